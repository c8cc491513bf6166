"""Pipeline stages (actors/stages.py) on a fake three-node cluster (ray.cluster_utils.Cluster), token for token
against the in-process Engine: Llama, Gemma 3 and DeepSeek tiny configs and the embedded SmolLM2, on 2 and 3
stages; greedy and seeded sampling; chain, tree and pipelined batches. Then placement, the split, and faults:
a stage killed mid-generation (revived, every stage replays), and a node that is gone (one clear error, the
tokens so far kept).

What "the same tokens" means for sampling is test_families' rule: tree and naive draw as naive does, so their
sampled tokens are naive's; a chain's draws depend on K, so sampled chain equals in-process chain at that K."""
from __future__ import annotations

import logging
import os

import pytest
import torch

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_worker_niceness", "0")
ray = pytest.importorskip("ray")

from test_families import FAMILIES, deepseek_store  # noqa: E402,F401  (the tiny DeepSeek V3 store fixture)
from test_ray import ray_tmp  # noqa: E402,F401

from streamspec_ray import Engine, RayEngine  # noqa: E402
from streamspec_ray.actors.common import ActorFailure  # noqa: E402
from streamspec_ray.errors import ConfigError  # noqa: E402

N = 10
K, BUDGET = 3, 8
SAMPLING = dict(temperature=0.9, top_p=0.95)
IDS = [[5, 9, 13, 5, 9, 13, 5, 9], list(range(40, 61))]
MEMORY = (2e9, 1e9, 1e9)  # the three nodes' `memory` resources: the split follows them


