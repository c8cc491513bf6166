"""Multi-head Latent Attention (DeepSeek V2/V3), on plain weight dicts.

Each token's keys and values are generated from one small latent: kv_a_proj_with_mqa maps h [hidden] to
c_kv [kv_lora_rank] (then RMS-normed) and one rope key k_pe [qk_rope_head_dim] shared by all heads. The cache
holds only (c_kv, k_pe) per token; kv_b_proj [H * (dn + dv), r] expands c_kv into per-head k_nope [dn] and v [dv].

Two exact ways to attend over the cache (they agree to float rounding; tests check it):
  naive     expand every cached c_kv into K/V ([S, H, dn + dv]) and attend: cheap for a long chunk (prefill),
            whose own queries outnumber nothing and amortize the expansion.
  absorbed  fold kv_b_proj into the query and the output instead (mlx-lm / the DeepSeek-V2 paper, appendix):
              q_nope . k_nope = q_nope . (W_uk c) = (W_uk^T q_nope) . c       W_uk [H, dn, r]
              o = sum_s p_s W_uv c_s = W_uv (sum_s p_s c_s)                     W_uv [H, dv, r]
            so attention runs in the r-dim latent space and nothing of size S x H x d is built: the decode path.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import ModelArgs
from ..errors import ConfigError
from .layers import _linear, rms_norm
from .rope import rotate_half

ABSORB_MAX_T = 8  # chunks up to this many tokens (decode, verification of short drafts) use the absorbed path


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_params(args: ModelArgs) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [dr / 2] fp32, attention_factor): default rope or YaRN, as transformers computes them for
    DeepSeek (head_dim = qk_rope_head_dim). The factor multiplies cos and sin, i.e. both q_pe and k_pe."""
    dim, base = args.qk_rope_head_dim, args.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    rs = args.rope_scaling
    if not rs:
        return 1.0 / pos_freqs, 1.0
    kind = rs.get("rope_type", rs.get("type"))
    if kind != "yarn":
        raise ConfigError(f"unsupported rope scaling {kind!r} for {args.model_type} (supported: default, yarn)")
    old = rs["original_max_position_embeddings"]
    factor = rs.get("factor") or args.max_position_embeddings / old
    attn = rs.get("attention_factor")
    if attn is None:
        m, m_all = rs.get("mscale"), rs.get("mscale_all_dim")
        attn = _mscale(factor, m) / _mscale(factor, m_all) if m and m_all else _mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def corr_dim(rot):  # the dimension whose wavelength makes `rot` turns over the original context
        return dim * math.log(old / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrap = 1 - ramp  # 1: keep the original frequency (high freqs), 0: interpolate by `factor` (low freqs)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    return inv, float(attn)


def softmax_scale(args: ModelArgs) -> float:
    """1/sqrt(dn + dr), times mscale(factor, mscale_all_dim)^2 under YaRN (transformers' yarn_apply_mscale)."""
    scale = (args.qk_nope_head_dim + args.qk_rope_head_dim) ** -0.5
    rs = args.rope_scaling
    if rs and rs.get("rope_type", rs.get("type")) != "default" and rs.get("mscale_all_dim"):
        m = _mscale(rs["factor"], rs["mscale_all_dim"])
        scale *= m * m
    return scale


def rope_tables(inv_freq: torch.Tensor, attention_factor: float, positions: torch.Tensor, dtype):
    """positions [T] -> cos, sin [T, dr] (halves repeated for rotate_half), already times attention_factor."""
    ang = positions.to(inv_freq.device, torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    return (emb.cos() * attention_factor).to(dtype), (emb.sin() * attention_factor).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [..., T, dr]. Interleaved rope rotates pairs (x0, x1), (x2, x3), ...; gathering evens then odds turns
    it into the usual half-split rotation. q and k get the same permutation, so q.k is unchanged, and the
    result is exactly transformers' apply_rotary_pos_emb_interleave (which outputs this layout too)."""
    if interleave:
        x = torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)
    return x * cos + rotate_half(x) * sin


def attention(args: ModelArgs, w: dict, x: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
              start: int, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, scale: float,
              absorb: bool | None = None) -> torch.Tensor:
    """x [T, hidden] (normed); ckv_cache [capacity, r], kpe_cache [capacity, dr], this chunk written at slots
    start..start+T; mask [T, start+T] bool. absorb None: absorbed for chunks of at most ABSORB_MAX_T tokens."""
    out = attend(args, w, *project(args, w, x, cos, sin), ckv_cache, kpe_cache, start, mask, scale, absorb)
    return _linear(out, w, "self_attn.o_proj")


def project(args: ModelArgs, w: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """The row-wise part of attention, for any rows (a ragged batch's too): x [T, hidden] (normed) ->
    q_nope [H, T, dn], roped q_pe [H, T, dr], normed c_kv [T, r], roped k_pe [T, dr]."""
    T, H = x.shape[0], args.num_attention_heads
    dn, dr, r = args.qk_nope_head_dim, args.qk_rope_head_dim, args.kv_lora_rank
    if args.q_lora_rank:
        q = _linear(rms_norm(_linear(x, w, "self_attn.q_a_proj"), w["self_attn.q_a_layernorm.weight"],
                             args.rms_norm_eps), w, "self_attn.q_b_proj")
    else:
        q = _linear(x, w, "self_attn.q_proj")
    q = q.view(T, H, dn + dr).transpose(0, 1)                       # [H, T, dn + dr]
    kv = _linear(x, w, "self_attn.kv_a_proj_with_mqa")               # [T, r + dr]
    return (q[..., :dn], apply_rope(q[..., dn:], cos, sin, args.rope_interleave),
            rms_norm(kv[:, :r], w["self_attn.kv_a_layernorm.weight"], args.rms_norm_eps),
            apply_rope(kv[:, r:], cos, sin, args.rope_interleave))


def attend(args: ModelArgs, w: dict, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_new: torch.Tensor,
           kpe_new: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor, start: int, mask: torch.Tensor,
           scale: float, absorb: bool | None = None) -> torch.Tensor:
    """One sequence's chunk (project's outputs for its T rows) against its own cache: writes its latents at
    slots start..start+T, attends under mask [T, start+T] -> [T, H * dv] (before o_proj). absorb None: by this
    chunk's own T, so a sequence attends alike alone or in a batch."""
    H, T = q_nope.shape[0], q_nope.shape[1]
    dn, dv, r = args.qk_nope_head_dim, args.v_head_dim, args.kv_lora_rank
    end = start + T
    ckv_cache[start:end] = ckv_new  # written by slot: a later rollback just moves the cache length back
    kpe_cache[start:end] = kpe_new
    ckv, kpe = ckv_cache[:end], kpe_cache[:end]                     # [S, r], [S, dr]
    kv_b = w["self_attn.kv_b_proj.weight"]
    if absorb is None:
        absorb = T <= ABSORB_MAX_T and isinstance(kv_b, torch.Tensor)
    if absorb:
        wkv = kv_b.view(H, dn + dv, r)
        w_uk, w_uv = wkv[:, :dn], wkv[:, dn:]                        # [H, dn, r], [H, dv, r]
        q_lat = q_nope @ w_uk                                        # [H, T, r]
        scores = (q_lat @ ckv.T + q_pe @ kpe.T) * scale              # [H, T, S]
        scores = scores.masked_fill(~mask, float("-inf"))
        p = torch.softmax(scores.float(), dim=-1).to(q_nope.dtype)
        out = (p @ ckv) @ w_uv.transpose(1, 2)                       # [H, T, r] -> [H, T, dv]
    else:
        kvx = _linear(ckv, w, "self_attn.kv_b_proj").view(-1, H, dn + dv).transpose(0, 1)  # [H, S, dn + dv]
        k = torch.cat([kvx[..., :dn], kpe[None].expand(H, -1, -1)], dim=-1)               # [H, S, dn + dr]
        qf = torch.cat([q_nope, q_pe], dim=-1)
        out = F.scaled_dot_product_attention(qf[None], k[None], kvx[None, ..., dn:], attn_mask=mask[None, None],
                                             scale=scale)[0]        # [H, T, dv]
    return out.transpose(0, 1).reshape(T, H * dv)
