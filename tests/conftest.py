"""Shared fixtures and checks: tiny random GGUF files built once per session, the real pair pulled once through the
registry (the `real` marker), `assert_speculated`, which every speculative == plain test calls, and the drafting
guard: a test that gave the engine a draft or prompt lookup and got no drafted token back fails (issue 51)."""

from __future__ import annotations

import os

import pytest
import torch

# Tiny models are all small kernels: with two OpenMP threads on a busy 2-core machine each one waits on the
# other's barrier (seen here: 1.4 ms a forward with one thread, 210 ms with two).
torch.set_num_threads(1)

# Settings that make a tiny file valid for the K-quants (rows must be multiples of 256 values).
K_QUANT_SHAPES = dict(d_model=256, d_ffn=512, n_heads=4, n_kv_heads=2, head_dim=64)


# A JSON schema with every value bounded (string lengths, an integer range, enums, an array's length), so even a
# random-weight model finishes the object well within a few hundred tokens: a test can require a complete document.
BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}


def count_batches(engine) -> list[int]:
    """Records the number of sequences in every target forward the engine runs (a list that grows as it runs)."""
    sizes, forward = [], engine.target_kv.forward_picking

    def recording(batch, *args, **kwargs):
        sizes.append(len(batch))
        return forward(batch, *args, **kwargs)

    engine.target_kv.forward_picking = recording
    return sizes


def record_verifies(monkeypatch, verify) -> dict[tuple[int, int], int]:
    """Routes the engine's sampled verification through `verify`, counting each call's (drafts, accepted): the dict
    it returns fills as the engine runs."""
    from tandem.engine import outcomes as outcomes_module

    outcomes: dict[tuple[int, int], int] = {}

    def recording(draft_tokens, draft_probs, target_probs, generator):
        n_accepted, token = verify(draft_tokens, draft_probs, target_probs, generator)
        key = (draft_tokens.shape[0], int(n_accepted))
        outcomes[key] = outcomes.get(key, 0) + 1
        return n_accepted, token

    monkeypatch.setattr(outcomes_module, "verify_sampled", recording)
    return outcomes


def sample_with_drafts(engine, prompt_ids: list[int], sampling: dict, n_samples: int, n_generated: int,
                       draft_maxes: list[int], monkeypatch, verify, **request_options) -> tuple[dict, dict]:
    """n_samples generations of prompt_ids, engine.slots at a time, request i seeded i and drafting a fixed
    draft_maxes[i % len] tokens from the engine's draft model, verified by `verify`: ({sequence: count},
    {(drafts, accepted): verifies}). Every request must have speculated, some drafts rejected."""
    from tandem.engine import Request
    from tandem.sampling import SamplingParams

    def model_drafted(draft_tokens, draft_probs, target_probs, generator):
        assert draft_tokens.shape[0] == 0 or draft_probs is not None  # drafted by the model, not looked up
        return verify(draft_tokens, draft_probs, target_probs, generator)

    outcomes = record_verifies(monkeypatch, model_drafted)
    counts, stats = {}, []
    for start in range(0, n_samples, engine.slots):
        requests = [Request(prompt_ids, SamplingParams(seed=seed, **sampling), max_tokens=n_generated,
                            ignore_eos=True, draft_max=draft_maxes[seed % len(draft_maxes)], draft_policy="fixed",
                            **request_options)
                    for seed in range(start, start + engine.slots)]
        for result in engine.generate(requests):
            counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
            stats.append(result.stats)
    monkeypatch.undo()
    assert_speculated(*stats, rejected=True)
    return counts, outcomes


HEAD_PROMPTS = ["def add(a, b):\n    return", "The quick brown fox", "hi"]
HEAD_BIAS = {300: 30.0, 301: 30.0}  # two single characters of the tiny vocabularies: a target and its head agree


