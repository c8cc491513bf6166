"""Gemma 3 decoder math on plain weight dicts, as llama.py (whose attention, projections and chunk handling it
shares). Where Gemma 3 differs from the Llama family:

- RMSNorm scales by (1 + weight), in fp32, and casts after the scale (Llama casts first);
- q and k get an RMSNorm over head_dim before rope ("QK-norm");
- attention output and MLP output are normed again before each residual add (four norms per layer);
- the MLP is GeGLU: gelu(gate, tanh approximation) * up;
- the embedding is scaled by sqrt(hidden) (rounded to the compute dtype first, as transformers does);
- sliding-window layers (a query at position q sees keys at positions q - window < k <= q) with their own
  rope base, interleaved with global layers (five to one in Gemma 3): see `sliding_mask`;
- attention scale query_pre_attn_scalar ** -0.5, and optional final logit soft-capping.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelArgs
from . import rope
from .llama import _apply, _attend, _linear, attend_spans, batch_invariant


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def scale_embed(args: ModelArgs, h: torch.Tensor) -> torch.Tensor:
    return h * torch.tensor(args.hidden_size ** 0.5, dtype=h.dtype, device=h.device)


def local_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Sliding layers' rope: the local base, no scaling (transformers' "sliding_attention" parameters)."""
    return rope.inv_freq(args, theta=args.rope_local_theta, scaled=False)


def sliding_mask(mask: torch.Tensor, positions: torch.Tensor, start: int, window: int) -> torch.Tensor:
    """mask [T, start + T] limited to the window: key slots < start count at their slot (the committed
    prefix, whose slot is its position), the chunk's keys at their own positions (a tree's depths).
    (A draft growing a tree over several calls keeps earlier nodes at slots past the committed prefix; they
    count at their slot, which can only widen the window for those few keys: draft guesses, never the
    verified output.)"""
    positions = positions.to(mask.device)
    keys = torch.cat([torch.arange(start, device=mask.device), positions])
    return mask & ((positions[:, None] - keys[None, :]) < window)


def _qkv(args: ModelArgs, w: dict, x: torch.Tensor, cos, sin):
    T, hd = x.shape[0], args.head_dim
    q = _linear(x, w, "self_attn.q_proj").view(T, args.num_attention_heads, hd).transpose(0, 1)
    k = _linear(x, w, "self_attn.k_proj").view(T, args.num_key_value_heads, hd).transpose(0, 1)
    v = _linear(x, w, "self_attn.v_proj").view(T, args.num_key_value_heads, hd).transpose(0, 1)
    q = norm(q, w["self_attn.q_norm.weight"], args.rms_norm_eps)
    k = norm(k, w["self_attn.k_norm.weight"], args.rms_norm_eps)
    return rope.apply(q, cos, sin), rope.apply(k, cos, sin), v


def _scale(args: ModelArgs) -> float:
    return (args.query_pre_attn_scalar or args.head_dim) ** -0.5


def _mlp_block(args: ModelArgs, w: dict, h: torch.Tensor) -> torch.Tensor:
    x = norm(h, w["pre_feedforward_layernorm.weight"], args.rms_norm_eps)
    x = F.gelu(_linear(x, w, "mlp.gate_proj"), approximate="tanh") * _linear(x, w, "mlp.up_proj")
    return h + norm(_linear(x, w, "mlp.down_proj"), w["post_feedforward_layernorm.weight"], args.rms_norm_eps)


def _attn_out(args: ModelArgs, w: dict, h: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
    return h + norm(_linear(att, w, "self_attn.o_proj"), w["post_attention_layernorm.weight"], args.rms_norm_eps)


def decoder_layer(args: ModelArgs, w: dict, h: torch.Tensor, k_cache, v_cache, start, cos, sin, mask):
    """As llama.decoder_layer (cos, sin and mask: this layer's, sliding or global)."""
    q, k, v = _qkv(args, w, norm(h, w["input_layernorm.weight"], args.rms_norm_eps), cos, sin)
    h = _attn_out(args, w, h, _attend(q, k, v, k_cache, v_cache, start, mask, _scale(args), batch_invariant(w)))
    return _mlp_block(args, w, h)


def batch_layer(args: ModelArgs, w: dict, h: torch.Tensor, layer: int, spans, cos, sin) -> torch.Tensor:
    """As llama.batch_layer."""
    q, k, v = _qkv(args, w, norm(h, w["input_layernorm.weight"], args.rms_norm_eps), cos, sin)
    att = attend_spans(q, k, v, layer, spans, _scale(args), batch_invariant(w))
    return _mlp_block(args, w, _attn_out(args, w, h, att))


def head(args: ModelArgs, w: dict, h: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    logits = _apply(w.get("lm_head.weight", embed), norm(h, w["norm.weight"], args.rms_norm_eps)).float()
    cap = args.final_logit_softcapping
    return logits if not cap else torch.tanh(logits / cap) * cap
