"""tandem's configurations under load on a shared machine: every server up at once, the loads in interleaved rounds.

    python bench/load_rounds.py --model T.gguf --draft D.gguf --configs tandem-plain,tandem-adaptive,tandem-fixed2 \
        --clients 8 --rounds 5 [--tandem-arg=--backend --tandem-arg=torch]

serve_load.py measures one configuration after another: on a 2-core machine shared with other work, the minutes
between them move every figure more than any difference it looks for. Here each configuration's server starts
first (serve_load's commands: --slots = the most clients), each answers a warm-up and, with --settle, finishes its
cost measurement before anything is timed (tandem measures while idle; a load would otherwise meet it); then each
round runs every load on every server in turn, rotating the order a round. The table gives each configuration's
median tok/s, the spread of its rounds and its ratio to the first configuration's in the same rounds, its TTFT p99
over p50 (the median of the rounds') and the draft tokens a generated token; greedy, EOS ignored as tandem loadtest
sends them. A second table says where each server's steps went over its loads (its /metrics before and after each:
tandem_step_part_seconds), the mean ms a step of each engine part and of the worker's time between steps. --json
keeps every round's figures, those sums and each server's seconds to ready.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict

import httpx
from prometheus_client.parser import text_string_to_metric_families
from serve_load import ServerProcess, commit, hardware, known, needs_draft, server_command, warm_up

from tandem.bench.llamaserver import free_port
from tandem.bench.load import PROMPTS, run_load
from tandem.server.metrics import ENGINE_PARTS, WORKER_PARTS

STEP_SAMPLES = ("tandem_engine_step_seconds_count", "tandem_engine_step_seconds_sum",
                "tandem_engine_step_cpu_seconds_sum", "tandem_batch_size_sum", "tandem_draft_prefill_chunks_total")


def settled(url: str) -> bool:
    """Whether the server plans from costs it measured (or has none to measure): no timing left to meet a load."""
    costs = httpx.get(url + "/health", timeout=5).json().get("costs")
    return costs is None or ("measuring" not in costs and not str(costs.get("source", "")).startswith("estimate"))


def step_sums(url: str) -> dict[str, float]:
    """A server's step clock now: each part's seconds and count (`part_sum`, `part_count`), its steps' count and wall
    time, the sequences they ran and the draft's prompt chunks (cumulative: a load's are the difference)."""
    sums = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name.startswith("tandem_step_part_seconds_"):
                sums[f"{sample.labels['part']}_{sample.name.rsplit('_', 1)[1]}"] = sample.value
            elif sample.name in STEP_SAMPLES:
                sums[sample.name] = sample.value
    return sums


def step_line(sums: dict[str, float]) -> str:
    """The mean ms a step of each part (between steps: a gap), from the sums over some loads."""
    def ms(part: str) -> float:
        return 1000.0 * sums.get(f"{part}_sum", 0.0) / max(1.0, sums.get(f"{part}_count", 0.0))

    steps = sums.get("tandem_engine_step_seconds_count", 0.0)
    step, cpu = (1000.0 * sums.get(f"tandem_engine_step{s}_seconds_sum", 0.0) / max(1.0, steps) for s in ("", "_cpu"))
    batch = sums.get("tandem_batch_size_sum", 0.0) / max(1.0, steps)
    engine = " ".join(f"{ms(p):8.3f}" for p in ENGINE_PARTS)
    worker = " ".join(f"{ms(p):8.3f}" for p in WORKER_PARTS)
    return (f"{steps:6.0f} {batch:5.1f} {step:7.3f} {cpu:7.3f} | {engine} | {worker} | "
            f"{sums.get('tandem_draft_prefill_chunks_total', 0.0):5.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--draft", default=None)
    p.add_argument("--configs", default="tandem-plain,tandem-adaptive", help="tandem configs (serve_load's names)")
    p.add_argument("--clients", default="8", help="comma list of concurrencies")
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--tandem-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--settle", type=float, default=300.0,
                   help="seconds each server may take to finish measuring its costs before the rounds [300; 0: none]")
    p.add_argument("--start-timeout", type=float, default=480.0)
    p.add_argument("--logs", default=None)
    p.add_argument("--json", default=None, help="write every round's figures here")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    clients = [int(c) for c in args.clients.split(",")]
    if not names or any(not known(n) or not n.startswith("tandem") for n in names):
        p.error(f"tandem configs only, as serve_load.py names them: {names}")
    if any(needs_draft(n) for n in names) and not args.draft:
        p.error("a config with a draft needs --draft")
    args.logs = args.logs or tempfile.mkdtemp(prefix="load-rounds-")
    os.makedirs(args.logs, exist_ok=True)

    servers: dict[str, ServerProcess] = {}
    ready_s: dict[str, float] = {}
    launched = time.monotonic()
    try:
        for name in names:
            port = free_port()
            servers[name] = ServerProcess(server_command(name, args, port, max(clients)), port,
                                          os.path.join(args.logs, f"{name}.log"))
        deadline = launched + args.start_timeout
        while not all(s.ready_at or s.is_ready() for s in servers.values()):  # each one's first 200, all polled
            if time.monotonic() > deadline:
                raise RuntimeError(f"not every server answered 200 within {args.start_timeout:.0f} s")
            time.sleep(0.5)
        for name, server in servers.items():
            ready_s[name] = round(server.ready_at - launched, 1)
            asyncio.run(warm_up(server.url))
        deadline = time.monotonic() + args.settle
        while args.settle and not all(settled(s.url) for s in servers.values()) and time.monotonic() < deadline:
            time.sleep(1.0)
        print(f"servers ready (logs in {args.logs}); costs: "
              + ", ".join(f"{n} {httpx.get(s.url + '/health').json().get('costs', {}).get('source', '-')}"
                          for n, s in servers.items()), flush=True)
        runs: dict[tuple[str, int], list] = {(n, c): [] for n in names for c in clients}
        steps: dict[tuple[str, int], dict[str, float]] = {(n, c): {} for n in names for c in clients}
        for r in range(args.rounds):
            turn = names[r % len(names):] + names[: r % len(names)]  # each config goes first in turn
            for c in clients:
                for name in turn:
                    before = step_sums(servers[name].url)
                    report = asyncio.run(run_load(servers[name].url, c, c * args.requests_per_client,
                                                  args.max_tokens, list(PROMPTS)))
                    for key, value in step_sums(servers[name].url).items():
                        steps[name, c][key] = steps[name, c].get(key, 0.0) + value - before.get(key, 0.0)
                    if report.failed:
                        raise RuntimeError(f"{name}: {report.failed} requests failed\n{servers[name].tail()}")
                    runs[name, c].append(report)
            print(f"round {r + 1}: " + "  ".join(f"{n}@{c} {runs[n, c][-1].output_tokens_per_s:.0f}"
                                                 for c in clients for n in names), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"hardware": hardware(), "commit": commit(), "args": vars(args), "ready_s": ready_s,
                       "runs": {f"{n}@{c}": [asdict(r) for r in reports] for (n, c), reports in runs.items()},
                       "steps": {f"{n}@{c}": sums for (n, c), sums in steps.items()}},
                      f, indent=1)
    print("ready after (s, all launched at once): " + ", ".join(f"{n} {s}" for n, s in ready_s.items()))
    base = names[0]
    print(f"\nmedian tok/s of {args.rounds} interleaved rounds (min-max), the ratio to {base} round by round "
          "(median), TTFT p99/p50 (median) and draft tokens a generated token")
    for c in clients:
        for name in names:
            reports = runs[name, c]
            tok_s = [r.output_tokens_per_s for r in reports]
            ratios = [r.output_tokens_per_s / b.output_tokens_per_s for r, b in zip(reports, runs[base, c],
                                                                                   strict=True)]
            spread = statistics.median(r.ttft_p99_s / r.ttft_p50_s for r in reports if r.ttft_p50_s > 0)
            drafted = sum(r.draft_n for r in reports) / max(1.0, sum(r.mean_completion_tokens * r.ok for r in reports))
            print(f"{c:>3} clients  {name:<18} {statistics.median(tok_s):9.1f}  ({min(tok_s):.0f}-{max(tok_s):.0f})"
                  f"  x{statistics.median(ratios):.3f}  TTFT p99/p50 {spread:5.2f}  drafted {drafted:.2f}")
    print("\nwhere the steps went, all rounds: steps, sequences a step, mean ms a step (engine.step's wall, the "
          "worker's CPU in it) | of its parts | between steps (a gap's) | the draft's prompt chunks")
    print(f"{'':>30} {'steps':>6} {'batch':>5} {'step':>7} {'cpu':>7} | "
          + " ".join(f"{p[:8]:>8}" for p in ENGINE_PARTS) + " | "
          + " ".join(f"{p[:8]:>8}" for p in WORKER_PARTS) + " | prefl")
    for c in clients:
        for name in names:
            print(f"{c:>3} clients  {name:<18} {step_line(steps[name, c])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
