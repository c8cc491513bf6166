"""VerifierActor: a StreamingExecutor (runtime/executor.py) whose store is the LayerStoreActor (RemoteStore).

Every sweep, Llama, Gemma or DeepSeek (MLA, and routed experts read as the chunk routes to them), single or
batched, is the in-process executor's: its reader threads keep reads requested ahead from the store actor,
within the memory budget, and the stream is cyclic, so layer 0 of the next sweep is read while the head
computes. Shards land in a shared-memory ring when the store actor is on this node, else they come through
the object store (actors/store.py). Nothing about layers is written here.

Restart safety: every sweep carries (cache id, seq, start). A fresh actor (Ray restarted it) has no cache and
answers None; the driver then replays the sweep history, which rebuilds the cache bit for bit (the same
chunks through the same code), and asks again. A failed sweep leaves the cache length where it was.
"""
from __future__ import annotations

import os

import torch

from ..errors import ConfigError
from ..models.layers import Chunk
from ..runtime import shm
from ..runtime.executor import StreamingExecutor
from ..runtime.prefetch import MAX_READERS
from .common import TIMEOUT_S, node_id, normal_priority
from .store import RemoteStore


def rollback(cache, start) -> None:
    """Before a sweep: `start` is the committed length (rejected drafts dropped), or (at, slots) after a tree
    round: keep [0, at) and the accepted path's slots, compacted (see SlotCache.compact)."""
    if isinstance(start, tuple):
        cache.compact(*start)
    else:
        cache.truncate(start)


