"""Streaming units from a store through a bounded buffer, reading ahead on a worker thread.

While the caller computes unit l, the worker reads units l+1 .. l+depth (depth 1 = double buffering), but only
while the bytes of streamed weights alive stay within the memory budget. "Alive" is measured, not assumed:
every buffer and every dequantized copy is tracked until Python actually frees its storage.

With depth >= 2, up to `depth` units (at most MAX_READERS) are read at once, on a small pool of threads, so the
disk always has reads queued, as an SSD needs to reach its bandwidth. Measured on this project's 2-core VM, cold,
135M fp32 sweeps: 648 ms at depth 1 (one read at a time), 400-450 ms at depth 2, 360 ms at depth 4. I/O time is
the disk's busy time (DiskClock), not the sum of overlapping reads.

Checksums can wait for the sweep (defer_verify, CPU engines): a shard's xxh3 costs ~1 ms of CPU per 10 MB, and a
read ahead of the next sweep lands while the draft computes on every core, so verifying it there slows drafting
(cold, O_DIRECT, tree 16 on SmolLM2 fp32: 273 and 241 ms of drafting per round with checksums against 244 and 217
without). Deferred, units go through a checker thread that verifies them in order only while a pass is being
consumed: then the sweep computes on one core and the checker, ahead of it at ~7-10 GB/s, has the other. Only
where the whole pass is read ahead (depth and budget hold it): where the budget holds less, the sweep itself
waits on reads, and checksums made by the parallel readers as each read lands wait less than a checker in series
(the real pair under 1.2 GB: stalls of 17.1 s against 10.2 for chain, 10.6 against 5.3 for tree 16, deferred
against not). No tensor reaches the caller before its shard is verified either way.
"""
from __future__ import annotations

import atexit
import functools
import queue
import threading
import time
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..errors import ConfigError, StreamspecError
from ..store import shard
from ..store.store import LayerStore
from .weights import extra_bytes, materialize

WAIT_TIMEOUT_S = 120.0
MAX_READERS = 4  # reads in flight at once, at most (and at most the prefetch depth)
DEFER_DEPTH = 4  # read ahead this far, checksums wait for the sweep (defer_verify) even short of a whole pass


# Streams whose reader threads may be running, stopped at interpreter exit: a reader of a cycling stream reads the
# next pass ahead after the last sweep, and a daemon thread still inside a read or a torch call while the
# interpreter finalizes aborts the process ("terminate called without an active exception", exit status -6: 2 of
# 6 runs of a script that generated and returned without closing its engine, whole pass read ahead).
_RUNNING: "weakref.WeakSet[UnitStream]" = weakref.WeakSet()


@atexit.register
def _stop_running_streams() -> None:
    for stream in list(_RUNNING):
        stream.close()


class Residency:
    """Bytes of streamed weights currently alive, and the peak. Tracks storages (not tensor objects), so a
    view that outlives its base tensor still counts until the memory is really released."""

    def __init__(self):
        self._cv = threading.Condition(threading.RLock())  # RLock: a finalizer can run inside our own lock
        self.current = 0
        self.peak = 0

    def track(self, t: torch.Tensor, n: int | None = None) -> None:
        """Count t's storage (n bytes of it: a pooled read buffer may be larger than the unit it holds) until it
        is freed."""
        storage = t.untyped_storage()
        n = storage.nbytes() if n is None else n
        with self._cv:
            self.current += n
            self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, n)

    def _free(self, n: int) -> None:
        with self._cv:
            self.current -= n
            self._cv.notify_all()

    def wait_room(self, n: int, budget: float, stop: threading.Event) -> None:
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        with self._cv:
            while self.current + n > budget:
                if stop.is_set():
                    return
                if time.monotonic() > deadline:
                    raise StreamspecError(f"memory budget wait timed out: {self.current} bytes held, "
                                          f"{n} more needed, budget {int(budget)}")
                self._cv.wait(0.05)

    def has_room(self, n: int, budget: float) -> bool:
        with self._cv:
            return self.current + n <= budget

    def reset_peak(self) -> None:
        with self._cv:
            self.peak = self.current


