"""The report's regime (issue 26): a big quantised target beside a small draft on llama.cpp, against the arithmetic
and against llama-server, in one table.

    python lab/gpu_report_regime.py --model T.gguf --draft D.gguf --device cuda --parts costs,bench \\
        --json /root/m/regime_cuda.json
    python lab/gpu_report_regime.py --model T.gguf --draft D.gguf --parts server \\
        --server /path/to/llama-server --json /root/m/regime_cuda.json      # a later call: adds llama-server

Parts (each fits one 10-minute device call for a 32B Q4_0 target; --json accumulates them in one file, and every
call prints the table of all that file holds):
- costs: tandem doctor's measurement (tandem.bench.doctor): the target's forward V(n) over n = 1..16 rows, the
  draft's step alone, beside the idle target and between the target's verifies (paired), the batched engine's costs
  for B = 1, 2, 4 sequences (doctor.batched_costs); the byte floor (bytes one step streams / --bandwidth-gbs);
- bench (measures costs too: its predictions come from the same run): plain against the adaptive policy with the
  draft model at each --acceptance (synthetic: each draft accepted with that probability, as `tandem bench
  --synthetic-acceptance` does), one request through `tandem.generate` (what `tandem bench` times), and 1, 2 and 4
  requests together through the batched engine (what the server runs; bench/batching.py's way); aggregate output
  tokens/s of each, the speedup, and its fraction of the arithmetic's prediction (one request: the best
  E(k)/(k c_d + V(k+1)) over 1/V(1) with the paired draft step; B requests: the planner's prediction from the
  batched costs). Prompt lookup stays off: synthetic acceptance would accept its drafts too;
- server: llama-server (--server) on the same files, plain and with the draft (`--spec-type draft-simple`, the
  classic draft-model speculation in this llama.cpp), `-np` = each concurrency, that many requests at once
  (tandem.bench.load), ignore_eos. llama-server has no synthetic acceptance: its drafted numbers run at whatever
  the random pair accepts (about nothing), so its plain numbers are the ones to beat, its drafted ones show what a
  draft that is never right costs it.
Models load through tandem's llama.cpp backend (`--isolation auto`: the worker process on a CUDA build beside CUDA
torch). Random-weight files make every token meaningless: systems numbers only.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import zlib
from dataclasses import dataclass

from step_parts import StepParts, iterations, iterations_traced, loop_learned

import tandem
from tandem.bench import doctor
from tandem.bench.bench import Bench, parse_configs
from tandem.bench.load import PROMPTS as LOAD_PROMPTS
from tandem.bench.suite import BenchPrompt
from tandem.engine import Engine, Request
from tandem.engine.costs import CostModel
from tandem.sampling import SamplingParams
from tandem.speculative.stats import GenerationStats

H200_BANDWIDTH_GBS = 4800.0
PROMPTS = [BenchPrompt(f"{kind}{i}", kind, ({"role": "user", "content": text},))
           for kind, texts in LOAD_PROMPTS.items() for i, text in enumerate(texts)]
GOAL_FRACTION, GOAL_PAIRED, GOAL_BATCHED = 0.90, 1.05, 0.97


def log(message: str) -> None:
    print(f"[regime {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def step_weight_bytes(path: str) -> int:
    """Bytes of weights one decoding step reads: every tensor but the input embedding, of which a step reads one
    row (unless it is also the output matrix: a tied model)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values())


def load(path: str, args: argparse.Namespace):
    return tandem.load(path, backend="llama.cpp", device=args.device, n_ctx=args.ctx, isolation=args.isolation)


# --- costs --------------------------------------------------------------------------------------------------------


