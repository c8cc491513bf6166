"""LayerStoreActor: a LayerStore on the node that holds the files, serving whole shards to verifiers.

Each shard is the file as read (plain reads, `cold`/`direct` as in the in-process store; direct None: O_DIRECT
when this node's page cache cannot keep a sweep, decided at the first read as StreamingExecutor decides it) and
checksummed against the manifest (a bad shard raises StoreError here, before it is served). Two ways out:
- `read_into`, for a verifier on this node: the read lands in a slot of the verifier's SharedRing
  (runtime/shm.py) and only the slot's offset goes back, so no byte is copied after the read;
- `read`, across nodes: a uint8 numpy buffer that Ray copies into the object store once, and moves to the
  verifier's node.

The actor is threaded (RayEngine gives it prefetch depth + 1 threads): while one answer is on its way back
(for `read`, Ray's copy of a 14 MB layer into the object store: 6-9 ms per round trip measured here, against
~17 ms to read it cold) the next requested units are already being read, so the disk keeps `depth` reads in
flight. One read at a time, the disk idled during every copy and round trip (a cold sweep took 1.2-1.4x what
the in-process engine, then also reading one at a time, took).
"""
from __future__ import annotations

import logging
import os
import threading

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from ..errors import StoreError, StreamspecError
from ..runtime import shm
from ..runtime.prefetch import DiskClock
from ..store import shard
from ..store.store import LayerStore, UnitData
from .common import TIMEOUT_S, RingUnavailable, StoreLost, as_tensor, cause, node_id, normal_priority

log = logging.getLogger("streamspec")


class StoreServer:
    """The plain class behind LayerStoreActor (becomes an actor with ray.remote(...)(StoreServer))."""

    def __init__(self, root: str, cold: bool = False, direct: bool | None = False):
        normal_priority()
        self.cold, self.direct = cold, direct
        self.io_s = 0.0  # (bytes and reads: the LayerStore counts them)
        self.lock = threading.Lock()  # reads run on several threads
        self.local = threading.local()  # each thread's read buffer, reused (see read)
        self.clock = DiskClock()  # reads overlap: each is charged its share of the disk's busy time
        self.rings: dict = {}  # key -> tensor: the SharedRing of each verifier on this node, mapped here
        self.error = None
        try:
            self.store = LayerStore(root)
        except Exception as e:  # kept for ready(): an actor whose constructor raises only says "died"
            self.error = e

    def ready(self) -> str:
        if self.error is not None:
            raise self.error
        return node_id()

    def pid(self) -> int:
        return os.getpid()

    def info(self):
        """The store's Manifest (args, units, sizes, checksums)."""
        return self.store.manifest

    def reads_direct(self) -> bool:
        """Whether shards are read with O_DIRECT; direct=None decides it here, once: when a sweep's bytes (the
        streamed units) exceed the room this node's page cache has for them (memplan.reads_direct)."""
        with self.lock:
            if self.direct is None:
                from ..runtime.memplan import reads_direct
                self.direct = reads_direct(sum(u.bytes for u in self.store.stream_units))
            return self.direct

    def _read(self, name: str, cold: bool | None, room):
        buf, io_s = self.clock.run(self.store.read_raw, name, self.cold if cold is None else cold, room,
                                   self.reads_direct())
        with self.lock:
            self.io_s += io_s
        return buf, io_s

    def read(self, name: str, cold: bool | None = None):
        """-> (numpy uint8 [bytes], io_s): one whole shard file, its checksum verified before it is served; io_s
        is this read's share of the disk's busy time (DiskClock). Ray copies it into the object store."""
        size = self.store.manifest.unit(name).bytes
        # Ray copies the returned array into the object store before this thread takes its next call, so the
        # thread can read every shard into the same buffer: no fresh pages to fault in and zero per read
        room = self.local.buf = shard.read_buffer(size, reuse=getattr(self.local, "buf", None))
        buf, io_s = self._read(name, cold, room)
        return buf.numpy(), io_s

    def read_into(self, name: str, ring: tuple, offset: int, room: int, cold: bool | None = None):
        """Same-node path: read shard `name` into bytes [offset, offset + room) of a verifier's SharedRing (its
        key) -> (offset of the shard's first byte in the ring, bytes, io_s). The bytes never pass through the
        object store: the verifier computes on them where the read put them."""
        size = self.store.manifest.unit(name).bytes
        if room < size:
            raise StoreError(f"slot of {room} bytes too small for shard {name!r} ({size} bytes)")
        seg = self._ring(ring)
        buf, io_s = self._read(name, cold, seg[offset : offset + room])
        at = buf.data_ptr() - seg.data_ptr()
        if not offset <= at <= offset + room - size:  # O_DIRECT lacked room to align and used a buffer of its own
            raise StoreError(f"slot of {room} bytes too small for shard {name!r} read with O_DIRECT ({size} bytes)")
        return at, buf.numel(), io_s

    def _ring(self, key: tuple):
        with self.lock:
            seg = self.rings.get(key)
            if seg is None:
                try:
                    _, seg = shm.attach(key)
                except OSError as e:
                    raise RingUnavailable(f"cannot map the verifier's shared ring: {e}") from None
                # a verifier streams through one ring at a time: a new one from the same process replaces its
                # old one, and the rings of processes that are gone are let go (a read still in flight into one
                # holds its own map), so no dead ring's memory outlives its verifier here
                for old in [k for k in self.rings if k[0] == key[0] or not os.path.exists(f"/proc/{k[0]}")]:
                    del self.rings[old]
                self.rings[key] = seg
            return seg

    def tokenizer_files(self) -> dict[str, bytes]:
        """The tokenizer folder's files, for a driver that cannot see the store's disk."""
        path = self.store.tokenizer_path
        if not path:
            return {}
        out = {}
        for name in os.listdir(path):
            with open(os.path.join(path, name), "rb") as f:
                out[name] = f.read()
        return out

    def stats(self) -> dict:
        with self.lock:
            return {"bytes_read": self.store.bytes_read, "reads": self.store.reads, "io_s": self.io_s,
                    "node_id": node_id(), "pid": os.getpid()}


