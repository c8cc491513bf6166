"""Packed INT4 weights that stay packed in memory and multiply through torch's int4 weight-only kernel.

Used for resident drafts (`self-int4`): 0.53 bytes per parameter in memory, and on CPU the kernel reads
~7x fewer weight bytes per token than fp32, which is what a memory-bound single-token draft step costs.
Where the kernel is missing, the weight is dequantized once and used as a plain matrix.

The kernel's cost grows with every row it multiplies (~11 us per row for a 1536 x 576 weight on 2 cores), while a
dense bf16 matmul runs on the CPU's matrix units (AMX) where it has them: 0.73 ms for 560 rows against 6.4 ms. A
weight whose `wide_rows` is set (resident drafts, see speculative/drafts.ModelDraft) dequantizes itself to bf16 for calls
of at least that many rows -- a batch of prompts entering a draft -- and multiplies densely. Targets leave it
unset: the kernel gives each row the same result whatever the batch, which their exactness relies on.
"""
from __future__ import annotations

import contextlib
import threading

import torch

from .. import quant

_CPU_KERNEL = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
# from this many rows on, dequantizing to bf16 (~0.8 ms per 1536 x 576) and a dense matmul beat the kernel
WIDE_ROWS = 128
_local = threading.local()


class PackedInt4:
    """A [out, in] weight in our store layout (qweight uint8 [out, in/2], fp16 scales and optional zero points
    [out, in/g]); w = (u - 8) * scale + zero."""

    wide_rows: int | None = None  # calls of at least this many rows dequantize and multiply densely (None: never)

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, group_size: int, dtype=torch.float32,
                 zeros: torch.Tensor | None = None):
        self.out_features, self.in_features = qweight.shape[0], qweight.shape[1] * 2
        self.group_size, self.dtype = group_size, dtype
        # the kernel's packing works on tiles of 16 output rows; other shapes use the dequantized fallback
        self.kernel = _CPU_KERNEL and qweight.device.type == "cpu" and self.out_features % 16 == 0
        if self.kernel:
            # torch's kernel wants nibble codes u in 0..15 and computes (u - 8) * scale + zero in bf16,
            # which is our formula (symmetric stores have zero = 0).
            codes = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).view(self.out_features, -1).int()
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8)
            s = scales.t().to(torch.bfloat16)  # [in/g, out]
            z = torch.zeros_like(s) if zeros is None else zeros.t().to(torch.bfloat16)
            self.scales_zeros = torch.stack([s, z], dim=-1).contiguous()  # [in/g, out, 2]
        else:
            self.weight = quant.dequantize_int4(qweight, scales, group_size, dtype=dtype, zeros=zeros)

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
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        wide = self.wide_rows is not None and x2.shape[0] >= self.wide_rows
        if wide and not getattr(_local, "kernel_only", False):
            y = torch.nn.functional.linear(x2, self.dense())
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, self.packed, self.group_size, self.scales_zeros)
        y = y.to(x.dtype).view(*shape[:-1], self.out_features)
        return y if bias is None else y + bias

    def dense(self) -> torch.Tensor:
        """The weight as a bf16 [out, in] matrix, computed from the kernel's codes and scales (~0.8 ms for
        1536 x 576 on 2 cores)."""
        from ..store.ggml_int4 import unpack_codes

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


def widen(tensors, rows: int = WIDE_ROWS) -> None:
    """Let every kernel PackedInt4 among `tensors` multiply calls of `rows` rows or more densely in bf16 (for
    weights whose outputs need not match the kernel's bit for bit: drafts). Where the kernel's code layout is
    not known here (ggml_int4.kernel_layout), weights stay on the kernel."""
    from ..store.ggml_int4 import kernel_layout

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
