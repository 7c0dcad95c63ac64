"""The llama.cpp backend in a worker process: the same logits, bit for bit, as in process (sequences, batched
caches, greedy plain, speculative and batched generation), no torch in the worker, and a clear error when it dies."""

from __future__ import annotations

import os
import signal

import pytest
import torch

pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.llamacpp

from conftest import K_QUANT_SHAPES, assert_speculated  # noqa: E402

import tandem  # noqa: E402
from tandem.backends.llamacpp_worker import WORKER_ENV, WorkerDiedError, WorkerModel, wants_worker  # noqa: E402
from tandem.engine import Engine, Request  # noqa: E402

IDS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 30, 201, 77, 8, 150, 23]
PROMPTS = ["def add(a, b):", "The quick brown fox", '{"name": "tandem",']


@pytest.fixture(scope="module", params=["Q4_K", "Q8_0"])
def pair(request, tiny_model_path):
    """(in-process target, worker target) of one file: Q4_K is repacked (two kernels), Q8_0 is not."""
    path = tiny_model_path(qtype=request.param, seed=5, **K_QUANT_SHAPES)
    local = tandem.load(path, backend="llama.cpp", n_ctx=256, isolation="none")
    remote = tandem.load(path, backend="llama.cpp", n_ctx=256, isolation="process")
    assert isinstance(remote, WorkerModel) and not isinstance(local, WorkerModel)
    yield local, remote
    local.close()
    remote.close()


def test_sequences_give_the_in_process_logits_bit_for_bit(pair):
    local, remote = pair
    assert remote.repacked == local.weights.repacked and remote.k_q8 == local.k_q8
    out = []
    for model in pair:
        seq = model.new_sequence()
        rows = [seq.forward(IDS[:10], logits="last"), seq.forward(IDS[10:14]), seq.forward(IDS[14:15])]
        seq.rewind(11)
        rows.append(seq.forward(IDS[11:16]))
        assert seq.length == 16
        seq.close()
        out.append(rows + [model.logits(IDS)])
    for a, b in zip(*out, strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b)


def test_batched_caches_give_the_in_process_logits_bit_for_bit(pair):
    out = []
    for model in pair:
        cache = model.new_batched_cache(3, 64)
        rows = cache.forward([(0, IDS[:9]), (2, IDS[3:6])], [True, False])
        rows += cache.forward([(0, IDS[9:12]), (2, IDS[6:7])], [False, False])
        cache.rewind(0, 10)
        cache.copy_prefix(0, 1, 8)
        rows += cache.forward([(1, IDS[8:13]), (0, IDS[10:11])], [False, True])
        settled = [cache.settle(1, IDS[:16], 4), cache.length(1), cache.reusable(1, cache.length(1))]
        rows += cache.forward([(1, IDS[cache.length(1) : 16])], [True])
        out.append((rows, [cache.length(s) for s in range(3)], cache.prefill_align, cache.reusable(0, 11), settled))
        cache.close()
    (rows_a, *rest_a), (rows_b, *rest_b) = out
    assert rest_a == rest_b
    assert rest_a[-1] == ([4, 12, 12] if rest_a[1] == 4 else [0, 13, 13])  # repacked: rows 8-11 settled, 4 to go
    for a, b in zip(rows_a, rows_b, strict=True):
        assert torch.equal(a, b)


def test_a_forward_picking_greedy_rows_gives_their_argmax(pair, monkeypatch):
    """BatchedCache.forward_picking: a picked entry comes back as its rows' argmax (taken in the worker, no rows
    copied back), the others as their logits, in process and in the worker alike. The worker's rewinds ride on the
    next request: one round trip for three rewinds and a forward."""
    from tandem.backends.llamacpp_process import WorkerProcess
    from tandem.sampling import argmax

    requests = []
    call = WorkerProcess.call
    monkeypatch.setattr(WorkerProcess, "call", lambda self, *a, **k: requests.append(a[0]) or call(self, *a, **k))
    batch, last_only = [(0, IDS[:5]), (1, IDS[5:9]), (2, IDS[9:16])], [False, False, True]
    for model in pair:
        cache = model.new_batched_cache(3, 64)
        logits = cache.forward(batch, last_only)
        for picks in ([True, False, True], [True, True, True]):
            requests.clear()
            for slot in range(3):
                cache.rewind(slot, 0)
            rows = cache.forward_picking(batch, last_only, picks)
            assert requests == ([] if model is pair[0] else ["batch_forward"])
            assert [cache.length(s) for s in range(3)] == [5, 4, 7]
            for got, want, pick in zip(rows, logits, picks, strict=True):
                assert torch.equal(got, argmax(want) if pick else want) and (got.dtype == torch.long) == pick
        cache.close()


