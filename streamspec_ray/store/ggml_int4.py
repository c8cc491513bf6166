"""GGUF (ggml) tensors -> 4-bit weights in the layout of torch's CPU int4 weight-only kernel.

The kernel
----------
``torch.ops.aten._weight_int4pack_mm_for_cpu(x [M, K] bf16, qweight, group_size, scales_zeros)`` computes
``y = x @ W^T`` ([M, N] bf16) with

    W[n, k] = (u[n, k] - 8) * scale[g, n] + zero[g, n],   g = k // group_size,  u in 0..15

where ``qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.int() [N, K], 8)`` (uint8, shape
[N, K/2]) and ``scales_zeros`` is bf16 [K/group_size, N, 2] holding (scale, zero). This module produces
(u, scale, zero) straight from a GGUF tensor's raw blocks, so a streamed sweep multiplies the file's own 4-bit
codes without a dequantization pass, and `pack` turns them into the two tensors the kernel takes.

Three ways in:
  * Q4_K (`q4k_to_int4`), Q4_0 and Q4_1 (`q4_0_to_int4`, `q4_1_to_int4`) map exactly: the file's codes are
    the kernel's codes, and only the per-32 scale and offset change form (then are rounded to bf16 by `pack`).
  * anything else (Q6_K, Q5_K, Q5_0, Q8_0, F16, BF16, F32...) is dequantized to fp32 (gguf-py) and
    requantized by `requantize_int4`, an asymmetric min/max quantizer that picks its codes under the
    bf16-rounded scale and zero the kernel will use.
  * `ggml_to_int4(raw, qtype, shape, group_size)` dispatches between the two.

ggml block layouts (llama.cpp ggml-common.h / ggml-quants.c; gguf-py's gguf/quants.py is the numpy twin)
--------------------------------------------------------------------------------------------------------
A GGUF tensor lists its dims fastest first (ne0 = K, the input dimension), so the row-major [N, K] matrix is
``N`` rows of ``K / block_values`` consecutive blocks, each block covering consecutive k of one row.

Q4_K, 256 values per block, 144 bytes (``block_q4_K``)::

    bytes 0..1     d      fp16  super-block scale of the sub-block scales
    bytes 2..3     dmin   fp16  super-block scale of the sub-block mins
    bytes 4..15    scales 12 B   8 six-bit scales sc[j] and 8 six-bit mins m[j] (j = sub-block 0..7):
                     j < 4:  sc[j] = b[j] & 63              m[j] = b[j + 4] & 63
                     j >= 4: sc[j] = (b[j + 4] & 15) | (b[j - 4] >> 6) << 4
                             m[j]  = (b[j + 4] >> 4) | (b[j] >> 6) << 4
    bytes 16..143  qs     128 B  4 chunks of 32 bytes; chunk c holds sub-block 2c in its low nibbles and
                                 sub-block 2c + 1 in its high nibbles (value i of the sub-block in byte i)

  value i of sub-block j: ``w = d * sc[j] * q - dmin * m[j]`` with q the nibble (0..15). In the kernel's form
  (group 32 = one sub-block): ``u = q``, ``scale = d * sc[j]``, ``zero = 8 * d * sc[j] - dmin * m[j]``.
  ``d * sc`` (11 x 6 significant bits) and ``dmin * m`` are exact in fp32, so only ``zero`` is rounded (once)
  before the final add: on every Q4_K tensor of Qwen2.5-Coder-1.5B checked, (u - 8) * scale + zero equals
  gguf's dequantization bitwise; on random blocks (unrelated d and dmin exponents) it is within 1 ulp.

Q4_0, 32 values per block, 18 bytes: fp16 d, 16 bytes qs (value i < 16 in the low nibble of byte i, value
  16 + i in its high nibble); ``w = (q - 8) * d`` -> u = q, scale = d, zero = 0.
Q4_1, 32 values per block, 20 bytes: fp16 d, fp16 m, 16 bytes qs as Q4_0; ``w = q * d + m`` -> u = q,
  scale = d, zero = m + 8 d.

Precision in the kernel
-----------------------
The kernel reads scale and zero as bf16 (8 significant bits). Q4_K's ``d * sc`` has up to 17, so `pack`'s
rounding moves each weight by up to ~2^-9 * (8 * scale + |zero|), a few percent of a quantization step. On
Qwen2.5-Coder-1.5B's blk.0.ffn_gate (Q4_K, |w| <= 0.53) the kernel's weights (bf16 scale and zero) differ
from gguf's fp32 dequantization by at most 1.2e-3 (relative RMS 2.0e-3,
~40x below a 4-bit quantizer's own error: requantizing its Q6_K tensors costs ~7.4e-2 at group 32). Choosing
the bf16 pair per group by least squares instead of rounding each to nearest was tried: 2.0e-3 -> 1.8e-3 for
~1 s a tensor, not kept. (The AVX512 and scalar kernels dequantize as fma(u - 8, scale, zero), i.e. exactly
`dequantize` on the bf16 values; the AVX2 one forms zero - 8 scale first, which can differ by an ulp.)

The packed layout (what `_convert_weight_to_int4pack_for_cpu` writes) -- machine dependent
-------------------------------------------------------------------------------------------
Found empirically (every (n, k) probed one at a time) and matching aten/src/ATen/native/cpu/int4mm_kernel.cpp:
the [N, K/2] uint8 result is really [N / BLOCK_N][K][BLOCK_N / 2] bytes: rows are cut into blocks of BLOCK_N,
and within a block, for each k, BLOCK_N / 2 bytes hold that column's codes of the block's rows.
BLOCK_N = 4 * (floats per vector) depends on the CPU capability torch dispatched to at start-up
(``torch.backends.cpu.get_cpu_capability()``, overridable with ATEN_CPU_CAPABILITY; all three x86 layouts
were measured on one AVX512 machine by starting torch with ATEN_CPU_CAPABILITY=default / avx2 / avx512):

    AVX512   BLOCK_N 64, split pairing  byte j (0..31) of column k = row j (low nibble) | row j + 32 (high)
    AVX2     BLOCK_N 32, split pairing  byte j (0..15) of column k = row j (low)        | row j + 16 (high)
    DEFAULT  BLOCK_N 32, adjacent pairs byte j of column k = row 2j (low) | row 2j + 1 (high)
    (aarch64 NEON: BLOCK_N 16, adjacent pairs -- from the source, not measured here)

A last block shorter than BLOCK_N (N % BLOCK_N in 16, 32, 48) always uses adjacent pairs. So the bytes are
easy to write from numpy (`pack_codes` / `unpack_codes`, with `kernel_layout` detecting the running layout by
probing torch's converter), but a packed qweight written on an AVX512 machine multiplies garbage on an AVX2
or ARM one, silently. A store should either keep the codes in a machine-independent layout and pack at load
(`pack_codes`: ~10 ms for 8960 x 1536; torch's converter ~30 ms plus the int32 copy it needs), or record
`kernel_layout().name` next to qweight and repack on a mismatch (`unpack_codes` then `pack_codes`, ~25 ms).

Other constraints (torch 2.13, measured): N % 16 == 0 (converter); K even; group sizes 32, 64, 128, 256
only, K % group_size == 0 (the kernel); the converter's inner-k-tiles argument is ignored on CPU; x must be
bf16 with bf16 scales_zeros for the vectorized kernel (fp32 and fp16 x are accepted with matching
scales_zeros but run a scalar loop 10-100x slower). The kernel accumulates each output in fp32 over k in
order with one FMA per k and rounds the result to bf16 once; a row's result does not depend on M or on the
row's position in x (bitwise), because every block of <= 4 rows runs the same per-row FMA chain (checked for
M up to 33 in tests/test_ggml_int4.py).

Speed (torch 2.13, one AVX512 Xeon core; [N, K] = [8960, 1536], per call)
---------------------------------------------------------------------
               int4 g32   int4 g64   dense bf16   dense fp32
    M = 1      0.82 ms    0.81 ms    1.9 ms       2.1 ms
    M = 9      3.8 ms     3.7 ms     2.0 ms       6.9 ms
    M = 33     12.6 ms    12.5 ms    2.7 ms       11.9 ms
With 2 threads the best times are 0.44 / 2.2 / 6.4 ms (g32 and g64 again within 3%), but with the default
passive OpenMP wait on a busy 2-core machine the medians sit at 8-16 ms (thread wake-ups). Group size does not
matter for speed. The kernel re-dequantizes the weight for every block of 4 rows of x, so its cost grows
~linearly with M: it wins for a single token (2.5x over fp32) and at M = 33 only matches fp32 -- still cheaper
than a dequantization pass (~95 ms to rebuild this weight in bf16 with torch ops).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import torch

QK_K = 256                 # values per k-quant super-block
Q4_K_BYTES = 144           # 2 + 2 + 12 + 128
Q4_0_BYTES = 18            # 2 + 16
Q4_1_BYTES = 20            # 2 + 2 + 16
GROUP_SIZES = (32, 64, 128, 256)   # what _weight_int4pack_mm_for_cpu accepts
SHRINK = (1.0, 0.95, 0.9)
REFINE = 2
_CHUNK = 1 << 18           # elements per slab in the torch loops (keeps temporaries in cache)


# ----------------------------------------------------------------------------------------------------------
# direct conversions of 4-bit ggml blocks
# ----------------------------------------------------------------------------------------------------------

def _blocks(blocks: np.ndarray, shape, block_values: int, block_bytes: int) -> tuple[np.ndarray, int, int]:
    n, k = (int(s) for s in shape)
    if k % block_values:
        raise ValueError(f"K={k} is not a multiple of the block size {block_values}")
    b = np.ascontiguousarray(blocks).view(np.uint8).reshape(-1)
    nb = n * (k // block_values)
    if b.size != nb * block_bytes:
        raise ValueError(f"{b.size} bytes for a [{n}, {k}] tensor; expected {nb * block_bytes}")
    return b.reshape(nb, block_bytes), n, k


def _fp16(b: np.ndarray) -> np.ndarray:
    """[nb, 2] uint8 -> [nb, 1] float32 (little-endian fp16, as ggml stores it)."""
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def q4k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[nb, 12] uint8 packed scales -> (sc, m), each uint8 [nb, 8] in 0..63 (llama.cpp get_scale_min_k4)."""
    s = scales.astype(np.uint8, copy=False)
    lo, hi, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (mix & 15) | ((lo >> 6) << 4)], axis=1)
    m = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=1)
    return sc, m


