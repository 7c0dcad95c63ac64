"""Plain decoding, tandem's llama.cpp backend against llama.cpp's own llama-server, back to back on one machine.

    python bench/plain_vs_llamaserver.py --server /path/to/llama-server [--model T.gguf] [--max-tokens 128]
        [--repeats 3] [--paths generate,engine,unrepacked]

Each round runs every prompt of the default suite through each tandem path and then through llama-server (greedy,
--max-tokens tokens, EOS ignored so every run decodes as many), in turn, so drift of a shared machine hits them
alike. Decode tokens/s: tandem's GenerationStats (tokens after the first / decode time), llama-server's own
`timings.predicted_per_second`; with --cpu-time, decoded tokens per CPU second of each process instead. Paths:
`generate` (tandem.generate: one request on its kept one-slot engine, what `tandem generate` runs), `engine` (an
Engine of one slot the script drives itself: the same loop without the API's per-call work), `unrepacked` (generate
with repack=False, the backend's previous default), `worker` (generate with llama.cpp in tandem's worker process,
which has no torch in it), `bare` (a bare greedy loop over a context of the generate path's weights and settings:
what tandem's per-token work costs). Prints per prompt the medians and each path's median ratio, over rounds, to
llama-server in the same round.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

import httpx
import numpy as np

import tandem
from tandem.bench.llamaserver import server_process
from tandem.bench.suite import load_suite
from tandem.engine import Engine, Request
from tandem.loading.registry import DEFAULT_TARGET


def server_decode_tps(base: str, messages: list[dict], max_tokens: int) -> float:
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "cache_prompt": False}
    reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=600).json()
    return reply["timings"]["predicted_per_second"]


def process_cpu_s(pid: int | str = "self") -> float:
    """CPU seconds (user + system, every thread) a process has used: with one thread a machine shared with other
    work barely moves it, where wall time follows the neighbours."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def decode_per_cpu_s(run, max_tokens: int, pid: int | str = "self") -> float:
    """Decoded tokens per CPU second: a max_tokens run's CPU time less a 1-token run's (the prompt alike)."""
    used = []
    for n in (1, max_tokens):
        before = process_cpu_s(pid)
        run(n)
        used.append(process_cpu_s(pid) - before)
    return (max_tokens - 1) / max(used[1] - used[0], 1e-9)


def bare_loop(context, ids: list[int], max_tokens: int, vocab: int) -> float:
    """Tokens/s after the first of a bare greedy loop on an empty llama.cpp context (tandem.backends.llamacpp_core's
    Context): llama_decode and numpy's argmax, the span llama-server's predicted_per_second times."""
    out = np.empty((1, vocab), dtype=np.float32)
    wanted = np.zeros(len(ids), dtype=np.int8)
    wanted[-1] = 1
    context.decode([0] * len(ids), ids, np.arange(len(ids), dtype=np.int32), wanted, out)
    started = time.perf_counter()
    for pos in range(len(ids), len(ids) + max_tokens - 1):
        context.decode([0], [int(out[0].argmax())], [pos], [1], out)
    return (max_tokens - 1) / (time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", required=True)
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--paths", default="generate,engine,unrepacked")
    p.add_argument("--prompts", default=None, help="comma list of suite prompt names [all]")
    p.add_argument("--cpu-time", action="store_true",
                   help="decoded tokens per CPU second (process CPU time, a run less a 1-token run) instead of per "
                   "wall second: for a machine busy with other work, with --threads 1 (no spinning threads)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    paths = [x.strip() for x in args.paths.split(",") if x.strip()]
    target = tandem.load(args.model, backend="llama.cpp", n_threads=args.threads)
    unrepacked = tandem.load(args.model, backend="llama.cpp", n_threads=args.threads, repack=False) \
        if "unrepacked" in paths else None
    worker = tandem.load(args.model, backend="llama.cpp", n_threads=args.threads, isolation="process") \
        if "worker" in paths else None
    engine = Engine(target, None, slots=1) if "engine" in paths else None
    prompts = load_suite("default", args.prompts)

    def bare(messages: list[dict], max_tokens: int) -> float:
        """A bare greedy loop over a context of tandem's own weights and settings: llama_decode and numpy's argmax,
        none of tandem's per-token work (sampling pipeline, stops, detokenising, stats)."""
        context = target.weights.context(target.n_ctx, target.n_batch)
        try:
            return bare_loop(context, target.tokenizer.encode_chat(messages), max_tokens, target.config.vocab_size)
        finally:
            target.weights.release(context)

    def run(path: str, messages: list[dict], max_tokens: int) -> float:
        if path == "bare":
            return bare(messages, max_tokens)
        if path == "engine":
            ids = target.tokenizer.encode_chat(messages)
            result = engine.generate([Request(ids, max_tokens=max_tokens, ignore_eos=True)])[0]
            return result.stats.decode_tokens_per_second
        model = {"unrepacked": unrepacked, "worker": worker}.get(path, target)
        result = tandem.generate(model, messages=messages, max_tokens=max_tokens, ignore_eos=True)
        return result.stats.decode_tokens_per_second

    # SIGTERM ends the run through server_process's exit, which stops the server (else it outlives us)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = {pr.name: {name: [] for name in paths + ["llama-server"]} for pr in prompts}
    with server_process(args.server, target.path, None, 0, 0, args.threads, 4096) as (proc, base):
        for pr in prompts:  # warm-up: every path and the server once on every prompt, short
            for path in paths:
                run(path, list(pr.messages), 8)
            server_decode_tps(base, list(pr.messages), 8)
        for r in range(args.repeats):
            for pr in prompts:
                order = paths + ["llama-server"]
                order = order[r % len(order):] + order[:r % len(order)]  # rotate who goes first
                for name in order:
                    messages = list(pr.messages)
                    if args.cpu_time and name == "llama-server":
                        tps = decode_per_cpu_s(lambda n, m=messages: server_decode_tps(base, m, n), args.max_tokens,
                                               proc.pid)
                    elif args.cpu_time:
                        tps = decode_per_cpu_s(lambda n, m=messages, path=name: run(path, m, n), args.max_tokens)
                    elif name == "llama-server":
                        tps = server_decode_tps(base, messages, args.max_tokens)
                    else:
                        tps = run(name, messages, args.max_tokens)
                    rows[pr.name][name].append(tps)
                print(pr.name, {k: round(v[-1], 1) for k, v in rows[pr.name].items()}, flush=True, file=sys.stderr)
    print(f"{'prompt':10} " + " ".join(f"{n:>12}" for n in paths + ["llama-server"]) + "   "
          + " ".join(f"{n + '/server':>18}" for n in paths))
    summary = {}
    for name, by in rows.items():
        ratios = {path: statistics.median(a / b for a, b in zip(by[path], by["llama-server"], strict=True))
                  for path in paths}
        summary[name] = {"median_tps": {k: statistics.median(v) for k, v in by.items()}, "ratio_to_server": ratios,
                         "runs": by}
        print(f"{name:10} " + " ".join(f"{statistics.median(by[n]):12.1f}" for n in paths + ["llama-server"])
              + "   " + " ".join(f"{ratios[n]:18.3f}" for n in paths))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"max_tokens": args.max_tokens, "repeats": args.repeats, "model": target.path,
                       "server": args.server, "prompts": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