class DiskClock:
    """Time reads kept the disk busy, shared fairly among overlapping reads: a read's share is the integral of
    1 / (reads in flight) over its duration, so the shares of all reads add up to the wall time during which
    at least one read was in flight (not to the sum of their durations)."""

    def __init__(self, now=time.perf_counter):
        self._now = now
        self._lock = threading.Lock()
        self._active = 0
        self._share = 0.0  # integral of 1/active dt while active > 0
        self._last = now()

    def _advance(self) -> float:
        now = self._now()
        if self._active:
            self._share += (now - self._last) / self._active
        self._last = now
        return self._share

    def start(self) -> float:
        with self._lock:
            mark = self._advance()
            self._active += 1
            return mark

    def stop(self, mark: float) -> float:
        """-> this read's share of the disk's busy time."""
        with self._lock:
            share = self._advance() - mark
            self._active -= 1
            return share

    def busy(self) -> float:
        """The disk's busy time so far (seconds with at least one read in flight)."""
        with self._lock:
            return self._advance()

    def run(self, read, *args, **kw):
        """read(*args, **kw) timed as one read -> (its result, its share of the disk's busy time)."""
        mark = self.start()
        try:
            out = read(*args, **kw)
        finally:
            share = self.stop(mark)
        return out, share


class BufferPool:
    """Read buffers that go back to a free list when the last view of them dies, instead of back to malloc.

    A sweep reads every unit into a fresh buffer and drops it after the layer. Handed back to glibc, buffers of
    a few tens of MB land in per-thread heaps that keep their pages (measured on Qwen2.5 1.5B int4pack with
    --memory-budget 150MB: peak RSS init + 450 MB), and mmap-ing each one instead pays a page fault per 4 KB on
    every read (SmolLM2 warm sweeps 270 -> 410 ms). Reused, a buffer costs neither: after the first pass the
    pool holds what the stream had in flight at most, which the memory budget bounds."""

    def __init__(self):
        # RLock, as Residency's: a storage's finalizer (_put) runs wherever the garbage collector does, also inside
        # get's own lock in the same thread (a plain Lock hung the prefetch thread and then the interpreter's exit,
        # once in ~8 runs of a corrupt-expert test); an append there leaves get's indices valid
        self._lock = threading.RLock()
        self._free: list = []  # numpy uint8 blocks, not in use

    def get(self, n: int) -> torch.Tensor:
        """A uint8 tensor of at least n bytes; its block returns to the pool when its storage is freed."""
        import numpy as np

        with self._lock:
            # a buffer over twice the size is left for a unit of its own size: a layer that took the head's
            # buffer made the head allocate another, until every buffer was the head's size (the real pair, 6
            # layers read ahead under 1.2 GB: killed by the limit, its pool 7 x 120 MB where 7 x 34 MB would do)
            fits = [i for i, b in enumerate(self._free) if n <= b.size <= 2 * n]
            block = None
            if fits:
                block = self._free.pop(min(fits, key=lambda i: self._free[i].size))
            elif small := [i for i, b in enumerate(self._free) if b.size < n]:  # none fits: let the largest
                self._free.pop(max(small, key=lambda i: self._free[i].size))  # too-small one go (no growth)
        if block is None:
            block = np.empty(n, dtype=np.uint8)
        t = torch.from_numpy(block)
        weakref.finalize(t.untyped_storage(), self._put, block)
        return t

    def _put(self, block) -> None:
        with self._lock:
            self._free.append(block)


@dataclass
class StreamStats:
    bytes_read: int = 0
    io_s: float = 0.0       # worker time reading (and verifying) shards
    prep_s: float = 0.0     # worker time dequantizing / casting / copying to the device
    stall_s: float = 0.0    # caller time blocked waiting for the next unit
    # between the last pass and this one (the caller verifying and drafting): how long, and the disk's busy time
    # in it; where the reader stopped early (gap_io_s < gap_s) its window was full: gap_io_s is what a gap can hide
    gap_s: float = 0.0
    gap_io_s: float = 0.0


