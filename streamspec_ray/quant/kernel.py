"""torch's CPU int4 weight-only kernel: its packed code layout, packing and unpacking, and the matmul.

(Where the CPU has AVX512-VNNI and a C compiler is at hand, q4q8.py multiplies these same packed bytes with 8-bit
activations instead, ~2x faster for a sweep's rows; this module's layout and packing serve both.)

The kernel
----------
``torch.ops.aten._weight_int4pack_mm_for_cpu(x [M, K] bf16, qweight, group_size, scales_zeros)`` computes
``y = x @ W^T`` ([M, N] bf16) with

    W[n, k] = (u[n, k] - 8) * scale[g, n] + zero[g, n],   g = k // group_size,  u in 0..15

where ``qweight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.int() [N, K], 8)`` (uint8, shape
[N, K/2]) and ``scales_zeros`` is bf16 [K/group_size, N, 2] holding (scale, zero). (u, scale, zero) come from a GGUF
tensor's own 4-bit blocks (quant/ggml.py DIRECT: a streamed sweep multiplies the file's codes without a
dequantization pass) or from quant/int4.quantize_asym at bf16; `pack` turns them into the two tensors the kernel
takes.

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

HAS_KERNEL = hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
GROUP_SIZES = (32, 64, 128, 256)   # what _weight_int4pack_mm_for_cpu accepts


def dequantize(u, scale, zero) -> np.ndarray:
    """(u [N, K], scale [N, G], zero [N, G]) -> fp32 [N, K] = (u - 8) * scale + zero, the kernel's formula
    (bitwise what its AVX512 and scalar paths compute, when scale and zero are bf16 values)."""
    u, scale, zero = (np.asarray(a) for a in (u, scale, zero))
    n, k = u.shape
    g = k // scale.shape[1]
    w = (u.reshape(n, -1, g).astype(np.float32) - 8) * scale.astype(np.float32)[..., None]
    return (w + zero.astype(np.float32)[..., None]).reshape(n, k)


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


def can_pack(name: str, shape, group_size: int) -> bool:
    """Whether a stored tensor can be an int4pack weight: a 2-D matrix with 16-row tiles and whole groups along
    the input, at a group size the kernel takes."""
    return (name.endswith(".weight") and len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % group_size == 0
            and group_size in GROUP_SIZES)


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
