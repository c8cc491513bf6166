"""How one source tensor becomes the store's tensors, a slab of rows at a time.

Each store dtype has a layout per tensor kind (norms and biases stay fp32, the embedding is kept as plain rows so
it can be read by rows, matrices are cast or quantized). A tensor larger than SLAB_ELEMS is read, encoded and
written in slabs of rows, so converting never holds more than a slab of any big tensor (plus, for int4pack,
its small scale table).

  fp32 | fp16 | bf16   name                    cast
  int4                 stem.qweight uint8 [out, in/2], stem.scales fp16 [out, in/g] (+ stem.zeros): INT4 groups
                       along the input, dequantized to the compute dtype per layer (quant/int4.py)
  int4pack             stem.qweight uint8 [out, in/2] in torch's CPU int4 kernel layout and stem.scales_zeros
                       bf16 [in/g, out, 2]: a sweep multiplies straight from the read buffer (quant/packed.py).
                       GGUF Q4_K / Q4_0 / Q4_1 tensors at group 32 keep their own codes (quant/ggml.py;
                       Llama's q/k rows reordered as the fix-ups reorder the dequantized weights);
                       other types are re-quantized (min/max per group; with search=True, as the self-int4
                       draft is built, quantize_asym's default shrink / refit search).
  gguf                 (GGUF sources) every block-quantized matrix as the file's own blocks: `name.<type>` uint8
                       [out, row_bytes] (e.g. `mlp.down_proj.weight.Q6_K`; quant/ggml.py dequantizes it
                       bit for bit as the fp32 store was made; Llama's q/k rows of blocks reordered as the
                       fix-ups reorder the dequantized rows); F16 / BF16 matrices as they are; F32 and the
                       rest as fp32.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .. import quant
from ..quant import ggml, kernel

SLAB_ELEMS = 1 << 21  # elements per slab: 8 MB of fp32 rows at a time
CAST = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
KERNEL_ROWS = 64  # int4pack slabs are whole multiples of the kernel's row tiles


@dataclass
class Encoding:
    kind: str                     # "keep" | "cast" | "int4" | "int4pack" | "ggml"
    specs: dict                   # store name -> (torch dtype, shape)
    dtype: torch.dtype | None = None


def layout(unit: str, name: str, shape: tuple, src_dtype: torch.dtype, dtype: str, group_size: int,
           symmetric: bool, qtype: str | None = None) -> Encoding:
    """qtype: the source tensor's GGUF type, where its stored rows can be kept (_SourceTensor.qtype)."""
    shape = list(shape)
    if not src_dtype.is_floating_point:
        return Encoding("keep", {name: (src_dtype, shape)})
    if name.startswith("mlp.gate."):  # the MoE router stays fp32 (as transformers keeps it): routing is discrete
        return Encoding("cast", {name: (torch.float32, shape)}, torch.float32)
    if dtype in CAST:
        return Encoding("cast", {name: (CAST[dtype], shape)}, CAST[dtype])
    if dtype == "gguf":
        return _gguf_layout(name, shape, qtype)
    stem = name[: -len(".weight")]
    if unit != "embed" and dtype == "int4pack" and kernel.can_pack(name, shape, group_size):
        out, inp = shape
        return Encoding("int4pack", {stem + ".qweight": (torch.uint8, [out, inp // 2]),
                                   stem + ".scales_zeros": (torch.bfloat16, [inp // group_size, out, 2])})
    if unit != "embed" and dtype == "int4" and name.endswith(".weight") and quant.can_quantize(name, shape, group_size):
        out, inp = shape
        specs = {stem + ".qweight": (torch.uint8, [out, inp // 2]),
                 stem + ".scales": (torch.float16, [out, inp // group_size])}
        if not symmetric:
            specs[stem + ".zeros"] = (torch.float16, [out, inp // group_size])
        return Encoding("int4", specs)
    # norms and biases stay fp32 (tiny); the embedding (read by rows, or resident when small) is kept fp16
    cast = torch.float16 if unit == "embed" else torch.float32
    return Encoding("cast", {name: (cast, shape)}, cast)


def _gguf_layout(name: str, shape: list, qtype: str | None) -> Encoding:
    """The file's own precision: a matrix's blocks (the embedding's too: read by rows, runtime/embedding.py),
    an F16 / BF16 matrix in that dtype (exact in fp32); norms, biases and anything whose rows cannot be kept
    (a fix-up that is not a reordering) in fp32, as the fp32 store holds them."""
    if len(shape) == 2 and qtype in ggml.BLOCKS:
        blocks = [shape[0], ggml.row_bytes(shape[1], qtype)]
        return Encoding("ggml", {ggml.block_name(name, qtype): (torch.uint8, blocks)})
    if len(shape) == 2 and qtype in ("F16", "BF16"):
        half = torch.float16 if qtype == "F16" else torch.bfloat16
        return Encoding("cast", {name: (half, shape)}, half)
    return Encoding("cast", {name: (torch.float32, shape)}, torch.float32)


def slab_rows(shape: tuple) -> int:
    per_row = 1
    for d in shape[1:]:
        per_row *= d
    n = max(1, SLAB_ELEMS // max(per_row, 1))
    return max(KERNEL_ROWS, n // KERNEL_ROWS * KERNEL_ROWS)


def write(writer, lay: Encoding, name: str, tensor, group_size: int, symmetric: bool, search: bool = False) -> None:
    """Encode `tensor` (a _SourceTensor: shape, rows(r0, r1), qtype(), raw(r0, r1)) into `writer` by `lay`.
    search: int4pack tensors that are re-quantized get quantize_asym's shrink / refit search (a lower
    error; ~3x the time: 0.12 vs 0.04 s for 2048 x 1536 at group 32 on one core) instead of plain min/max."""
    shape = tensor.shape
    if lay.kind == "keep" or len(shape) < 2 or tensor.whole:
        pieces = [(0, shape[0] if shape else 1)]
    else:
        step = slab_rows(shape)
        pieces = [(r0, min(r0 + step, shape[0])) for r0 in range(0, shape[0], step)]
    if lay.kind == "int4pack":
        stem = name[: -len(".weight")]
        sz = torch.empty(lay.specs[stem + ".scales_zeros"][1], dtype=torch.bfloat16)  # [in/g, out, 2]
    for r0, r1 in pieces:
        if lay.kind == "keep":
            writer.write(name, tensor.rows(r0, r1))
            continue
        if lay.kind == "ggml":  # the file's blocks as they are (rows reordered where the fix-ups reorder them)
            (store_name, (_, (_, row_bytes))), = lay.specs.items()
            raw, perm = tensor.raw(r0, r1), getattr(tensor, "perm", None)
            if perm is not None:
                raw = raw[perm]
            writer.write(store_name, torch.from_numpy(np.ascontiguousarray(raw)), at=r0 * row_bytes)
            continue
        if lay.kind == "int4pack":
            qtype = tensor.qtype() if group_size == 32 else None
            if qtype in ggml.DIRECT:  # Q4_K / Q4_0 / Q4_1 blocks of 32: codes, scales and offsets kept
                u, scale, zero = ggml.DIRECT[qtype](tensor.raw(r0, r1), (r1 - r0, shape[1]))
                perm = getattr(tensor, "perm", None)
                if perm is not None:  # (read whole: rows the source's fix-ups reorder, Llama's q/k)
                    u, scale, zero = u[perm], scale[perm], zero[perm]
                u, scale, zero = torch.from_numpy(u), torch.from_numpy(scale), torch.from_numpy(zero)
            elif search:
                u, scale, zero = quant.quantize_asym(tensor.rows(r0, r1), group_size, torch.bfloat16)
            else:  # plain min/max (see `search`)
                u, scale, zero = quant.quantize_asym(tensor.rows(r0, r1), group_size, torch.bfloat16, (1.0,), 0)
            packed = kernel.pack(u, scale, zero)
            writer.write(stem + ".qweight", packed["qweight"], at=r0 * (shape[1] // 2))
            sz[:, r0:r1] = packed["scales_zeros"]
            continue
        rows = tensor.rows(r0, r1)
        if lay.kind == "cast":
            writer.write(name, rows.to(lay.dtype).contiguous(), at=r0 * _row_bytes(shape, lay.dtype))
        else:  # int4
            stem = name[: -len(".weight")]
            G = shape[1] // group_size
            if symmetric:
                q, s = quant.quantize_int4(rows.float(), group_size)
                parts = {".qweight": q, ".scales": s}
            else:
                q, s, z = quant.quantize_int4_asym(rows.float(), group_size)
                parts = {".qweight": q, ".scales": s, ".zeros": z}
            for suffix, t in parts.items():
                per_row = shape[1] // 2 if suffix == ".qweight" else G * 2
                writer.write(stem + suffix, t, at=r0 * per_row)
    if lay.kind == "int4pack":
        writer.write(stem + ".scales_zeros", sz)


def _row_bytes(shape, dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape[1:]:
        n *= d
    return n
