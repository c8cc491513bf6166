"""The driver's side of the actors: the target's executor, its caches and the draft, as the round sees them
(StreamingExecutor's and Draft's interfaces), each call a remote one with the state to replay it kept here."""
from __future__ import annotations

import dataclasses
import time
import uuid

import ray

from ..errors import StreamspecError
from ..speculative.drafts import Draft, Proposal
from .supervise import Supervised, with_store


class RemoteCache:
    """The target's KV cache as the loop sees it: the K/V live in the VerifierActor; this keeps the committed
    length and the sweeps that built it (replayed if the verifier restarts)."""

    def __init__(self):
        self.id = uuid.uuid4().hex
        self.length = 0
        self.keep: tuple | None = None  # a compaction still to send: (at, slots)
        self.history: list[tuple] = []  # (start, tokens, positions, mask) per sweep

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} tokens to {n}")
        self.length = n  # sent with the next sweep: one round trip per round
        self.keep = None

    def compact(self, at: int, slots: list[int]) -> None:
        """After a tree round: keep [0, at) and the accepted path's slots (sent with the next sweep)."""
        if at > self.length or any(s >= self.length for s in slots):
            raise ValueError(f"compact: slots {slots} outside a cache of {self.length} tokens")
        self.keep = (at, list(slots))
        self.length = at + len(slots)

    def entry(self, tokens, positions=None, mask=None) -> tuple:
        """The next sweep as the actors take it and a replay repeats it: (start, tokens, positions, mask), start
        being the committed length or a compaction still to send."""
        return (self.keep or self.length, [int(t) for t in tokens], positions, mask)

    def commit(self, entry: tuple) -> None:
        """The sweep `entry` ran: it joins the history, and its tokens the committed length."""
        self.keep = None
        self.history.append(entry)
        self.length += len(entry[1])


class RemoteExecutor:
    """StreamingExecutor's interface (new_cache, sweep) backed by the VerifierActor."""

    def __init__(self, verifier: Supervised, store: Supervised):
        self.verifier, self.store = verifier, store
        self.sweeps = 0
        self.bytes_read = 0
        self.remote_s = 0.0  # round trips minus the verifier's own sweep time: Ray's share
        self._direct: bool | None = None

    def new_cache(self) -> RemoteCache:
        return RemoteCache()

    @property
    def direct(self) -> bool | None:
        """Whether the store actor reads with O_DIRECT (`generate --json`'s direct_reads), asked once. None when
        it cannot be asked (lost after the generation's last sweep): a finished generation's result is not lost
        for a figure in its stats."""
        if self._direct is None:
            try:
                self._direct = bool(self.store.call("reads_direct"))
            except StreamspecError:
                return None
        return self._direct

    def _sweep(self, cache: RemoteCache, entry: tuple, logits_from: int):
        start, tokens, positions, mask = entry
        args = (cache.id, len(cache.history), start, tokens, logits_from, positions, mask)

        def attempt():
            out = self.verifier.call("sweep", *args)
            if out is None:  # a restarted verifier: rebuild the cache from the history, then sweep
                self.verifier.call("replay", cache.id, cache.history)
                out = self.verifier.call("sweep", *args)
            return out

        return with_store(self.store, attempt)  # a store lost under the verifier is revived, the sweep re-run

    def sweep(self, tokens, cache: RemoteCache, positions=None, mask=None, logits_from: int = 0):
        """tokens [T] after cache.length committed ones -> (logits [T - logits_from, V] fp32, SweepStats).
        SweepStats.wall_s is the driver's round trip; compute/stall/io are measured inside the actors."""
        t0 = time.perf_counter()
        entry = cache.entry(tokens, positions, mask)
        logits, st = self._sweep(cache, entry, logits_from)
        wall = time.perf_counter() - t0
        cache.commit(entry)
        self.sweeps += 1
        self.bytes_read += st.bytes_read
        self.remote_s += wall - st.wall_s
        return logits, dataclasses.replace(st, wall_s=wall)

    def sweep_batch(self, chunks):
        """StreamingExecutor.sweep_batch on the verifier: Chunks over RemoteCaches -> (logits per chunk,
        SweepStats). A restarted verifier gets the live caches replayed (VerifierActor.replay_caches)."""
        t0 = time.perf_counter()
        # start: the committed length, or (at, slots) to keep after a tree round (RemoteCache.compact)
        entries = [c.cache.entry(c.ids.tolist(), c.positions, c.mask) for c in chunks]
        items = [(c.cache.id, len(c.cache.history), c.logits_from, *e) for c, e in zip(chunks, entries)]

        def attempt():
            out = self.verifier.call("sweep_batch", items)
            if out is None:
                self.verifier.call("replay_caches", [(c.cache.id, c.cache.history) for c in chunks])
                out = self.verifier.call("sweep_batch", items)
            return out

        logits, st = with_store(self.store, attempt)
        wall = time.perf_counter() - t0
        for c, e in zip(chunks, entries):
            c.cache.commit(e)
        self.sweeps += 1
        self.bytes_read += st.bytes_read
        self.remote_s += wall - st.wall_s
        return logits, dataclasses.replace(st, wall_s=wall)


class RemoteDraft(Draft):
    """A Draft whose propose runs in the DraftActor. Keeps this generation's calls to replay on a restart."""

    def __init__(self, actor: Supervised, store: Supervised):
        self.actor, self.store = actor, store
        self.name = actor.info["name"]
        self.resident_bytes = actor.info["resident_bytes"]
        self.calls: list[tuple] = []

    def reset(self) -> None:
        self.calls = []
        with_store(self.store, lambda: self.actor.call("reset"))

    def propose(self, context, k, params, generator) -> Proposal:
        state = None if params.greedy or generator is None else generator.get_state()
        call = (list(context), k, params, state)
        t0 = time.perf_counter()

        def attempt():
            out = self.actor.call("propose", len(self.calls), *call)
            if out is None:  # a restarted draft: replay this generation's calls to rebuild its cache, then propose
                self.actor.call("replay", self.calls)
                out = self.actor.call("propose", len(self.calls), *call)
            return out

        proposal, state = with_store(self.store, attempt)  # (a restarted draft rebuilds from the store)
        if state is not None:
            generator.set_state(state)  # the draws the draft made, so verification continues the same sequence
        self.calls.append(call)
        proposal.draft_s = time.perf_counter() - t0  # the round trip is what a round pays for drafting
        return proposal

    def propose_tree(self, context, budget, params, max_depth):
        call = ("tree", list(context), budget, params, max_depth)
        t0 = time.perf_counter()

        def attempt():
            out = self.actor.call("propose_tree", len(self.calls), *call[1:])
            if out is None:  # restarted: replay this generation's calls, then grow the tree
                self.actor.call("replay", self.calls)
                out = self.actor.call("propose_tree", len(self.calls), *call[1:])
            return out

        tree = with_store(self.store, attempt)
        self.calls.append(call)
        tree.draft_s = time.perf_counter() - t0
        return tree


def drain(verifier: Supervised, timeout_s: float = 15.0) -> None:
    """Let a verifier's reads in flight finish before it and the store actor are killed (Verifier.drain);
    best effort: a verifier already dead or stuck is killed anyway."""
    try:
        ray.get(verifier.handle.drain.remote(), timeout=timeout_s)
    except Exception:
        pass