def measure_costs(args: argparse.Namespace):
    """(target, draft, costs document): the draft timed alone before the target loads, as the doctor does."""
    log(f"loading the draft {args.draft}")
    draft = load(args.draft, args)
    k = args.paired_k
    standalone = doctor.time_draft_steps(draft, None, k, args.cost_repeats, warmup_s=doctor.WARMUP_S)[0]
    log(f"loading the target {args.model}")
    target = load(args.model, args)
    report = doctor.measure(target, draft, standalone, k, args.cost_repeats, log=log)
    log(f"batched costs (B = 1 .. {max(args.concurrency)})")
    batched = doctor.batched_costs(target, draft, max(args.concurrency), args.draft_max, tuple(args.acceptance))
    floor_bytes = step_weight_bytes(args.model)
    costs = {
        "device": target.device, "device_name": getattr(target, "device_description", None) or target.device,
        "isolation": getattr(target, "isolation", "none"), "target": args.model, "draft": args.draft,
        "target_step_bytes": floor_bytes, "draft_step_bytes": step_weight_bytes(args.draft),
        "bandwidth_gbs": args.bandwidth_gbs, "byte_floor_ms": floor_bytes / (args.bandwidth_gbs * 1e6),
        "verify_ms": {str(n): v for n, v in report.verify_ms.items()},
        "draft_step_ms_standalone": report.draft_step_ms_standalone,
        "draft_step_ms_target_idle": report.draft_step_ms_target_idle,
        "draft_step_ms_paired": report.draft_step_ms_paired, "draft_len_paired": report.draft_len_paired,
        "paired_over_standalone": report.paired_over_standalone, "flags": report.flags,
        "batched": {str(b): {**row, "draft_len": {str(a): v for a, v in row["draft_len"].items()},
                             "predicted_speedup": {str(a): v for a, v in row["predicted_speedup"].items()},
                             "verify_ms": {str(n): v for n, v in row["verify_ms"].items()}}
                    for b, row in batched.items()},
    }
    return target, draft, costs


def cost_model(costs: dict) -> CostModel:
    return CostModel(draft_step_ms=costs["draft_step_ms_paired"],
                     verify_ms={int(n): v for n, v in costs["verify_ms"].items()})


# --- bench --------------------------------------------------------------------------------------------------------


@dataclass
class AcceptanceSeen:
    """The per-position acceptance the runs showed: iterations accepting their first draft / iterations drafting
    (what --acceptance sets; accepted / drafted is lower, a rejection discarding the drafts after it)."""
    first_accepted: int = 0
    drafting: int = 0
    drafted: int = 0

    def add(self, stats: GenerationStats) -> None:
        self.first_accepted += stats.accepted_per_position[0] if stats.accepted_per_position else 0
        self.drafting += sum(n for k, n in stats.draft_len_counts.items() if k > 0)
        self.drafted += stats.draft_tokens

    def row(self) -> dict:
        return {"acceptance_seen": self.first_accepted / self.drafting if self.drafting else None,
                "drafted": self.drafted, "drafting_iterations": self.drafting}


