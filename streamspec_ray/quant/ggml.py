"""GGUF (ggml) block-quantized rows: dequantized to fp32 in torch, and Q4_K / Q4_0 / Q4_1 blocks read as int4 codes.

Dequantization: bit for bit what gguf-py's numpy dequantizers give. A `gguf` store keeps each matrix as the file's
own blocks: a uint8 tensor [rows, row_bytes] named `<weight name>.<type>` (e.g. `mlp.down_proj.weight.Q6_K`), one
row of blocks per matrix row, so a slab of rows is a slice. A sweep dequantizes a layer's matrices to fp32 here
and then computes exactly as an fp32 store does, whose weights were dequantized at conversion by gguf-py
(`gguf.quants.dequantize`, store/gguf.py). For the two to be equal bit for bit, each function below does gguf-py's
fp32 operations in gguf-py's order: every step is one IEEE operation (exact integer codes, an fp16 -> fp32
widening, one rounded multiply, one rounded add or subtract); torch in eager mode fuses none of them into an FMA,
so the roundings are the same.

Direct int4 (`q4k_to_int4`, `q4_0_to_int4`, `q4_1_to_int4`: `DIRECT`; numpy in, numpy out): the file's 4-bit codes
are the int4 kernel's codes (quant/kernel.py), and only the per-32 scale and offset change form, so an int4pack
store multiplies the file's own codes. `ggml_to_int4` dispatches between them and dequantize + quantize_asym
(bf16) for every other type. The bit unpacking (`_k_scale_min`, `_k_codes4`, `_nibbles`) is written once, on
operators numpy arrays and torch tensors share, and used by both paths.

Block layouts (llama.cpp ggml-common.h; the byte offsets within one block):

  type  values bytes  fields                                          value
  Q8_0    32    34    d f16, qs i8[32]                                d * q
  Q4_0    32    18    d f16, qs[16] (value i: low nibble of byte i,   d * (q - 8)
                      value 16 + i: its high nibble)
  Q4_1    32    20    d f16, m f16, qs[16] as Q4_0                    (d * q) + m
  Q5_0    32    22    d f16, qh u32 (bit i: value i's 5th bit), qs    d * (q - 16)
  Q5_1    32    24    d f16, m f16, qh u32, qs                        (d * q) + m
  Q4_K   256   144    d f16, dmin f16, 12 B of 6-bit scales/mins,     (d * sc[j]) * q - (dmin * m[j])
                      qs[128] (32-byte chunk c: sub-block 2c low nibbles, 2c + 1 high)
  Q5_K   256   176    as Q4_K, then qh[32] (bit j of byte i: value i of sub-block j's 5th bit), qs[128]
  Q6_K   256   210    ql[128], qh[64], scales i8[16], d f16           (d * sc[j]) * (q - 32), j per 16 values

Q4_K in the kernel's form (group 32 = one sub-block j): u = q, scale = d * sc[j], zero = 8 * d * sc[j] - dmin * m[j].
d * sc (11 x 6 significant bits) and dmin * m are exact in fp32, so only zero is rounded (once) before the final
add: on every Q4_K tensor of Qwen2.5-Coder-1.5B checked, (u - 8) * scale + zero equals gguf's dequantization
bitwise; on random blocks (unrelated d and dmin exponents) it is within 1 ulp. Q4_0: u = q, scale = d, zero = 0.
Q4_1: u = q, scale = d, zero = m + 8 d.
"""
from __future__ import annotations

import numpy as np
import torch

# type -> (values per block, bytes per block): gguf-py's GGML_QUANT_SIZES for the types the converter reads
BLOCKS = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
# values dequantized at once, so the temporaries stay in cache whatever the matrix's size (Q4_K 8960 x 1536, one
# core of this busy 2-core VM, best of 3: 38-40 ms at 2^16-2^20 values a step, 58 at 2^22, 100 at 2^24)
CHUNK_VALUES = 1 << 18


def split(name: str) -> tuple[str, str] | None:
    """A store tensor name -> (the weight's name, its block type) for a block tensor, else None:
    "mlp.down_proj.weight.Q6_K" -> ("mlp.down_proj.weight", "Q6_K")."""
    stem, _, qtype = name.rpartition(".")
    return (stem, qtype) if stem and qtype in BLOCKS else None


def block_name(name: str, qtype: str) -> str:
    return f"{name}.{qtype}"


def row_bytes(cols: int, qtype: str) -> int:
    values, size = BLOCKS[qtype]
    if cols % values:
        raise ValueError(f"a {qtype} row of {cols} values is not whole blocks of {values}")
    return cols // values * size


def cols_of(nbytes: int, qtype: str) -> int:
    """Values in a row of `nbytes` bytes of blocks."""
    values, size = BLOCKS[qtype]
    return nbytes // size * values


