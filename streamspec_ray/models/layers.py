"""What the model families share, on plain weight dicts: projections, the RMSNorm, attention of a chunk against its
own cache, chunks and ragged batches, and the sweep loops of the dense-attention families (llama.py, gemma.py),
which pass in their own layer and head maths.

Weights arrive per unit as `{hf_local_name: tensor}` (e.g. "self_attn.q_proj.weight"), already materialized in the
compute dtype, or as a packed weight that computes its own matmul (quant.PackedInt4): a streamed layer, a
resident draft layer and an INT4 layer all run the same code.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ModelArgs
from ..quant import linear, row_invariant
from ..runtime.kvcache import KVCache
from . import rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # as HF: normalize in fp32, scale in the input dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _apply(weight, x: torch.Tensor, bias=None) -> torch.Tensor:
    return linear(x, weight, bias)  # a tensor, or a weight that computes its own matmul (quant.PackedInt4...)


def _linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    return _apply(w[name + ".weight"], x, w.get(name + ".bias"))


def head(args: ModelArgs, w: dict, h: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    """Final norm and LM head: h [T, hidden] -> logits [T, vocab] (fp32). Tied models reuse the embedding."""
    x = rms_norm(h, w["norm.weight"], args.rms_norm_eps)
    return _apply(w.get("lm_head.weight", embed), x).float()


def _attend(q, k, v, k_cache, v_cache, start: int, mask, scale: float | None = None,
            rowwise: bool = False) -> torch.Tensor:
    """One sequence's chunk against its own cache: q [H, T, hd], k/v [n_kv, T, hd] -> [T, H * hd]
    (mask: the chunk's RowKeys; scale None: 1 / sqrt(hd)).

    rowwise: each query row attends on its own, over exactly the keys its mask allows, in slot order: the same
    call on the same keys as when the row is the only token of a sweep, so its result does not depend on what
    else shares the sweep. One batched call over the chunk gives the same values only up to rounding (~5e-7),
    which is harmless in fp32 but which the int4 kernel's bf16 activations amplify (Gemma 3 270M int4pack:
    logits 1.2 apart for one token computed alone or in a chunk of 9, enough to flip near-tied greedy tokens,
    so naive's output and chain's or tree's differed on 2 of 4 prompts). With it, an int4pack store's layers are
    batch-invariant end to end (the kernel's rows already are). It costs one call per row: for fp32 stores,
    whose matmuls are not batch-invariant anyway (~7e-7), the batched call stays (rowwise False)."""
    T = q.shape[1]
    end = start + T
    k_cache[:, start:end] = k  # written by slot: a later rollback just moves the cache length back
    v_cache[:, start:end] = v
    if not rowwise:
        # grouped-query attention: each KV head serves num_attention_heads / num_key_value_heads query heads
        out = F.scaled_dot_product_attention(q[None], k_cache[None, :, :end], v_cache[None, :, :end],
                                             attn_mask=mask.mask[None, None], enable_gqa=True,
                                             scale=scale)  # [1, H, T, hd]
        return out[0].transpose(0, 1).reshape(T, -1)
    out = torch.empty(q.shape[0], T, q.shape[2], dtype=q.dtype, device=q.device)
    for i, keys in enumerate(mask.rows):
        out[:, i : i + 1] = F.scaled_dot_product_attention(q[None, :, i : i + 1], k_cache[None, :, keys],
                                                           v_cache[None, :, keys], enable_gqa=True, scale=scale)[0]
    return out.transpose(0, 1).reshape(T, -1)


def batch_invariant(w: dict) -> bool:
    """Whether this layer's projections give each row the same result whatever the batch (torch's int4 kernel
    does; fp32 matmuls do not exactly, nor does a draft's weight that goes dense for wide calls, packed.widen):
    then attention runs row by row too (_attend's rowwise)."""
    return row_invariant(w["self_attn.o_proj.weight"])


class RowKeys:
    """A chunk's attention mask [T, start + T] bool and, per query row, the key slots it attends (`rows`): a
    slice when they are one run of slots, else their indices (ascending). The rows are worked out on first use
    (only row-by-row attention needs them), once per sweep rather than once per layer."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask

    @functools.cached_property
    def rows(self) -> list:
        rows = []
        for allowed in self.mask:
            idx = allowed.nonzero().squeeze(1)
            lo, n = int(idx[0]), idx.numel()
            rows.append(slice(lo, lo + n) if int(idx[-1]) - lo + 1 == n else idx)
        return rows


def attend_spans(q, k, v, layer: int, spans, scale: float | None, rowwise: bool) -> torch.Tensor:
    """_attend for each sequence of a ragged batch (rows o..o+T of q/k/v, against that sequence's cache at
    `layer` under its own mask) -> [sum T, H * hd]."""
    return torch.cat([_attend(q[:, o : o + T], k[:, o : o + T], v[:, o : o + T], cache.k[layer], cache.v[layer],
                              start, mask, scale, rowwise) for cache, start, o, T, mask in spans])


def causal_mask(start: int, T: int, device="cpu") -> torch.Tensor:
    """[T, start + T] bool: the chunk sees the whole prefix and itself causally."""
    mask = torch.ones(T, start + T, dtype=torch.bool, device=device)
    mask[:, start:] = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return mask


def sliding_mask(mask: torch.Tensor, positions: torch.Tensor, start: int, window: int) -> torch.Tensor:
    """mask [T, start + T] limited to a sliding window (a query at position q sees keys at positions
    q - window < k <= q): key slots < start count at their slot (the committed prefix, whose slot is its
    position), the chunk's keys at their own positions (a tree's depths). (A draft growing a tree over several
    calls keeps earlier nodes at slots past the committed prefix; they count at their slot, which can only widen
    the window for those few keys: draft guesses, never the verified output.)"""
    positions = positions.to(mask.device)
    keys = torch.cat([torch.arange(start, device=mask.device), positions])
    return mask & ((positions[:, None] - keys[None, :]) < window)


def prepare_chunk(cache, T: int, positions, mask, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Room in the cache for T new slots; default positions (the slots) and the full attention mask
    [T, start + T]: the whole prefix, then causal or the caller's mask [T, T] within the chunk. A caller's
    mask of [T, start + T] is the whole mask (a draft growing a tree over several calls hides the sibling
    branches it added to its cache earlier)."""
    start = cache.length
    if positions is None:
        positions = torch.arange(start, start + T)
    cache.reserve(start + T)
    if mask is not None and mask.shape[-1] == start + T and start > 0:
        return positions, mask.to(device)
    full_mask = causal_mask(start, T, device)
    if mask is not None:
        full_mask[:, start:] = mask.to(device)
    return positions, full_mask


@dataclass
class Chunk:
    """One sequence's part of a ragged batch (forward_batch): its new tokens, its own cache, positions and
    mask (as forward's), and the first row whose logits it needs."""
    ids: torch.Tensor                      # [T] new tokens
    cache: object                          # this sequence's KVCache or LatentCache; new entries at length .. +T
    positions: torch.Tensor | None = None  # [T] (default: the slots)
    mask: torch.Tensor | None = None       # [T, T] within the chunk or [T, start+T] whole (default: causal)
    logits_from: int = 0

    def __post_init__(self) -> None:
        self.ids = torch.as_tensor(self.ids, dtype=torch.long).reshape(-1)

    def __repr__(self) -> str:
        return f"Chunk(T={self.ids.numel()}, start={self.cache.length}, logits_from={self.logits_from})"


def prepare_batch(chunks: list[Chunk], device) -> tuple[list, list[torch.Tensor], list[torch.Tensor]]:
    """prepare_chunk for each chunk of a ragged batch -> (spans: (cache, start, row offset, T, full mask
    [T, start + T]) per chunk, positions [T] per chunk, rows per chunk whose logits it wants)."""
    spans, positions, rows, offset = [], [], [], 0
    for c in chunks:
        T, start = c.ids.numel(), c.cache.length
        pos, full_mask = prepare_chunk(c.cache, T, c.positions, c.mask, device)
        spans.append((c.cache, start, offset, T, full_mask))
        positions.append(pos)
        rows.append(torch.arange(offset + c.logits_from, offset + T))
        offset += T
    return spans, positions, rows


# The dense-attention families (a K/V cache per layer, rope by inv_freq): their Family's cache and rope state.

def kv_cache(args: ModelArgs, layers: int, dtype, device) -> KVCache:
    return KVCache(layers, args.num_key_value_heads, args.head_dim, dtype, device)


def rope_state(args: ModelArgs, device) -> torch.Tensor:
    return rope.inv_freq(args).to(device)  # [head_dim / 2] fp32


def layer_number(name: str) -> int:
    """The model's layer number of a unit "layer.007" (a stage's or a skip draft's cache slot is not always it)."""
    return int(name.split(".")[1])


def forward(args: ModelArgs, embed: torch.Tensor, inv_freq: torch.Tensor, units, ids: torch.Tensor, cache,
            positions, mask, logits_from: int, layer, head, scale_embed=None, hidden=None) -> torch.Tensor:
    """A dense family's forward (llama.forward, gemma.forward) with its maths passed in: layer(args, w, h [T,
    hidden], k_cache, v_cache, start, cos, sin, mask) -> h, head(args, w, h, embed) -> logits fp32, and
    scale_embed(args, h) -> h for the embedded rows (None: as they are).

    A pipeline stage (runtime/executor.py, `layers=`) runs a part of the model: `hidden` [T, hidden] is the
    previous stage's output, taken instead of embedding ids (embed may then be None), and units without "head"
    return the hidden states [T, hidden] for the next stage. The cache holds the stage's layers only, slot i for
    its i-th unit."""
    T, start = ids.numel(), cache.length
    src = embed if hidden is None else hidden
    dev = src.device
    positions, full_mask = prepare_chunk(cache, T, positions, mask, dev)
    tables = _tables(args, inv_freq, positions.to(dev), src.dtype,
                     lambda window: RowKeys(full_mask if window is None
                                            else sliding_mask(full_mask, positions, start, window)))
    h = _embed(args, embed, ids, dev, scale_embed) if hidden is None else hidden
    out = None
    i = 0  # (no enumerate: it keeps its last result alive, and with it the previous layer's weights)
    for name, w in units:
        if name == "head":
            out = head(args, w, h[logits_from:], embed)
        else:
            h = layer(args, w, h, cache.k[i], cache.v[i], start, *tables[args.is_sliding(layer_number(name))])
        del w  # drop this layer before asking for the next one, so a memory budget can make room
        i += 1
    cache.length = start + T
    return h if out is None else out


def _embed(args: ModelArgs, embed: torch.Tensor, ids: torch.Tensor, dev, scale_embed) -> torch.Tensor:
    h = embed[ids.to(dev)]
    return h if scale_embed is None else scale_embed(args, h)


def forward_batch(args: ModelArgs, embed: torch.Tensor, inv_freq: torch.Tensor, units, chunks: list[Chunk],
                  batch_layer, head, scale_embed=None, hidden=None) -> list[torch.Tensor] | torch.Tensor:
    """A dense family's forward_batch with its maths passed in (as forward's; batch_layer(args, w, h [sum T,
    hidden], layer, spans, cos, sin) -> h). The chunks' rows are concatenated into one h [sum T_i, hidden], so
    every projection and MLP matmul runs once per layer over the whole batch (with streamed weights: one read of
    the layer serves every sequence); attention alone runs per sequence, against that sequence's cache under its
    own mask. Returns each chunk's logits [T_i - logits_from_i, vocab] fp32, in order; a stage without the head
    (as forward's) takes `hidden` [sum T, hidden] and returns the batch's hidden states [sum T, hidden]."""
    src = embed if hidden is None else hidden
    dev = src.device
    spans, positions, rows = prepare_batch(chunks, dev)
    tables = _tables(args, inv_freq, torch.cat(positions).to(dev), src.dtype,  # cos, sin [sum T, hd]
                     lambda window: [(cache, start, o, T, RowKeys(m if window is None
                                                                 else sliding_mask(m, pos, start, window)))
                                     for (cache, start, o, T, m), pos in zip(spans, positions)])
    h = _embed(args, embed, torch.cat([c.ids for c in chunks]), dev, scale_embed) if hidden is None else hidden
    logits = None
    i = 0
    for name, w in units:
        if name == "head":
            logits = head(args, w, h[torch.cat(rows).to(dev)], embed)
        else:
            cos, sin, layer_spans = tables[args.is_sliding(layer_number(name))]
            h = batch_layer(args, w, h, i, layer_spans, cos, sin)
        del w  # as forward: drop this layer before asking for the next one
        i += 1
    for cache, start, _, T, _ in spans:
        cache.length = start + T
    return h if logits is None else list(logits.split([len(r) for r in rows]))


def _tables(args: ModelArgs, inv_freq: torch.Tensor, positions: torch.Tensor, dtype, masks) -> dict:
    """{sliding?: (cos, sin, mask)} for a chunk: a global layer uses the global entry; a sliding layer (Gemma 3's)
    its own rope base and `masks(window)`, the attention mask(s) limited to the window (masks(None): global)."""
    cos, sin = rope.cos_sin(inv_freq, positions, dtype)
    out = {False: (cos, sin, masks(None))}
    if any(args.is_sliding(i) for i in range(args.num_hidden_layers)):
        out[True] = (*rope.cos_sin(rope.local_inv_freq(args).to(inv_freq.device), positions, dtype),
                     masks(args.sliding_window))
    return out
