"""Routed experts for a streamed sweep: several shards read at once after routing, hot experts kept in memory.

ExpertReader is the StreamingExecutor's ExpertProvider (models/moe.py): a MoE layer asks it for the union of the
experts its chunk routed to, ascending. Experts in its cache are handed out from memory; the others are read
through a UnitStream over their shards, which with `readers` > 1 keeps that many reads in flight on its thread
pool while the caller computes with the experts already read, still in ascending order. readers = 1 reads one
at a time, each after the previous one was used.

Memory. DeepSeek's routed experts all have the same shapes, so each needs `unit` bytes (the largest, to be safe):
- outside the cache, at most readers + 1 experts are alive when readers > 1 (the one in use and one per read in
  flight: the stream's slots bound it), one when readers = 1. That is `reserve(readers, unit)`, which the
  executor sets aside by streaming layers within budget - reserve;
- the cache holds floor(cache_bytes / unit) experts, counted in the residency from the start (a placeholder per
  empty slot, tracked as one expert's bytes), so the layers' stream treats those bytes as taken before the
  cache fills, and nothing ever waits for room that the cache takes later.
Layers, their read-ahead, the cache and the experts outside it thus stay within the budget (residency.peak).

Cache policy: least recently used first out, except that an expert used in this sweep or the previous one is
never evicted (a miss that would need it is not cached). A sweep uses each layer's experts once, in layer order,
so an expert comes back a whole sweep's union of experts later at the soonest: when that union is larger than
the cache, plain LRU evicts every expert just before its next use and never hits (in benchmarks/bench_moe.py's
setup, a cache of a quarter of all experts: plain LRU hit 0% at chunks of 8 and 16 tokens, this policy 28% and
25%).
"""
from __future__ import annotations

import time
from collections import OrderedDict

import torch

from .prefetch import BufferPool, Residency, UnitStream


def reserve(readers: int, unit: int) -> int:
    """Bytes of experts alive outside the cache with `readers` reads in flight (one in use besides them)."""
    return unit * (readers + 1 if readers > 1 else 1)


def fit_readers(readers: int, unit: int, room: float) -> int:
    """The most reads in flight, at most `readers`, whose experts fit in `room` bytes (at least 1)."""
    return max([r for r in range(2, readers + 1) if reserve(r, unit) <= room], default=1)


class ExpertReader:
    """ExpertProvider over a store's expert shards: reader(layer, ids ascending, into) yields (expert id, weights)
    and adds its figures to `into` (a SweepStats: experts_read, expert_hits, expert_bytes, io_s, prep_s,
    stall_s, where stall_s is the time the caller waited for expert reads)."""

    def __init__(self, store, unit: int, *, readers: int, cache_bytes: float, dtype: torch.dtype, device,
                 budget: float, cold: bool, residency: Residency, pin: bool, direct: bool):
        self.store, self.unit, self.readers = store, unit, readers
        self.stream_kw = dict(dtype=dtype, device=device, budget=budget, cold=cold, residency=residency, pin=pin,
                              direct=direct)
        self.slots = int(cache_bytes // unit) if unit else 0
        # (layer, expert) -> (weights, the sweep that last used it), least recently used first
        self.cache: OrderedDict[tuple[int, int], tuple[dict, int]] = OrderedDict()
        self.sweep, self._layer = 0, None  # sweeps counted by their layers: a layer not after the last starts one
        self._empty = []  # one placeholder per empty slot
        for _ in range(self.slots):
            t = torch.empty(1, dtype=torch.uint8)
            residency.track(t, unit)
            self._empty.append(t)
        self.buffers = BufferPool()  # read buffers reused across layers and sweeps

    def __call__(self, layer: int, ids: list[int], into, clock=None):
        from ..store.convert import expert_name  # (convert's imports are heavy; the executor's module stays light)

        if self._layer is None or layer <= self._layer:
            self.sweep += 1
        self._layer = layer
        hits = {e for e in ids if (layer, e) in self.cache}
        for e in ids:
            if e in hits:
                self.cache[layer, e] = (self.cache[layer, e][0], self.sweep)
                self.cache.move_to_end((layer, e))
        misses = [e for e in ids if e not in hits]
        stream = UnitStream(self.store, [expert_name(layer, e) for e in misses], **self.stream_kw,
                            depth=self.readers if self.readers > 1 else 0, readers=self.readers)
        stream.buffers = self.buffers
        if clock is not None:  # one clock with the layers' reads: overlapping reads share the disk's time
            stream.clock = clock
        stall = 0.0
        try:
            it = stream.start().take() if misses else iter(())
            for e in ids:
                if e in hits:
                    w = self.cache[layer, e][0]
                else:
                    t0 = time.perf_counter()
                    _, w = next(it)
                    stall += time.perf_counter() - t0
                    self._keep((layer, e), w)
                yield e, w
                del w  # (the caller drops its reference too, so an expert not cached is freed now)
            for _ in it:  # resume take() once more so it lets go of the last expert
                pass
        finally:
            stream.close()
        into.experts_read += len(ids)
        into.expert_hits += len(hits)
        into.expert_bytes += stream.stats.bytes_read
        into.io_s += stream.stats.io_s
        into.prep_s += stream.stats.prep_s
        into.stall_s += stall

    def _keep(self, key: tuple[int, int], w: dict) -> None:
        """Cache a miss: it takes an empty slot's placeholder's place, or the least recently used expert's unless
        that one was used in this sweep or the one before (then the miss is not cached)."""
        if not self.slots:
            return
        if self._empty:
            self._empty.pop()  # (its bytes are released: the expert's own are counted already)
        else:
            oldest = next(iter(self.cache))
            if self.cache[oldest][1] >= self.sweep - 1:
                return
            del self.cache[oldest]
        self.cache[key] = (w, self.sweep)
