"""Pipeline stages: the target's decoder layers split into contiguous ranges, one StageActor per range.

    driver      round (speculative/round.py) -> StagedExecutor.sweep: one submission per stage, one wait
    stage 0     embeds the tokens, runs layers [0, a)      -> hidden [T, hidden]  (by object reference)
    stage i     runs layers [a, b) on the hidden states    -> hidden              (stage to stage, not the driver)
    stage N-1   runs its layers and the head               -> logits to the driver

A stage is the VerifierActor's class (actors/verifier.py) over a StreamingExecutor of its own layers
(`layers=`), reading the store from its own node's disk: it holds its units in memory when they fit its budget
(StreamingExecutor.hold) and otherwise streams them with the prefetcher. Its KV cache holds its layers only;
roll-back and compaction ride with each sweep to every stage. The driver submits the N calls at once, each
taking the previous one's result by reference, so Ray moves the hidden states between the stages' nodes and a
round pays one hop per stage. Each stage appends its figures (compute, reads, what it received) to what it
passes on, and the driver gets them with the logits.

Several pipelines (batch groups) share the stages: a stage runs one call at a time, in the order they were
submitted, so while stage 1 works on group A's round, stage 0 already runs group B's (pipelined rounds).

Faults: a stage that died is revived (Ray restart, else a new actor) and every stage rebuilds the sequence's
cache from its sweep history, the hidden states again passing stage to stage; then the sweep runs again. A
stage that cannot be revived (its node is gone) raises ActorFailure, and RayEngine keeps the text so far.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import ray
import torch
from ray.exceptions import ActorUnschedulableError, RayActorError, RayTaskError

from ..errors import ConfigError, StreamspecError
from ..runtime.embedding import RESIDENT_MAX
from ..runtime.executor import StreamingExecutor, SweepStats
from ..runtime.split import by_weight, check, parse_split
from ..store.store import LayerStore
from .common import SHARE, TIMEOUT_S, ActorFailure, cause, get, node_id, normal_priority
from .remote import RemoteCache
from .supervise import Supervised
from .verifier import Verifier

STAGE_RESOURCE = "streamspec_stage"  # a node that runs a stage; its `memory` resource sizes the stage's share


@dataclass
class StageFigures:
    """One stage's part of one sweep, as the stage measured it."""
    stage: int
    node: str
    sweep: SweepStats      # its own sweep: compute, reads (bytes, io, stall), wall
    received_bytes: int    # the hidden states it took from the stage before (0 for the first)
    sent_bytes: int        # what it passed on: hidden states, or the last stage's logits


