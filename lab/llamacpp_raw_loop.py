"""llama.cpp's greedy decode loop driven bare through ctypes, against llama-server: the floor of what tandem's
llama.cpp backend can reach on this machine (issue 26's plain-decode goal).

    python lab/llamacpp_raw_loop.py --server /path/to/llama-server [--model M.gguf] [--repeats 3]

Each round runs, in turn: a bare loop with llama-server's context settings (F16 KV, n_batch 2048, n_ubatch 512),
one with tandem's (Q8_0 KV with flash attention, n_batch = n_ubatch = 512, GGML_CPU_TILED_MM=0), each in a fresh
process that imports neither torch nor tandem, `tandem.generate` in a fresh process, and llama-server itself; 128
tokens greedy from a fixed 69-token prompt (or --prompt NAME: a suite prompt's chat tokens), EOS ignored. Prints
decode tokens/s per round and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = [151644, 872, 198] + list(range(1000, 1060)) + [151645, 198, 151644, 77091, 198]
MAX_TOKENS = 128


def tandem_loop(model_path: str, prompt: list[int], threads: int) -> float:
    """Decode tokens/s of tandem.generate on the same prompt (in this process: call it from a fresh one)."""
    import tandem

    model = tandem.load(model_path, backend="llama.cpp", n_threads=threads)
    tandem.generate(model, prompt=prompt, max_tokens=8, ignore_eos=True)
    return tandem.generate(model, prompt=prompt, max_tokens=MAX_TOKENS, ignore_eos=True).stats.decode_tokens_per_second


def bare_loop(model_path: str, settings: str, threads: int, prompt: list[int]) -> float:
    """Decode tokens/s of one bare run (in this process: call it from a fresh one)."""
    if settings == "tandem":
        os.environ["GGML_CPU_TILED_MM"] = "0"
    import llama_cpp.llama_cpp as llc
    import numpy as np

    llc.llama_backend_init()
    model = llc.llama_model_load_from_file(model_path.encode(), llc.llama_model_default_params())
    params = llc.llama_context_default_params()
    params.n_ctx, params.n_threads, params.n_threads_batch = 4096, threads, threads
    if settings == "tandem":
        params.n_batch = params.n_ubatch = 512
        params.type_k = params.type_v = 8  # GGML_TYPE_Q8_0
        params.flash_attn_type = llc.LLAMA_FLASH_ATTN_TYPE_ENABLED
    else:
        params.n_batch, params.n_ubatch = 2048, 512
    ctx = llc.llama_init_from_model(model, params)
    vocab = llc.llama_vocab_n_tokens(llc.llama_model_get_vocab(model))
    batch = llc.llama_batch_init(512, 0, 1)

    def decode(tokens: list[int], start: int) -> int:
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, start + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        if llc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return int(np.ctypeslib.as_array(llc.llama_get_logits_ith(ctx, -1), shape=(vocab,)).argmax())

    def run(n: int) -> float:
        llc.llama_memory_clear(llc.llama_get_memory(ctx), True)
        token, position = decode(prompt, 0), len(prompt)
        started = time.perf_counter()
        for _ in range(n - 1):
            token, position = decode([token], position), position + 1
        return (n - 1) / (time.perf_counter() - started)

    run(8)
    return run(MAX_TOKENS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", help="llama-server binary")
    p.add_argument("--model", default=None, help="GGUF [the default target]")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", default=None, help="a default-suite prompt's name: its chat tokens [a fixed prompt]")
    p.add_argument("--bare", choices=["server", "tandem", "generate"], help=argparse.SUPPRESS)  # the child's side
    p.add_argument("--tokens", help=argparse.SUPPRESS)  # the child's prompt
    args = p.parse_args(argv)
    if args.bare:
        tokens = json.loads(args.tokens)
        tps = tandem_loop(args.model, tokens, args.threads) if args.bare == "generate" else \
            bare_loop(args.model, args.bare, args.threads, tokens)
        print(json.dumps(tps))
        return 0
    if not args.server:
        p.error("--server is required")
    import httpx

    from tandem.bench.llamaserver import serving
    from tandem.loading.registry import DEFAULT_TARGET, resolve

    model = resolve(args.model or DEFAULT_TARGET)
    prompt = PROMPT
    if args.prompt:
        from tandem.bench.suite import load_suite
        from tandem.loading.gguf import open_gguf
        from tandem.loading.tokenizer import Tokenizer

        messages = list(load_suite("default", args.prompt)[0].messages)
        prompt = Tokenizer.from_gguf(open_gguf(model)).encode_chat(messages)
    runs = (("bare, server settings", "server"), ("bare, tandem settings", "tandem"), ("tandem.generate", "generate"),
            ("llama-server", None))
    rows: dict[str, list[float]] = {name: [] for name, _ in runs}
    with serving(args.server, model, None, 0, ngl=0, threads=args.threads, ctx=4096) as base:

        def server_tps() -> float:
            body = {"prompt": prompt, "n_predict": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                    "cache_prompt": False}
            return httpx.post(base + "/completion", json=body, timeout=600).json()["timings"]["predicted_per_second"]

        server_tps()
        for _ in range(args.repeats):
            for name, settings in runs:
                if settings is None:
                    rows[name].append(server_tps())
                    continue
                out = subprocess.run([sys.executable, __file__, "--bare", settings, "--model", model, "--threads",
                                      str(args.threads), "--tokens", json.dumps(prompt)],
                                     capture_output=True, text=True, check=True)
                rows[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print({k: round(v[-1], 2) for k, v in rows.items()}, flush=True)
    print("medians:", {k: round(statistics.median(v), 2) for k, v in rows.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
