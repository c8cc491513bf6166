"""DeepSeek V2/V3 decoder: MLA attention (models/mla.py) and a dense MLP or a routed MoE (models/moe.py).

Same contract as models/llama.py: weights arrive as `{hf_local_name: tensor}` per decoder layer (attention,
norms, router, shared experts, or the dense MLP of the first_k_dense_replace layers); routed experts are not
in the layer's unit but come from an ExpertProvider, so a streamed sweep reads only the experts it routes to.
The cache is a runtime.kvcache.LatentCache: per layer and token only c_kv [kv_lora_rank] and k_pe [dr].
"""
from __future__ import annotations

import torch

from ..config import ModelArgs
from . import mla, moe
from .llama import head, prepare_chunk, rms_norm


class RopeState:
    """What a DeepSeek sweep needs for positions: YaRN-aware frequencies, cos/sin factor, softmax scale."""

    def __init__(self, args: ModelArgs, device="cpu"):
        inv, self.attention_factor = mla.rope_params(args)
        self.inv_freq = inv.to(device)
        self.scale = mla.softmax_scale(args)

    def tables(self, positions: torch.Tensor, dtype):
        return mla.rope_tables(self.inv_freq, self.attention_factor, positions, dtype)


def decoder_layer(args: ModelArgs, w: dict, layer: int, h: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                  start: int, cos, sin, mask: torch.Tensor, scale: float, experts: moe.ExpertProvider,
                  absorb: bool | None = None) -> torch.Tensor:
    """One pre-norm layer (the model's layer number `layer`) over a chunk: h [T, hidden] -> [T, hidden];
    ckv [capacity, r] / kpe [capacity, dr] this layer's latent cache."""
    x = rms_norm(h, w["input_layernorm.weight"], args.rms_norm_eps)
    h = h + mla.attention(args, w, x, ckv, kpe, start, cos, sin, mask, scale, absorb)
    x = rms_norm(h, w["post_attention_layernorm.weight"], args.rms_norm_eps)
    if args.is_moe_layer(layer):
        return h + moe.moe(args, w, x, layer, experts)
    return h + moe.mlp(w, x, "mlp.")


def forward(args: ModelArgs, embed: torch.Tensor, rope: RopeState, units, ids: torch.Tensor, cache,
            experts: moe.ExpertProvider, positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
            logits_from: int = 0, absorb: bool | None = None) -> torch.Tensor:
    """As llama.forward: a chunk of ids [T] through every layer from `units` (streamed or resident), new
    latents at slots cache.length .. +T; returns logits [T - logits_from, vocab] fp32."""
    T, start = ids.numel(), cache.length
    dev = embed.device
    positions, full_mask = prepare_chunk(cache, T, positions, mask, dev)
    cos, sin = rope.tables(positions.to(dev), embed.dtype)
    h = embed[ids.to(dev)]
    logits = None
    i = 0
    for name, w in units:
        if name == "head":
            logits = head(args, w, h[logits_from:], embed)
        else:
            # the model's layer number (from "layer.007"): a skip draft holds a subset, cache slot i != layer
            h = decoder_layer(args, w, int(name.split(".")[1]), h, cache.ckv[i], cache.kpe[i], start, cos, sin,
                              full_mask, rope.scale, experts, absorb)
        del w  # drop this layer before asking for the next one, so a memory budget can make room
        i += 1
    cache.length = start + T
    return logits


class ResidentExperts:
    """An ExpertProvider over experts held in memory: {(layer, expert): weights}."""

    def __init__(self, table: dict[tuple[int, int], dict]):
        self.table = table

    def __call__(self, layer: int, ids: list[int]):
        for e in ids:
            yield e, self.table[(layer, e)]