class RemoteStore:
    """LayerStore's reading interface (manifest, args, read) served by a LayerStoreActor: what a StreamingExecutor
    (VerifierActor) streams from, and what a resident draft is built from, on a node without the store's files.

    Two transports. Across nodes, `read` returns the shard through the object store. With a ring (`use_ring`:
    the store actor is on this node), `buffer` hands the reader a slot of a SharedRing and `read` has the actor
    read the shard straight into it; the slot is free again when the unit's last tensor dies. A full ring, or a
    store actor that cannot map it, falls back to the object store. Cold and O_DIRECT reads are the store
    actor's settings. A store actor that dies or stops answering raises StoreLost: the driver revives it and
    calls set_actor."""

    def __init__(self, actor, timeout_s: float = TIMEOUT_S):
        """actor: a LayerStoreActor handle or name. A store that is gone raises StoreLost."""
        self.timeout_s = timeout_s
        self.ring: shm.SharedRing | None = None
        self.set_actor(actor)
        self.manifest = self._get(self.handle.info.remote(), "info")
        self.args = self.manifest.args
        self.root = "<layer store actor>"
        self.tokenizer_path = None

    def set_actor(self, actor) -> None:
        """Read from `actor` (a handle or name) from now on. A ring in use is replaced by a fresh one: a read
        the old actor still had in flight may yet write into its slots."""
        if isinstance(actor, str):
            try:
                actor = ray.get_actor(actor)
            except ValueError:
                raise StoreLost(f"layer store actor {actor!r} not found") from None
        self.handle = actor
        if self.ring is not None:
            self.ring = None
            self.use_ring(self._capacity)

    def use_ring(self, capacity: int) -> bool:
        """Shards through a SharedRing of `capacity` bytes if the store actor runs on this node -> whether."""
        self._capacity = capacity
        if self._get(self.handle.ready.remote(), "setup") != node_id():
            return False
        try:
            self.ring = shm.SharedRing(capacity)
        except (OSError, AttributeError) as e:  # no memfd_create (not Linux), or no room in /dev/shm's tmpfs
            log.warning("no shared ring (%s): shards come through the object store", e)
        return self.ring is not None

    @property
    def transport(self) -> str:
        return "object store" if self.ring is None else "shared ring"

    def _get(self, ref, what: str):
        """ray.get: a dead or silent store actor raises StoreLost; its own errors (a corrupt shard, a ring it
        cannot map) come out as themselves."""
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except RayActorError as e:
            raise StoreLost(f"layer store lost during {what}: {type(e).__name__}") from None
        except GetTimeoutError:
            raise StoreLost(f"layer store: no answer for {what} within {self.timeout_s:.0f} s") from None
        except RayTaskError as e:
            inner = cause(e)
            if isinstance(inner, (StreamspecError, RingUnavailable)):
                raise inner from None
            raise

    def buffer(self, size: int) -> torch.Tensor | None:
        """Room for a shard of `size` bytes: a ring slot, or None (the object store brings its own)."""
        ring = self.ring
        return None if ring is None else ring.slot(shm.slot_bytes(size))

    def read(self, name: str, cold: bool = False, out: torch.Tensor | None = None, direct: bool = False) -> UnitData:
        ring = self.ring
        at = None if out is None or ring is None else ring.offset(out)
        if at is not None and 0 <= at < ring.capacity:  # (`out` is a slot of this ring: buffer()'s)
            try:
                start, nbytes, io_s = self._get(self.handle.read_into.remote(name, ring.key, at, out.numel()),
                                                f"read {name}")
            except RingUnavailable as e:
                log.warning("%s; shards now come through the object store", e)
                self.ring = None
            else:
                buf = out[start - at : start - at + nbytes]
                return UnitData(name, shard.parse(buf, name), nbytes, io_s)
        arr, io_s = self._get(self.handle.read.remote(name), f"read {name}")
        buf = as_tensor(arr)
        return UnitData(name, shard.parse(buf, name), buf.numel(), io_s)