def check_head_greedy_is_plain(target, head) -> None:
    """Greedy with a head draft, alone and batched, is the target alone; with nothing to agree on (no bias) every
    draft is rejected and the output is the target's all the same."""
    import tandem

    plain = [tandem.generate(target, prompt=p, max_tokens=24, logit_bias=HEAD_BIAS).tokens for p in HEAD_PROMPTS]
    alone = [tandem.generate(target, prompt=p, max_tokens=24, logit_bias=HEAD_BIAS, draft=head,
                             draft_policy="fixed", draft_max=3) for p in HEAD_PROMPTS]
    batched = tandem.generate(target, prompts=HEAD_PROMPTS, max_tokens=24, logit_bias=HEAD_BIAS, draft=head,
                              draft_policy="fixed", draft_max=4)
    assert [r.tokens for r in alone] == plain
    assert [r.tokens for r in batched] == plain
    assert {r.stats.draft_kind for r in alone + batched} == {"head"}
    assert_speculated(*(r.stats for r in alone + batched), rejected=True)
    unbiased = tandem.generate(target, prompt=HEAD_PROMPTS[1], max_tokens=16, draft=head, draft_policy="fixed")
    assert unbiased.tokens == tandem.generate(target, prompt=HEAD_PROMPTS[1], max_tokens=16).tokens
    assert_speculated(unbiased.stats, accepted=False)


def check_head_greedy_catches_a_kept_rejection(target, head, monkeypatch) -> None:
    """Control for check_head_greedy_is_plain: a verify that keeps the first draft whether or not the target
    agrees drifts from plain decoding."""
    import tandem
    from tandem.engine import outcomes
    from tandem.speculative.verify import verify_greedy

    def keeps_the_first(draft_tokens, target_tokens):
        n, tokens = verify_greedy(draft_tokens, target_tokens)
        return (1, draft_tokens[:1] + [target_tokens[1]]) if n == 0 and draft_tokens else (n, tokens)

    plain = [tandem.generate(target, prompt=p, max_tokens=24, logit_bias=HEAD_BIAS).tokens for p in HEAD_PROMPTS]
    monkeypatch.setattr(outcomes, "verify_greedy", keeps_the_first)
    wrong = tandem.generate(target, prompts=HEAD_PROMPTS, max_tokens=24, logit_bias=HEAD_BIAS, draft=head,
                            draft_policy="fixed", draft_max=4)
    assert [r.tokens for r in wrong] != plain


def check_adaptive_head_is_plain(target, head, monkeypatch, tmp_path) -> None:
    """The adaptive policy drafts with a head where drafting pays (a GPU's costs) and stays the target alone."""
    import tandem
    from tandem.engine import Engine, Request
    from tandem.logits.options import logits_settings

    cheap_drafting(monkeypatch, tmp_path)  # costs as a GPU's: drafting pays on acceptance alone
    engine = Engine(target, head, slots=3, draft_max=4, prompt_lookup=False)
    logits = logits_settings(logit_bias=HEAD_BIAS, vocab=target.vocab_size)
    results = engine.generate([Request(target.tokenizer.encode(p), max_tokens=40, logits=logits)
                               for p in HEAD_PROMPTS])
    plain = [tandem.generate(target, prompt=p, max_tokens=40, logit_bias=HEAD_BIAS).tokens for p in HEAD_PROMPTS]
    assert [r.tokens for r in results] == plain
    assert_speculated(*(r.stats for r in results), rejected=True)


def load_llamacpp_pair(tiny_model_path, seed: int, n_ctx: int):
    """A tiny Q8_0 target and the same weights in Q4_0 as its draft, both on llama.cpp (one thread each)."""
    import tandem

    target, draft = (tandem.load(tiny_model_path(qtype=qtype, seed=seed, **K_QUANT_SHAPES), backend="llama.cpp",
                                 n_ctx=n_ctx, n_threads=1) for qtype in ("Q8_0", "Q4_0"))
    assert target.backend == draft.backend == "llama.cpp"
    return target, draft


# Set by .ci/run: where the real pair cannot be pulled, its tests fail instead of skipping (CI must run them).
REQUIRE_REAL_ENV = "TANDEM_REQUIRE_REAL"


def pytest_configure(config: pytest.Config) -> None:
    # Also declared in pyproject.toml; repeated so the marker is known when pytest runs without it.
    config.addinivalue_line("markers", "real: needs the real model pair from the registry (slow, ~1.6 GB)")
    config.addinivalue_line("markers", f"{NO_DRAFTS_MARK}(reason): the test may pass a draft or prompt lookup and "
                                       "get no drafted token back (the drafting guard lets it pass)")
    # Costs the adaptive policy measures for the tests' models stay out of the user's $TANDEM_HOME.
    import tempfile

    os.environ.setdefault("TANDEM_COSTS", tempfile.mkdtemp(prefix="tandem-costs-"))


