"""StreamingExecutor: runs a chunk of new tokens through the target, streaming each layer exactly once.

A sweep embeds the chunk (the embedding table is resident), then for every decoder layer: the layer's shard
arrives from the UnitStream (read ahead on a worker thread), the whole chunk goes through it as one batched
matmul, and the weights are dropped; finally the head unit gives logits. The KV cache stays resident.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..models import llama, rope
from ..store.store import LayerStore
from .kvcache import KVCache
from .prefetch import Residency, UnitStream
from .weights import materialize


@dataclass
class SweepStats:
    tokens: int
    bytes_read: int
    io_s: float
    prep_s: float
    compute_s: float
    stall_s: float
    wall_s: float

    def __repr__(self) -> str:
        return (f"SweepStats(tokens={self.tokens}, read={self.bytes_read / 1e6:.1f} MB, io={self.io_s * 1e3:.1f} ms, "
                f"compute={self.compute_s * 1e3:.1f} ms, stall={self.stall_s * 1e3:.1f} ms)")


class StreamingExecutor:
    def __init__(self, store: LayerStore | str, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 memory_budget: float | None = None, cold: bool = False, prefetch_depth: int = 1,
                 direct: bool = False):
        self.store = store if isinstance(store, LayerStore) else LayerStore(store)
        self.args = self.store.args
        self.device, self.dtype, self.cold, self.direct = torch.device(device), dtype, cold, direct
        self.budget = float("inf") if memory_budget is None else float(memory_budget)
        self.depth = prefetch_depth
        self.pin = self.device.type == "cuda"
        self.residency = Residency()
        self.layer_names = [u.name for u in self.store.manifest.layer_units]
        if len(self.layer_names) != self.args.num_hidden_layers:
            raise ConfigError(f"store has {len(self.layer_names)} layers, config says {self.args.num_hidden_layers}")
        self._stream: UnitStream | None = None
        self.stream(self.layer_names + ["head"]).check_budget()  # a budget below the largest unit fails here
        embed = self.store.read("embed")
        self.resident_bytes = embed.nbytes
        self.embed = materialize(embed.tensors, dtype, self.device, self.store.manifest.group_size or 64)["weight"]
        self.inv_freq = rope.inv_freq(self.args).to(self.device)
        self.sweeps = 0
        self.bytes_read = 0

    def new_cache(self) -> KVCache:
        a = self.args
        return KVCache(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, self.dtype, self.device)

    def stream(self, names: list[str], cycle: bool = False) -> UnitStream:
        return UnitStream(self.store, names, dtype=self.dtype, device=self.device, budget=self.budget,
                          depth=self.depth, cold=self.cold, residency=self.residency, pin=self.pin,
                          direct=self.direct, cycle=cycle)

    def _sweep_stream(self) -> UnitStream:
        """One long-lived stream that cycles through the layers: while the caller verifies and drafts between
        sweeps, the worker already reads the next sweep's first layers (up to depth / the budget)."""
        if self._stream is None:
            self._stream = self.stream(self.layer_names + ["head"], cycle=True).start()
        return self._stream

    def close(self) -> None:
        """Stop reading ahead (units read ahead for a sweep that never comes are dropped)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    @torch.inference_mode()
    def sweep(self, tokens, cache: KVCache, positions: torch.Tensor | None = None,
              mask: torch.Tensor | None = None, logits_from: int = 0) -> tuple[torch.Tensor, SweepStats]:
        """One streamed sweep: tokens [T] -> logits [T - logits_from, vocab] (fp32, on CPU); see llama.forward."""
        t_start = time.perf_counter()
        ids = torch.as_tensor(tokens, dtype=torch.long)
        if ids.numel() == 0:
            raise ValueError("a sweep needs at least one token")
        last = cache.length + ids.numel() if positions is None else int(positions.max()) + 1
        if last > self.args.max_position_embeddings:
            raise ConfigError(f"sequence of {last} tokens exceeds the model's context "
                              f"({self.args.max_position_embeddings})")
        stream = self._sweep_stream()
        try:
            logits = llama.forward(self.args, self.embed, self.inv_freq, stream.take(), ids, cache, positions,
                                   mask, logits_from)
        except BaseException:
            self.close()  # a failed or interrupted sweep leaves the cycle mid-pass: start afresh next time
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - t_start
        st = stream.stats
        self.sweeps += 1
        self.bytes_read += st.bytes_read
        compute = wall - st.stall_s if self.depth > 0 else wall - st.io_s - st.prep_s
        return logits.cpu(), SweepStats(ids.numel(), st.bytes_read, st.io_s, st.prep_s, compute, st.stall_s, wall)
