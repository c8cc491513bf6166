"""A shared-memory ring through which one process hands shard files to another on the same node, without a copy.

Through Ray's object store a served shard is copied once more than in-process: read into the store actor's
buffer, then copied into the object store. On 2 cores that copy (plus the object's create, seal and release)
takes CPU from the sweep: the Ray verifier computed a warm sweep ~1.6x slower than the in-process engine
while the store actor kept copying. With a ring the verifier owns a segment, the store actor reads each
shard straight into a slot of it (the same read as in-process, into shared pages), and answers only with
where the bytes are.

The segment is a memfd: it has no name in /dev/shm, the other process maps it through /proc/<pid>/fd/<fd>,
and the kernel frees it when both have let go of it, even if one is killed. Slots are handed out first in,
first out, because a stream consumes units in the order it asked for them: allocate at the head, free the
oldest. A slot freed out of turn (an expert read after the layers read ahead of it) stays taken until the
slots before it are freed too.
"""
from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections import deque

import torch

from ..store.shard import ALIGN, buffer_bytes  # slots start on ALIGN boundaries: O_DIRECT reads straight in


def round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def slot_bytes(size: int) -> int:
    """A slot for a shard of `size` bytes, with the room that shard.read_into's O_DIRECT path needs to align."""
    return round_up(buffer_bytes(size))


def capacity_for(sizes: list[int], depth: int, budget: float = float("inf")) -> int:
    """Ring bytes for a cyclic stream of units of `sizes` bytes with up to depth + 1 of them held at once (the
    one computing and `depth` requested ahead), and their shard bytes never over `budget` (a stream checks that
    before each request): the most such a run of slots can take, plus the largest slot, since a slot that does
    not fit before the end starts again at 0 and wastes less than one slot there."""
    slots = [slot_bytes(s) for s in sizes]
    n = len(slots)
    window = max(sum(slots[(i + j) % n] for j in range(depth + 1)) for i in range(n))  # may pass a unit twice
    slack = max(a - s for a, s in zip(slots, sizes))  # per slot, beyond its shard's bytes
    return int(min(window, budget + (depth + 1) * slack)) + max(slots)


class SharedRing:
    """A memfd segment of `capacity` bytes, cut into slots first in, first out (thread-safe: a stream's reader
    threads allocate, and a slot is freed wherever its last view dies). `key` names it to another process on
    the same node (attach)."""

    def __init__(self, capacity: int):
        self.capacity = round_up(capacity)
        self.fd = os.memfd_create("streamspec-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.capacity)
            self.map = mmap.mmap(self.fd, self.capacity)
        except BaseException:
            os.close(self.fd)
            raise
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        st = os.fstat(self.fd)  # (device, inode): attach checks that /proc/<pid>/fd/<fd> is still this memfd
        self.key = (os.getpid(), self.fd, self.capacity, st.st_dev, st.st_ino)
        self.slots: deque = deque()  # [offset, bytes, freed] taken, oldest first
        self.head = 0                # where the next slot starts
        # RLock: a slot's finalizer (free) runs wherever the garbage collector does, also inside _alloc under this
        # lock in the same thread; a free only adds room, so _alloc's choice stays valid (a Lock would hang there)
        self._lock = threading.RLock()

    def alloc(self, size: int) -> int | None:
        """Offset of a new slot of at least `size` bytes, or None while the ring is too full for it."""
        with self._lock:
            return self._alloc(size)

    def _alloc(self, size: int) -> int | None:
        n = round_up(size)
        if not self.slots:
            off = 0
        else:
            tail = self.slots[0][0]
            if self.slots[-1][0] < tail:  # wrapped: the free space is [head, tail)
                off = self.head if self.head + n <= tail else None
            elif self.head + n <= self.capacity:
                off = self.head
            else:  # wrap to 0 (the end's remainder stays unused until the ring passes it)
                off = 0 if n <= tail else None
        if off is None or off + n > self.capacity:
            return None
        self.slots.append([off, n, False])
        self.head = off + n
        return off

    def free(self, offset: int) -> None:
        """Free the slot at `offset` (its room is reused once every older slot is free too)."""
        with self._lock:
            for slot in self.slots:
                if slot[0] == offset and not slot[2]:
                    slot[2] = True
                    break
            self._release()

    def _release(self) -> None:
        while self.slots and self.slots[0][2]:
            self.slots.popleft()
        if not self.slots:
            self.head = 0

    def slot(self, size: int) -> torch.Tensor | None:
        """A uint8 tensor over a new slot of at least `size` bytes (None while the ring is too full), with a
        storage of its own: the slot is freed when that storage is (its last view dies)."""
        off = self.alloc(size)
        if off is None:
            return None
        t = torch.frombuffer(self.map, dtype=torch.uint8, count=round_up(size), offset=off)
        weakref.finalize(t.untyped_storage(), self.free, off)
        return t

    def offset(self, t: torch.Tensor) -> int:
        """Where tensor `t` (a view of this ring's memory) starts in the ring."""
        return t.data_ptr() - self.tensor.data_ptr()

    def close(self) -> None:
        """Let go of the fd; the pages go once no tensor views them and the other process has dropped its map."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()


def attach(key: tuple) -> tuple[mmap.mmap, torch.Tensor]:
    """Map another process's SharedRing (same node, same user) -> (mmap, uint8 tensor over all of it).
    OSError if that process or fd is gone, or /proc does not allow it."""
    pid, fd, capacity, dev, ino = key
    own = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
    try:
        st = os.fstat(own)
        if (st.st_dev, st.st_ino) != (dev, ino):  # the ring is gone and its fd number taken by another file
            raise FileNotFoundError(f"shared ring {key} is gone")
        m = mmap.mmap(own, capacity)
    finally:
        os.close(own)
    return m, torch.frombuffer(m, dtype=torch.uint8)