_REAL_OUTCOMES: dict[str, str] = {}  # nodeid -> "passed" | "failed" | "skipped" of each real-model test run


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "real" not in report.keywords:
        return
    if report.when == "call" or report.outcome != "passed":  # a setup skip or error counts; a passed setup does not
        _REAL_OUTCOMES[report.nodeid] = report.outcome


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    outcomes = _REAL_OUTCOMES
    counts = {kind: sum(1 for o in outcomes.values() if o == kind) for kind in ("passed", "failed", "skipped")}
    terminalreporter.write_line(
        f"real-model tests: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    )


def _draft_counts(stats) -> tuple[int, int]:
    """(drafted, accepted) from a GenerationStats, a server response's `timings` or a bench config's dict."""
    if isinstance(stats, dict):
        if "draft_n" in stats:
            return stats["draft_n"], stats["draft_n_accepted"]
        return stats["draft_tokens"], stats["accepted_tokens"]
    return stats.draft_tokens, stats.accepted_tokens


def assert_speculated(*stats, accepted: bool = True, rejected: bool = False) -> tuple[int, int]:
    """Speculation really happened in these generations (summed): drafts were proposed, and some were accepted
    (accepted=True) and/or some rejected (rejected=True).

    Without this a "speculative == plain" test proves nothing: with no drafts it compares plain with plain, and with
    no accepted draft every verify keeps only the target's own token. Rejections are what a verifier that accepts
    one draft too many would get wrong. Returns (drafted, accepted).
    """
    drafted = accepted_n = 0
    for s in stats:
        d, a = _draft_counts(s)
        drafted, accepted_n = drafted + d, accepted_n + a
    assert drafted > 0, "no draft token was proposed: this compared plain decoding with itself"
    if accepted:
        assert accepted_n > 0, f"none of {drafted} draft tokens was accepted"
    if rejected:
        assert accepted_n < drafted, f"all {drafted} draft tokens were accepted: no rejection was exercised"
    return drafted, accepted_n


def cheap_drafting(monkeypatch, costs_dir) -> None:
    """The engine's costs as a GPU's where drafting is all but free, and kept so (nothing learnt from the loop):
    the adaptive policy then drafts on acceptance alone, so what a test checks does not hang on this machine's
    timing (a same-size tiny draft never pays on measured costs). Costs are kept in `costs_dir`, apart from the
    measured ones other tests keep."""
    from tandem.engine import calibration, cost_store
    from tandem.engine.costs import BatchCosts, CostModel

    def measure(target, draft, k_max, synchronize):
        batches = sorted({2**i for i in range(target.slots.bit_length())} | {target.slots})
        return BatchCosts(verify={b: CostModel(0.0, {b: 1.0, b * (k_max + 1): 1.0}) for b in batches},
                                  draft_step={b: 1e-3 for b in batches}, catch_up_ms_per_token=1e-3)

    monkeypatch.setenv(cost_store.COSTS_DIR_ENV, str(costs_dir))
    monkeypatch.setattr(calibration, "measure", measure)
    for name in ("observe_draft", "observe_iteration", "observe_yield"):
        monkeypatch.setattr(BatchCosts, name, lambda self, *args: None)


# --- the drafting guard ---------------------------------------------------------------------------------------

NO_DRAFTS_MARK = "no_drafts_expected"


class DraftLedger:
    """The engine's generations that a test started and could have drafted (a draft model or prompt lookup, a
    draft length above 0, room for a draft, at least one decoding step), and the draft tokens they got."""

    def __init__(self) -> None:
        self.could_draft = 0
        self.drafted = 0

    def retire(self, gen) -> None:
        if gen.finish_reason is None or gen.proposer is None or gen.draft_max == 0 or gen.stats.iterations == 0:
            return  # cancelled, or it had nothing to draft with or no step to draft in
        if gen.request.max_tokens <= 2:
            return  # the prefill's token and one more: no room for a draft and the target's token after it
        self.could_draft += 1
        self.drafted += gen.stats.draft_tokens


@pytest.fixture(autouse=True)
def draft_ledger(request: pytest.FixtureRequest):
    """Counts, for the drafting guard (pytest_runtest_call below), what the engine drafted for this test's
    generations. Generations are tagged with the test's ledger when added, so a server thread retiring an earlier
    test's request, or this test's after it ended, counts for no one."""
    from tandem.engine import engine as engine_module

    ledger = DraftLedger()
    add, retire = engine_module.Engine.add, engine_module.Engine._retire

    def tagging_add(self, req):
        gen = add(self, req)
        gen.draft_ledger = ledger
        return gen

    def counting_retire(self, gen):
        if getattr(gen, "draft_ledger", None) is ledger:
            ledger.retire(gen)
        return retire(self, gen)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module.Engine, "add", tagging_add)
        patch.setattr(engine_module.Engine, "_retire", counting_retire)
        request.node.draft_ledger = ledger
        yield ledger


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield  # a test that failed fails as it did
    ledger = getattr(item, "draft_ledger", None)
    if ledger is not None and ledger.could_draft and not ledger.drafted and \
            item.get_closest_marker(NO_DRAFTS_MARK) is None:
        pytest.fail(f"{ledger.could_draft} generation(s) had a draft or prompt lookup and drafted no token: this "
                    f"compared plain decoding with itself. Make it draft (draft_policy='fixed', "
                    f"measure_costs=False, cheap_drafting) or mark it @pytest.mark.{NO_DRAFTS_MARK}(reason).",
                    pytrace=False)
    return result


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory):
    """Factory: tiny_model_path(arch="qwen2", qtype="F32", **kw) -> path of a cached random-weight GGUF.

    K-quant qtypes get K_QUANT_SHAPES unless the caller passes shapes.
    """
    from tandem.synthetic.tiny_gguf import write_tiny_gguf

    root = tmp_path_factory.mktemp("tiny_gguf")
    cache: dict[tuple, str] = {}

    def make(arch: str = "qwen2", qtype: str = "F32", **kw) -> str:
        if qtype.endswith("_K"):
            kw = {**K_QUANT_SHAPES, **kw}
        key = (arch, qtype, tuple(sorted((k, repr(v)) for k, v in kw.items())))
        if key not in cache:
            path = os.path.join(root, f"{arch}-{qtype}-{len(cache)}.gguf")
            cache[key] = write_tiny_gguf(path, arch=arch, qtype=qtype, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="module")
