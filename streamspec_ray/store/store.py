"""LayerStore: opens and validates a store folder and reads one unit (shard) at a time."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import torch

from ..errors import StoreError
from . import shard
from .manifest import Manifest, Unit


@dataclass
class UnitData:
    """One unit's tensors, all views of one read buffer ([nbytes] uint8)."""
    name: str
    tensors: dict[str, torch.Tensor]
    nbytes: int
    io_s: float
    raw: torch.Tensor | None = None  # the read buffer, when its checksum is left to the caller (read(verify=False))
    key: tuple | None = None  # the shard file's identity before the read (file_identity), for check()

    def __repr__(self) -> str:
        return f"UnitData({self.name}, {len(self.tensors)} tensors, {self.nbytes / 2**20:.1f} MiB)"


def file_identity(path: str) -> tuple:
    """What changes when a file is rewritten, replaced or altered in place: device, inode, size, modification
    and status-change times (the latter moves on any write, even one whose mtime is then set back)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class LayerStore:
    """A store on local disk. Opening checks that every shard exists with its manifest size; a read verifies the
    shard's checksum before any tensor is handed out, so no sweep computes on bad bytes.

    Each version of a shard file is hashed once per store object: a later read of the same file (same
    file_identity, taken before the read) skips the hash, and a file rewritten, replaced or altered in place
    since is hashed again. Hashing every read cost a cold fp32 sweep of SmolLM2 ~60 ms of CPU for its 425 MB
    (xxh3 at ~7 GB/s), beside a sweep that computes in ~90 ms on the same two cores; `reverify=True` hashes
    every read all the same."""

    def __init__(self, root: str, verify: bool = True, reverify: bool = False):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.manifest = Manifest.load(self.root)
        self.args = self.manifest.args
        self.verify, self.reverify = verify, reverify
        self._verified: dict[str, tuple] = {}  # unit -> the file identity whose bytes matched the manifest
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.reads = 0
        for u in self.manifest.units:
            path = self.path(u)
            if not os.path.exists(path):
                raise StoreError(f"shard file missing: {path}")
            size = os.path.getsize(path)
            if size != u.bytes:
                raise StoreError(f"shard truncated or altered: {path} has {size} bytes, manifest says {u.bytes}")

    def path(self, unit: Unit | str) -> str:
        if isinstance(unit, str):
            unit = self.manifest.unit(unit)
        return os.path.join(self.root, unit.file)

    @property
    def tokenizer_path(self) -> str | None:
        t = self.manifest.tokenizer
        return os.path.join(self.root, t) if t else None

    @property
    def stream_units(self) -> list[Unit]:
        """Units streamed by every sweep: the decoder layers, then the head. The embedding table is resident,
        routed experts (`expert.*`, MoE stores) are read only when a chunk routes to them, and a DeepSeek V3
        multi-token-prediction layer (`mtp.*`) only by the mtp draft."""
        return [u for u in self.manifest.units if u.name != "embed" and not u.name.startswith(("expert.", "mtp."))]

    def read(self, name: str, cold: bool = False, out: torch.Tensor | None = None, direct: bool = False,
             verify: bool = True, mapped: bool = False) -> UnitData:
        """verify False: the checksum is left to the caller (check(name, data.raw)) before any tensor is used.
        mapped: the tensors are views of the file's mapped pages (shard.map_file; warm reads, `out` unused)."""
        t0 = time.perf_counter()
        buf, key = self._read_raw(name, cold, out, direct, verify, mapped)
        io_s = time.perf_counter() - t0
        try:
            tensors = shard.parse(buf, self.path(name))
        except StoreError:
            if not verify:  # (a header that does not parse: the checksum says why, if it is corruption)
                self.check(name, buf)
            raise
        return UnitData(name, tensors, buf.numel(), io_s, None if verify else buf, None if verify else key)

    def read_raw(self, name: str, cold: bool = False, out: torch.Tensor | None = None,
                 direct: bool = False, verify: bool = True, mapped: bool = False) -> torch.Tensor:
        """One unit's shard file as read, uint8 [bytes], its checksum verified (StoreError if it does not match;
        verify False: left to the caller, who has only read() to pass check() the file's identity)."""
        return self._read_raw(name, cold, out, direct, verify, mapped)[0]

    def _read_raw(self, name, cold, out, direct, verify, mapped=False) -> tuple[torch.Tensor, tuple | None]:
        unit = self.manifest.unit(name)
        path = self.path(unit)
        try:  # (before the read: a file changed after it has another identity at the next read)
            key = None if self.reverify else file_identity(path)
        except OSError as e:
            raise StoreError(f"shard file missing: {path} ({e.strerror})") from None
        if mapped and not (cold or direct):
            buf = shard.map_file(path, unit.bytes)
        else:
            buf = shard.read_into(path, unit.bytes, out=out, cold=cold, direct=direct)
        if verify:
            self.check(name, buf, key)
        with self._lock:
            self.bytes_read += unit.bytes
            self.reads += 1
        return buf, key

    def check(self, name: str, buf: torch.Tensor, key: tuple | None = None) -> None:
        """StoreError unless `buf` (unit `name` as read) has the manifest's checksum (nothing when verify is off).
        key: the file's identity before the read (UnitData.key); None hashes whatever was verified before."""
        if not self.verify or (key is not None and self._verified.get(name) == key):
            return
        unit = self.manifest.unit(name)
        if shard.checksum(buf) != unit.xxh3:
            raise StoreError(f"shard corrupt (checksum mismatch): {self.path(unit)}")
        if key is not None:
            self._verified[name] = key

    def evict_all(self) -> None:
        for u in self.manifest.units:
            shard.evict(self.path(u))

    def total_bytes(self, names=None) -> int:
        return sum(u.bytes for u in self.manifest.units if names is None or u.name in names)
