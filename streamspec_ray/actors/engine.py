"""RayEngine: Engine's constructor, generate and logits, with the target and the draft on Ray actors.

    driver (this object)         speculative.loop.generate: drafts via RemoteDraft, sweeps via RemoteExecutor,
                                 verification and sampling on the driver's own torch.Generator
    LayerStoreActor (store node) reads and checksums shards, serves them as object-store buffers
    VerifierActor (verifier node) embedding + KV cache; streams layers from the store actor, read ahead
    DraftActor                   the draft model; proposals carry the generator state both ways

The generation loop is the in-process engine's own (RayEngine subclasses Engine and swaps only the executor
and the draft), so the tokens are the same as Engine's, greedy or sampled with the same seed. Every remote
call has a timeout; an actor that dies is revived (Ray restart, else a new actor) and the call re-run, with
state rebuilt by replaying this generation's calls; if it cannot be revived, ActorFailure (a StreamspecError)
carries the tokens emitted so far.
"""
from __future__ import annotations

import os
import tempfile
import uuid

import ray
import torch

from ..engine import Engine, Setup
from ..errors import ConfigError, StreamspecError
from ..speculative.drafts import Draft
from ..runtime.split import parse_split
from ..store.default import resolve_store
from .pipelines import pipelines
from .common import STORE_RESOURCE, TIMEOUT_S, VERIFIER_RESOURCE, ActorFailure, ensure_ray, node_id, placement
from .draft import DraftServer
from .store import StoreServer
from .remote import RemoteDraft, RemoteExecutor, drain  # noqa: F401 (engine.X users)
from .supervise import Supervised, spawn_named, with_store
from .stages import StagedExecutor, StageRecipe, drain_stages, spawn_stages
from .verifier import Verifier

__all__ = ["RayEngine", "ActorFailure"]


def _actor(cls, max_restarts: int, retries: int, options: dict):
    # num_cpus=0: actors take turns (draft, then sweep), and torch's thread count is set explicitly inside
    return ray.remote(num_cpus=0, max_restarts=max_restarts, max_task_retries=retries, **options)(cls)


