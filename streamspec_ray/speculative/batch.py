"""Batch generation: many sequences share every streamed sweep (continuous batching).

When the target streams from disk, a sweep costs one read of every layer whatever it carries, so up to B
sequences ride each sweep together. Each keeps its own target KV cache, draft state, K controller, sampling
generator and pending tokens, and every round is round.py's, for all of them at once:

    draft    every active sequence proposes its chunk (BatchDraft, a model draft: one batched draft forward
             per draft step, each sequence against its own draft cache; a tree: each grows its own)
    sweep    ONE target sweep_batch carries every sequence's [pending..., d_1..d_K] as a ragged batch
    verify   each sequence against its own logits rows and its own generator (the sampled chains in one
             batched test, rejection.verify_chains), rollback of its own cache
    refill   a finished sequence's slot takes the next request; its prompt rides the next sweep (prefill)

Per sequence the draws come from its own generator in loop.generate's order, so a sequence's output does not
depend on what else is in the batch: greedy tokens are one-at-a-time generation's, and sampled ones follow
the request's seed. (Float rounding differs with the batch's shape, as chain vs naive rounding does; only an
exact tie, or a uniform draw landing within rounding of a boundary, could tell them apart.)
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import ConfigError, describe
from ..models.layers import Chunk
from ..quant.packed import kernel_only
from ..runtime.threads import using as using_threads
from .draft_length import line_fit, make_budget_controller, make_controller
from .drafts import Draft, ModelDraft, NgramDraft, Proposal, common_prefix
from .requests import (MODES, OPTIONS, Request, Source, chat_ids, check_mode,  # noqa: F401 (batch.X users)
                       requests_from, to_request)
from .round import RoundLog, Seq, advance, plan_chains, plan_trees, verify
from .round import sweep as round_sweep
from .sampling import draw
from .tree import TokenTree

log = logging.getLogger("streamspec")


# ---- drafts: one state per slot over one resident draft ---------------------------------------------------

@dataclass
class _SlotCache:
    """A sequence's draft state: its own cache over the shared draft weights, and the tokens it holds."""
    cache: object  # ModelDraft.new_cache's
    tokens: list[int] = field(default_factory=list)


