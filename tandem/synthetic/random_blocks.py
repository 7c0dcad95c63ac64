"""Random but valid quantised blocks of ggml types, with values of a chosen spread: weights written without a float
quantisation pass, so a 32B model's 18 GB of GGUF take as long as the random bytes and the disk do.
More: docs/internals.md."""

from __future__ import annotations

from functools import cache

import numpy as np

# Byte offsets of the fp16 super-block scale `d` and, where the type has one, the min scale `dmin` (`m`) per block.
SCALE_OFFSETS: dict[str, tuple[int, int | None]] = {
    "Q4_0": (0, None),
    "Q4_1": (0, 2),
    "Q5_0": (0, None),
    "Q5_1": (0, 2),
    "Q8_0": (0, None),
    "Q2_K": (80, 82),
    "Q3_K": (108, None),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208, None),
}
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
CALIBRATION_BLOCKS = 4096  # blocks in the sample the unit scales are measured on
SIGN_BIT = np.uint16(0x8000)


def block_geometry(qtype: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a ggml type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]


def row_bytes(qtype: str, cols: int) -> int:
    """Bytes of one row of `cols` values; raises where the row is not a whole number of blocks."""
    block, size = block_geometry(qtype)
    if cols % block:
        raise ValueError(f"{qtype} needs rows that are a multiple of {block} values; got a row of {cols}")
    return cols // block * size


def _set_scales(blocks: np.ndarray, qtype: str, d: float, dmin: float, signs: bool) -> None:
    """Write d (and dmin) into every block of `blocks` [n, bytes] in place; with `signs`, a block whose random bits had
    d's sign bit set gets both negated (all its values flip sign)."""
    d_off, dmin_off = SCALE_OFFSETS[qtype]
    halves = blocks.view(np.uint16)  # every type here has an even block size and even scale offsets
    sign = halves[:, d_off // 2] & SIGN_BIT if signs else np.uint16(0)
    halves[:, d_off // 2] = np.float16(d).view(np.uint16) ^ sign
    if dmin_off is not None:
        halves[:, dmin_off // 2] = np.float16(dmin).view(np.uint16) ^ sign


@cache
def unit_scales(qtype: str) -> tuple[float, float]:
    """(d, dmin) for which random blocks of `qtype` dequantise to values of mean ~0 and std ~1."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    gtype = GGMLQuantizationType[qtype]
    _, size = block_geometry(qtype)
    sample = np.random.default_rng(0).integers(0, 256, size=(CALIBRATION_BLOCKS, size), dtype=np.uint8)

    def values(d: float, dmin: float) -> np.ndarray:
        _set_scales(sample, qtype, d, dmin, signs=False)
        return dequantize(sample, gtype)

    # Values are d * A + dmin * B: measure A's and B's means, pick the dmin that centres, then scale for std 1.
    has_min = SCALE_OFFSETS[qtype][1] is not None
    ratio = float(values(1.0, 0.0).mean()) / float(-values(0.0, 1.0).mean()) if has_min else 0.0
    spread = float(values(1.0, ratio).std()) or 1.0
    return 1.0 / spread, ratio / spread


def set_scales(blocks: np.ndarray, qtype: str, std: float, signs: bool = True) -> np.ndarray:
    """Give random blocks [n, bytes] of `qtype` the scales for values of spread `std`, in place; returns them."""
    d, dmin = unit_scales(qtype)
    _set_scales(blocks, qtype, d * std, dmin * std, signs)
    return blocks


def random_rows(rows: int, cols: int, qtype: str, std: float, rng: np.random.Generator) -> np.ndarray:
    """[rows, row bytes] of random `qtype` blocks whose values have ~zero mean and ~`std` spread."""
    block, size = block_geometry(qtype)
    n = rows * row_bytes(qtype, cols)
    # random_raw: the bit generator's own 64-bit words, the fastest random bytes numpy has (~2-3 GB/s a core)
    raw = rng.bit_generator.random_raw((n + 7) // 8).view(np.uint8)[:n]
    blocks = raw.reshape(rows * cols // block, size)
    set_scales(blocks, qtype, std)
    return blocks.reshape(rows, -1)
