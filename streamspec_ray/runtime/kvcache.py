"""Resident caches indexed by slot. Rolling back rejected tokens is just moving `length` back: the next
sweep overwrites those slots (gpt-fast's trick)."""
from __future__ import annotations

import torch


class SlotCache:
    """Per-layer tensors with one axis of token slots (`slot_dim`); subclasses name the tensor lists."""
    slot_dim = 0

    def __init__(self, stores: list[list[torch.Tensor]], dtype, device):
        self.stores, self.dtype, self.device = stores, dtype, device
        self.length = 0  # slots [0, length) hold committed tokens

    @property
    def capacity(self) -> int:
        return self.stores[0][0].shape[self.slot_dim]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for store in self.stores for t in store)

    def bytes_per_token(self) -> int:
        return self.nbytes // self.capacity

    def reserve(self, n: int) -> None:
        """Make room for n slots in total (grows by doubling, copying the committed part)."""
        if n <= self.capacity:
            return
        cap = max(n, 2 * self.capacity)
        for store in self.stores:
            for i, t in enumerate(store):
                shape = list(t.shape)
                shape[self.slot_dim] = cap
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                new.narrow(self.slot_dim, 0, self.length).copy_(t.narrow(self.slot_dim, 0, self.length))
                store[i] = new

    def truncate(self, n: int) -> None:
        if n > self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {n}")
        self.length = n

    def compact(self, at: int, slots: list[int]) -> None:
        """Keep slots [0, at) and then only `slots` (ascending, each >= at), moved to at, at+1, ...: after a
        tree sweep, the accepted path's entries become consecutive without a second sweep."""
        if any(s < at for s in slots) or any(b <= a for a, b in zip(slots, slots[1:])) or at > self.length:
            raise ValueError(f"compact: slots {slots} must ascend from {at} (cache of {self.length})")
        if slots:
            idx = torch.tensor(slots, device=self.device)
            # (inference mode: a cache grown during a sweep holds inference tensors, updatable only there)
            with torch.inference_mode():
                for store in self.stores:
                    for t in store:
                        t.narrow(self.slot_dim, at, len(slots)).copy_(t.index_select(self.slot_dim, idx))
        self.length = at + len(slots)

    def save(self, lo: int) -> tuple[int, int, list]:
        """A copy of slots [lo, length) and the length, for `load` to put back (a draft's lookahead, which may
        compact and overwrite them, is undone this way when its guess was wrong)."""
        n = self.length - lo
        return lo, self.length, [t.narrow(self.slot_dim, lo, n).clone() for store in self.stores for t in store]

    def load(self, saved: tuple[int, int, list]) -> None:
        lo, length, rows = saved
        with torch.inference_mode():
            for t, r in zip((t for store in self.stores for t in store), rows):
                t.narrow(self.slot_dim, lo, r.shape[self.slot_dim]).copy_(r)
        self.length = length


class KVCache(SlotCache):
    """Llama-family K and V per layer: [n_kv_heads, slots, head_dim]."""
    slot_dim = 1

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype=torch.float32, device="cpu",
                 capacity: int = 256):
        self.k = [torch.zeros(n_kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(n_layers)]
        self.v = [torch.zeros_like(k) for k in self.k]
        super().__init__([self.k, self.v], dtype, device)


class LatentCache(SlotCache):
    """MLA cache (DeepSeek V2/V3): per layer and token only the normed latent c_kv [kv_lora_rank] and the
    roped shared key k_pe [qk_rope_head_dim], instead of K and V for every head: [slots, dim]."""
    slot_dim = 0

    def __init__(self, n_layers: int, kv_lora_rank: int, rope_dim: int, dtype=torch.float32, device="cpu",
                 capacity: int = 256):
        self.ckv = [torch.zeros(capacity, kv_lora_rank, dtype=dtype, device=device) for _ in range(n_layers)]
        self.kpe = [torch.zeros(capacity, rope_dim, dtype=dtype, device=device) for _ in range(n_layers)]
        super().__init__([self.ckv, self.kpe], dtype, device)