class UnitStream:
    """Deliver (name, weights) over `names` in order, reading ahead on a worker thread.

    cycle=False: one pass (iterate the stream itself). cycle=True: the worker goes round `names` for ever and
    each `take()` yields one full pass, so the next sweep's first layers are read while the caller verifies
    and drafts between sweeps. Drop each unit's weights before asking for the next, or the budget cannot make
    room. Stats are per pass and attributed to the pass that consumes the unit.
    mapped: warm reads on the CPU (neither cold, O_DIRECT nor pinned, from a local LayerStore) map each shard
    instead of copying it (shard.map_file): the worker then spends milliseconds per pass, not a core."""

    def __init__(self, store: LayerStore, names: list[str], *, dtype: torch.dtype, device="cpu",
                 budget: float = float("inf"), depth: int = 1, cold: bool = False,
                 residency: Residency | None = None, pin: bool = False, direct: bool = False,
                 cycle: bool = False, readers: int = MAX_READERS, keep_dtype: frozenset = frozenset(),
                 defer_verify: bool = False, mapped: bool = False):
        self.store, self.names, self.dtype, self.device = store, names, dtype, device
        self.keep_dtype = keep_dtype  # units handed over in their stored dtype (the caller casts as it multiplies)
        self.budget, self.depth, self.cold, self.pin, self.direct = budget, depth, cold, pin, direct
        self.cycle = cycle
        # reads in flight at once: each holds one of the depth + 1 slots and the caller holds one: at most depth
        self.readers = max(1, min(readers, depth))
        self.clock = DiskClock()
        self._last_pass: tuple[float, float] | None = None  # (when the last pass ended, the disk's busy time then)
        self.residency = residency or Residency()
        self.stats = StreamStats()
        self.buffers = BufferPool()
        self._own_buffers = getattr(store, "buffer", None)  # a store that hands out its own read buffers
        # warm reads on the CPU map the shard files instead of copying them (shard.map_file)
        self.mapped = (mapped and shard.MAPPED_OK and isinstance(store, LayerStore) and not (cold or direct or pin)
                       and torch.device(device).type == "cpu")
        self._q: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(max(depth, 1) + 1)  # units read but not yet released by the caller
        self._stop = threading.Event()
        self._thread = None
        self._same_device = torch.device(device).type == "cpu"
        # whether the worker can read a whole pass ahead (between sweeps) within the budget
        self.whole_pass = len(names) <= depth and sum(self.need(n) for n in names) <= budget  # (none: whole)
        # checksums left to the checker thread, which runs them only while a pass is consumed (see the docstring)
        # (and where a memory plan reads several units ahead: they land while the draft drafts on every core)
        self._defer = (defer_verify and isinstance(store, LayerStore) and store.verify
                       and (self.whole_pass or depth >= DEFER_DEPTH))
        self._checker = None
        self._unchecked: queue.Queue = queue.Queue()  # (name, item, UnitData) from the worker, in stream order
        self._consuming = threading.Event()
        # CUDA: host-to-device copies run on their own stream, so they overlap the compute stream's kernels
        self._copy_stream = torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None

    @functools.cached_property
    def ahead_share(self) -> float:
        """The share of a pass's bytes that the worker may read before the caller takes the pass's first unit,
        i.e. between sweeps, during verification and drafting: 1 for a whole pass, else the first depth + 1 units'
        (the slots a pass's units hold until the caller releases them)."""
        if self.whole_pass:
            return 1.0
        sizes = [self.store.manifest.unit(n).bytes for n in self.names]
        return min(1.0, sum(sizes[: self.depth + 1]) / sum(sizes)) if self.depth > 0 and sum(sizes) else 0.0

    def need(self, name: str) -> int:
        u = self.store.manifest.unit(name)
        if name in self.keep_dtype:
            return u.bytes * (1 if self._same_device else 2)
        return u.bytes + extra_bytes(u, self.dtype, self._same_device)

    def _read(self, name: str, buf):
        """The I/O part of a unit: read its shard and verify it (deferred: UnitData.raw is left to _check) ->
        (UnitData, this read's share of disk time)."""
        how = dict(cold=self.cold, out=buf, direct=self.direct, **({"mapped": True} if self.mapped else {}))
        if self._defer:
            return self.clock.run(self.store.read, name, verify=False, **how)
        return self.clock.run(self.store.read, name, **how)

    def _start(self, name: str, pool) -> tuple[str, Future]:
        """Begin reading `name` (on the pool, or here when reading one at a time)."""
        size = self.store.manifest.unit(name).bytes
        if self.mapped:
            buf = None
        elif self._own_buffers is not None:  # a remote store's: a shared-ring slot, or None (it brings its own)
            buf = self._own_buffers(size)
        elif self.pin:  # page-locked host buffer: the host-to-device copy can run asynchronously
            buf = shard.read_buffer(size, pin=True)
            self.residency.track(buf)
        else:
            buf = self.buffers.get(shard.buffer_bytes(size) if self.direct else size)
        if pool is not None:
            return name, pool.submit(self._read, name, buf)
        fut: Future = Future()
        try:
            fut.set_result(self._read(name, buf))
        except BaseException as e:
            fut.set_exception(e)
        return name, fut

    def _finish(self, name: str, fut: Future):
        """Wait for a read, then track and materialize it -> (weights, io_s, prep_s, nbytes)."""
        data, io_s = fut.result()
        if not (self.pin and self._own_buffers is None) and data.tensors:  # (a pinned buffer is tracked already)
            self.residency.track(next(iter(data.tensors.values())), data.nbytes)
        t0 = time.perf_counter()
        ready = None
        with torch.cuda.stream(self._copy_stream) if self._copy_stream is not None else _nullcontext():
            if name in self.keep_dtype:
                w = {k: t.to(self.device, non_blocking=True) for k, t in data.tensors.items()}
            else:
                w = materialize(data.tensors, self.dtype, self.device, self.store.manifest.group_size or 64)
            if self._copy_stream is not None:
                ready = torch.cuda.Event()
                ready.record(self._copy_stream)
        for t in w.values():  # (a PackedInt4 of an int4pack store is a view of the read buffer, tracked above)
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != 0 and not _shares(t, data.tensors):
                self.residency.track(t)
        if ready is not None:
            w["__ready__"] = ready
        return w, io_s, time.perf_counter() - t0, data.nbytes

    def _load(self, name: str):
        """Read, verify and materialize one unit here -> (weights, io_s, prep_s, nbytes), or None when stopped."""
        self.residency.wait_room(self.need(name), self.budget, self._stop)
        if self._stop.is_set():
            return None
        return self._finish(*self._start(name, None))

    def _worker(self) -> None:
        """Read units in order, up to `readers` at once. Reads in flight are not tracked by the residency yet, so
        their bytes count as pending; when the budget has no room for the next one, the oldest read is finished
        and handed over first (so a tight budget degrades to one read at a time, never to a wait on itself)."""
        pool = ThreadPoolExecutor(self.readers, thread_name_prefix="streamspec-read") if self.readers > 1 else None
        inflight: deque = deque()  # (name, future, need), in stream order

        def deliver(name, item, data=None):  # to the caller, or first to the checker (defer_verify)
            if self._defer:
                self._unchecked.put((name, item, data))
            else:
                self._q.put((name, item))

        def hand_over():
            name, fut, _ = inflight.popleft()
            item = self._finish(name, fut)
            deliver(name, item, fut.result()[0])

        try:
            while True:
                for name in self.names:
                    self._slots.acquire()
                    if self._stop.is_set():
                        return
                    need = self.need(name)
                    while inflight and (len(inflight) >= self.readers or not self.residency.has_room(
                            need + sum(n for _, _, n in inflight), self.budget)):
                        hand_over()
                    self.residency.wait_room(need, self.budget, self._stop)
                    if self._stop.is_set():
                        return
                    inflight.append((*self._start(name, pool), need))
                    if pool is None:
                        hand_over()
                if not self.cycle:
                    while inflight:
                        hand_over()
                    return
        except BaseException as e:  # the caller re-raises it: a failed read never hangs the sweep
            deliver(None, e)
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    def _check(self, worker: threading.Thread) -> None:
        """The checker thread (defer_verify): the worker's units in order, each verified once a pass is being
        consumed, then handed to the caller; a mismatch goes to the caller as the store's StoreError."""
        while not self._stop.is_set():
            try:
                name, item, data = self._unchecked.get(timeout=0.5)  # (data: the unit as read, UnitData)
            except queue.Empty:
                if not worker.is_alive() and self._unchecked.empty():
                    return  # (a one-pass stream's worker is done, and so is everything it read)
                continue
            while not self._consuming.wait(0.5):
                if self._stop.is_set():
                    return
            if self._stop.is_set():
                return
            if name is not None:
                try:
                    self.store.check(name, data.raw, data.key)
                except BaseException as e:
                    name, item = None, e
            self._q.put((name, item))
            del name, item, data  # (held here until the next get, they would keep the unit's memory in the budget)

    def check_budget(self) -> None:
        for name in self.names:
            if self.need(name) > self.budget:
                raise ConfigError(f"memory budget {int(self.budget)} bytes is below unit {name!r} "
                                  f"({self.need(name)} bytes): raise --memory-budget")

    def start(self) -> "UnitStream":
        self.check_budget()
        if self.depth > 0 and self._thread is None:
            _RUNNING.add(self)
            self._thread = threading.Thread(target=self._worker, name="streamspec-prefetch", daemon=True)
            self._thread.start()
            if self._defer:
                self._checker = threading.Thread(target=self._check, args=(self._thread,), name="streamspec-checksum",
                                                 daemon=True)
                self._checker.start()
        return self

    def __enter__(self):
        return self.start()

    def __iter__(self):
        return self.take()

    def take(self):
        """One pass over `names`: yields (name, weights); self.stats holds this pass's figures."""
        self.stats = stats = StreamStats()
        if self._last_pass is not None:
            t, busy = self._last_pass
            stats.gap_s, stats.gap_io_s = time.perf_counter() - t, self.clock.busy() - busy
        self._consuming.set()
        try:
            yield from self._pass(stats)
        finally:
            self._consuming.clear()
            self._last_pass = (time.perf_counter(), self.clock.busy())

    def _pass(self, stats: StreamStats):
        for name in self.names:
            if self._thread is None:
                got, item = name, self._load(name)
            else:
                t0 = time.perf_counter()
                got, item = self._next()
                stats.stall_s += time.perf_counter() - t0
                if got is None:
                    raise item
                if got != name:
                    raise StreamspecError(f"prefetch out of order: expected {name}, got {got}")
            w, io_s, prep_s, nbytes = item
            del item
            stats.io_s += io_s
            stats.prep_s += prep_s
            stats.bytes_read += nbytes
            ready = w.pop("__ready__", None)
            if ready is not None:  # the compute stream waits for this unit's copies, and owns them after
                stream = torch.cuda.current_stream(self.device)
                stream.wait_event(ready)
                for t in w.values():
                    t.record_stream(stream)
            yield got, w
            del w
            if self._thread is not None:
                self._slots.release()

    def _next(self):
        deadline = time.monotonic() + WAIT_TIMEOUT_S
        while True:
            try:
                return self._q.get(timeout=0.5)
            except queue.Empty:
                producer = self._checker if self._checker is not None else self._thread
                if not producer.is_alive() and self._q.empty():
                    raise StreamspecError("prefetch worker stopped without delivering a unit") from None
                if time.monotonic() > deadline:
                    raise StreamspecError(f"no unit arrived within {WAIT_TIMEOUT_S:.0f} s (is a previous layer's "
                                          "weights still referenced, so the memory budget cannot make room?)") from None

    def close(self) -> None:
        self._stop.set()
        self._consuming.set()  # (wakes a checker waiting for a pass: it sees the stop and ends)
        self._unchecked.put((None, None, None))
        for _ in range(self.depth + 2):
            self._slots.release()
        if self._thread is not None:
            self._thread.join(timeout=WAIT_TIMEOUT_S)
            self._thread = None
        if self._checker is not None:
            self._checker.join(timeout=WAIT_TIMEOUT_S)
            self._checker = None
        for q in (self._q, self._unchecked):  # drop units read ahead but never used
            while not q.empty():
                q.get_nowait()

    def __exit__(self, *exc):
        self.close()
        return False


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _shares(t: torch.Tensor, tensors: dict) -> bool:
    ptr = t.untyped_storage().data_ptr()
    return any(ptr == s.untyped_storage().data_ptr() for s in tensors.values())
