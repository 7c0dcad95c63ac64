"""tandem's configurations under load on a shared machine: every server up at once, the loads in interleaved rounds.

    python bench/load_rounds.py --model T.gguf --draft D.gguf --configs tandem-plain,tandem-adaptive,tandem-fixed2 \
        --clients 8 --rounds 5 [--tandem-arg=--backend --tandem-arg=torch]

serve_load.py measures one configuration after another: on a 2-core machine shared with other work, the minutes
between them move every figure more than any difference it looks for. Here each configuration's server starts
first (serve_load's commands: --slots = the most clients), each answers a warm-up and, with --settle, finishes its
cost measurement before anything is timed (tandem measures while idle; a load would otherwise meet it); then each
round runs every load on every server in turn, rotating the order a round. The table gives each configuration's
median tok/s, the spread of its rounds and its ratio to the first configuration's in the same rounds; greedy, EOS
ignored as tandem loadtest sends them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import httpx
from serve_load import ServerProcess, known, needs_draft, server_command, warm_up

from tandem.bench.llamaserver import free_port
from tandem.bench.load import PROMPTS, run_load


def settled(url: str) -> bool:
    """Whether the server plans from costs it measured (or has none to measure): no timing left to meet a load."""
    costs = httpx.get(url + "/health", timeout=5).json().get("costs")
    return costs is None or ("measuring" not in costs and not str(costs.get("source", "")).startswith("estimate"))


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
    try:
        for name in names:
            port = free_port()
            servers[name] = ServerProcess(server_command(name, args, port, max(clients)), port,
                                          os.path.join(args.logs, f"{name}.log"))
        for server in servers.values():
            server.wait_ready(args.start_timeout)
            asyncio.run(warm_up(server.url))
        deadline = time.monotonic() + args.settle
        while args.settle and not all(settled(s.url) for s in servers.values()) and time.monotonic() < deadline:
            time.sleep(1.0)
        print(f"servers ready (logs in {args.logs}); costs: "
              + ", ".join(f"{n} {httpx.get(s.url + '/health').json().get('costs', {}).get('source', '-')}"
                          for n, s in servers.items()), flush=True)
        tps: dict[tuple[str, int], list[float]] = {(n, c): [] for n in names for c in clients}
        for r in range(args.rounds):
            turn = names[r % len(names):] + names[: r % len(names)]  # each config goes first in turn
            for c in clients:
                for name in turn:
                    report = asyncio.run(run_load(servers[name].url, c, c * args.requests_per_client,
                                                  args.max_tokens, list(PROMPTS)))
                    if report.failed:
                        raise RuntimeError(f"{name}: {report.failed} requests failed\n{servers[name].tail()}")
                    tps[name, c].append(report.output_tokens_per_s)
            print(f"round {r + 1}: " + "  ".join(f"{n}@{c} {tps[n, c][-1]:.0f}" for c in clients for n in names),
                  flush=True)
    finally:
        for server in servers.values():
            server.stop()

    base = names[0]
    print(f"\nmedian tok/s of {args.rounds} interleaved rounds (min-max), and the ratio to {base} round by round "
          "(median)")
    for c in clients:
        for name in names:
            runs = tps[name, c]
            ratios = [a / b for a, b in zip(runs, tps[base, c], strict=True)]
            print(f"{c:>3} clients  {name:<18} {statistics.median(runs):9.1f}  ({min(runs):.0f}-{max(runs):.0f})"
                  f"  x{statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
