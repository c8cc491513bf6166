"""Weights as the model code sees them: something `linear(x, w)` multiplies by. A plain tensor, or a weight that
computes its own matmul: PackedInt4 here, or runtime/weights.py's block-cast heads.

PackedInt4: INT4 weights that stay packed in memory (torch's int4pack layout, quant/kernel.py) and multiply through
`int4_matmul`: the 4-bit x 8-bit kernel of quant/q4q8.py where it runs here, else torch's int4 weight-only kernel.

Used for resident drafts (`self-int4`): 0.53 bytes per parameter in memory, and on CPU the kernel reads
~7x fewer weight bytes per token than fp32, which is what a memory-bound single-token draft step costs.
Where the kernel is missing, the weight is dequantized once and used as a plain matrix.

The kernel's cost grows with every row it multiplies (~11 us per row for a 1536 x 576 weight on 2 cores), while a
dense bf16 matmul runs on the CPU's matrix units (AMX) where it has them: 0.73 ms for 560 rows against 6.4 ms. A
weight whose `wide_rows` is set (resident drafts, see speculative/drafts.ModelDraft) dequantizes itself to bf16 for
calls of at least that many rows -- a batch of prompts entering a draft -- and multiplies densely. Targets leave it
unset: the kernel gives each row the same result whatever the batch, which their exactness relies on.
"""
from __future__ import annotations

import contextlib
import threading

import torch

import torch.nn.functional as F

from . import int4, q4q8
from .kernel import HAS_KERNEL, can_pack, kernel_layout, pack, unpack_codes

# from this many rows on, dequantizing to bf16 (~0.8 ms per 1536 x 576) and a dense matmul beat the kernel
DENSE_ROWS = 128
_local = threading.local()


def linear(x: torch.Tensor, weight, bias=None) -> torch.Tensor:
    """x [..., in] -> [..., out]: a plain tensor weight [out, in] by F.linear; any other weight (PackedInt4, a
    block-cast head) computes its own matmul."""
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    return weight(x, bias)


def int4_input_dtype() -> torch.dtype:
    """What `int4_matmul` takes x in: fp32 for the 4-bit x 8-bit kernel (q4q8.py, which quantizes it), else bf16
    (torch's int4 kernel)."""
    return torch.float32 if q4q8.available() else torch.bfloat16


def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, group_size: int, scales_zeros: torch.Tensor) -> torch.Tensor:
    """x [M, K] in int4_input_dtype() -> x @ W^T [M, N] for an int4pack weight: on q4q8's kernel where it runs
    here (fp32 out), else torch's int4 kernel (bf16 out). One process uses one of them throughout, so plain and
    speculative decoding multiply alike."""
    if x.dtype == torch.float32 and x.device.type == "cpu":
        return q4q8.mm(x, qweight, scales_zeros, group_size)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, qweight, group_size, scales_zeros)


def row_invariant(weight) -> bool:
    """Whether `weight` gives each row the same result whatever else the call carries: a PackedInt4 on its kernel
    (q4q8 or torch's int4) that never goes dense for wide calls, or an int8.PackedInt8 (fp32 matmuls are not
    exactly; a widened draft weight is not)."""
    return getattr(weight, "kernel", False) and getattr(weight, "wide_rows", None) is None


