"""The token embedding: resident when small, else read by rows from its shard.

A big vocabulary makes the embedding larger than a decoder layer (Qwen2.5 1.5B: 151,936 x 1,536, 0.93 GB in
fp32), yet a sweep needs only the rows of its T tokens. Rows are contiguous in the shard, so a lookup is a
few preads (a gguf store's table is rows of GGUF blocks, dequantized after the read: quant/ggml.py).
Integrity: the converter records an xxh3 per BLOCK bytes of the shard, and every block a lookup touches is
read whole and checked, so no sweep computes on bad bytes (stores without block checksums are checked whole
once, when opened).
"""
from __future__ import annotations

import os

import torch
import xxhash

from ..errors import StoreError
from ..quant import ggml
from ..store import shard
from ..store.store import LayerStore
from .weights import materialize

RESIDENT_MAX = 256 * 2**20  # embeddings up to this size (in the compute dtype) stay in memory
BLOCK = shard.BLOCK


def by_rows(store: LayerStore, dtype: torch.dtype, resident_max: int = RESIDENT_MAX) -> bool:
    """Whether the embedding is too big to keep in memory in `dtype`: then it is read by rows (from the file: a
    store served from another process, which has no files here, keeps it resident)."""
    if not hasattr(store, "path"):
        return False
    unit = store.manifest.unit("embed")
    name = table_name(unit)
    if name is None:
        return False
    rows, cols = table_shape(name, unit.tensors[name]["shape"])
    return rows * cols * dtype.itemsize > resident_max


def table_name(unit) -> str | None:
    """The embed unit's table: "weight", or "weight.<type>" for GGUF blocks (a gguf store)."""
    return next((k for k in unit.tensors if (ggml.split(k) or (k,))[0] == "weight"), None)


def table_shape(name: str, shape) -> tuple[int, int]:
    """[vocab, hidden] of a table stored as `name` with `shape` (GGUF blocks: [vocab, row bytes])."""
    block = ggml.split(name)
    return (shape[0], shape[1]) if block is None else (shape[0], ggml.cols_of(shape[1], block[1]))


def head_is_the_table(store: LayerStore) -> bool:
    """A tied model whose head unit holds no copy of the table (a copy may be packed: lm_head.qweight): a sweep
    that reads the embedding by rows then streams the table itself as the head."""
    return store.args.tie_word_embeddings and not any(k.startswith("lm_head.")
                                                      for k in store.manifest.unit("head").tensors)


def load_embedding(store: LayerStore, dtype: torch.dtype, device="cpu", resident_max: int = RESIDENT_MAX):
    """The embedding as a [vocab, hidden] tensor if it is small enough, else an EmbeddingRows."""
    if not by_rows(store, dtype, resident_max):
        return materialize(store.read("embed").tensors, dtype, device, store.manifest.group_size or 64)["weight"]
    return EmbeddingRows(store, dtype, device)


class EmbeddingRows:
    """embed[ids] -> [T, hidden] in `dtype`, read from the shard by rows; quacks like the table for the model
    code (indexing, .dtype, .device, .shape)."""

    def __init__(self, store: LayerStore, dtype: torch.dtype, device="cpu"):
        unit = store.manifest.unit("embed")
        self.path, self.dtype, self.device = store.path(unit), dtype, torch.device(device)
        name = table_name(unit)
        self.blocks = list(getattr(unit, "block_xxh3", None) or [])
        # (verified before it is parsed; an older store without block checksums: the whole file, once)
        header, base = shard.read_header(self.path, unit.xxh3, self.blocks)
        meta = header[name]
        self.stored = shard._DTYPES[meta["dtype"]]
        self.qtype = None if ggml.split(name) is None else ggml.split(name)[1]  # GGUF blocks: dequantized
        self.row_items = meta["shape"][1]  # stored items per row (bytes of blocks for a gguf table)
        self.shape = torch.Size(table_shape(name, meta["shape"]))
        self.row_bytes = self.row_items * self.stored.itemsize
        self.data_start = base + meta["data_offsets"][0]
        self.bytes_read = 0
        self._fd = os.open(self.path, os.O_RDONLY)
        self.file_bytes = os.fstat(self._fd).st_size

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def __getstate__(self) -> dict:
        """Pickled (a draft sent to another process) with the file's path, not this process's descriptor."""
        state = dict(self.__dict__)
        del state["_fd"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise StoreError(f"cannot open the embedding's shard {self.path}: {e.strerror}") from None

    def __repr__(self) -> str:
        return (f"EmbeddingRows({tuple(self.shape)}, {self.qtype or self.stored} on disk -> {self.dtype}, "
                f"{self.path})")

    def _read(self, start: int, n: int) -> bytes:
        data = os.pread(self._fd, n, start)
        if len(data) != n:
            raise StoreError(f"shard truncated: {self.path} ends before byte {start + n}")
        return data

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(ids).reshape(-1).cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.shape[0]):
            raise IndexError(f"token id out of range 0..{self.shape[0] - 1}")
        out = torch.empty(ids.numel(), self.row_items, dtype=self.stored)
        rows = {}
        for i, t in enumerate(ids.tolist()):
            rows.setdefault(t, []).append(i)
        if self.blocks:
            blocks: dict[int, bytes] = {}
            for t, where in rows.items():
                start = self.data_start + t * self.row_bytes
                first, last = start // BLOCK, (start + self.row_bytes - 1) // BLOCK
                for b in range(first, last + 1):
                    if b not in blocks:
                        data = self._read(b * BLOCK, min(BLOCK, self.file_bytes - b * BLOCK))
                        if xxhash.xxh3_64_hexdigest(data) != self.blocks[b]:
                            raise StoreError(f"shard corrupt (checksum mismatch in block {b}): {self.path}")
                        blocks[b] = data
                        self.bytes_read += len(data)
                raw = b"".join(blocks[b] for b in range(first, last + 1))
                off = start - first * BLOCK
                row = torch.frombuffer(bytearray(raw[off : off + self.row_bytes]), dtype=self.stored)
                out[where] = row
        else:
            for t, where in rows.items():
                row = torch.frombuffer(bytearray(self._read(self.data_start + t * self.row_bytes, self.row_bytes)),
                                       dtype=self.stored)
                self.bytes_read += self.row_bytes
                out[where] = row
        if self.qtype is not None:
            out = ggml.dequantize(out, self.qtype)
        return out.to(self.device, self.dtype)
