"""What a change of forward shape costs in llama.cpp: a forward of n rows timed after one of the same n rows (the
graph is reused) and after one of another row count (rebuilt; on CUDA also re-captured), per n, with llama.cpp's
graph reuse on and, in a second process, off (LLAMA_GRAPH_REUSE_DISABLE=1).

The engine's calibration times each shape repeated; its loop switches shapes every time a sequence starts or stops
drafting, and its draft alternates catch-up and one-row steps. This says what those switches cost on a machine.

  python lab/llamacpp_graph_reuse.py --model T.gguf --device cuda --rows 1,3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONTEXT = 16


def measure(args: argparse.Namespace) -> dict:
    import tandem

    model = tandem.load(args.model, backend="llama.cpp", device=args.device, n_ctx=CONTEXT + 64)
    kv = model.new_batched_cache(1, CONTEXT + 64)
    kv.forward([(0, [1] * CONTEXT)], [True])

    def timed(rows: int) -> float:
        model.synchronize()
        started = time.perf_counter()
        kv.forward([(0, [5] * rows)], [False])
        model.synchronize()
        ms = 1000.0 * (time.perf_counter() - started)
        kv.rewind(0, CONTEXT)
        return ms

    times: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for n in args.rows:
            other = next(m for m in args.rows if m != n)
            for _ in range(2):
                timed(n)
            times.setdefault(f"{n} after {n}", []).append(timed(n))
            timed(other)
            times.setdefault(f"{n} after {other}", []).append(timed(n))
    return {key: {"min": min(v), "median": statistics.median(v)} for key, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", default="1,3", help="row counts, comma list (at least two)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.rows = [int(n) for n in args.rows.split(",")]
    if len(args.rows) < 2:
        p.error("--rows needs two row counts at least")
    if args.child:
        print(json.dumps(measure(args)))
        return 0
    results = {}
    for label, env in (("reuse on", {}), ("reuse off", {"LLAMA_GRAPH_REUSE_DISABLE": "1"})):
        out = subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--child"],
                             env={**os.environ, **env}, capture_output=True, text=True, check=True).stdout
        results[label] = json.loads(out.strip().splitlines()[-1])
    columns = [(label, stat) for label in results for stat in ("min", "median")]
    print(f"{'forward':<12}" + "".join(f"{label + ' ' + stat:>20}" for label, stat in columns))
    for key in results["reuse on"]:
        print(f"{key:<12}" + "".join(f"{results[label][key][stat]:>20.3f}" for label, stat in columns))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
