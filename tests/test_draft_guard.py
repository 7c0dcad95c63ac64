"""The drafting guard (conftest.py, issue 51 item 4): a test that gives the engine a draft or prompt lookup and gets
no drafted token back fails, unless marked no_drafts_expected. Checked on planted tests run by a pytest of their own
with this suite's conftest as its plugin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from conftest import NO_DRAFTS_MARK

import tandem
from tandem.engine import Engine, Request

PLANTED = textwrap.dedent(f"""
    import pytest

    import tandem
    from tandem.engine import Engine, Request


    def generate(tiny_model_path, draft, speculation_off=False, **request):
        target = tandem.load(tiny_model_path(seed=0), dtype="float64")
        engine = Engine(target, draft, slots=1, draft_max=4, measure_costs=False)
        if speculation_off:  # the regression the guard is for: every plan is plain
            engine.policy.plan = lambda decoding, prefill_rows: [0] * len(decoding)
        ids = target.tokenizer.encode("abc abc abc abc abc abc")
        return engine.generate([Request(ids, max_tokens=12, draft_policy="fixed", **request)])[0]


    def test_speculation_silently_off(tiny_model_path):
        generate(tiny_model_path, "ngram", speculation_off=True)


    def test_speculation_silently_off_and_failing(tiny_model_path):
        generate(tiny_model_path, "ngram", speculation_off=True)
        assert False, "its own failure"


    @pytest.mark.{NO_DRAFTS_MARK}("planted: says it drafts nothing")
    def test_marked(tiny_model_path):
        generate(tiny_model_path, "ngram", speculation_off=True)


    def test_drafting(tiny_model_path):
        assert generate(tiny_model_path, "ngram").stats.draft_tokens > 0


    def test_plain(tiny_model_path):
        generate(tiny_model_path, None)


    def test_speculation_not_asked_for(tiny_model_path):
        generate(tiny_model_path, "ngram", speculate=False)
        generate(tiny_model_path, "ngram", draft_max=0)
""")


def test_the_guard_fails_a_test_that_drafted_nothing(tmp_path):
    (tmp_path / "test_planted.py").write_text(PLANTED)
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests_dir, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", "-rA",
                          "--rootdir", str(tmp_path), str(tmp_path / "test_planted.py")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = run.stdout.splitlines()
    outcomes = {line.split()[1].split("::")[-1]: line.split()[0] for line in lines
                if line.startswith(("PASSED ", "FAILED ", "ERROR "))}
    assert outcomes == {"test_speculation_silently_off": "FAILED",
                        "test_speculation_silently_off_and_failing": "FAILED",
                        "test_marked": "PASSED", "test_drafting": "PASSED", "test_plain": "PASSED",
                        "test_speculation_not_asked_for": "PASSED"}, run.stdout[-3000:] + run.stderr[-3000:]
    assert "1 generation(s) had a draft or prompt lookup and drafted no token" in run.stdout
    assert "its own failure" in run.stdout  # a failing test keeps its own failure, not the guard's


def test_the_ledger_counts_this_tests_generations(tiny_model_path, draft_ledger):
    target = tandem.load(tiny_model_path(seed=0), dtype="float64")
    ids = target.tokenizer.encode("abc abc abc abc abc abc")
    engine = Engine(target, "ngram", slots=1, draft_max=4, measure_costs=False)
    result = engine.generate([Request(ids, max_tokens=12, draft_policy="fixed")])[0]
    assert draft_ledger.could_draft == 1 and draft_ledger.drafted == result.stats.draft_tokens > 0