@pytest.fixture(scope="module")
def cluster(ray_tmp):  # noqa: F811
    """Three nodes carrying the stage resource, of 2, 1 and 1 GB: stages land one per node."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=1, resources={"streamspec_stage": 1},
                                                          memory=int(MEMORY[0]), include_dashboard=False))
    for m in MEMORY[1:]:
        c.add_node(num_cpus=1, resources={"streamspec_stage": 1}, memory=int(m))
    ray.init(address=c.address, log_to_driver=False, logging_level=logging.WARNING)
    c.wait_for_nodes()
    threads = torch.get_num_threads()
    yield c
    torch.set_num_threads(threads)
    ray.shutdown()
    c.shutdown()


def _store(request, name: str) -> str:
    if name == "smollm2":
        return request.getfixturevalue("smol_store")
    return FAMILIES[name](request.getfixturevalue)


class Reference:
    """A family's in-process engine (one thread: the staged engines compute on one too, for the same bits), its
    prompts and its results per path, computed once for both stage counts."""

    def __init__(self, store: str):
        self.store = store
        self.eng = Engine(target=store, draft="self-int4", threads=1)
        self.prompts = IDS if self.eng.tokenizer is None else [self.eng.encode("def fibonacci(n):", None, False)]
        self._out: dict = {}

    def run(self, eng, mode: str, sampled: bool, batch: bool = False) -> list[list[int]]:
        policy = {"naive": {}, "chain": {"k": K}, "tree": {"budget": BUDGET}}[mode]
        reqs = [dict(prompt_ids=p, max_new_tokens=N, **(dict(SAMPLING, seed=7 + i) if sampled else {}))
                for i, p in enumerate(self.prompts)]
        if batch:
            return [r.token_ids for r in eng.generate_batch(reqs, batch_size=len(reqs), mode=mode, **policy)]
        return [eng.generate(mode=mode, **policy, **r).token_ids for r in reqs]

    def want(self, mode: str, sampled: bool) -> list[list[int]]:
        if (mode, sampled) not in self._out:
            self._out[mode, sampled] = self.run(self.eng, mode, sampled)
        return self._out[mode, sampled]


@pytest.fixture(scope="module")
def references(cluster):
    refs: dict = {}
    yield refs
    for r in refs.values():
        r.eng.executor.close()


# (the embedded model on 2 stages: tests/test_stages_cli.py's `generate --ray --stages 2` against in-process)
@pytest.mark.parametrize("family,stages", [(f, n) for f in ("llama", "gemma3", "deepseek") for n in (2, 3)]
                         + [("smollm2", 3)])
def test_stages_give_the_in_process_tokens(request, references, family, stages):
    """Every path on the stages gives what it gives in process: greedy naive's tokens everywhere; sampled naive
    and tree naive's; sampled chain in-process chain's; batches (pipelined over the stages) likewise. (The
    embedded model, 30 layers of a real vocabulary, runs the paths that differ most: greedy chain, sampled tree,
    a pipelined batch.)"""
    if family not in references:
        references[family] = Reference(_store(request, family))
    ref = references[family]
    eng = RayEngine(target=ref.store, draft=ref.eng.draft, threads=1, stages=stages)
    try:
        naive, sampled = ref.want("naive", False), ref.want("naive", True)
        assert sampled != naive  # (else the sampled checks prove nothing)
        assert ref.run(eng, "chain", False) == naive
        assert ref.run(eng, "tree", True) == sampled
        assert ref.run(eng, "chain", False, batch=True) == naive
        if family != "smollm2":
            assert ref.run(eng, "naive", False) == naive
            assert ref.run(eng, "tree", False) == naive
            assert ref.run(eng, "chain", True) == ref.want("chain", True)
            assert ref.run(eng, "tree", True, batch=True) == sampled
        out = eng.generate(prompt_ids=ref.prompts[0], max_new_tokens=N, k=K)
        st = out.stats["ray"]["stages"]
        # one hop per stage boundary per sweep, and what crossed is the sweeps' hidden states
        assert st["stages"] == stages and st["hops"] == (stages - 1) * out.stats["sweeps"]
        assert st["hidden_bytes"] > 0 and out.stats["ray"]["revivals"] == {
            **{f"stage {i}": 0 for i in range(stages)}, "layer store": 0, "draft": 0}
    finally:
        eng.close()


def test_each_stage_on_its_own_node_sized_by_memory(tiny_gemma, cluster):
    """Three stages on the three stage nodes, one each; the 2 GB node gets the most layers of Gemma's six."""
    store = tiny_gemma[1]
    eng = RayEngine(target=store, draft=None, threads=1, stages=3)
    try:
        infos = [s.call("ready") for s in eng._stages]
        nodes = {n["NodeID"]: n["Resources"]["memory"] for n in ray.nodes() if n["Alive"]}
        assert len({i["node_id"] for i in infos}) == 3
        big = max(infos, key=lambda i: nodes[i["node_id"]])
        assert all(big["layers"][1] - big["layers"][0] >= i["layers"][1] - i["layers"][0] for i in infos)
        assert [i["layers"][0] for i in infos] == [0, infos[0]["layers"][1], infos[1]["layers"][1]]
        assert all(i["held_bytes"] > 0 for i in infos)  # (they fit their nodes' memory: each holds its layers)
        _server_loop_gives_generate_tokens(eng, store)
    finally:
        eng.close()


def _server_loop_gives_generate_tokens(eng, store: str) -> None:
    """The server's loop (scheduler.Scheduler) on the staged engine: 5 requests at once, batch size 4, its
    pipelines groups over the stages; each request gets in-process naive generate's tokens."""
    from streamspec_ray.scheduler import Job, Scheduler
    from streamspec_ray.speculative import batch

    ref = Engine(target=store, draft=None, threads=1)
    sched = Scheduler(eng, mode="naive", batch_size=4)
    try:
        defaults = dict(max_new_tokens=N, temperature=0.0, top_p=1.0, top_k=0, seed=0)
        jobs = [Job(batch.to_request(ref, {"prompt_ids": IDS[i % 2][i:]}, defaults)) for i in range(5)]
        for j in jobs:
            sched.submit(j)
        for i, j in enumerate(jobs):
            got, event = [], ("tokens", [])
            while event[0] == "tokens":
                got += event[1]
                event = j.events.get(timeout=120)
            assert event == ("done", "length") and got == ref.generate(prompt_ids=IDS[i % 2][i:], max_new_tokens=N,
                                                                       mode="naive").token_ids
    finally:
        sched.close()
        ref.executor.close()


