"""Random-weight GGUFs of real model shapes, 32B ones included, quantised as llama-quantize would, carrying a real
model's tokenizer: llama.cpp benchmarks of a big target beside a small draft without downloading either.

    python -m tandem.synthetic.random_gguf OUT.gguf --shape qwen2.5-32b --mix Q4_0 --tokenizer-from REAL.gguf
    python -m tandem.synthetic.random_gguf TOKENIZER.gguf --extract-tokenizer REAL.gguf   # metadata only, ~7 MB
More (block values, mixes): docs/internals.md.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.config import ModelConfig
from tandem.synthetic.random_blocks import block_geometry, random_rows, row_bytes
from tandem.synthetic.shapes import parse_shape
from tandem.synthetic.tiny_gguf import FILE_TYPE, TOKEN_TYPE_UNUSED, architecture_kv, tensor_specs

MIXES = ("Q4_0", "Q8_0", "Q4_K", "Q4_K_M", "Q6_K")
MIX_FILE_TYPE = {**FILE_TYPE, "Q4_K": 14, "Q4_K_M": 15}  # llama_ftype: MOSTLY_Q4_K_S = 14, MOSTLY_Q4_K_M = 15
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # llama-quantize's tensor_type_fallback
CHUNK_BYTES = 32 << 20  # one process's piece of a matrix: bounds memory, keeps 16 processes busy
EMBEDDING_STD = 0.1
NORM_STD, BIAS_STD = 0.1, 0.02


@dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # torch order: (rows, row length) for a matrix
    kind: str  # matrix | norm | bias
    qtype: str  # a ggml type name; F32 for norms and biases
    nbytes: int
    std: float  # the values' spread (matrices, biases)


@dataclass
class WriteSummary:
    path: str
    bytes: int
    seconds: float
    data_seconds: float  # of `seconds`, drawing and writing the tensors (the rest: reading the tokenizer, the header)
    tensor_types: dict[str, int]  # ggml type -> tensors stored in it


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama-quantize's layers that get more bits in the _M mixes."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_qtype(mix: str, name: str, cols: int, n_layers: int, tied: bool) -> str:
    """The type llama-quantize gives matrix `name` (rows of `cols` values) in `mix`."""
    if mix not in MIXES:
        raise ValueError(f"unknown mix {mix!r}; choose one of {', '.join(MIXES)}")
    base = "Q4_K" if mix == "Q4_K_M" else mix
    layer = re.match(r"blk\.(\d+)\.", name)
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        qtype = "Q8_0" if cols % block_geometry(base)[0] or base == "Q8_0" else "Q6_K"
    elif mix == "Q4_K_M" and layer and re.search(r"\.(attn_v|ffn_down)\.", name) \
            and use_more_bits(int(layer.group(1)), n_layers):
        qtype = "Q6_K"
    else:
        qtype = base
    return FALLBACK.get(qtype, qtype) if cols % block_geometry(qtype)[0] else qtype


def plan_tensors(config: ModelConfig, mix: str) -> list[TensorPlan]:
    """Every tensor of a qwen2/llama file of this shape, in file order, with its type and size."""
    specs = tensor_specs(config.architecture, config.n_layers, config.d_model, config.d_ffn, config.n_heads,
                         config.n_kv_heads, config.head_dim, config.vocab_size, config.qkv_bias,
                         config.tied_embeddings)
    plans = []
    for name, shape, kind in specs:
        if kind != "matrix":
            plans.append(TensorPlan(name, shape, kind, "F32", 4 * math.prod(shape),
                                    NORM_STD if kind == "norm" else BIAS_STD))
            continue
        rows, cols = shape
        qtype = tensor_qtype(mix, name, cols, config.n_layers, config.tied_embeddings)
        std = EMBEDDING_STD if name == "token_embd.weight" else min(EMBEDDING_STD, 1.0 / math.sqrt(cols))
        plans.append(TensorPlan(name, shape, kind, qtype, rows * row_bytes(qtype, cols), std))
    return plans


# --- the tokenizer, copied ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetadataValue:
    value: Any
    types: tuple[Any, ...]  # GGUFValueType of the value; for an array, ARRAY then the items' type


def tokenizer_metadata(path: str | os.PathLike[str]) -> dict[str, MetadataValue]:
    """Every `tokenizer.*` key of a GGUF (vocabulary, merges, special ids, chat template) with its stored types."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    found = {key: MetadataValue(field.contents(), tuple(field.types))
             for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in found:
        raise ValueError(f"{path} carries no tokenizer (no tokenizer.ggml.tokens)")
    return found


