"""A static, preallocated KV cache indexed by absolute position.

Rewinding is just moving `length`: stale entries past it are never read, because the causal mask only lets a
query at position p see keys at positions <= p, and every such key was written by this or an earlier forward.
Shapes never change, which is what CUDA graphs need.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (n_layers, 1, n_kv_heads, capacity, head_dim)  # [L, B, H_kv, S, D]
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [B, H_kv, T, D] at positions [T]; index_copy_ keeps it one kernel and graph-capturable."""
        self.k[layer].index_copy_(2, positions, k)
        self.v[layer].index_copy_(2, positions, v)

    def rewind(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind to {length}: the cache holds {self.length} tokens")
        self.length = length

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