def dequantize(blocks: torch.Tensor, qtype: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """blocks uint8 [rows, row_bytes] -> fp32 [rows, cols] (into `out`, contiguous, when given), CHUNK_VALUES
    values at a time."""
    rows, nbytes = blocks.shape
    values, size = BLOCKS[qtype]
    if out is None:
        out = torch.empty(rows, cols_of(nbytes, qtype), dtype=torch.float32, device=blocks.device)
    flat_in, flat_out = blocks.reshape(-1, size), out.view(-1, values)  # [blocks, size] -> [blocks, values]
    fn = DEQUANTIZE[qtype]
    step = max(1, CHUNK_VALUES // values)
    for b0 in range(0, flat_in.shape[0], step):
        b1 = min(b0 + step, flat_in.shape[0])
        flat_out[b0:b1] = fn(flat_in[b0:b1])
    return out


def _f16(b):
    """[n, 2] uint8 (little-endian fp16, as ggml stores it) -> [n, 1] fp32 (exact); torch or numpy."""
    if isinstance(b, np.ndarray):
        return np.ascontiguousarray(b).view("<f2").astype(np.float32)
    return b.contiguous().view(torch.float16).float()


def _cat(parts: list, axis: int):
    """torch.cat or np.concatenate, by the parts' type: the bit unpacking below serves both paths."""
    return np.concatenate(parts, axis) if isinstance(parts[0], np.ndarray) else torch.cat(parts, axis)


def _nibbles(qs):
    """[n, 16] bytes -> [n, 32] codes: the 16 low nibbles, then the 16 high ones (the legacy types' order)."""
    return _cat([qs & 0x0F, qs >> 4], 1)


def _qh_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian u32 -> [n, 32] its bits, bit i first (value i's 5th bit)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return ((qh[:, :, None] >> shifts) & 1).reshape(-1, 32)  # byte k's bit s is the u32's bit 8k + s


def q8_0(b: torch.Tensor) -> torch.Tensor:   # [n, 34] -> [n, 32]
    d = _f16(b[:, :2])
    return b[:, 2:].contiguous().view(torch.int8).float() * d


def q4_0(b: torch.Tensor) -> torch.Tensor:   # [n, 18] -> [n, 32]
    d = _f16(b[:, :2])
    return d * (_nibbles(b[:, 2:]).to(torch.int8) - 8).float()


def q4_1(b: torch.Tensor) -> torch.Tensor:   # [n, 20] -> [n, 32]
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return d * _nibbles(b[:, 4:]).float() + m


def q5_0(b: torch.Tensor) -> torch.Tensor:   # [n, 22] -> [n, 32]
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 6:]) | (_qh_bits(b[:, 2:6]) << 4)
    return d * (q.to(torch.int8) - 16).float()


def q5_1(b: torch.Tensor) -> torch.Tensor:   # [n, 24] -> [n, 32]
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 8:]) | (_qh_bits(b[:, 4:8]) << 4)
    return d * q.float() + m


