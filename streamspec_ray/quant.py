"""INT4 block quantization of linear weights, for streaming layers at 4 bits.

Two schemes share one layout. Symmetric (below): w ~= q * s. Asymmetric (quantize_int4_asym): each group
also gets an fp16 zero point z, w ~= (u - 8) * s + z, which fits skewed groups far better (0.5625 bytes
per parameter). On SmolLM2 the asymmetric copy is the one good enough to serve as a draft.

A weight W [out, in] is cut along the input dimension into groups of GROUP_SIZE (64)
consecutive values. Each group gets one fp16 scale s = absmax / 7 and its values are
stored as q = clamp(round(w / s), -8, 7), i.e. w ~= q * s.

Layout:
  qweight  uint8   [out, in // 2]           two 4-bit codes per byte, code u = q + 8 in 0..15;
                                            low nibble = even column, high nibble = odd column
  scales   float16 [out, in // group_size]  scale of columns [g * group_size, (g + 1) * group_size)

Cost per parameter: 0.5 byte of codes + 2 bytes / 64 of scale = 0.53125 bytes
(vs 2 for fp16: a 73% cut). The scale is computed in fp32, rounded to fp16 (upwards, so
|w / s| <= 7 always holds and the error is <= s / 2 per element), and the codes are computed
with that fp16 scale, so dequantize_int4 reproduces exactly what quantize_int4 meant.
All-zero groups get scale 1 (codes all 8), which dequantize to exact zeros.
"""
from __future__ import annotations

import torch

GROUP_SIZE = 64
FP16_MAX = 65504.0