class StageServer(Verifier):
    """The plain class behind a StageActor: layers `layers` (start, stop) of the store at `root` (a path on this
    node). memory_budget: bytes of this stage's streamed weights at once; hold None: keep the units in memory
    when they fit the budget (no budget: always), True/False to force. memory_limit: this process joins a memory
    cgroup of that many bytes (runtime/memlimit.py) before reading anything, as a node of that size would be."""

    def __init__(self, root: str, index: int, layers: tuple[int, int], dtype=torch.float32, device: str = "cpu",
                 depth: int = 2, memory_budget: float | None = None, threads: int | None = None,
                 timeout_s: float = TIMEOUT_S, wide_threads: int | None = None, cold: bool = False,
                 direct: bool | None = None, hold: bool | None = None, memory_limit: int | None = None):
        normal_priority()
        self.cgroup = None
        if memory_limit:
            from ..runtime.memlimit import MemoryCgroup

            self.cgroup = MemoryCgroup()
            self.cgroup.set_limit(int(memory_limit))
            self.cgroup.add(os.getpid())
        super().__init__(None, dtype, device, depth, memory_budget, threads, timeout_s, False, wide_threads)
        self.root, self.index, self.span = root, index, range(*layers)
        self.cold, self.direct, self.hold_units = cold, direct, hold
        self.held_bytes = 0

    def _setup(self) -> StreamingExecutor:
        if self.executor is not None:
            return self.executor
        if not os.path.isdir(self.root):
            raise ConfigError(f"stage {self.index}: the store {self.root} is not on this node ({node_id()}): "
                              "copy it to the same path on every stage's node")
        ex = StreamingExecutor(LayerStore(self.root), self.device_name, self.dtype, self.memory_budget,
                               cold=self.cold, prefetch_depth=self.depth, direct=self.direct, layers=self.span)
        ex.wide_threads = self.wide_threads
        probe = ex.stream(ex.sweep_names)  # (what each unit takes in memory, in the compute dtype)
        need = sum(probe.need(n) for n in ex.sweep_names)
        hold = self.hold_units
        if hold is None:
            hold = not ex.family.moe and (self.memory_budget is None or need <= self.memory_budget)
        if hold:
            self.held_bytes = ex.hold()
        self.executor = ex
        return ex

    def ready(self) -> dict:
        ex = self._setup()
        return {"stage": self.index, "node_id": node_id(), "pid": os.getpid(), "layers": (ex.layers.start,
                ex.layers.stop), "held_bytes": self.held_bytes, "unit_bytes": sum(ex.store.manifest.unit(n).bytes
                                                                                 for n in ex.sweep_names)}

    def transport(self) -> str:
        return "local store"

    def memory_peak(self) -> int | None:
        """This stage's cgroup peak (page cache included), if it runs under a memory limit."""
        return None if self.cgroup is None else self.cgroup.peak()

    def _figures(self, prev, out, st: SweepStats) -> list[StageFigures]:
        sent = out if isinstance(out, torch.Tensor) else None
        return prev[1] + [StageFigures(self.index, node_id(), st, _nbytes(prev[0]),
                                       _nbytes(sent) if sent is not None else sum(map(_nbytes, out)))]

    def stage_sweep(self, prev, cache_id, seq: int, start, tokens, logits_from: int = 0, positions=None, mask=None):
        """Verifier.sweep on the stage before's output prev = (hidden or None, [StageFigures]) -> (this stage's
        output: hidden [T, hidden], or the last stage's logits; the figures with this stage's appended). None
        (the stage before, or this one, lost the cache: a restart) is passed on as None."""
        if prev is None:
            return None
        out = self.sweep(cache_id, seq, start, tokens, logits_from, positions, mask, hidden=prev[0])
        return None if out is None else (out[0], self._figures(prev, *out))

    def stage_batch(self, prev, group, items):
        """Verifier.sweep_batch on the stage before's output, as stage_sweep."""
        if prev is None:
            return None
        out = self.sweep_batch(items, hidden=prev[0], group=group)
        return None if out is None else (out[0], self._figures(prev, *out))

    def stage_replay(self, prev, cache_id, history):
        """Rebuild one cache from its history on the stage before's outputs for it -> (this stage's outputs for
        each sweep, []) for the next stage's replay."""
        if prev is None:
            return None
        cache, outs = self._rebuild(history, prev[0])
        self.cache_id, self.cache, self.seq = cache_id, cache, len(history)
        return outs, []

    def stage_replay_batch(self, prev, group, histories):
        if prev is None:
            return None
        return self._replay_caches(histories, group, prev[0]), []


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


FIRST = (None, [])
_REVIVING = threading.Lock()
LOST = (RayActorError, ActorUnschedulableError)  # a stage died, or cannot be placed again  # what the first stage is given: no hidden states, no figures yet


