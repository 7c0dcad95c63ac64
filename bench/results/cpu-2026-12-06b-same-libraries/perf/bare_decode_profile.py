"""tandem's bare greedy loop on its own llama.cpp context, 4 rounds of 127 decode steps after the code prompt; with
an argument, `perf record --control fifo:/tmp/prof/ctl` is enabled around rounds 2-4's decode loops only:

    mkfifo /tmp/prof/ctl
    perf record -F 999 -D -1 --control fifo:/tmp/prof/ctl -o bare.data -- python bare_decode_profile.py x

V_F16=1 kept V in F16 when tandem's default was a Q8_0 V (before this directory's change; now the default).
"""

import os
import sys
import time

import llama_cpp.llama_cpp as llc
import numpy as np

import tandem
from tandem.bench.suite import load_suite
from tandem.loading.registry import DEFAULT_TARGET

if os.environ.get("V_F16"):
    _init = llc.llama_init_from_model

    def init(model, params):
        params.type_v = 1  # GGML_TYPE_F16
        return _init(model, params)

    llc.llama_init_from_model = init

target = tandem.load(DEFAULT_TARGET, backend="llama.cpp", n_threads=2)
ids = target.tokenizer.encode_chat(list(load_suite("default", "code")[0].messages))
context = target.weights.context(target.n_ctx, target.n_batch)
control = open("/tmp/prof/ctl", "w") if len(sys.argv) > 1 else None


def perf(command: str) -> None:
    if control is not None:
        control.write(command + "\n")
        control.flush()


out = np.empty((1, target.config.vocab_size), dtype=np.float32)
rates = []
for r in range(4):
    context.clear()
    wanted = np.zeros(len(ids), dtype=np.int8)
    wanted[-1] = 1
    context.decode([0] * len(ids), ids, np.arange(len(ids), dtype=np.int32), wanted, out)
    if r:
        perf("enable")
    started, cpu = time.perf_counter(), time.process_time()
    for pos in range(len(ids), len(ids) + 127):
        context.decode([0], [int(out[0].argmax())], [pos], [1], out)
    wall = time.perf_counter() - started
    if r:
        perf("disable")
        rates.append((round(127 / wall, 2), round((time.process_time() - cpu) / wall, 2)))
print("tokens/s, CPUs busy:", rates)
