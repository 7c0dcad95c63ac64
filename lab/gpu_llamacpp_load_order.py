"""Which import order lets a CUDA build of llama.cpp load a model (issue 26; h200-2026-12-05-regime).

    for order in numpy-first stdcxx-first llama-first; do python lab/gpu_llamacpp_load_order.py MODEL $order; done

MODEL must have a 151,936-token vocabulary (Qwen2.5's; VOCAB=n for another): reading it from the GGUF here would
import numpy first.

One process per order, torch never imported. On the H200 box numpy first segfaulted in llama_model_load's
print_info (libllama's std::ostream calls bound into libggml-cuda's own copies); libstdc++ loaded globally first,
or llama.cpp first, loaded. The worker process therefore imports llama.cpp before numpy.
"""

import faulthandler
import os
import sys

faulthandler.enable()
path, order = sys.argv[1], sys.argv[2]
if order == "numpy-first":
    import numpy  # noqa: F401
elif order == "stdcxx-first":
    import ctypes

    ctypes.CDLL("libstdc++.so.6", mode=ctypes.RTLD_GLOBAL)
    import numpy  # noqa: F401
elif order == "llama-first":
    import llama_cpp.llama_cpp  # noqa: F401
    import numpy  # noqa: F401
else:
    raise SystemExit(f"unknown order {order!r}: numpy-first, stdcxx-first or llama-first")

from tandem.backends import llamacpp_core  # noqa: E402

llamacpp_core.LlamaCppWeights(path, int(os.environ.get("VOCAB", 151936)), device="cuda")
print(order, "ok", flush=True)
