"""Turn a unit's stored tensors into compute weights: dequantize INT4 pairs and GGUF blocks, cast the rest."""
from __future__ import annotations

import torch

from .. import quant
from ..quant import ggml
from ..quant.packed import PackedInt4
from ..store.manifest import Unit

_ELEM = {"float32": 4, "float16": 2, "bfloat16": 2}
BLOCK_BYTES = 16 << 20  # BlockCast / GGMLMatrix: bytes of compute-dtype rows per block


def block_rows(cols: int, dtype: torch.dtype, block_bytes: int | None = None) -> int:
    """Rows per block of a matrix multiplied a block at a time (block_bytes None: BLOCK_BYTES)."""
    return max(256, (block_bytes or BLOCK_BYTES) // (cols * dtype.itemsize))


def materialize(tensors: dict[str, torch.Tensor], dtype: torch.dtype, device="cpu",
                group_size: int = quant.GROUP_SIZE) -> dict[str, torch.Tensor]:
    """{name.qweight, name.scales[, name.zeros], other} -> {name.weight, other}, all in `dtype` on `device`.
    A gguf store's block tensors ({name.weight.Q4_K, ...}: quant/ggml.py) are dequantized to fp32 whole, except
    an LM head, which is multiplied a slab of rows at a time (GGMLMatrix: a big vocabulary's fp32 head would be
    the largest copy of the sweep). Tensors already in the right dtype and device are returned as views."""
    out = {}
    for name, t in tensors.items():
        if name.endswith((".scales", ".zeros", ".scales_zeros")):
            continue
        if (block := ggml.split(name)) is not None:
            wname, qtype = block
            t = t.to(device, non_blocking=True)
            if wname.startswith("lm_head."):
                out[wname] = GGMLMatrix(t, qtype, dtype)
            else:  # (to fp32 first, as the fp32 store was made, then to the compute dtype)
                out[wname] = ggml.dequantize(t, qtype).to(dtype)
            continue
        if name.endswith(".qweight") and name[: -len(".qweight")] + ".scales_zeros" in tensors:
            stem = name[: -len(".qweight")]  # int4pack: the kernel multiplies straight from the read buffer
            out[stem + ".weight"] = PackedInt4.from_packed(t, tensors[stem + ".scales_zeros"], group_size)
        elif name.endswith(".qweight"):
            stem = name[: -len(".qweight")]
            q, s = t.to(device, non_blocking=True), tensors[stem + ".scales"].to(device, non_blocking=True)
            z = tensors.get(stem + ".zeros")
            z = None if z is None else z.to(device, non_blocking=True)
            out[stem + ".weight"] = quant.dequantize_int4(q, s, group_size, dtype=dtype, zeros=z)
        elif t.is_floating_point():
            out[name] = t.to(device, dtype, non_blocking=True)
        else:
            out[name] = t.to(device, non_blocking=True)
    return out


class BlockCast:
    """A big matrix kept in its stored dtype (a big vocabulary's tied head: the fp16 embedding table streamed as
    the head), multiplied a block of rows at a time, each block cast into one reused buffer of the compute
    dtype. Every output is the same dot product as after casting the whole table (bit for bit, checked in
    tests/test_head.py), without the whole-table copy: on Gemma 3 270M's 262,144 x 640 fp16 head, 1
    token took 99 ms against 350 ms for cast-then-multiply (1 thread, this VM), 9 tokens 145 against 529."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, block_bytes: int | None = None):
        self.weight, self.dtype = weight, dtype
        self.shape, self.device = weight.shape, weight.device
        self.rows = block_rows(self.shape[1], dtype, block_bytes)

    def _fill(self, b: torch.Tensor, i: int) -> None:
        """b [r, in] (compute dtype) <- rows i..i+r of the matrix."""
        b.copy_(self.weight[i : i + b.shape[0]])

    def __call__(self, x: torch.Tensor, bias=None) -> torch.Tensor:
        n, k = self.shape
        x2 = x.reshape(-1, x.shape[-1]).to(self.dtype)
        out = torch.empty(x2.shape[0], n, dtype=self.dtype, device=x.device)
        buf = torch.empty(min(self.rows, n), k, dtype=self.dtype, device=self.device)
        for i in range(0, n, self.rows):
            b = buf[: min(self.rows, n - i)]
            self._fill(b, i)
            torch.mm(x2, b.t(), out=out[:, i : i + b.shape[0]])
        out = out.view(*x.shape[:-1], n)
        return out if bias is None else out + bias


class GGMLMatrix(BlockCast):
    """A gguf store's block-quantized matrix (blocks uint8 [out, row_bytes], quant/ggml.py) multiplied as
    BlockCast does, each block of rows dequantized to fp32 (then the compute dtype) as it is needed: the same
    dot products as the fp32 store's whole matrix, without its fp32 copy (Qwen2.5 1.5B's tied 151,936 x 1,536
    head: 0.93 GB)."""

    def __init__(self, blocks: torch.Tensor, qtype: str, dtype: torch.dtype, block_bytes: int | None = None):
        self.blocks, self.qtype, self.dtype = blocks, qtype, dtype
        self.shape = torch.Size([blocks.shape[0], ggml.cols_of(blocks.shape[1], qtype)])
        self.device = blocks.device
        self.rows = block_rows(self.shape[1], dtype, block_bytes)

    def _fill(self, b: torch.Tensor, i: int) -> None:
        rows = self.blocks[i : i + b.shape[0]]
        if b.dtype == torch.float32:
            ggml.dequantize(rows, self.qtype, out=b)
        else:
            b.copy_(ggml.dequantize(rows, self.qtype))

    def rows_of(self, r0: int, r1: int) -> torch.Tensor:
        """Rows r0..r1 dequantized: [r1 - r0, in] in the compute dtype."""
        return ggml.dequantize(self.blocks[r0:r1], self.qtype).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def clone(self) -> "GGMLMatrix":
        """A copy that holds its own blocks (so the read buffer they came from can go)."""
        return GGMLMatrix(self.blocks.clone(), self.qtype, self.dtype)

    def __repr__(self) -> str:
        return f"GGMLMatrix({tuple(self.shape)}, {self.qtype} blocks -> {self.dtype})"


def streamed_table(tensors: dict[str, torch.Tensor], dtype: torch.dtype):
    """A tied table streamed as the head in its stored form ({"weight": ...} or {"weight.Q6_K": ...}) -> the
    head's weight: the table itself when it is in the compute dtype, else multiplied a block at a time."""
    (name, table), = tensors.items()
    if (block := ggml.split(name)) is not None:
        return GGMLMatrix(table, block[1], dtype)
    return table if table.dtype == dtype else BlockCast(table, dtype)


def extra_bytes(unit: Unit, dtype: torch.dtype, same_device: bool = True) -> int:
    """Bytes that `materialize` allocates beyond the read buffer (dequantized or cast copies)."""
    elem = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, meta in unit.tensors.items():
        n = unit.numel(name)
        if name.endswith(".qweight") and name[: -len(".qweight")] + ".scales_zeros" in unit.tensors:
            continue  # int4pack: used where it was read
        elif (block := ggml.split(name)) is not None:  # gguf: the fp32 copy, or one block of a head's rows
            rows, cols = meta["shape"][0], ggml.cols_of(meta["shape"][1], block[1])
            if block[0].startswith("lm_head."):
                rows = min(rows, block_rows(cols, dtype))  # (GGMLMatrix's buffer)
            total += rows * cols * elem + (0 if same_device else n)
        elif name.endswith(".qweight"):
            total += 2 * n * elem  # packed two per byte
        elif name.endswith((".scales", ".zeros", ".scales_zeros")):
            continue
        elif not same_device or (meta["dtype"] in _ELEM and meta["dtype"] != str(dtype).removeprefix("torch.")):
            total += n * (elem if meta["dtype"] in _ELEM else 8)
    return total
