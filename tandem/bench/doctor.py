"""`tandem doctor`: measure what speculation costs on this device for this pair, and say whether it can pay.
More: docs/internals.md."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass, field

from tandem.backends.base import Model
from tandem.engine.calibration import time_forwards_ms
from tandem.engine.costs import NGRAM_STEP_MS, CostModel
from tandem.sampling import argmax
from tandem.speculative.compat import is_head
from tandem.speculative.policy import expected_tokens

DEFAULT_REPEATS = 5
WARMUP_S = 1.0  # one-token forwards before the first timing of each model (see tandem.engine.calibration.warm_up)
CONTEXT_TOKENS = 32  # tokens already in the caches when a step is timed: a short chat's worth
VERIFY_SIZES = tuple(range(1, 17))
# Drafting steps are cheap, and few of them read the pairing wrong (a fresh context's first steps read it high:
# docs/decisions/0007)
STEPS_PER_REPEAT = 8
WARMUP_STEPS = 3
ACCEPTANCES = (0.5, 0.7, 0.9)
K_MAX = 15  # V is measured up to 16 tokens, so drafts up to 15 are predicted from measurements alone
PAIRED_SLOWDOWN_FLAG = 1.2  # paired / standalone draft step above this: the two models interfere
VERIFY_MARGINAL_FLAG = 0.3  # each extra verified token costs this fraction of a plain step or more: compute-bound
HELPS_SPEEDUP = 1.1  # below this predicted gain at 90% acceptance, the verdict says speculation barely helps
DRAFT_COST_FLAG = 0.5  # a draft step above this fraction of a target step can rarely pay
DRIFT_FLAG = 1.2  # one timing pass's target step over the other's above this: the device was not steady


@dataclass
class DoctorReport:
    device: str
    backend: str
    target: str
    draft: str | None
    draft_len_paired: int  # k of the interleaved measurement
    repeats: int
    draft_step_ms_standalone: float | None  # per draft step (one token), only the draft loaded
    draft_step_ms_target_idle: float | None  # per draft step, target loaded but not running
    draft_step_ms_paired: float | None  # per draft step, target loaded and verifying between draft runs
    paired_over_standalone: float | None
    target_step_ms: float  # per plain decoding step (a forward of one token)
    verify_ms: dict[int, float]  # n -> ms per target forward over n tokens
    draft_cost_ratio: float  # c_d / c_t: a draft step as a fraction of a target step
    weight_bytes_ratio: float | None  # draft's weight bytes / target's: the ratio a memory-bound device would show
    best_draft_len: dict[float, int]  # acceptance -> the k the cost model picks (0 = plain decoding)
    predicted_speedup: dict[float, float]  # acceptance -> predicted tokens/s over plain
    break_even_acceptance: float | None  # lowest acceptance at which some k > 0 beats plain; None: none does
    flags: list[str] = field(default_factory=list)
    verdict: str = ""
    synthetic: bool = False
    shapes: dict[str, str] | None = None
    batched: dict[int, dict] | None = None  # --slots: B -> the batched engine's costs and plan (batched_costs)
    draft_kind: str = "model"  # "model", or "head": a head draft (no step alone: it reads the target's KV)

    def to_dict(self) -> dict:
        out = asdict(self)
        for key in ("verify_ms", "best_draft_len", "predicted_speedup"):
            out[key] = {str(k): v for k, v in out[key].items()}  # JSON object keys are strings
        return out


def time_draft_steps(draft: Model, target: Model | None, k: int, repeats: int, context: int = CONTEXT_TOKENS,
                     warmup_s: float = 0.0, verifying: Seq[bool] = (True,)) -> list[float]:
    """Median ms a draft token of k-token drafting steps, timed whole as the engine drafts (tandem.engine.drafter).

    One figure per entry of `verifying`: True interleaves the target's verify of k + 1 rows, False leaves it idle.
    Entries take turns in blocks of STEPS_PER_REPEAT so device drift moves them alike; warm-up steps are untimed.
    """
    token = draft.tokenizer.bos_token_id or 0
    vocab = draft.vocab_size if target is None else min(draft.vocab_size, target.vocab_size)
    capacity = context + k + 2
    target_kv = target.new_batched_cache(1, capacity) if target is not None else None
    # a head draft runs over the target's KV (and needs one); its context is the target's, fed below
    draft_kv = target_kv.attach_head(draft) if is_head(draft) else draft.new_batched_cache(1, capacity, drafting=True)

    def drafting_step() -> int:
        if draft_kv.drafts_greedy:
            return draft_kv.greedy_drafts([[(0, [token])]], [k], vocab, steady=False)[1]
        fed = token
        for _ in range(k):
            fed = int(argmax(draft_kv.forward([(0, [fed])], [False])[0][-1, :vocab]))
        return k

    try:
        if target_kv is not None:
            target_kv.forward([(0, [token] * context)], [True])
        if not is_head(draft):
            draft_kv.forward([(0, [token] * context)], [True])
        deadline, run, steps = time.perf_counter() + warmup_s, 0, [[] for _ in verifying]
        while min(len(s) for s in steps) < repeats * STEPS_PER_REPEAT:
            block = run // STEPS_PER_REPEAT % len(verifying)
            draft.synchronize()
            started = time.perf_counter()
            forwards = drafting_step()
            draft.synchronize()
            if run >= WARMUP_STEPS and started >= deadline:
                steps[block].append(1000.0 * (time.perf_counter() - started) / forwards)
            if target_kv is not None and verifying[block]:
                target_kv.forward_picking([(0, [token] * (k + 1))], [False], [True])
                target.synchronize()
                target_kv.rewind(0, context)
            draft_kv.rewind(0, context)
            run += 1
        return [statistics.median(s) for s in steps]
    finally:
        draft_kv.close()
        if target_kv is not None:
            target_kv.close()


def break_even_acceptance(costs: CostModel, k_max: int = K_MAX) -> float | None:
    """Lowest acceptance (to 0.01) at which the cost model prefers some draft over plain decoding."""
    for step in range(1, 100):
        if costs.best_draft_len(step / 100, k_max) > 0:
            return step / 100
    return None


def diagnose(paired_over_standalone: float | None, verify_ms: dict[int, float], draft_cost_ratio: float,
             weight_bytes_ratio: float | None = None, drift: float = 1.0,
             idle_over_standalone: float | None = None) -> list[str]:
    """Plain-words flags for the pathologies that make speculation lose, and for timings not to trust. Pure:
    numbers in, sentences out. drift = the slower timing pass's target step over the faster one's;
    idle_over_standalone = the draft's step beside the idle target over its step alone, which tells what slows a
    paired draft: the target's presence (memory) or its forwards (the device's queue, the host's work)."""
    flags = []
    step = verify_ms[1]
    if drift > DRIFT_FLAG:
        flags.append(
            f"timings drifted: the target's step took {drift:.1f}x longer in one timing pass than in the other "
            f"(a device still warming up, or other work on it); every figure here is the faster pass's, and a "
            f"second run of the doctor should agree with it"
        )
    if paired_over_standalone is not None and paired_over_standalone > PAIRED_SLOWDOWN_FLAG:
        slowed = (f"the draft slows down when the target shares the device: a draft step costs "
                  f"{paired_over_standalone:.2f}x its standalone time once the target is loaded and verifying")
        if idle_over_standalone is None:
            why = "queue sharing, cache thrashing or extra synchronisation between the two models"
        elif idle_over_standalone > PAIRED_SLOWDOWN_FLAG:
            why = (f"{idle_over_standalone:.2f}x with the target loaded and idle, so its presence costs: the two "
                   f"compete for memory (a unified-memory GPU's shared RAM, or memory the driver moves or pages)")
        else:
            why = (f"{idle_over_standalone:.2f}x with the target loaded and idle, so its forwards cost, not its "
                   f"presence: the device's queue, or the host (llama.cpp's Vulkan build records every forward's "
                   f"commands on the host, slower after the target's work: docs/vulkan.md)")
        flags.append(f"{slowed} ({why})")
    n = 9 if 9 in verify_ms else max(verify_ms)
    marginal = (verify_ms[n] - step) / (n - 1) / step if n > 1 else 0.0
    if marginal > VERIFY_MARGINAL_FLAG:
        flags.append(
            f"compute-bound: a verify of {n} tokens costs {verify_ms[n] / step:.1f} plain steps "
            f"(each extra token +{100 * marginal:.0f}% of a step), so long drafts cannot pay"
        )
    if draft_cost_ratio > DRAFT_COST_FLAG:
        why = (f" although its weights are {weight_bytes_ratio:.2f} of the target's bytes"
               if weight_bytes_ratio is not None else "")
        flags.append(
            f"draft is launch/overhead-bound: its step costs {draft_cost_ratio:.2f} of a target step{why}; "
            f"a draft must be much cheaper than the target to pay"
        )
    return flags


