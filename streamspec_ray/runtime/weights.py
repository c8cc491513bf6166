"""Turn a unit's stored tensors into compute weights: dequantize INT4 pairs, cast the rest."""
from __future__ import annotations

import torch

from .. import quant
from ..store.manifest import Unit
from .int4 import PackedInt4

_ELEM = {"float32": 4, "float16": 2, "bfloat16": 2}


def materialize(tensors: dict[str, torch.Tensor], dtype: torch.dtype, device="cpu",
                group_size: int = quant.GROUP_SIZE) -> dict[str, torch.Tensor]:
    """{name.qweight, name.scales[, name.zeros], other} -> {name.weight, other}, all in `dtype` on `device`.
    Tensors already in the right dtype and device are returned as views (no copy)."""
    out = {}
    for name, t in tensors.items():
        if name.endswith((".scales", ".zeros", ".scales_zeros")):
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

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, block_bytes: int = 16 << 20):
        self.weight, self.dtype = weight, dtype
        self.shape = weight.shape
        elem = torch.empty((), dtype=dtype).element_size()
        self.rows = max(256, block_bytes // (weight.shape[1] * elem))

    def __call__(self, x: torch.Tensor, bias=None) -> torch.Tensor:
        w, n = self.weight, self.weight.shape[0]
        x2 = x.reshape(-1, x.shape[-1]).to(self.dtype)
        out = torch.empty(x2.shape[0], n, dtype=self.dtype, device=x.device)
        buf = torch.empty(min(self.rows, n), w.shape[1], dtype=self.dtype, device=w.device)
        for i in range(0, n, self.rows):
            b = buf[: min(self.rows, n - i)]
            b.copy_(w[i : i + b.shape[0]])
            torch.mm(x2, b.t(), out=out[:, i : i + b.shape[0]])
        out = out.view(*x.shape[:-1], n)
        return out if bias is None else out + bias


def extra_bytes(unit: Unit, dtype: torch.dtype, same_device: bool = True) -> int:
    """Bytes that `materialize` allocates beyond the read buffer (dequantized or cast copies)."""
    elem = torch.empty((), dtype=dtype).element_size()
    total = 0
    for name, meta in unit.tensors.items():
        n = unit.numel(name)
        if name.endswith(".qweight") and name[: -len(".qweight")] + ".scales_zeros" in unit.tensors:
            continue  # int4pack: used where it was read
        elif name.endswith(".qweight"):
            total += 2 * n * elem  # packed two per byte
        elif name.endswith((".scales", ".zeros", ".scales_zeros")):
            continue
        elif not same_device or (meta["dtype"] in _ELEM and meta["dtype"] != str(dtype).removeprefix("torch.")):
            total += n * (elem if meta["dtype"] in _ELEM else 8)
    return total
