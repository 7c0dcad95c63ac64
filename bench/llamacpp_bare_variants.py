"""Bare greedy loops (llama_decode and numpy's argmax, as plain_vs_llamaserver.py's `bare`) over contexts of
tandem's llama.cpp weights, variants interleaved round by round, each variant's tokens/s against the first's: does a
setting llama-server uses and tandem does not (a persistent ggml threadpool attached to the context, common's
default, polling 50; an F16 K cache instead of tandem's Q8_0 on the CPU) explain llama-server's edge?

    python bench/llamacpp_bare_variants.py --variants default,pool,f16kv,pool+f16kv --rounds 4
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import statistics
import sys

import llama_cpp as llc
from plain_vs_llamaserver import bare_loop  # bench/, this script's directory

import tandem
from tandem.backends.llamacpp_core import Context
from tandem.bench.suite import load_suite
from tandem.loading.registry import DEFAULT_TARGET


class ThreadpoolParams(ctypes.Structure):  # ggml.h's struct ggml_threadpool_params
    _fields_ = [("cpumask", ctypes.c_bool * 512), ("n_threads", ctypes.c_int), ("prio", ctypes.c_int),
                ("poll", ctypes.c_uint32), ("strict_cpu", ctypes.c_bool), ("paused", ctypes.c_bool)]


def attach_threadpool(context: Context, n_threads: int, poll: int = 50) -> None:
    """What llama-server does (common_threadpools::init): one persistent pool for the context's graphs."""
    lib = os.path.dirname(llc.__file__) + "/lib"
    cpu = ctypes.CDLL(glob.glob(lib + "/libggml-cpu.so")[0])
    llama = ctypes.CDLL(glob.glob(lib + "/libllama.so")[0])
    cpu.ggml_threadpool_params_default.restype = ThreadpoolParams
    cpu.ggml_threadpool_params_default.argtypes = [ctypes.c_int]
    cpu.ggml_threadpool_new.restype = ctypes.c_void_p
    cpu.ggml_threadpool_new.argtypes = [ctypes.POINTER(ThreadpoolParams)]
    llama.llama_attach_threadpool.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    params = cpu.ggml_threadpool_params_default(n_threads)
    params.poll = poll
    pool = cpu.ggml_threadpool_new(ctypes.byref(params))
    llama.llama_attach_threadpool(ctypes.cast(context.ctx, ctypes.c_void_p), pool, None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_TARGET)
    p.add_argument("--variants", default="default,pool,f16kv,pool+f16kv")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args(argv)
    target = tandem.load(args.model, backend="llama.cpp", n_threads=args.threads)
    weights, vocab = target.weights, target.config.vocab_size
    variants = args.variants.split(",")

    def make(variant: str) -> Context:
        k_q8 = weights.k_q8
        weights.k_q8 = k_q8 and "f16kv" not in variant  # read when the context is made
        context = Context(weights, target.n_ctx, target.n_batch)
        weights.k_q8 = k_q8
        if "pool" in variant:
            attach_threadpool(context, args.threads)
        return context

    def bare(context: Context, ids: list[int], n: int) -> float:
        context.clear()
        return bare_loop(context, ids, n, vocab)

    contexts = {v: make(v) for v in variants}
    prompts = [target.tokenizer.encode_chat(list(pr.messages)) for pr in load_suite("default", "code,json")]
    for v in variants:
        bare(contexts[v], prompts[0], 8)
    rates: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for ids in prompts:
            for v in variants[r % len(variants):] + variants[:r % len(variants)]:  # rotate who goes first
                rates[v].append(bare(contexts[v], ids, args.max_tokens))
            print({v: round(rates[v][-1], 1) for v in variants}, file=sys.stderr, flush=True)
    for v in variants:
        ratios = [a / b for a, b in zip(rates[v], rates[variants[0]], strict=True)]
        print(f"{v:12} {statistics.median(rates[v]):6.2f} tok/s; / {variants[0]}: median "
              f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
