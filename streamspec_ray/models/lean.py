"""A resident int4 draft's Llama-family forward in fewer ops: llama.forward's logits, bit for bit.

A draft forward of one or a few rows is as much dispatch as matmul. On this project's 2-core CPU, SmolLM2-135M's
self-int4 draft spent ~10 of its ~23 ms per one-row forward outside the int4 kernel and attention, on the ~80 small
ops per layer around four kernel calls (casts before and after each call, an unfused norm, rope on q and k apart,
a bool mask turned into a float one in every layer). This path does the same arithmetic in fewer calls:

  * each projection calls the int4 kernel (packed.int4_matmul) directly on the input dtype it takes (what
    PackedInt4 casts to anyway) and casts its output once; q and k are roped together on one [T, H + KV, hd] view;
  * torch's fused rms_norm; the attention mask made additive once per forward, and left out for a one-row chunk
    that may see every slot (a chain step);
  * the residual stream, the K/V cache and attention in the draft's dtype (fp32), as in llama.forward.

Its logits and cache entries equal llama.forward's bit for bit (tests/test_lean.py), so sampled drafting uses it
too: a seeded request's draws stay the same alone or in a batch (which drafts through llama.forward_batch).
Measured on that draft (2 threads, 300 cached tokens, medians of 28 interleaved calls): 23.0 -> 19.8 ms for 1 row,
23.0 -> 19.7 for 2, 29.8 -> 26.3 for 4, 43.5 -> 39.6 for 8. Calls of `max_rows` rows or more (a prompt entering
the draft) go through llama.forward, where the weights multiply densely (quant.packed.widen).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import LLAMA_FAMILY, ModelArgs
from ..quant.kernel import HAS_KERNEL
from ..quant.packed import DENSE_ROWS, PackedInt4, int4_input_dtype, int4_matmul
from . import layers, llama, rope

_mm = int4_matmul if HAS_KERNEL else None


def _kernel(w) -> bool:
    return isinstance(w, PackedInt4) and w.kernel


class _Proj:
    """One or more kernel weights whose outputs are concatenated (q, k, v kept apart), and their biases."""

    def __init__(self, ws: list[PackedInt4], biases: list):
        self.calls = [(w.packed, w.group_size, w.scales_zeros) for w in ws]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(w.out_features) for w, b in zip(ws, biases)])

    def __call__(self, x: torch.Tensor, dtype) -> torch.Tensor:
        """x [T, in] bf16 -> [T, out] in dtype."""
        ys = [_mm(x, *c) for c in self.calls]
        y = (ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)).to(dtype)
        return y if self.bias is None else y + self.bias


def _proj(w: dict, fused: str, parts: tuple[str, ...]) -> _Proj | None:
    names = [fused] if fused + ".weight" in w else list(parts)
    ws = [w.get(n + ".weight") for n in names]
    if not all(_kernel(x) for x in ws):
        return None
    return _Proj(ws, [w.get(n + ".bias") for n in names])


class LeanForward:
    """llama.forward for one chunk through a resident draft whose every projection is a kernel PackedInt4."""

    max_rows = DENSE_ROWS  # calls of this many rows or more go through llama.forward (dense, see packed.widen)

    def __init__(self, args: ModelArgs, layers: list[tuple], head: dict, head_proj: _Proj | None):
        self.args, self.layers, self.head, self.head_proj = args, layers, head, head_proj

    @classmethod
    def build(cls, args: ModelArgs, units: list[tuple[str, dict]]) -> "LeanForward | None":
        """The lean path for these resident units (decoder layers, then "head"), or None where it does not apply:
        no int4 kernel, another family's maths than llama.py's, sliding-window layers, or any projection not on
        the kernel."""
        if _mm is None or args.model_type not in LLAMA_FAMILY or not units or units[-1][0] != "head":
            return None
        if any(args.is_sliding(i) for i in range(args.num_hidden_layers)):
            return None
        layers = []
        for _, w in units[:-1]:
            projs = (_proj(w, "self_attn.qkv_proj", llama.FUSED["self_attn.qkv_proj"]),
                     _proj(w, "self_attn.o_proj", ()), _proj(w, "mlp.gate_up_proj", llama.FUSED["mlp.gate_up_proj"]),
                     _proj(w, "mlp.down_proj", ()))
            if any(p is None for p in projs):
                return None
            layers.append((w["input_layernorm.weight"], w["post_attention_layernorm.weight"], *projs))
        head = units[-1][1]
        lm = head.get("lm_head.weight")
        return cls(args, layers, head, _Proj([lm], [None]) if _kernel(lm) else None)

    def __call__(self, embed: torch.Tensor, inv_freq: torch.Tensor, ids: torch.Tensor, cache,
                 positions: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                 logits_from: int = 0) -> torch.Tensor:
        """As llama.forward: ids [T] appended to `cache` (slots cache.length..+T) at `positions` under `mask`
        -> logits [T - logits_from, vocab] fp32."""
        a = self.args
        T, start, dt, kdt = ids.numel(), cache.length, embed.dtype, int4_input_dtype()
        H, KV, hd, eps = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.rms_norm_eps
        positions, full = layers.prepare_chunk(cache, T, positions, mask, embed.device)
        cos, sin = rope.cos_sin(inv_freq, positions, dt)
        cos, sin = cos[:, None], sin[:, None]  # [T, 1, hd]: one rope for q's and k's heads together
        if T == 1 and bool(full.all()):
            bias = None
        else:  # additive, once for every layer (SDPA would turn a bool mask into this in each one)
            bias = torch.zeros(full.shape, dtype=dt).masked_fill_(~full, float("-inf"))[None, None]
        end, nq = start + T, H + KV
        h = embed[ids]  # [T, hidden]
        for i, (norm1, norm2, qkv, o, gate_up, down) in enumerate(self.layers):
            y = qkv(F.rms_norm(h, h.shape[-1:], norm1, eps).to(kdt), dt)  # [T, (H + 2 KV) hd]
            qk = rope.apply(y[:, : nq * hd].view(T, nq, hd), cos, sin).transpose(0, 1)  # [H + KV, T, hd]
            k_cache, v_cache = cache.k[i], cache.v[i]
            k_cache[:, start:end] = qk[H:]
            v_cache[:, start:end] = y[:, nq * hd :].view(T, KV, hd).transpose(0, 1)
            att = F.scaled_dot_product_attention(qk[None, :H], k_cache[None, :, :end], v_cache[None, :, :end],
                                                 attn_mask=bias, enable_gqa=True)  # [1, H, T, hd]
            h = h + o(att[0].transpose(0, 1).reshape(T, -1).to(kdt), dt)
            gate, up = gate_up(F.rms_norm(h, h.shape[-1:], norm2, eps).to(kdt), dt).chunk(2, dim=-1)
            h = h + down((F.silu(gate) * up).to(kdt), dt)
        cache.length = end
        if self.head_proj is None:
            return layers.head(a, self.head, h[logits_from:], embed)
        x = F.rms_norm(h[logits_from:], h.shape[-1:], self.head["norm.weight"], eps).to(kdt)
        return self.head_proj(x, torch.float32)