def run_generate(target, draft, acceptance: float, args: argparse.Namespace) -> dict:
    """One request at a time through tandem.generate, plain and adaptive with the draft model alone, as `tandem bench
    --configs plain,draft --synthetic-acceptance A` runs them (rounds interleaved, speedup the median ratio)."""
    configs = parse_configs(",".join(["plain", "draft"] + [f"fixed{k}" for k in args.fixed]), draft, args.draft_max)
    bench = Bench(target, draft, configs, args.max_tokens, acceptance, ignore_eos=True, repeats=args.repeats)
    tps = {c.name: [] for c in configs}
    speedups: dict[str, list[float]] = {c.name: [] for c in configs}
    decode_speedups = []  # decode tok/s alone (not the prompt's time): what the arithmetic of steps predicts
    drafting = {c.name: [0.0, 0] for c in configs}  # draft ms, drafted tokens: what a drafted token cost the loop
    seen = AcceptanceSeen()
    trace: dict[str, list[str]] = {c.name: [] for c in configs}  # the median runs' iterations
    for prompt in PROMPTS[:args.prompts]:
        for config in configs:
            bench.warm_up(prompt, config)
        with iterations_traced():  # and what the kept engines had learned before each run
            runs, ratio = bench.measure(prompt, on_run=lambda c: log(f"    before {c.name}: {learned(target)}"))
        for name, run in runs.items():
            trace[name].append(iterations(run.stats))
            log(f"    {prompt.name} {name} (median run): {trace[name][-1]}; belief {run.stats.belief}")
        for name in tps:
            speedups[name].append(ratio[name])
            tps[name].append(runs[name].stats.tokens_per_second)
            drafting[name][0] += runs[name].stats.draft_ms
            drafting[name][1] += runs[name].stats.draft_tokens
        seen.add(runs["draft"].stats)
        decode_speedups.append(runs["draft"].stats.decode_tokens_per_second /
                               runs["plain"].stats.decode_tokens_per_second)

    def geomean(values: list[float]) -> float:
        return math.exp(statistics.fmean(math.log(v) for v in values))

    def draft_ms_per_token(name: str) -> float | None:
        return drafting[name][0] / drafting[name][1] if drafting[name][1] else None

    log(f"    learned by tandem.generate's engines: {learned(target)}")
    return {"plain_tps": statistics.fmean(tps["plain"]), "adaptive_tps": statistics.fmean(tps["draft"]),
            "speedup": geomean(speedups["draft"]), "decode_speedup": geomean(decode_speedups),
            "draft_ms_per_token": draft_ms_per_token("draft"),
            "fixed": {name: {"speedup": geomean(speedups[name]), "draft_ms_per_token": draft_ms_per_token(name)}
                      for name in tps if name.startswith("fixed")},
            "trace": trace, "learned": learned(target), **seen.row()}


def learned(target) -> dict:
    """What tandem.generate's kept engines learned beyond their calibration (tandem.api keeps them on the target)."""
    return {os.path.basename(str(key.draft))[:24]: loop_learned(kept.engine, 1)
            for key, kept in target.__dict__.get("_tandem_engines", {}).items() if kept.engine.costs is not None}


def engine_round(engine: Engine, prompts: list[list[int]], args: argparse.Namespace, seen: AcceptanceSeen | None = None
                 ) -> float:
    """Output tokens/s of the prompts decoded together to --max-tokens each; their acceptance counted in `seen`."""
    # seeded per prompt: synthetic acceptance draws, and a round should draw as the last one did
    requests = [Request(ids, SamplingParams(seed=zlib.crc32(str(ids).encode())), max_tokens=args.max_tokens,
                        ignore_eos=True) for ids in prompts]
    started = time.perf_counter()
    results = engine.generate(requests)
    seconds = time.perf_counter() - started
    for r in results if seen is not None else ():
        seen.add(r.stats)
    return sum(len(r.tokens) for r in results) / seconds