def make_verdict(costs: CostModel, break_even: float | None, predicted: dict[float, float],
                 best: dict[float, int]) -> str:
    if break_even is None:
        return (f"Speculation cannot help this pair on this device: even at 99% acceptance no draft length beats "
                f"plain decoding (a draft step costs {costs.draft_step_ms:.2f} ms, a plain step "
                f"{costs.verify(1):.2f} ms, a 9-token verify {costs.verify(9):.2f} ms). tandem's adaptive policy "
                f"will decode plainly.")
    at = ", ".join(f"{predicted[a]:.2f}x at {a:.0%} ({f'k={best[a]}' if best[a] else 'plain'})" for a in ACCEPTANCES)
    helps = "helps" if predicted[ACCEPTANCES[-1]] > HELPS_SPEEDUP else "barely helps"
    return (f"Speculation {helps} on this device once acceptance exceeds {break_even:.0%} (the break-even point): "
            f"predicted {at}. Below that, tandem's adaptive policy falls back to plain decoding, so it is never "
            f"slower by more than its probes.")


def measure(target: Model, draft: Model | None, standalone_ms: float | None, k: int, repeats: int,
            synthetic: bool = False, shapes: dict[str, str] | None = None, log=lambda message: None) -> DoctorReport:
    """Everything but the standalone draft step, which the caller measured before loading the target."""
    from tandem.synthetic.shapes import weight_bytes

    log(f"timing the target's forwards over 1..{max(VERIFY_SIZES)} tokens, two passes")
    # Two passes, each figure the faster pass's: a device still warming up, or busy with other work, shows as one
    # pass much slower than the other, and is flagged rather than reported as the target's cost.
    passes = [time_forwards_ms(target, VERIFY_SIZES, repeats, CONTEXT_TOKENS, warmup_s=WARMUP_S),
              time_forwards_ms(target, VERIFY_SIZES, repeats, CONTEXT_TOKENS)]
    verify_ms = {n: min(p[n] for p in passes) for n in VERIFY_SIZES}
    drift = max(p[1] for p in passes) / verify_ms[1]
    if draft is not None and standalone_ms is not None:
        # Paired at the draft length the policy would run here (at the highest acceptance asked about), not past
        # it: beyond a backend's knee the loop never drafts, and the slow verifies there make the draft look slower.
        k = max(1, CostModel(draft_step_ms=standalone_ms, verify_ms=verify_ms).best_draft_len(ACCEPTANCES[-1], k))
    idle_ms = paired_ms = None
    if draft is not None:
        log(f"timing the draft's steps beside the idle target, then between its verifies (k = {k})")
        idle_ms, paired_ms = time_draft_steps(draft, target, k, repeats, warmup_s=WARMUP_S, verifying=(False, True))
    costs = CostModel(draft_step_ms=paired_ms if paired_ms is not None else NGRAM_STEP_MS, verify_ms=verify_ms)
    ratio = costs.draft_step_ms / verify_ms[1]
    target_bytes = weight_bytes(target)
    bytes_ratio = weight_bytes(draft) / target_bytes if draft is not None and target_bytes else None
    paired_over = paired_ms / standalone_ms if paired_ms is not None and standalone_ms else None
    idle_over = idle_ms / standalone_ms if idle_ms is not None and standalone_ms else None
    best = {a: costs.best_draft_len(a, K_MAX) for a in ACCEPTANCES}
    predicted = {a: costs.predicted_speedup(a, K_MAX) for a in ACCEPTANCES}
    even = break_even_acceptance(costs)
    return DoctorReport(
        device=target.device, backend=target.backend, target=target.path, draft=draft.path if draft else None,
        draft_len_paired=k, repeats=repeats, draft_step_ms_standalone=standalone_ms,
        draft_step_ms_target_idle=idle_ms, draft_step_ms_paired=paired_ms, paired_over_standalone=paired_over,
        target_step_ms=verify_ms[1], verify_ms=verify_ms, draft_cost_ratio=ratio, weight_bytes_ratio=bytes_ratio,
        best_draft_len=best, predicted_speedup=predicted, break_even_acceptance=even,
        flags=diagnose(paired_over, verify_ms, ratio, bytes_ratio, drift, idle_over),
        verdict=make_verdict(costs, even, predicted, best),
        synthetic=synthetic, shapes=shapes, draft_kind="head" if draft is not None and is_head(draft) else "model",
    )


