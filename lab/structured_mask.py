"""The per-token cost of a grammar mask on a real vocabulary: llguidance against xgrammar, on this machine.

For each library: building its tokenizer view (once a process), compiling a JSON schema (once a request), then per
decoded token the mask fill into a [1, ceil(V/32)] int32 bitmask and the advance by the chosen token, walking the
tokens of a JSON document that satisfies the schema (the real tokenizer's own tokenization). Also the masks a
speculative verify needs: k draft tokens advanced tentatively, k+1 masks, rolled back. The mask's application to a
[1, V] logits row (unpack the bits, masked_fill) is tandem's and the same for both.

    python lab/structured_mask.py [--model qwen2.5-coder-0.5b-instruct] [--repeats 5]

Prints medians (microseconds) of `--repeats` walks over the document, in this process's CPU time (all its threads),
not wall time: on a shared machine wall time counts the other processes' turns too. Read the two libraries side by
side from one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tandem.logits.grammar import JSON_OPTIONS, WHITESPACE_BOUND  # both libraries get tandem's whitespace bound

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
            "tags": ["mathematics", "engines", "poetry of science"],
            "address": {"city": "London", "zip": "W1 4AB"}, "active": True}
DRAFTS = 8


def median_us(samples: list[float]) -> float:
    return 1e6 * statistics.median(samples)


def bench_llguidance(tokenizer, vocab: int, ids: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.torch as llt

    started = time.process_time()
    ll_tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab,
                                          eos_token=list(tokenizer.eos_token_ids))
    setup = time.process_time() - started
    compiles, fills, advances, verifies = [], [], [], []
    bitmask = llt.allocate_token_bitmask(DRAFTS + 1, vocab)
    for _ in range(repeats):
        started = time.process_time()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        llt.fill_next_token_bitmask(matcher, bitmask, 0)  # the first mask is part of what a request waits for
        compiles.append(time.process_time() - started)
        for i, token in enumerate(ids):
            started = time.process_time()
            llt.fill_next_token_bitmask(matcher, bitmask, 0)
            filled = time.process_time()
            assert matcher.consume_token(token), matcher.get_error()
            fills.append(filled - started)
            advances.append(time.process_time() - filled)
            drafts = ids[i + 1 : i + 1 + DRAFTS]
            if len(drafts) == DRAFTS:
                started = time.process_time()
                for r, draft in enumerate(drafts):
                    llt.fill_next_token_bitmask(matcher, bitmask, r)
                    matcher.consume_token(draft)
                llt.fill_next_token_bitmask(matcher, bitmask, DRAFTS)
                matcher.rollback(DRAFTS)
                verifies.append(time.process_time() - started)
    return dict(setup_s=setup, compile_us=median_us(compiles), fill_us=median_us(fills),
                fill_p99_us=1e6 * sorted(fills)[int(0.99 * len(fills))], advance_us=median_us(advances),
                verify_k_us=median_us(verifies))


def bench_xgrammar(tokenizer, vocab: int, ids: list[int], repeats: int) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    started = time.process_time()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend),
                                              vocab_size=vocab, stop_token_ids=list(tokenizer.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    setup = time.process_time() - started
    compiles, fills, advances, verifies = [], [], [], []
    bitmask = xgr.allocate_token_bitmask(DRAFTS + 1, vocab)
    for _ in range(repeats):
        started = time.process_time()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True,
                                                max_whitespace_cnt=WHITESPACE_BOUND)
        matcher = xgr.GrammarMatcher(compiled)
        matcher.fill_next_token_bitmask(bitmask, 0)
        compiles.append(time.process_time() - started)
        for i, token in enumerate(ids):
            started = time.process_time()
            matcher.fill_next_token_bitmask(bitmask, 0)
            filled = time.process_time()
            assert matcher.accept_token(token)
            fills.append(filled - started)
            advances.append(time.process_time() - filled)
            drafts = ids[i + 1 : i + 1 + DRAFTS]
            if len(drafts) == DRAFTS:
                started = time.process_time()
                for r, draft in enumerate(drafts):
                    matcher.fill_next_token_bitmask(bitmask, r)
                    matcher.accept_token(draft)
                matcher.fill_next_token_bitmask(bitmask, DRAFTS)
                matcher.rollback(DRAFTS)
                verifies.append(time.process_time() - started)
    return dict(setup_s=setup, compile_us=median_us(compiles), fill_us=median_us(fills),
                fill_p99_us=1e6 * sorted(fills)[int(0.99 * len(fills))], advance_us=median_us(advances),
                verify_k_us=median_us(verifies))


def bench_apply(vocab: int, repeats: int) -> float:
    """Microseconds to apply one row's bitmask to a float32 logits row (tandem.logits.adjust.apply_bitmask)."""
    from tandem.logits.adjust import apply_bitmask

    logits = torch.randn(1, vocab)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (1, (vocab + 31) // 32), dtype=torch.int32)
    apply_bitmask(logits, bitmask)
    times = []
    for _ in range(repeats * 50):
        started = time.process_time()
        apply_bitmask(logits, bitmask)
        times.append(time.process_time() - started)
    return median_us(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="GGUF path or registry name")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from tandem.loading.registry import resolve
    from tandem.loading.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(resolve(args.model))
    vocab = tokenizer.vocab_size
    ids = tokenizer.encode(json.dumps(DOCUMENT, indent=2))
    print(f"vocabulary {vocab}, document {len(ids)} tokens, drafts per verify {DRAFTS}, torch threads 1")
    rows = {"llguidance": bench_llguidance(tokenizer, vocab, ids, args.repeats),
            "xgrammar": bench_xgrammar(tokenizer, vocab, ids, args.repeats)}
    print(f"{'library':<12}{'setup s':>9}{'compile us':>12}{'mask us':>9}{'mask p99':>10}{'advance us':>12}"
          f"{'verify k=8 us':>15}")
    for name, r in rows.items():
        print(f"{name:<12}{r['setup_s']:>9.2f}{r['compile_us']:>12.0f}{r['fill_us']:>9.1f}{r['fill_p99_us']:>10.1f}"
              f"{r['advance_us']:>12.1f}{r['verify_k_us']:>15.0f}")
    print(f"apply one row's bitmask to [1, {vocab}] float32 logits: {bench_apply(vocab, args.repeats):.1f} us")


if __name__ == "__main__":
    main()