def run_engine(target, draft, acceptance: float, n: int, args: argparse.Namespace) -> dict:
    """n requests together on the batched engine, plain and adaptive (the planner's draft lengths), rounds
    interleaved; aggregate output tokens/s, median over rounds."""
    prompts = [target.tokenizer.encode_chat(list(PROMPTS[i % len(PROMPTS)].messages)) for i in range(n)]
    def adaptive() -> Engine:
        return Engine(target, draft, slots=n, n_ctx=args.ctx, draft_max=args.draft_max,
                      synthetic_acceptance=acceptance, prompt_lookup=False)

    engines = {"plain": Engine(target, None, slots=n, n_ctx=args.ctx), "adaptive": adaptive()}
    if args.ahead_ab and engines["adaptive"].costs.ahead_ms:  # the same engine, its last drafts fed after the verify
        engines["adaptive, no feed ahead"] = adaptive()
        engines["adaptive, no feed ahead"].costs.ahead_ms = {}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    seen = AcceptanceSeen()
    parts = StepParts() if args.step_parts else None
    for name, engine in engines.items():  # a whole round of warm-up, as for llama-server: first-use allocations, graphs
        engine_round(engine, prompts, args)
        if parts is not None and name in ("plain", "adaptive"):  # the measured rounds' steps only
            parts.instrument(engine)
    for r in range(args.repeats):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            rates[name].append(engine_round(engines[name], prompts, args, seen if name == "adaptive" else None))
    ratios = [a / p for a, p in zip(rates["adaptive"], rates["plain"], strict=True)]
    row = {"plain_tps": statistics.median(rates["plain"]), "adaptive_tps": statistics.median(rates["adaptive"]),
           "speedup": statistics.median(ratios), **seen.row(),
           "ahead_ms": engines["adaptive"].costs.ahead_ms, "feeds_ahead": engines["adaptive"].costs.feeds_ahead(n)}
    if "adaptive, no feed ahead" in rates:
        row["no_ahead_tps"] = statistics.median(rates["adaptive, no feed ahead"])
        row["ahead_gain"] = statistics.median(a / b for a, b in zip(rates["adaptive"], rates["adaptive, no feed ahead"],
                                                                  strict=True))
        log(f"    feeding ahead (ahead_ms {row['ahead_ms']}): {row['adaptive_tps']:.1f} tok/s against "
            f"{row['no_ahead_tps']:.1f} without, {row['ahead_gain']:.3f}x")
    if parts is not None:
        row["step_parts"] = parts.table()
        row["learned"] = loop_learned(engines["adaptive"], n)  # what the loop learned beyond the calibration
        for line in parts.lines():
            log("    " + line)
        log(f"    learned: {row['learned']}")
    return row


def run_bench(target, draft, costs: dict, args: argparse.Namespace, save=lambda rows: None) -> list[dict]:
    """Every row, each passed to `save` as soon as it is measured (a device call cut off keeps what it measured)."""
    model = cost_model(costs)
    rows = []

    def add(row: dict) -> None:
        row["fraction"] = row["speedup"] / row["predicted"] if row["predicted"] else None
        rows.append(row)
        save(rows)
        log(f"  {row['path']} x{row['requests']}: plain {row['plain_tps']:.1f} tok/s, adaptive "
            f"{row['adaptive_tps']:.1f}, {row['speedup']:.3f}x")

    for a in args.acceptance:
        log(f"acceptance {a}: one request through tandem.generate")
        add({"acceptance": a, "path": "generate", "requests": 1, **run_generate(target, draft, a, args),
             "predicted": model.predicted_speedup(a, args.draft_max),
             "predicted_k": model.best_draft_len(a, args.draft_max)})
        for n in args.concurrency:
            log(f"acceptance {a}: {n} requests together on the engine")
            batched = costs["batched"].get(str(n))
            add({"acceptance": a, "path": "engine", "requests": n, **run_engine(target, draft, a, n, args),
                 "predicted": batched["predicted_speedup"][str(a)] if batched else None,
                 "predicted_k": batched["draft_len"][str(a)] if batched else None})
    return rows


# --- llama-server -------------------------------------------------------------------------------------------------


