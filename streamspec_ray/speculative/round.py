"""One speculative round for N sequences: every engine's generation runs it (N = 1 for `generate`).

    plan     each sequence drafts (a chain of K tokens, or a token tree) and lays out its sweep chunk:
             [pending..., drafts...] after what its target cache holds (pending: the prompt, later the one
             trailing token that the last round emitted and no cache holds yet)
    sweep    ONE target sweep carries every chunk (generate: the Target's sweep; a batch: sweep_batch)
    verify   each sequence against its own rows of logits and its own generator (verify_chain / verify_tree:
             this module is their only caller), its cache rolled back to what it accepted (a tree: the accepted
             path compacted into consecutive slots), its round logged and its K or tree-budget controller fed

The loops around it differ only in what they do between rounds: speculative/loop.generate runs one sequence
until it ends (and may draft the next round during the sweep, loop.Lookahead); speculative/batch.run admits
requests into free slots, and keeps one sequence's failure its own.

A drafter gives the proposals: propose(seqs, ks) -> [Proposal | None] and propose_tree(seq, budget, depth)
-> TokenTree (batch.BatchDraft: one state per sequence over one resident draft; loop.OneDraft: one sequence,
any draft). A sweep is sweep(target, plans) below: the target is an executor (StreamingExecutor, the Ray
verifier's RemoteExecutor) whose caches the sequences hold, or, for one sequence, anything with the loop's
Target interface (sweep, truncate, compact, length: then the sequence's cache is the target itself).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

import torch

from ..models.layers import Chunk
from .drafts import Proposal
from .rejection import verify_chain, verify_chains
from .requests import Request
from .sampling import SamplingParams, logits_to_probs
from .tree import TokenTree, cut_short, verify_tree


@dataclass
class RoundLog:
    """What every round measured, summed into the stats a result reports."""
    k: list[int] = field(default_factory=list)         # drafts per round (a tree: its depth)
    nodes: list[int] = field(default_factory=list)     # tokens drafted per round (a chain: K)
    accepted: list[int] = field(default_factory=list)
    draft_s: float = 0.0                          # drafting on the critical path (the round waited for it)
    sweeps: list = field(default_factory=list)   # SweepStats per sweep
    draft_hidden_s: float = 0.0                   # drafting done while the target swept (Lookahead)
    prepared: int = 0                             # proposals a lookahead prepared
    reused: int = 0                               # ... that verification's outcome let a round use

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


@dataclass
class Seq:
    """A sequence being generated: its request, its own target cache, draft state, controller and generator."""
    req: Request
    cache: object
    draft_state: object
    controller: object
    generator: torch.Generator
    pending: list[int]
    out: list[int] = field(default_factory=list)
    log: RoundLog = field(default_factory=RoundLog)
    t0: float = field(default_factory=time.perf_counter)
    finish_reason: str | None = None  # set when it ends: "stop" (an end-of-sequence token) or "length"

    @property
    def params(self) -> SamplingParams:
        return self.req.params

    def context(self) -> list[int]:
        return self.req.prompt_ids + self.out

    def left(self) -> int:
        """Tokens this sequence may still emit."""
        return self.req.max_new_tokens - len(self.out)


@dataclass
class Plan:
    """One sequence's part of a round: its sweep chunk and what verification needs (chain or tree)."""
    tokens: list[int]  # [pending..., drafts or tree nodes...]
    cache: object
    logits_from: int
    positions: torch.Tensor | None = None  # a tree's: [T]
    mask: torch.Tensor | None = None       # a tree's: [T, T] within the chunk
    drafts: list[int] = field(default_factory=list)
    proposal: Proposal | None = None
    tree: TokenTree | None = None
    start: int = 0     # the cache length before the sweep
    cut: bool = False  # a tree cut short by the tokens left (tree.cut_short): it does not teach the budget
    accepted: int = 0  # set by verify: drafts accepted (a tree: the accepted path's length)
    path: list[int] = field(default_factory=list)  # set by verify, a tree's: the accepted nodes

    def chunk(self) -> Chunk:
        return Chunk(self.tokens, self.cache, self.positions, self.mask, self.logits_from)


