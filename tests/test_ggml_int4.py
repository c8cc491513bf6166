"""GGUF 4-bit blocks -> torch's CPU int4 kernel format (streamspec_ray/quant/ggml.py, kernel.py). No model
download: Q4_K / Q4_0 / Q4_1 blocks are synthesized as random valid bytes."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from streamspec_ray.quant import ggml, int4, kernel  # noqa: E402

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="torch without the CPU int4 kernel")


def _fp16_bytes(rng, nb, lo, hi):
    """[nb, 2] uint8: random fp16 magnitudes in [lo, hi] (log-uniform)."""
    return np.exp(rng.uniform(np.log(lo), np.log(hi), nb)).astype("<f2").view(np.uint8).reshape(nb, 2)


def random_q4k(n, k, seed=0):
    """Random valid Q4_K bytes of a [n, k] tensor: [n, k/256 * 144] uint8 (GGUFReader's view)."""
    rng = np.random.default_rng(seed)
    nb = n * k // 256
    blocks = np.concatenate([
        _fp16_bytes(rng, nb, 1e-4, 2e-2),                          # d
        _fp16_bytes(rng, nb, 1e-4, 2e-2),                          # dmin
        rng.integers(0, 256, (nb, 12), dtype=np.uint8),            # any 12 bytes are 8 valid 6-bit pairs
        rng.integers(0, 256, (nb, 128), dtype=np.uint8),           # nibbles
    ], axis=1)
    return blocks.reshape(n, -1)


def random_q4_legacy(n, k, with_min, seed=0):
    rng = np.random.default_rng(seed)
    nb = n * k // 32
    parts = [_fp16_bytes(rng, nb, 1e-4, 2e-2)]
    if with_min:
        m = (-rng.uniform(1e-3, 1e-1, nb)).astype("<f2").view(np.uint8).reshape(nb, 2)
        parts.append(m)
    parts.append(rng.integers(0, 256, (nb, 16), dtype=np.uint8))
    return np.concatenate(parts, axis=1).reshape(n, -1)


def _bf16(a):
    return torch.as_tensor(np.asarray(a, np.float32)).to(torch.bfloat16).float().numpy()


def _check_direct(u, scale, zero, ref):
    assert u.dtype == np.uint8 and u.max() <= 15
    assert scale.dtype == np.float32 and zero.dtype == np.float32
    w = kernel.dequantize(u, scale, zero)
    diff = np.abs(w - ref)
    # 1 ulp-ish: the fp32 form is (q - 8) * scale + zero with zero rounded once, vs ggml's d sc q - dmin m
    tol = np.spacing(np.maximum(np.abs(ref), np.abs(zero).repeat(ref.shape[1] // zero.shape[1], 1)))
    assert (diff <= tol).all(), f"max abs diff {diff.max():.3g}"
    return float(diff.max()), float((diff / np.maximum(np.abs(ref), 1e-30)).max())


def test_q4k_matches_gguf_dequantize():
    n, k = 48, 512
    raw = random_q4k(n, k)
    u, scale, zero = ggml.q4k_to_int4(raw, (n, k))
    assert u.shape == (n, k) and scale.shape == zero.shape == (n, k // 32)
    ref = gguf_dequantize(raw, GGMLQuantizationType.Q4_K).reshape(n, k)
    max_abs, max_rel = _check_direct(u, scale, zero, ref)
    print(f"Q4_K: max abs diff {max_abs:.3g}, max rel {max_rel:.3g}")
    # the codes are the file's nibbles (sub-block 0 of block 0 = low nibbles of qs[0:32])
    assert np.array_equal(u[0, :32], raw[0, 16:48] & 15) and np.array_equal(u[0, 32:64], raw[0, 16:48] >> 4)
    # a flat buffer works the same
    u2, s2, z2 = ggml.q4k_to_int4(raw.reshape(-1), (n, k))
    assert np.array_equal(u, u2) and np.array_equal(scale, s2) and np.array_equal(zero, z2)
    with pytest.raises(ValueError):
        ggml.q4k_to_int4(raw, (n, k + 256))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_legacy_matches_gguf_dequantize(qtype):
    n, k = 32, 256
    raw = random_q4_legacy(n, k, with_min=qtype == "Q4_1", seed=3)
    u, scale, zero = ggml.ggml_to_int4(raw, GGMLQuantizationType[qtype], (n, k), 32)
    ref = gguf_dequantize(raw, GGMLQuantizationType[qtype]).reshape(n, k)
    max_abs, _ = _check_direct(u, scale, zero, ref)
    print(f"{qtype}: max abs diff {max_abs:.3g}")


def test_requantize_error_bounds_and_constant_groups():
    torch.manual_seed(0)
    n, k, g = 64, 256, 32
    w = torch.randn(n, k) * 0.05
    w[:, :32] += 3.0                                        # a group far from zero (skewed range)
    w[1, 64:96] = 0.0                                       # constant groups: zeros,
    w[2, 64:96] = 0.3125                                    # a bf16 value,
    w[3, 64:96] = float(np.float16(0.1234))                 # an fp16 value (not bf16),
    w[4, 64:96] = 0.123456789                               # an arbitrary fp32 value
    w[5, 96:128] = 7.0                                      # an integer
    u, s, z = int4.quantize_asym(w, g, torch.bfloat16, shrink=(1.0,), refine=0)
    assert u.dtype == torch.uint8 and int(u.max()) <= 15 and s.shape == z.shape == (n, k // g)
    assert torch.equal(s, s.bfloat16().float()) and torch.equal(z, z.bfloat16().float())   # bf16 values
    wd = torch.from_numpy(kernel.dequantize(u.numpy(), s.numpy(), z.numpy()))
    err = (wd - w).abs().reshape(n, -1, g)
    bound = s / 2 + 2.0 ** -9 * (8 * s + z.abs()) + 1e-7 * (1 + w.abs().reshape(n, -1, g).amax(-1))
    assert (err <= bound[..., None]).all(), float((err - bound[..., None]).max())
    for r, c0 in ((1, 64), (2, 64), (3, 64), (5, 96)):
        assert torch.equal(wd[r, c0:c0 + 32], w[r, c0:c0 + 32]), r
    assert (wd[4, 64:96] - w[4, 64:96]).abs().max() <= 2.0 ** -16 * 0.124
    # the default (shrink factors + least-squares refits) is never worse per group than the plain min/max
    u2, s2, z2 = int4.quantize_asym(w, g, torch.bfloat16)
    wd2 = torch.from_numpy(kernel.dequantize(u2.numpy(), s2.numpy(), z2.numpy()))
    e1 = (wd - w).double().square().reshape(n, -1, g).sum(-1)
    e2 = (wd2 - w).double().square().reshape(n, -1, g).sum(-1)
    assert (e2 <= e1 * (1 + 1e-5) + 1e-30).all()
    assert e2.sum() < 0.97 * e1.sum()
    for r, c0 in ((1, 64), (2, 64), (3, 64), (5, 96)):
        assert torch.equal(wd2[r, c0:c0 + 32], w[r, c0:c0 + 32]), r


def test_requantize_matches_gguf_source_roundtrip():
    """A Q8_0 tensor goes through gguf's dequantization and quantize_asym at bf16 (the path for non-4-bit types)."""
    rng = np.random.default_rng(5)
    n, k = 32, 128
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    raw = gguf.quants.quantize(w, GGMLQuantizationType.Q8_0)
    u, s, z = ggml.ggml_to_int4(raw, GGMLQuantizationType.Q8_0, (n, k), 64)
    src = gguf_dequantize(raw, GGMLQuantizationType.Q8_0).reshape(n, k)
    wd = kernel.dequantize(u.numpy(), s.numpy(), z.numpy())
    rel = np.sqrt(np.mean((wd - src) ** 2) / np.mean(src ** 2))
    assert s.shape == (n, 2) and rel < 0.12


def _kernel_case(n, k, g, seed=0):
    """Q4_K codes for g == 32, requantized random weights otherwise -> (u, scale, zero, W_ref fp32)."""
    if g == 32:
        u, scale, zero = ggml.q4k_to_int4(random_q4k(n, k, seed), (n, k))
    else:
        torch.manual_seed(seed)
        u, scale, zero = (t.numpy() for t in int4.quantize_asym(torch.randn(n, k) * 0.05, g, torch.bfloat16))
    return u, scale, zero, kernel.dequantize(u, _bf16(scale), _bf16(zero))


@pytest.mark.parametrize("n,k,g", [(64, 512, 32), (80, 256, 32), (144, 512, 64), (32, 256, 128)])
def test_kernel_matches_reference_and_is_row_independent(n, k, g):
    u, scale, zero, w_ref = _kernel_case(n, k, g)
    packed = kernel.pack(u, scale, zero)
    qw, sz = packed["qweight"], packed["scales_zeros"]
    assert qw.dtype == torch.uint8 and qw.shape == (n, k // 2)
    assert sz.dtype == torch.bfloat16 and sz.shape == (k // g, n, 2) and sz.is_contiguous()
    assert kernel.group_size_of(k, sz) == g == kernel.group_size_of(u, scale)
    W = torch.from_numpy(w_ref)
    torch.manual_seed(1)
    xs = torch.randn(33, k).bfloat16()
    for m in (1, 5):
        x = xs[:m]
        y = kernel.int4_mm(x, qw, sz, g).float()
        ref = x.double() @ W.double().T
        # fp32 accumulation, then one rounding to bf16
        tol = 2.0 ** -8 * ref.abs() + 1e-5 * (x.double().abs() @ W.double().abs().T)
        assert ((y.double() - ref).abs() <= tol).all(), float((y.double() - ref).abs().max())
    # a row's result does not depend on M or on its position (chain verification == naive decoding)
    full = kernel.int4_mm(xs, qw, sz, g)
    for m in (1, 2, 3, 5, 9):
        assert torch.equal(kernel.int4_mm(xs[:m], qw, sz, g), full[:m])
    for i in (0, 7, 32):
        assert torch.equal(kernel.int4_mm(xs[i:i + 1], qw, sz, g), full[i:i + 1])
    assert torch.equal(kernel.int4_mm(xs.flip(0), qw, sz, g), full.flip(0))


def test_unpack_reference_and_codes():
    n, k, g = 144, 512, 32                                  # two 64-row blocks and a 16-row tail
    u, scale, zero, w_ref = _kernel_case(n, k, g, seed=2)
    packed = kernel.pack(u, scale, zero)
    qw, sz = packed["qweight"], packed["scales_zeros"]
    # torch's converter (whole, or in slabs of rows) writes the same bytes as the numpy writer
    conv = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(u).int(), 8)
    assert kernel.kernel_layout() is not None
    assert torch.equal(qw, conv)
    assert torch.equal(kernel.pack(u, scale, zero, writer="torch")["qweight"], conv)
    assert torch.equal(kernel.pack(u, scale, zero, rows_per_chunk=64, writer="torch")["qweight"], conv)
    assert np.array_equal(kernel.pack_codes(u), conv.numpy())
    assert np.array_equal(kernel.unpack_codes(qw, k), u)
    rows = [0, 1, 31, 32, 63, 64, 100, 127, 128, 129, 143]
    assert np.array_equal(kernel.unpack_codes(qw, k, rows=rows), u[rows])
    assert np.array_equal(kernel.unpack_codes_kernel(qw, k), u)
    w = kernel.unpack_reference(qw, sz, g, k)
    assert torch.equal(w, torch.from_numpy(w_ref))          # exact: codes back, then the kernel's formula
    assert torch.equal(kernel.unpack_reference(qw, sz, g, k, rows=rows), torch.from_numpy(w_ref[rows]))
    # the identity matmul gives W only to bf16: the kernel rounds its (exact) fp32 sums to bf16
    wi = kernel.unpack_reference(qw, sz, g, k, exact=False)
    wb = torch.from_numpy(w_ref).bfloat16().float()
    if torch.backends.cpu.get_cpu_capability() in ("AVX512", "DEFAULT"):   # fma(u - 8, scale, zero): our formula
        assert torch.equal(wi, wb)
    else:                                   # AVX2 forms zero - 8 scale first: an fp32 ulp can flip a bf16 rounding
        assert ((wi - wb).abs() <= 2.0 ** -7 * wb.abs()).all()


@pytest.mark.parametrize("layout", kernel.LAYOUTS)
def test_pack_codes_roundtrip_every_layout(layout):
    rng = np.random.default_rng(7)
    for n in (16, 48, 80, 144):
        u = rng.integers(0, 16, (n, 6), dtype=np.uint8)
        p = kernel.pack_codes(u, layout)
        assert p.shape == (n, 3)
        assert np.array_equal(kernel.unpack_codes(p, 6, layout), u)
        rows = list(range(n))[::-3]
        assert np.array_equal(kernel.unpack_codes(p, 6, layout, rows=rows), u[rows])


def test_layout_per_cpu_capability():
    """The converter's bytes depend on the CPU capability torch dispatches to: the probe must recognise the
    layout (and pack_codes reproduce it) under each capability this CPU can run."""
    script = textwrap.dedent("""
        import numpy as np, torch
        from streamspec_ray.quant import kernel
        lay = kernel.kernel_layout()
        u = np.random.default_rng(0).integers(0, 16, (208, 64), dtype=np.uint8)
        got = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(u).int(), 8).numpy()
        assert lay is not None and np.array_equal(kernel.pack_codes(u), got)
        print(torch.backends.cpu.get_cpu_capability(), lay.name)
    """)
    seen = {}
    for cap in ("default", "avx2"):
        env = dict(os.environ, ATEN_CPU_CAPABILITY=cap)
        out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        got_cap, name = out.stdout.split()
        seen[got_cap] = name
    print(seen)
    if "DEFAULT" in seen and sys.platform.startswith("linux") and os.uname().machine == "x86_64":
        assert seen["DEFAULT"] == "n32pairs"
    if "AVX2" in seen:
        assert seen["AVX2"] == "n32split"


def test_shape_checks():
    u = np.zeros((24, 64), np.uint8)
    s = np.ones((24, 2), np.float32)
    with pytest.raises(ValueError, match="N % 16"):
        kernel.pack(u, s, s)
    with pytest.raises(ValueError, match="group_size"):
        kernel.pack(np.zeros((16, 64), np.uint8), np.ones((16, 4), np.float32), np.ones((16, 4), np.float32))
    with pytest.raises(ValueError):
        int4.quantize_asym(torch.zeros(16, 48), 32, torch.bfloat16)
