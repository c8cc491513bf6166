"""INT4 group quantization of linear weights: the one asymmetric quantizer and the `int4` store's layout.

A weight W [out, in] is cut along the input dimension into groups of `group_size` consecutive values; each group
gets a scale s and (asymmetric) a zero z, and each value a 4-bit code u in 0..15: w ~= (u - 8) s + z.

`quantize_asym` is the quantizer every asymmetric 4-bit weight in this project comes from. Its scale dtype names
the stored format it writes for:
  float16   the `int4` store (qweight + fp16 scales + fp16 zeros: `quantize_int4_asym`), and resident drafts
            without torch's CPU int4 kernel;
  bfloat16  torch's CPU int4 kernel (`int4pack` stores, self-int4 drafts: quant/kernel.py packs the codes),
            whose scales_zeros are bf16.
Both search the same way: a few shrunk ranges per group, then rounds of a least-squares refit of (s, z) to the
codes, each candidate's codes rounded under its already-rounded (s, z) and kept per group where its error is
lowest. The two formats' stores were written with slightly different arithmetic (the fp16 one shrinks ranges
towards 0, divides by s and ranks by the squared error; the bf16 one shrinks about the range's middle, multiplies
by 1 / s, ranks by the error's norm, and refits with s > 0 kept), and a refactor must not change stored bytes, so
each format keeps its own arithmetic (`_Fp16Rules`, `_Bf16Rules`) inside the one search loop (`_search`).

The `int4` store's layout:
  qweight  uint8   [out, in // 2]           two codes per byte: low nibble = even column, high = odd column
  scales   float16 [out, in // group_size]  (symmetric: s = absmax / 7 rounded up to fp16, z = 0)
  zeros    float16 [out, in // group_size]  (asymmetric only)
Cost per parameter: 0.5 byte of codes + 2 (or 4) bytes / 64 = 0.53125 (0.5625) bytes, vs 2 for fp16.
Symmetric: the scale is rounded up to fp16 so |w / s| <= 7 always holds and each error is <= s / 2; the codes are
computed with that fp16 scale, so dequantize_int4 reproduces exactly what quantize_int4 meant; all-zero groups get
scale 1 (codes all 8), which dequantize to exact zeros. On SmolLM2 the asymmetric copy is the one good enough to
serve as a draft.
"""
from __future__ import annotations

import torch

GROUP_SIZE = 64
FP16_MAX = 65504.0
_SLAB = 1 << 18  # elements per slab in the search (keeps temporaries in cache whatever the tensor's size)


def _fp16_scale_up(s: torch.Tensor) -> torch.Tensor:
    """fp32 scales -> the smallest fp16 values >= them (saturating at fp16 max)."""
    s = s.clamp(max=FP16_MAX)
    s16 = s.to(torch.float16)
    low = s16.float() < s  # rounded down: step to the next fp16 (positive bits are monotone)
    bumped = (s16.view(torch.int16) + 1).view(torch.float16)
    return torch.where(low, bumped, s16)


def _check(weight: torch.Tensor, group_size: int) -> None:
    assert weight.dim() == 2, f"expected a 2-D weight, got shape {tuple(weight.shape)}"
    inp = weight.shape[1]
    assert inp % group_size == 0 and inp % 2 == 0, f"in={inp} must be even and divisible by {group_size}"


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """codes uint8 [out, in] in 0..15 -> qweight uint8 [out, in // 2] (even column | odd column << 4)."""
    u = u.to(torch.uint8).reshape(u.shape[0], -1, 2)                        # [out, in/2, 2]
    return (u[..., 0] | (u[..., 1] << 4)).contiguous()


