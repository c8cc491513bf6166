"""The generation loop shared by every engine: naive (one sweep per token), chain and tree speculation.

Zero extra sweeps: the target's cache never holds the last emitted token. That token rides at the head of
the next round's sweep together with the new draft chunk, so a round costs exactly one target sweep (and the
first round's sweep carries the whole prompt, so the prefill is a round too):

    sweep input  [pending..., d_1, ..., d_K]      pending = the prompt, later the one trailing token
    logits rows  [p_1, ..., p_K, p_K+1]           (only the last K+1 rows are computed)
    verify       accepted d_1..d_n, then one recovered / bonus token t
    rollback     target cache keeps pending + d_1..d_n; t becomes the next round's pending token

A tree round is the same with a token tree in place of the chain (see tree.py): one sweep under a tree mask,
then the accepted root path's cache entries are compacted into consecutive slots.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from .rejection import verify_chain
from .sampling import SamplingParams, logits_to_probs
from .tree import TokenTree, verify_tree


class Target(Protocol):
    length: int

    def sweep(self, tokens: list[int], logits_from: int, positions=None, mask=None) -> tuple[torch.Tensor, object]: ...

    def truncate(self, n: int) -> None: ...

    def compact(self, at: int, slots: list[int]) -> None: ...


@dataclass
class RoundLog:
    """What every round measured, summed into the stats a result reports."""
    k: list[int] = field(default_factory=list)         # drafts per round (a tree: its depth)
    nodes: list[int] = field(default_factory=list)     # tokens drafted per round (a chain: K)
    accepted: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    sweeps: list = field(default_factory=list)   # SweepStats per sweep

    def add(self, k: int, accepted: int, draft_s: float, sweep, nodes: int | None = None) -> None:
        self.k.append(k)
        self.nodes.append(k if nodes is None else nodes)
        self.accepted.append(accepted)
        self.draft_s += draft_s
        self.sweeps.append(sweep)

    def acceptance_per_position(self) -> list[float]:
        """P(draft i accepted | reached): over rounds that proposed at least i+1 tokens."""
        out = []
        for i in range(max(self.k, default=0)):
            reached = [a for k, a in zip(self.k, self.accepted) if k > i and a >= i]
            if reached:
                out.append(sum(a > i for a in reached) / len(reached))
        return out


def generate(target: Target, draft, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
             controller=None, eos_ids=(), generator: torch.Generator | None = None,
             on_tokens: Callable[[list[int]], None] | None = None) -> tuple[list[int], str, RoundLog]:
    """Returns (new tokens, finish reason "length" | "stop", per-round log). draft=None means naive."""
    log = RoundLog()
    out: list[int] = []
    pending = list(prompt_ids)
    while len(out) < max_new_tokens:
        k = 0 if draft is None else max(0, min(controller.k(), max_new_tokens - len(out) - 1))
        proposal = draft.propose(prompt_ids + out, k, params, generator) if k else None
        drafts = proposal.tokens[:k] if proposal else []
        k = len(drafts)  # an n-gram draft may find fewer than K
        logits, sweep = target.sweep(pending + drafts, logits_from=len(pending) - 1)  # [k+1, V]
        if params.greedy:
            emitted = verify_chain(drafts, None, logits)
        else:
            q = proposal.probs[:k] if k else torch.zeros(0, logits.shape[-1])
            emitted = verify_chain(drafts, q, logits_to_probs(logits, params), generator)
        accepted = len(emitted) - 1
        target.truncate(target.length - (k - accepted))  # drop the rejected drafts' K/V
        draft_s = proposal.draft_s if proposal else 0.0
        log.add(k, accepted, draft_s, sweep)
        if controller is not None:
            controller.update(k, accepted, draft_s, sweep.wall_s)
        if emit(emitted, out, max_new_tokens, eos_ids, on_tokens):
            return out, "stop", log
        pending = [out[-1]]
    return out, "length", log


def generate_tree(target: Target, draft, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                  controller, eos_ids=(), generator: torch.Generator | None = None,
                  on_tokens: Callable[[list[int]], None] | None = None, max_depth: int = 24
                  ) -> tuple[list[int], str, RoundLog]:
    """Tree speculation: each round the draft proposes a token tree of at most controller.budget() nodes, and
    the target verifies all of them (with the pending tokens) in one sweep under a tree mask. The accepted
    root path's K/V are compacted into consecutive slots, the rest dropped: still one sweep per round."""
    log = RoundLog()
    out: list[int] = []
    pending = list(prompt_ids)
    while len(out) < max_new_tokens:
        depth = min(max_depth, max_new_tokens - len(out) - 1)
        budget = controller.budget()
        tree = draft.propose_tree(prompt_ids + out, budget, params, depth) if depth and budget else TokenTree([], [])
        start, P = target.length, len(pending)
        logits, sweep = target.sweep(pending + tree.tokens, logits_from=P - 1,
                                     positions=tree.positions(start, P), mask=tree.chunk_mask(P))  # [N+1, V]
        path, emitted = verify_tree(tree, logits, params, generator)
        target.compact(start + P, [start + P + j for j in path])  # keep the accepted path, consecutively
        log.add(tree.depth, len(path), tree.draft_s, sweep, nodes=len(tree))
        controller.update(tree, len(path), sweep)
        if emit(emitted, out, max_new_tokens, eos_ids, on_tokens):
            return out, "stop", log
        pending = [out[-1]]
    return out, "length", log


def emit(emitted: list[int], out: list[int], max_new_tokens: int, eos_ids, on_tokens) -> bool:
    """Append a round's tokens, cut at max_new_tokens or an end-of-sequence token; True when generation ends."""
    eos = set(eos_ids)
    emitted = emitted[: max_new_tokens - len(out)]
    for i, t in enumerate(emitted):
        if t in eos:
            emitted = emitted[: i + 1]
            break
    out.extend(emitted)
    if on_tokens:
        on_tokens(emitted)
    return bool(emitted) and emitted[-1] in eos


def summarize(log: RoundLog, new_tokens: int, wall_s: float, mode: str) -> dict:
    sweeps = len(log.sweeps)
    proposed = sum(log.k)
    io = sum(s.io_s for s in log.sweeps)
    prep = sum(s.prep_s for s in log.sweeps)
    return {
        "mode": mode,
        "new_tokens": new_tokens,
        "sweeps": sweeps,
        "rounds": len(log.k),
        "tokens_per_sweep": new_tokens / sweeps if sweeps else 0.0,
        "bytes_read": sum(s.bytes_read for s in log.sweeps),
        "acceptance_rate": sum(log.accepted) / proposed if proposed else 0.0,
        "wall_s": wall_s,
        "tokens_per_s": new_tokens / wall_s if wall_s > 0 else 0.0,
        "stats": {
            "draft_s": log.draft_s,
            "io_s": io,
            "prep_s": prep,
            "compute_s": sum(s.compute_s for s in log.sweeps),
            "stall_s": sum(s.stall_s for s in log.sweeps),
            "sweep_s": sum(s.wall_s for s in log.sweeps),
            # 1 - stall / (worker time): 1 when every read (and dequantize) hid behind compute
            "overlap_efficiency": 1.0 - sum(s.stall_s for s in log.sweeps) / (io + prep) if io + prep > 0 else None,
            "acceptance_per_position": log.acceptance_per_position(),
            "k_per_round": log.k,
            "nodes_per_round": log.nodes,
            "accepted_per_round": log.accepted,
            "sweep_tokens": [s.tokens for s in log.sweeps],
        },
    }
