"""Streaming executor: memory budget (measured), prefetch order and failure propagation."""
import os
import threading

import pytest
import torch

from conftest import dropped_inside
from streamspec_ray.errors import ConfigError, StoreError
from streamspec_ray.runtime.executor import StreamingExecutor
from streamspec_ray.runtime.prefetch import BufferPool, UnitStream
from streamspec_ray.store.store import LayerStore


def _sweep(store, **kw):
    ex = StreamingExecutor(store, **kw)
    logits, stats = ex.sweep(list(range(3, 19)), ex.new_cache())
    return ex, logits, stats


@pytest.mark.parametrize("depth", [0, 1, 2, 4])
def test_budget_is_never_exceeded(tiny, depth):
    store = LayerStore(tiny["store"])
    one = max(u.bytes for u in store.stream_units)
    _, ref, _ = _sweep(tiny["store"])
    for budget in (one, 2 * one, 3 * one + 1):
        ex, logits, stats = _sweep(tiny["store"], memory_budget=budget, prefetch_depth=depth)
        assert torch.equal(logits, ref)
        assert 0 < ex.residency.peak <= budget
        assert stats.bytes_read == sum(u.bytes for u in store.stream_units)
    ex.close()  # stop reading ahead for the next sweep
    assert ex.residency.current == 0  # everything streamed was released


def test_budget_below_one_layer_is_a_clear_error(tiny):
    one = max(u.bytes for u in LayerStore(tiny["store"]).stream_units)
    with pytest.raises(ConfigError, match="memory budget"):
        _sweep(tiny["store"], memory_budget=one - 1)


def test_units_arrive_in_order_and_read_ahead(tiny):
    store = LayerStore(tiny["store"])
    names = [u.name for u in store.stream_units]
    with UnitStream(store, names, dtype=torch.float32, depth=2) as s:
        seen = []
        for name, w in s:
            seen.append(name)
            del w
    assert seen == names
    assert s.stats.bytes_read == sum(u.bytes for u in store.stream_units)


def test_the_gap_between_passes_and_the_reads_in_it_are_measured(tiny):
    """A cycling stream times the gap between two passes (the caller verifying and drafting) and the disk's busy
    time in it: the reads that the gap hid, which the K and budget controllers price rounds by (HiddenReads). A
    window of 2 units fills in well under the gap here, so the reader stops: its disk time is a part of the gap."""
    import time

    store = LayerStore(tiny["store"])
    names = [u.name for u in store.stream_units]
    s = UnitStream(store, names, dtype=torch.float32, depth=2, cold=True, cycle=True).start()
    try:
        for _ in s.take():
            pass
        assert s.stats.gap_s == 0.0  # (the first pass has no gap before it)
        time.sleep(0.3)
        for _ in s.take():
            pass
        assert s.stats.gap_s >= 0.3
        assert 0.0 < s.stats.gap_io_s < 0.9 * s.stats.gap_s
    finally:
        s.close()


@pytest.mark.parametrize("corrupt", [False, True])
def test_deferred_checksums_wait_for_a_pass(tiny, tmp_path, monkeypatch, corrupt):
    """defer_verify (CPU engines): every unit is read ahead at once, but no checksum runs until a pass is being
    consumed (between sweeps the draft has the cores); then each unit is verified, in stream order, before it
    reaches the caller, and a corrupt shard still raises the store's StoreError at its own unit."""
    import os
    import shutil
    import time

    root = tiny["store"]
    if corrupt:
        root = shutil.copytree(root, tmp_path / "store")
        path = os.path.join(root, "layer.001.safetensors")
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
    store = LayerStore(str(root))
    names = [u.name for u in store.stream_units]
    checked, real = [], store.check
    monkeypatch.setattr(store, "check", lambda name, *a: (checked.append(name), real(name, *a))[1])
    stream = UnitStream(store, names, dtype=torch.float32, depth=len(names), defer_verify=True)
    with stream:
        deadline = time.monotonic() + 30
        while stream._thread.is_alive() and time.monotonic() < deadline:  # (a one-pass worker ends once all is read)
            time.sleep(0.01)
        time.sleep(0.2)  # (a checker that did not wait would have started by now)
        assert not stream._thread.is_alive() and checked == []
        seen = []
        if corrupt:
            with pytest.raises(StoreError, match="layer.001.safetensors"):
                for name, w in stream:
                    seen.append(name)
            assert seen == names[:1] and checked[:2] == names[:2]  # (the checker may run ahead of the caller)
        else:
            seen = [name for name, _ in stream]
            assert seen == checked == names