def test_greedy_plain_speculative_and_batched_generation_equal_in_process(pair, tiny_model_path):
    local, remote = pair
    # A draft that agrees in part (as in test_llamacpp_backend): the K-quant writer draws random blocks, so there
    # the same file with another RoPE base; else the same weights in Q4_0.
    k_quant = local.weights.repacked  # the Q4_K file (Q8_0 is not repacked)
    draft_path = tiny_model_path(qtype="Q4_K", seed=5, rope_base=300_000.0, **K_QUANT_SHAPES) if k_quant else \
        tiny_model_path(qtype="Q4_0", seed=5, **K_QUANT_SHAPES)
    draft = tandem.load(draft_path, backend="llama.cpp", n_ctx=256, isolation="process")
    assert draft.worker is remote.worker  # one worker serves every model of the process
    specs = []
    for prompt in PROMPTS:
        plain = tandem.generate(local, prompt=prompt, max_tokens=24)
        assert tandem.generate(remote, prompt=prompt, max_tokens=24).tokens == plain.tokens
        spec = tandem.generate(remote, prompt=prompt, draft=draft, draft_max=3, draft_policy="fixed", max_tokens=24)
        assert spec.tokens == plain.tokens
        specs.append(spec.stats)
    assert_speculated(*specs)
    expected = [tandem.generate(local, prompt=p, max_tokens=16).tokens for p in PROMPTS]
    engine = Engine(remote, draft, slots=2, draft_max=3, prefill_chunk=5)
    requests = [Request(remote.tokenizer.encode(p), max_tokens=16, draft_policy="fixed") for p in PROMPTS]
    assert [r.tokens for r in engine.generate(requests)] == expected
    draft.close()


@pytest.mark.parametrize("steady", [False, True])
def test_greedy_drafts_next_to_the_model_are_the_drafters_own(pair, tiny_model_path, monkeypatch, steady):
    """Drafter.draft through BatchedCache.greedy_drafts (a step's drafting in one call: in the worker, no round trip
    and no logits row back a draft token) proposes the drafts its loop through forward does, in as many forwards,
    in process and in the worker, with steady shapes (llama.cpp's CUDA graphs: catch-ups of two tokens, sequences
    done drafting on) or not; the output is the target's alone."""
    from tandem.engine.drafter import Drafter

    local, remote = pair
    draft_path = tiny_model_path(qtype="Q4_0", seed=5, **K_QUANT_SHAPES)
    expected = [tandem.generate(local, prompt=p, max_tokens=20).tokens for p in PROMPTS]
    draft_of = Drafter.draft
    for target in (local, remote):
        draft = tandem.load(draft_path, backend="llama.cpp", n_ctx=256,
                            isolation="process" if isinstance(target, WorkerModel) else "none")
        draft.steady_shapes = steady
        runs = []
        for fused in (True, False):
            cache_type = type(draft.new_batched_cache(1, 32))
            monkeypatch.setattr(cache_type, "drafts_greedy", fused)
            proposed = []
            def draft_step(self, *args, proposed=proposed, **kwargs):  # drafts by sequence order (ids differ)
                proposals, forwards = draft_of(self, *args, **kwargs)
                proposed.append(([drafts for drafts, _ in proposals.values()], forwards))
                return proposals, forwards

            monkeypatch.setattr(Drafter, "draft", draft_step)
            engine = Engine(target, draft, slots=3, draft_max=3, prefill_chunk=5)
            requests = [Request(target.tokenizer.encode(p), max_tokens=20, draft_policy="fixed", draft_max=k)
                        for p, k in zip(PROMPTS, (3, 1, 2), strict=True)]
            runs.append(([r.tokens for r in engine.generate(requests)], proposed))
            engine.drafter.close()
        assert runs[0] == runs[1] and runs[0][0] == expected
        assert len(runs[0][1]) >= 6 and any(len(drafts) == 3 for drafts, _ in runs[0][1])
        draft.close()