class PackedInt4:
    """A [out, in] weight in our store layout (qweight uint8 [out, in/2], fp16 scales and optional zero points
    [out, in/g]); w = (u - 8) * scale + zero."""

    wide_rows: int | None = None  # calls of at least this many rows dequantize and multiply densely (None: never)

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, dtype=torch.float32,
                 zeros: torch.Tensor | None = None):
        self.out_features, self.in_features = qweight.shape[0], qweight.shape[1] * 2
        self.group_size, self.dtype = group_size, dtype
        # the kernel's packing works on tiles of 16 output rows; other shapes use the dequantized fallback
        self.kernel = HAS_KERNEL and qweight.device.type == "cpu" and self.out_features % 16 == 0
        if self.kernel:
            # torch's kernel wants nibble codes u in 0..15 and computes (u - 8) * scale + zero in bf16,
            # which is our formula (symmetric stores have zero = 0).
            codes = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).view(self.out_features, -1).int()
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8)
            s = scales.t().to(torch.bfloat16)  # [in/g, out]
            z = torch.zeros_like(s) if zeros is None else zeros.t().to(torch.bfloat16)
            self.scales_zeros = torch.stack([s, z], dim=-1).contiguous()  # [in/g, out, 2]
        else:
            self.weight = int4.dequantize_int4(qweight, scales, group_size, dtype=dtype, zeros=zeros)

    @classmethod
    def from_packed(cls, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> "PackedInt4":
        """A weight already in the kernel's layout (an `int4pack` store's qweight [out, in/2] uint8 and
        scales_zeros bf16 [in/g, out, 2], views of the read buffer): nothing to compute before the matmul."""
        self = cls.__new__(cls)
        self.out_features, self.in_features = scales_zeros.shape[1], packed.shape[1] * 2
        self.group_size, self.dtype, self.kernel = group_size, torch.float32, True
        self.packed, self.scales_zeros = packed, scales_zeros
        return self

    @classmethod
    def cat(cls, parts: list["PackedInt4"]) -> "PackedInt4 | None":
        """One weight whose output rows are the parts' in order, or None where that cannot be had exactly.
        The kernel packs output rows in blocks (of 64 on AVX512); parts that are whole blocks of kernel weights
        with one group size and input width join by concatenation, and each output is then computed from the
        same codes and scales as before: the parts' outputs bit for bit, which is checked here on one random
        row, in one call instead of several (a resident draft's single-row forward is mostly per-call cost)."""
        first = parts[0]
        if not all(p.kernel and p.group_size == first.group_size and p.in_features == first.in_features
                   and p.out_features % 64 == 0 for p in parts):
            return None
        joined = cls.from_packed(torch.cat([p.packed for p in parts]),
                                 torch.cat([p.scales_zeros for p in parts], dim=1).contiguous(), first.group_size)
        x = torch.randn(1, first.in_features, generator=torch.Generator().manual_seed(0))
        return joined if torch.equal(joined(x), torch.cat([p(x) for p in parts], dim=-1)) else None

    @property
    def nbytes(self) -> int:
        if self.kernel:
            return self.packed.numel() * self.packed.element_size() + self.scales_zeros.numel() * 2
        return self.weight.numel() * self.weight.element_size()

    def __call__(self, x: torch.Tensor, bias=None) -> torch.Tensor:
        if not self.kernel:
            return torch.nn.functional.linear(x, self.weight, bias)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        wide = self.wide_rows is not None and x2.shape[0] >= self.wide_rows
        if wide and not getattr(_local, "kernel_only", False):
            y = torch.nn.functional.linear(x2.to(torch.bfloat16), self.dense())
        else:
            y = int4_matmul(x2.to(int4_input_dtype()), self.packed, self.group_size, self.scales_zeros)
        y = y.to(x.dtype).view(*shape[:-1], self.out_features)
        return y if bias is None else y + bias

    def dense(self) -> torch.Tensor:
        """The weight as a bf16 [out, in] matrix, computed from the kernel's codes and scales (~0.8 ms for
        1536 x 576 on 2 cores)."""
        n, k, g = self.out_features, self.in_features, self.group_size
        u = torch.from_numpy(unpack_codes(self.packed, k)).view(n, k // g, g).to(torch.bfloat16)
        s, z = self.scales_zeros[..., 0].t().unsqueeze(-1), self.scales_zeros[..., 1].t().unsqueeze(-1)  # [out, G, 1]
        return ((u - 8) * s + z).view(n, k)


# torch's CPU kernel multiplies rows in blocks of 4: a 5-row call costs about what an 8-row one does (SmolLM2
# self-int4 draft forwards, 2 threads: 1 row 8.2 ms, 4 rows 11.8, 5 rows 18.5, 8 rows 19.4, 9 rows 26.2)
KERNEL_ROW_BLOCK = 4


def row_block(tensors) -> int:
    """The row block a model's forward pays by: KERNEL_ROW_BLOCK when any of `tensors` multiplies through the CPU
    kernel, else 1."""
    return KERNEL_ROW_BLOCK if any(isinstance(t, PackedInt4) and t.kernel for t in tensors) else 1


def widen(tensors, rows: int = DENSE_ROWS) -> None:
    """Let every kernel PackedInt4 among `tensors` multiply calls of `rows` rows or more densely in bf16 (for
    weights whose outputs need not match the kernel's bit for bit: drafts). Where the kernel's code layout is
    not known here (kernel.kernel_layout), weights stay on the kernel."""
    if kernel_layout() is None:
        return
    for t in tensors:
        if isinstance(t, PackedInt4) and t.kernel:
            t.wide_rows = rows


@contextlib.contextmanager
def kernel_only(on: bool = True):
    """Within it (on True), PackedInt4 calls made by this thread stay on the kernel whatever their wide_rows: each
    row's result is then the same whatever else the call carries. Sampled drafting needs that: its seeded draws
    depend on the draft's probabilities bit for bit, and a request's tokens must not depend on its batch."""
    before = getattr(_local, "kernel_only", False)
    _local.kernel_only = before or on
    try:
        yield
    finally:
        _local.kernel_only = before


# ---- joining, splitting and copying weights (a resident layer's fused projections: models/llama.fuse) --------

def join_rows(parts: list):
    """One weight whose outputs are the parts' concatenated, bit for bit (PackedInt4.cat), or None where that cannot
    be had (a part that is not a PackedInt4 on the kernel, mismatched groups, rows not in whole kernel blocks)."""
    if not all(isinstance(p, PackedInt4) for p in parts):
        return None
    return PackedInt4.cat(parts)


def split_rows(weight: PackedInt4, sizes: list[int]) -> list[PackedInt4]:
    """The inverse of join_rows: the parts of `sizes` output rows, as copies (the kernel reads its scales as a
    contiguous [groups, rows, 2] array)."""
    return [PackedInt4.from_packed(q.contiguous(), sz.contiguous(), weight.group_size)
            for q, sz in zip(weight.packed.split(sizes), weight.scales_zeros.split(sizes, dim=1))]


def owned(weight):
    """A copy that holds its own memory (so a read buffer the weight was a view of can go); weights that own
    theirs already (a dequantized PackedInt4, a block-cast head) come back as they are."""
    if isinstance(weight, PackedInt4) and weight.kernel:
        return PackedInt4.from_packed(weight.packed.clone(), weight.scales_zeros.clone(), weight.group_size)
    return weight.clone() if isinstance(weight, torch.Tensor) else weight


def nbytes(weight) -> int:
    """Bytes a weight holds: a tensor's, a PackedInt4's codes and scales, a gguf head's blocks (GGMLMatrix),
    nothing for a view of another's table (EmbeddingRows)."""
    if isinstance(weight, PackedInt4):
        return weight.nbytes
    if isinstance(weight, torch.Tensor):
        return weight.numel() * weight.element_size()
    return getattr(weight, "nbytes", 0)


# ---- float weights -> resident 4-bit ones (self-int4 drafts built in memory) -----------------------------------

def packable(name: str, t, group_size: int, kernel: bool) -> bool:
    """Which matrices a resident draft holds in 4 bits: with the CPU kernel, exactly those the converter packs into
    an int4pack store (kernel.can_pack, as store/encode.layout), so a draft built in memory equals one converted
    from the same values."""
    if not (isinstance(t, torch.Tensor) and t.is_floating_point()) or name.startswith("mlp.gate."):
        return False  # (a MoE router, "mlp.gate.weight", stays exact: its choices are discrete)
    if kernel:
        return can_pack(name, t.shape, group_size)
    return name.endswith(".weight") and int4.can_quantize(name, t.shape, group_size)


def quantize(t: torch.Tensor, group_size: int, kernel: bool, dtype) -> PackedInt4:
    """One matrix -> 4 bits, by quantize_asym. CPU kernel: bf16 scale and zero (as an int4pack store holds them),
    packed straight into the kernel's layout; else the int4 store's fp16 form, dequantized once (PackedInt4)."""
    if kernel:
        p = pack(*int4.quantize_asym(t, group_size, torch.bfloat16))
        return PackedInt4.from_packed(p["qweight"], p["scales_zeros"], group_size)
    q, s, z = int4.quantize_int4_asym(t.float(), group_size)
    return PackedInt4(q, s, group_size, dtype, zeros=z)


def quantize_table(table, group_size: int, kernel: bool, dtype) -> PackedInt4:
    """A (tied) embedding table as a 4-bit head, a slab of rows at a time when it is read by rows (EmbeddingRows:
    a big vocabulary is never whole in fp32)."""
    if isinstance(table, torch.Tensor) or not kernel:
        t = table if isinstance(table, torch.Tensor) else table[torch.arange(table.shape[0])]
        return quantize(t, group_size, kernel, dtype)
    n, k = table.shape
    u = torch.empty(n, k, dtype=torch.uint8)
    s, z = torch.empty(n, k // group_size), torch.empty(n, k // group_size)
    step = max(64, (1 << 22) // k // 64 * 64)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        u[r0:r1], s[r0:r1], z[r0:r1] = int4.quantize_asym(table[torch.arange(r0, r1)], group_size, torch.bfloat16)
    p = pack(u, s, z)
    return PackedInt4.from_packed(p["qweight"], p["scales_zeros"], group_size)


def quantize_unit(w: dict, group_size: int, kernel: bool, dtype) -> tuple[dict, int]:
    """One unit's weights with every packable matrix as a PackedInt4 and the rest copied (so the read buffer and
    any fp32 copy can go) -> (weights, bytes held)."""
    out, total = {}, 0
    for k, t in w.items():
        if isinstance(t, PackedInt4):  # an int4pack target's weights are 4-bit already
            out[k] = t
        elif packable(k, t, group_size, kernel):
            out[k] = quantize(t, group_size, kernel, dtype)
        else:
            out[k] = t.clone()
        total += nbytes(out[k])
    return out, total