def _k_scale_min(s):
    """Q4_K / Q5_K's 12 bytes uint8 [n, 12] -> the 8 six-bit sub-block scales and mins, each uint8 [n, 8] in 0..63
    (llama.cpp's get_scale_min_k4, gguf-py's get_scale_min): bytes 0-3 scales 0-3 and the top 2 bits of scales
    4-7, bytes 4-7 the same for mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins 4-7 (high
    nibble). torch or numpy."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = _cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], 1)
    mn = _cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], 1)
    return sc, mn


def _k_codes4(qs):
    """[n, 128] -> [n, 8, 32]: chunk c of 32 bytes holds sub-block 2c in its low nibbles, 2c + 1 in its high."""
    qs = qs.reshape(-1, 4, 1, 32)
    return _cat([qs & 0x0F, qs >> 4], 2).reshape(-1, 8, 32)


def q4_k(b: torch.Tensor) -> torch.Tensor:   # [n, 144] -> [n, 256]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    scale = (d * sc.float())[:, :, None]     # [n, 8, 1]: exact (11 x 6 significant bits)
    low = (dmin * mn.float())[:, :, None]
    return (scale * _k_codes4(b[:, 16:]).float() - low).reshape(-1, 256)


def q5_k(b: torch.Tensor) -> torch.Tensor:   # [n, 176] -> [n, 256]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    scale = (d * sc.float())[:, :, None]
    low = (dmin * mn.float())[:, :, None]
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)[None, :, None]
    high = (b[:, None, 16:48] >> shifts) & 1  # [n, 8, 32]: bit j of byte i -> sub-block j, value i
    q = _k_codes4(b[:, 48:]) | (high << 4)
    return (scale * q.float() - low).reshape(-1, 256)


def q6_k(b: torch.Tensor) -> torch.Tensor:   # [n, 210] -> [n, 256]
    ql, qh = b[:, :128].reshape(-1, 2, 1, 64), b[:, 128:192].reshape(-1, 2, 1, 32)
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    d = _f16(b[:, 208:210])
    scale = (d * sc)[:, :, None]  # [n, 16, 1]: one scale per 16 values
    # per half of 128 values: ql's 64 bytes give values 0-63 (low nibbles) and 64-127 (high), qh's 32 bytes the
    # top 2 bits of values 0-31, 32-63, 64-95, 96-127 (bit pairs 0, 2, 4, 6)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device)[None, None, :, None]
    high = ((qh >> shifts) & 3).reshape(-1, 8, 32)
    q = ((low | (high << 4)).to(torch.int8) - 32).reshape(-1, 16, 16).float()
    return (scale * q).reshape(-1, 256)


DEQUANTIZE = {"Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q5_0": q5_0, "Q5_1": q5_1,
              "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}


# ---- GGUF 4-bit blocks read as int4 codes (numpy: the converter reads GGUF tensors as numpy arrays) -----------

def _blocks(blocks: np.ndarray, shape, qtype: str) -> tuple[np.ndarray, int, int]:
    block_values, block_bytes = BLOCKS[qtype]
    n, k = (int(s) for s in shape)
    if k % block_values:
        raise ValueError(f"K={k} is not a multiple of the block size {block_values}")
    b = np.ascontiguousarray(blocks).view(np.uint8).reshape(-1)
    nb = n * (k // block_values)
    if b.size != nb * block_bytes:
        raise ValueError(f"{b.size} bytes for a [{n}, {k}] tensor; expected {nb * block_bytes}")
    return b.reshape(nb, block_bytes), n, k


def q4k_to_int4(blocks: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_K bytes of a [N, K] tensor -> (u uint8 [N, K] in 0..15, scale f32 [N, K/32], zero f32 [N, K/32]).

    blocks: any uint8 array of N * K/256 * 144 bytes (GGUFReader's [N, K/256*144] view, or flat).
    (u - 8) * scale + zero reproduces gguf's fp32 dequantization to ~1 ulp (see the module docstring)."""
    b, n, k = _blocks(blocks, shape, "Q4_K")
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])                 # [nb, 1]
    sc, m = _k_scale_min(b[:, 4:16])                           # [nb, 8]
    scale = d * sc.astype(np.float32)                          # exact: 11 x 6 significant bits
    zero = 8 * scale - dmin * m.astype(np.float32)             # one rounding
    return _k_codes4(b[:, 16:]).reshape(n, k), scale.reshape(n, k // 32), zero.reshape(n, k // 32)


def q4_0_to_int4(blocks: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_0 bytes of a [N, K] tensor -> (u, scale, zero) with group 32 (w = (q - 8) * d: zero = 0)."""
    b, n, k = _blocks(blocks, shape, "Q4_0")
    d = _f16(b[:, 0:2]).reshape(n, k // 32)
    return _nibbles(b[:, 2:]).reshape(n, k), d, np.zeros_like(d)


def q4_1_to_int4(blocks: np.ndarray, shape: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw Q4_1 bytes of a [N, K] tensor -> (u, scale, zero) with group 32 (w = q * d + m: zero = m + 8 d)."""
    b, n, k = _blocks(blocks, shape, "Q4_1")
    d, m = _f16(b[:, 0:2]).reshape(n, k // 32), _f16(b[:, 2:4]).reshape(n, k // 32)
    return _nibbles(b[:, 4:]).reshape(n, k), d, m + 8 * d


DIRECT = {"Q4_K": q4k_to_int4, "Q4_0": q4_0_to_int4, "Q4_1": q4_1_to_int4}


def ggml_to_int4(raw: np.ndarray, qtype, shape: tuple[int, int], group_size: int = 32,
                 shrink=None, refine: int | None = None) -> tuple[np.ndarray | torch.Tensor, ...]:
    """Raw bytes (or values, for float types) of a [N, K] GGUF tensor -> (u, scale, zero) for the int4 kernel.

    Q4_K / Q4_0 / Q4_1 at group_size 32 map directly (codes kept, nothing requantized); everything else, or
    another group size, is dequantized with gguf-py and requantized by quantize_asym at bf16 (torch tensors out).
    Row permutations a converter applies (Llama's q/k) apply to u, scale and zero rows alike."""
    from .int4 import quantize_asym

    name = getattr(qtype, "name", str(qtype))
    if name in DIRECT and group_size == 32:
        return DIRECT[name](raw, shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize
    qt = qtype if not isinstance(qtype, str) else GGMLQuantizationType[qtype]
    w = gguf_dequantize(np.asarray(raw), qt).reshape(shape)
    return quantize_asym(torch.from_numpy(np.ascontiguousarray(w, np.float32)), group_size, torch.bfloat16,
                         shrink, refine)