class BatchDraft:
    """Proposals for every active sequence of a round, one draft state per sequence over one resident draft.

    chain: a model draft (self-int4, skip:, another store) keeps one cache per sequence and runs each draft
    step for all sequences as one ragged batch. tree: each sequence has its own ModelDraft over the shared
    weights and grows its tree on its own (ModelDraft.propose_tree). n-gram drafts hold no state."""

    def __init__(self, draft: Draft, mode: str = "chain", threads: int | None = None):
        """threads: torch's threads while the round drafts (runtime/threads.plan_threads; None: as set)."""
        if isinstance(draft, ModelDraft):
            self.model = draft
        elif isinstance(draft, NgramDraft):
            self.model = None
        else:
            raise ConfigError(f"batch generation takes a self-int4, skip:, store or ngram draft, not {draft.name!r}, "
                              "which drafts one sequence at a time (generate)")
        self.draft, self.mode, self.threads = draft, mode, threads
        self.name = draft.name

    def new_state(self):
        m = self.model
        if m is None:
            return None
        if self.mode == "tree":  # its own cache (and tree bookkeeping), the same weights
            return m.twin()
        return _SlotCache(m.new_cache())

    def propose_tree(self, s: "Seq", budget: int, depth: int) -> TokenTree:
        with using_threads(self.threads):
            return (s.draft_state or self.draft).propose_tree(s.context(), budget, s.params, depth)

    @torch.inference_mode()
    def propose(self, seqs: list["Seq"], ks: list[int]) -> list[Proposal | None]:
        """One proposal of ks[i] tokens per sequence (None where ks[i] == 0); draft_s is the whole round's."""
        t0 = time.perf_counter()
        todo = [(s, k) for s, k in zip(seqs, ks) if k > 0]
        with using_threads(self.threads):
            if self.model is None:
                got = {id(s): self.draft.propose(s.context(), k, s.params, s.generator) for s, k in todo}
            else:
                got = self._propose_model(todo)
        draft_s = time.perf_counter() - t0
        out = []
        for s, k in zip(seqs, ks):
            p = got.get(id(s)) if k > 0 else None
            if p is not None:
                p.draft_s = draft_s
            out.append(p)
        return out

    def _propose_model(self, todo: list[tuple["Seq", int]]) -> dict[int, Proposal]:
        def forward(chunks, seqs):  # -> the logits after each chunk's last token [V]
            # greedy sequences' calls may go dense when wide (prompts entering the draft); sampled ones' stay on
            # the kernel, whose rows do not depend on the batch (packed.kernel_only)
            greedy = [j for j, s in enumerate(seqs) if s.params.greedy]
            rest = [j for j, s in enumerate(seqs) if not s.params.greedy]
            out = [None] * len(chunks)
            for group, narrow in ((greedy, False), (rest, True)):
                if group:
                    with kernel_only(narrow):
                        for j, x in zip(group, self.model.forward_batch([chunks[j] for j in group])):
                            out[j] = x[-1]
            return out

        chunks = []
        for s, _ in todo:  # rollback: keep the longest common prefix of the cache and the new context
            st, ctx = s.draft_state, s.context()
            n = common_prefix(st.tokens, ctx)
            st.cache.truncate(n)
            st.tokens[n:] = ctx[n:]
            chunks.append(Chunk(ctx[n:], st.cache, logits_from=len(ctx) - n - 1))
        logits = forward(chunks, [s for s, _ in todo])
        tokens: list[list[int]] = [[] for _ in todo]
        probs: list[list[torch.Tensor]] = [[] for _ in todo]
        for step in range(max(k for _, k in todo)):
            feed = []
            for j, (s, k) in enumerate(todo):
                if step >= k:
                    continue
                tok, q = draw(logits[j], s.params, s.generator)  # (its own generator, as ModelDraft.propose)
                tokens[j].append(tok)
                if q is not None:
                    probs[j].append(q)
                if step + 1 < k:
                    feed.append(j)
            if feed:
                for j, x in zip(feed, forward([Chunk([tokens[j][-1]], todo[j][0].draft_state.cache)
                                               for j in feed], [todo[j][0] for j in feed])):
                    logits[j] = x
                    todo[j][0].draft_state.tokens.append(tokens[j][-1])
        return {id(s): Proposal(tokens[j], torch.stack(probs[j]) if probs[j] else None)
                for j, (s, _) in enumerate(todo)}


# ---- the loop ---------------------------------------------------------------------------------------------

@dataclass
class Finished:
    """A completed request: its new tokens, why it stopped, its rounds and its wall time since admission."""
    req: Request
    token_ids: list[int]
    finish_reason: str
    log: RoundLog
    wall_s: float
    controller: str | None  # the K controller's name (None: naive)
    error: str | None = None  # finish_reason "error": what failed, for this sequence alone


@dataclass(frozen=True)
class Policy:
    """How every sequence of a batch speculates: naive, chain (K drafts per round, K an int or a controller
    name) or tree (a token tree of at most `budget` nodes and `max_depth` levels per round)."""
    mode: str = "chain"
    k: int | str = "adaptive"
    budget: int | str = "adaptive"
    max_depth: int = 24

    def controller(self):
        if self.mode == "chain":
            return make_controller(self.k)
        return make_budget_controller(self.budget) if self.mode == "tree" else None


@dataclass
class _Mark:
    """What a sequence was before a round, to take it back there when a round it shared failed: its target
    cache length and its generator's state (so a rerun draws what the failed round would have drawn)."""
    length: int
    rng: torch.Tensor

    @classmethod
    def of(cls, s: Seq) -> "_Mark":
        return cls(s.cache.length, s.generator.get_state())

    def restore(self, s: Seq, draft: BatchDraft | None) -> None:
        if s.cache.length > self.length:
            s.cache.truncate(self.length)
        s.generator.set_state(self.rng)
        if draft is not None:  # a draft step may have stopped half-way: its cache is rebuilt from the context
            s.draft_state = draft.new_state()


