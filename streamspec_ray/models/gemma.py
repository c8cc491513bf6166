"""Gemma 3 decoder math on plain weight dicts, as llama.py (attention, projections, chunks and the sweep loops
shared in models/layers.py). Where Gemma 3 differs from the Llama family:

- RMSNorm scales by (1 + weight), in fp32, and casts after the scale (Llama casts first);
- q and k get an RMSNorm over head_dim before rope ("QK-norm");
- attention output and MLP output are normed again before each residual add (four norms per layer);
- the MLP is GeGLU: gelu(gate, tanh approximation) * up;
- the embedding is scaled by sqrt(hidden) (rounded to the compute dtype first, as transformers does);
- sliding-window layers (a query at position q sees keys at positions q - window < k <= q) with their own
  rope base, interleaved with global layers (five to one in Gemma 3): see layers.sliding_mask;
- attention scale query_pre_attn_scalar ** -0.5, and optional final logit soft-capping.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import ModelArgs
from . import layers, rope
from .family import Family
from .layers import Chunk, _apply, _attend, _linear, attend_spans, batch_invariant


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


def scale_embed(args: ModelArgs, h: torch.Tensor) -> torch.Tensor:
    return h * torch.tensor(args.hidden_size ** 0.5, dtype=h.dtype, device=h.device)


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


def forward(args: ModelArgs, embed: torch.Tensor, inv_freq: torch.Tensor, units, ids: torch.Tensor, cache,
            positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
            logits_from: int = 0, experts=None, on_hidden=None, hidden=None) -> torch.Tensor:
    """As llama.forward, with Gemma's layers, head and scaled embedding (sliding layers: layers._tables)."""
    return layers.forward(args, embed, inv_freq, units, ids, cache, positions, mask, logits_from, decoder_layer, head,
                          scale_embed, hidden)


def forward_batch(args: ModelArgs, embed: torch.Tensor, inv_freq: torch.Tensor, units, chunks: list[Chunk],
                  experts=None, hidden=None) -> list[torch.Tensor]:
    """As llama.forward_batch."""
    return layers.forward_batch(args, embed, inv_freq, units, chunks, batch_layer, head, scale_embed, hidden)


def hf_config(args: ModelArgs, rope_parameters: dict) -> dict:
    """transformers' Gemma3TextConfig fields beyond the common ones (hfref.py): both layer kinds' rope, the
    layer kinds and window, the activation, the query scale and the logit soft-capping."""
    return dict(rope_parameters={"full_attention": rope_parameters,
                                 "sliding_attention": {"rope_type": "default", "rope_theta": args.rope_local_theta}},
                layer_types=args.layer_types, sliding_window=args.sliding_window, hidden_activation=args.hidden_act,
                query_pre_attn_scalar=args.query_pre_attn_scalar,
                final_logit_softcapping=args.final_logit_softcapping)


FAMILY = Family("gemma", new_cache=layers.kv_cache, rope=layers.rope_state, forward=forward,
                forward_batch=forward_batch, hf_config=hf_config)