def quantize_int4(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] float -> (qweight uint8 [out, in // 2], scales float16 [out, in // group_size])."""
    _check(weight, group_size)
    out, inp = weight.shape
    w = weight.detach().float().reshape(out, inp // group_size, group_size)  # [out, G, g]
    absmax = w.abs().amax(dim=-1)                                           # [out, G]
    scales = _fp16_scale_up(absmax / 7)                                     # [out, G] fp16
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)     # zero groups: s = 1
    q = torch.round(w / scales.float()[..., None]).clamp_(-8, 7)           # [out, G, g] in -8..7
    return pack_nibbles((q + 8).reshape(out, inp)), scales.contiguous()


# ---- the asymmetric quantizer -------------------------------------------------------------------------------

class _Fp16Rules:
    """The `int4` store's arithmetic: ranges [c lo, c hi] (shrunk towards 0), codes by division, squared error."""
    dtype, shrink, refine = torch.float16, (1.0, 0.95, 0.9, 0.85, 0.8), 4

    def round(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype).float()

    def ranges(self, w, shrink):
        lo0, hi0 = w.amin(-1), w.amax(-1)                                   # [R, G]
        for c in shrink:
            lo, hi = lo0 * c, hi0 * c
            s = self.round((hi - lo) / 15)
            s = torch.where(s == 0, torch.ones_like(s), s)                  # constant groups: any s works
            yield s, self.round(lo + 8 * s)

    def codes(self, w, s, z):
        """-> (q [R, G, g] in -8..7, error [R, G]) under (s, z) [R, G]."""
        q = torch.round((w - z[..., None]) / s[..., None] + 8).clamp_(0, 15) - 8
        return q, (q * s[..., None] + z[..., None] - w).pow(2).sum(-1)

    def refit(self, w, q, s):
        mx, mw = q.mean(-1), w.mean(-1)
        var = (q - mx[..., None]).pow(2).mean(-1)
        cov = ((q - mx[..., None]) * (w - mw[..., None])).mean(-1)
        s_new = torch.where(var > 0, cov / var.clamp(min=1e-12), s)
        s_new = self.round(torch.where(s_new.abs() > 0, s_new, s))
        return s_new, self.round(mw - s_new * mx)

    def finish(self, w, q, s, z):
        return q, s, z


class _Bf16Rules(_Fp16Rules):
    """The kernel's arithmetic: ranges shrunk about their middle, codes by 1 / s, the error's norm; a constant group
    c gets z = bf16(c) and the residual in s with u = 9 (exact when c - bf16(c) is a bf16 value: 0, any bf16, fp16
    or small-integer value; else within ~|c| 2^-17)."""
    dtype, shrink, refine = torch.bfloat16, (1.0, 0.95, 0.9), 2

    def ranges(self, w, shrink):
        lo, hi = torch.aminmax(w, dim=-1)
        mid, half = (lo + hi) * 0.5, (hi - lo) * 0.5
        for f in shrink:
            s = self.round(half * (2 * f / 15))                    # the range [mid - f half, mid + f half] / 15
            yield s, self.round(mid - half * f + 8 * s)            # z - 8 s ~ the range's low end

    def codes(self, w, s, z):
        inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
        q = torch.sub(w, z[..., None]).mul_(inv[..., None]).round_().clamp_(-8, 7)
        e = torch.addcmul(z[..., None], q, s[..., None]).sub_(w)   # (u - 8) s + z - w, as the kernel rounds
        return q, torch.linalg.vector_norm(e, dim=-1)              # (ordering only, like the squared sum)

    def refit(self, w, q, s):
        mq = q.mean(-1)
        qc = q - mq[..., None]
        var, cov = qc.square().mean(-1), (qc * w).mean(-1)
        s_ls = self.round(torch.where(var > 0, cov / var.clamp(min=1e-30), s))
        s_ls = torch.where(s_ls > 0, s_ls, s)
        return s_ls, self.round(w.mean(-1) - s_ls * mq)

    def finish(self, w, q, s, z):
        lo, hi = torch.aminmax(w, dim=-1)
        const = (hi - lo) * 0.5 == 0
        if bool(const.any()):
            z = torch.where(const, self.round(lo), z)
            r = self.round(lo - z)
            s = torch.where(const, r, s)
            q = torch.where(const[..., None], (r != 0).float()[..., None].expand_as(q), q)
        return q, s, z


RULES = {torch.float16: _Fp16Rules(), torch.bfloat16: _Bf16Rules()}


def _search(w: torch.Tensor, rules, shrink, refine: int):
    """w [R, G, g] fp32 -> (q [R, G, g] fp32 in -8..7, s [R, G], z [R, G]): per group the candidate (s, z) with the
    lowest error among the shrunk ranges and the least-squares refits."""
    best = []
    for s, z in rules.ranges(w, shrink):
        _offer(best, w, rules, s, z)
    for _ in range(refine):
        # with the codes fixed, (s, z) is a per-group least-squares line fit w ~ q s + z; then the codes are
        # re-rounded under the new line. A refit is kept only where it lowers the group's error.
        _offer(best, w, rules, *rules.refit(w, best[0], best[1]))
    return rules.finish(w, *best[:3])


def _offer(best: list, w, rules, s, z) -> None:
    q, err = rules.codes(w, s, z)
    if not best:
        best[:] = [q, s, z, err]
        return
    m = err < best[3]
    best[:] = [torch.where(m[..., None], q, best[0]), torch.where(m, s, best[1]), torch.where(m, z, best[2]),
               torch.where(m, err, best[3])]


def quantize_asym(weight, group_size: int = GROUP_SIZE, scale_dtype: torch.dtype = torch.float16,
                  shrink=None, refine: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (u uint8 [N, K] in 0..15, scale fp32 [N, K/g], zero fp32 [N, K/g]),
    w ~= (u - 8) * scale + zero, with scale and zero already rounded to `scale_dtype` (fp16 or bf16; held as fp32).

      * each group's range [min, max] is mapped onto the 16 codes (scale = (max - min) / 15, zero = min + 8 scale),
        and also tried shrunk by each factor in `shrink` (clipping a lone outlier often lowers the group's error);
      * `refine` rounds of a least-squares refit of (scale, zero) to the codes, then re-rounding the codes;
      * per group the candidate with the lowest error is kept, so the result is never worse than plain min/max.

    Every candidate's codes and error are computed under its rounded (scale, zero), so (u - 8) * scale + zero is
    exactly what a dequantization (or the kernel) multiplies. shrink / refine default to the format's own
    (`RULES`); bf16 with shrink=(1.0,), refine=0 is plain min/max: every element within scale / 2 of its value,
    plus the bf16 rounding of scale and zero (<= 2^-9 (8 scale + |zero|)). Relative RMS error on Qwen2.5-1.5B's
    Q6_K ffn_down (bf16): 7.90e-2 plain -> 7.35e-2 default at group 32 (9.07e-2 -> 8.52e-2 at 64), for ~0.3 s
    per 8960 x 1536 tensor on 2 cores (0.07 s plain). Rows are processed in slabs, so memory stays ~3 copies of
    a 256k-element slab whatever the tensor's size."""
    rules = RULES[scale_dtype]
    shrink = rules.shrink if shrink is None else shrink
    refine = rules.refine if refine is None else refine
    w = torch.as_tensor(weight).detach().float()
    if w.dim() != 2 or w.shape[1] % group_size:
        raise ValueError(f"a [N, K] weight with K a multiple of group_size={group_size}, not {tuple(w.shape)}")
    n, k = w.shape
    g = k // group_size
    u, scale, zero = torch.empty(n, k, dtype=torch.uint8), torch.empty(n, g), torch.empty(n, g)
    rows = max(1, _SLAB // k)
    with torch.no_grad():
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            q, s, z = _search(w[r0:r1].reshape(r1 - r0, g, group_size), rules, shrink, refine)
            u[r0:r1] = q.add_(8).reshape(r1 - r0, k).to(torch.uint8)
            scale[r0:r1], zero[r0:r1] = s, z
    return u, scale, zero


def quantize_int4_asym(weight: torch.Tensor, group_size: int = GROUP_SIZE):
    """weight [out, in] -> the `int4` store's asymmetric tensors (qweight uint8 [out, in // 2], scales fp16
    [out, G], zeros fp16 [out, G]): quantize_asym at fp16."""
    _check(weight, group_size)
    u, s, z = quantize_asym(weight, group_size, torch.float16)
    return pack_nibbles(u), s.half(), z.half()


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