def _sweep_round(target, draft: BatchDraft | None, seqs: list[Seq], policy: Policy, totals: dict):
    """Draft and sweep one round for `seqs` -> (plans, logits per sequence [rows after pending, V], sweep)."""
    t0 = time.perf_counter()
    plans = plan_trees(seqs, draft, policy.max_depth) if policy.mode == "tree" else plan_chains(seqs, draft)
    totals["draft_s"] += time.perf_counter() - t0
    logits, sweep = round_sweep(target, plans)
    totals["sweeps"] += 1
    totals["bytes_read"] += sweep.bytes_read
    totals["sweep_s"] += sweep.wall_s
    totals["rows"] += len(plans)
    return plans, logits, sweep


@torch.inference_mode()
def run(target, draft: BatchDraft | None, next_request: Callable[[], Request | None], batch_size: int,
        policy: Policy = Policy(), eos_ids=(), on_finished: Callable[[Finished], None] | None = None,
        on_tokens: Callable[[Request, list[int]], None] | None = None, stop: threading.Event | None = None) -> dict:
    """Generate every request next_request() hands out, up to batch_size at once, one target sweep per round.

    target: new_cache() and sweep_batch(chunks) -> (logits per chunk, SweepStats) (StreamingExecutor, or the
    Ray verifier's RemoteExecutor). draft=None: naive (one token per sequence per sweep). on_finished gets each
    request as it completes; `stop` (set by another replica that failed) ends the loop after the round.
    Returns this loop's totals: sweeps, bytes_read, sweep_s, draft_s, rows (sequences summed over sweeps).

    One sequence's failure is its own: it finishes with finish_reason "error" (and the message) and the others
    go on. A failure in a step the batch shares (the draft's batched forward, the sweep) cannot name its
    sequence, so the round is taken back (_Mark) and each sequence runs it alone: the ones that fail alone
    end, the others carry on with what they would have had alone."""
    if batch_size < 1:
        raise ConfigError(f"batch size must be at least 1, got {batch_size}")
    active: list[Seq] = []
    exhausted = False
    totals = {"sweeps": 0, "bytes_read": 0, "sweep_s": 0.0, "draft_s": 0.0, "rows": 0}
    fit: list[tuple[int, float]] = []  # (rows, seconds) of recent sweeps that prefilled nothing

    def finish(s: Seq, reason: str, error: BaseException | None = None) -> None:
        message = None if error is None else describe(error)
        if error is not None:
            log.warning("request %r failed: %s", s.req.tag, message, exc_info=log.isEnabledFor(logging.DEBUG))
        if on_finished is not None:
            on_finished(Finished(s.req, s.out, reason, s.log, time.perf_counter() - s.t0,
                                 s.controller.name if s.controller else None, message))

    while True:
        while not exhausted and len(active) < batch_size:  # continuous batching: fill the free slots
            req = next_request(not active) if isinstance(next_request, Source) else next_request()
            if req is None:
                # a Source answers None without waiting while sequences run, and for good once it is closed
                exhausted = not isinstance(next_request, Source) or not active
                break
            s = Seq(req, None, None, None, torch.Generator(), list(req.prompt_ids))
            try:
                s.cache, s.generator = target.new_cache(), torch.Generator().manual_seed(req.seed)
                s.draft_state = draft.new_state() if draft else None
                s.controller = policy.controller() if draft else None
            except Exception as e:  # noqa: BLE001 (this request ends; the others go on)
                finish(s, "error", e)
                continue
            active.append(s)
        gone = [s for s in active if s.req.cancel is not None and s.req.cancel.is_set()]
        for s in gone:  # cancelled between rounds: its slot is free for the next request
            active.remove(s)
            finish(s, "cancelled")
        if gone and not active and not exhausted:
            continue
        if not active or (stop is not None and stop.is_set()):
            return totals
        marks = [_Mark.of(s) for s in active]
        try:
            rounds = [(active, *_sweep_round(target, draft, active, policy, totals))]
        except Exception as e:  # noqa: BLE001 (see the docstring: each sequence runs the round alone)
            rounds = []
            if len(active) == 1:
                finish(active[0], "error", e)
            else:
                log.warning("a round of %d sequences failed (%s): each runs it alone", len(active), describe(e))
                for s, mark in zip(active, marks):
                    mark.restore(s, draft)
                    try:
                        rounds.append(([s], *_sweep_round(target, draft, [s], policy, totals)))
                    except Exception as alone:  # noqa: BLE001
                        finish(s, "error", alone)
        still = []
        for seqs, plans, logits, sweep in rounds:
            # a round that prefills a prompt (in the sweep, and in the draft's cache) costs what no K explains
            costs = all(len(s.pending) == 1 for s in seqs)
            if costs:  # the sweep's time against its rows, over recent rounds (see _verify)
                fit = (fit + [(sum(len(p.tokens) for p in plans), sweep.wall_s)])[-32:]
            sweep_cost = line_fit(fit) if len({r for r, _ in fit}) > 1 else None
            for s, emitted in zip(seqs, verify(seqs, plans, logits, sweep, costs, sweep_cost)):
                hook = None if on_tokens is None else (lambda tokens, req=s.req: on_tokens(req, tokens))
                try:
                    if isinstance(emitted, Exception):
                        raise emitted
                    going = advance(s, emitted, eos_ids, hook)
                except Exception as e:  # noqa: BLE001 (this sequence ends; the others go on)
                    finish(s, "error", e)
                    continue
                if going:
                    still.append(s)
                else:
                    finish(s, s.finish_reason)
        active = still


