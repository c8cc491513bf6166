"""Llama-family decoder math (Llama, SmolLM2, Qwen2, Mistral) on plain weight dicts.

The functions know nothing about where weights come from: the executor hands each decoder layer's weights
in as `{hf_local_name: tensor}` (e.g. "self_attn.q_proj.weight"), already materialized in the compute dtype,
so a streamed layer, a resident draft layer and an INT4 layer all run the same code. Biases are used when
the shard has them (Qwen2's q/k/v biases, attention_bias Llamas).
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ModelArgs
from ..runtime.int4 import PackedInt4
from . import rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # as HF: normalize in fp32, scale in the input dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _apply(weight, x: torch.Tensor, bias=None) -> torch.Tensor:
    if isinstance(weight, torch.Tensor):
        return F.linear(x, weight, bias)
    return weight(x, bias)  # a packed weight (e.g. runtime.int4.PackedInt4) computes its own matmul


def _linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
    return _apply(w[name + ".weight"], x, w.get(name + ".bias"))


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
    does; fp32 matmuls do not exactly, nor does a draft's weight that goes dense for wide calls, int4.widen):
    then attention runs row by row too (_attend's rowwise)."""
    o = w["self_attn.o_proj.weight"]
    return getattr(o, "kernel", False) and getattr(o, "wide_rows", None) is None  # (a PackedInt4 on the kernel)


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
        for i, (p, q, sz) in enumerate(zip(parts, j.packed.split(sizes[fused]),
                                           j.scales_zeros.split(sizes[fused], dim=1))):
            out[p + ".weight"] = PackedInt4.from_packed(q.contiguous(), sz.contiguous(), j.group_size)
            if b is not None:
                out[p + ".bias"] = b.split(sizes[fused])[i]
    return out


def fuse(w: dict) -> dict:
    """A resident layer's int4 kernel weights with q/k/v and gate/up each joined into one (PackedInt4.cat):
    the same outputs bit for bit, in 4 kernel calls per layer instead of 7. Other layers (dense weights, a
    layer already fused) come back as they are. A fused layer owns all its tensors (copies), so a read buffer
    that its unfused weights were views of is not kept alive beside the joined copies."""
    out = dict(w)
    done = False
    for fused, parts in FUSED.items():
        ws = [w.get(p + ".weight") for p in parts]
        if not all(isinstance(x, PackedInt4) for x in ws):
            continue
        joined = PackedInt4.cat(ws)
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
    return {n: (PackedInt4.from_packed(t.packed.clone(), t.scales_zeros.clone(), t.group_size)
                if isinstance(t, PackedInt4) and t.kernel else t.clone() if isinstance(t, torch.Tensor) else t)
            for n, t in out.items()}


