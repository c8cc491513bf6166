"""The shared-memory ring (runtime/shm.py) and the store actor's read into it, without Ray: slots never overlap
and a stream never waits for room it was promised; another process sees what one writes; a stale key never maps
whatever file took the ring's fd number."""
import multiprocessing
import os
import random

import pytest
import torch

from conftest import dropped_inside
from streamspec_ray.runtime import shm

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="memfd_create: Linux only")


def _overlap(slots) -> bool:
    spans = sorted((a, n) for a, n, _ in slots)
    return any(a + n > b for (a, n), (b, _) in zip(spans, spans[1:]))


@pytest.mark.parametrize("depth", [0, 1, 2, 4])
@pytest.mark.parametrize("budgeted", [False, True])
def test_stream_never_lacks_room(depth, budgeted):
    """A cyclic stream, as the verifier's reader drives it: the unit computing plus up to `depth` requested ahead (while
    their bytes fit the budget), freed in order. With capacity_for's size every request the budget allows
    fits, no two slots in use overlap, and a budget keeps the ring within it plus one slot."""
    rng = random.Random(depth * 2 + budgeted)
    for trial in range(20):
        sizes = [rng.choice([1, 7, 4096, 50_000, 300_000, 1_000_000]) for _ in range(rng.randint(1, 9))]
        budget = rng.randint(max(sizes), 3 * sum(sizes)) if budgeted else float("inf")
        ring = shm.SharedRing(shm.capacity_for(sizes, depth, budget))
        if budgeted:
            assert ring.capacity <= budget + (depth + 2) * 3 * shm.ALIGN + shm.slot_bytes(max(sizes))
        pending, nxt = [], 0
        for step in range(200):
            if not pending:
                pending.append((ring.alloc(shm.slot_bytes(sizes[nxt % len(sizes)])), sizes[nxt % len(sizes)]))
                nxt += 1
            held = pending.pop(0)
            assert held[0] is not None
            while len(pending) < depth:
                size = sizes[nxt % len(sizes)]
                if held[1] + sum(s for _, s in pending) + size > budget:
                    break
                at = ring.alloc(shm.slot_bytes(size))
                assert at is not None, (sizes, depth, budget, step)
                pending.append((at, size))
                nxt += 1
            assert len(ring.slots) == 1 + len(pending) and not _overlap(ring.slots)
            assert all(a % shm.ALIGN == 0 and a + n <= ring.capacity for a, n, _ in ring.slots)
            ring.free(held[0])
        ring.close()


def test_full_ring_says_so():
    ring = shm.SharedRing(3 * shm.ALIGN)
    assert ring.alloc(shm.ALIGN) == 0 and ring.alloc(shm.ALIGN) == shm.ALIGN
    assert ring.alloc(2 * shm.ALIGN) is None  # one page left at the end, the start still in use
    ring.free(0)
    assert ring.alloc(shm.ALIGN) == 2 * shm.ALIGN and ring.alloc(shm.ALIGN) == 0  # wraps to the freed start
    assert ring.alloc(1) is None  # full
    ring.close()


def test_slots_free_when_their_tensors_die_in_any_order():
    """slot(): a tensor with a storage of its own, its slot freed when its last view dies. A slot freed out of
    turn (an expert read after layers read ahead) is reused once the older ones are free too."""
    import gc

    ring = shm.SharedRing(4 * shm.ALIGN)
    a, b = ring.slot(shm.ALIGN), ring.slot(shm.ALIGN)
    c = ring.slot(2 * shm.ALIGN)
    assert [ring.offset(t) for t in (a, b, c)] == [0, shm.ALIGN, 2 * shm.ALIGN] and ring.slot(1) is None
    view = c[10:20]
    del b, c
    gc.collect()
    assert ring.slot(1) is None  # b and c are freed, but the oldest (a) is still in use, and c still viewed
    del view, a
    gc.collect()
    assert not ring.slots and ring.offset(ring.slot(4 * shm.ALIGN)) == 0  # all free: the whole ring again
    ring.close()


