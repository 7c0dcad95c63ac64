"""`tandem bench`: plain and speculative decoding side by side, same process, same prompts, same models.
More: docs/internals.md."""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field

import tandem
from tandem.api import forget_prompts
from tandem.backends.base import Model
from tandem.bench.loading import compute_dtype, environment, load_draft, load_target, synthetic_shapes
from tandem.bench.suite import BenchPrompt, load_suite
from tandem.engine.costs import CostModel
from tandem.speculative.policy import expected_tokens
from tandem.speculative.stats import GenerationStats

WARMUP_TOKENS = 16  # a warm-up generation's length: enough to calibrate and touch every kernel


@dataclass(frozen=True)
class BenchConfig:
    name: str  # as given in --configs
    # "mixed" (the draft model and prompt lookup, the policy picking per iteration), "model" (the draft model
    # alone), "ngram" (prompt lookup alone) or None (plain)
    draft: str | None
    policy: str  # "adaptive" | "fixed"
    draft_max: int


@dataclass
class ConfigResult:
    config: str
    tps: float  # generated tokens / (prefill + decode) s, from GenerationStats
    decode_tps: float  # tokens after the first / decode s
    wall_tps: float  # generated tokens / wall-clock s of the whole generate() call
    wall_s: float
    speedup: float  # over tandem plain on the same prompt: the median over rounds of tps / plain's tps that round
    prompt_tokens: int
    generated_tokens: int
    draft_tokens: int  # proposed over the generation
    accepted_tokens: int
    acceptance_rate: float  # accepted / drafted
    first_position_acceptance: float  # iterations accepting draft 1 / iterations drafting: per-position rate a
    mean_accepted_len: float  # tokens per target forward after the prefill (1.0 = plain)
    draft_ms_per_token: float  # per draft token
    verify_ms: float  # per target forward (iteration), verify + acceptance
    prefill_ms: float
    decode_ms: float
    k_counts: dict[str, int]  # draft length -> iterations that used it
    finish_reason: str
    lossless: bool | None  # tokens == plain's tokens (greedy); None for plain itself and synthetic acceptance
    sources: dict[str, dict] = field(default_factory=dict)  # per draft source: iterations, drafted, accepted, ...
    belief: dict = field(default_factory=dict)  # what the adaptive policy believed (GenerationStats.belief)
    predicted_speedup: float | None = None  # E(k)/(k c_d + V(k+1)) over 1/V(1), from measured costs and a
    fraction_of_prediction: float | None = None  # speedup / predicted_speedup


@dataclass
class PromptResult:
    name: str
    kind: str
    prompt_tokens: int
    primary: str  # the speculative config the top-level spec_* fields describe
    baseline_tps: float
    spec_tps: float
    speedup: float
    acceptance_rate: float
    mean_accepted_len: float
    draft_ms_per_token: float
    verify_ms: float
    lossless: bool | None
    configs: dict[str, ConfigResult] = field(default_factory=dict)
    peers: dict[str, dict] = field(default_factory=dict)
    plain_bandwidth_gb_s: float | None = None  # target weight bytes / plain decode time per token
    synthetic: bool = False  # random-weight models or synthetic acceptance: systems numbers only


# --- configurations -----------------------------------------------------------------------------------------------


def parse_configs(spec: str | None, draft: Model | str | None, draft_max: int) -> list[BenchConfig]:
    """plain, adaptive, draft, fixed, fixedN, ngram; plain always runs first (every speedup is against it).

    adaptive: what `tandem generate` does by default (with a draft model, mixed with prompt lookup); draft: the
    draft model alone, adaptive; fixedN: the draft model alone, N tokens every iteration; ngram: prompt lookup
    alone, adaptive."""
    has_model = isinstance(draft, Model)
    if spec is None:
        names = ["plain", "adaptive", "draft", "ngram"] if has_model else ["plain", "ngram"]
    else:
        names = [n.strip() for n in spec.split(",") if n.strip()]
    configs = [BenchConfig("plain", None, "fixed", 0)]
    for name in names:
        if name == "plain":
            continue
        fixed = re.fullmatch(r"fixed(\d*)", name)
        if name == "ngram":
            configs.append(BenchConfig(name, "ngram", "adaptive", draft_max))
        elif name in ("adaptive", "draft") or fixed:
            if not has_model:
                raise ValueError(f"config {name!r} needs a draft model (--draft PATH or --synthetic-shape T,D)")
            k = int(fixed.group(1)) if fixed and fixed.group(1) else draft_max
            kind = "mixed" if name == "adaptive" else "model"
            configs.append(BenchConfig(name, kind, "fixed" if fixed else "adaptive", k))
        else:
            raise ValueError(f"unknown config {name!r}; use plain, adaptive, draft, fixed, fixedN (e.g. fixed3), ngram")
    if len({c.name for c in configs}) != len(configs):
        raise ValueError(f"a config is named twice in {spec!r}")
    return configs