def head(args: ModelArgs, w: dict, h: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
    """Final norm and LM head: h [T, hidden] -> logits [T, vocab] (fp32). Tied models reuse the embedding."""
    x = rms_norm(h, w["norm.weight"], args.rms_norm_eps)
    return _apply(w.get("lm_head.weight", embed), x).float()


def causal_mask(start: int, T: int, device="cpu") -> torch.Tensor:
    """[T, start + T] bool: the chunk sees the whole prefix and itself causally."""
    mask = torch.ones(T, start + T, dtype=torch.bool, device=device)
    mask[:, start:] = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return mask


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


def forward(args: ModelArgs, embed: torch.Tensor, inv_freq: torch.Tensor, units, ids: torch.Tensor, cache,
            positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
            logits_from: int = 0) -> torch.Tensor:
    """Run a chunk of new tokens ids [T] through the model and commit them to the cache.

    `units` yields (name, weights) for every decoder layer in order and then "head": a streamed UnitStream
    or a resident list, the maths is the same. New K/V go to slots cache.length .. cache.length+T.
    positions [T] (default: the slots) and mask [T, T] over the chunk (default causal; a tree passes
    ancestors) let a token tree share one pass. Returns logits [T - logits_from, vocab] fp32."""
    T, start = ids.numel(), cache.length
    dev = embed.device
    positions, full_mask = prepare_chunk(cache, T, positions, mask, dev)
    fam = _family(args)
    tables = _tables(args, inv_freq, positions.to(dev), embed.dtype,
                     lambda window: RowKeys(full_mask if window is None
                                            else gemma.sliding_mask(full_mask, positions, start, window)))
    h = embed[ids.to(dev)]
    if args.is_gemma:
        h = gemma.scale_embed(args, h)
    logits = None
    i = 0  # (no enumerate: it keeps its last result alive, and with it the previous layer's weights)
    for name, w in units:
        if name == "head":
            logits = fam.head(args, w, h[logits_from:], embed)
        else:
            h = fam.decoder_layer(args, w, h, cache.k[i], cache.v[i], start, *tables[args.is_sliding(i)])
        del w  # drop this layer before asking for the next one, so a memory budget can make room
        i += 1
    cache.length = start + T
    return logits


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


def forward_batch(args: ModelArgs, embed: torch.Tensor, inv_freq: torch.Tensor, units,
                  chunks: list[Chunk]) -> list[torch.Tensor]:
    """forward for several sequences at once, each layer taken from `units` once for all of them.

    The chunks' rows are concatenated into one h [sum T_i, hidden], so every projection and MLP matmul runs
    once per layer over the whole batch (with streamed weights: one read of the layer serves every
    sequence); attention alone runs per sequence, against that sequence's cache under its own mask. Returns
    each chunk's logits [T_i - logits_from_i, vocab] fp32, in order."""
    dev = embed.device
    spans, positions, rows = prepare_batch(chunks, dev)
    fam = _family(args)
    tables = _tables(args, inv_freq, torch.cat(positions).to(dev), embed.dtype,  # cos, sin [sum T, hd]
                     lambda window: [(cache, start, o, T, RowKeys(m if window is None
                                                                 else gemma.sliding_mask(m, pos, start, window)))
                                     for (cache, start, o, T, m), pos in zip(spans, positions)])
    h = embed[torch.cat([c.ids for c in chunks]).to(dev)]
    if args.is_gemma:
        h = gemma.scale_embed(args, h)
    logits = None
    i = 0
    for name, w in units:
        if name == "head":
            logits = fam.head(args, w, h[torch.cat(rows).to(dev)], embed)
        else:
            cos, sin, layer_spans = tables[args.is_sliding(i)]
            h = fam.batch_layer(args, w, h, i, layer_spans, cos, sin)
        del w  # as forward: drop this layer before asking for the next one
        i += 1
    for cache, start, _, T, _ in spans:
        cache.length = start + T
    return list(logits.split([len(r) for r in rows]))


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


def batch_layer(args: ModelArgs, w: dict, h: torch.Tensor, layer: int, spans, cos, sin) -> torch.Tensor:
    """decoder_layer over a ragged batch h [sum T, hidden]: one matmul per projection for all rows, attention
    per sequence (q/k/v rows o..o+T against that sequence's cache at `layer`)."""
    q, k, v = _qkv(args, w, rms_norm(h, w["input_layernorm.weight"], args.rms_norm_eps), cos, sin)
    att = attend_spans(q, k, v, layer, spans, None, batch_invariant(w))  # [sum T, H * hd]
    return _mlp_block(args, w, h + _linear(att, w, "self_attn.o_proj"))


def _family(args: ModelArgs):
    """The module with this model's decoder_layer, batch_layer and head (this one, or gemma's)."""
    return gemma if args.is_gemma else sys.modules[__name__]


def _tables(args: ModelArgs, inv_freq: torch.Tensor, positions: torch.Tensor, dtype, masks) -> dict:
    """{sliding?: (cos, sin, mask)} for a chunk: every Llama layer uses the global entry; a Gemma sliding layer
    its own rope base and `masks(window)`, the attention mask(s) limited to the window (masks(None): global)."""
    cos, sin = rope.cos_sin(inv_freq, positions, dtype)
    out = {False: (cos, sin, masks(None))}
    if any(args.is_sliding(i) for i in range(args.num_hidden_layers)):
        out[True] = (*rope.cos_sin(gemma.local_inv_freq(args).to(inv_freq.device), positions, dtype),
                     masks(args.sliding_window))
    return out


from . import gemma  # noqa: E402  (gemma reuses this module's attention and projections)