def pair64(tiny_model_path):
    """float64 target and a draft that mostly agrees with it (same weights, quantized to Q4_0); one per module."""
    import tandem

    target = tandem.load(tiny_model_path(seed=0), dtype="float64")
    draft = tandem.load(tiny_model_path(qtype="Q4_0", seed=0), dtype="float64")
    return target, draft


def exact_distribution(target, prompt_ids: list[int], params, n_tokens: int) -> dict[tuple[int, ...], float]:
    """P(t1, ..., tn) of the target's next n_tokens under sampling params, by enumerating the tree of the tokens
    each position may sample (top-k keeps it small): {sequence: probability}."""
    from tandem.sampling import probs_from_logits

    dist = {(): 1.0}
    for _ in range(n_tokens):
        grown = {}
        for prefix, mass in dist.items():
            probs = probs_from_logits(target.logits(prompt_ids + list(prefix))[-1:], params)[0]
            for token in torch.nonzero(probs > 0).flatten().tolist():
                grown[prefix + (token,)] = mass * float(probs[token])
        dist = grown
    return dist


@pytest.fixture(scope="session")
def real_pair() -> tuple[str, str]:
    """(target path, draft path) of the default pair, pulled through the registry once per session (honours
    $TANDEM_HOME). A clean machine pulls it here, so real-model tests run in CI instead of skipping."""
    from tandem.loading import registry

    try:
        return registry.pull(registry.DEFAULT_TARGET, progress=False), registry.pull(registry.DEFAULT_DRAFT,
                                                                                    progress=False)
    except registry.RegistryError as e:  # no network and no cached copy
        if os.environ.get(REQUIRE_REAL_ENV):
            raise
        pytest.skip(f"the real pair could not be pulled: {e}")
