"""What does an attached EAGLE-3 head cost the torch target's own steps (their rows kept for its catch-up), and what
does a draft step cost, steady and a round's first (the catch-up on the verify's rows)? Medians of interleaved
rounds, one thread, on whatever device runs it (CPU here: an 8-layer 512-wide llama in F32 with a head as wide).
Run: PYTHONPATH=. python lab/torch_head_costs.py"""

import statistics
import tempfile
import time

import torch

import tandem
from tandem.synthetic.heads import write_eagle3
from tandem.synthetic.tiny_gguf import write_tiny_gguf

torch.set_num_threads(1)
SHAPE = dict(d_model=512, d_ffn=1408, n_heads=8, n_kv_heads=4)
folder = tempfile.mkdtemp()
target = tandem.load(write_tiny_gguf(f"{folder}/t.gguf", arch="llama", n_layers=8, seed=3, context_length=2048,
                                     **SHAPE), backend="torch", n_ctx=1024)
head = tandem.load(write_eagle3(f"{folder}/h.gguf", target_d_model=512, target_layers=(1, 4, 6), seed=4, **SHAPE),
                   backend="torch")
prompt = list(range(1, 257))
plain_kv = target.new_batched_cache(1, 1024)
head_kv_target = target.new_batched_cache(1, 1024)
head_kv = head_kv_target.attach_head(head)
for kv in (plain_kv, head_kv_target):
    kv.forward([(0, prompt)], [True])


def timed(fn, n: int = 30) -> list[float]:
    out = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        out.append(1000 * (time.perf_counter() - started))
    return out


def forward(kv, rows):
    kv.forward([(0, rows)], [False])
    kv.rewind(0, len(prompt))


def draft():
    head_kv.forward([(0, [5])], [True])
    head_kv.rewind(0, len(prompt))


def draft_after_verify() -> float:
    """A round's first draft step after a verify of 4 rows that kept 3: it catches up on them first."""
    head_kv_target.forward([(0, [5, 6, 7, 8])], [False])
    head_kv_target.rewind(0, len(prompt) + 3)
    started = time.perf_counter()
    head_kv.forward([(0, [9])], [True])
    ms = 1000 * (time.perf_counter() - started)
    head_kv_target.rewind(0, len(prompt))
    head_kv.rewind(0, len(prompt))
    return ms


times: dict[str, list[float]] = {}
for _ in range(5):  # interleaved rounds
    for name, kv in (("no head", plain_kv), ("head attached", head_kv_target)):
        times.setdefault(f"plain step ({name})", []).extend(timed(lambda kv=kv: forward(kv, [5])))
        times.setdefault(f"verify of 4 rows ({name})", []).extend(timed(lambda kv=kv: forward(kv, [5, 6, 7, 8])))
    times.setdefault("head draft step", []).extend(timed(draft))
    times.setdefault("first draft step after a verify", []).extend(draft_after_verify() for _ in range(30))
for name, values in times.items():
    print(f"{name:34s} {statistics.median(values):7.3f} ms")
