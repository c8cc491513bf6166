"""Llama-family decoder math (Llama, SmolLM2, Qwen2, Mistral) on plain weight dicts.

The functions know nothing about where weights come from: the executor hands each decoder layer's weights
in as `{hf_local_name: tensor}` (e.g. "self_attn.q_proj.weight"), already materialized in the compute dtype,
so a streamed layer, a resident draft layer and an INT4 layer all run the same code. Biases are used when
the shard has them (Qwen2's q/k/v biases, attention_bias Llamas). Attention against the cache, chunks and the
sweep loops are shared with the other families (models/layers.py); FAMILY at the end describes this one.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import quant
from ..config import ModelArgs
from . import layers, rope
from .family import Family
from .layers import Chunk, _attend, _linear, attend_spans, batch_invariant, head, rms_norm


def attention(args: ModelArgs, w: dict, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              start: int, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x [T, hidden]; k_cache/v_cache [n_kv, capacity, head_dim], new K/V written at slots start..start+T;
    mask [T, start+T] bool (True = may attend)."""
    q, k, v = _qkv(args, w, x, cos, sin)
    att = _attend(q, k, v, k_cache, v_cache, start, mask, rowwise=batch_invariant(w))
    return _linear(att, w, "self_attn.o_proj")


def _qkv(args: ModelArgs, w: dict, x: torch.Tensor, cos, sin):
    """x [T, hidden] -> roped q [H, T, hd], roped k and v [n_kv, T, hd]."""
    T, hd = x.shape[0], args.head_dim
    if "self_attn.qkv_proj.weight" in w:  # fused (see fuse)
        n_kv = args.num_key_value_heads * hd
        q, k, v = _linear(x, w, "self_attn.qkv_proj").split([args.num_attention_heads * hd, n_kv, n_kv], dim=-1)
    else:
        q, k, v = (_linear(x, w, f"self_attn.{n}_proj") for n in "qkv")
    q = q.view(T, args.num_attention_heads, hd).transpose(0, 1)
    k = k.view(T, args.num_key_value_heads, hd).transpose(0, 1)
    v = v.view(T, args.num_key_value_heads, hd).transpose(0, 1)
    q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
    return q, k, v


def decoder_layer(args: ModelArgs, w: dict, h: torch.Tensor, k_cache, v_cache, start, cos, sin, mask):
    """One pre-norm decoder layer over a chunk: h [T, hidden] -> [T, hidden]."""
    h = h + attention(args, w, rms_norm(h, w["input_layernorm.weight"], args.rms_norm_eps),
                      k_cache, v_cache, start, cos, sin, mask)
    return _mlp_block(args, w, h)


def _mlp_block(args: ModelArgs, w: dict, h: torch.Tensor) -> torch.Tensor:
    x = rms_norm(h, w["post_attention_layernorm.weight"], args.rms_norm_eps)
    if "mlp.gate_up_proj.weight" in w:  # fused (see fuse)
        gate, up = _linear(x, w, "mlp.gate_up_proj").chunk(2, dim=-1)
    else:
        gate, up = _linear(x, w, "mlp.gate_proj"), _linear(x, w, "mlp.up_proj")
    return h + _linear(F.silu(gate) * up, w, "mlp.down_proj")


FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def unfuse(args: ModelArgs, w: dict) -> dict:
    """The inverse of fuse: each joined weight taken apart into its parts' rows of codes and scales (copies:
    the kernel reads its scales as a contiguous [groups, rows, 2] array)."""
    hd = args.head_dim
    sizes = {"self_attn.qkv_proj": [args.num_attention_heads * hd] + [args.num_key_value_heads * hd] * 2,
             "mlp.gate_up_proj": [args.intermediate_size] * 2}
    out = dict(w)
    for fused, parts in FUSED.items():
        if fused + ".weight" not in w:
            continue
        j, b = out.pop(fused + ".weight"), out.pop(fused + ".bias", None)
        for i, (p, part) in enumerate(zip(parts, quant.split_rows(j, sizes[fused]))):
            out[p + ".weight"] = part
            if b is not None:
                out[p + ".bias"] = b.split(sizes[fused])[i]
    return out


def fuse(w: dict) -> dict:
    """A resident layer's int4 kernel weights with q/k/v and gate/up each joined into one (quant.join_rows):
    the same outputs bit for bit, in 4 kernel calls per layer instead of 7. Other layers (dense weights, a
    layer already fused) come back as they are. A fused layer owns all its tensors (copies), so a read buffer
    that its unfused weights were views of is not kept alive beside the joined copies."""
    out = dict(w)
    done = False
    for fused, parts in FUSED.items():
        joined = quant.join_rows([w.get(p + ".weight") for p in parts])
        biases = [w.get(p + ".bias") for p in parts]
        if joined is None or (any(b is not None for b in biases) and any(b is None for b in biases)):
            continue
        for p in parts:
            out.pop(p + ".weight")
            out.pop(p + ".bias", None)
        out[fused + ".weight"] = joined
        if biases[0] is not None:
            out[fused + ".bias"] = torch.cat(biases)
        done = True
    if not done:
        return w
    return {n: quant.owned(t) for n, t in out.items()}


def forward(args: ModelArgs, embed: torch.Tensor, inv_freq: torch.Tensor, units, ids: torch.Tensor, cache,
            positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
            logits_from: int = 0, experts=None, on_hidden=None, hidden=None) -> torch.Tensor:
    """Run a chunk of new tokens ids [T] through the model and commit them to the cache.

    `units` yields (name, weights) for every decoder layer in order and then "head": a streamed UnitStream
    or a resident list, the maths is the same. New K/V go to slots cache.length .. cache.length+T.
    positions [T] (default: the slots) and mask [T, T] over the chunk (default causal; a tree passes
    ancestors) let a token tree share one pass. Returns logits [T - logits_from, vocab] fp32. (experts,
    on_hidden: the Family interface's, see deepseek.forward; a dense model routes to no experts, and no draft
    reads its hidden states.)"""
    return layers.forward(args, embed, inv_freq, units, ids, cache, positions, mask, logits_from, decoder_layer, head,
                          hidden=hidden)


def forward_batch(args: ModelArgs, embed: torch.Tensor, inv_freq: torch.Tensor, units, chunks: list[Chunk],
                  experts=None, hidden=None) -> list[torch.Tensor]:
    """forward for several sequences at once, each layer taken from `units` once for all of them (see
    layers.forward_batch): each chunk's logits [T_i - logits_from_i, vocab] fp32, in order."""
    return layers.forward_batch(args, embed, inv_freq, units, chunks, batch_layer, head, hidden=hidden)


def batch_layer(args: ModelArgs, w: dict, h: torch.Tensor, layer: int, spans, cos, sin) -> torch.Tensor:
    """decoder_layer over a ragged batch h [sum T, hidden]: one matmul per projection for all rows, attention
    per sequence (q/k/v rows o..o+T against that sequence's cache at `layer`)."""
    q, k, v = _qkv(args, w, rms_norm(h, w["input_layernorm.weight"], args.rms_norm_eps), cos, sin)
    att = attend_spans(q, k, v, layer, spans, None, batch_invariant(w))  # [sum T, H * hd]
    return _mlp_block(args, w, h + _linear(att, w, "self_attn.o_proj"))


FAMILY = Family("llama", new_cache=layers.kv_cache, rope=layers.rope_state, forward=forward,
                forward_batch=forward_batch, prepare=fuse)