class StagedExecutor:
    """StreamingExecutor's interface (new_cache, sweep, sweep_batch) over a chain of StageActors. `group`: the
    batch caches' group on the stages (one per pipeline sharing them)."""

    def __init__(self, stages: list[Supervised], group: int = 0):
        self.stages, self.group = stages, group
        self.sweeps = 0
        self.bytes_read = 0
        self.remote_s = 0.0  # round trips minus the stages' own sweep times
        self.hops = 0  # stage-to-stage messages (N - 1 per sweep)
        self.hidden_bytes = 0  # what crossed between stages, as the receiving stages counted it
        self.last: list[StageFigures] = []  # the last sweep's figures, one per stage
        self.direct = None  # (each stage decides its own reads)

    def new_cache(self) -> RemoteCache:
        return RemoteCache()

    def _through(self, method: str, *args):
        """Submit `method` on every stage at once, each taking the previous one's result by reference; wait for
        the last one only."""
        ref = FIRST
        for s in self.stages:
            ref = getattr(s.handle, method).remote(ref, *args)
        return get(ref, self.stages[-1].timeout_s, f"stages.{method}")

    def _run(self, attempt, repair):
        """attempt() until it answers: None (a stage restarted and lost the cache) -> repair() (replay on every
        stage), then again; a stage that died is revived first."""
        while True:
            try:
                out = attempt()
                if out is None:
                    repair()
                    out = attempt()
                if out is None:
                    raise StreamspecError("a stage lost its cache again right after a replay")
                return out
            except (RayActorError, ActorUnschedulableError, RayTaskError) as e:
                if isinstance(e, RayTaskError) and not isinstance(cause(e), LOST):
                    raise
                self._revive_dead(e)
                repair()

    def _revive_dead(self, err: BaseException) -> None:
        """Revive the stages that died. One at a time across the pipelines sharing them: the group that comes
        second finds them answering and revives nothing (one death, one revival)."""
        with _REVIVING:
            for s in self.stages:
                try:
                    try:
                        get(s.handle.ready.remote(), s.timeout_s, f"{s.role}.ready")
                    except RayActorError:
                        s.revive(err)
                except ActorUnschedulableError:  # (pinned to its node, which is gone: Ray's restart or ours)
                    node = (s.info or {}).get("node_id", "?")
                    raise ActorFailure(f"the {s.role} actor's node {node} is gone: its layers were placed there; "
                                       "start the node again, or run with fewer --stages") from None

    def _account(self, out, wall: float):
        result, figures = out
        self.last = figures
        self.sweeps += 1
        self.hops += len(figures) - 1
        self.hidden_bytes += sum(f.received_bytes for f in figures)
        sts = [f.sweep for f in figures]
        st = SweepStats(sts[0].tokens, sum(s.bytes_read for s in sts), sum(s.io_s for s in sts),
                        sum(s.prep_s for s in sts), sum(s.compute_s for s in sts), sum(s.stall_s for s in sts), wall,
                        read_ahead=all(s.read_ahead for s in sts), ahead=min(s.ahead for s in sts))
        self.bytes_read += st.bytes_read
        self.remote_s += wall - sum(s.wall_s for s in sts)
        return result, st

    def sweep(self, tokens, cache: RemoteCache, positions=None, mask=None, logits_from: int = 0):
        """As RemoteExecutor.sweep, through every stage -> (logits, SweepStats summed over the stages; wall_s
        the driver's round trip)."""
        t0 = time.perf_counter()
        entry = cache.entry(tokens, positions, mask)
        start, ids, pos, m = entry
        out = self._run(lambda: self._through("stage_sweep", cache.id, len(cache.history), start, ids,
                                              logits_from, pos, m),
                        lambda: self._through("stage_replay", cache.id, cache.history))
        cache.commit(entry)
        return self._account(out, time.perf_counter() - t0)

    def sweep_batch(self, chunks):
        """As RemoteExecutor.sweep_batch, through every stage, in this executor's group."""
        t0 = time.perf_counter()
        entries = [c.cache.entry(c.ids.tolist(), c.positions, c.mask) for c in chunks]
        items = [(c.cache.id, len(c.cache.history), c.logits_from, *e) for c, e in zip(chunks, entries)]
        out = self._run(lambda: self._through("stage_batch", self.group, items),
                        lambda: self._through("stage_replay_batch", self.group,
                                              [(c.cache.id, c.cache.history) for c in chunks]))
        for c, e in zip(chunks, entries):
            c.cache.commit(e)
        return self._account(out, time.perf_counter() - t0)

    def figures(self) -> dict:
        """Counters for --json and the bench: sweeps, stage-to-stage hops and bytes, the last sweep per stage."""
        return {"stages": len(self.stages), "sweeps": self.sweeps, "hops": self.hops,
                "hidden_bytes": self.hidden_bytes,
                "last_sweep": [{"stage": f.stage, "node": f.node, "compute_s": f.sweep.compute_s,
                                "io_s": f.sweep.io_s, "stall_s": f.sweep.stall_s, "bytes_read": f.sweep.bytes_read,
                                "wall_s": f.sweep.wall_s, "received_bytes": f.received_bytes,
                                "sent_bytes": f.sent_bytes} for f in self.last]}


def stage_nodes() -> list[tuple[str, float]]:
    """(node id, memory bytes) of the alive nodes carrying STAGE_RESOURCE, in a stable order."""
    return sorted((n["NodeID"], float(n["Resources"].get("memory", 0.0))) for n in ray.nodes()
                  if n.get("Alive") and STAGE_RESOURCE in n.get("Resources", {}))


