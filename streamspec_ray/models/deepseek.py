"""DeepSeek V2/V3 decoder: MLA attention (models/mla.py) and a dense MLP or a routed MoE (models/moe.py).

Same contract as models/llama.py: weights arrive as `{hf_local_name: tensor}` per decoder layer (attention,
norms, router, shared experts, or the dense MLP of the first_k_dense_replace layers); routed experts are not
in the layer's unit but come from an ExpertProvider, so a streamed sweep reads only the experts it routes to.
The cache is a runtime.kvcache.LatentCache: per layer and token only c_kv [kv_lora_rank] and k_pe [dr].
forward_batch runs a ragged batch as llama.forward_batch does; forward is it with one chunk.
"""
from __future__ import annotations

import torch

from ..config import ModelArgs
from ..runtime.kvcache import LatentCache
from . import mla, moe
from .family import Family
from .layers import Chunk, _linear, head, layer_number, prepare_batch, rms_norm


class RopeState:
    """What a DeepSeek sweep needs for positions: YaRN-aware frequencies, cos/sin factor, softmax scale."""

    def __init__(self, args: ModelArgs, device="cpu"):
        inv, self.attention_factor = mla.rope_params(args)
        self.inv_freq = inv.to(device)
        self.scale = mla.softmax_scale(args)

    def tables(self, positions: torch.Tensor, dtype):
        return mla.rope_tables(self.inv_freq, self.attention_factor, positions, dtype)


def batch_layer(args: ModelArgs, w: dict, layer: int, h: torch.Tensor, slot: int, spans, cos, sin, scale: float,
                experts: moe.ExpertProvider, absorb: bool | None = None) -> torch.Tensor:
    """One pre-norm layer (the model's layer number `layer`, cache slot `slot`: a skip draft holds a subset) over
    a ragged batch h [sum T, hidden] -> [sum T, hidden]. Projections, norms, the router and the experts run once
    over all rows (one provider call for the union the batch routed to); MLA attention per sequence, rows
    o..o+T against that sequence's latent cache under its own mask (spans: layers.prepare_batch's)."""
    x = rms_norm(h, w["input_layernorm.weight"], args.rms_norm_eps)
    q_nope, q_pe, ckv, kpe = mla.project(args, w, x, cos, sin)
    att = torch.cat([mla.attend(args, w, q_nope[:, o : o + T], q_pe[:, o : o + T], ckv[o : o + T], kpe[o : o + T],
                                cache.ckv[slot], cache.kpe[slot], start, mask, scale, absorb)
                     for cache, start, o, T, mask in spans])          # [sum T, H * dv]
    h = h + _linear(att, w, "self_attn.o_proj")
    x = rms_norm(h, w["post_attention_layernorm.weight"], args.rms_norm_eps)
    if args.is_moe_layer(layer):
        return h + moe.moe(args, w, x, layer, experts)
    return h + moe.mlp(w, x, "mlp.")


def forward(args: ModelArgs, embed: torch.Tensor, rope: RopeState, units, ids: torch.Tensor, cache,
            experts: moe.ExpertProvider, positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
            logits_from: int = 0, absorb: bool | None = None, on_hidden=None, hidden=None) -> torch.Tensor:
    """As llama.forward: a chunk of ids [T] through every layer from `units` (streamed or resident), new
    latents at slots cache.length .. +T; returns logits [T - logits_from, vocab] fp32, or a stage's hidden
    states (see layers.forward). (forward_batch of one chunk: the same maths.)"""
    out = forward_batch(args, embed, rope, units, [Chunk(ids, cache, positions, mask, logits_from)], experts,
                        absorb, on_hidden, hidden)
    return out if isinstance(out, torch.Tensor) else out[0]


def forward_batch(args: ModelArgs, embed: torch.Tensor, rope: RopeState, units, chunks: list[Chunk],
                  experts: moe.ExpertProvider, absorb: bool | None = None, on_hidden=None,
                  hidden=None) -> list[torch.Tensor] | torch.Tensor:
    """As llama.forward_batch, over each chunk's own LatentCache: every layer taken from `units` once for all
    sequences, and a MoE layer's routed experts asked of `experts` once for the whole batch. Returns each
    chunk's logits [T_i - logits_from_i, vocab] fp32, in order. absorb None: each sequence by its own T.
    on_hidden(positions [sum T], h [sum T, hidden]): shown every row's final hidden state, normed as the head
    sees it (the mtp draft predicts from them). A stage (layers.forward_batch) takes `hidden` and, without the
    head, returns hidden states [sum T, hidden]."""
    src = embed if hidden is None else hidden
    dev = src.device
    spans, positions, rows = prepare_batch(chunks, dev)
    cos, sin = rope.tables(torch.cat(positions).to(dev), src.dtype)  # [sum T, dr]
    h = embed[torch.cat([c.ids for c in chunks]).to(dev)] if hidden is None else hidden
    logits = None
    i = 0  # (no enumerate: it keeps its last result alive, and with it the previous layer's weights)
    for name, w in units:
        if name == "head":
            if on_hidden is not None:
                on_hidden(torch.cat(positions), rms_norm(h, w["norm.weight"], args.rms_norm_eps))
            logits = head(args, w, h[torch.cat(rows).to(dev)], embed)
        else:  # the model's layer number from "layer.007": a skip draft's cache slot i is not always it
            h = batch_layer(args, w, layer_number(name), h, i, spans, cos, sin, rope.scale, experts, absorb)
        del w  # drop this layer before asking for the next one, so a memory budget can make room
        i += 1
    for cache, start, _, T, _ in spans:
        cache.length = start + T
    return h if logits is None else list(logits.split([len(r) for r in rows]))


class ResidentExperts:
    """An ExpertProvider over experts held in memory: {(layer, expert): weights}."""

    def __init__(self, table: dict[tuple[int, int], dict]):
        self.table = table

    def __call__(self, layer: int, ids: list[int]):
        for e in ids:
            yield e, self.table[(layer, e)]


def resident_experts(units: list[tuple[str, dict]]) -> tuple[ResidentExperts, list[tuple[str, dict]]]:
    """A resident draft's units -> (its routed experts, the "expert.LLL.EEE" units, as a ResidentExperts table
    keyed (layer, expert); the other units in order)."""
    table = {tuple(int(x) for x in n.split(".")[1:]): w for n, w in units if n.startswith("expert.")}
    return ResidentExperts(table), [(n, w) for n, w in units if not n.startswith("expert.")]


def new_cache(args: ModelArgs, layers: int, dtype, device) -> LatentCache:
    return LatentCache(layers, args.kv_lora_rank, args.qk_rope_head_dim, dtype, device)


FAMILY = Family("deepseek", new_cache=new_cache, rope=RopeState, forward=forward, forward_batch=forward_batch,
                resident_experts=resident_experts)