def _write(key, offset, data, done):
    _, t = shm.attach(key)
    t[offset : offset + len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    done.set()


def test_another_process_writes_into_the_ring():
    ring = shm.SharedRing(1 << 16)
    at = ring.alloc(100)
    ctx = multiprocessing.get_context("spawn")  # not a fork: the child must map the ring through /proc
    done = ctx.Event()
    p = ctx.Process(target=_write, args=(ring.key, at, b"streamed", done))
    p.start()
    p.join(60)
    assert p.exitcode == 0 and done.is_set()
    assert bytes(ring.tensor[at : at + 8].tolist()) == b"streamed"
    ring.close()


def test_stale_key_maps_nothing(tmp_path):
    """After a ring is closed its fd number may be taken by a file: attaching the old key must refuse, not
    write shard bytes into that file."""
    ring = shm.SharedRing(1 << 16)
    key = ring.key
    ring.close()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me" * 10000)
    fd = os.open(victim, os.O_RDONLY)
    try:
        if fd != key[1]:
            os.dup2(fd, key[1])  # make the old number point at the file, as a later open could
        with pytest.raises(FileNotFoundError, match="gone"):
            shm.attach(key)
    finally:
        os.close(fd)
        if fd != key[1]:
            os.close(key[1])
    assert victim.read_bytes() == b"keep me" * 10000


def test_store_server_reads_into_the_ring(tiny):
    """StoreServer.read_into puts the shard where the verifier will read it: the same bytes as LayerStore, no
    object store; a slot too small or a ring it cannot map is one clear error."""
    from streamspec_ray.actors.common import RingUnavailable
    from streamspec_ray.actors.store import StoreServer
    from streamspec_ray.errors import StoreError
    from streamspec_ray.store.store import LayerStore

    server, store = StoreServer(tiny["store"]), LayerStore(tiny["store"])
    unit = store.stream_units[0]
    ring = shm.SharedRing(shm.capacity_for([unit.bytes], 1))
    room = shm.slot_bytes(unit.bytes)
    at = ring.alloc(room)
    start, nbytes, _ = server.read_into(unit.name, ring.key, at, room)
    assert at <= start and start + nbytes <= at + room
    assert torch.equal(ring.tensor[start : start + nbytes], store.read_raw(unit.name))
    with pytest.raises(StoreError, match="too small"):
        server.read_into(unit.name, ring.key, 0, unit.bytes // 2)
    gone = ring.key[:-1] + (ring.key[-1] + 1,)  # another inode: a ring that no longer exists
    with pytest.raises(RingUnavailable):
        server.read_into(unit.name, gone, at, room)
    again = shm.SharedRing(ring.capacity)  # this process's next ring (after a reset) replaces its old one
    start, nbytes, _ = server.read_into(unit.name, again.key, 0, room)
    assert torch.equal(again.tensor[start : start + nbytes], store.read_raw(unit.name))
    assert list(server.rings) == [again.key]
    ring.close()
    again.close()


def _hold_ring(conn, capacity):
    ring = shm.SharedRing(capacity)
    conn.send(ring.key)
    conn.recv()  # until told to go


def test_store_server_lets_go_of_rings(tiny):
    """Two verifiers (batch replicas) keep a ring each mapped in the store actor; the ring of a verifier that is
    gone is let go at the next new ring, so its memory does not outlive it."""
    from streamspec_ray.actors.store import StoreServer
    from streamspec_ray.store.store import LayerStore

    server = StoreServer(tiny["store"])
    unit = LayerStore(tiny["store"]).stream_units[0]
    room = shm.slot_bytes(unit.bytes)
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=_hold_ring, args=(theirs, shm.capacity_for([unit.bytes], 1)))
    p.start()
    key = ours.recv()
    server.read_into(unit.name, key, 0, room)  # the other verifier's ring
    ring = shm.SharedRing(key[2])
    server.read_into(unit.name, ring.key, 0, room)
    assert set(server.rings) == {key, ring.key}
    ours.send("go")
    p.join(60)
    again = shm.SharedRing(key[2])
    server.read_into(unit.name, again.key, 0, room)
    assert list(server.rings) == [again.key]
    ring.close()
    again.close()


def test_a_slot_freed_inside_the_rings_lock_does_not_deadlock():
    """A slot's finalizer runs wherever the garbage collector does: also in a thread inside the ring's own lock
    (in `alloc`). It must not wait for that lock, and the slot is free afterwards."""
    ring = shm.SharedRing(4 * shm.ALIGN)
    assert dropped_inside(ring._lock, [ring.slot(4 * shm.ALIGN)]), "the finalizer waited for the ring's lock"
    assert ring.alloc(4 * shm.ALIGN) == 0  # the whole ring is free again