class Verifier:
    """The plain class behind VerifierActor. Set up lazily (first ready/sweep), so that an actor Ray restarts
    while the store actor is also down reports StoreLost (the driver revives the store and asks again) rather
    than dying in its constructor."""

    def __init__(self, store, dtype=torch.float32, device: str = "cpu", depth: int = 1,
                 memory_budget: float | None = None, threads: int | None = None, timeout_s: float = TIMEOUT_S,
                 shared_ring: bool = True, wide_threads: int | None = None, expert_cache: float | None = None):
        """threads, wide_threads: the driver's compute count, and its count for long sweeps (the in-process
        executor's wide_threads), so the verifier's sweeps give the in-process engine's bits. expert_cache: bytes
        of a MoE store's recently used experts kept here (StreamingExecutor's)."""
        normal_priority()
        self.wide_threads, self.expert_cache = wide_threads, expert_cache
        if threads:
            torch.set_num_threads(threads)  # the driver's count: the same matmul blocking, the same bits
        self.store_ref, self.dtype, self.timeout_s = store, dtype, timeout_s  # a LayerStoreActor name or handle
        self.device_name, self.depth, self.memory_budget = device, depth, memory_budget
        self.shared_ring = shared_ring  # a store actor on this node reads into a SharedRing (no object-store copy)
        self.executor: StreamingExecutor | None = None
        self.cache_id, self.cache, self.seq = None, None, 0
        self.batch_caches: dict = {}  # group -> {cache id -> [cache, sweeps it has had]} (one group per pipeline)

    def _setup(self) -> StreamingExecutor:
        if self.executor is not None:
            return self.executor
        device = self.device_name
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} asked for, but torch sees no CUDA device on the verifier's node")
        store = RemoteStore(self.store_ref, self.timeout_s)
        ex = StreamingExecutor(store, device, self.dtype, self.memory_budget, prefetch_depth=self.depth,
                               expert_cache=self.expert_cache)
        ex.wide_threads = self.wide_threads
        if self.shared_ring:
            store.use_ring(self._ring_bytes(ex))
        self.executor = ex
        return ex

    def _ring_bytes(self, ex: StreamingExecutor) -> int:
        """A ring for the sweep's cycle of units, `depth` read ahead of the one computing, plus room for as many
        experts as are read at once (experts are read within the sweep's budget too; a ring that is full all
        the same sends a read through the object store)."""
        m = ex.store.manifest
        sizes = [m.unit(n).bytes for n in ex.sweep_names]
        experts = [u.bytes for u in m.units if u.name.startswith("expert.")]
        extra = shm.slot_bytes(max(experts)) * MAX_READERS if experts else 0
        return shm.capacity_for(sizes, self.depth, ex.budget) + extra

    def transport(self) -> str:
        """How shards reach this verifier: "shared ring" (store actor on this node) or "object store"."""
        return self._setup().store.transport

    def ready(self) -> str:
        self._setup()
        return node_id()

    def pid(self) -> int:
        return os.getpid()

    def drain(self, timeout_s: float = 10.0) -> None:
        """Let the reads requested ahead finish (the stream stops), before the engine kills the actors: a store
        actor killed under them has Ray print a failed, retried task on the user's terminal."""
        if self.executor is not None:
            self.executor.close()

    def set_store(self, store) -> None:
        """A recreated LayerStoreActor (name or handle): read from it from now on."""
        self.store_ref = store
        if self.executor is not None:
            self.executor.close()  # reads in flight belong to the dead actor
            self.executor.store.set_actor(store)  # (a ring in use is replaced; the new store may be elsewhere)

    def _sweep(self, tokens, cache, logits_from: int, positions=None, mask=None, hidden=None):
        pos = None if positions is None else torch.as_tensor(positions, dtype=torch.long)
        return self.executor.sweep(tokens, cache, pos, mask, logits_from, hidden)

    def sweep(self, cache_id, seq: int, start: int, tokens, logits_from: int = 0, positions=None, mask=None,
              hidden=None):
        """Sweep `tokens` after the first `start` cached tokens (dropping the rest: rejected drafts). Returns
        (logits, SweepStats), or None if this actor does not hold sweep number `seq` of cache `cache_id` (it was
        restarted): replay first. hidden: a pipeline stage's input from the stage before (actors/stages.py)."""
        ex = self._setup()
        if seq == 0:
            self.cache_id, self.cache, self.seq = cache_id, ex.new_cache(), 0
        elif cache_id != self.cache_id or seq != self.seq:
            return None
        rollback(self.cache, start)
        out = self._sweep(tokens, self.cache, logits_from, positions, mask, hidden)
        self.seq += 1
        return out

    def _rebuild(self, history, hiddens=None):
        """A cache rebuilt from its sweep history [(start, tokens, positions, mask)]: the same chunks through the
        same code give the same K/V bits (only the last row's logits are computed). A stage's replay takes the
        stage before's output for each sweep (`hiddens`) -> (the cache, this stage's output for each sweep)."""
        cache = self._setup().new_cache()
        outs = []
        for i, (start, tokens, positions, mask) in enumerate(history):
            rollback(cache, start)
            out, _ = self._sweep(tokens, cache, len(tokens) - 1, positions, mask,
                                 None if hiddens is None else hiddens[i])
            outs.append(out)
        return cache, outs

    def replay(self, cache_id, history) -> None:
        self.cache_id, self.cache, self.seq = cache_id, self._rebuild(history)[0], len(history)

    # ---- batch jobs: several caches in one sweep (speculative/batch.py) ----------------------------------------

    def sweep_batch(self, items, hidden=None, group=0):
        """One streamed sweep for several sequences, each with its own cache held here by id (a ragged batch).
        items: [(cache_id, seq, logits_from, start, tokens, positions, mask)], start as sweep's (a length, or
        (at, slots) after a tree round); a cache at seq 0 is made new, and the group's caches not named are
        dropped (their sequences finished). Returns (logits per item, SweepStats), or None if some cache is not
        at sweep `seq` here (a restarted actor): replay_caches first. group: the pipeline the batch belongs to
        (pipelined stages serve several); hidden: a stage's input, as sweep's."""
        ex = self._setup()
        caches = self.batch_caches.setdefault(group, {})
        if any(seq > 0 and caches.get(cid, (None, -1))[1] != seq for cid, seq, *_ in items):
            return None
        named = {cid for cid, *_ in items}
        for cid in [c for c in caches if c not in named]:
            del caches[cid]
        chunks = []
        for cid, seq, logits_from, start, tokens, positions, mask in items:
            if seq == 0:
                caches[cid] = [ex.new_cache(), 0]
            cache = caches[cid][0]
            rollback(cache, start)
            chunks.append(Chunk(tokens, cache, None if positions is None else torch.as_tensor(positions),
                                mask, logits_from))
        out = ex.sweep_batch(chunks, hidden)
        for cid in named:
            caches[cid][1] += 1
        return out

    def replay_caches(self, histories) -> None:
        self._replay_caches(histories)

    def _replay_caches(self, histories, group=0, hiddens=None) -> list:
        """Rebuild batch caches after a restart: [(cache_id, [(start, tokens, positions, mask), ...])], each
        from its own chunks, one sequence at a time. (The batch sweeps that first built them mixed other
        sequences' rows into each matmul, so the rebuilt K/V can differ from those in float rounding, as a
        batch's do from one-at-a-time generation's.) A stage's replay (hiddens: the stage before's output per
        cache and sweep) returns its own output per cache and sweep."""
        caches, outs = {}, []
        for i, (cid, history) in enumerate(histories):
            cache, out = self._rebuild(history, None if hiddens is None else hiddens[i])
            caches[cid] = [cache, len(history)]
            outs.append(out)
        self.batch_caches[group] = caches
        return outs
