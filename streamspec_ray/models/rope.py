"""Rotary position embeddings: default, linear and llama3 frequency scaling (as Hugging Face computes them)."""
from __future__ import annotations

import math

import torch

from ..config import ModelArgs
from ..errors import ConfigError


def inv_freq(args: ModelArgs, dim: int | None = None, theta: float | None = None, scaled: bool = True) -> torch.Tensor:
    """[dim / 2] inverse frequencies, fp32 (theta: another base than rope_theta; scaled False: no rope_scaling)."""
    dim = dim or args.head_dim
    base = 1.0 / ((theta or args.rope_theta) ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = args.rope_scaling if scaled else None
    if not rs:
        return base
    kind = rs.get("rope_type", rs.get("type"))
    if kind == "linear":
        return base / rs["factor"]
    if kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
        factor, low, high = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"]
        old = rs["original_max_position_embeddings"]
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > old / low, base / factor, base)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(medium, smoothed, scaled)
    raise ConfigError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")


def local_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Sliding-window layers' rope (Gemma 3's): the local base, no scaling (transformers' "sliding_attention")."""
    return inv_freq(args, theta=args.rope_local_theta, scaled=False)


def cos_sin(freqs: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, dim] (the two halves repeat, matching rotate_half)."""
    ang = positions.to(freqs.device, torch.float32)[:, None] * freqs[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, T, dim], cos/sin [T, dim]."""
    return x * cos + rotate_half(x) * sin
