"""PackedInt8: a resident weight that multiplies a sweep's rows on the CPU's int8 dot-product units.

Why
---
torch's int4 kernel (kernel.py) dequantizes its weight again for every block of 4 rows of x, so a verify sweep of
~10 rows costs ~5x one row: on the real pair (Qwen2.5-Coder-1.5B, one layer's q/k/v, o, gate/up and down, 2 threads,
this VM, each matrix called repeatedly) 6.9 ms a layer at 10 rows against 1.45 at one. fbgemm's int8 GEMM (torch's
`quantized.linear_dynamic`: VNNI / AVX512 / AVX2 dot products on uint8 x int8) reads its packed weight once per
call: 3.7 ms at 10 rows, 1.7 at one, in this module's form. But its weights are twice the int4 bytes: inside the
model, where no layer's weights stay in the CPU's caches between calls, one row took ~2.5 ms a layer and 8 rows
~4.0 (memory-bound), and converting the real pair's held units took 20-35 s. So it is an opt-in for a target held
whole (runtime/executor.py StreamingExecutor._int8, STREAMSPEC_INT8=1), not the default.

The numbers (what the model computes)
-------------------------------------
Weight: the int4 weight's own values (kernel.dequantize, fp32) rounded to int8 with one scale per output row,
    W[n, k] ~= q[n, k] * ws[n],   ws[n] = max_k |W[n, k]| / 127.
Activations: each row of x on its own scale, rounded to 8 bits,
    x[m, k] ~= a[m, k] * xs[m],   xs[m] = max_k |x[m, k]| / 127,
and y[m, n] = xs[m] * ws[n] * sum_k a[m, k] q[n, k], the sum exact in int32.

Why each row on its own: a verify sweep must give a row the same bits whatever else the sweep carries (the
speculative output equals plain decoding token for token only then). fbgemm picks one scale and zero point for the
whole of x from its range, which other rows would move. So each row is scaled here to span exactly [-127, 127]
(clamped: the division can land an ulp past), and a sentinel row holding -127 and 127 joins the call: x's range is
then [-127, 127] whatever the rows, fbgemm's quantization parameters are constants, every element is quantized
alone, the integer sums are exact, and the output scaling is per element. Checked bit for bit for every row and
prefix up to 17 rows in tests/test_int8.py. The sentinel costs one row (~0.05 ms a layer).

Error: ~1.1% relative on a gaussian matmul (weights and activations both at 8 bits); a row with an outlier channel
quantizes its other channels coarsely (per-row scales), which is the risk of W8A8 on LLMs with outlier features.
On the real pair, teacher-forced over the file's own fp32 greedy text (6 prompts, 499 tokens), the int8-held target
picks the same top-1 token at 486 positions where the int4 kernel does at 488.
"""
from __future__ import annotations

import warnings

import torch

from .kernel import dequantize, unpack_codes
from .packed import PackedInt4

HAS_INT8 = "fbgemm" in torch.backends.quantized.supported_engines or "x86" in torch.backends.quantized.supported_engines
LEVEL = 127.0


def _to_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [out, in] -> (int8 codes, fp32 scale per output row): w ~= q * scale."""
    scale = (w.abs().amax(1) / LEVEL).clamp_min(1e-12)
    return (w / scale[:, None]).round_().clamp_(-LEVEL, LEVEL).to(torch.int8), scale


class PackedInt8:
    """A [out, in] weight as fbgemm's packed int8 (one scale per output row), multiplying rows quantized one by one
    (see the module docstring). Row-invariant: a row's result does not depend on the call's other rows."""

    kernel = True          # (packed.row_invariant: a row's bits do not depend on its batch)
    wide_rows = None

    def __init__(self, w: torch.Tensor):
        """From a float [out, in] weight."""
        self._pack(*_to_int8(w.float()))

    def _pack(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        self.out_features, self.in_features = q.shape
        with warnings.catch_warnings():  # (quantized tensors are deprecated as a public type; fbgemm still takes them)
            warnings.simplefilter("ignore")
            qw = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0)
        self.packed = torch.ops.quantized.linear_prepack(qw, None)
        self.nbytes = q.numel() + 4 * self.out_features
        self._sentinel = torch.full((self.in_features,), LEVEL)
        self._sentinel[1::2] = -LEVEL

    @classmethod
    def from_int4(cls, w, slab_bytes: int = 64 << 20) -> "PackedInt8":
        """From a kernel PackedInt4: its exact fp32 values ((u - 8) * scale + zero on its bf16 scale and zero),
        a slab of rows at a time, so a big head (the real pair's 151,936 rows) never stands whole in fp32."""
        n, k = w.out_features, w.in_features
        u = unpack_codes(w.packed, k)
        q, scale = torch.empty(n, k, dtype=torch.int8), torch.empty(n)
        step = max(1, slab_bytes // (4 * k))
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            sz = w.scales_zeros[:, r0:r1].float().numpy()  # [groups, rows, (scale, zero)]
            q[r0:r1], scale[r0:r1] = _to_int8(torch.from_numpy(dequantize(u[r0:r1], sz[..., 0].T, sz[..., 1].T)))
        self = cls.__new__(cls)
        self._pack(q, scale)
        return self

    def __call__(self, x: torch.Tensor, bias=None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).float()
        xs = x2.abs().amax(1, keepdim=True).clamp_min_(1e-30) / LEVEL
        m = x2.shape[0]
        a = torch.empty(m + 1, self.in_features)
        torch.div(x2, xs, out=a[:m]).clamp_(-LEVEL, LEVEL)
        a[m] = self._sentinel
        y = torch.ops.quantized.linear_dynamic(a, self.packed, False)[:-1].mul_(xs)
        y = y.to(x.dtype).view(*shape[:-1], self.out_features)
        return y if bias is None else y + bias


def as_int8(weights: dict) -> tuple[dict, int]:
    """A held unit's weights with every kernel PackedInt4 as a PackedInt8 -> (weights, bytes added)."""
    out, added = {}, 0
    for name, t in weights.items():
        if isinstance(t, PackedInt4) and t.kernel:
            out[name] = PackedInt8.from_int4(t)
            added += out[name].nbytes - t.nbytes
        else:
            out[name] = t
    return out, added