def plan_chains(seqs: list[Seq], drafter) -> list[Plan]:
    """Each sequence's chain round: K from its controller (at most what it may still emit, less the bonus)."""
    ks = [0 if drafter is None else max(0, min(s.controller.k(), s.left() - 1)) for s in seqs]
    proposals = drafter.propose(seqs, ks) if drafter is not None and any(ks) else [None] * len(seqs)
    plans = []
    for s, p, k in zip(seqs, proposals, ks):
        d = p.tokens[:k] if p else []  # an n-gram draft may find fewer than K
        plans.append(Plan(s.pending + d, s.cache, len(s.pending) - 1, drafts=d, proposal=p, start=s.cache.length))
    return plans


def plan_trees(seqs: list[Seq], drafter, max_depth: int) -> list[Plan]:
    """Each sequence's tree round: a tree of at most its controller's budget and the depth it has left."""
    plans = []
    for s in seqs:
        depth, budget = min(max_depth, s.left() - 1), s.controller.budget()
        tree = drafter.propose_tree(s, budget, depth) if depth and budget else TokenTree([], [])
        start, P = s.cache.length, len(s.pending)
        plans.append(Plan(s.pending + tree.tokens, s.cache, P - 1, tree.positions(start, P), tree.chunk_mask(P),
                          tree=tree, start=start, cut=cut_short(tree, depth, max_depth)))
    return plans


def sweep(target, plans: list[Plan]):
    """One target sweep for every plan -> (logits per plan [rows from its logits_from, V], SweepStats). A batch
    sweeps its caches with sweep_batch even when one sequence is left: the Ray verifier keeps a batch's caches
    apart from a single generation's, and sweeping one through the other would rebuild it by replay."""
    if len(plans) == 1 and plans[0].cache is target:  # (loop.generate: the sequence's cache is the Target)
        p = plans[0]
        logits, st = target.sweep(p.tokens, p.logits_from, p.positions, p.mask)
        return [logits], st
    return target.sweep_batch([p.chunk() for p in plans])


def verify(seqs: list[Seq], plans: list[Plan], logits: list[torch.Tensor], sweep_stats, costs: bool = True,
           sweep_cost: tuple[float, float] | None = None) -> list:
    """Verify a round (logits per sequence [rows after its pending tokens, V]): each sequence's accepted tokens,
    its cache rolled back to them, its round logged and its controller fed -> per sequence the tokens it emits
    (accepted, then one more), or the exception that ended it alone.

    costs False: the round also prefilled a prompt, so its times say nothing of what K or a budget costs.
    sweep_cost: the batch's sweep time as (intercept, seconds per row), once fitted."""
    out = accept(seqs, plans, logits)
    for i, (s, plan) in enumerate(zip(seqs, plans)):
        if not isinstance(out[i], Exception):
            try:
                settle(s, plan, sweep_stats, costs, len(seqs), sweep_cost)
            except Exception as e:  # noqa: BLE001 (this sequence's own failure: the caller ends it)
                out[i] = e
    return out