def test_split_by_hand_a_streamed_stage_and_errors(tiny_gemma, cluster):
    """--split's ranges, with a budget that the first stage's one layer fits (it holds it) and the second's five
    and the head do not (it streams them, reading every sweep): naive's tokens. Bad splits: one clear error."""
    store = tiny_gemma[1]
    ref = Engine(target=store, draft=None, threads=1)
    unit = max(u.bytes for u in ref.store.manifest.units if u.name != "embed")  # (the embedding stays resident)
    eng = RayEngine(target=store, draft=None, threads=1, split="0:1,1:6", memory_budget=1.2 * unit)
    try:
        infos = [s.call("ready") for s in eng._stages]
        assert [i["layers"] for i in infos] == [(0, 1), (1, 6)]
        assert infos[0]["held_bytes"] > 0 and infos[1]["held_bytes"] == 0
        want = ref.generate(prompt_ids=IDS[1], max_new_tokens=N, mode="naive")
        out = eng.generate(prompt_ids=IDS[1], max_new_tokens=N, mode="naive")
        assert out.token_ids == want.token_ids
        assert out.stats["bytes_read"] == out.stats["sweeps"] * infos[1]["unit_bytes"]
    finally:
        eng.close()
    for split, msg in [("0:2,3:6", "follow each other"), ("0-2", "START:END"), ("0:2,2:5", "end at layer 5")]:
        with pytest.raises(ConfigError, match=msg):
            RayEngine(target=store, draft=None, threads=1, split=split)
    with pytest.raises(ConfigError, match="at most one stage per layer"):
        RayEngine(target=store, draft=None, threads=1, stages=7)


def test_a_stage_killed_is_rebuilt_and_a_node_gone_is_one_clear_error(tiny, cluster):
    """A stage of 3 dies after the first round (Ray restarts it): every stage rebuilds the cache from the sweep
    history, and the tokens are still the in-process ones; a batch too. Then the node under a stage leaves the
    cluster mid-generation: the stage cannot come back there, and generate raises ActorFailure naming it,
    carrying the tokens emitted before. (Last in the module: it removes a node.)"""
    ref = Engine(target=tiny["store"], draft="self-int4", threads=1)
    eng = RayEngine(target=tiny["store"], draft=ref.draft, threads=1, stages=3, max_restarts=3, timeout_s=60)
    try:
        want = ref.generate(prompt_ids=IDS[1], max_new_tokens=24, k=K).token_ids
        pid = ray.get(eng.actor("stage 1").pid.remote(), timeout=60)
        killed = []

        def kill(_tokens):
            if not killed:
                killed.append(1)
                ray.kill(eng.actor("stage 1"), no_restart=False)

        out = eng.generate(prompt_ids=IDS[1], max_new_tokens=24, k=K, on_tokens=kill)
        assert out.token_ids == want and out.stats["ray"]["revivals"]["stage 1"] == 1
        assert ray.get(eng.actor("stage 1").pid.remote(), timeout=60) != pid

        reqs = [{"prompt_ids": IDS[i % 2][: 3 + i], "max_new_tokens": 8 + 2 * i} for i in range(4)]
        want = [ref.generate(k=K, **r).token_ids for r in reqs]
        killed.clear()
        out = eng.generate_batch(reqs, batch_size=4, k=K, on_tokens=lambda i, t: kill(t))
        assert [r.finish_reason for r in out] == ["length"] * 4, [r.stats.get("error") for r in out]
        assert [r.token_ids for r in out] == want

        workers = {n.node_id: n for n in cluster.worker_nodes}  # (the head node cannot be removed)
        stage, victim = next((i, workers[s.call("ready")["node_id"]]) for i, s in enumerate(eng._stages)
                             if s.call("ready")["node_id"] in workers)
        emitted = []

        def leave(tokens):
            emitted.extend(tokens)
            if len(emitted) == len(tokens):
                cluster.remove_node(victim)

        with pytest.raises(ActorFailure, match=f"stage {stage} actor's node .* is gone") as e:
            eng.generate(prompt_ids=IDS[1], max_new_tokens=40, k=K, on_tokens=leave)
        assert e.value.token_ids == emitted and emitted
        assert e.value.text == ref.decode(emitted)
    finally:
        eng.close()