def batched_costs(target: Model, draft: Model | None, slots: int, k: int,
                  acceptances: tuple[float, ...] = ACCEPTANCES) -> dict[int, dict]:
    """The costs the batched engine plans with (tandem.engine.planner), per batch size B = 1, 2, 4, ... slots:
    the target's forward over B sequences of 1, 2 and k + 1 rows, the draft's one-row step over B sequences, and
    what the planner would do with them: the draft length for B sequences all at acceptance a, and the predicted
    tokens/s over B plain sequences."""
    from tandem.engine import calibration, planner

    target_kv = target.new_batched_cache(slots, min(target.n_ctx, 256))
    draft_kv = None if draft is None else target_kv.attach_head(draft) if is_head(draft) else \
        draft.new_batched_cache(slots, min(draft.n_ctx, 256), drafting=True)
    try:
        costs = calibration.measure(target_kv, draft_kv, k,
                                    lambda: (target.synchronize(), draft and draft.synchronize()))
    finally:
        target_kv.close()
        if draft_kv is not None:
            draft_kv.close()
    if draft is None:
        costs.draft_step = {}
    out = {}
    for b, model in costs.verify.items():
        plain = b / costs.target_ms(b, b)
        row = {"verify_ms": dict(sorted(model.verify_ms.items())), "draft_step_ms": costs.draft_step.get(b),
               "switch_ms": costs.switch_ms, "ahead_ms": costs.ahead_ms.get(b), "feeds_ahead": costs.feeds_ahead(b),
               "draft_len": {}, "predicted_speedup": {}}
        for a in acceptances:
            ks = planner.plan([planner.Candidate(a, k) for _ in range(b)], costs)
            tokens = sum(expected_tokens(a, ki) for ki in ks)
            ms = max(ks) * costs.draft_ms(sum(1 for ki in ks if ki)) + costs.target_ms(b, b + sum(ks))
            row["draft_len"][a], row["predicted_speedup"][a] = ks[0], tokens / ms / plain
        out[b] = row
    return out