def run_server(args: argparse.Namespace, save=lambda rows: None) -> list[dict]:
    """llama-server's rows, each passed to `save` as soon as it is measured (each config restarts the server)."""
    import asyncio

    from tandem.bench.llamaserver import serving
    from tandem.bench.load import run_load

    kinds = list(LOAD_PROMPTS)
    rows = []
    for with_draft in [c == "draft" for c in args.server_configs]:
        for n in args.concurrency:
            log(f"llama-server {'with the draft' if with_draft else 'plain'}, {n} slots")
            with serving(args.server, args.model, args.draft if with_draft else None, args.server_n_max, args.ngl,
                         args.server_threads, args.ctx, slots=n, extra=args.server_args.split()) as url:
                extra = {"ignore_eos": True, "seed": 0}
                # a whole round of warm-up: llama-server's first requests ran 4-40x slower than its third here
                asyncio.run(run_load(url, n, n, args.max_tokens, kinds, extra_body=extra))
                reports = [asyncio.run(run_load(url, n, n, args.max_tokens, kinds, extra_body=extra))
                           for _ in range(args.repeats)]
            failed = sum(r.failed for r in reports)
            drafted = sum(r.draft_n for r in reports)
            accepted = sum((r.acceptance_rate or 0.0) * r.draft_n for r in reports)
            rows.append({"draft": with_draft, "n_max": args.server_n_max if with_draft else 0, "requests": n,
                         "tps": statistics.median(r.output_tokens_per_s for r in reports), "failed": failed,
                         "errors": sorted({e for r in reports for e in r.errors})[:3],
                         "acceptance": accepted / drafted if drafted else None})
            save(rows)
            log(f"  {rows[-1]['tps']:.1f} tok/s" + (f", {failed} failed" if failed else ""))
    return rows


# --- the table ----------------------------------------------------------------------------------------------------