def first_position_acceptance(stats: GenerationStats) -> float:
    drafting = sum(n for k, n in stats.draft_len_counts.items() if k > 0)
    return stats.accepted_per_position[0] / drafting if drafting and stats.accepted_per_position else 0.0


def predicted_speedup(costs: CostModel, config: BenchConfig, acceptance: float) -> float:
    """The arithmetic: E(k) / (k c_d + V(k+1)) over 1 / V(1), for the k this config would draft."""
    if config.policy == "adaptive":
        return costs.predicted_speedup(acceptance, config.draft_max)
    k = config.draft_max
    return expected_tokens(acceptance, k) / (k * costs.draft_step_ms + costs.verify(k + 1)) * costs.verify(1)


# --- running ------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    tokens: list[int]
    stats: GenerationStats
    wall_s: float
    finish_reason: str


class Bench:
    """One target, its draft, the configs: runs a prompt under each config."""

    def __init__(self, target: Model, draft: Model | str | None, configs: list[BenchConfig], max_tokens: int,
                 synthetic_acceptance: float | None, ignore_eos: bool, repeats: int) -> None:
        self.target, self.draft, self.configs = target, draft, configs
        self.max_tokens, self.repeats = max_tokens, repeats
        self.synthetic_acceptance = synthetic_acceptance
        self.ignore_eos = ignore_eos or synthetic_acceptance is not None

    def options(self, config: BenchConfig, prompt: BenchPrompt) -> dict:
        draft = {"mixed": self.draft, "model": self.draft, "ngram": "ngram", None: None}[config.draft]
        # seed: greedy decoding draws nothing, but synthetic acceptance does. Seeded per prompt, a run repeats and
        # prompts draw apart (unseeded, the CI test of the acceptance it yields failed one run in ~50).
        return dict(draft=draft, draft_max=config.draft_max, draft_policy=config.policy, temperature=0.0,
                    seed=zlib.crc32(prompt.name.encode()), synthetic_acceptance=self.synthetic_acceptance,
                    ignore_eos=self.ignore_eos, prompt_lookup=config.draft == "mixed")

    def generate(self, prompt: BenchPrompt, config: BenchConfig, max_tokens: int) -> Run:
        forget_prompts(self.target)  # every run reads its prompt, as a first request does
        self.target.synchronize()
        started = time.perf_counter()
        result = tandem.generate(self.target, messages=list(prompt.messages), max_tokens=max_tokens,
                                 **self.options(config, prompt))
        self.target.synchronize()
        return Run(result.tokens, result.stats, time.perf_counter() - started, result.finish_reason)

    def warm_up(self, prompt: BenchPrompt, config: BenchConfig) -> None:
        self.generate(prompt, config, min(self.max_tokens, WARMUP_TOKENS))

    def measure(self, prompt: BenchPrompt, on_run=None) -> tuple[dict[str, Run], dict[str, float]]:
        """Every config on one prompt, `repeats` rounds: each config's median run, and its median over rounds of
        its speed over plain's in the same round. Rounds interleave the configs and rotate their order, and a ratio
        within a round cancels drift slower than a round (clocks, a noisy neighbour)."""
        runs: dict[str, list[Run]] = {c.name: [] for c in self.configs}
        for r in range(self.repeats):
            for config in self.configs[r % len(self.configs):] + self.configs[:r % len(self.configs)]:
                if on_run is not None:
                    on_run(config)
                runs[config.name].append(self.generate(prompt, config, self.max_tokens))
        speedups = {}
        for name, rs in runs.items():
            ratios = [run.stats.tokens_per_second / plain.stats.tokens_per_second
                      for run, plain in zip(rs, runs["plain"], strict=True) if plain.stats.tokens_per_second]
            speedups[name] = statistics.median(ratios) if ratios else 1.0
        # The median run, whole: its counts and timings belong together.
        medians = {name: sorted(rs, key=lambda r: r.stats.tokens_per_second)[len(rs) // 2] for name, rs in runs.items()}
        return medians, speedups


def costs_for(target: Model, draft: Model | str | None, configs: list[BenchConfig]) -> dict[str, CostModel]:
    """The batch-1 costs per proposer kind the predictions use (cost_store.cached_costs: kept on the target and on
    disk)."""
    from tandem.engine.cost_store import cached_costs

    out = {}
    for kind in {c.draft for c in configs if c.draft is not None}:
        k_max = max(c.draft_max for c in configs if c.draft == kind)
        # mixed: predicted as the draft model's; its lookup iterations cost the same verify and nearly no draft
        out[kind] = cached_costs(target, draft if kind in ("model", "mixed") else None, k_max)
    return out


def fitting_prompts(target: Model, prompts: list[BenchPrompt]) -> tuple[list[BenchPrompt], list[str]]:
    """The prompts whose chat leaves the target's context room for a generated token, and a line for each other."""
    fits, skipped = [], []
    for prompt in prompts:
        n = len(target.tokenizer.encode_chat(list(prompt.messages)))
        if n < target.n_ctx:
            fits.append(prompt)
        else:
            skipped.append(f"{prompt.name}: {n} prompt tokens, the context holds {target.n_ctx}")
    return fits, skipped


def config_result(config: BenchConfig, run: Run, plain: Run | None, synthetic: bool, speedup: float) -> ConfigResult:
    """speedup: measured against plain round by round (Bench.measure)."""
    s = run.stats
    lossless = None if plain is None or synthetic else run.tokens == plain.tokens
    return ConfigResult(
        config=config.name, tps=s.tokens_per_second, decode_tps=s.decode_tokens_per_second,
        wall_tps=s.generated_tokens / run.wall_s if run.wall_s > 0 else 0.0, wall_s=run.wall_s,
        speedup=speedup,
        prompt_tokens=s.prompt_tokens, generated_tokens=s.generated_tokens, draft_tokens=s.draft_tokens,
        accepted_tokens=s.accepted_tokens, acceptance_rate=s.acceptance_rate,
        first_position_acceptance=first_position_acceptance(s), mean_accepted_len=s.mean_accepted_len,
        draft_ms_per_token=s.draft_ms_per_token, verify_ms=s.verify_ms_per_iteration, prefill_ms=s.prefill_ms,
        decode_ms=s.decode_ms, k_counts={str(k): v for k, v in sorted(s.draft_len_counts.items())},
        finish_reason=run.finish_reason, lossless=lossless, sources=s.sources, belief=s.belief,
    )


def _mean(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def summarize(prompts: list[PromptResult], configs: list[BenchConfig]) -> dict:
    per_config = {}
    for c in configs:
        rows = [p.configs[c.name] for p in prompts]
        drafted = sum(r.draft_tokens for r in rows)
        flags = [r.lossless for r in rows if r.lossless is not None]
        per_config[c.name] = {
            "mean_tps": statistics.fmean(r.tps for r in rows),
            "geomean_speedup": math.exp(statistics.fmean(math.log(max(r.speedup, 1e-9)) for r in rows)),
            "min_speedup": min(r.speedup for r in rows),
            "max_speedup": max(r.speedup for r in rows),
            "acceptance_rate": sum(r.accepted_tokens for r in rows) / drafted if drafted else 0.0,
            "draft_tokens": drafted,
            "all_lossless": all(flags) if flags else None,
            "mean_predicted_speedup": _mean([r.predicted_speedup for r in rows]),
            "mean_fraction_of_prediction": _mean([r.fraction_of_prediction for r in rows]),
        }
    primary = prompts[0].primary
    return {
        "primary": primary,
        "synthetic": prompts[0].synthetic,
        "baseline_tps": per_config["plain"]["mean_tps"],
        "spec_tps": per_config[primary]["mean_tps"],
        "speedup": per_config[primary]["geomean_speedup"],
        "configs": per_config,
    }


def run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from tandem.bench import report
    from tandem.synthetic.shapes import weight_bytes

    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    repeats = max(1, getattr(args, "repeats", 1) or 1)
    prompts = load_suite(args.suite, getattr(args, "prompts", None))
    shapes = synthetic_shapes(args)
    synthetic = shapes is not None or args.synthetic_acceptance is not None
    target = load_target(args)
    draft = load_draft(args, backend=target.backend)
    configs = parse_configs(args.configs, draft, args.draft_max)
    prompts, skipped = fitting_prompts(target, prompts)
    for line in skipped:
        print(f"tandem bench: skipping {line}", file=sys.stderr)
    if not prompts:
        raise ValueError(f"no prompt of the suite fits the context ({target.n_ctx} tokens): {'; '.join(skipped)}")
    bench = Bench(target, draft, configs, args.max_tokens, args.synthetic_acceptance,
                  getattr(args, "ignore_eos", False), repeats)
    peers = _load_peers(args, target, draft, shapes)
    target_bytes = weight_bytes(target)
    meta = {
        **environment(target), "backend": target.backend, "dtype": getattr(target, "dtype", None) and str(target.dtype),
        "target": target.path, "draft": draft.path if isinstance(draft, Model) else draft,
        "max_tokens": args.max_tokens, "repeats": repeats, "greedy": True, "suite": args.suite,
        "configs": [asdict(c) for c in configs], "ignore_eos": bench.ignore_eos,
        "synthetic_acceptance": args.synthetic_acceptance, "shapes": shapes,
        "weight_bytes": {"target": target_bytes, "draft": weight_bytes(draft) if isinstance(draft, Model) else None},
        "peers": {name: peer.describe() for name, peer in peers.items()},
        "skipped_prompts": skipped,
    }

    console = Console(stderr=True)
    total = len(configs) * len(prompts) * (1 + repeats)
    results: list[PromptResult] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("warm-up", total=total)
        # Every prompt, not just the first: a longer prompt reaches attention spans (CUDA graphs) and batch sizes
        # (Vulkan pipelines) that a first use would otherwise compile inside a timed run.
        for config in configs:
            for prompt in prompts:
                progress.update(task, description=f"warm-up {config.name}: {prompt.name}")
                bench.warm_up(prompt, config)
                progress.advance(task)
        costs = costs_for(target, draft, configs)
        for prompt in prompts:

            def on_run(config: BenchConfig, prompt: BenchPrompt = prompt) -> None:
                progress.update(task, description=f"{prompt.name}: {config.name}")
                progress.advance(task)

            runs, speedups = bench.measure(prompt, on_run)
            results.append(_prompt_result(prompt, configs, runs, speedups, costs, args.synthetic_acceptance, synthetic,
                                          target_bytes))
            for name, peer in peers.items():
                progress.update(task, description=f"{prompt.name}: peer {name}")
                results[-1].peers[name] = peer.run(target.tokenizer.encode_chat(list(prompt.messages)),
                                                   args.max_tokens)
            if args.json_out and len(results) < len(prompts):
                # The prompts so far, in case the run dies later (a rented GPU's time limit, a device error).
                _write_json(args.json_out, _document(meta, results, configs, synthetic, complete=False))

    out = _document(meta, results, configs, synthetic, complete=True)
    # A wide table: rich would squeeze it into 80 columns when stdout is a file or a pipe.
    report.print_table(out, console=Console(width=None if sys.stdout.isatty() else 170))
    if args.json_out:
        _write_json(args.json_out, out)
    if args.plot:
        report.plot(out, args.plot)
    return 0


def _document(meta: dict, results: list[PromptResult], configs: list[BenchConfig], synthetic: bool,
              complete: bool) -> dict:
    return {
        "synthetic": synthetic,
        "complete": complete,  # False: the run stopped before its last prompt; `prompts` holds the ones done
        "meta": meta,
        "prompts": [asdict(p) for p in results],
        "summary": summarize(results, configs),
    }


def _write_json(path: str, document: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(document, f, indent=2)


def _prompt_result(prompt: BenchPrompt, configs: list[BenchConfig], runs: dict[str, Run], speedups: dict[str, float],
                   costs: dict[str, CostModel], synthetic_acceptance: float | None, synthetic: bool,
                   target_bytes: int) -> PromptResult:
    plain = runs["plain"]
    rows = {}
    for c in configs:
        row = config_result(c, runs[c.name], None if c.name == "plain" else plain, synthetic, speedups[c.name])
        if c.draft is not None and c.draft in costs:
            a = synthetic_acceptance if synthetic_acceptance is not None else row.first_position_acceptance
            row.predicted_speedup = predicted_speedup(costs[c.draft], c, a)
            row.fraction_of_prediction = row.speedup / row.predicted_speedup if row.predicted_speedup else None
        rows[c.name] = row
    spec_configs = [c for c in configs if c.name != "plain"]
    primary = rows[spec_configs[0].name] if spec_configs else rows["plain"]
    per_token_s = plain.stats.decode_ms / 1000.0 / max(plain.stats.generated_tokens - 1, 1)
    return PromptResult(
        name=prompt.name, kind=prompt.kind, prompt_tokens=plain.stats.prompt_tokens, primary=primary.config,
        baseline_tps=rows["plain"].tps, spec_tps=primary.tps, speedup=primary.speedup,
        acceptance_rate=primary.acceptance_rate, mean_accepted_len=primary.mean_accepted_len,
        draft_ms_per_token=primary.draft_ms_per_token, verify_ms=primary.verify_ms, lossless=primary.lossless,
        configs=rows, synthetic=synthetic,
        plain_bandwidth_gb_s=target_bytes / per_token_s / 1e9 if target_bytes and plain.stats.decode_ms > 0 else None,
    )


def _load_peers(args: argparse.Namespace, target: Model, draft: Model | str | None, shapes) -> dict:
    peers = {}
    for name in args.peer:
        if name not in ("hf", "hf-static"):
            raise ValueError(f"unknown peer {name!r}; known: hf, hf-static")
        if shapes is not None:
            raise ValueError(f"--peer {name} needs GGUF files; it cannot run --synthetic-shape models")
        from tandem.bench.peers import HFPeer

        static = name == "hf-static"  # plain decoding only: assisted generation takes no static cache
        peers[name] = HFPeer(target.path, draft.path if isinstance(draft, Model) and not static else None,
                             args.device, compute_dtype(args), static=static)
    return peers