def format_batched(batched: dict[int, dict]) -> list[str]:
    lines = ["  batched (per call; the planner's draft length and predicted speed-up over plain at acceptance a):"]
    switch = next(iter(batched.values()), {}).get("switch_ms")
    if switch is not None:  # llama.cpp rebuilds its graph for another shape, and its CUDA build captures it anew
        lines.append(f"    a change of shape (plain step <-> verify): {switch:.2f} ms, paid as drafting starts, stops")
    for b, row in batched.items():
        verify = ", ".join(f"{n} rows {ms:.2f}" for n, ms in row["verify_ms"].items())
        draft = "" if row["draft_step_ms"] is None else f"; draft step {row['draft_step_ms']:.2f} ms"
        if row.get("ahead_ms") is not None:  # a GPU: the last drafts fed to the draft beside the verify
            draft += f"; last drafts beside the verify +{row['ahead_ms']:.2f} ms (" + \
                ("fed" if row["feeds_ahead"] else "not fed: it adds half a draft step or more") + ")"
        plan = ", ".join(f"a={a}: k={row['draft_len'][a]} {row['predicted_speedup'][a]:.2f}x" for a in row["draft_len"])
        lines.append(f"    B={b}: target {verify} ms{draft}; {plan}")
    return lines


def format_report(r: DoctorReport, device_name: str = "") -> str:
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.3f} ms"

    lines = [
        f"tandem doctor — {r.backend} on {r.device}{f' ({device_name})' if device_name else ''}"
        + (" — SYNTHETIC random-weight models " + str(r.shapes) if r.synthetic else ""),
        f"  target: {r.target}",
        f"  draft:  {r.draft or '(none: prompt lookup costs)'}"
        + (" (a head draft: it runs over the target's KV, so it has no step alone)" if r.draft_kind == "head" else ""),
        f"  draft step, draft alone (per token):          {ms(r.draft_step_ms_standalone)}",
        f"  draft step, target loaded and idle:           {ms(r.draft_step_ms_target_idle)}",
        f"  draft step, target loaded, k={r.draft_len_paired} (per token): {ms(r.draft_step_ms_paired)}"
        + (f"  ({r.paired_over_standalone:.2f}x standalone)" if r.paired_over_standalone else ""),
        f"  target step (per token, plain decoding):      {ms(r.target_step_ms)}",
        f"  draft step / target step:                     {r.draft_cost_ratio:.2f}"
        + (f"  (weight bytes ratio {r.weight_bytes_ratio:.2f})" if r.weight_bytes_ratio else ""),
        "  verify of n tokens (per call): "
        + ", ".join(f"{n}: {v:.2f}" for n, v in r.verify_ms.items() if n in (1, 2, 3, 4, 5, 9, 12, 16)) + " ms",
        "  predicted: " + ", ".join(f"a={a}: k={r.best_draft_len[a]}, {r.predicted_speedup[a]:.2f}x"
                                    for a in r.predicted_speedup),
        f"  break-even acceptance: {'none' if r.break_even_acceptance is None else f'{r.break_even_acceptance:.2f}'}",
    ]
    if r.batched:
        lines += format_batched(r.batched)
    lines += [f"  ! {flag}" for flag in r.flags] or ["  no pathologies found"]
    lines += ["", r.verdict]
    return "\n".join(lines)