def format_table(doc: dict) -> str:
    lines = []
    costs = doc.get("costs")
    if costs:
        v = {int(n): ms for n, ms in costs["verify_ms"].items()}
        floor = costs["byte_floor_ms"]
        lines += [
            f"device {costs['device']} ({costs['device_name']}), llama.cpp in {costs['isolation']} isolation",
            f"target {costs['target']}: {costs['target_step_bytes'] / 1e9:.2f} GB a step; byte floor "
            f"{floor:.2f} ms = {1000 / floor:.0f} tok/s at {costs['bandwidth_gbs']:.0f} GB/s",
            f"plain step V(1) {v[1]:.2f} ms = {v[1] / floor:.2f}x the floor ({1000 / v[1]:.1f} tok/s, "
            f"{floor / v[1]:.0%} of the floor's rate)",
            "V(n) ms: " + ", ".join(f"{n}: {v[n]:.2f}" for n in range(1, 10) if n in v),
            f"draft {costs['draft']}: {costs['draft_step_bytes'] / 1e9:.2f} GB a step; step alone "
            f"{costs['draft_step_ms_standalone']:.3f} ms, beside the idle target "
            f"{costs['draft_step_ms_target_idle']:.3f}"
            f", paired (k={costs['draft_len_paired']}) {costs['draft_step_ms_paired']:.3f} ms: paired/alone "
            f"{costs['paired_over_standalone']:.3f} (goal <= {GOAL_PAIRED}); c_d / V(1) = "
            f"{costs['draft_step_ms_paired'] / v[1]:.3f}",
        ]
        model = cost_model(costs)
        k_max = doc.get("args", {}).get("draft_max", doctor.K_MAX)
        lines.append("arithmetic E(k)/(k c_d + V(k+1)) over 1/V(1): " + ", ".join(
            f"a={a}: k={model.best_draft_len(a, k_max)} {model.predicted_speedup(a, k_max):.2f}x"
            for a in (0.6, 0.7, 0.8, 0.9)))
        lines += [f"! {flag}" for flag in costs["flags"]]
    server = {(r["draft"], r["requests"]): r for r in doc.get("server", [])}
    if doc.get("bench") or server:
        lines += ["", f"{'a':>4} {'path':<9} {'n':>2} {'plain t/s':>10} {'adaptive':>9} {'speedup':>8} "
                      f"{'predicted':>10} {'fraction':>8} {'a seen':>8} {'ls plain':>9} {'ls draft':>9}  goal"]
    for row in doc.get("bench", []):
        plain_ls, draft_ls = server.get((False, row["requests"])), server.get((True, row["requests"]))
        best_ls = max([r["tps"] for r in (plain_ls, draft_ls) if r] or [0.0])
        goal = ""
        if row["path"] == "engine" and row["requests"] > 1:
            goal = f"adaptive/plain >= {GOAL_BATCHED}: {'yes' if row['speedup'] >= GOAL_BATCHED else 'NO'}"
            if best_ls:
                best = max(row["plain_tps"], row["adaptive_tps"])
                goal += f"; > llama-server: {'yes' if best > best_ls else 'NO'}"
        elif row["requests"] == 1 and row["acceptance"] == 0.8 and row["fraction"] is not None:
            goal = f">= {GOAL_FRACTION:.0%} of the arithmetic: {'yes' if row['fraction'] >= GOAL_FRACTION else 'NO'}"
        lines.append(
            f"{row['acceptance']:>4} {row['path']:<9} {row['requests']:>2} {row['plain_tps']:>10.1f} "
            f"{row['adaptive_tps']:>9.1f} {row['speedup']:>7.3f}x "
            + (f"{row['predicted']:>9.3f}x {row['fraction']:>8.2f}" if row["predicted"] else f"{'-':>10} {'-':>8}")
            + f" {_fmt(row['acceptance_seen']):>8}"
            f" {_fmt(plain_ls and plain_ls['tps'], '.1f'):>9} {_fmt(draft_ls and draft_ls['tps'], '.1f'):>9}  {goal}")
    for row in doc.get("bench", []):
        if row["path"] == "generate":
            per_token = [f"adaptive {_fmt(row.get('draft_ms_per_token'), '.2f')}"] + [
                f"{name} {fixed['speedup']:.3f}x ({fixed['speedup'] / row['predicted']:.2f} of predicted), "
                f"{_fmt(fixed['draft_ms_per_token'], '.2f')}" for name, fixed in row.get("fixed", {}).items()]
            lines.append(f"a={row['acceptance']} one request, draft ms a drafted token in the loop: "
                         + "; ".join(per_token))
            if row.get("decode_speedup") and row["predicted"]:  # the speedup above counts each run's prompt too
                lines.append(f"a={row['acceptance']} tandem.generate, decode alone (the prompt's time left out, as "
                             f"in the arithmetic): {row['decode_speedup']:.3f}x, "
                             f"{row['decode_speedup'] / row['predicted']:.2f} of predicted")
    for row in doc.get("bench", []) if costs else ():
        # ~100 seeded draws a run realise the synthetic rate only to +-0.04: the arithmetic at the rate they realised
        seen = row["acceptance_seen"]
        if row["requests"] == 1 and seen:
            at_seen = model.predicted_speedup(seen, k_max)
            decode = (f", decode alone {row['decode_speedup'] / at_seen:.2f} of it" if row.get("decode_speedup")
                      else "")
            lines.append(f"a={row['acceptance']} {row['path']} x1 at the acceptance its draws showed ({seen:.2f}): "
                         f"arithmetic {at_seen:.3f}x (k={model.best_draft_len(seen, k_max)}), speedup "
                         f"{row['speedup'] / at_seen:.2f} of it{decode}")
    if server and not doc.get("bench"):
        for (with_draft, n), r in sorted(server.items()):
            lines.append(f"llama-server {'draft' if with_draft else 'plain'} x{n}: {r['tps']:.1f} tok/s")
    if server:
        acc = [r["acceptance"] for r in server.values() if r["draft"] and r["acceptance"] is not None]
        lines.append(f"(ls: llama-server, same files, -np = n; its drafts are the random draft's own, accepted "
                     f"{_fmt(statistics.fmean(acc) if acc else None)})")
    return "\n".join(lines)


def _fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None or value is False else format(value, spec)