def q4k_to_int4(blocks: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_K bytes of a [N, K] tensor -> (u uint8 [N, K] in 0..15, scale f32 [N, K/32], zero f32 [N, K/32]).

    blocks: any uint8 array of N * K/256 * 144 bytes (GGUFReader's [N, K/256*144] view, or flat).
    (u - 8) * scale + zero reproduces gguf's fp32 dequantization to ~1 ulp (see the module docstring)."""
    b, n, k = _blocks(blocks, shape, QK_K, Q4_K_BYTES)
    nb = b.shape[0]
    d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])              # [nb, 1]
    sc, m = q4k_scale_min(b[:, 4:16])                          # [nb, 8]
    scale = d * sc.astype(np.float32)                          # exact: 11 x 6 significant bits
    zero = 8 * scale - dmin * m.astype(np.float32)             # one rounding
    qs = b[:, 16:].reshape(nb, 4, 1, 32)                       # chunk c: sub-blocks 2c (low), 2c + 1 (high)
    u = np.empty((nb, 4, 2, 32), np.uint8)
    np.bitwise_and(qs[:, :, 0], 15, out=u[:, :, 0])
    np.right_shift(qs[:, :, 0], 4, out=u[:, :, 1])
    return u.reshape(n, k), scale.reshape(n, k // 32), zero.reshape(n, k // 32)


def _q4_legacy(b: np.ndarray, n: int, k: int) -> np.ndarray:
    qs = b[:, -16:]                                            # value i: low nibble of byte i, 16 + i: high
    u = np.empty((b.shape[0], 2, 16), np.uint8)
    np.bitwise_and(qs, 15, out=u[:, 0])
    np.right_shift(qs, 4, out=u[:, 1])
    return u.reshape(n, k)


def q4_0_to_int4(blocks: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_0 bytes of a [N, K] tensor -> (u, scale, zero) with group 32 (w = (q - 8) * d: zero = 0)."""
    b, n, k = _blocks(blocks, shape, 32, Q4_0_BYTES)
    d = _fp16(b[:, 0:2]).reshape(n, k // 32)
    return _q4_legacy(b, n, k), d, np.zeros_like(d)


def q4_1_to_int4(blocks: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_1 bytes of a [N, K] tensor -> (u, scale, zero) with group 32 (w = q * d + m: zero = m + 8 d)."""
    b, n, k = _blocks(blocks, shape, 32, Q4_1_BYTES)
    d, m = _fp16(b[:, 0:2]).reshape(n, k // 32), _fp16(b[:, 2:4]).reshape(n, k // 32)
    return _q4_legacy(b, n, k), d, m + 8 * d


DIRECT = {"Q4_K": q4k_to_int4, "Q4_0": q4_0_to_int4, "Q4_1": q4_1_to_int4}


def dequantize(u, scale, zero) -> np.ndarray:
    """(u [N, K], scale [N, G], zero [N, G]) -> fp32 [N, K] = (u - 8) * scale + zero, the kernel's formula
    (bitwise what its AVX512 and scalar paths compute, when scale and zero are bf16 values)."""
    u, scale, zero = (np.asarray(a) for a in (u, scale, zero))
    n, k = u.shape
    g = k // scale.shape[1]
    w = (u.reshape(n, -1, g).astype(np.float32) - 8) * scale.astype(np.float32)[..., None]
    return (w + zero.astype(np.float32)[..., None]).reshape(n, k)


# ----------------------------------------------------------------------------------------------------------
# requantization of other types
# ----------------------------------------------------------------------------------------------------------

def _bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> the nearest bf16 value, as fp32 (what the kernel will read)."""
    return x.to(torch.bfloat16).float()


def _requant_slab(w: torch.Tensor, shrink, refine: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [R, G, g] fp32 -> (q [R, G, g] fp32 in -8..7, scale [R, G], zero [R, G]) bf16-exact."""
    lo, hi = torch.aminmax(w, dim=-1)
    mid, half = (lo + hi) * 0.5, (hi - lo) * 0.5
    best = []

    def offer(s, z):
        """Candidate bf16 (s, z) per group: round the codes under it, keep it where its error is lowest."""
        inv = torch.where(s > 0, 1 / s, torch.zeros_like(s))
        q = torch.sub(w, z[..., None]).mul_(inv[..., None]).round_().clamp_(-8, 7)
        e = torch.addcmul(z[..., None], q, s[..., None]).sub_(w)   # (u - 8) s + z - w, as the kernel rounds
        err = torch.linalg.vector_norm(e, dim=-1)                  # (ordering only, like the squared sum)
        if not best:
            best[:] = [q, s, z, err]
            return
        m = err < best[3]
        best[0] = torch.where(m[..., None], q, best[0])
        best[1], best[2] = torch.where(m, s, best[1]), torch.where(m, z, best[2])
        best[3] = torch.where(m, err, best[3])

    for f in shrink:
        s = _bf16(half * (2 * f / 15))                         # the range [mid - f half, mid + f half] / 15
        offer(s, _bf16(mid - half * f + 8 * s))                # z - 8 s ~ the range's low end
    mw = w.mean(-1)
    for _ in range(refine):
        # with the codes fixed, the least-squares line w ~ q s + z; then the codes are re-rounded under it
        q, s = best[0], best[1]
        mq = q.mean(-1)
        qc = q - mq[..., None]
        var, cov = qc.square().mean(-1), (qc * w).mean(-1)
        s_ls = _bf16(torch.where(var > 0, cov / var.clamp(min=1e-30), s))
        s_ls = torch.where(s_ls > 0, s_ls, s)
        offer(s_ls, _bf16(mw - s_ls * mq))
    q, s, z = best[0], best[1], best[2]
    # constant groups: z = bf16(c) and the residual c - z carried by one code step (u = 9), so c comes back
    # exactly when the residual is a bf16 value (0, bf16, fp16 and small-integer sources), else within |c| 2^-17
    const = half == 0
    if bool(const.any()):
        z = torch.where(const, _bf16(lo), z)
        r = _bf16(lo - z)
        s = torch.where(const, r, s)
        q = torch.where(const[..., None], (r != 0).float()[..., None].expand_as(q), q)
    return q, s, z


def requantize_int4(w, group_size: int = 32, shrink=SHRINK,
                    refine: int = REFINE) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] float (a dequantized Q6_K, Q5_0, Q8_0, F16... tensor) -> (u uint8 [N, K], scale f32 [N, K/g],
    zero f32 [N, K/g]), asymmetric, per group of `group_size` consecutive k:

      * the range [min, max] is mapped onto the 16 codes: scale = (max - min) / 15, zero = min + 8 scale;
      * the range is also tried shrunk about its middle by each factor in `shrink` (clipping a lone outlier
        often lowers the group's error), and `refine` rounds of a least-squares refit of (scale, zero) to the
        codes (then re-rounding the codes) are offered; per group the candidate with the lowest squared error
        is kept, so the result is never worse than the plain min/max one.

    scale and zero are returned already rounded to bf16 (as fp32 values), and every candidate's codes and error
    are computed under those rounded values, so (u - 8) * scale + zero is exactly what the kernel multiplies.
    With shrink=(1.0,), refine=0 every element is within scale / 2 of its value, plus the bf16 rounding of
    scale and zero (<= 2^-9 (8 scale + |zero|)). A constant group c gets zero = bf16(c) and the residual in
    scale with u = 9: exact when c - bf16(c) is a bf16 value (0, any bf16, fp16 or small-integer value), else
    within ~|c| 2^-17. Relative RMS error on Qwen2.5-1.5B's Q6_K ffn_down: 7.90e-2 plain -> 7.35e-2 default at group
    32 (9.07e-2 -> 8.52e-2 at 64), for ~0.3 s per 8960 x 1536 tensor on 2 cores (0.07 s plain). Rows are
    processed in slabs, so memory stays ~3 copies of a 256k-element slab whatever the tensor's size."""
    w = torch.as_tensor(w).detach().float()
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group_size={group_size}")
    g = k // group_size
    u = torch.empty(n, k, dtype=torch.uint8)
    scale = torch.empty(n, g)
    zero = torch.empty(n, g)
    rows = max(1, _CHUNK // k)
    with torch.no_grad():
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            q, s, z = _requant_slab(w[r0:r1].reshape(r1 - r0, g, group_size), shrink, refine)
            u[r0:r1] = q.add_(8).reshape(r1 - r0, k).to(torch.uint8)
            scale[r0:r1], zero[r0:r1] = s, z
    return u, scale, zero


def ggml_to_int4(raw: np.ndarray, qtype, shape: tuple[int, int], group_size: int = 32,
                 shrink=SHRINK, refine: int = REFINE) -> tuple[np.ndarray | torch.Tensor, ...]:
    """Raw bytes (or values, for float types) of a [N, K] GGUF tensor -> (u, scale, zero).

    Q4_K / Q4_0 / Q4_1 at group_size 32 map directly (codes kept, nothing requantized); everything else, or
    another group size, is dequantized with gguf-py and requantized by requantize_int4 (torch tensors out).
    Row permutations a converter applies (Llama's q/k) apply to u, scale and zero rows alike."""
    name = getattr(qtype, "name", str(qtype))
    if name in DIRECT and group_size == 32:
        return DIRECT[name](raw, shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    qt = qtype if not isinstance(qtype, str) else GGMLQuantizationType[qtype]
    w = gguf_dequantize(np.asarray(raw), qt).reshape(shape)
    return requantize_int4(torch.from_numpy(np.ascontiguousarray(w, np.float32)), group_size, shrink, refine)


# ----------------------------------------------------------------------------------------------------------
# packing for the kernel
# ----------------------------------------------------------------------------------------------------------

class Layout(NamedTuple):
    """How _convert_weight_to_int4pack_for_cpu arranges codes (see the module docstring)."""
    block_n: int       # rows per block (64 AVX512, 32 AVX2 / x86 default, 16 NEON)
    split: bool        # full blocks pair row j with row j + block_n / 2 (else rows 2j and 2j + 1)

    @property
    def name(self) -> str:
        return f"n{self.block_n}{'split' if self.split else 'pairs'}"


LAYOUTS = (Layout(64, True), Layout(32, True), Layout(32, False), Layout(16, False), Layout(64, False))


def group_size_of(k: int | tuple | np.ndarray | torch.Tensor, scale) -> int:
    """Group size from K (or a [N, K] shape / codes array) and a [N, G] scale (or [G, N, 2] scales_zeros)."""
    if not isinstance(k, int):
        k = int(tuple(k)[-1]) if isinstance(k, (tuple, list, torch.Size)) else int(k.shape[-1])
    shape = tuple(scale.shape)
    groups = shape[0] if len(shape) == 3 else shape[-1]
    if k % groups:
        raise ValueError(f"K={k} is not a multiple of the {groups} groups")
    return k // groups


def check_shape(n: int, k: int, group_size: int) -> None:
    """Raise ValueError unless the kernel can take an [n, k] weight at this group size."""
    if n % 16:
        raise ValueError(f"N={n}: the int4 packer needs N % 16 == 0")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size={group_size}: the kernel takes {GROUP_SIZES}")
    if k % group_size:
        raise ValueError(f"K={k} is not a multiple of group_size={group_size}")


def _torch(a) -> torch.Tensor:
    return a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))


def pack(u, scale, zero, rows_per_chunk: int | None = None, writer: str = "auto") -> dict[str, torch.Tensor]:
    """(u [N, K] in 0..15, scale [N, G], zero [N, G]) -> {"qweight": uint8 [N, K/2] in this machine's layout
    (the bytes of _convert_weight_to_int4pack_for_cpu), "scales_zeros": bf16 [G, N, 2] contiguous}; numpy or
    torch inputs. writer "auto" uses the numpy writer `pack_codes` when `kernel_layout()` recognised the layout
    (~10 ms for 8960 x 1536) and torch's converter otherwise; "torch" forces the converter, which wants int32
    codes, so it is fed a slab of rows at a time (~60-120 ms; slabs of a multiple of 64 rows pack to exactly
    the corresponding slice of the whole)."""
    u, scale, zero = _torch(u), _torch(scale).float(), _torch(zero).float()
    n, k = u.shape
    g = group_size_of(k, scale)
    check_shape(n, k, g)
    if writer == "auto" and kernel_layout() is not None:
        qweight = torch.from_numpy(pack_codes(u.numpy()))
    else:
        if rows_per_chunk is None:
            rows_per_chunk = max(64, (1 << 22) // k // 64 * 64)
        if rows_per_chunk % 64:
            raise ValueError("rows_per_chunk must be a multiple of 64")
        conv = torch.ops.aten._convert_weight_to_int4pack_for_cpu
        qweight = torch.empty(n, k // 2, dtype=torch.uint8)
        for r0 in range(0, n, rows_per_chunk):
            r1 = min(n, r0 + rows_per_chunk)
            qweight[r0:r1] = conv(u[r0:r1].to(torch.int32), 8)
    scales_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()
    return {"qweight": qweight, "scales_zeros": scales_zeros}


def int4_mm(x: torch.Tensor, qweight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [..., K] -> x @ W^T [..., N] through the kernel (computed in bf16 x, fp32 accumulation, bf16 out),
    returned in x's dtype."""
    shape = x.shape
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(torch.bfloat16), qweight,
                                                   group_size, scales_zeros)
    return y.to(x.dtype).view(*shape[:-1], y.shape[-1])


@functools.lru_cache(maxsize=1)
def kernel_layout() -> Layout | None:
    """The layout torch's converter writes on this machine, found by packing a probe and matching it against
    the known layouts (None when it matches none: then use the converter and `unpack_codes_kernel`)."""
    rng = np.random.default_rng(1234)
    probes = []
    for n in (144, 96, 112):           # full 64-row blocks and tails of 16, 32 and 48 rows
        u = rng.integers(0, 16, (n, 4), dtype=np.uint8)
        probes.append((u, torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(u).int(), 8).numpy()))
    for layout in LAYOUTS:
        if all(np.array_equal(pack_codes(u, layout), got) for u, got in probes):
            return layout
    return None


def _layout(layout: Layout | None) -> Layout:
    layout = kernel_layout() if layout is None else layout
    if layout is None:
        raise RuntimeError("torch's int4 packing on this machine matches no known layout")
    return layout


def pack_codes(u, layout: Layout | None = None) -> np.ndarray:
    """numpy writer of the converter's bytes: u uint8 [N, K] (0..15) -> uint8 [N, K/2] in `layout` (default:
    this machine's). Equal to _convert_weight_to_int4pack_for_cpu(u.int(), 8) for that layout."""
    u = np.asarray(u, dtype=np.uint8)
    n, k = u.shape
    lay = _layout(layout)
    bn = lay.block_n
    out = np.empty(n * k // 2, np.uint8)
    full = n // bn * bn
    if full:
        ub = u[:full].reshape(n // bn, bn, k)
        lo, hi = (ub[:, :bn // 2], ub[:, bn // 2:]) if lay.split else (ub[:, 0::2], ub[:, 1::2])
        out[:full * k // 2] = (lo | (hi << 4)).transpose(0, 2, 1).reshape(-1)   # [blocks, K, bn/2]
    if full < n:
        ut = u[full:]                                                          # tail: adjacent pairs
        out[full * k // 2:] = (ut[0::2] | (ut[1::2] << 4)).T.reshape(-1)       # [K, tail/2]
    return out.reshape(n, k // 2)


def unpack_codes(qweight, k: int | None = None, layout: Layout | None = None, rows=None) -> np.ndarray:
    """Inverse of pack_codes: qweight uint8 [N, K/2] -> u uint8 [N, K] (or only `rows`, e.g. embedding
    lookups: [len(rows), K], touching only their blocks)."""
    p = qweight.numpy() if isinstance(qweight, torch.Tensor) else np.asarray(qweight)
    n = p.shape[0]
    k = p.shape[1] * 2 if k is None else k
    lay = _layout(layout)
    bn = lay.block_n
    flat = p.reshape(-1)
    full = n // bn * bn
    if rows is None:
        u = np.empty((n, k), np.uint8)
        if full:
            b = flat[:full * k // 2].reshape(n // bn, k, bn // 2).transpose(0, 2, 1)     # [blocks, bn/2, K]
            ub = u[:full].reshape(n // bn, bn, k)
            lo, hi = (ub[:, :bn // 2], ub[:, bn // 2:]) if lay.split else (ub[:, 0::2], ub[:, 1::2])
            lo[...], hi[...] = b & 15, b >> 4
        if full < n:
            t = flat[full * k // 2:].reshape(k, (n - full) // 2).T                       # [tail/2, K]
            u[full::2], u[full + 1::2] = t & 15, t >> 4
        return u
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    blk, j = rows // bn, rows % bn
    in_full = rows < full
    half = np.where(in_full, bn // 2, (n - full) // 2)
    if lay.split:
        col, high = np.where(in_full, j % (bn // 2), j // 2), np.where(in_full, j >= bn // 2, j % 2 == 1)
    else:
        col, high = j // 2, j % 2 == 1
    col = np.where(in_full, col, (rows - full) // 2)
    high = np.where(in_full, high, (rows - full) % 2 == 1)
    base = np.where(in_full, blk * bn * k // 2, full * k // 2)
    idx = base[:, None] + np.arange(k)[None, :] * half[:, None] + col[:, None]   # [R, K] byte positions
    b = flat[idx]
    return np.where(high[:, None], b >> 4, b & 15).astype(np.uint8)


def unpack_codes_kernel(qweight: torch.Tensor, k: int) -> np.ndarray:
    """Layout-free recovery of u [N, K] through the kernel itself: with every (scale, zero) = (1, 0) the weight
    is u - 8 (exact in bf16), and x = eye(K) returns W^T one column per row. Costs ~N K^2 / 4 multiply-adds
    (0.8 s for 8960 x 1536 on 2 cores, 4 s for 1536 x 8960): a check or last resort, not a load path."""
    n = qweight.shape[0]
    sz = torch.stack([torch.ones(k // 32, n), torch.zeros(k // 32, n)], -1).to(torch.bfloat16)
    eye = torch.eye(k, dtype=torch.bfloat16)
    wt = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, qweight, 32, sz)             # [K, N] = u^T - 8
    return (wt.float().t() + 8).to(torch.uint8).contiguous().numpy()


def unpack_reference(qweight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, k: int,
                     exact: bool = True, rows=None) -> torch.Tensor:
    """Recover W [N, K] fp32 from the packed form, e.g. for a non-CPU device or embedding-row lookups.

    Running the kernel on x = eye(K) does give W^T, but only to bf16: its fp32 accumulation is exact here
    (one FMA by 1.0, the rest by 0.0) and it then rounds every output to bf16. So the default (exact=True)
    reads the codes back (numpy, this machine's layout; the kernel trick of unpack_codes_kernel when the
    layout is unknown) and recomputes (u - 8) * scale + zero in fp32 -- bitwise the weight the kernel's
    AVX512 / scalar paths multiply (AVX2 forms zero - 8 scale first: within an ulp). exact=False returns the
    identity-matmul result itself (bf16-rounded W, as fp32). `rows` picks rows."""
    if not exact:
        wt = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k, dtype=torch.bfloat16), qweight, group_size,
                                                        scales_zeros)
        w = wt.float().t().contiguous()
        return w if rows is None else w[torch.as_tensor(rows)]
    if kernel_layout() is not None:
        u = unpack_codes(qweight, k, rows=rows)
    else:
        u = unpack_codes_kernel(qweight, k)
        u = u if rows is None else u[np.asarray(rows)]
    sz = scales_zeros.float()
    s, z = sz[..., 0].t(), sz[..., 1].t()                                              # [N, G]
    if rows is not None:
        idx = torch.as_tensor(np.asarray(rows, dtype=np.int64))
        s, z = s[idx], z[idx]
    return torch.from_numpy(dequantize(u, s.numpy(), z.numpy()))


def layout_tag() -> str:
    """What an int4pack store records about the packed bytes it holds: the running kernel's layout."""
    layout = kernel_layout()
    return layout.name if layout is not None else f"torch-{torch.backends.cpu.get_cpu_capability()}"


def check_store_layout(manifest) -> None:
    """An int4pack store's bytes are only right for the kernel layout they were packed for (it depends on the CPU
    capability torch dispatches to): refuse a store packed for another one rather than multiply garbage."""
    from ..errors import StoreError

    if manifest.dtype != "int4pack":
        return
    theirs, ours = manifest.extra.get("int4pack_layout"), layout_tag()
    if theirs != ours:
        raise StoreError(f"this int4pack store was packed for the int4 kernel layout {theirs}, but torch here uses "
                         f"{ours} (another CPU type): convert the model again on this machine")
