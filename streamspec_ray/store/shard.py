"""Reading one shard file: a plain safetensors file read with plain reads into one buffer.

Why not `safetensors.safe_open`: it mmaps the file, and pages that a process still has mapped cannot be
evicted with posix_fadvise(DONTNEED), so `--cold` would silently read from the page cache. Plain reads into
one buffer also give one large sequential read per shard and tensors that are zero-copy views of the buffer.
Warm reads (neither cold nor O_DIRECT, on the CPU) may map the file instead (`map_file`): no copy at all.
"""
from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import shutil
import struct

import torch
import xxhash

from ..errors import StoreError

log = logging.getLogger("streamspec")
BLOCK = 256 * 2**10  # bytes per checksummed block of a shard read in part (the embedding, by rows)
ALIGN = 4096  # O_DIRECT needs buffer, offset and length aligned to the logical block size
MAPPED_OK = hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap.mmap, "madvise")  # map_file (else warm reads copy)
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14 (Python's mmap does not name it)
_populate_ok = True
_direct_ok = True

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


def block_checksums(path: str, block: int = BLOCK) -> list[str]:
    """xxh3-64 of each `block`-byte piece of a file (the last one shorter)."""
    out = []
    with open(path, "rb") as f:
        while chunk := f.read(block):
            out.append(xxhash.xxh3_64_hexdigest(chunk))
    return out


def evict(path: str) -> None:
    """Drop a file's pages from the page cache so the next read really comes from disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _drop(fd)
    finally:
        os.close(fd)


MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")  # their files are pages in memory: nothing to evict


def filesystem(path: str) -> str | None:
    """The type of the filesystem that holds `path` ("ext4", "tmpfs", ...), from /proc/self/mountinfo (the
    longest mount point above it), or None where the OS does not say."""
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None
    path, best, kind = os.path.realpath(path), "", None
    for fields in mounts:
        # "<id> <parent> <dev> <root> <mount point> <options> [optional...] - <type> <source> <super options>"
        point = fields[4].encode().decode("unicode_escape")  # (spaces in a mount point read as \040)
        if "-" not in fields[6:]:
            continue
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= len(best):
            best, kind = point, fields[fields.index("-", 6) + 1]
    return kind


def memory_backed(path: str) -> bool:
    """True where `path` lies on a filesystem that lives in memory (tmpfs: /dev/shm, and /tmp on many systems).
    Its pages are the files themselves: DONTNEED and O_DIRECT cannot make a read come from a disk."""
    return filesystem(path) in MEMORY_FILESYSTEMS


def sync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop(fd: int) -> None:
    os.fdatasync(fd)  # dirty pages (a freshly written store) cannot be dropped until they are on disk
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def buffer_bytes(size: int) -> int:
    """Room that read_into needs to read `size` bytes by either path (O_DIRECT needs room to align)."""
    return size + 2 * ALIGN


def read_buffer(size: int, pin: bool = False, reuse: torch.Tensor | None = None) -> torch.Tensor:
    """A uint8 buffer that read_into can fill with `size` bytes by either path: `reuse` if it is large enough,
    else a new one."""
    if reuse is not None and reuse.numel() >= buffer_bytes(size):
        return reuse
    return torch.empty(buffer_bytes(size), dtype=torch.uint8, pin_memory=pin)


def read_into(path: str, size: int, out: torch.Tensor | None = None, cold: bool = False,
              direct: bool = False) -> torch.Tensor:
    """Read a whole file into a uint8 tensor (optionally a caller's, e.g. pinned, buffer) -> [size] uint8.

    cold: drop the file's cached pages first (posix_fadvise DONTNEED), so the read really hits the disk.
    direct: O_DIRECT, bypassing the page cache altogether, where the filesystem allows it."""
    global _direct_ok
    if direct and _direct_ok:
        try:
            return _read_direct(path, size, out)
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                raise StoreError(f"shard file missing: {path}") from None
            _direct_ok = False
            log.warning("O_DIRECT not usable here (%s); reading with posix_fadvise(DONTNEED) instead", e)
        cold = True
    buf = torch.empty(size, dtype=torch.uint8) if out is None else out[:size]
    view = memoryview(buf.numpy())
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise StoreError(f"shard file missing: {path}") from None
    try:
        if cold:
            _drop(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        _pread_all(fd, view, size, path)
    finally:
        os.close(fd)
    return buf


def map_file(path: str, size: int) -> torch.Tensor:
    """A file's first `size` bytes as a uint8 tensor over a private mapping of its pages, mapped up front
    (MADV_POPULATE_READ where the kernel has it): the tensors parsed from it are the page cache's own pages, not
    a copy. For warm reads only: pages that a process maps cannot be evicted (see the module docstring), and
    CUDA reads need pinned buffers. The mapping goes when the last tensor over it does.

    A warm sweep of SmolLM2-135M fp32 (425 MB) copied its pages in ~100 ms of one core, beside the sweep's own
    compute on a 2-core machine; mapping 538 MB takes ~11 ms and the matmuls over the pages run as fast as over
    a private buffer. (Not MAP_POPULATE: on a writable private mapping it populates for writing, which copies
    every page.)"""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise StoreError(f"shard file missing: {path}") from None
    try:
        have = os.fstat(fd).st_size
        if have < size:  # (a mapping past the end of a file faults on access: check before mapping)
            raise StoreError(f"shard truncated: {path} has {have} bytes, manifest says {size}")
        # private and writable: torch wants a writable buffer, and nothing written ever reaches the file
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    global _populate_ok
    if _populate_ok:
        try:
            mm.madvise(MADV_POPULATE_READ)
        except OSError:  # (kernels before 5.14: the pages fault in as the sweep touches them)
            _populate_ok = False
    return torch.frombuffer(mm, dtype=torch.uint8)


def _pread_all(fd: int, view: memoryview, size: int, path: str) -> None:
    done = 0
    while done < size:
        n = os.preadv(fd, [view[done:]], done)
        if n == 0:
            raise StoreError(f"shard truncated: {path} has {done} bytes, manifest says {size}")
        done += n


def _read_direct(path: str, size: int, out: torch.Tensor | None) -> torch.Tensor:
    padded = (size + ALIGN - 1) // ALIGN * ALIGN
    raw = torch.empty(padded + ALIGN, dtype=torch.uint8) if out is None or out.numel() < padded + ALIGN else out
    shift = (-raw.data_ptr()) % ALIGN
    buf = raw[shift : shift + padded]
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        view = memoryview(buf.numpy())
        done = 0
        while done < size:  # aligned chunks; the last read returns short at end of file
            n = os.preadv(fd, [view[done:]], done)
            if n == 0:
                raise StoreError(f"shard truncated: {path} has {done} bytes, manifest says {size}")
            done += n
    finally:
        os.close(fd)
    return buf[:size]


def residency(path: str) -> float | None:
    """Fraction of a file's pages in the page cache (mincore), or None where the OS does not say."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fd = os.open(path, os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
    except (OSError, AttributeError):
        return None
    try:
        page = mmap.PAGESIZE
        n = (size + page - 1) // page
        vec = (ctypes.c_ubyte * n)()
        addr = _address(mm)
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            return None
        return sum(v & 1 for v in vec) / n
    finally:
        mm.close()


def _address(mm: mmap.mmap) -> int:
    import numpy as np

    arr = np.frombuffer(mm, dtype=np.uint8)
    addr = arr.ctypes.data
    del arr  # release the export so the mapping can close
    return addr


def parse(buf: torch.Tensor, path: str = "<buffer>") -> dict[str, torch.Tensor]:
    """safetensors bytes -> {name: tensor}, each a view of `buf` (no copy). Bytes that are not a shard (a header
    length or offsets past the end, a bad dtype or shape) are one StoreError; callers that have a checksum check
    it first (LayerStore.read), so a corrupt shard says so rather than what its garbled header looks like."""
    try:
        (hlen,) = struct.unpack("<Q", bytes(buf[:8].numpy()))
        if 8 + hlen > buf.numel():
            raise ValueError(f"header length {hlen} runs past the end of its {buf.numel()} bytes")
        header = json.loads(bytes(buf[8 : 8 + hlen].numpy()))
        base = 8 + hlen
        out = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            dtype = _DTYPES[meta["dtype"]]
            if not 0 <= start <= end <= buf.numel() - base:
                raise ValueError(f"tensor {name} at bytes {start}..{end} lies outside the shard")
            raw = buf[base + start : base + end]
            if (base + start) % dtype.itemsize:  # misaligned view is not allowed: copy (never for our writes)
                raw = raw.clone()
            out[name] = raw.view(dtype).view(meta["shape"])
    except (struct.error, ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
        raise StoreError(f"shard header unreadable: {path} ({e})") from None
    return out


def read_header(path: str, xxh3: str, blocks: list[str]) -> tuple[dict, int]:
    """The header of a shard read in part (the embedding, by rows), its bytes verified before they are parsed:
    the checksummed blocks that hold it (`blocks`: the unit's block_xxh3), or the whole file (`xxh3`) for a
    store without them. -> (header, the byte where tensor data starts)."""
    if not blocks and file_checksum(path) != xxh3:
        raise StoreError(f"shard corrupt (checksum mismatch): {path}")
    data, need = b"", 8
    with open(path, "rb") as f:
        while len(data) < need:  # (one block holds the header of any shard this project writes)
            b, chunk = len(data) // BLOCK, f.read(BLOCK)
            if not chunk:
                raise StoreError(f"shard header unreadable: {path} (it runs past the end of the file)")
            if blocks and (b >= len(blocks) or xxhash.xxh3_64_hexdigest(chunk) != blocks[b]):
                raise StoreError(f"shard corrupt (checksum mismatch in block {b}): {path}")
            data += chunk
            need = 8 + struct.unpack("<Q", data[:8])[0] if len(data) >= 8 else 8
    try:
        return json.loads(data[8:need]), need
    except ValueError as e:
        raise StoreError(f"shard header unreadable: {path} ({e})") from None


_ST_NAMES = {v: k for k, v in _DTYPES.items()}


def check_space(folder: str, need: int, what: str) -> None:
    """One error line, before anything is written, when `folder`'s disk has less than `need` bytes (+1%) free."""
    free = shutil.disk_usage(folder or ".").free
    if free < need * 1.01:
        raise StoreError(f"{what} needs {need / 1e9:.2f} GB but {folder or '.'} has {free / 1e9:.2f} GB free: "
                         f"free some space or write it elsewhere (STREAMSPEC_HOME, or convert's OUT)")


class ShardWriter:
    """Write a safetensors file whose tensors arrive in pieces (slabs of rows), so a tensor larger than memory
    never has to exist whole: the header is laid out first from the declared shapes, then each piece is written
    at its place. safetensors' own save_file needs every tensor whole (and copies each once more to bytes).

        w = ShardWriter(path, {"weight": (torch.float16, [N, K])})
        w.write("weight", rows_0_to_1023, row=0); ...; w.close()
    """

    def __init__(self, path: str, specs: dict[str, tuple[torch.dtype, list[int]]]):
        header, offset, self._where = {}, 0, {}
        for name, (dtype, shape) in specs.items():
            n = dtype.itemsize
            for d in shape:
                n *= d
            header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self._where[name] = (offset, n)
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # tensors start 8-byte aligned, as safetensors writes them
        self._base = 8 + len(raw)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(self._fd, struct.pack("<Q", len(raw)) + raw, 0)
        os.ftruncate(self._fd, self._base + offset)

    def write(self, name: str, t: torch.Tensor, at: int = 0) -> None:
        """Bytes of `t` (contiguous) into tensor `name`, starting `at` bytes into it."""
        start, n = self._where[name]
        data = t.detach().contiguous().view(torch.uint8).reshape(-1).numpy()
        if at + data.size > n:
            raise ValueError(f"{name}: write of {data.size} bytes at {at} overflows its {n} bytes")
        view, done = memoryview(data), 0
        while done < data.size:
            done += os.pwrite(self._fd, view[done:], self._base + start + at + done)

    def close(self) -> None:
        os.fsync(self._fd)
        os.close(self._fd)
