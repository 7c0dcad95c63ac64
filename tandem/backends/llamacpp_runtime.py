"""llama.cpp's process-wide set-up, shared by the backend and the device probe: initialised once per process,
its log filtered to errors, the last of them kept to quote when a load or a decode fails."""

from __future__ import annotations

import ctypes
import os
import sys
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import llama_cpp.llama_cpp as llc
import numpy as np

# ggml_log_level: keep errors (and their continuation lines), drop the rest.
_LOG_LEVEL_ERROR = 4
_LOG_LEVEL_CONT = 5
recent_errors: deque[str] = deque(maxlen=20)  # llama.cpp's last error lines, quoted when a load fails
_log_state: dict = {"last_level": 0, "capture": None}  # capture: a list collecting every line (captured_log)


def _log_callback(level: int, text: bytes | None, _user_data: ctypes.c_void_p) -> None:
    if level == _LOG_LEVEL_CONT:
        level = _log_state["last_level"]
    _log_state["last_level"] = level
    if _log_state["capture"] is not None and text:
        _log_state["capture"].append(text.decode("utf-8", errors="replace"))
    if level >= _LOG_LEVEL_ERROR and text:
        message = text.decode("utf-8", errors="replace")
        recent_errors.append(message.rstrip())
        sys.stderr.write(message)


# Kept alive on the module: llama.cpp holds a raw pointer to it for the life of the process.
_LOG_CALLBACK = llc.llama_log_callback(_log_callback)
_initialized = False


@contextmanager
def captured_log() -> Iterator[list[str]]:
    """Every line llama.cpp logs meanwhile, info included (e.g. which buffer types a model load used)."""
    lines: list[str] = []
    _log_state["capture"] = lines
    try:
        yield lines
    finally:
        _log_state["capture"] = None


def init_llama() -> None:
    global _initialized  # once per process, as llama.cpp requires
    if _initialized:
        return
    # Batch-invariant CPU matmuls (NUMERICS in llamacpp_backend); ggml reads this once, at its first matmul.
    os.environ.setdefault("GGML_CPU_TILED_MM", "0")
    llc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
    llc.llama_backend_init()
    _initialized = True


# llama-ext.h's staging API, by its Itanium-mangled names (libllama exports them; llama-cpp-python does not bind them)
_STAGING = {
    "set_embeddings_nextn": ("_Z26llama_set_embeddings_nextnP13llama_contextbb",
                             [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None),
    "get_embeddings_nextn": ("_Z26llama_get_embeddings_nextnP13llama_context", [ctypes.c_void_p],
                             ctypes.POINTER(ctypes.c_float)),
    "get_embeddings_nextn_ith": ("_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
                                 [ctypes.c_void_p, ctypes.c_int32], ctypes.POINTER(ctypes.c_float)),
    "set_embeddings_layer_inp": ("_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
                                 [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None),
    "get_embeddings_layer_inp": ("_Z30llama_get_embeddings_layer_inpP13llama_contextj",
                                 [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)),
}


def staging(name: str):
    symbol, argtypes, restype = _STAGING[name]
    try:
        function = getattr(llc._lib, symbol)
    except AttributeError as missing:
        raise RuntimeError(f"this llama.cpp build does not export {symbol} (llama-cpp-python 0.3.36's does): head "
                           "drafts need it") from missing
    function.argtypes, function.restype = argtypes, restype
    return function


def output_hidden(ctx) -> None:
    """Make a target context output its hidden state for every row of every decode (read_hidden)."""
    staging("set_embeddings_nextn")(ctx, True, False)


def read_hidden(ctx, rows: int, width: int) -> np.ndarray:
    """The last decode's hidden states [rows, width], one per batch row, in batch order: valid until the next decode
    (a view of llama.cpp's buffer; copy what is kept)."""
    address = ctypes.cast(staging("get_embeddings_nextn")(ctx), ctypes.c_void_p).value
    return np.frombuffer((ctypes.c_float * (rows * width)).from_address(address), np.float32).reshape(rows, width)
