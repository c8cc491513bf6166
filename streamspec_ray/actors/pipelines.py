"""Batch jobs on the actors: RayEngine.generate_batch's pipelines.

Each pipeline is one VerifierActor (this engine's own, then replicas - 1 more made for the batch and killed
after it; all read from the one LayerStoreActor) driven by a thread on the driver that runs speculative.batch.run,
so the pipelines' sweeps overlap and they pull prompts from one shared queue. The batch's draft runs on the
driver: one state per sequence over one resident draft, batched across sequences (speculative.batch.BatchDraft);
the DraftActor holds one sequence's state and is not used by batches.

A staged engine's pipelines are groups of sequences over the same stage actors (actors/stages.py), by default
as many as there are stages, splitting the batch between them: each stage runs one group's round while the
next stage runs another's.
"""
from __future__ import annotations

import contextlib

import torch

from ..speculative.batch import BatchDraft
from ..speculative.drafts import Draft, make_draft
from .remote import RemoteExecutor, drain
from .stages import StagedExecutor
from .store import RemoteStore
from .supervise import Supervised, with_store


def local_draft(eng) -> Draft:
    """The engine's draft, built once on the driver: a Draft object as given, else from its spec, reading the
    target's units through the store actor (so the driver needs no access to the store's disk)."""
    draft = getattr(eng, "_batch_draft", None)
    if draft is None:
        spec = eng.draft_spec
        if isinstance(spec, Draft):
            draft = spec
        else:
            device = eng.device if not eng.device.startswith("cuda") or torch.cuda.is_available() else "cpu"
            draft = with_store(eng._store, lambda: make_draft(spec, RemoteStore(eng._store_name, eng._store.timeout_s),
                                                             eng.dtype, device))
        eng._batch_draft = draft
    return draft


@contextlib.contextmanager
def pipelines(eng, mode: str, replicas: int):
    """Yields [(RemoteExecutor, BatchDraft or None)] for `replicas` verifiers; the extra ones are killed after."""

    draft = None if mode == "naive" else BatchDraft(local_draft(eng), mode)
    if eng._stages:
        groups = replicas if replicas > 1 else len(eng._stages)
        yield [(StagedExecutor(eng._stages, group=g), draft) for g in range(groups)]
        return
    extra: list[Supervised] = []
    try:
        if replicas > 1:  # the engine's own verifier recipe (same store actor, settings and placement)
            v = eng._verifier
            extra = [Supervised(f"verifier {i + 2}", v.spawn, v.max_restarts, v.timeout_s, wait=False)
                     for i in range(replicas - 1)]
            Supervised.start_all(extra, v.timeout_s)
        yield [(RemoteExecutor(v, eng._store), draft) for v in [eng._verifier, *extra]]
    finally:
        for v in extra:
            drain(v)
            v.kill()