def accept(seqs: list[Seq], plans: list[Plan], logits: list[torch.Tensor]) -> list:
    """What each sequence's round emits (the only caller of verify_chain, verify_chains and verify_tree): a tree
    by verify_tree, a greedy chain by the argmax, the sampled chains together (verify_chains: one batched test,
    each drawing from its own generator as verify_chain would). Sets plan.accepted (and a tree's plan.path).
    -> per sequence its tokens, or the exception raised by its own part."""
    out: list = [None] * len(seqs)
    sampled = []  # (index, drafts, q [K, V], p [K+1, V], generator)
    for i, (s, plan, x) in enumerate(zip(seqs, plans, logits)):
        try:
            if plan.tree is not None:
                plan.path, out[i] = verify_tree(plan.tree, x, s.params, s.generator)
            elif s.params.greedy:
                out[i] = verify_chain(plan.drafts, None, x)
            else:
                d = plan.drafts
                q = plan.proposal.probs[: len(d)] if d else torch.zeros(0, x.shape[-1])
                sampled.append((i, d, q, logits_to_probs(x, s.params), s.generator))
        except Exception as e:  # noqa: BLE001
            out[i] = e
    if len(sampled) > 1:
        states = [g.get_state() if g is not None else None for *_, g in sampled]
        try:
            for (i, *_), tokens in zip(sampled, verify_chains(*(list(c) for c in zip(*(x[1:] for x in sampled))))):
                out[i] = tokens
            sampled = []
        except Exception:  # noqa: BLE001 (each alone, from where its generator was, to find whose part failed)
            for (*_, g), state in zip(sampled, states):
                if g is not None:
                    g.set_state(state)
    for i, d, q, p, g in sampled:
        try:
            out[i] = verify_chain(d, q, p, g)
        except Exception as e:  # noqa: BLE001
            out[i] = e
    for plan, e in zip(plans, out):
        if not isinstance(e, Exception):
            plan.accepted = len(plan.path) if plan.tree is not None else len(e) - 1
    return out


def settle(s: Seq, plan: Plan, sweep_stats, costs: bool, n: int, sweep_cost: tuple[float, float] | None) -> None:
    """After verification: roll the sequence's cache back to what it accepted, log its round, feed its controller.
    With n > 1 sequences in the sweep, a sequence is charged its share of the round, which is what one more draft
    token costs it when all draft alike: the drafting split evenly, the sweep's fixed part split evenly plus its
    own rows' cost. (Fed the whole round's times, which rose and fell with how many sequences were left and not
    with this K, the controllers of 16 chat requests settled at K = 1: 40 tok/s, against 54 with a fixed K = 6.)"""
    share = sweep_stats if n == 1 else dataclasses.replace(
        # its own tokens, an even split of the bytes; its reads ran during every sequence's drafting, not its own
        # alone, so no read-ahead round model
        sweep_stats, tokens=len(plan.tokens), bytes_read=sweep_stats.bytes_read // n, read_ahead=False, ahead=0.0,
        gap_s=0.0, gap_io_s=0.0)
    if plan.tree is not None:
        tree, P = plan.tree, len(s.pending)
        s.cache.compact(plan.start + P, [plan.start + P + j for j in plan.path])  # the path, consecutively
        s.log.add(tree.depth, plan.accepted, tree.draft_s, share, nodes=len(tree))
        if not plan.cut:
            s.controller.update(tree, plan.accepted, share, costs)
        return
    d, p = plan.drafts, plan.proposal
    s.cache.truncate(s.cache.length - (len(d) - plan.accepted))  # drop the rejected drafts' K/V
    draft_s = p.draft_s if p else 0.0
    s.log.add(len(d), plan.accepted, draft_s, share)
    if s.controller is not None:
        if n == 1:
            cost = sweep_stats.wall_s
        else:
            c0, c1 = sweep_cost or (sweep_stats.wall_s, 0.0)
            cost = c0 / n + c1 * len(plan.tokens)
        s.controller.update(len(d), plan.accepted, draft_s / n, cost, costs, sweep=share)


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


def advance(s: Seq, emitted: list[int], eos_ids, on_tokens) -> bool:
    """Append a verified round's tokens -> whether the sequence goes on (then its last token is pending)."""
    stopped = emit(emitted, s.out, s.req.max_new_tokens, eos_ids, on_tokens)
    if stopped or s.left() <= 0:
        s.finish_reason = "stop" if stopped else "length"
        return False
    s.pending = [s.out[-1]]
    return True
