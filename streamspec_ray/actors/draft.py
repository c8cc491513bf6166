"""DraftActor: holds one draft (speculative.drafts) and proposes.

The sampling generator crosses the boundary as its state: the driver sends the state before the call and
adopts the state after it, so draft sampling and the driver's verification draw from one torch.Generator
sequence, exactly as in the in-process engine.

Restart safety: a model draft's KV cache is part of what it computes (feeding a context in one chunk or in
several gives different float rounding), so every call carries its sequence number. A fresh actor (Ray
restarted it) answers None, and the driver replays the calls of this generation to rebuild the same state.
"""
from __future__ import annotations

import os
import ray
import torch

from ..speculative.drafts import Draft, make_draft
from ..store.store import LayerStore
from .common import TIMEOUT_S, node_id, normal_priority
from ..store.manifest import MANIFEST
from .store import RemoteStore


class DraftServer:
    """The plain class behind DraftActor. `draft` is a spec (`self-int4`, `skip:...`, `ngram`, a store path)
    or a Draft object shipped from the driver. Drafts made of the target's own units (self-int4, skip; ngram)
    read them through the LayerStoreActor, so this actor needs no access to the store's disk."""

    def __init__(self, draft, store_root: str, store_actor=None, dtype=torch.float32, device: str = "cpu",
                 threads: int | None = None, timeout_s: float = TIMEOUT_S):
        normal_priority()
        if threads:
            torch.set_num_threads(threads)  # the driver's count: the same matmul blocking, the same bits
        self.spec, self.store_root, self.store_actor = draft, store_root, store_actor
        self.dtype, self.device, self.timeout_s = dtype, device, timeout_s
        self.draft: Draft | None = None  # built on first use: a restart while the store is down says StoreLost
        self.seq = 0

    def _setup(self) -> Draft:
        if self.draft is not None:
            return self.draft
        draft = self.spec
        if isinstance(draft, list):  # [ObjectRef of a Draft] shipped from the driver
            draft = ray.get(draft[0], timeout=self.timeout_s)
        if not isinstance(draft, Draft):
            own = draft in ("self-int4", "ngram") or draft.startswith("skip:")
            # self-int4 where this node has the store's files: the same draft Engine builds (kept on disk, from
            # the source's own 4-bit blocks), so sampled outputs match Engine's seed for seed
            local = draft == "self-int4" and os.path.isfile(os.path.join(self.store_root, MANIFEST))
            if own and self.store_actor is not None and not local:
                store = RemoteStore(self.store_actor, self.timeout_s)
            else:
                store = LayerStore(self.store_root)
            draft = make_draft(draft, store, self.dtype, self.device)
        self.draft = draft
        return draft

    def ready(self) -> dict:
        d = self._setup()
        return {"name": d.name, "resident_bytes": d.resident_bytes, "node_id": node_id()}

    def pid(self) -> int:
        return os.getpid()

    def reset(self) -> None:
        self._setup().reset()
        self.seq = 0

    def _propose(self, context, k, params, state):
        gen = None
        if state is not None:
            gen = torch.Generator()
            gen.set_state(state)
        proposal = self._setup().propose(context, k, params, gen)
        self.seq += 1
        return proposal, None if gen is None else gen.get_state()

    def propose(self, seq: int, context: list[int], k: int, params, state):
        """-> (Proposal, generator state after) or None if this actor has not seen calls 0..seq-1 (restarted)."""
        if seq != self.seq:
            return None
        return self._propose(context, k, params, state)

    def propose_tree(self, seq: int, context: list[int], budget: int, params, max_depth: int):
        """-> TokenTree, or None if this actor has not seen calls 0..seq-1 (restarted)."""
        if seq != self.seq:
            return None
        tree = self._setup().propose_tree(context, budget, params, max_depth)
        self.seq += 1
        return tree

    def replay(self, calls) -> None:
        """Re-run this generation's calls on a fresh draft: chains (context, k, params, state) and trees
        ("tree", context, budget, params, max_depth)."""
        self.reset()
        for call in calls:
            if call[0] == "tree":
                self.propose_tree(self.seq, *call[1:])
            else:
                self._propose(*call)
