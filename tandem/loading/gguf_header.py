"""A GGUF file's header: its metadata and tensor infos parsed with `struct`, and its data section checked against
them (gguf.py reads the tensors and the config from what this returns). Every problem is a GGUFError naming the
file and what is wrong with it.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"


class GGUFError(ValueError):
    """A GGUF file is missing, malformed, or describes something tandem cannot run."""


_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_DTYPES = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9
DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4  # llama.cpp's limit on a tensor's dimensions


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF stores dims fastest-first; reversed here)
    qtype: Any  # gguf.GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class _HeaderParser:
    """Parses a GGUF header straight from the mapped bytes: gguf.GGUFReader's numpy view per array element takes
    ~16 s for a 152k vocabulary, struct ~0.3 s. Tensor data is still dequantised by gguf-py."""

    def __init__(self, buf: memoryview, path: str):
        self.buf, self.path, self.pos = buf, path, 0

    def _unpack(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self._unpack("<Q")
        if self.pos + n > len(self.buf):
            raise struct.error(f"string of {n} bytes at offset {self.pos} runs past the end")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            sub_type, count = self._unpack("<I"), self._unpack("<Q")
            if sub_type == _STRING:
                return [self.string() for _ in range(count)]
            if sub_type == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_NUMPY_DTYPES[sub_type])
            if self.pos + count * dtype.itemsize > len(self.buf):
                raise struct.error(f"array of {count} values at offset {self.pos} runs past the end")
            array = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += count * dtype.itemsize
            return array.tolist()
        if vtype not in _SCALAR_FORMATS:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype} at offset {self.pos}")
        return self._unpack(_SCALAR_FORMATS[vtype])


def parse_header(buf: memoryview, path: str, file_size: int) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    p = _HeaderParser(buf, path)
    p.pos = 4  # past the magic
    version = p._unpack("<I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: unsupported GGUF version {version} (supported: 2, 3; big-endian files are not)")
    n_tensors, n_kv = p._unpack("<Q"), p._unpack("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = p.string()
        metadata[key] = p.value(p._unpack("<I"))
    raw_infos = [_read_tensor_info(p, i, n_tensors) for i in range(n_tensors)]
    header_end = p.pos
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: general.alignment is {alignment}, not a power of two")
    data_start = _align(header_end, alignment)

    tensors: dict[str, TensorInfo] = {}
    for name, dims, type_id, offset in raw_infos:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has unknown ggml type id {type_id}") from None
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_elements = math.prod(dims)
        if dims and dims[0] % block_size:
            raise GGUFError(
                f"{path}: tensor {name!r} row of {dims[0]} is not a multiple of {qtype.name}'s block {block_size}"
            )
        if name in tensors:
            raise GGUFError(f"{path}: tensor {name!r} is described twice")
        tensors[name] = TensorInfo(name, tuple(reversed(dims)), qtype, data_start + offset,
                                   n_elements // block_size * type_size)
    _check_data_section(path, p, list(tensors.values()), n_tensors, data_start, alignment, file_size)
    return metadata, tensors


def _align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _read_tensor_info(p: _HeaderParser, index: int, n_tensors: int) -> tuple[str, list[int], int, int]:
    """(name, dims fastest-first, ggml type id, offset relative to the data section) of tensor info `index`."""
    start = p.pos
    try:
        name = p.string()
        n_dims = p._unpack("<I")
        if not name or n_dims > GGML_MAX_DIMS:
            reason = "an empty name" if not name else f"{n_dims} dimensions (at most {GGML_MAX_DIMS})"
            raise GGUFError(reason)
        dims = [p._unpack("<Q") for _ in range(n_dims)]
        return name, dims, p._unpack("<I"), p._unpack("<Q")
    except (GGUFError, struct.error) as exc:
        # Past the real infos, a reader is parsing padding and tensor data: the count is the likeliest culprit.
        raise GGUFError(
            f"{p.path}: the header counts {n_tensors} tensors, but tensor info {index + 1} (at byte {start}) is "
            f"not a valid tensor description ({exc}); is the tensor count too high?"
        ) from None


def _check_data_section(path: str, p: _HeaderParser, tensors: list[TensorInfo], n_tensors: int, data_start: int,
                        alignment: int, file_size: int) -> None:
    """Every byte of the data section belongs to exactly one tensor, up to alignment padding: llama.cpp only
    checks that each offset follows the previous one, so a header one tensor short reads every tensor wrong."""
    counted = f"the header counts {n_tensors} tensors"
    for info in tensors:
        relative = info.offset - data_start
        if relative % alignment:
            raise GGUFError(f"{path}: tensor {info.name!r} starts at data offset {relative}, which is not a multiple "
                            f"of the alignment {alignment}")
        if info.offset + info.nbytes > file_size:
            raise GGUFError(f"{path}: truncated: tensor {info.name!r} ends at byte {info.offset + info.nbytes} but "
                            f"the file has {file_size} ({counted}; a count too high shifts every tensor later)")
    expected, previous = data_start, None
    for info in sorted(tensors, key=lambda t: t.offset):
        if info.offset < expected and previous is not None:
            raise GGUFError(f"{path}: tensors {previous.name!r} (bytes {previous.offset}-"
                            f"{previous.offset + previous.nbytes}) and {info.name!r} (from byte {info.offset}) overlap")
        if info.offset > expected:
            after = f"after tensor {previous.name!r}" if previous else "at the start of the data section"
            raise GGUFError(f"{path}: {info.offset - expected} bytes {after} (bytes {expected}-{info.offset}) belong "
                            f"to no tensor ({counted})")
        expected, previous = _align(info.offset + info.nbytes, alignment), info
    end = previous.offset + previous.nbytes if previous else data_start
    if file_size - end >= alignment:
        raise GGUFError(f"{path}: {file_size - end} bytes after the last tensor (bytes {end}-{file_size}) belong to "
                        f"no tensor: {counted}{_uncounted_hint(p, n_tensors)}")


def _uncounted_hint(p: _HeaderParser, n_tensors: int) -> str:
    """When a valid tensor info follows the counted ones, name it: the count is short."""
    try:
        name, dims, _, _ = _read_tensor_info(p, n_tensors, n_tensors)
    except GGUFError:
        return " (or the file has trailing data)"
    if not name.isprintable():
        return " (or the file has trailing data)"
    return f", but another, {name!r} {list(reversed(dims))}, follows them: the count is short"


def check_header(path: str) -> None:
    if not os.path.exists(path):
        raise GGUFError(f"{path}: no such file")
    if os.path.isdir(path):
        raise GGUFError(f"{path}: is a directory, not a GGUF file")
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 4 or head[:4] != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic bytes {head[:4]!r}, expected {GGUF_MAGIC!r})")
    if len(head) < 24:
        raise GGUFError(f"{path}: truncated GGUF header ({len(head)} bytes)")
