"""Servers under load, side by side (issues 22 and 52): tandem plain, adaptive and with the draft at a fixed K,
llama-server plain and with the draft, at each client count; then a 10-turn conversation on each.

    python bench/serve_load.py --model T.gguf --draft D.gguf --device cuda --clients 1,4,16,64 \
        --configs tandem-plain,tandem-adaptive,tandem-fixed2,llama-plain,llama-draft \
        --llama-server /path/to/llama-server --ngl 99 --json OUT.json [--with EARLIER.json]

Configurations: tandem-plain (--no-draft), tandem-adaptive (the draft, --draft-policy adaptive), tandem-draft (the same
with --no-prompt-lookup: the draft model's presence and drafting alone), tandem-fixedK for any
K >= 1 (the draft, --draft-policy fixed --draft-max K: K draft tokens every iteration, whatever the load),
llama-plain, llama-draft (-md, draft-simple, --llama-draft-max tokens).

Each configuration runs as a subprocess on a free loopback port, measured once /health answers 200 (both servers
answer 503 while loading). tandem starts once with --slots = the most clients and serves every load, as a deployed
server would; llama-server restarts for each load with -np = the clients (its slots are fixed at start) and a context
of --slot-ctx tokens a slot. Each load is `tandem loadtest`'s client (tandem.bench.load.run_load): clients x
--requests-per-client streamed chat completions, greedy. The conversation runs on a server's first start: each turn
sends the whole chat so far plus a new user message, and records its time to first token and the prompt tokens the
server says it reused (tandem: usage.prompt_tokens_details.cached_tokens and timings.cache_n; llama-server:
timings.cache_n); --no-conversation skips it. The table gives each configuration's tok/s over tandem-plain's at
every client count. The JSON is rewritten after every measurement, so a run cut off keeps what it measured; --with
adds the configurations of an earlier run's JSON to the table (e.g. llama-server, or some of tandem's configurations,
measured in a second call).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import httpx

from tandem.bench.llamaserver import free_port
from tandem.bench.load import PROMPTS, LoadReport, one_request, run_load

CONFIGS = ("tandem-plain", "tandem-adaptive", "tandem-draft", "llama-plain", "llama-draft")
FIXED = "tandem-fixed"  # tandem-fixedK: the draft at a fixed K tokens an iteration (any K >= 1)
# A coding chat whose turns build on each other, as a user's would.
TURNS = (
    "Write a Python function that splits one CSV line into fields, honouring double-quoted fields.",
    "Add type hints and a docstring to it.",
    "Make it handle escaped quotes (two double quotes) inside quoted fields.",
    "Write three pytest tests for it.",
    "What is its time complexity? Answer in one sentence.",
    "Rewrite it as a generator over the lines of a file.",
    "Add a parameter for the delimiter.",
    "Show how to sum the second column of a file with it.",
    "Which edge cases does it still not handle?",
    "Summarize the final function's behaviour in three bullet points.",
)


@dataclass
class Turn:
    ttft_s: float | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens (tandem; OpenAI's field)
    cache_n: int | None  # timings.cache_n (tandem and llama-server)
    error: str | None = None
    prompt_ms: float | None = None  # timings.prompt_ms: the server's own time for the prompt


@dataclass
class ConfigResult:
    name: str
    started: str  # how the server was run for the loads, in words
    commands: list[list[str]] = field(default_factory=list)
    loads: dict[str, dict] = field(default_factory=dict)  # clients -> LoadReport as a dict
    conversation: list[dict] = field(default_factory=list)  # Turn as dicts
    errors: list[str] = field(default_factory=list)  # servers that failed to start, with their stderr's tail
    health_rtt_ms: list[float] = field(default_factory=list)  # a start's GET /health on one kept-alive connection
    ready_s: list[float] = field(default_factory=list)  # each start's seconds from launch to /health's first 200


def fixed_k(name: str) -> int | None:
    """K of a tandem-fixedK configuration (K >= 1), else None."""
    k = name[len(FIXED):]
    return int(k) if name.startswith(FIXED) and k.isdigit() and int(k) >= 1 else None


def known(name: str) -> bool:
    return name in CONFIGS or fixed_k(name) is not None


def needs_draft(name: str) -> bool:
    return name in ("tandem-adaptive", "tandem-draft", "llama-draft") or fixed_k(name) is not None


def order(names) -> list[str]:
    """Table order: tandem-plain, tandem-adaptive, tandem-fixedK by K, llama-plain, llama-draft, then any others."""
    rank = {"tandem-plain": 0, "tandem-adaptive": 1, "tandem-draft": 1.5, "llama-plain": 3, "llama-draft": 4}

    def key(name: str) -> tuple[float, int]:
        k = fixed_k(name)
        return (2, k) if k is not None else (rank.get(name, 5), 0)
    return sorted(names, key=key)


class ServerProcess:
    """A server subprocess on 127.0.0.1:port, stderr to a log file (a pipe nobody reads would fill and stall it)."""

    def __init__(self, argv: list[str], port: int, log_path: str) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.ready_at: float | None = None  # time.monotonic() of the first 200 (is_ready)
        self.log = open(log_path, "w")
        try:
            self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError:
            self.log.close()
            raise

    def is_ready(self) -> bool:
        """Whether /health answers 200 (the time it first did: ready_at); an error if the server exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"exited with status {self.proc.returncode}")
        try:
            ok = httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
        if ok and self.ready_at is None:
            self.ready_at = time.monotonic()
        return ok

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.is_ready():
                return
            time.sleep(0.5)
        raise RuntimeError(f"/health did not answer 200 within {timeout_s:.0f} s")

    def tail(self, n_chars: int = 3000) -> str:
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n_chars:]

    def stop(self) -> None:
        """SIGTERM (tandem drains the streams in flight, if a run was cut off), then SIGKILL after 15 s."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.log.close()


def server_command(name: str, args: argparse.Namespace, port: int, clients: int) -> list[str]:
    """argv of one configuration; clients: the slots it must serve at once."""
    address = ["--host", "127.0.0.1", "--port", str(port)]
    if name.startswith("tandem"):
        k = fixed_k(name)
        draft = (["--no-draft"] if name == "tandem-plain" else
                 ["--draft", args.draft, "--draft-policy", "adaptive"] if name == "tandem-adaptive" else
                 ["--draft", args.draft, "--draft-policy", "adaptive", "--no-prompt-lookup"] if k is None else
                 ["--draft", args.draft, "--draft-policy", "fixed", "--draft-max", str(k)])
        return [sys.executable, "-m", "tandem.cli", "serve", "--model", args.model, *draft, "--device", args.device,
                "--slots", str(clients), "--max-queue", str(max(64, clients)), *address, *args.tandem_arg]
    draft = ["-md", args.draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(args.llama_draft_max),
             "--spec-draft-ngl", str(args.ngl)] if name == "llama-draft" else []
    return [args.llama_server, "-m", args.model, "-np", str(clients), "-c", str(args.slot_ctx * clients),
            "-ngl", str(args.ngl), "--no-webui", *draft, *address, *args.llama_arg]


def health_rtt_ms(url: str, n: int = 5) -> float:
    """Median GET /health round trip on one kept-alive connection, as the load's clients reuse theirs: a server whose
    sockets lack TCP_NODELAY shows ~40 ms here (Nagle's algorithm against delayed ACKs), added to every TTFT."""
    times = []
    with httpx.Client() as client:
        client.get(url + "/health")
        for _ in range(n):
            started = time.perf_counter()
            client.get(url + "/health")
            times.append(1000 * (time.perf_counter() - started))
    return sorted(times)[n // 2]


async def warm_up(url: str) -> None:
    """One short request before measuring: first-request work (allocations, lazy inits) stays out of the loads."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        await one_request(client, url, model, "warm-up", "Say hello.", 8, 0.0)


async def conversation(url: str, turns: int, max_tokens: int, opening: str = "", think_s: float = 0.0
                       ) -> list[Turn]:
    """A chat of `turns` turns, each sending the whole chat so far: its TTFT and the prompt tokens reused. opening
    goes before the first message (a chat no server has seen); think_s: the pause between a reply and the next turn
    (a user reading it)."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        messages: list[dict] = []
        out = []
        for i in range(turns):
            if i and think_s:
                await asyncio.sleep(think_s)
            messages.append({"role": "user", "content": (opening if i == 0 else "") + TURNS[i % len(TURNS)]})
            r = await one_request(client, url, model, "chat", list(messages), max_tokens, 0.0)
            out.append(Turn(r.ttft_s, r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.cache_n, r.error,
                            r.prompt_ms))
            messages.append({"role": "assistant", "content": r.text})
        return out


def run_config(name: str, args: argparse.Namespace, clients: list[int],
               on_change: Callable[[ConfigResult], None]) -> ConfigResult:
    """Every load (and the conversation) on one configuration; on_change(result) after each measurement."""
    per_load = name.startswith("llama")
    result = ConfigResult(name, f"restarted for each load with -np = clients, -c = {args.slot_ctx} x clients"
                          if per_load else f"started once with --slots {max(clients)} for every load")
    runs = [[c] for c in clients] if per_load else [clients]
    for i, loads in enumerate(runs):
        port = free_port()
        argv = server_command(name, args, port, loads[0] if per_load else max(clients))
        result.commands.append(argv)
        log_path = os.path.join(args.logs, f"{name}-{loads[0] if per_load else 'all'}.log")
        server = None
        try:
            launched = time.monotonic()
            server = ServerProcess(argv, port, log_path)
            server.wait_ready(args.start_timeout)
            result.ready_s.append(round(time.monotonic() - launched, 1))
            result.health_rtt_ms.append(round(health_rtt_ms(server.url), 2))
            print(f"  {name}: ready after {result.ready_s[-1]} s; GET /health on a kept-alive connection "
                  f"{result.health_rtt_ms[-1]} ms", flush=True)
            asyncio.run(warm_up(server.url))
            for c in loads:
                report: LoadReport = asyncio.run(run_load(server.url, c, c * args.requests_per_client,
                                                          args.max_tokens, list(PROMPTS)))
                result.loads[str(c)] = asdict(report)
                print(f"  {name} {c:>3} clients: {report.output_tokens_per_s:8.1f} tok/s, TTFT p50/p99 "
                      f"{report.ttft_p50_s:.3f}/{report.ttft_p99_s:.3f} s, {report.ok} ok / {report.failed} failed",
                      flush=True)
                on_change(result)
            if i == 0 and args.turns:
                turns = asyncio.run(conversation(server.url, args.turns, args.turn_max_tokens or args.max_tokens))
                result.conversation = [asdict(t) for t in turns]
                print(f"  {name} conversation TTFT (s): "
                      + " ".join(f"{t.ttft_s:.3f}" if t.ttft_s else "-" for t in turns)
                      + " | reused: " + " ".join(str(reused(asdict(t))) for t in turns), flush=True)
                on_change(result)
        except Exception as e:  # noqa: BLE001  (a server that fails is reported; the others still run)
            tail = server.tail() if server else ""
            result.errors.append(f"{' '.join(argv)}: {type(e).__name__}: {e}\n{tail}")
            print(f"  {name}: FAILED ({type(e).__name__}: {e}); its log's tail:\n{tail}", flush=True)
            on_change(result)
        finally:
            if server:
                server.stop()
    return result


def reused(turn: dict) -> int | None:
    """The prompt tokens a turn reused, in whichever field its server reported them."""
    return turn["cached_tokens"] if turn.get("cached_tokens") is not None else turn.get("cache_n")


def hardware() -> str:
    """The GPU's name where nvidia-smi answers, else the CPU's model and cores."""
    if shutil.which("nvidia-smi"):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip().splitlines()
        if out:
            return f"{len(out)} x {out[0]}" if len(out) > 1 else out[0]
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{model} ({os.cpu_count()} cores)"


def commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def tps(results: dict, name: str, clients: int) -> float | None:
    load = results.get(name, {}).get("loads", {}).get(str(clients))
    return load["output_tokens_per_s"] if load and load["ok"] else None


def best_llama(results: dict, clients: int) -> float | None:
    """The faster llama-server configuration's tok/s (the goals compare with the better of the two)."""
    values = [v for v in (tps(results, "llama-plain", clients), tps(results, "llama-draft", clients)) if v]
    return max(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ttft_spread(results: dict, name: str, clients: int) -> float | None:
    load = results.get(name, {}).get("loads", {}).get(str(clients))
    return ratio(load["ttft_p99_s"], load["ttft_p50_s"]) if load else None


def turn_ratio(conv: list[dict]) -> float | None:
    """Last turn's TTFT over the first's."""
    return ratio(conv[-1]["ttft_s"], conv[0]["ttft_s"]) if len(conv) > 1 else None


def short(name: str) -> str:
    """A column's name for a configuration: tandem's without "tandem-"."""
    return name.removeprefix("tandem-")


def table(results: dict, clients: list[int]) -> str:
    """Tokens/s per configuration and the issues' ratios, a row per client count (each configuration over tandem-plain;
    columns with no value at any load left out); TTFT spread; draft acceptance; the conversation."""
    names = order(results)
    first = min(clients)

    ratios = {f"{short(n)}/plain": (lambda c, n=n: ratio(tps(results, n, c), tps(results, "tandem-plain", c)))
              for n in names if n != "tandem-plain"}
    ratios |= {
        "adapt/best-llama": lambda c: ratio(tps(results, "tandem-adaptive", c), best_llama(results, c)),
        f"plain x/{first}c": lambda c: ratio(tps(results, "tandem-plain", c), tps(results, "tandem-plain", first)),
        f"adapt x/{first}c": lambda c: ratio(tps(results, "tandem-adaptive", c),
                                             tps(results, "tandem-adaptive", first)),
    }
    ratios = {head: f for head, f in ratios.items() if any(f(c) is not None for c in clients)}

    def cell(value: float | None, fmt: str) -> str:
        return format(value, fmt) if value is not None else "-"

    head = ["clients"] + [f"{n} tok/s" for n in names] + list(ratios)
    rows = [[str(c)] + [cell(tps(results, n, c), ".1f") for n in names] + [cell(f(c), ".2f")
                                                                          for f in ratios.values()] for c in clients]
    lines = [" | ".join(head), " | ".join("---" for _ in head)] + [" | ".join(r) for r in rows]
    lines += ["", "TTFT p99/p50 (p50 s): " + ", ".join(names)]
    for c in clients:
        spreads = []
        for n in names:
            load = results[n].get("loads", {}).get(str(c))
            spreads.append(f"{cell(ttft_spread(results, n, c), '.2f')} ({load['ttft_p50_s']:.3f})" if load else "-")
        lines.append(f"{c:>4} clients: " + " | ".join(spreads))
    drafting = [n for n in names if needs_draft(n)]
    if drafting:
        lines += ["", "draft acceptance (tokens drafted a token generated): " + ", ".join(drafting)]
        for c in clients:
            cells = []
            for n in drafting:
                load = results[n].get("loads", {}).get(str(c))
                if load:
                    per_token = ratio(load["draft_n"], load["mean_completion_tokens"] * load["ok"])
                    cells.append(f"{cell(load['acceptance_rate'], '.2f')} ({cell(per_token, '.2f')})")
                else:
                    cells.append("-")
            lines.append(f"{c:>4} clients: " + " | ".join(cells))
    lines += ["", "conversation: turn TTFTs (s), prompt tokens reused, last/first TTFT"]
    for n in names:
        conv = results[n].get("conversation") or []
        if conv:
            lines.append(f"{n}: " + " ".join(cell(t["ttft_s"], ".3f") for t in conv) + " | reused "
                         + " ".join(cell(reused(t), "d") for t in conv) + f" | {cell(turn_ratio(conv), '.2f')}")
    lines += [f"({n}: {results[n]['started']}; ready after, s: {results[n].get('ready_s')}; GET /health kept alive, "
              f"ms: {results[n].get('health_rtt_ms')})" for n in names if results[n].get("started")]
    return "\n".join(lines)


def goals(results: dict) -> list[dict]:
    """Issues 22's and 52's goals that this run's numbers can decide: {goal, value, met}."""
    out = []

    def check(goal: str, value: float | None, met: bool) -> None:
        if value is not None:
            out.append({"goal": goal, "value": round(value, 3), "met": met})

    for name in ("tandem-plain", "tandem-adaptive"):
        if name not in results:
            continue
        scale = ratio(tps(results, name, 16), tps(results, name, 1))
        check(f"{name}: 16 clients >= 8x its 1-client tok/s", scale, scale is not None and scale >= 8)
        for c in (16, 64):
            r = ratio(tps(results, name, c), best_llama(results, c))
            check(f"{name}: {c} clients >= 3x the best llama-server", r, r is not None and r >= 3)
        spread = ttft_spread(results, name, 16)
        check(f"{name}: 16 clients TTFT p99 <= 2x p50", spread, spread is not None and spread <= 2)
        turns = turn_ratio(results[name].get("conversation") or [])
        check(f"{name}: conversation last-turn TTFT <= 1.2x the first's", turns, turns is not None and turns <= 1.2)
    loads = sorted({int(c) for c in results.get("tandem-adaptive", {}).get("loads", {})})
    for c in loads:
        r = ratio(tps(results, "tandem-adaptive", c), tps(results, "tandem-plain", c))
        check(f"tandem-adaptive >= 0.97x tandem-plain at {c} clients", r, r is not None and r >= 0.97)
    fixed = [n for n in order(results) if fixed_k(n) is not None]
    for c in loads if fixed else []:  # issue 52: never below the better of plain and the best fixed K at a load
        best = max((v for v in (tps(results, n, c) for n in ["tandem-plain", *fixed]) if v), default=None)
        r = ratio(tps(results, "tandem-adaptive", c), best)
        check(f"tandem-adaptive >= 0.97x the best of tandem-plain and {', '.join(fixed)} at {c} clients", r,
              r is not None and r >= 0.97)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="target GGUF (both servers)")
    p.add_argument("--draft", default=None, help="draft GGUF (tandem-adaptive, llama-draft)")
    p.add_argument("--configs", default="tandem-plain,tandem-adaptive",
                   help=f"comma list of {', '.join(CONFIGS)}, {FIXED}K (K >= 1)")
    p.add_argument("--clients", default="1,4,16,64", help="comma list of concurrencies")
    p.add_argument("--requests-per-client", type=int, default=4, help="requests = this x clients [4]")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--turns", type=int, default=10, help="conversation turns; 0: no conversation [10]")
    p.add_argument("--no-conversation", dest="turns", action="store_const", const=0, help="as --turns 0")
    p.add_argument("--turn-max-tokens", type=int, default=None, help="max_tokens a turn [--max-tokens]")
    p.add_argument("--device", default="cpu", help="tandem's --device")
    p.add_argument("--tandem-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for tandem serve (repeatable; use --tandem-arg=--flag)")
    p.add_argument("--llama-server", default=None, help="llama-server binary (llama-* configs)")
    p.add_argument("--ngl", type=int, default=0, help="llama-server's GPU layers, target and draft (99: all)")
    p.add_argument("--slot-ctx", type=int, default=4096, help="llama-server's context a slot [4096]")
    p.add_argument("--llama-draft-max", type=int, default=3,
                   help="llama-draft's --spec-draft-n-max [3: its best with the default pair on the H200]")
    p.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for llama-server (repeatable; use --llama-arg=--flag)")
    p.add_argument("--start-timeout", type=float, default=480.0, help="seconds a server may take to be ready")
    p.add_argument("--logs", default=None, help="folder for the servers' logs [a temporary one]")
    p.add_argument("--json", default=None, help="write everything here (rewritten after each measurement)")
    p.add_argument("--with", dest="merge", action="append", default=[], metavar="JSON",
                   help="an earlier run's JSON whose configurations join this table (repeatable)")
    args = p.parse_args(argv)

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    clients = [int(c) for c in args.clients.split(",")]
    unknown = [n for n in names if not known(n)]
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}, {FIXED}K (K >= 1)")
    if any(n.startswith("llama") for n in names) and not args.llama_server:
        p.error("llama-* configs need --llama-server")
    if any(needs_draft(n) for n in names) and not args.draft:
        p.error(f"tandem-adaptive, {FIXED}K and llama-draft need --draft")
    args.logs = args.logs or tempfile.mkdtemp(prefix="serve-load-")
    os.makedirs(args.logs, exist_ok=True)

    results: dict[str, dict] = {}
    for path in args.merge:
        with open(path) as f:
            results.update(json.load(f)["configs"])
    report = {"hardware": hardware(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "commit": commit(), "model": args.model, "draft": args.draft, "device": args.device,
              "max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client, "clients": clients,
              "merged_from": args.merge, "configs": results}

    def save() -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=1)

    print(f"{report['hardware']}, commit {report['commit']}; logs in {args.logs}", flush=True)
    def update(result: ConfigResult) -> None:
        results[result.name] = asdict(result)
        save()

    # A SIGTERM (a `timeout` around this command) unwinds like Ctrl-C: servers stopped, the table of what was measured.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for name in names:
            update(run_config(name, args, clients, update))
    except KeyboardInterrupt:
        print("interrupted: the table has what was measured", flush=True)
    all_clients = sorted({int(c) for r in results.values() for c in r.get("loads", {})} | set(clients))
    report["goals"] = goals(results)
    save()
    print()
    print(table(results, all_clients))
    for g in report["goals"]:
        print(f"goal {'met' if g['met'] else 'NOT met'}: {g['goal']} ({g['value']:.2f})")
    return 0 if all(not r.get("errors") for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
