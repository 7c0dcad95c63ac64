"""What a forward costs in llama.cpp when its greedy tokens are picked on the device (llama.cpp's backend sampling:
a greedy sampler chain set on the sequence, llama_get_sampled_token_ith) instead of its logits being copied to the
host and argmaxed there, as tandem's llama.cpp backend does today (Context.decode copies every wanted row, 152k
floats each for Qwen, then numpy's argmax). Per row count: the forward plus reading its tokens both ways, and
whether the tokens agree. A verify of 2 sequences x 8 rows reads 9.7 MB of logits: the candidate cause of the
engine's drafting steps costing more in the loop than their forwards (issue 26).

  python lab/llamacpp_backend_sampling.py --model T.gguf --gpu-layers 99 --rows 1,4,9,16

Raw llama_cpp bindings, no torch in the process (a CUDA build beside CUDA torch crashes: tandem's worker process).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time

# llama.cpp's libraries before numpy: on the H200 box a CUDA libllama loaded after numpy segfaulted at model load
# (tandem.backends.llamacpp_worker loads them first for the same reason)
import llama_cpp as llc  # isort: skip
import numpy as np

PROMPT = 64  # tokens every timed forward follows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--gpu-layers", type=int, default=0)
    p.add_argument("--rows", default="1,4,9,16", help="rows a forward, comma list")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    rows = [int(n) for n in args.rows.split(",")]

    llc.llama_backend_init()
    params = llc.llama_model_default_params()
    params.n_gpu_layers = args.gpu_layers
    model = llc.llama_model_load_from_file(args.model.encode(), params)
    if not model:
        sys.exit(f"could not load {args.model}")
    vocab = llc.llama_vocab_n_tokens(llc.llama_model_get_vocab(model))
    batch = llc.llama_batch_init(max(PROMPT, *rows), 0, 1)

    def context(sampled: bool):
        cp = llc.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch = PROMPT + max(rows) + 8, 128, 128
        cp.n_threads = cp.n_threads_batch = args.threads
        cp.n_outputs_max_per_seq = max(rows)
        ctx = llc.llama_init_from_model(model, cp)
        chain = None
        if sampled:  # kept alive beside the context, as llama.cpp asks
            chain = llc.llama_sampler_chain_init(llc.llama_sampler_chain_default_params())
            llc.llama_sampler_chain_add(chain, llc.llama_sampler_init_greedy())
            if not llc.llama_set_sampler(ctx, 0, chain):
                sys.exit("this llama.cpp cannot sample on the backend")
        return ctx, chain

    def decode(ctx, tokens: list[int], start: int, outputs: bool) -> None:
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, start + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, outputs or i == len(tokens) - 1
        batch.n_tokens = len(tokens)
        if llc.llama_decode(ctx, batch) != 0:
            sys.exit("llama_decode failed")

    def host_tokens(ctx, n: int) -> list[int]:  # as tandem's backend: every row copied out, then argmax
        out = np.empty((n, vocab), dtype=np.float32)
        ctypes.memmove(out.ctypes.data, llc.llama_get_logits(ctx), out.nbytes)
        return out.argmax(axis=1).tolist()

    def device_tokens(ctx, n: int) -> list[int]:
        return [llc.llama_get_sampled_token_ith(ctx, i) for i in range(n)]

    prompt = [(7 * i + 3) % 1000 + 100 for i in range(PROMPT)]
    paths = {"host": (context(False), host_tokens), "device": (context(True), device_tokens)}
    for (ctx, _), _ in paths.values():
        decode(ctx, prompt, 0, False)
    print(f"{args.model}: gpu layers {args.gpu_layers}, vocab {vocab}, median of {args.repeats}")
    print(f"{'rows':>5} {'host ms':>9} {'device ms':>10} {'saved ms':>9}  tokens equal")
    for n in rows:
        times: dict[str, list[float]] = {name: [] for name in paths}
        seen: dict[str, list[int]] = {}
        feed = [(11 * i + 5) % 1000 + 100 for i in range(n)]
        for r in range(args.repeats + 2):
            for name in (list(paths) if r % 2 == 0 else list(paths)[::-1]):
                (ctx, _), read = paths[name]
                started = time.perf_counter()
                decode(ctx, feed, PROMPT, True)
                seen[name] = read(ctx, n)
                if r >= 2:  # two rounds of warm-up: graphs built and captured
                    times[name].append(1000.0 * (time.perf_counter() - started))
                llc.llama_memory_seq_rm(llc.llama_get_memory(ctx), 0, PROMPT, -1)
        host, device = (statistics.median(times[name]) for name in paths)
        print(f"{n:>5} {host:>9.3f} {device:>10.3f} {host - device:>9.3f}  {seen['host'] == seen['device']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