def padded_vocabulary(tokenizer: dict[str, MetadataValue], rows: int) -> dict[str, MetadataValue]:
    """The tokenizer with `[PADn]` tokens (type UNUSED) appended up to `rows` entries, as llama.cpp's converter
    pads a vocabulary smaller than the embedding."""
    tokens, types = tokenizer["tokenizer.ggml.tokens"], tokenizer["tokenizer.ggml.token_type"]
    n = len(tokens.value)
    if rows < n:
        raise ValueError(f"the shape has {rows} embedding rows but the tokenizer {n} tokens; set vocab_size >= {n}")
    if rows == n:
        return tokenizer
    return {**tokenizer,
            "tokenizer.ggml.tokens": MetadataValue(list(tokens.value) + [f"[PAD{i}]" for i in range(n, rows)],
                                                   tokens.types),
            "tokenizer.ggml.token_type": MetadataValue(list(types.value) + [TOKEN_TYPE_UNUSED] * (rows - n),
                                                       types.types)}


def _add_metadata(writer, key: str, item: MetadataValue) -> None:
    from gguf import GGUFValueType

    if item.types[0] == GGUFValueType.ARRAY:
        writer.add_key_value(key, list(item.value), GGUFValueType.ARRAY, sub_type=item.types[-1])
    else:
        writer.add_key_value(key, item.value, item.types[0])


def extract_tokenizer(source: str | os.PathLike[str], out: str | os.PathLike[str]) -> str:
    """A GGUF holding only `source`'s architecture name and tokenizer keys (no tensors): what `write_random_gguf`
    needs of a real model, small enough (~7 MB for Qwen) to carry where the real model is not."""
    from gguf import GGUFReader, GGUFWriter

    arch = GGUFReader(source).fields["general.architecture"].contents()
    writer = GGUFWriter(os.fspath(out), arch)
    for key, item in tokenizer_metadata(source).items():
        _add_metadata(writer, key, item)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    return os.fspath(out)


# --- writing ------------------------------------------------------------------------------------------------------