def run_all(pipelines: list, next_request, batch_size: int | list[int], policy: Policy, eos_ids, on_finished,
            on_tokens) -> dict:
    """run() on every (target, draft) pipeline, all pulling from one next_request; several pipelines run in
    threads (their remote sweeps overlap), with the callbacks serialized. If one fails the others stop after
    their round and the first error is raised. Returns the summed totals. batch_size: each pipeline's, or one
    per pipeline (a pipeline given 0 does not run)."""
    sizes = batch_size if isinstance(batch_size, list) else [batch_size] * len(pipelines)
    pipelines, sizes = [p for p, n in zip(pipelines, sizes) if n > 0], [n for n in sizes if n > 0]
    if len(pipelines) == 1:
        return run(*pipelines[0], next_request, sizes[0], policy, eos_ids, on_finished, on_tokens)
    lock, stop, errors, totals = threading.Lock(), threading.Event(), [], []

    def serialized(fn):
        def call(*args):
            with lock:
                return fn(*args)
        return None if fn is None else call

    def work(target, draft, size):
        try:
            totals.append(run(target, draft, next_request, size, policy, eos_ids, serialized(on_finished),
                              serialized(on_tokens), stop))
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the caller's thread)
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=work, args=(*p, n), name=f"streamspec-batch-{i}", daemon=True)
               for i, (p, n) in enumerate(zip(pipelines, sizes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return {key: sum(t[key] for t in totals) for key in totals[0]}


class BatchResults(list):
    """generate_batch's answer: a list of GenerationResult (request order) plus `stats` for the whole batch."""
    stats: dict = {}


def batch_stats(results: list, totals: dict, wall_s: float, mode: str, batch_size: int, replicas: int) -> dict:
    tokens = sum(len(r.token_ids) for r in results if r is not None)
    sweeps = totals["sweeps"]
    return {"mode": mode, "requests": len(results), "batch_size": batch_size, "replicas": replicas,
            "new_tokens": tokens, "wall_s": wall_s, "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
            "sweeps": sweeps, "tokens_per_sweep": tokens / sweeps if sweeps else 0.0,
            "sequences_per_sweep": totals["rows"] / sweeps if sweeps else 0.0, "bytes_read": totals["bytes_read"],
            "bytes_per_token": totals["bytes_read"] / tokens if tokens else 0.0, "sweep_s": totals["sweep_s"],
            "draft_s": totals["draft_s"]}