def stage_placement(i: int, nodes: list[tuple[str, float]]) -> dict:
    """Stage i on the i-th stage node (pinned: its share was sized for that node), or where Ray puts it when
    there are fewer stage nodes than stages (one machine: the stages are processes side by side)."""
    if len(nodes) <= i:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=nodes[i][0], soft=False),
            "resources": {STAGE_RESOURCE: SHARE}}


@dataclass
class StageRecipe:
    """What every stage actor is built with (RayEngine's settings)."""
    root: str
    dtype: torch.dtype
    device: str
    depth: int
    memory_budget: float | None
    threads: int | None
    timeout_s: float
    wide_threads: int | None
    cold: bool
    direct: bool | None
    memory_limit: int | None
    max_restarts: int


def layer_bytes(manifest, dtype: torch.dtype) -> list[int]:
    """What each decoder layer costs a stage: its unit and its routed experts; the embedding is charged to the
    first layer when it is held (a big one is read by rows: runtime/embedding.py), the head to the last, and so
    is the table again where a tied head multiplies by it (the last stage then holds it too)."""
    n = manifest.args.num_hidden_layers
    out = [u.bytes for u in manifest.layer_units]
    for u in manifest.units:
        if u.name.startswith("expert.") and int(u.name.split(".")[1]) < n:
            out[int(u.name.split(".")[1])] += u.bytes
    table = manifest.args.vocab_size * manifest.args.hidden_size * dtype.itemsize
    held = table if table <= RESIDENT_MAX else 0
    head = manifest.unit("head")
    tied = manifest.args.tie_word_embeddings and not any(k.startswith("lm_head.") for k in head.tensors)
    out[0] += held
    # (a tied head whose table is read by rows elsewhere holds, or streams, the whole table as its head unit)
    out[-1] += head.bytes + ((held or manifest.unit("embed").bytes) if tied else 0)
    return out


def plan_ranges(manifest, stages: int | None, split, nodes: list[tuple[str, float]],
                dtype: torch.dtype = torch.float32) -> list[range]:
    """The stages' layer ranges: `split` as given ("0:12,12:24", or [(start, stop)...]), else `stages` ranges
    sized by the stage nodes' memory (equal shares of the bytes where there are fewer stage nodes than stages,
    or a node does not say its memory)."""
    n = manifest.args.num_hidden_layers
    if split is not None:
        ranges = parse_split(split, n) if isinstance(split, str) else [range(a, b) for a, b in split]
        check(ranges, n)
        if stages is not None and stages != len(ranges):
            raise ConfigError(f"--stages {stages} but --split gives {len(ranges)} ranges")
        return ranges
    use = nodes[:stages] if len(nodes) >= stages else []
    weights = [m for _, m in use] if use and all(m > 0 for _, m in use) else [1.0] * stages
    return by_weight(layer_bytes(manifest, dtype), weights)


def spawn_stages(r: StageRecipe, manifest, stages: int | None, split) -> list[Supervised]:
    """One StageActor per range (plan_ranges), each placed on its own stage node where there are enough, all
    started at once; a stage on a stage node holds its layers if they fit that node's Ray memory (unless a
    budget is given), else streams them within it. -> their Supervised handles, in order."""
    nodes = stage_nodes()
    ranges = plan_ranges(manifest, stages, split, nodes, r.dtype)
    parts = []
    for i, rg in enumerate(ranges):
        # what the stage may hold: the budget given, else its node's Ray memory (a stage node's share)
        budget = r.memory_budget if r.memory_budget is not None or len(nodes) <= i else (nodes[i][1] or None)

        def spawn(i=i, rg=rg, budget=budget):
            cls = ray.remote(num_cpus=0, max_restarts=r.max_restarts, max_task_retries=0,
                             **stage_placement(i, nodes))(StageServer)
            return cls.remote(r.root, i, (rg.start, rg.stop), r.dtype, r.device, r.depth, budget, r.threads,
                              r.timeout_s, r.wide_threads, r.cold, r.direct, None, r.memory_limit)

        parts.append(Supervised(f"stage {i}", spawn, r.max_restarts, r.timeout_s, wait=False))
    try:
        Supervised.start_all(parts, r.timeout_s)
    except BaseException:
        for p in parts:
            p.kill()
        raise
    return parts


def drain_stages(stages: list[Supervised], timeout_s: float = 15.0) -> None:
    """Let every stage's reads in flight finish before the stages are killed (best effort)."""
    try:
        ray.get([s.handle.drain.remote() for s in stages], timeout=timeout_s)
    except Exception:
        pass


