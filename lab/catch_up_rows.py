"""What a draft's catch-up forward costs reading one logits row back, as the drafter's catch-ups read, against
reading every row back, as the engine's calibration timed it (tandem.engine.calibration.measure, before): a row of a
152k vocabulary is 0.6 MB a token to copy back (and, in tandem's worker process, to send over).

    python lab/catch_up_rows.py --model D.gguf --device cuda --rows 8,16,32
"""

from __future__ import annotations

import argparse
import statistics
import time

import tandem

CONTEXT = 32  # tokens in the cache before each timed forward, as calibration.measure


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", default="8,16,32")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args(argv)
    model = tandem.load(args.model, backend="llama.cpp", device=args.device, n_ctx=512)
    kv = model.new_batched_cache(1, 256, drafting=True)
    kv.forward([(0, [0] * CONTEXT)], [True])
    print(f"{model.device}: {args.model}, vocabulary {model.vocab_size}; ms a forward of n rows, median of "
          f"{args.repeats}")
    print(f"{'rows':>5} {'last row':>9} {'every row':>10} {'difference':>11}")
    try:
        for rows in (int(r) for r in args.rows.split(",")):
            times: dict[bool, list[float]] = {True: [], False: []}
            for repeat in range(args.repeats + 1):  # the first of each a warm-up
                for last_only in (True, False):
                    model.synchronize()
                    started = time.perf_counter()
                    kv.forward([(0, [0] * rows)], [last_only])
                    model.synchronize()
                    if repeat:
                        times[last_only].append(1000.0 * (time.perf_counter() - started))
                    kv.rewind(0, CONTEXT)
            last, every = statistics.median(times[True]), statistics.median(times[False])
            print(f"{rows:>5} {last:>9.3f} {every:>10.3f} {every - last:>11.3f}")
    finally:
        kv.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
