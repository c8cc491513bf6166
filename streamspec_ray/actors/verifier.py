"""VerifierActor: the target's resident part (embedding, KV cache) and a streamed sweep whose layers arrive as
object refs from the LayerStoreActor.

The sweep is the in-process executor's, with the store on the far side of Ray: llama.forward pulls
(name, weights) from a RefStream, which keeps `depth` reads in flight ahead of the layer being computed. The
stream is cyclic: while the head computes, layer 0 of the next sweep is already being read, so the first
layer of a sweep rarely waits (the store serves the same units in the same order every sweep).

Restart safety: every sweep carries (cache id, seq, start). A fresh actor (Ray restarted it) has no cache and
answers None; the driver then replays the sweep history, which rebuilds the cache bit for bit (the same
chunks through the same code), and asks again. A failed sweep leaves the cache length where it was.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque

import ray
import torch
from ray.exceptions import RayActorError

from ..errors import ConfigError, StreamspecError
from ..models import llama, rope
from ..runtime import shm
from ..runtime.executor import SweepStats, check_chunk
from ..runtime.kvcache import KVCache
from ..runtime.weights import extra_bytes, materialize
from ..store import shard
from .common import TIMEOUT_S, RingUnavailable, StoreLost, as_tensor, cause, node_id, normal_priority

log = logging.getLogger("streamspec")


class RefStream:
    """Yields (name, weights) for every streamed unit of one sweep, with reads requested ahead.

    In flight at once: at most `depth` units beyond the one being computed, and never more streamed bytes
    (shard buffers plus dequantized copies, per the manifest) than `budget`. With a `ring` (the store actor is
    on this node) each read lands in a slot of it, freed once its layer is computed; else each shard arrives
    through the object store."""

    def __init__(self, store, names: list[str], sizes: dict[str, int], need: dict[str, int], dtype, device,
                 group_size: int, depth: int = 1, budget: float = float("inf"), timeout_s: float = TIMEOUT_S,
                 ring: shm.SharedRing | None = None):
        self.store, self.names, self.sizes, self.need = store, names, sizes, need
        self.dtype, self.device, self.group_size = dtype, device, group_size
        self.depth, self.budget, self.timeout_s = max(depth, 0), budget, timeout_s
        self.ring = ring
        self.pending: deque = deque()  # (name, ref, ring offset or None), in stream order
        self.next_i = 0                # index (mod len(names)) of the next unit to request
        self.bytes_read = 0
        self.io_s = self.prep_s = self.stall_s = 0.0

    def reset(self, store=None) -> None:
        """Drop reads in flight (after a failure, or for a new store actor). Those reads may yet write into the
        ring's slots, so a ring is replaced by a fresh one."""
        self.pending.clear()
        self.next_i = 0
        if store is not None:
            self.store = store
        if self.ring is not None:
            self.ring = shm.SharedRing(self.ring.capacity)

    def _request(self) -> bool:
        """Ask for the next unit; False if the ring has no slot for it yet."""
        name = self.names[self.next_i % len(self.names)]
        if self.ring is None:
            ref, at = self.store.read.remote(name), None  # cold or warm: the store's setting
        else:
            room = shm.slot_bytes(self.sizes[name])
            at = self.ring.alloc(room)
            if at is None:
                return False
            ref = self.store.read_into.remote(name, self.ring.key, at, room)
        self.pending.append((name, ref, at))
        self.next_i += 1
        return True

    def _top_up(self, held: int) -> None:
        while len(self.pending) < self.depth:
            upcoming = self.names[self.next_i % len(self.names)]
            if held + sum(self.need[n] for n, *_ in self.pending) + self.need[upcoming] > self.budget:
                break
            if not self._request():
                break

    def _fetch(self, name: str, ref, at: int | None):
        """-> (uint8 tensor [bytes] of the shard, io_s)."""
        try:
            out = ray.get(ref, timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise StoreLost(f"layer store: no answer for {name} within {self.timeout_s:.0f} s") from None
        except RayActorError as e:
            raise StoreLost(f"layer store actor lost while reading {name}: {type(e).__name__}") from None
        except ray.exceptions.RayTaskError as e:
            inner = cause(e)
            if isinstance(inner, (StreamspecError, RingUnavailable)):
                raise inner from None
            raise
        if at is None:
            arr, io_s = out
            return as_tensor(arr), io_s
        start, nbytes, io_s = out
        return self.ring.view(start, nbytes), io_s

    def _first(self, i: int, name: str):
        """The unit `name` (the i-th of the sweep): requested now if nothing is in flight, then waited for."""
        if not self.pending:
            ok = self._request()
            assert ok, "an empty ring has room for any unit"
        got, ref, at = self.pending.popleft()
        assert got == name, f"stream out of order: {got} arrived for {name}"
        try:
            return self._fetch(name, ref, at) + (at,)
        except RingUnavailable as e:
            log.warning("%s; shards now come through the object store", e)
            self.ring = None
            self.reset()
            self.next_i = i
            return self._first(i, name)

    def sweep(self):
        self.bytes_read, self.io_s, self.prep_s, self.stall_s = 0, 0.0, 0.0, 0.0
        for i, name in enumerate(self.names):
            t0 = time.perf_counter()
            buf, io_s, at = self._first(i, name)
            self.stall_s += time.perf_counter() - t0
            self._top_up(held=self.need[name])  # ask for the next units before computing this one
            t0 = time.perf_counter()
            w = materialize(shard.parse(buf, name), self.dtype, self.device, self.group_size)
            self.prep_s += time.perf_counter() - t0
            self.io_s += io_s
            self.bytes_read += buf.numel()
            del buf
            yield name, w
            del w  # the caller dropped its reference too: the buffer can go back to the object store or the ring
            if at is not None:  # its slot (the oldest: slots go in request order) may be read into again. On CUDA
                self.ring.free_oldest()  # the weights are device copies, and a copy from pageable memory has
                # finished reading the host bytes when .to() returns


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
                 shared_ring: bool = True):
        normal_priority()
        if threads:
            torch.set_num_threads(threads)  # the driver's count: the same matmul blocking, the same bits
        self.store_ref, self.dtype, self.timeout_s = store, dtype, timeout_s  # a LayerStoreActor name or handle
        self.device_name, self.depth, self.memory_budget = device, depth, memory_budget
        self.shared_ring = shared_ring  # a store actor on this node reads into a SharedRing (no object-store copy)
        self.stream = None
        self.cache_id, self.cache, self.seq = None, None, 0

    def _store(self):
        if not isinstance(self.store_ref, str):
            return self.store_ref
        try:
            return ray.get_actor(self.store_ref)
        except ValueError:  # no live actor of that name (yet): the driver recreates it
            raise StoreLost(f"layer store actor {self.store_ref!r} not found") from None

    def _fetch(self, ref, what: str):
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except (RayActorError, ray.exceptions.GetTimeoutError) as e:
            raise StoreLost(f"layer store lost during {what}: {type(e).__name__}") from None

    def _setup(self) -> None:
        if self.stream is not None:
            return
        device, dtype = self.device_name, self.dtype
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} asked for, but torch sees no CUDA device on the verifier's node")
        self.device = torch.device(device)
        store = self._store()
        manifest = self._fetch(store.info.remote(), "setup")
        self.args = args = manifest.args
        if getattr(args, "is_deepseek", False):
            raise ConfigError("RayEngine streams Llama-family stores only so far (MLA/MoE stores: use Engine)")
        group = manifest.group_size or 64
        names = [u.name for u in manifest.layer_units] + ["head"]
        if len(names) - 1 != args.num_hidden_layers:
            raise ConfigError(f"store has {len(names) - 1} layers, config says {args.num_hidden_layers}")
        same = self.device.type == "cpu"
        need = {n: manifest.unit(n).bytes + extra_bytes(manifest.unit(n), dtype, same) for n in names}
        budget = float("inf") if self.memory_budget is None else float(self.memory_budget)
        for n in names:
            if need[n] > budget:
                raise ConfigError(f"memory budget {int(budget)} bytes is below unit {n!r} ({need[n]} bytes): "
                                  "raise --memory-budget")
        arr, _ = self._fetch(store.read.remote("embed"), "setup")
        self.embed = materialize(shard.parse(as_tensor(arr), "embed"), dtype, self.device, group)["weight"]
        self.inv_freq = rope.inv_freq(args).to(self.device)
        sizes = {n: manifest.unit(n).bytes for n in names}
        self.stream = RefStream(store, names, sizes, need, dtype, self.device, group, self.depth, budget,
                                self.timeout_s, self._ring(store, sizes, budget))

    def _ring(self, store, sizes: dict[str, int], budget: float) -> shm.SharedRing | None:
        """A ring for this stream if the store actor runs on this node (else None: the object store)."""
        if not self.shared_ring or self._fetch(store.ready.remote(), "setup") != node_id():
            return None
        try:
            return shm.SharedRing(shm.capacity_for(list(sizes.values()), self.depth, budget))
        except (OSError, AttributeError) as e:  # no memfd_create (not Linux), or no room in /dev/shm's tmpfs
            log.warning("no shared ring (%s): shards come through the object store", e)
            return None

    def transport(self) -> str:
        """How shards reach this verifier: "shared ring" (store actor on this node) or "object store"."""
        self._setup()
        return "object store" if self.stream.ring is None else "shared ring"

    def ready(self) -> str:
        self._setup()
        return node_id()

    def pid(self) -> int:
        return os.getpid()

    def drain(self, timeout_s: float = 10.0) -> None:
        """Wait (a while) for the reads requested ahead, before the engine kills the actors: a store actor killed
        under them has Ray print a failed, retried task on the user's terminal."""
        if self.stream is not None and self.stream.pending:
            refs = [ref for _, ref, _ in self.stream.pending]
            ray.wait(refs, num_returns=len(refs), timeout=timeout_s)

    def set_store(self, store) -> None:
        """A recreated LayerStoreActor (name or handle): read from it from now on."""
        self.store_ref = store
        if self.stream is not None:
            handle = self._store()
            self.stream.ring = None  # (reset would make a fresh one)
            self.stream.reset(handle)
            self.stream.ring = self._ring(handle, self.stream.sizes, self.stream.budget)  # the new store may be on another node

    def _new_cache(self) -> KVCache:
        a = self.args
        return KVCache(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, self.dtype, self.device)

    @torch.inference_mode()
    def _forward(self, tokens, cache: KVCache, logits_from: int, positions=None, mask=None):
        """One streamed sweep over `cache` -> (logits [T - logits_from, V] fp32 CPU, SweepStats)."""
        t0 = time.perf_counter()
        ids = torch.as_tensor(tokens, dtype=torch.long)
        check_chunk(self.args, ids, cache, positions)
        pos = None if positions is None else torch.as_tensor(positions, dtype=torch.long)
        try:
            logits = llama.forward(self.args, self.embed, self.inv_freq, self.stream.sweep(), ids, cache, pos, mask,
                                   logits_from)
        except BaseException:
            self.stream.reset()  # reads in flight may belong to a dead store actor or to an aborted sweep
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - t0
        s = self.stream
        return logits.cpu(), SweepStats(ids.numel(), s.bytes_read, s.io_s, s.prep_s, wall - s.stall_s, s.stall_s, wall)

    def sweep(self, cache_id, seq: int, start: int, tokens, logits_from: int = 0, positions=None, mask=None):
        """Sweep `tokens` after the first `start` cached tokens (dropping the rest: rejected drafts). Returns None
        if this actor does not hold sweep number `seq` of cache `cache_id` (it was restarted): replay first."""
        self._setup()
        if seq == 0:
            self.cache_id, self.cache, self.seq = cache_id, self._new_cache(), 0
        elif cache_id != self.cache_id or seq != self.seq:
            return None
        rollback(self.cache, start)
        out = self._forward(tokens, self.cache, logits_from, positions, mask)
        self.seq += 1
        return out

    def replay(self, cache_id, history) -> None:
        """Rebuild a cache from its sweep history [(start, tokens, positions, mask)]: the same chunks through
        the same code give the same K/V bits (only the last row's logits are computed)."""
        self._setup()
        self.cache_id, self.cache, self.seq = cache_id, self._new_cache(), 0
        for start, tokens, positions, mask in history:
            rollback(self.cache, start)
            self._forward(tokens, self.cache, len(tokens) - 1, positions, mask)
            self.seq += 1

    # ---- batch jobs: several caches in one sweep (spec/batch.py) ----------------------------------------

    def sweep_batch(self, items):
        """One streamed sweep for several sequences, each with its own cache held here by id (a ragged batch,
        llama.forward_batch). items: [(cache_id, seq, logits_from, start, tokens, positions, mask)], start as
        sweep's (a length, or (at, slots) after a tree round); a cache at seq 0 is made new, and caches not
        named are dropped (their sequences finished). Returns (logits per item, SweepStats), or None if some
        cache is not at sweep `seq` here (a restarted actor): replay_caches first."""
        self._setup()
        caches = getattr(self, "batch_caches", None)
        if caches is None:
            caches = self.batch_caches = {}  # cache id -> [KVCache, sweeps it has had]
        if any(seq > 0 and caches.get(cid, (None, -1))[1] != seq for cid, seq, *_ in items):
            return None
        named = {cid for cid, *_ in items}
        for cid in [c for c in caches if c not in named]:
            del caches[cid]
        chunks = []
        for cid, seq, logits_from, start, tokens, positions, mask in items:
            if seq == 0:
                caches[cid] = [self._new_cache(), 0]
            cache = caches[cid][0]
            rollback(cache, start)
            ids = torch.as_tensor(tokens, dtype=torch.long)
            check_chunk(self.args, ids, cache, positions)
            chunks.append(llama.Chunk(ids, cache, positions, mask, logits_from))
        t0 = time.perf_counter()
        try:
            logits = llama.forward_batch(self.args, self.embed, self.inv_freq, self.stream.sweep(), chunks)
        except BaseException:
            self.stream.reset()  # as _forward
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - t0
        for cid in named:
            caches[cid][1] += 1
        s = self.stream
        return [x.cpu() for x in logits], SweepStats(sum(c.ids.numel() for c in chunks), s.bytes_read, s.io_s,
                                                     s.prep_s, wall - s.stall_s, s.stall_s, wall)

    def replay_caches(self, histories) -> None:
        """Rebuild batch caches after a restart: [(cache_id, [(start, tokens, positions, mask), ...])], each
        from its own chunks, one sequence at a time. (The batch sweeps that first built them mixed other
        sequences' rows into each matmul, so the rebuilt K/V can differ from those in float rounding, as a
        batch's do from one-at-a-time generation's.)"""
        self._setup()
        self.batch_caches = {}
        for cid, history in histories:
            cache = self._new_cache()
            for start, tokens, positions, mask in history:
                rollback(cache, start)
                self._forward(tokens, cache, len(tokens) - 1, positions, mask)
            self.batch_caches[cid] = [cache, len(history)]
