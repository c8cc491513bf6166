"""4-bit weights x 8-bit activations: a small C kernel (q4q8.c) on AVX512-VNNI that multiplies an int4pack weight's
bytes as torch's CPU kernel holds them, with each 32-value group of x quantized to int8 on its own scale.

Why
---
torch's int4 kernel (kernel.py) dequantizes its weight to floats again for every block of 4 rows of x, so a verify
sweep of ~10 rows costs ~4-5x one row; fbgemm's int8 GEMM (int8.py) reads a weight once per call but holds twice
the bytes and needs a conversion. llama.cpp multiplies 4-bit blocks by 8-bit activation blocks with integer dot
products (Q4_K x Q8_K). This does the same on the int4pack layout: the weight's nibbles are unpacked in registers,
each 4 codes of an output row meet 4 int8 activations in one vpdpbusd lane, the exact integer sums of a group are
scaled once per group, and the weight bytes are read once per call for up to 4 rows at a time.

No maintained library offers this for torch on x86 CPUs: torchao's da8w4 CPU kernels are not in its PyPI wheel,
fbgemm's int4 paths are GPU-only, and torch's `_dyn_quant_matmul_4bit` is KleidiAI (ARM). So it is written here,
~150 lines of C with intrinsics, compiled on first use with the system's C compiler into $STREAMSPEC_HOME/kernels
(~1 s) and loaded with ctypes; its OpenMP loop runs on torch's own OpenMP threads (the wheel's libgomp.so.1 is
already loaded when this library asks for that name).

The numbers
-----------
    y[m, n] = sum_g xs[m, g] * (scale[g, n] * sum_{k in g} u[n, k] a[m, k] + (zero[g, n] - 8 scale[g, n]) * asum[m, g])
for W[n, k] = (u - 8) * scale + zero (the int4pack weight, bf16 scale and zero) and x[m, k] ~= a[m, k] * xs[m, g],
a in -127..127 rounded to nearest on the group's own scale (max |x| / 127 rounded up to a bf16 value), asum the
group's sum of a. Why the scale is rounded: computed exactly, it passed an ulp's change in a group's largest |x|
straight into the row's result, and upstream reductions (attention, norms) differ by ulps between thread counts:
a draft actor on Ray then sampled other tokens than the same draft in process (tests/test_ray.py, seeded
sampling). Rounded to bf16 it absorbs such noise as rounding x to bf16 did for torch's kernel. The weight
is the store's exactly; the activations carry ~0.2-0.4% relative error (8 bits on 32 values). Every float step
runs in one fixed order per (row, output): a row's result does not depend on the other rows of the call, which
verified sweeps need (tests/test_q4q8.py checks every row and prefix bit for bit, and the scalar path against the
vector one).

Where it runs
-------------
x86 CPUs with AVX512 F/BW/VBMI/VNNI, where torch packs int4 in its AVX512 layout (64-row blocks), with a C
compiler on the PATH ($CC, else cc or gcc). Elsewhere `available()` is False and PackedInt4 keeps torch's kernel.
`STREAMSPEC_Q4Q8=0` turns it off (the output then changes slightly: the engine compares runs of one kernel only).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch

from ..config import home
from .kernel import Layout, kernel_layout

log = logging.getLogger("streamspec")

ENV = "STREAMSPEC_Q4Q8"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "q4q8.c")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vbmi", "-mavx512vnni", "-mfma",
         "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vbmi", "avx512_vnni")
_vp, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _cpu_ok() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    have = set(line.split(":", 1)[1].split())
                    return all(flag in have for flag in CPU_FLAGS)
    except OSError:
        pass
    return False


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc"):
        if cc and shutil.which(cc):
            return cc
    return None


def build(cc: str) -> str:
    """Compile q4q8.c (once per source, compiler and flags: the library's name carries their hash) -> its path.
    Written to a temporary name and renamed, so concurrent first uses never load a half-written file."""
    src = open(SOURCE, "rb").read()
    tag = hashlib.sha256(src + " ".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    folder = os.path.join(home(), "kernels")
    path = os.path.join(folder, f"q4q8-{tag}.so")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
        os.close(fd)
        try:
            subprocess.run([cc, *FLAGS, SOURCE, "-o", tmp, "-lm"], check=True, capture_output=True, timeout=120)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return path


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot run here (see the module docstring; the reason is logged once)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    why = None
    if not _cpu_ok():
        why = "this CPU lacks AVX512 VNNI/VBMI"
    elif kernel_layout() != Layout(64, True):
        why = "torch packs int4 in another layout here"
    elif _compiler() is None:
        why = "no C compiler on the PATH ($CC, cc, gcc)"
    if why is None:
        try:
            lib = ctypes.CDLL(build(_compiler()))
        except (OSError, subprocess.SubprocessError) as e:
            why = f"building it failed ({str(e).strip()[:200]})"
    if why is not None:
        log.info("4-bit x 8-bit kernel off: %s; torch's int4 kernel multiplies instead", why)
        return None
    lib.q8_quantize.argtypes = [_vp, _i64, _i64, _i64, _vp, _vp, _vp]
    lib.q8_quantize.restype = None
    lib.q4q8_mm.argtypes = [_vp, _vp, _i64, _i64, _i64, _vp, _vp, _vp, _i64, _vp, _int, _int]
    lib.q4q8_mm.restype = None
    return lib


def available() -> bool:
    return library() is not None


def mm(x: torch.Tensor, qweight: torch.Tensor, scales_zeros: torch.Tensor, group_size: int,
       scalar: bool = False) -> torch.Tensor:
    """x [M, K] -> fp32 [M, N] = x @ W^T for an int4pack weight (qweight uint8 [N, K/2] in the AVX512 layout,
    scales_zeros bf16 [K/group_size, N, 2]). `scalar` runs every output through the C scalar path (tests)."""
    lib = library()
    x = x.float().contiguous()
    m, k = x.shape
    n = scales_zeros.shape[1]
    if (qweight.shape != (n, k // 2) or k % group_size or group_size % 4 or qweight.dtype != torch.uint8
            or scales_zeros.dtype != torch.bfloat16 or not (scales_zeros.is_contiguous() and qweight.is_contiguous())
            or not all(t.device.type == "cpu" for t in (x, qweight, scales_zeros))):
        raise ValueError(f"q4q8.mm takes CPU tensors: x [M, K], qweight uint8 [N, K/2], scales_zeros bf16 [K/g, N, 2] "
                         f"contiguous; got x {tuple(x.shape)} on {x.device}, qweight {tuple(qweight.shape)} "
                         f"{qweight.dtype}, scales_zeros {tuple(scales_zeros.shape)} {scales_zeros.dtype}, "
                         f"group {group_size}")
    g = k // group_size
    a = torch.empty(m, k, dtype=torch.int8)
    xs, asum = torch.empty(m, g), torch.empty(m, g)
    y = torch.empty(m, n)
    lib.q8_quantize(x.data_ptr(), m, k, group_size, a.data_ptr(), xs.data_ptr(), asum.data_ptr())
    lib.q4q8_mm(qweight.data_ptr(), scales_zeros.data_ptr(), n, k, group_size, a.data_ptr(), xs.data_ptr(),
                asum.data_ptr(), m, y.data_ptr(), torch.get_num_threads(), int(scalar))
    return y