# --- main ---------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the target GGUF")
    p.add_argument("--draft", required=True, help="the draft GGUF")
    p.add_argument("--device", default="cuda", help="cuda | vulkan | cpu")
    p.add_argument("--parts", default="costs,bench", help="comma list of costs, bench, server ('': print the "
                   "table of what --json holds)")
    p.add_argument("--acceptance", default="0.6,0.8", help="synthetic acceptance rates, comma list")
    p.add_argument("--concurrency", default="1,2,4", help="requests together on the engine / llama-server slots")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="rounds of each measurement (median)")
    p.add_argument("--prompts", type=int, default=2, help="prompts of the one-request runs")
    p.add_argument("--draft-max", type=int, default=8, help="the adaptive policy's longest draft")
    p.add_argument("--fixed", default="2,3", help="fixed draft lengths run beside adaptive at one request (comma list; "
                   "'' for none)")
    p.add_argument("--paired-k", type=int, default=3, help="draft length of the paired draft-step timing (at most)")
    p.add_argument("--cost-repeats", type=int, default=doctor.DEFAULT_REPEATS)
    p.add_argument("--ctx", type=int, default=1024, help="tokens a sequence holds")
    p.add_argument("--bandwidth-gbs", type=float, default=H200_BANDWIDTH_GBS, help="memory bandwidth for the floor")
    p.add_argument("--isolation", default="auto", choices=["auto", "process", "none"])
    p.add_argument("--server", help="llama-server binary (the server part)")
    p.add_argument("--ngl", type=int, default=99, help="llama-server's GPU layers")
    p.add_argument("--server-n-max", type=int, default=3, help="llama-server's --spec-draft-n-max")
    p.add_argument("--server-configs", default="plain,draft", help="llama-server runs: plain, draft (with the draft "
                   "model), or both")
    p.add_argument("--server-threads", type=int, default=None, help="llama-server's -t (CPU runs: tandem's threads)")
    # On this shared 2-core CPU, llama-server's decode of one small random file swung between ~4 and ~200 tok/s from
    # one start to the next (with and without --no-warmup, -np 1 or 2): flags to try where a number looks like that.
    p.add_argument("--server-args", default="", help="more llama-server flags, space-separated (e.g. --no-warmup)")
    p.add_argument("--json", help="results file: read if present, this call's parts added, written back")
    p.add_argument("--ahead-ab", action="store_true", help="engine rows: also the adaptive engine without feeding "
                   "its last drafts beside the verify (BatchCosts.feeds_ahead), rounds interleaved")
    p.add_argument("--step-parts", action="store_true", help="engine rows: where each step's time goes in the loop "
                   "(lab/step_parts.py), by the target's rows before and in the step, and what the loop learned")
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = set(args.parts) - {"costs", "bench", "server"}
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}")
    if "server" in args.parts and not args.server:
        p.error("the server part needs --server PATH")
    args.acceptance = [float(a) for a in args.acceptance.split(",")]
    args.concurrency = [int(n) for n in args.concurrency.split(",")]
    args.server_configs = [x.strip() for x in args.server_configs.split(",") if x.strip()]
    if set(args.server_configs) - {"plain", "draft"}:
        p.error("--server-configs: plain, draft")
    args.fixed = [int(k) for k in args.fixed.split(",") if k.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    doc: dict = {}
    if args.json and os.path.exists(args.json):
        with open(args.json) as f:
            doc = json.load(f)
    if args.parts:  # none: print the table of what --json holds
        doc["args"] = {k: v for k, v in vars(args).items() if k != "json"}

    def save(rows: list[dict] | None = None, part: str = "bench") -> None:
        if rows is not None:
            doc[part] = rows
        if args.json:
            with open(args.json, "w") as f:
                json.dump(doc, f, indent=1)

    if "costs" in args.parts or "bench" in args.parts:
        target, draft, doc["costs"] = measure_costs(args)
        save()
        if "bench" in args.parts:
            doc["bench"] = run_bench(target, draft, doc["costs"], args, save)
        target.close()
        draft.close()
    if "server" in args.parts:
        # rows from an earlier call stay unless this call measures the same config again
        earlier = [r for r in doc.get("server", []) if ("draft" if r["draft"] else "plain") not in args.server_configs]
        doc["server"] = earlier + run_server(args, lambda rows: save(earlier + rows, "server"))
    save()
    print(format_table(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