def test_last_drafts_fed_beside_the_verify_spare_the_catch_up_and_change_no_draft(pair, tiny_model_path,
                                                                                   monkeypatch):
    """Where the target's cache overlaps the draft's (a GPU) and the costs say it pays, each drafting sequence's
    last draft goes to the draft beside the verify (BatchedCache.forward_picking's alongside): a sequence whose
    drafts all passed then drafts from its bonus token alone. Forced here on the CPU, in process and in the worker,
    with a draft that agrees in part (its last drafts rejected and forgotten) and one that always agrees (the
    target's own file): the drafts are the ones drafted without it, the output the target's alone, in a draft
    forward less after each step whose drafts all passed; with several sequences too."""
    from tandem.engine.drafter import Drafter

    local, remote = pair
    expected = [tandem.generate(local, prompt=p, max_tokens=20).tokens for p in PROMPTS]
    draft_of = Drafter.draft
    for target in (local, remote):
        for draft_path in (tiny_model_path(qtype="Q4_0", seed=5, **K_QUANT_SHAPES), local.path):
            draft = tandem.load(draft_path, backend="llama.cpp", n_ctx=256,
                                isolation="process" if isinstance(target, WorkerModel) else "none")
            draft.steady_shapes = True  # a catch-up of two tokens in two forwards, as on a GPU
            cache_type = type(draft.new_batched_cache(1, 32))
            forward_picking = cache_type.forward_picking
            runs = []
            for ahead in (False, True):
                monkeypatch.setattr(cache_type, "overlaps", lambda self, other, ahead=ahead: ahead)
                proposed, fed = [], []

                def draft_step(self, *args, proposed=proposed, **kwargs):
                    proposals, forwards = draft_of(self, *args, **kwargs)
                    proposed.append(([drafts for drafts, _ in proposals.values()], forwards))
                    return proposals, forwards

                def picking(self, batch, last_only, picks, alongside=None, fed=fed, forward_picking=forward_picking):
                    fed.append(alongside is not None and self.overlaps(alongside[0]))  # beside the verify
                    return forward_picking(self, batch, last_only, picks, alongside)

                monkeypatch.setattr(Drafter, "draft", draft_step)
                monkeypatch.setattr(cache_type, "forward_picking", picking)
                engine = Engine(target, draft, slots=1, draft_max=3, prefill_chunk=5)
                if ahead:
                    engine.costs.ahead_ms = {1: 0.0}  # where the target's cache overlaps, the costs say it pays
                    engine.costs.decide_feeding_ahead()
                requests = [Request(target.tokenizer.encode(p), max_tokens=20, draft_policy="fixed")
                            for p in PROMPTS]
                results = engine.generate(requests)
                all_passed = sum(r.stats.accepted_per_position[2] for r in results)  # steps whose 3 drafts passed
                runs.append(([r.tokens for r in results], proposed, fed, all_passed))
                engine.drafter.close()
            (tokens, proposed, fed_not, all_passed), (tokens_ahead, proposed_ahead, fed_ahead, _) = runs
            assert tokens == tokens_ahead == expected
            assert [d for d, _ in proposed] == [d for d, _ in proposed_ahead] and len(proposed) >= 6
            assert not any(fed_not) and sum(fed_ahead) >= len(proposed) - len(PROMPTS)
            # A step drafts in 3 forwards; without feeding ahead, one after a step whose drafts all passed takes in
            # two tokens first, in a forward more (not after a request's last step)
            spared = sum(f for _, f in proposed if f) - sum(f for _, f in proposed_ahead if f)
            assert all_passed - len(PROMPTS) <= spared <= all_passed
            if draft_path == local.path:
                assert spared >= len(proposed) - 2 * len(PROMPTS)

            engine = Engine(target, draft, slots=3, draft_max=3, prefill_chunk=5)
            engine.costs.ahead_ms = {1: 0.0, 2: 0.0, 3: 0.0}
            engine.costs.decide_feeding_ahead()
            fed_ahead.clear()
            requests = [Request(target.tokenizer.encode(p), max_tokens=20, draft_policy="fixed", draft_max=k)
                        for p, k in zip(PROMPTS, (3, 1, 2), strict=True)]
            assert [r.tokens for r in engine.generate(requests)] == expected and any(fed_ahead)
            engine.drafter.close()
            draft.close()


def test_greedy_drafts_past_the_context_fail_clearly_and_change_nothing(pair):
    """A step's drafting whose feeds would pass a slot's capacity, each feed fitting alone but not together, or a
    slot named twice in one feed, is refused before anything runs, in process and in the worker alike."""
    from tandem.backends.base import ContextOverflowError

    for model in pair:
        cache = model.new_batched_cache(2, 16)
        cache.forward([(0, IDS[:14])], [True])
        with pytest.raises(ContextOverflowError, match="slot 0"):
            cache.greedy_drafts([[(0, IDS[:2])], [(0, IDS[2:3])]], [1], model.vocab_size, steady=True)
        with pytest.raises(ValueError, match="at most once"):
            cache.greedy_drafts([[(1, IDS[:1]), (1, IDS[1:2])]], [1, 1], model.vocab_size, steady=False)
        assert [cache.length(s) for s in range(2)] == [14, 0]
        drafts, forwards = cache.greedy_drafts([[(0, IDS[14:15])]], [2], model.vocab_size, steady=False)
        assert len(drafts[0]) == 2 and forwards == 2 and cache.length(0) == 16
        cache.close()


