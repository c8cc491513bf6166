"""Streaming executor: memory budget (measured), prefetch order and failure propagation."""
import threading

import pytest
import torch

from streamspec_ray.errors import ConfigError, StoreError
from streamspec_ray.runtime.executor import StreamingExecutor
from streamspec_ray.runtime.prefetch import UnitStream
from streamspec_ray.store.store import LayerStore


def _sweep(store, **kw):
    ex = StreamingExecutor(store, **kw)
    logits, stats = ex.sweep(list(range(3, 19)), ex.new_cache())
    return ex, logits, stats


@pytest.mark.parametrize("depth", [0, 1, 3])
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


def test_failed_read_reaches_the_caller_without_deadlock(tiny, monkeypatch):
    store = LayerStore(tiny["store"])
    real = store.read

    def failing(name, **kw):
        if name == "layer.001":
            raise StoreError("disk on fire: layer.001")
        return real(name, **kw)

    monkeypatch.setattr(store, "read", failing)
    ex = StreamingExecutor(store, prefetch_depth=1)
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


def test_cold_sweep_evicts_before_reading(tiny, monkeypatch):
    """--cold: every streamed shard gets posix_fadvise(DONTNEED) before its read, and DONTNEED really empties
    the page cache for the file (checked with mincore where the OS reports residency)."""
    import os

    from streamspec_ray.store import shard

    store = LayerStore(tiny["store"])
    path = store.path("layer.001")
    store.read("layer.001")
    before = shard.residency(path)
    if before in (None, 0.0):
        pytest.skip("this OS does not report page-cache residency")
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
    for u in store.stream_units:
        shard.evict(store.path(u))
    ex = StreamingExecutor(store, direct=True)
    out, _ = ex.sweep([4, 5, 6], ex.new_cache())
    assert torch.equal(out, ref)
    r = shard.residency(store.path("layer.000"))
    assert r is None or r == 0.0 or not shard._direct_ok  # O_DIRECT left nothing cached where it works
