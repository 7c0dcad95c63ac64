import os, sys, time
import numpy as np
import tandem
import llama_cpp.llama_cpp as llc
if os.environ.get("V_F16"):
    _init = llc.llama_init_from_model
    def init(model, params):
        params.type_v = 1  # GGML_TYPE_F16
        return _init(model, params)
    llc.llama_init_from_model = init
from tandem.bench.suite import load_suite
from tandem.loading.registry import DEFAULT_TARGET
target = tandem.load(DEFAULT_TARGET, backend="llama.cpp", n_threads=2)
ids = target.tokenizer.encode_chat(list(load_suite("default", "code")[0].messages))
ctx = target.weights.context(target.n_ctx, target.n_batch)
vocab = target.config.vocab_size
ctl = open("/tmp/prof/ctl", "w") if len(sys.argv) > 1 else None
def perf(cmd):
    if ctl: ctl.write(cmd + "\n"); ctl.flush()
out = np.empty((1, vocab), dtype=np.float32)
rates = []
for r in range(4):
    ctx.clear()
    wanted = np.zeros(len(ids), dtype=np.int8); wanted[-1] = 1
    ctx.decode([0] * len(ids), ids, np.arange(len(ids), dtype=np.int32), wanted, out)
    if r: perf("enable")
    t = time.perf_counter(); c = time.process_time()
    for pos in range(len(ids), len(ids) + 127):
        ctx.decode([0], [int(out[0].argmax())], [pos], [1], out)
    w = time.perf_counter() - t; cpu = time.process_time() - c
    if r: perf("disable"); rates.append((127 / w, cpu / w))
print([(round(a, 2), round(b, 2)) for a, b in rates])