class RayEngine(Engine):
    """Engine's constructor plus: address (join a cluster; default $RAY_ADDRESS, else an embedded Ray),
    max_restarts (revivals per actor; 0: the first death is final), timeout_s (every remote wait).
    prefetch_depth: units requested ahead of the one computing; the store actor serves them concurrently.
    shared_ring: where the store and verifier actors share a node, shards go through a shared-memory ring
    (runtime/shm.py) instead of the object store, which copies each once more (False: always the object store).
    direct None (the default): the store actor reads with O_DIRECT when its node's page cache cannot keep a
    sweep (as Engine's executor decides in process; a CUDA verifier's store keeps the page cache). threads,
    expert_cache, target_dtype: as Engine's; the actors compute on the counts the driver resolves
    (runtime/threads.resolve), and the verifier keeps the expert cache.
    stages, split: the target's layers on pipeline stage actors instead of one verifier (actors/stages.py):
    `stages` ranges sized by the stage nodes' memory, or `split`'s ranges ("0:12,12:28" or [(0, 12), (12, 28)]);
    memory_budget then applies to each stage. stage_memory_limit: each stage process joins a memory cgroup of that
    many bytes (a node of that size, on one machine)."""

    def __init__(self, target: str | None = None, draft: str | Draft | None = "self-int4",
                 memory_budget: float | None = None, device: str = "cpu", cold: bool = False,
                 prefetch_depth: int | None = None, dtype: torch.dtype = torch.float32, direct: bool | None = None,
                 threads: int | str | None = "auto", expert_cache: float | None = None,
                 target_dtype: str | None = None, *, address: str | None = None,
                 max_restarts: int = 3, timeout_s: float = TIMEOUT_S, shared_ring: bool = True,
                 stages: int | None = None, split: str | list | None = None, stage_memory_limit: int | None = None):
        if max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0, got {max_restarts}")
        if stages is not None and stages < 1:
            raise ConfigError(f"stages must be at least 1, got {stages}")
        if isinstance(split, str):
            parse_split(split)  # (its form, before any actor starts; where it must end, once the store is open)
        if (stages is not None or split is not None) and expert_cache:
            raise ConfigError("an expert cache is not supported with stages yet: a MoE stage streams its experts")
        self._ray = (address, max_restarts, timeout_s, shared_ring)  # (read by _start, which Engine's calls)
        self._staging = (stages, split, stage_memory_limit)
        self._stages: list[Supervised] = []
        super().__init__(target, draft, memory_budget, device, cold, prefetch_depth, dtype, direct, threads,
                         expert_cache, target_dtype)

    def _start(self, s: Setup, draft: str | Draft | None) -> None:
        """Engine's construction with the store, the target's sweeps and the draft on actors: the round runs
        here on the driver against a RemoteExecutor and a RemoteDraft (actors/remote.py)."""
        address, n, timeout_s, shared_ring = self._ray
        device, dtype, cold, direct, threads = self.device, self.dtype, s.cold, s.direct, self.threads
        # (the actors read a fixed depth ahead: no memory plan across processes)
        prefetch_depth = 2 if s.prefetch_depth is None else s.prefetch_depth
        ensure_ray(address)
        root = resolve_store(s.target, s.target_dtype)  # converted here on first use (a named model, a GGUF...)
        root = os.path.abspath(root) if os.path.exists(root) else root  # else: a path on the store's node
        self.root, self.cold = root, cold
        self.store = None  # the LayerStore lives in the LayerStoreActor
        # the actors compute on the threads Engine would (runtime/threads.resolve), long sweeps on the drafting
        # count as Engine's executor does (executor.wide_threads): the same matmul blocking, the same bits
        wide = self.draft_threads if self.draft_threads > threads else None
        # an actor sees only the GPU Ray gave it, as cuda:0
        actor_device = "cuda" if device.startswith("cuda") else device
        verifier_opts = placement(VERIFIER_RESOURCE, device)
        # on a GPU the draft shares the verifier's node and GPU; on CPUs Ray places it
        draft_opts = placement(VERIFIER_RESOURCE if device.startswith("cuda") else None, device)

        # The store actor has one name for this engine's life (a recreated one takes it over), and the others
        # find it by name: a handle passed as a constructor argument would live in the object store, which Ray
        # warns makes restarts fragile, and would point at the dead actor after a recreation.
        self._store_name = f"streamspec-store-{uuid.uuid4().hex[:12]}"
        if direct is None and device.startswith("cuda"):
            direct = False  # (as StreamingExecutor: CUDA runs keep the page cache)

        def spawn_store():
            # reads are idempotent: Ray may retry them itself on a restarted store (max_task_retries).
            # depth + 1 threads: the verifier keeps `depth` reads requested, and one more thread lets the next
            # read start while a finished one is still being copied into the object store
            options = {"name": self._store_name, "max_concurrency": max(prefetch_depth, 1) + 1,
                       **placement(STORE_RESOURCE)}
            return spawn_named(lambda: _actor(StoreServer, n, n, options).remote(root, cold, direct), timeout_s)

        stages, split, stage_limit = self._staging
        self._store = Supervised("layer store", spawn_store, n, timeout_s, on_new=self._new_store, wait=False)
        self._verifier = None  # (staged: the stage actors run the target instead, each from its own node's disk)
        if stages is None and split is None:
            self._verifier = Supervised("verifier", lambda: _actor(Verifier, n, 0, verifier_opts)
                                        .remote(self._store_name, dtype, actor_device, prefetch_depth,
                                                s.memory_budget, threads, timeout_s, shared_ring, wide,
                                                s.expert_cache), n, timeout_s, wait=False)
        self._draft_actor = None
        parts = [self._store] + ([self._verifier] if self._verifier is not None else [])
        if draft is not None:
            # a Draft object is shipped once, by reference, inside a list: a bare ObjectRef argument would be
            # resolved by Ray, and Ray warns that restarts depend on constructor arguments in the object store
            spec = [ray.put(draft)] if isinstance(draft, Draft) else draft
            self._draft_actor = Supervised("draft", lambda: _actor(DraftServer, n, 0, draft_opts)
                                           .remote(spec, root, self._store_name, dtype, actor_device, threads,
                                                   timeout_s), n, timeout_s, wait=False)
            parts.append(self._draft_actor)
        try:
            Supervised.start_all(parts, timeout_s)  # one wait for all three (the draft may take a while to build)
        except BaseException:
            for part in parts:  # a bad draft or store: leave no actors behind
                part.kill()
            raise

        manifest = self._store.call("info")
        self.args = manifest.args
        if self._verifier is None:
            recipe = StageRecipe(root, dtype, actor_device, prefetch_depth, s.memory_budget, threads, timeout_s,
                                 wide, cold, direct, stage_limit, n)
            try:
                self._stages = spawn_stages(recipe, manifest, stages, split)
            except BaseException:
                for part in parts:
                    part.kill()
                raise
            self.executor = StagedExecutor(self._stages)
        else:
            self.executor = RemoteExecutor(self._verifier, self._store)
        self.tokenizer = self._tokenizer(manifest)
        self.draft_threads = None  # (the draft computes in its own actor, with the driver's count: draft.py)
        self.draft_spec = draft
        self._use_draft(RemoteDraft(self._draft_actor, self._store) if self._draft_actor is not None else None)

    @staticmethod
    def attach(name: str = "streamspec", address: str | None = None):
        """Attach to the named ControllerActor running on this Ray cluster (`streamspec serve --ray`): an engine
        whose generate() requests join that controller's loop, sharing its sweeps with every other process's."""
        from .attached import AttachedEngine

        return AttachedEngine(name, address)

    def _new_store(self, handle) -> None:
        if self._verifier is not None:  # (stages read their own node's files, not the store actor)
            with_store(self._store, lambda: self._verifier.call("set_store", self._store_name))

    def _tokenizer(self, manifest):
        if not manifest.tokenizer:
            return None
        from ..store import tokenizer

        local = os.path.join(self.root, manifest.tokenizer)
        if os.path.isdir(local):
            return tokenizer.load(local)
        with tempfile.TemporaryDirectory(prefix="streamspec-tok-") as tmp:  # the store is on another node
            for name, data in self._store.call("tokenizer_files").items():
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
            return tokenizer.load(tmp)

    def generate(self, *args, **kw):
        """Engine.generate on the actors. On a failure the exception carries `token_ids` (and `text`): the tokens
        emitted before it."""
        user_hook = kw.pop("on_tokens", None)
        emitted: list[int] = []

        def hook(tokens):
            emitted.extend(tokens)
            if user_hook is not None:
                user_hook(tokens)

        revivals = self.revivals()
        before = self.executor.figures() if self._stages else None
        try:
            out = super().generate(*args, on_tokens=hook, **kw)
        except StreamspecError as e:
            e.token_ids, e.text = list(emitted), self.decode(emitted)
            raise
        now = self.revivals()
        out.stats["ray"] = {"remote_s": self.executor.remote_s, "placement": self.placement(),
                            "transport": self.transport(), "revivals": {k: now[k] - revivals[k] for k in now}}
        if self._stages:  # (this generation's: the counters less those before it)
            now_f = self.executor.figures()
            out.stats["ray"]["stages"] = {**now_f, **{k: now_f[k] - before[k] for k in ("sweeps", "hops",
                                                                                        "hidden_bytes")}}
        return out

    def revivals(self) -> dict:
        return {s.role: s.revivals for s in self._parts()}

    def _parts(self) -> list[Supervised]:
        return [s for s in (self._store, self._verifier, *self._stages, self._draft_actor) if s is not None]

    def placement(self) -> dict:
        """Node id of each actor (and of the driver), asked now (an actor may have moved on a restart)."""
        parts = self._parts()
        ids = [self._store.call("ready")]
        ids += [self._verifier.call("ready")] if self._verifier is not None else []
        ids += [s.call("ready")["node_id"] for s in self._stages]
        if self._draft_actor is not None:
            ids.append(self._draft_actor.call("ready")["node_id"])
        return {"driver": node_id(), **{s.role.replace(" ", "_"): i for s, i in zip(parts, ids)}}

    def transport(self) -> str:
        """How shards reach the verifier now: "shared ring" (store actor on its node) or "object store"; stages
        read their own node's store ("local store")."""
        return self._verifier.call("transport") if self._verifier is not None else "local store"

    def store_stats(self) -> dict:
        """Bytes and reads served by the current LayerStoreActor (since it started)."""
        return self._store.call("stats")

    def actor(self, role: str):
        """The current handle of `role` ("layer store", "verifier", "draft"): for tests and fault drills."""
        return {s.role: s for s in self._parts()}[role].handle

    def _batch_pipelines(self, mode: str, replicas: int):
        """Engine._batch_pipelines on the actors: this engine's verifier plus replicas - 1 more (sharing the
        store actor, killed when the batch ends); the batch's draft runs on the driver (see actors/pipelines.py)."""
        return pipelines(self, mode, replicas)

    def _batch_sizes(self, batch_size: int, pipelines: int) -> int | list[int]:
        """Staged: the batch split between the pipelined groups (pipelines.py), so batch_size sequences are in
        flight in all; else batch_size per verifier replica."""
        if not self._stages:
            return batch_size
        return [batch_size // pipelines + (i < batch_size % pipelines) for i in range(pipelines)]

    def close(self) -> None:
        if self._verifier is not None:
            drain(self._verifier)
        drain_stages(self._stages)
        for s in reversed(self._parts()):  # the store last: no read the verifier still awaits is left to retry
            s.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
