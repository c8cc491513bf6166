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

    def __repr__(self) -> str:
        return f"UnitData({self.name}, {len(self.tensors)} tensors, {self.nbytes / 2**20:.1f} MiB)"


class LayerStore:
    """A store on local disk. Opening checks that every shard exists with its manifest size; each read
    verifies the shard's checksum before any tensor is handed out, so no sweep computes on bad bytes."""

    def __init__(self, root: str, verify: bool = True):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.manifest = Manifest.load(self.root)
        self.args = self.manifest.args
        self.verify = verify
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
             verify: bool = True) -> UnitData:
        """verify False: the checksum is left to the caller (check(name, data.raw)) before any tensor is used."""
        t0 = time.perf_counter()
        buf = self.read_raw(name, cold, out, direct, verify)
        io_s = time.perf_counter() - t0
        return UnitData(name, shard.parse(buf, self.path(name)), buf.numel(), io_s, None if verify else buf)

    def read_raw(self, name: str, cold: bool = False, out: torch.Tensor | None = None,
                 direct: bool = False, verify: bool = True) -> torch.Tensor:
        """One unit's shard file as read, uint8 [bytes], its checksum verified (StoreError if it does not match;
        verify False: left to the caller's check())."""
        unit = self.manifest.unit(name)
        buf = shard.read_into(self.path(unit), unit.bytes, out=out, cold=cold, direct=direct)
        if verify:
            self.check(name, buf)
        with self._lock:
            self.bytes_read += unit.bytes
            self.reads += 1
        return buf

    def check(self, name: str, buf: torch.Tensor) -> None:
        """StoreError unless `buf` (unit `name` as read) has the manifest's checksum (nothing when verify is off)."""
        unit = self.manifest.unit(name)
        if self.verify and shard.checksum(buf) != unit.xxh3:
            raise StoreError(f"shard corrupt (checksum mismatch): {self.path(unit)}")

    def evict_all(self) -> None:
        for u in self.manifest.units:
            shard.evict(self.path(u))

    def total_bytes(self, names=None) -> int:
        return sum(u.bytes for u in self.manifest.units if names is None or u.name in names)
