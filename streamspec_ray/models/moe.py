"""DeepSeek mixture of experts: routing as pure functions, and the expert sum over an expert provider.

Routing maps each token's hidden state to (expert ids [T, top_k], weights [T, top_k]); nothing else. Which
expert weights exist in memory is the caller's business: `moe` asks a provider for exactly the union of the
experts the chunk routed to, one at a time, so a streamed sweep reads only those experts' shards.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from ..config import ModelArgs
from .layers import _linear

# provider(layer, expert ids ascending) -> yields (expert id, {"gate_proj.weight", "up_proj.weight", ...})
ExpertProvider = Callable[[int, list[int]], Iterable[tuple[int, dict]]]


def _group_mask(choice: torch.Tensor, n_group: int, topk_group: int, group_score: str) -> torch.Tensor:
    """choice [T, E] -> bool [T, E]: True for experts in the topk_group best groups of each token.
    A group scores the sum of its top-2 choice scores (V3) or its best one (V2)."""
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)
    scores = grouped.topk(2, dim=-1)[0].sum(-1) if group_score == "top2" else grouped.max(dim=-1).values
    keep = torch.zeros_like(scores, dtype=torch.bool)
    keep.scatter_(1, scores.topk(topk_group, dim=-1, sorted=False)[1], True)
    return keep[:, :, None].expand(T, n_group, E // n_group).reshape(T, E)


def route_v3(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
             norm_topk_prob: bool, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 (noaux_tc): logits [T, E] fp32 -> (ids [T, top_k], weights [T, top_k]).
    Sigmoid scores; the load-balancing bias e_score_correction_bias [E] shifts which experts are *chosen*
    but never the weights, which come from the unbiased scores (then optionally renormalized, then scaled)."""
    scores = logits.sigmoid()
    choice = scores + bias
    choice = choice.masked_fill(~_group_mask(choice, n_group, topk_group, "top2"), float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


def route_v2(logits: torch.Tensor, top_k: int, method: str, n_group: int, topk_group: int,
             scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2: softmax scores; `greedy` takes the top_k, `group_limited_greedy` first keeps the topk_group
    groups with the best single expert (masked experts score 0). Weights are the (unrenormalized) scores,
    times routed_scaling_factor, as transformers' DeepseekV2TopkRouter computes them."""
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if method == "group_limited_greedy":
        scores = scores.masked_fill(~_group_mask(scores, n_group, topk_group, "max"), 0.0)
    weights, ids = scores.topk(top_k, dim=-1, sorted=False)
    return ids, weights * scaling


def route(args: ModelArgs, w: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, hidden] (post-attention normed) -> (ids [T, top_k] long, weights [T, top_k] fp32)."""
    logits = F.linear(x.float(), w["mlp.gate.weight"].float())  # the router runs in fp32, as in transformers
    if args.model_type == "deepseek_v3":
        return route_v3(logits, w["mlp.gate.e_score_correction_bias"].float(), args.num_experts_per_tok,
                        args.n_group, args.topk_group, args.norm_topk_prob, args.routed_scaling_factor)
    return route_v2(logits, args.num_experts_per_tok, args.topk_method, args.n_group, args.topk_group,
                    args.routed_scaling_factor)


def mlp(w: dict, x: torch.Tensor, prefix: str = "") -> torch.Tensor:
    """SwiGLU: x [T, hidden] -> [T, hidden]."""
    return _linear(F.silu(_linear(x, w, prefix + "gate_proj")) * _linear(x, w, prefix + "up_proj"), w,
                   prefix + "down_proj")


def moe(args: ModelArgs, w: dict, x: torch.Tensor, layer: int, experts: ExpertProvider) -> torch.Tensor:
    """Routed experts (only the union the chunk chose, fetched from `experts`) plus the shared experts."""
    ids, weights = route(args, w, x)
    union = torch.unique(ids).tolist()                                # ascending, as transformers iterates
    out = torch.zeros_like(x)
    for e, ew in _checked(experts(layer, union), union):
        tok, slot = torch.where(ids == e)                             # tokens routed to e, and at which rank
        y = mlp(ew, x[tok]) * weights[tok, slot, None].to(x.dtype)
        out.index_add_(0, tok, y)
        del ew
    if args.n_shared_experts:
        out = out + mlp(w, x, "mlp.shared_experts.")
    return out


def _checked(pairs: Iterable, union: list[int]) -> Iterator:
    got = []
    for e, ew in pairs:
        got.append(e)
        yield e, ew
        del ew  # before the provider reads the next expert
    if got != union:
        raise RuntimeError(f"expert provider returned experts {got}, asked for {union}")