def test_concurrent_reads_arrive_in_order(tiny, monkeypatch):
    """depth 3: three reads in flight at once, the first held back until the next two have finished (out of
    order), yet units reach the caller in stream order; the stream's I/O time is the disk's busy time (at most
    the wall time), not the sum of the reads' durations."""
    import time

    store = LayerStore(tiny["store"])
    names = [u.name for u in store.stream_units]
    real, lock, three = store.read, threading.Lock(), threading.Event()
    state = {"now": 0, "most": 0, "done": 0, "sum": 0.0}

    def held(name, **kw):
        t0 = time.perf_counter()
        with lock:
            state["now"] += 1
            state["most"] = max(state["most"], state["now"])
            if state["now"] == 3:
                three.set()
        if name in names[:3]:  # the first three reads wait until all three are in flight (no race on timing)
            three.wait(10)
        if name == names[0]:
            while state["done"] < 2 and time.perf_counter() - t0 < 10:  # reads 2 and 3 finish first
                time.sleep(0.001)
        try:
            return real(name, **kw)
        finally:
            with lock:
                state["now"] -= 1
                state["done"] += 1
                state["sum"] += time.perf_counter() - t0

    monkeypatch.setattr(store, "read", held)
    t0 = time.perf_counter()
    with UnitStream(store, names, dtype=torch.float32, depth=3) as s:
        seen = []
        for name, w in s:
            seen.append(name)
            del w
    wall = time.perf_counter() - t0
    assert seen == names
    assert state["most"] == 3
    assert s.stats.io_s <= wall and s.stats.io_s < state["sum"]


def test_disk_clock_counts_overlap_once():
    from streamspec_ray.runtime.prefetch import DiskClock

    t = [0.0]
    clock = DiskClock(now=lambda: t[0])
    a = clock.start()          # t=0: a alone
    t[0] = 1.0
    b = clock.start()          # t=1: a and b
    t[0] = 2.0
    share_a = clock.stop(a)    # t=2: b alone
    t[0] = 4.0
    share_b = clock.stop(b)
    assert (share_a, share_b) == (1.5, 2.5)  # 1 + 1/2, 1/2 + 2: together the 4 busy seconds


def test_a_buffer_freed_inside_the_pools_lock_comes_back_without_deadlock():
    """A read buffer's finalizer runs wherever the garbage collector does: also in a thread that is inside the
    pool's own lock (in `get`). It must neither wait for that lock (the prefetch thread and then the interpreter's
    exit hung so, in a corrupt-expert test) nor lose the block."""
    pool = BufferPool()
    box = [pool.get(1 << 12)]
    ptr = box[0].data_ptr()
    assert dropped_inside(pool._lock, box), "the finalizer waited for the pool's lock"
    assert pool.get(1 << 11).data_ptr() == ptr  # the block was returned and is reused


def test_the_pool_keeps_a_big_buffer_for_a_big_unit():
    """A unit takes a free buffer of its size, up to twice it, never the head's: a layer that took the head's
    buffer made the head allocate another, until every buffer in the pool had the head's size (the real pair
    under a 1.2 GB limit, 6 units read ahead: killed by the limit)."""
    pool = BufferPool()
    head, layer = pool.get(120 << 10), pool.get(34 << 10)
    head_ptr, layer_ptr = head.data_ptr(), layer.data_ptr()
    del head, layer
    a = pool.get(34 << 10)
    b = pool.get(34 << 10)  # the one layer-sized buffer is taken: a new one, not the head's
    assert a.data_ptr() == layer_ptr and b.data_ptr() != head_ptr
    assert pool.get(120 << 10).data_ptr() == head_ptr


@pytest.mark.parametrize("depth", [1, 3])
def test_failed_read_reaches_the_caller_without_deadlock(tiny, monkeypatch, depth):
    store = LayerStore(tiny["store"])
    real = store.read

    def failing(name, **kw):
        if name == "layer.001":
            raise StoreError("disk on fire: layer.001")
        return real(name, **kw)

    monkeypatch.setattr(store, "read", failing)
    ex = StreamingExecutor(store, prefetch_depth=depth)
    before = threading.active_count()
    with pytest.raises(StoreError, match="disk on fire"):
        ex.sweep([5, 6, 7], ex.new_cache())
    assert threading.active_count() <= before  # the worker thread ended
    monkeypatch.setattr(store, "read", real)  # the disk recovers: the next sweep works
    ex.sweep([5, 6, 7], ex.new_cache())


def test_cache_rollback_then_resweep_matches_fresh(tiny):
    ex = StreamingExecutor(tiny["store"])
    ids = list(range(10, 30))
    ref, _ = ex.sweep(ids, ex.new_cache())
    cache = ex.new_cache()
    ex.sweep(ids[:12] + [99, 98, 97], cache)  # three tokens that get rejected
    cache.truncate(12)
    out, _ = ex.sweep(ids[12:], cache)
    assert (out - ref[12:]).abs().max() < 1e-5


def _drops_pages(path: str) -> bool:
    """Whether DONTNEED empties this file's pages from the page cache here: mincore reports residency and the
    file lies on a disk's filesystem (on tmpfs, /tmp on some machines, the pages are the file)."""
    from streamspec_ray.store import shard

    return shard.residency(path) not in (None, 0.0) and not shard.memory_backed(path)


