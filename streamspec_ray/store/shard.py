"""Reading one shard file: a plain safetensors file read with plain reads into one buffer.

Why not `safetensors.safe_open`: it mmaps the file, and pages that a process still has mapped cannot be
evicted with posix_fadvise(DONTNEED), so `--cold` would silently read from the page cache. Plain reads into
one buffer also give one large sequential read per shard and tensors that are zero-copy views of the buffer.
"""
from __future__ import annotations

import json
import os
import struct

import torch
import xxhash

from ..errors import StoreError

_DTYPES = {
    "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "U8": torch.uint8,
    "I8": torch.int8, "I32": torch.int32, "I64": torch.int64,
}


def checksum(data) -> str:
    """xxh3-64 of a buffer (bytes, memoryview or uint8 tensor): ~10 GB/s, so verifying costs little per sweep."""
    if isinstance(data, torch.Tensor):
        data = memoryview(data.numpy())
    return xxhash.xxh3_64_hexdigest(data)


def file_checksum(path: str) -> str:
    h = xxhash.xxh3_64()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def evict(path: str) -> None:
    """Drop a file's pages from the page cache so the next read really comes from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_into(path: str, size: int, out: torch.Tensor | None = None, cold: bool = False) -> torch.Tensor:
    """Read a whole file into a uint8 tensor (optionally a caller's, e.g. pinned, buffer) -> [size] uint8."""
    buf = torch.empty(size, dtype=torch.uint8) if out is None else out[:size]
    view = memoryview(buf.numpy())
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise StoreError(f"shard file missing: {path}") from None
    try:
        if cold:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        done = 0
        while done < size:
            n = os.preadv(fd, [view[done:]], done)
            if n == 0:
                raise StoreError(f"shard truncated: {path} has {done} bytes, manifest says {size}")
            done += n
    finally:
        os.close(fd)
    return buf


def parse(buf: torch.Tensor, path: str = "<buffer>") -> dict[str, torch.Tensor]:
    """safetensors bytes -> {name: tensor}, each a view of `buf` (no copy)."""
    try:
        (hlen,) = struct.unpack("<Q", bytes(buf[:8].numpy()))
        header = json.loads(bytes(buf[8 : 8 + hlen].numpy()))
    except (struct.error, ValueError, UnicodeDecodeError) as e:
        raise StoreError(f"shard header unreadable: {path} ({e})") from None
    base = 8 + hlen
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        dtype = _DTYPES[meta["dtype"]]
        raw = buf[base + start : base + end]
        if (base + start) % dtype.itemsize:  # misaligned view is not allowed: copy (never happens for our writes)
            raw = raw.clone()
        out[name] = raw.view(dtype).view(meta["shape"])
    return out
