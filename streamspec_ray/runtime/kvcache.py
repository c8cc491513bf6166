"""A resident KV cache indexed by slot. Rolling back rejected tokens is just moving `length` back: the next
sweep overwrites those slots (gpt-fast's trick)."""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype=torch.float32, device="cpu",
                 capacity: int = 256):
        self.shape = (n_kv_heads, head_dim)
        self.dtype, self.device = dtype, device
        self.k = [torch.zeros(n_kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.length = 0  # slots [0, length) hold committed tokens

    @property
    def capacity(self) -> int:
        return self.k[0].shape[1]

    @property
    def nbytes(self) -> int:
        return 2 * sum(k.numel() * k.element_size() for k in self.k)

    def bytes_per_token(self) -> int:
        return 2 * len(self.k) * self.shape[0] * self.shape[1] * self.k[0].element_size()

    def reserve(self, n: int) -> None:
        """Make room for n slots in total (grows by doubling, copying the committed part)."""
        if n <= self.capacity:
            return
        cap = max(n, 2 * self.capacity)
        for i in range(len(self.k)):
            for store in (self.k, self.v):
                new = torch.zeros(self.shape[0], cap, self.shape[1], dtype=self.dtype, device=self.device)
                new[:, : self.length] = store[i][:, : self.length]
                store[i] = new

    def truncate(self, n: int) -> None:
        if n > self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {n}")
        self.length = n

    def compact(self, slots: list[int]) -> None:
        """Keep only `slots` (ascending, all >= some base), moved to consecutive slots after the last untouched
        one: used after a tree sweep to keep the accepted path. Slots below slots[0] stay as they are."""
        base = slots[0]
        idx = torch.tensor(slots, device=self.device)
        for store in (self.k, self.v):
            for t in store:
                t[:, base : base + len(slots)] = t[:, idx]
        self.length = base + len(slots)


class LatentCache:
    """MLA cache (DeepSeek V2/V3): per layer and token only the normed latent c_kv [kv_lora_rank] and the
    roped shared key k_pe [qk_rope_head_dim], instead of K and V for every head. Same slot semantics as
    KVCache (rollback = moving `length` back)."""

    def __init__(self, n_layers: int, kv_lora_rank: int, rope_dim: int, dtype=torch.float32, device="cpu",
                 capacity: int = 256):
        self.dtype, self.device = dtype, device
        self.ckv = [torch.zeros(capacity, kv_lora_rank, dtype=dtype, device=device) for _ in range(n_layers)]
        self.kpe = [torch.zeros(capacity, rope_dim, dtype=dtype, device=device) for _ in range(n_layers)]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.ckv[0].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.ckv + self.kpe)

    def bytes_per_token(self) -> int:
        return sum(t.shape[1] * t.element_size() for t in self.ckv + self.kpe)

    def reserve(self, n: int) -> None:
        if n <= self.capacity:
            return
        cap = max(n, 2 * self.capacity)
        for store in (self.ckv, self.kpe):
            for i, t in enumerate(store):
                new = torch.zeros(cap, t.shape[1], dtype=self.dtype, device=self.device)
                new[: self.length] = t[: self.length]
                store[i] = new

    def truncate(self, n: int) -> None:
        if n > self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {n}")
        self.length = n

    def compact(self, slots: list[int]) -> None:
        base = slots[0]
        idx = torch.tensor(slots, device=self.device)
        for store in (self.ckv, self.kpe):
            for t in store:
                t[base : base + len(slots)] = t[idx]
        self.length = base + len(slots)
