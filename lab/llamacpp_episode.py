"""A drafting episode as the batched engine runs it on the llama.cpp backend, each forward timed by its place: B
sequences take P plain steps (B rows), then V drafting iterations (the draft catches up and drafts k tokens a
sequence, the target verifies B x (k + 1) rows, one row a sequence is rejected and rewound), then P plain steps
again, and the draft's k steps once more with no target forward before them ("draft alone"); "a rewind" is one
call's ms, a round trip to tandem's llama.cpp worker process where llama.cpp runs in one.
Medians by place over the repeats, in child processes: as the engine runs (CUDA graphs on), with ggml's CUDA graphs
off (GGML_CUDA_DISABLE_GRAPHS=1), with the draft's forwards left out (the target's alone), with one CPU thread a
context (llama.cpp's CPU side of a GPU forward: the token embeddings' rows), and with OpenMP's threads not spinning.

The engine's calibration times each target shape repeated; the loop's verifies at 2 sequences ran 7-20 ms above
those figures on an H100 (CUDA) where a lone sequence's did not. Which place in the episode pays, and whether the
draft's forwards between the target's or ggml's graph capture is what costs, is what this says.

  python lab/llamacpp_episode.py --model T.gguf --draft D.gguf --device cuda --sequences 2 --draft-len 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

PROMPT = 64
# name: (environment, whether the draft's forwards run between the target's, CPU threads a context: None as tandem)
VARIANTS = {"engine": ({}, True, None), "no CUDA graphs": ({"GGML_CUDA_DISABLE_GRAPHS": "1"}, True, None),
            "target alone": ({}, False, None), "1 CPU thread": ({}, True, 1),
            "OpenMP passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, True, None)}


def measure(args: argparse.Namespace, with_draft: bool, threads: int | None) -> dict[str, float]:
    import tandem

    n_ctx = PROMPT + (args.plain * 2 + args.iterations * (args.draft_len + 1)) + 64
    options = {} if threads is None else {"n_threads": threads}
    target = tandem.load(args.model, backend="llama.cpp", device=args.device, n_ctx=n_ctx, **options)
    draft = tandem.load(args.draft, backend="llama.cpp", device=args.device, n_ctx=n_ctx, **options) \
        if with_draft else None
    b, k = args.sequences, args.draft_len
    t_kv = target.new_batched_cache(b, n_ctx)
    d_kv = draft.new_batched_cache(b, n_ctx, drafting=True) if draft else None
    slots = range(b)
    for kv in filter(None, (t_kv, d_kv)):
        kv.forward([(s, [1 + s] * PROMPT) for s in slots], [True] * b)
    times: dict[str, list[float]] = {}

    @contextmanager
    def timed(label: str):
        started = time.perf_counter()
        yield
        times.setdefault(label, []).append(1000.0 * (time.perf_counter() - started))

    def step(kv, rows: int, last_only: bool) -> None:
        kv.forward([(s, [7] * rows) for s in slots], [last_only] * b)

    for _ in range(args.repeats):
        for kv in filter(None, (t_kv, d_kv)):
            for s in slots:
                kv.rewind(s, PROMPT)
        for i in range(args.plain):
            with timed(f"plain {i + 1}"):
                step(t_kv, 1, False)
        for i in range(args.iterations):
            if d_kv is not None:
                with timed(f"draft {i + 1}"):
                    step(d_kv, t_kv.length(0) - d_kv.length(0), True)  # what the target saw since its last step
                    for _ in range(k - 1):
                        step(d_kv, 1, True)
            with timed(f"verify {i + 1}"):
                step(t_kv, k + 1, False)
            for s in slots:  # one row a sequence rejected: k tokens kept (k - 1 drafts and the correction)
                with timed("a rewind"):  # a round trip to the worker process, where there is one
                    t_kv.rewind(s, t_kv.length(s) - 1)
                if d_kv is not None:
                    d_kv.rewind(s, min(d_kv.length(s), t_kv.length(s) - 1))
        for i in range(args.plain):
            with timed(f"plain after {i + 1}"):
                step(t_kv, 1, False)
        if d_kv is not None:  # the draft's k steady steps again with no target forward before: paired against alone
            with timed("draft alone"):
                for _ in range(k):
                    step(d_kv, 1, True)
    return {label: statistics.median(v) for label, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--sequences", type=int, default=2)
    p.add_argument("--draft-len", type=int, default=2)
    p.add_argument("--plain", type=int, default=5, help="plain steps before and after the drafting iterations")
    p.add_argument("--iterations", type=int, default=5, help="drafting iterations in a row")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma list of: " + ", ".join(VARIANTS))
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print(json.dumps(measure(args, *VARIANTS[args.child][1:])))
        return 0
    results = {}
    for name in args.variants.split(","):
        env = {**os.environ, **VARIANTS[name][0]}
        run = subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--child", name],
                             env=env, capture_output=True, text=True)
        if run.returncode != 0:
            print(f"{name}: failed ({run.returncode}): {run.stderr.strip()[-400:]}")
            continue
        results[name] = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"{args.sequences} sequences, k = {args.draft_len}: medians of ms by place over {args.repeats} episodes")
    print(f"{'place':<16}" + "".join(f"{name:>16}" for name in results))
    for place in (next(iter(results.values())) if results else {}):
        print(f"{place:<16}" + "".join(f"{r.get(place, float('nan')):>16.2f}" for r in results.values()))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