def test_the_worker_never_imports_torch_and_loads_llamacpp_before_numpy(pair):
    _, remote = pair
    assert remote.worker.call("imports") == ["llama_cpp.llama_cpp", "numpy"]  # numpy first: CUDA load crashed


def test_a_dead_worker_fails_every_request_with_a_clear_error(tiny_model_path, caplog):
    model = tandem.load(tiny_model_path(qtype="Q8_0", seed=7, **K_QUANT_SHAPES), backend="llama.cpp", n_ctx=64,
                        isolation="process")
    engine = Engine(model, None, slots=2)
    engine.add(Request(model.tokenizer.encode("hello there"), max_tokens=8))
    engine.step()
    pid = model.worker_pid
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerDiedError, match=rf"pid {pid}\) died \(signal 9 \(SIGKILL\)\)"):
        engine.step()
    assert any("died" in r.getMessage() for r in caplog.records)  # the server's log says so once
    with pytest.raises(WorkerDiedError):  # at once: nothing waits on a dead process
        model.new_sequence()
    model.close()
    # A crash inside llama.cpp (as the CUDA runtime clash was) reads the same; a new model gets a new worker.
    model = tandem.load(tiny_model_path(qtype="Q8_0", seed=7, **K_QUANT_SHAPES), backend="llama.cpp", n_ctx=64,
                        isolation="process")
    assert model.worker_pid != pid
    with pytest.raises(WorkerDiedError, match=r"\(SIGSEGV\)\) during 'crash'"):
        model.worker.call("crash")
    model.close()


def test_worker_errors_come_back_as_the_in_process_ones(tiny_model_path):
    model = tandem.load(tiny_model_path(qtype="Q8_0", seed=7, **K_QUANT_SHAPES), backend="llama.cpp", n_ctx=64,
                        isolation="process")
    with pytest.raises(ValueError, match="unknown device"):
        tandem.load(model.path, backend="llama.cpp", device="tpu", isolation="process")
    assert model.new_sequence().forward([1, 2, 3]).shape == (3, model.vocab_size)  # the worker still serves
    model.close()


def test_when_llamacpp_runs_in_a_worker(monkeypatch):
    monkeypatch.delenv(WORKER_ENV, raising=False)
    assert wants_worker("cuda") and wants_worker("cuda:1") and wants_worker("cpu", "process")
    assert not wants_worker("cuda", "none")
    assert not wants_worker("cpu")  # this machine: a CPU build of llama.cpp
    monkeypatch.setenv(WORKER_ENV, "1")
    assert wants_worker("cpu", "none")
    monkeypatch.setenv(WORKER_ENV, "0")
    assert not wants_worker("cuda")
    monkeypatch.setenv(WORKER_ENV, "yes")
    with pytest.raises(ValueError, match=WORKER_ENV):
        wants_worker("cpu")
    with pytest.raises(ValueError, match="isolation"):
        wants_worker("cpu", "thread")


def test_the_doctor_times_the_draft_as_the_engine_drafts(pair, monkeypatch):
    """doctor.time_draft_steps times a drafting step as the engine runs a lone greedy sequence's: in the worker one
    request for its k drafts and one for the verify after them, the rewinds riding on the next request; the idle
    target's steps and the paired ones take turns in blocks."""
    from tandem.backends.llamacpp_process import WorkerProcess
    from tandem.bench.doctor import STEPS_PER_REPEAT, WARMUP_STEPS, time_draft_steps

    requests = []
    call = WorkerProcess.call
    monkeypatch.setattr(WorkerProcess, "call", lambda self, *a, **k: requests.append(a[0]) or call(self, *a, **k))
    _, remote = pair

    def timed(target, verifying) -> list[str]:
        requests.clear()
        ms = time_draft_steps(remote, target, k=3, repeats=2, context=8, verifying=verifying)
        assert len(ms) == len(verifying) and all(m > 0 for m in ms)
        return [r for r in requests if r in ("batch_forward", "batch_greedy_drafts")]

    prefill = ["batch_forward"] * 2
    runs = WARMUP_STEPS + 2 * STEPS_PER_REPEAT
    assert timed(remote, (True,)) == prefill + ["batch_greedy_drafts", "batch_forward"] * runs
    assert timed(None, (True,)) == ["batch_forward"] + ["batch_greedy_drafts"] * runs
    idle = ["batch_greedy_drafts"] * STEPS_PER_REPEAT
    paired = ["batch_greedy_drafts", "batch_forward"] * STEPS_PER_REPEAT
    # idle's first WARMUP_STEPS untimed: after two blocks each, idle takes that many more
    assert timed(remote, (False, True)) == prefill + (idle + paired) * 2 + idle[:WARMUP_STEPS]
