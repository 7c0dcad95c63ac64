"""Why a draft step costs more beside its target (issue 26: paired / standalone <= 1.05): the draft's drafting
steps timed in phases, one process, the GPU's clocks read around each phase.

    python bench/draft_pairing.py --model T.gguf --draft D.gguf --device cuda [--k 3 --repeats 40]

Phases, in this order: the draft alone; the target loaded, idle; the target verifying k + 1 rows between the
draft's steps (paired); the target verifying one row between them (paired-1); with --causes five that tell the
host from the device: the host sweeping SWEEP_MB of memory between the steps and no verify (flushed), the verify
and then a sleep (paired-sleep), the verify on a thread pinned to the other half of the CPUs (paired-thread), the
host sweeping L2_SWEEP_MB, a core's L2 (swept-l2), the verify launched and the host spinning through 90% of it
(paired-spin: no wait for the core to idle in), and paired once more; idle again; the target closed; the
draft alone again. Each phase times `repeats` drafting steps of k tokens whole, as the engine drafts a lone greedy
sequence (one greedy_drafts call), and the same steps forward by forward (each read before the next, as the
doctor timed them before): the first forward after a verify against the others. A slower idle phase than alone
says the target's presence costs (memory), a slower paired than idle says its forwards do (queue, caches); a
second alone phase as slow as the idle one says the device drifted (clocks, heat), not the pair.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

import tandem
from tandem.sampling import argmax

CONTEXT = 32
SWEEP_MB = 256  # past a server CPU's L2 and L3: what the target's host work between two draft steps could evict
L2_SWEEP_MB = 4  # a core's L2 and no more (a server CPU's: 1-2 MB)
SLEEP_S = 0.005  # longer than the device needs to finish a verify it was still running (V(4) ~ 14-22 ms, read back)


def clocks() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw",
                               "--format=csv,noheader"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "-"


def halves() -> tuple[set[int], set[int]]:
    cpus = sorted(os.sched_getaffinity(0))
    return set(cpus[: len(cpus) // 2] or cpus), set(cpus[len(cpus) // 2:] or cpus)


def phase(draft, target, k: int, repeats: int, verify_rows: int, between: str = "") -> dict:
    """Median ms a drafted token: steps timed whole, then forward by forward (first after a verify, the rest).
    between: "" the verify alone, "sweep" / "sweep-l2" the host sweeping memory instead, "sleep" the verify then a
    sleep, "thread" the verify on a thread pinned to the other half of the CPUs (this one on the first half
    meanwhile), "spin" the verify launched and the host spinning through most of it."""
    token = draft.tokenizer.bos_token_id or 0
    vocab = draft.vocab_size
    draft_kv = draft.new_batched_cache(1, CONTEXT + k + 2, drafting=True)
    target_kv = target.new_batched_cache(1, CONTEXT + k + 2) if target is not None else None
    whole, first, rest = [], [], []
    sweep = np.ones((SWEEP_MB if between == "sweep" else L2_SWEEP_MB) << 18, dtype=np.float32) \
        if between in ("sweep", "sweep-l2") else None
    pool = None
    if between == "thread":
        mine, other = halves()
        os.sched_setaffinity(0, mine)
        pool = ThreadPoolExecutor(1, initializer=os.sched_setaffinity, initargs=(0, other))

    def verify_target() -> None:
        if between == "spin":  # the verify launched, the host kept busy (no wait to idle in) while the device runs it
            until = time.perf_counter() + spin_s
            target_kv.feed([(0, [token] * verify_rows)])
            while time.perf_counter() < until:
                pass
        else:
            target_kv.forward_picking([(0, [token] * verify_rows)], [False], [True])
        target.synchronize()
        target_kv.rewind(0, CONTEXT)

    def verify() -> None:
        if sweep is not None:
            np.multiply(sweep, 1.0, out=sweep)
        if target_kv is not None:
            pool.submit(verify_target).result() if pool is not None else verify_target()
            if between == "sleep":
                time.sleep(SLEEP_S)
        draft_kv.rewind(0, CONTEXT)

    try:
        draft_kv.forward([(0, [token] * CONTEXT)], [True])
        if target_kv is not None:
            target_kv.forward([(0, [token] * CONTEXT)], [True])
        spin_s = 0.0
        if between == "spin":  # spin for 90% of a verify (median of 5, timed without spinning), block for the rest
            times = []
            for _ in range(5):
                started = time.perf_counter()
                verify_target()
                times.append(time.perf_counter() - started)
            spin_s = 0.9 * statistics.median(times)
        for run in range(repeats + 2):
            draft.synchronize()
            started = time.perf_counter()
            if draft_kv.drafts_greedy:
                forwards = draft_kv.greedy_drafts([[(0, [token])]], [k], vocab, steady=False)[1]
            else:
                fed = token
                for _ in range(k):
                    fed = int(argmax(draft_kv.forward([(0, [fed])], [False])[0][-1, :vocab]))
                forwards = k
            draft.synchronize()
            if run >= 2:
                whole.append(1000.0 * (time.perf_counter() - started) / forwards)
            verify()
        for run in range(repeats + 2):
            fed = token
            for i in range(k):
                started = time.perf_counter()
                fed = int(argmax(draft_kv.forward([(0, [fed])], [False])[0][-1, :vocab]))
                if run >= 2:
                    (first if i == 0 else rest).append(1000.0 * (time.perf_counter() - started))
            verify()
    finally:
        draft_kv.close()
        if target_kv is not None:
            target_kv.close()
        if pool is not None:
            pool.shutdown()
            os.sched_setaffinity(0, mine | other)
    q = lambda xs: [round(statistics.quantiles(xs, n=10)[i], 3) for i in (0, 4, 8)]  # noqa: E731
    return {"whole_ms": statistics.median(whole), "whole_p10_50_90": q(whole),
            "first_ms": statistics.median(first), "rest_ms": statistics.median(rest), "first_p10_50_90": q(first),
            "rest_p10_50_90": q(rest)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--isolation", default="auto", help="tandem.load's isolation")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--threads", type=int, default=None, help="llama.cpp's CPU threads a decode (default: tandem's)")
    p.add_argument("--causes", action="store_true", help="also the phases that tell the host from the device")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    threads = {} if args.threads is None else {"n_threads": args.threads}
    load = lambda path: tandem.load(path, backend="llama.cpp", device=args.device, n_ctx=256,  # noqa: E731
                                    isolation=args.isolation, **threads)
    rows = []

    def run(name: str, draft, target, verify_rows: int = 0, between: str = "") -> None:
        before = clocks()
        r = phase(draft, target, args.k, args.repeats, verify_rows, between)
        rows.append({"phase": name, **r, "clocks_before": before, "clocks_after": clocks()})
        print(f"{name:10} whole {r['whole_ms']:.3f} ms/token {r['whole_p10_50_90']}  by forward: first "
              f"{r['first_ms']:.3f} {r['first_p10_50_90']}, rest {r['rest_ms']:.3f} {r['rest_p10_50_90']}  "
              f"[{before} -> {rows[-1]['clocks_after']}]", flush=True)

    draft = load(args.draft)
    phase(draft, None, args.k, 20, 0)  # warm-up: graphs captured, clocks up
    run("alone", draft, None)
    target = load(args.model)
    phase(draft, target, args.k, 5, args.k + 1)
    run("idle", draft, None)
    run("paired", draft, target, args.k + 1)
    run("paired-1", draft, target, 1)
    if args.causes:
        run("flushed", draft, None, 0, "sweep")
        run("paired-sleep", draft, target, args.k + 1, "sleep")
        run("paired-thread", draft, target, args.k + 1, "thread")
        run("swept-l2", draft, None, 0, "sweep-l2")
        run("paired-spin", draft, target, args.k + 1, "spin")
        run("paired-again", draft, target, args.k + 1)
    run("idle-2", draft, None)
    target.close()
    run("alone-2", draft, None)
    alone = rows[0]["whole_ms"]
    print("whole step / alone: " + ", ".join(f"{r['phase']} {r['whole_ms'] / alone:.3f}" for r in rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "phases": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