def _write_header(path: str, config: ModelConfig, mix: str, plans: list[TensorPlan],
                  tokenizer: dict[str, MetadataValue]) -> tuple[int, int]:
    """Header, metadata and tensor infos; returns where tensor data starts and the tensors' alignment."""
    from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

    arch = config.architecture
    writer = GGUFWriter(path, arch)
    writer.add_key_value("general.name", f"random-{config.name}-{mix.lower()}", GGUFValueType.STRING)
    writer.add_key_value("general.file_type", MIX_FILE_TYPE[mix], GGUFValueType.UINT32)
    writer.add_key_value("general.quantization_version", 2, GGUFValueType.UINT32)
    for key, value in architecture_kv(arch, config.context_length, config.d_model, config.d_ffn, config.n_layers,
                                      config.n_heads, config.n_kv_heads, config.rms_eps, config.rope_base,
                                      config.head_dim).items():
        writer.add_key_value(key, value, GGUFValueType.FLOAT32 if isinstance(value, float) else GGUFValueType.UINT32)
    for key, item in tokenizer.items():
        _add_metadata(writer, key, item)
    for p in plans:
        if p.qtype == "F32":
            writer.add_tensor_info(p.name, p.shape, np.dtype(np.float32), p.nbytes)
        else:  # a byte shape (rows, row bytes), which gguf-py turns back into values
            writer.add_tensor_info(p.name, (p.shape[0], p.nbytes // p.shape[0]), np.dtype(np.uint8), p.nbytes,
                                   raw_dtype=GGMLQuantizationType[p.qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    end = writer.fout[0].tell()
    alignment = writer.data_alignment
    writer.close()
    return -(-end // alignment) * alignment, alignment


@dataclass(frozen=True)
class Chunk:
    """Rows [row0, row0 + rows) of one tensor, written at byte `offset` of the file."""
    path: str
    plan: TensorPlan
    index: int  # the tensor's position in the file: seeds its draws with the chunk's first row
    row0: int
    rows: int
    offset: int
    seed: int


def _chunk_bytes(chunk: Chunk) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([chunk.seed, chunk.index, chunk.row0])))
    p = chunk.plan
    if p.kind == "norm":  # near 1, as trained norms are
        return (1.0 + p.std * rng.standard_normal(p.shape)).astype(np.float32)
    if p.kind == "bias":
        return (p.std * rng.standard_normal(p.shape)).astype(np.float32)
    return random_rows(chunk.rows, p.shape[1], p.qtype, p.std, rng)


def _write_chunk(chunk: Chunk) -> int:
    data = _chunk_bytes(chunk)
    fd = os.open(chunk.path, os.O_WRONLY)
    try:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):  # pwrite may write less than asked
            done += os.pwrite(fd, view[done:], chunk.offset + done)
    finally:
        os.close(fd)
    return len(view)


def _chunks(path: str, plans: list[TensorPlan], data_start: int, alignment: int, seed: int) -> tuple[list[Chunk], int]:
    """Every chunk to write, and the file's total size."""
    chunks, offset = [], data_start
    for index, p in enumerate(plans):
        if p.kind == "matrix":
            per_row = p.nbytes // p.shape[0]
            step = max(1, CHUNK_BYTES // per_row)
            for row0 in range(0, p.shape[0], step):
                rows = min(step, p.shape[0] - row0)
                chunks.append(Chunk(path, p, index, row0, rows, offset + row0 * per_row, seed))
        else:
            chunks.append(Chunk(path, p, index, 0, 1, offset, seed))
        offset += -(-p.nbytes // alignment) * alignment
    return chunks, offset


def write_random_gguf(path: str | os.PathLike[str], shape: ModelConfig | str, mix: str = "Q4_0",
                      tokenizer_from: str | os.PathLike[str] | None = None, seed: int = 0, workers: int | None = None,
                      log: Callable[[str], None] = lambda message: None) -> WriteSummary:
    """Write a random-weight GGUF of `shape` (a name or spec for tandem.synthetic.shapes.parse_shape, or a config).

    Args:
        mix: MIXES; which type each matrix gets follows llama-quantize (docs/internals.md).
        tokenizer_from: a GGUF whose `tokenizer.*` keys to copy (a real model, or extract_tokenizer's output);
            None: the tiny test tokenizer (tandem.synthetic.tiny_gguf), padded to the shape's vocabulary.
        seed: the same seed writes the same bytes, whatever the number of workers.
        workers: processes drawing and writing chunks (default: every core, at most 16); 1 draws in this process.
    """

    config = parse_shape(shape) if isinstance(shape, str) else shape
    if config.architecture not in ("qwen2", "llama"):
        raise ValueError(f"random GGUFs of {config.architecture!r} shapes are not supported (qwen2, llama)")
    path = os.fspath(path)
    started = time.perf_counter()
    plans = plan_tensors(config, mix)
    tokenizer = tokenizer_metadata(tokenizer_from) if tokenizer_from else _tiny_tokenizer()
    tokenizer = padded_vocabulary(tokenizer, config.vocab_size)
    data_start, alignment = _write_header(path, config, mix, plans, tokenizer)
    chunks, total = _chunks(path, plans, data_start, alignment, seed)
    os.truncate(path, total)  # the padding between tensors stays zero; chunks fill the rest in any order
    data_started = time.perf_counter()
    log(f"{path}: {len(plans)} tensors, {total / 1e9:.2f} GB, {len(chunks)} chunks; tokenizer and header took "
        f"{data_started - started:.1f} s")
    workers = workers or min(16, os.cpu_count() or 1)
    written, next_report = 0, total / 10
    pool = ProcessPoolExecutor(workers) if workers > 1 else None
    try:
        for n in (pool.map(_write_chunk, chunks) if pool is not None else map(_write_chunk, chunks)):
            written += n
            if written >= next_report:
                seconds = time.perf_counter() - data_started
                log(f"  {written / 1e9:.2f} GB written, {written / 1e9 / seconds:.2f} GB/s")
                next_report += total / 10
    finally:
        if pool is not None:
            pool.shutdown()
    ended = time.perf_counter()
    return WriteSummary(path, total, ended - started, ended - data_started, dict(Counter(p.qtype for p in plans)))


def _tiny_tokenizer() -> dict[str, MetadataValue]:
    from gguf import GGUFValueType

    from tandem.loading.tokenizer import CHATML_TEMPLATE
    from tandem.synthetic.tiny_gguf import tiny_vocab

    tokens, types, merges = tiny_vocab()
    array, string, u32 = GGUFValueType.ARRAY, GGUFValueType.STRING, GGUFValueType.UINT32
    endoftext, im_end = tokens.index("<|endoftext|>"), tokens.index("<|im_end|>")
    return {
        "tokenizer.ggml.model": MetadataValue("gpt2", (string,)),
        "tokenizer.ggml.pre": MetadataValue("qwen2", (string,)),
        "tokenizer.ggml.tokens": MetadataValue(tokens, (array, string)),
        "tokenizer.ggml.token_type": MetadataValue(types, (array, GGUFValueType.INT32)),
        "tokenizer.ggml.merges": MetadataValue(merges, (array, string)),
        "tokenizer.ggml.bos_token_id": MetadataValue(endoftext, (u32,)),
        "tokenizer.ggml.eos_token_id": MetadataValue(im_end, (u32,)),
        "tokenizer.ggml.padding_token_id": MetadataValue(endoftext, (u32,)),
        "tokenizer.ggml.add_bos_token": MetadataValue(False, (GGUFValueType.BOOL,)),
        "tokenizer.chat_template": MetadataValue(CHATML_TEMPLATE, (string,)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the GGUF to write")
    p.add_argument("--shape", help="a name of tandem.synthetic.shapes, optionally with overrides: "
                                   "qwen2.5-0.5b:n_layers=4,vocab_size=152064")
    p.add_argument("--mix", default="Q4_0", choices=MIXES)
    p.add_argument("--tokenizer-from", help="a GGUF whose tokenizer to copy (default: the tiny test tokenizer)")
    p.add_argument("--extract-tokenizer", metavar="SRC", help="write OUT as SRC's tokenizer metadata alone")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=None)
    args = p.parse_args(argv)
    if args.extract_tokenizer:
        extract_tokenizer(args.extract_tokenizer, args.out)
        print(f"{args.out}: tokenizer of {args.extract_tokenizer}, {os.path.getsize(args.out) / 1e6:.1f} MB")
        return 0
    if not args.shape:
        p.error("--shape is required (or --extract-tokenizer)")
    summary = write_random_gguf(args.out, args.shape, args.mix, args.tokenizer_from, args.seed, args.workers,
                                log=lambda message: print(message, file=sys.stderr, flush=True))
    print(f"{summary.path}: {summary.bytes / 1e9:.2f} GB in {summary.seconds:.1f} s (tensors "
          f"{summary.bytes / 1e9 / summary.data_seconds:.2f} GB/s); tensor types {summary.tensor_types}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