def test_cold_sweep_evicts_before_reading(tiny, monkeypatch):
    """--cold: every streamed shard gets posix_fadvise(DONTNEED) before its read, and DONTNEED really empties
    the page cache for the file (checked with mincore where the OS reports residency and the file is on a disk)."""
    import os

    from streamspec_ray.store import shard

    store = LayerStore(tiny["store"])
    path = store.path("layer.001")
    store.read("layer.001")
    if _drops_pages(path):
        shard.evict(path)
        assert shard.residency(path) == 0.0

    calls = []
    real = os.posix_fadvise
    monkeypatch.setattr(shard.os, "posix_fadvise", lambda fd, off, n, adv: (calls.append(adv), real(fd, off, n, adv)))
    ex = StreamingExecutor(store, cold=True)
    ex.sweep([1, 2, 3], ex.new_cache())
    ex.close()
    assert calls.count(os.POSIX_FADV_DONTNEED) >= len(store.stream_units)  # (+ units read ahead)


def test_direct_reads_bypass_the_page_cache(tiny):
    from streamspec_ray.store import shard

    store = LayerStore(tiny["store"])
    ref, _ = StreamingExecutor(store).sweep([4, 5, 6], StreamingExecutor(store).new_cache())
    on_disk = _drops_pages(store.path("layer.000"))
    for u in store.stream_units:
        shard.evict(store.path(u))
    ex = StreamingExecutor(store, direct=True)
    out, _ = ex.sweep([4, 5, 6], ex.new_cache())
    assert torch.equal(out, ref)
    if on_disk and shard._direct_ok:  # O_DIRECT left nothing cached where it works
        assert shard.residency(store.path("layer.000")) == 0.0


def test_a_cold_store_on_tmpfs_is_named_not_read_as_a_disk(tiny, tmp_path, caplog):
    """A store on tmpfs cannot be read cold (its pages are the files): shard.memory_backed says so, and a cold
    executor over it warns rather than letting memory copies pass for disk reads."""
    import logging
    import shutil
    import tempfile

    from streamspec_ray.store import shard

    if shard.filesystem("/") is None:
        pytest.skip("this OS has no /proc/self/mountinfo")
    assert shard.filesystem(str(tmp_path)) is not None
    assert not shard.memory_backed("/proc")
    if shard.filesystem("/dev/shm") != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    assert shard.memory_backed("/dev/shm/a/path/that/need/not/exist")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        root = shutil.copytree(tiny["store"], os.path.join(d, "store"))
        with caplog.at_level(logging.WARNING, logger="streamspec"):
            StreamingExecutor(root, cold=True).close()
    assert "keeps files in memory" in caplog.text


def test_direct_reads_by_default_when_the_page_cache_cannot_keep_a_sweep(tiny, monkeypatch):
    """direct=None (the Engine's and the CLI's default): O_DIRECT when a sweep's bytes exceed the page cache's
    room (memplan.page_cache_room), decided at the first sweep; the page cache otherwise. Same logits either way;
    an explicit choice stands. `generate --json` says which it used."""
    from streamspec_ray import Engine
    from streamspec_ray.runtime import memplan

    room = memplan.page_cache_room()
    assert room is None or room > 0  # (this process, here: MemAvailable, or its cgroup's limit minus its RSS)
    store = LayerStore(tiny["store"])
    ref, _ = StreamingExecutor(store).sweep([4, 5, 6], StreamingExecutor(store).new_cache())
    for fake_room, explicit, want in ((1, None, True), (10 ** 15, None, False), (1, False, False)):
        monkeypatch.setattr(memplan, "page_cache_room", lambda r=fake_room: r)
        ex = StreamingExecutor(store, direct=explicit)
        out, _ = ex.sweep([4, 5, 6], ex.new_cache())
        assert ex.direct is want and torch.equal(out, ref), (fake_room, explicit)
        ex.close()
    monkeypatch.setattr(memplan, "page_cache_room", lambda: 1)
    eng = Engine(target=tiny["store"], draft=None)
    assert eng.generate(prompt_ids=[4, 5, 6], max_new_tokens=2, mode="naive").stats["direct_reads"] is True


def test_streams_reading_ahead_stop_at_interpreter_exit(tiny, monkeypatch):
    """A script that generates and returns without closing its engine: the reader, already reading the next pass,
    is stopped and joined at exit, not left inside a read while the interpreter finalizes (which aborted such a
    process with status -6). Here as a child process that does exactly that, and the exit handler itself."""
    import subprocess
    import sys
    import weakref

    from streamspec_ray.runtime import prefetch

    code = ("import sys; from streamspec_ray import Engine\n"
            "e = Engine(target=sys.argv[1], draft=None, prefetch_depth=8)\n"
            "e.generate(prompt_ids=[5, 6, 7], max_new_tokens=3, mode='naive')\n")
    r = subprocess.run([sys.executable, "-c", code, tiny["store"]], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    # the exit handler stops only this test's stream: the session's shared engines keep theirs
    monkeypatch.setattr(prefetch, "_RUNNING", weakref.WeakSet())
    ex = StreamingExecutor(tiny["store"], prefetch_depth=4)
    ex.sweep([3, 4, 5], ex.new_cache())  # (its stream now reads the next pass ahead)
    streams = list(prefetch._RUNNING)
    assert streams and any(s._thread is not None for s in streams)
    prefetch._stop_running_streams()
    assert all(s._thread is None and s._checker is None for s in streams)
