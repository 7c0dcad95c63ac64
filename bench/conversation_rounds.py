"""serve_load.py's 10-turn conversation on several servers, rounds interleaved (issue 47's CPU goal): each server is
started once with one slot and warmed up, then every round runs a fresh conversation (an opening no server has seen)
on each server in turn, so a busy shared machine slows all of them alike. Prints each turn's median TTFT per server,
each tandem configuration's per-turn TTFT over llama-plain's (the median over rounds of a round's ratio), and the
servers' own prompt times (timings.prompt_ms) and reused tokens. A tandem configuration named NAME@PATH runs the
tandem of the checkout at PATH (PYTHONPATH), e.g. the same configuration before a change.

    python bench/conversation_rounds.py --model T.gguf --configs tandem-plain,tandem-plain@/other/tree,llama-plain \
        --llama-server llama-server --rounds 4 --turn-max-tokens 16 [--think-s 2] --json OUT.json

--think-s pauses between a reply and the next turn, as a user reading it would; the servers then take the
conversation's turns in turn (lockstep). 0: back to back, each server's whole conversation in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import asdict

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import (  # noqa: E402  (bench/, this script's directory)
    TURNS,
    ServerProcess,
    Turn,
    commit,
    conversation,
    hardware,
    known,
    needs_draft,
    reused,
    server_command,
    warm_up,
)

from tandem.bench.llamaserver import free_port  # noqa: E402
from tandem.bench.load import one_request  # noqa: E402


async def lockstep(urls: dict[str, str], turns: int, max_tokens: int, opening: str, think_s: float
                   ) -> dict[str, list[Turn]]:
    """One conversation on each server, turn by turn in turn (a busy machine's changing load falls on every server's
    same turn alike); a server's next turn goes out think_s after its reply at the earliest."""
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        models = {n: (await client.get(f"{url}/v1/models")).json()["data"][0]["id"] for n, url in urls.items()}
        messages: dict[str, list[dict]] = {n: [] for n in urls}
        out: dict[str, list[Turn]] = {n: [] for n in urls}
        ended = dict.fromkeys(urls, 0.0)
        for i in range(turns):
            for n, url in urls.items():
                await asyncio.sleep(max(0.0, ended[n] + think_s - time.monotonic()))
                messages[n].append({"role": "user", "content": (opening if i == 0 else "") + TURNS[i % len(TURNS)]})
                r = await one_request(client, url, models[n], "chat", list(messages[n]), max_tokens, 0.0)
                ended[n] = time.monotonic()
                out[n].append(Turn(r.ttft_s, r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.cache_n,
                                   r.error, r.prompt_ms))
                messages[n].append({"role": "assistant", "content": r.text})
        return out


def median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def cell(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else "-"


def summary(rounds: dict[str, list[list[dict]]], base: str | None) -> str:
    """Per server: each turn's median TTFT, prompt_ms and reuse over the rounds; per tandem server: each turn's
    median ratio to `base` (the same round's turn)."""
    lines = []
    for name, convs in rounds.items():
        if not convs:
            continue
        turns = len(convs[0])
        ttft = [median([c[i]["ttft_s"] for c in convs if i < len(c)]) for i in range(turns)]
        prompt_ms = [median([c[i].get("prompt_ms") for c in convs if i < len(c)]) for i in range(turns)]
        lines.append(f"{name} TTFT s (median of {len(convs)}): " + " ".join(cell(t, ".3f") for t in ttft))
        lines.append(f"{name} prompt_ms: " + " ".join(cell(t, ".0f") for t in prompt_ms))
        lines.append(f"{name} reused | new: " + " ".join(f"{reused(t)}|{t['prompt_tokens'] - (reused(t) or 0)}"
                                                          for t in convs[-1]))
        if base and name != base and rounds.get(base):
            ratios = [median([c[i]["ttft_s"] / b[i]["ttft_s"] for c, b in zip(convs, rounds[base], strict=False)
                              if i < len(c) and i < len(b) and c[i]["ttft_s"] and b[i]["ttft_s"]])
                      for i in range(turns)]
            lines.append(f"{name} / {base} TTFT: " + " ".join(cell(r, ".2f") for r in ratios)
                         + f" (turns 2-{turns} median {cell(median(ratios[1:]), '.2f')})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="target GGUF (every server)")
    p.add_argument("--draft", default=None, help="draft GGUF (tandem-adaptive, llama-draft)")
    p.add_argument("--configs", default="tandem-plain,llama-plain", help="comma list, as serve_load.py's")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--turn-max-tokens", type=int, default=16)
    p.add_argument("--think-s", type=float, default=0.0, help="pause before each turn after the first [0]")
    p.add_argument("--device", default="cpu", help="tandem's --device")
    p.add_argument("--tandem-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--llama-server", default=None)
    p.add_argument("--llama-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--ngl", type=int, default=0)
    p.add_argument("--slot-ctx", type=int, default=4096)
    p.add_argument("--llama-draft-max", type=int, default=3)
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if unknown := [n for n in names if not known(n.partition("@")[0])]:
        p.error(f"unknown configs {unknown}")
    if any(n.startswith("llama") for n in names) and not args.llama_server:
        p.error("llama-* configs need --llama-server")
    if any(needs_draft(n.partition("@")[0]) for n in names) and not args.draft:
        p.error("tandem-adaptive, tandem-fixedK and llama-draft need --draft")
    logs = tempfile.mkdtemp(prefix="conversation-rounds-")
    base = "llama-plain" if "llama-plain" in names else None
    rounds: dict[str, list[list[dict]]] = {n: [] for n in names}
    report = {"hardware": hardware(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "commit": commit(), "model": args.model, "draft": args.draft, "think_s": args.think_s,
              "turn_max_tokens": args.turn_max_tokens, "commands": {}, "rounds": rounds}
    print(f"{report['hardware']}, commit {report['commit']}; logs in {logs}", flush=True)
    servers: dict[str, ServerProcess] = {}
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for name in names:
            port = free_port()
            config, _, tree = name.partition("@")
            argv_ = server_command(config, args, port, 1)
            if tree:  # tandem as another checkout has it (e.g. before a change, side by side)
                argv_ = ["env", "-C", tree, f"PYTHONPATH={tree}", *argv_]
            report["commands"][name] = argv_
            launched = time.monotonic()
            servers[name] = ServerProcess(argv_, port, os.path.join(logs, name.replace("/", "_") + ".log"))
            servers[name].wait_ready(args.start_timeout)
            print(f"  {name}: ready after {time.monotonic() - launched:.1f} s", flush=True)
            asyncio.run(warm_up(servers[name].url))
        for r in range(args.rounds):
            opening = f"(chat {r} of {report['date']}) "
            if args.think_s:
                chats = asyncio.run(lockstep({n: s.url for n, s in servers.items()}, args.turns,
                                             args.turn_max_tokens, opening, args.think_s))
            else:
                chats = {n: asyncio.run(conversation(servers[n].url, args.turns, args.turn_max_tokens, opening))
                         for n in names}
            for name in names:
                rounds[name].append([asdict(t) for t in chats[name]])
                print(f"  round {r} {name}: " + " ".join(cell(t.ttft_s, ".3f") for t in chats[name]), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=1)
    except KeyboardInterrupt:
        print("interrupted: the summary has what was measured", flush=True)
    finally:
        for server in servers.values():
            server.stop()
    print()
    print(summary(rounds, base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