def run_doctor(args: argparse.Namespace) -> int:
    from tandem.bench.loading import environment, load_draft, load_target, synthetic_shapes

    repeats = getattr(args, "repeats", None) or DEFAULT_REPEATS
    k = max(1, args.draft_max)
    started = time.perf_counter()

    def log(message: str) -> None:
        # Progress on stderr: on a GPU the first forwards compile for minutes, and a run cut short by a time
        # limit should still say where it was.
        print(f"[doctor {time.perf_counter() - started:6.1f} s] {message}", file=sys.stderr, flush=True)

    # The draft first, alone: its standalone step must be timed before the target exists.
    log("loading the draft")
    draft = load_draft(args, backend=None)
    if isinstance(draft, str):
        draft = None  # "ngram": no draft model to time; costs are prompt lookup's
    if draft is not None and not is_head(draft):
        log(f"timing the draft's steps alone (k = {k}, {repeats} repeats; the first compiles)")
    standalone = None
    if draft is not None and not is_head(draft):  # timed as the idle and paired steps are (see measure), so that
        # the ratios compare like with like; a head draft has no step alone (it reads the target's KV)
        standalone = time_draft_steps(draft, None, k, repeats, warmup_s=WARMUP_S)[0]
    log("loading the target")
    target = load_target(args)
    shapes = synthetic_shapes(args)
    report = measure(target, draft, standalone, k, repeats, synthetic=shapes is not None, shapes=shapes, log=log)
    slots = getattr(args, "slots", 0) or 0
    if slots > 1:
        log(f"timing batched forwards (B = 1 .. {slots})")
        report.batched = batched_costs(target, draft, slots, k)
    log("done")
    env = environment(target)
    if args.json:
        print(json.dumps({**report.to_dict(), "environment": env}, indent=2))
    else:
        print(format_report(report, env["device_name"]))
    sys.stdout.flush()
    return 0
