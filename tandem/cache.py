"""A static, preallocated KV cache indexed by absolute position.

Rewinding is just moving `length`: stale entries past it are never read, because the causal mask only lets a
query at position p see keys at positions <= p, and every such key was written by this or an earlier forward.
Shapes never change, which is what CUDA graphs need. A pool holds several sequences, one row each
([B, H_kv, S, D] a layer); `row(b)` is one sequence's cache, a view of the pool's memory with a length of its own.
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
        sequences: int = 1,
    ) -> None:
        shape = (sequences, n_kv_heads, capacity, head_dim)  # [B, H_kv, S, D] per layer
        # One tensor per layer, not one [L, ...] tensor: a compiled step writes each in place, where a slice of a
        # shared tensor would make the compiler copy the whole cache back after every write.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.capacity = capacity
        self.length = 0

    def row(self, b: int) -> KVCache:
        """Sequence b's cache: [1, H_kv, S, D] views of this pool's tensors, its own length (starting at 0)."""
        view = KVCache.__new__(KVCache)
        view.k, view.v = [t[b : b + 1] for t in self.k], [t[b : b + 1] for t in self.v]
        view.capacity, view.length = self.capacity, 0
        return view

    def rewind(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind to {length}: the cache holds {self.length} tokens")
        self.length = length

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)