def _fp16_scale_up(s: torch.Tensor) -> torch.Tensor:
    """fp32 scales -> the smallest fp16 values >= them (saturating at fp16 max)."""
    s = s.clamp(max=FP16_MAX)
    s16 = s.to(torch.float16)
    low = s16.float() < s  # rounded down: step to the next fp16 (positive bits are monotone)
    bumped = (s16.view(torch.int16) + 1).view(torch.float16)
    return torch.where(low, bumped, s16)


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] float -> (qweight uint8 [out, in // 2], scales float16 [out, in // group_size])."""
    assert weight.dim() == 2, f"expected a 2-D weight, got shape {tuple(weight.shape)}"
    out, inp = weight.shape
    assert inp % group_size == 0 and inp % 2 == 0, f"in={inp} must be even and divisible by {group_size}"
    w = weight.detach().float().reshape(out, inp // group_size, group_size)  # [out, G, g]
    absmax = w.abs().amax(dim=-1)                                           # [out, G]
    scales = _fp16_scale_up(absmax / 7)                                     # [out, G] fp16
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)     # zero groups: s = 1
    q = torch.round(w / scales.float()[..., None]).clamp_(-8, 7)           # [out, G, g] in -8..7
    u = (q + 8).to(torch.uint8).reshape(out, inp // 2, 2)                   # [out, in/2, 2] in 0..15
    qweight = u[..., 0] | (u[..., 1] << 4)                                  # [out, in/2] even | odd << 4
    return qweight.contiguous(), scales.contiguous()


def quantize_int4_asym(weight: torch.Tensor, group_size: int = GROUP_SIZE,
                       shrink: tuple[float, ...] = (0.0, 0.05, 0.1, 0.15, 0.2), refine: int = 4):
    """weight [out, in] -> (qweight uint8 [out, in // 2], scales fp16 [out, G], zeros fp16 [out, G]).

    Each group maps [lo, hi] onto the 16 codes: s = (hi - lo) / 15, z = lo + 8 s, so w ~= (u - 8) s + z.
    lo and hi start at the group's min and max; a few shrunk ranges are tried (clipping a rare outlier often
    lowers the group's squared error) and the best one per group is kept, then refined by alternating
    least-squares fits of (s, z) and re-rounding of the codes."""
    assert weight.dim() == 2, f"expected a 2-D weight, got shape {tuple(weight.shape)}"
    out, inp = weight.shape
    assert inp % group_size == 0 and inp % 2 == 0, f"in={inp} must be even and divisible by {group_size}"
    w = weight.detach().float().reshape(out, inp // group_size, group_size)  # [out, G, g]
    lo0, hi0 = w.amin(-1), w.amax(-1)                                       # [out, G]
    best = None
    for f in shrink:
        lo, hi = lo0 * (1 - f), hi0 * (1 - f)
        s = ((hi - lo) / 15).to(torch.float16)
        s = torch.where(s == 0, torch.ones_like(s), s)                      # constant groups: any s works
        z = (lo + 8 * s.float()).to(torch.float16)
        u = torch.round((w - z.float()[..., None]) / s.float()[..., None] + 8).clamp_(0, 15)  # [out, G, g]
        err = ((u - 8) * s.float()[..., None] + z.float()[..., None] - w).pow(2).sum(-1)     # [out, G]
        if best is None:
            best = [u, s, z, err]
        else:
            m = err < best[3]
            best = [torch.where(m[..., None], u, best[0]), torch.where(m, s, best[1]),
                    torch.where(m, z, best[2]), torch.where(m, err, best[3])]
    u, s, z = best[0], best[1], best[2]
    for _ in range(refine):
        # alternate: with the codes fixed, (s, z) is a per-group least-squares line fit w ~ (u - 8) s + z;
        # then re-round the codes under the new line. Each step lowers the group's squared error.
        x = u - 8                                                             # [out, G, g]
        mx, mw = x.mean(-1), w.mean(-1)
        var = (x - mx[..., None]).pow(2).mean(-1)
        cov = ((x - mx[..., None]) * (w - mw[..., None])).mean(-1)
        s_new = torch.where(var > 0, cov / var.clamp(min=1e-12), s.float())
        s_new = torch.where(s_new.abs() > 0, s_new, s.float()).to(torch.float16)
        z_new = (mw - s_new.float() * mx).to(torch.float16)
        u_new = torch.round((w - z_new.float()[..., None]) / s_new.float()[..., None] + 8).clamp_(0, 15)
        err = ((u_new - 8) * s_new.float()[..., None] + z_new.float()[..., None] - w).pow(2).sum(-1)
        m = err < best[3]
        u = torch.where(m[..., None], u_new, u)
        s, z, best[3] = torch.where(m, s_new, s), torch.where(m, z_new, z), torch.where(m, err, best[3])
    u = u.to(torch.uint8).reshape(out, inp // 2, 2)
    return (u[..., 0] | (u[..., 1] << 4)).contiguous(), s.contiguous(), z.contiguous()


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, group_size: int = GROUP_SIZE,
                    dtype: torch.dtype = torch.float32, zeros: torch.Tensor | None = None) -> torch.Tensor:
    """(qweight uint8 [out, in // 2], scales fp16 [out, in // group_size], zeros fp16 [out, G] or None)
    -> weight [out, in] of `dtype`."""
    out, half = qweight.shape
    cdt = torch.float64 if dtype == torch.float64 else torch.float32         # multiply in >= fp32
    u = torch.stack((qweight & 0x0F, qweight >> 4), dim=-1)                  # [out, in/2, 2] uint8
    q = u.reshape(out, -1, group_size).to(cdt) - 8                           # [out, G, g] in -8..7
    w = q * scales.to(cdt)[..., None]                                        # [out, G, g]
    if zeros is not None:
        w = w + zeros.to(cdt)[..., None]
    return w.reshape(out, 2 * half).to(dtype)                                # [out, in]


def can_quantize(name: str, shape, group_size: int = GROUP_SIZE) -> bool:
    """True for 2-D weights whose input dim is even and a multiple of group_size; never norms or biases."""
    shape = tuple(shape)
    if len(shape) != 2:
        return False
    lname = name.lower()
    if "norm" in lname or lname.endswith("bias"):
        return False
    inp = shape[1]
    return inp > 0 and inp % group_size == 0 and inp % 2 == 0


@torch.no_grad()
def quant_report(weight: torch.Tensor, group_size: int = GROUP_SIZE, symmetric: bool = True) -> dict:
    """Round-trip one weight; returns {"cosine", "max_abs_err", "bytes_per_param"}."""
    if symmetric:
        (qweight, scales), zeros = quantize_int4(weight, group_size), None
    else:
        qweight, scales, zeros = quantize_int4_asym(weight, group_size)
    w = weight.detach().double()
    wd = dequantize_int4(qweight, scales, group_size, dtype=torch.float64, zeros=zeros)
    cos = torch.nn.functional.cosine_similarity(w.flatten(), wd.flatten(), dim=0, eps=1e-30)
    nbytes = qweight.numel() * qweight.element_size() + scales.numel() * scales.element_size()
    nbytes += 0 if zeros is None else zeros.numel() * zeros.element_size()
    return {
        "cosine": float(cos),
        "max_abs_err": float((w - wd).abs().max()),
        "bytes_per_param": nbytes / weight.numel(),
    }
