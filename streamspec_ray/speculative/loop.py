"""One sequence's generation (Engine.generate, RayEngine.generate): round.py's round, naive (one sweep per token),
chain or tree, run until the sequence ends.

Zero extra sweeps: the target's cache never holds the last emitted token. That token rides at the head of
the next round's sweep together with the new draft chunk, so a round costs exactly one target sweep (and the
first round's sweep carries the whole prompt, so the prefill is a round too):

    sweep input  [pending..., d_1, ..., d_K]      pending = the prompt, later the one trailing token
    logits rows  [p_1, ..., p_K, p_K+1]           (only the last K+1 rows are computed)
    verify       accepted d_1..d_n, then one recovered / bonus token t
    rollback     target cache keeps pending + d_1..d_n; t becomes the next round's pending token

A tree round is the same with a token tree in place of the chain (see tree.py): one sweep under a tree mask,
then the accepted root path's cache entries are compacted into consecutive slots.

Drafting during the sweep (`overlap`, greedy rounds with a model draft): while the target sweeps round n, a
background thread prepares round n+1's proposal for the likeliest outcome of round n (see Lookahead). When
verification gives exactly that outcome the prepared proposal is used as it is; otherwise it is cancelled, the
draft's cache put back as round n left it, and the round drafts as before. The target only ever verifies
proposals, so outputs do not change; only where the drafting time goes does.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Protocol

import torch

from ..runtime.threads import using as using_threads
from .drafts import Cancelled
from .requests import Request
from .round import Plan, RoundLog, Seq, advance, plan_chains, plan_trees, sweep, verify
from .sampling import SamplingParams
from .tree import TokenTree

log = logging.getLogger("streamspec")


class Target(Protocol):
    length: int

    def sweep(self, tokens: list[int], logits_from: int, positions=None, mask=None) -> tuple[torch.Tensor, object]: ...

    def truncate(self, n: int) -> None: ...

    def compact(self, at: int, slots: list[int]) -> None: ...


def _background() -> None:
    """The lookahead thread runs at the lowest CPU priority (Linux: a thread's nice value is its own), so it
    takes the cycles the sweep leaves idle (waiting on the disk) and not those of the sweep's compute and reads:
    at normal priority, on 2 cores, it slowed the real pair's sweeps by about as much as it hid."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # (not Linux, or not allowed: runs at normal priority)
        pass


def _pool(draft) -> ThreadPoolExecutor:
    """The draft's one lookahead thread, kept for its lifetime: a new thread per generation would get a new
    malloc arena each time, and the memory those arenas keep grew until a run under a 1.2 GB limit thrashed."""
    pool = getattr(draft, "_lookahead_pool", None)
    if pool is None:
        pool = ThreadPoolExecutor(1, thread_name_prefix="streamspec-lookahead", initializer=_background)
        draft._lookahead_pool = pool
    return pool


class Lookahead:
    """Drafting while the target sweeps: a background thread prepares the next round's proposal for the
    likeliest outcome of this one, which is: the target accepts the draft's own greedy path through this
    round's proposal (the whole chain; a tree's best-scored branch) and then emits the draft's argmax after it.

    Only for greedy rounds and drafts that can stop between forwards and put their cache back (ModelDraft:
    snapshot / restore / cancel / guess_next). The sweep mostly waits on the disk, and its compute takes one
    core, so the draft's forwards run beside it. A sampled round would need the draft's random draws made in
    the background, and then a seeded run's output would depend on timing; sampled rounds draft as before.

    After verification, `take(context)`: if `context` (what the round produced) is the guessed one, the
    prepared proposal is returned (the round waits only for what is not finished yet); else the job is
    cancelled (it stops before its next forward), the draft's state restored, and None returned."""

    # A job costs the sweep some cycles and memory bandwidth even at low priority, and pays only when the round
    # accepts the draft's whole path: rounds are prepared only while a moving average of how often that
    # happened (observed every round, prepared or not) is at least MIN_FULL. Measured on the real pair (chain
    # K=8, 64 tokens, every round prepared): code rounds used 66% of the prepared proposals, chat rounds 4%.
    MIN_FULL, EMA = 0.25, 0.3

    def __init__(self, draft, log_: RoundLog):
        self.draft, self.log = draft, log_
        self.full = 0.5  # moving average of "the round accepted the draft's whole path" (optimistic start)
        self.pool = _pool(draft)
        self.job = None

    @staticmethod
    def usable(draft, params: SamplingParams, overlap: bool) -> bool:
        return overlap and params.greedy and draft is not None and hasattr(draft, "guess_next")

    def observe(self, full: bool) -> None:
        """After each round: did it accept the draft's whole path (the part of the guess before the bonus)?"""
        self.full += self.EMA * (float(full) - self.full)

    def start(self, context: list[int], path: list[int], make: Callable[[list[int]], object]) -> None:
        """Prepare make(guessed context) in the background; `path` is this round's greedy proposal path. Does
        nothing while whole paths are rarely accepted (MIN_FULL)."""
        if self.full < self.MIN_FULL:
            return
        snap = self.draft.snapshot()
        known, box = threading.Event(), {}

        @torch.inference_mode()
        def run():
            t0 = time.perf_counter()
            try:
                box["guess"] = self.draft.guess_next(context, path)
                known.set()
                return make(box["guess"])
            finally:
                known.set()
                box["s"] = time.perf_counter() - t0

        self.job = (self.pool.submit(run), snap, known, box, context + path)
        self.log.prepared += 1

    def take(self, context: list[int]):
        """-> (the prepared proposal or None, seconds the round waited for the job)."""
        if self.job is None:
            return None, 0.0
        fut, snap, known, box, prefix = self.job
        self.job = None
        t0 = time.perf_counter()
        if context[: len(prefix)] == prefix:
            known.wait()  # (the guess is the job's first forward)
        if box.get("guess") != context:
            self.draft.cancel.set()
        try:
            prepared = fut.result()
        except Exception as e:  # Cancelled, or a failure that the round's own drafting will meet and report
            if not isinstance(e, Cancelled):
                log.debug("lookahead failed: %s: %s", type(e).__name__, e)
            prepared = None
        finally:
            self.draft.cancel.clear()
        wait = time.perf_counter() - t0
        self.log.draft_hidden_s += max(0.0, box.get("s", 0.0) - wait)
        if prepared is None or box.get("guess") != context:
            self.draft.restore(snap)
            return None, wait
        self.log.reused += 1
        return prepared, wait

    def close(self) -> None:
        """Stop a job the generation no longer needs (it ended) and leave the draft as the last round left it."""
        if self.job is not None:
            self.take([])


def _propose(ahead: Lookahead | None, context: list[int], fresh: Callable[[], object], threads: int | None):
    """This round's proposal: the one prepared during the last sweep if verification's outcome was its guess,
    else fresh() computed with `threads`. Its draft_s is the drafting the round waited for."""
    prepared, wait = ahead.take(context) if ahead is not None else (None, 0.0)
    if prepared is None:
        with using_threads(threads):
            prepared = fresh()
        prepared.draft_s += wait
    else:
        prepared.draft_s = wait
    return prepared


class OneDraft:
    """The drafter of one sequence (round.py's interface): any Draft, which keeps its own state, and the
    lookahead that prepares the next round during the sweep where it can."""

    def __init__(self, draft, ahead: Lookahead | None, threads: int | None, max_depth: int):
        self.draft, self.ahead, self.threads, self.max_depth = draft, ahead, threads, max_depth
        self.spine: list[int] = []  # a tree round's greedy path, which its lookahead guessed would be accepted

    def propose(self, seqs: list[Seq], ks: list[int]) -> list:
        (s,), (k,) = seqs, ks
        context = s.context()
        p = _propose(self.ahead, context, lambda: self.draft.propose(context, k, s.params, s.generator), self.threads)
        drafts = p.tokens[:k]
        if self.ahead is not None and drafts and len(s.out) + len(drafts) + 2 < s.req.max_new_tokens:
            # (a next round will draft; K bound now: the job may run after the next round asked the controller)
            self.ahead.start(context, drafts,
                             lambda ctx, kk=s.controller.k(): self.draft.propose(ctx, kk, s.params, None))
        return [p]

    def propose_tree(self, s: Seq, budget: int, depth: int) -> TokenTree:
        context = s.context()
        tree = _propose(self.ahead, context, lambda: self.draft.propose_tree(context, budget, s.params, depth),
                        self.threads)
        self.spine = tree.spine() if self.ahead is not None else []
        next_depth = min(self.max_depth, s.left() - len(self.spine) - 2)
        if self.spine and next_depth > 0:  # (budget and depth bound now: the next round reassigns them)
            self.ahead.start(context, self.spine,
                             lambda ctx, b=budget, d=next_depth: self.draft.propose_tree(ctx, b, s.params, d))
        return tree

    def verified(self, plan: Plan) -> None:
        """Tell the lookahead whether the round accepted the draft's whole path (what it bets on)."""
        if self.ahead is not None:
            if plan.tree is not None and self.spine:
                self.ahead.observe([plan.tree.tokens[j] for j in plan.path] == self.spine)
            elif plan.tree is None and plan.drafts:
                self.ahead.observe(plan.accepted == len(plan.drafts))
        self.spine = []


def generate(target: Target, draft, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
             controller=None, eos_ids=(), generator: torch.Generator | None = None,
             on_tokens: Callable[[list[int]], None] | None = None, overlap: bool = True,
             draft_threads: int | None = None) -> tuple[list[int], str, RoundLog]:
    """Chain speculation (K drafts per round, K from the controller; draft=None means naive, one token per
    sweep). Returns (new tokens, finish reason "length" | "stop", per-round log). overlap: draft the next round
    during the sweep where it can (Lookahead). draft_threads: torch's threads while the round waits for the draft
    (runtime/threads.plan_threads; None: torch's setting)."""
    return _generate("chain", target, draft, prompt_ids, max_new_tokens, params, controller, eos_ids, generator,
                     on_tokens, overlap, draft_threads)


def generate_tree(target: Target, draft, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                  controller, eos_ids=(), generator: torch.Generator | None = None,
                  on_tokens: Callable[[list[int]], None] | None = None, max_depth: int = 24, overlap: bool = False,
                  draft_threads: int | None = None) -> tuple[list[int], str, RoundLog]:
    """Tree speculation: each round the draft proposes a token tree of at most controller.budget() nodes, and
    the target verifies all of them (with the pending tokens) in one sweep under a tree mask. The accepted
    root path's K/V are compacted into consecutive slots, the rest dropped: still one sweep per round.
    overlap (off by default for trees, see Engine.generate): grow the next round's tree during the sweep."""
    return _generate("tree", target, draft, prompt_ids, max_new_tokens, params, controller, eos_ids, generator,
                     on_tokens, overlap, draft_threads, max_depth)


def _generate(mode, target, draft, prompt_ids, max_new_tokens, params, controller, eos_ids, generator, on_tokens,
              overlap, draft_threads, max_depth: int = 24):
    """round.py's round for one sequence, whose cache is the target, until it ends."""
    s = Seq(Request(list(prompt_ids), max_new_tokens, params, 0), target, None, controller, generator,
            list(prompt_ids))
    if max_new_tokens <= 0:
        return s.out, "length", s.log
    ahead = Lookahead(draft, s.log) if Lookahead.usable(draft, params, overlap) else None
    drafter = None if draft is None else OneDraft(draft, ahead, draft_threads, max_depth)
    try:
        while True:
            plans = plan_trees([s], drafter, max_depth) if mode == "tree" else plan_chains([s], drafter)
            [logits], sweep_stats = sweep(target, plans)
            # (the first sweep also prefills the prompt: its time says nothing of what K costs)
            [emitted] = verify([s], plans, [logits], sweep_stats, costs=len(s.pending) == 1)
            if isinstance(emitted, Exception):
                raise emitted
            if drafter is not None:
                drafter.verified(plans[0])
            if not advance(s, emitted, eos_ids, on_tokens):
                return s.out, s.finish_reason, s.log
    finally:
        if ahead is not None:
            ahead.close()


def summarize(log: RoundLog, new_tokens: int, wall_s: float, mode: str) -> dict:
    sweeps = len(log.sweeps)
    proposed = sum(log.k)
    io = sum(s.io_s for s in log.sweeps)
    prep = sum(s.prep_s for s in log.sweeps)
    experts = sum(s.experts_read for s in log.sweeps)  # (MoE stores; 0 otherwise)
    hits = sum(s.expert_hits for s in log.sweeps)
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
            "draft_hidden_s": log.draft_hidden_s,
            # proposals prepared during a sweep, and the share of them that a round used
            "lookahead_prepared": log.prepared,
            "lookahead_reused": log.reused,
            "lookahead_reuse_rate": log.reused / log.prepared if log.prepared else None,
            "io_s": io,
            "prep_s": prep,
            "compute_s": sum(s.compute_s for s in log.sweeps),
            "stall_s": sum(s.stall_s for s in log.sweeps),
            "sweep_s": sum(s.wall_s for s in log.sweeps),
            # 1 - stall / (worker time): 1 when every read (and dequantize) hid behind compute
            "overlap_efficiency": 1.0 - sum(s.stall_s for s in log.sweeps) / (io + prep) if io + prep > 0 else None,
            # MoE stores: routed experts used (summed over sweeps and layers), and the share the expert cache held
            "experts_read": experts,
            "expert_hit_rate": hits / experts if experts else None,
            "acceptance_per_position": log.acceptance_per_position(),
            "k_per_round": log.k,
            "nodes_per_round": log.nodes,
            "accepted_per_round": log.accepted,
            "sweep_tokens": [s.tokens for s in log.sweeps],
        },
    }
