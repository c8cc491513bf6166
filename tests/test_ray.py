"""RayEngine against the in-process Engine, token for token: tiny and real model, greedy and sampled, actor
deaths mid-generation, a two-node cluster. Two Ray startups in all: one local session for the module, then
(last) a two-node ray.cluster_utils.Cluster."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import shutil
import tempfile
import time

import pytest

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_worker_niceness", "0")  # actors at normal priority, as in the engine
ray = pytest.importorskip("ray")

from streamspec_ray import Engine, StreamspecError  # noqa: E402
from streamspec_ray.errors import ConfigError, StoreError  # noqa: E402

PROMPT = [1, 5, 9, 33, 7, 12]
N = 40


@pytest.fixture(scope="module")
def ray_tmp():
    # short and outside the home folder: Ray's unix sockets live under it (path length limit ~107 bytes)
    tmp = tempfile.mkdtemp(prefix="ssr-", dir="/tmp")
    old = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = tmp
    yield tmp
    if old is None:
        os.environ.pop("RAY_TMPDIR", None)
    else:
        os.environ["RAY_TMPDIR"] = old
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def local_ray(ray_tmp):
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING,
                 _temp_dir=ray_tmp)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def tiny_pair(tiny, local_ray):
    from streamspec_ray import RayEngine

    from streamspec_ray.runtime import threads

    # one thread plan for both: plan_threads samples the machine's load at each call, and on an idle machine gives
    # the in-process engine two threads for a short sweep whose reads it maps (executor.wide_threads), where the
    # verifier, whose reads arrive from the store actor, keeps one: logits then differ in the last bits
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(threads, "plan_threads", lambda: (1, 1, "fixed for the test"))
        ref = Engine(target=tiny["store"], draft="self-int4")
        eng = RayEngine(target=tiny["store"], draft="self-int4")
    yield ref, eng
    eng.close()


def _same(ref, eng, **kw):
    a = ref.generate(prompt_ids=PROMPT, max_new_tokens=N, **kw)
    b = eng.generate(prompt_ids=PROMPT, max_new_tokens=N, **kw)
    assert b.token_ids == a.token_ids, kw
    return a, b


@pytest.mark.parametrize("kw", [dict(k=4), dict(k=3, temperature=0.9, seed=5), dict(k=5, temperature=0.7, top_p=0.9,
                                seed=1), dict(mode="naive"), dict(mode="tree", budget=8),
                                dict(mode="tree", budget=12, temperature=0.9, seed=5)],
                         ids=["greedy", "sampled", "top-p", "naive", "tree", "tree-sampled"])
def test_tiny_identical(tiny_pair, kw):
    ref, eng = tiny_pair
    a, b = _same(ref, eng, **kw)
    assert b.stats["sweeps"] == a.stats["sweeps"] and b.stats["bytes_read"] == a.stats["bytes_read"]
    assert b.stats["ray"]["revivals"] == {"layer store": 0, "verifier": 0, "draft": 0}


def test_logits_and_placement(tiny_pair):
    import torch

    ref, eng = tiny_pair
    assert torch.equal(eng.logits(PROMPT), ref.logits(PROMPT))  # bit for bit: same code, same threads
    where = eng.placement()
    assert set(where) == {"driver", "layer_store", "verifier", "draft"}
    assert len(set(where.values())) == 1  # one node, no custom resources: default placement
    assert eng.transport() == "shared ring"  # store and verifier on one node: no object-store copy
    assert eng.store_stats()["bytes_read"] > 0


def test_store_actor_reads_direct_when_its_page_cache_cannot_keep_a_sweep(tiny, tiny_pair, monkeypatch):
    """RayEngine's default (direct None): the store server decides at its first read, as the in-process executor
    does: O_DIRECT when a sweep's bytes exceed the page cache's room on its node (memplan.page_cache_room), the
    page cache otherwise; an explicit choice stands. The same bytes either way; `--json` says which it used."""
    from streamspec_ray.actors.store import StoreServer
    from streamspec_ray.runtime import memplan
    from streamspec_ray.store.store import LayerStore

    name = LayerStore(tiny["store"]).manifest.layer_units[0].name
    ref = None
    for room, explicit, want in ((1, None, True), (10 ** 15, None, False), (1, False, False)):
        monkeypatch.setattr(memplan, "page_cache_room", lambda r=room: r)
        server = StoreServer(tiny["store"], direct=explicit)
        buf, _ = server.read(name)
        assert server.reads_direct() is want, (room, explicit)
        ref = buf.copy() if ref is None else ref
        assert (buf == ref).all()
    ref, eng = tiny_pair  # (the tiny store fits this machine's page cache)
    assert eng.generate(prompt_ids=PROMPT, max_new_tokens=2, mode="naive").stats["direct_reads"] is False
    from streamspec_ray import RayEngine

    direct = RayEngine(target=tiny["store"], draft=None, direct=True)  # (O_DIRECT straight into the shared ring)
    try:
        out = direct.generate(prompt_ids=PROMPT, max_new_tokens=8, mode="naive")
        assert out.stats["direct_reads"] is True
        assert out.token_ids == ref.generate(prompt_ids=PROMPT, max_new_tokens=8, mode="naive").token_ids
    finally:
        direct.close()


def test_ring_falls_back_to_object_store(tiny_pair, tiny, caplog):
    """A store actor that cannot map the verifier's ring (here its key points at a ring that is gone): the
    verifier warns once and takes shards through the object store from then on, with the same logits."""
    import torch

    from streamspec_ray.actors.verifier import Verifier

    ref, eng = tiny_pair
    # a plain one in this process (on the store actor's node), on the engines' threads
    v = Verifier(eng._store_name, depth=2, threads=ref.threads, wide_threads=ref.executor.wide_threads)
    assert v.transport() == "shared ring"
    ring = v.executor.store.ring
    ring.key = ring.key[:-1] + (ring.key[-1] + 1,)  # another inode
    with caplog.at_level(logging.WARNING, logger="streamspec"):
        logits, _ = v.sweep("c", 0, 0, PROMPT)
    assert v.transport() == "object store" and "object store" in caplog.text
    assert torch.equal(logits, ref.logits(PROMPT))
    logits, _ = v.sweep("c", 0, 0, PROMPT)  # (rolled back to 0: the same sweep again)
    assert torch.equal(logits, ref.logits(PROMPT))


def test_ngram_and_memory_budget(tiny, local_ray):
    from streamspec_ray import RayEngine
    from streamspec_ray.store.store import LayerStore
    from streamspec_ray.runtime.weights import extra_bytes

    store = LayerStore(tiny["store"])
    one = max(u.bytes + extra_bytes(u, __import__("torch").float32) for u in store.stream_units)
    ref = Engine(target=tiny["store"], draft="ngram")
    with RayEngine(target=tiny["store"], draft="ngram", memory_budget=one, prefetch_depth=2) as eng:
        _same(ref, eng, k=4, temperature=0.8, seed=2)
    with pytest.raises(ConfigError, match="memory budget"):
        RayEngine(target=tiny["store"], draft=None, memory_budget=one // 2)


def test_bad_draft_and_corrupt_store(tiny, local_ray, tmp_path):
    from streamspec_ray import RayEngine

    with pytest.raises(ConfigError, match="out of range"):
        RayEngine(target=tiny["store"], draft="skip:99")
    bad = tmp_path / "store"
    shutil.copytree(tiny["store"], bad)
    shard = bad / "layer.001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # same size, one flipped byte: only the checksum can tell
    shard.write_bytes(bytes(data))
    with RayEngine(target=str(bad), draft=None) as eng:
        with pytest.raises(StoreError, match="checksum"):
            eng.generate(prompt_ids=PROMPT, max_new_tokens=4, mode="naive")


@pytest.mark.parametrize("role,no_restart", [("layer store", False), ("layer store", True), ("draft", False),
                                             ("verifier", False)])
def test_actor_killed_mid_generation(tiny_pair, tiny, role, no_restart):
    """Killed after the first round: Ray restarts it (or, no_restart, a new one is made), state is replayed,
    and the tokens are exactly the in-process engine's."""
    from streamspec_ray import RayEngine

    ref = tiny_pair[0]
    kw = dict(k=3, temperature=0.9, seed=11)
    want = ref.generate(prompt_ids=PROMPT, max_new_tokens=N, **kw).token_ids
    with RayEngine(target=tiny["store"], draft="self-int4", max_restarts=2) as eng:
        pid = ray.get(eng.actor(role).pid.remote(), timeout=60)
        killed = []

        def kill(_tokens):
            if not killed:
                killed.append(1)
                ray.kill(eng.actor(role), no_restart=no_restart)

        out = eng.generate(prompt_ids=PROMPT, max_new_tokens=N, on_tokens=kill, **kw)
        assert out.token_ids == want
        assert ray.get(eng.actor(role).pid.remote(), timeout=60) != pid  # really a new process
        if no_restart:  # a new actor was made (Ray's own restarts may need no revival from us)
            assert out.stats["ray"]["revivals"][role] == 1


@pytest.mark.parametrize("role", ["draft", "verifier"])
def test_actor_killed_mid_tree_generation(tiny_pair, tiny, role):
    """Tree rounds compact the caches: a restarted verifier replays sweeps and compactions, a restarted draft
    replays its trees, and the tokens are still the in-process engine's."""
    from streamspec_ray import RayEngine

    kw = dict(mode="tree", budget=8, temperature=0.9, seed=2)
    want = tiny_pair[0].generate(prompt_ids=PROMPT, max_new_tokens=N, **kw).token_ids
    with RayEngine(target=tiny["store"], draft="self-int4", max_restarts=2) as eng:
        killed = []

        def kill(_tokens):
            if len(killed) < 2:  # after the first and the second round
                killed.append(1)
                ray.kill(eng.actor(role), no_restart=False)

        assert eng.generate(prompt_ids=PROMPT, max_new_tokens=N, on_tokens=kill, **kw).token_ids == want


def test_actor_lost_for_good_keeps_tokens(tiny_pair, tiny):
    from streamspec_ray import RayEngine
    from streamspec_ray.actors.common import ActorFailure

    want = tiny_pair[0].generate(prompt_ids=PROMPT, max_new_tokens=N, k=3).token_ids
    with RayEngine(target=tiny["store"], draft="self-int4", max_restarts=0) as eng:
        first = []

        def kill(tokens):
            if not first:
                first.extend(tokens)
                ray.kill(eng.actor("layer store"), no_restart=True)

        with pytest.raises(ActorFailure, match="layer store") as e:
            eng.generate(prompt_ids=PROMPT, max_new_tokens=N, k=3, on_tokens=kill)
    assert isinstance(e.value, StreamspecError)
    assert e.value.token_ids == first and first == want[: len(first)]


def test_cli_ray(tiny, local_ray, capsys):
    from streamspec_ray.cli import main

    ids = ",".join(map(str, PROMPT))
    want = Engine(target=tiny["store"], draft="self-int4").generate(prompt_ids=PROMPT, max_new_tokens=12, k=4)
    assert main(["generate", "--prompt-ids", ids, "--target", tiny["store"], "--max-new-tokens", "12", "--k", "4",
                 "--ray", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == want.token_ids and out["ray"]["revivals"]["verifier"] == 0


# ---- batch jobs on the actors (speculative/batch.py, actors/pipelines.py) -------------------------------------------

def test_batch_identical_on_ray(tiny_pair):
    """18 prompts of different lengths and budgets through RayEngine.generate_batch, on one verifier and on two
    replicas, and as tree batches: every prompt's greedy tokens are one-at-a-time Engine.generate's; sampled
    ones follow the seed."""
    import random

    ref, eng = tiny_pair
    rng = random.Random(3)
    reqs = [{"prompt_ids": [rng.randrange(3, 256) for _ in range(rng.randrange(1, 30))],
             "max_new_tokens": rng.randrange(1, 40)} for _ in range(18)]
    want = [ref.generate(prompt_ids=r["prompt_ids"], max_new_tokens=r["max_new_tokens"], k=4).token_ids for r in reqs]
    for replicas in (1, 2):
        out = eng.generate_batch(reqs, batch_size=5, k=4, replicas=replicas)
        assert [r.token_ids for r in out] == want, replicas
        assert out.stats["replicas"] == replicas and out.stats["sequences_per_sweep"] > 1
    out = eng.generate_batch(reqs, batch_size=6, mode="tree", budget=8)
    assert [r.token_ids for r in out] == want
    sampled = [{**r, "temperature": 0.8, "seed": i} for i, r in enumerate(reqs[:6])]
    out = eng.generate_batch(sampled, batch_size=6, k=3)
    for i, (r, got) in enumerate(zip(sampled, out)):
        assert got.token_ids == ref.generate(prompt_ids=r["prompt_ids"], max_new_tokens=r["max_new_tokens"], k=3,
                                             temperature=0.8, seed=i).token_ids
    assert eng.revivals() == {"layer store": 0, "verifier": 0, "draft": 0}


def test_a_failing_request_on_ray_ends_alone(tiny_pair):
    """A request whose sampler fails (NaN temperature, which no validation lets in) beside greedy ones on the
    actors: it ends with finish_reason "error", the others give their one-at-a-time tokens."""
    from streamspec_ray.speculative import batch

    ref, eng = tiny_pair
    prompts = [PROMPT[:3], PROMPT[:5] + [9], PROMPT[1:4]]
    defaults = dict(max_new_tokens=12, temperature=0.0, top_p=1.0, top_k=0, seed=0)
    reqs = [batch.to_request(ref, {"prompt_ids": p}, defaults) for p in prompts]
    object.__setattr__(reqs[1].params, "temperature", float("nan"))
    out = eng.generate_batch(reqs, batch_size=3, k=4)
    assert out[1].finish_reason == "error" and "not finite" in out[1].error
    assert [out[0].token_ids, out[2].token_ids] == [ref.generate(prompt_ids=p, max_new_tokens=12, k=4).token_ids
                                                    for p in (prompts[0], prompts[2])]


def test_batch_verifier_killed_mid_job(tiny_pair, tiny):
    """The verifier dies between two batch sweeps: Ray restarts it, the live caches are replayed, and every
    prompt still gets one-at-a-time generation's tokens."""
    from streamspec_ray import RayEngine

    ref = tiny_pair[0]
    reqs = [{"prompt_ids": PROMPT[: 2 + i % 4] + [i + 20], "max_new_tokens": 12 + 3 * i} for i in range(8)]
    want = [ref.generate(prompt_ids=r["prompt_ids"], max_new_tokens=r["max_new_tokens"], k=4).token_ids for r in reqs]
    with RayEngine(target=tiny["store"], draft=ref.draft, max_restarts=2) as eng:
        pid = ray.get(eng.actor("verifier").pid.remote(), timeout=60)
        killed = []

        def kill(_i, _tokens):
            if not killed:
                killed.append(1)
                ray.kill(eng.actor("verifier"), no_restart=False)

        out = eng.generate_batch(reqs, batch_size=4, k=4, on_tokens=kill)
        assert [r.token_ids for r in out] == want
        assert ray.get(eng.actor("verifier").pid.remote(), timeout=60) != pid  # really a new process


def test_cli_batch_ray_replicas(tiny, local_ray, tmp_path):
    """`streamspec batch --ray --replicas 2` writes the same outputs as the in-process job."""
    from streamspec_ray.cli import main

    with open(tmp_path / "in.jsonl", "w") as f:
        for i in range(10):
            f.write(json.dumps({"id": i, "prompt_ids": PROMPT[: 1 + i % 6], "max_new_tokens": 5 + i}) + "\n")
    common = ["--target", tiny["store"], "--k", "4", "--batch-size", "3"]
    assert main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "local.jsonl"), *common]) == 0
    assert main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "ray.jsonl"), *common, "--ray",
                 "--replicas", "2"]) == 0

    def results(name):
        with open(tmp_path / name) as f:
            return {r["id"]: r["token_ids"] for r in map(json.loads, f)}

    assert results("ray.jsonl") == results("local.jsonl") and len(results("ray.jsonl")) == 10


@pytest.fixture(scope="module")
def deepseek_stores(tmp_path_factory):
    """fp32 stores of two tiny random DeepSeek models (test_deepseek's configs): V3 (q LoRA, YaRN, group-limited
    sigmoid routing, a dense first layer) and V2 (softmax group-limited routing)."""
    from test_deepseek import CONFIGS, save_tiny_deepseek

    from streamspec_ray.store.convert import convert

    out = {}
    for name in ("v3-lora-yarn", "v2-group"):
        root = tmp_path_factory.mktemp(name)
        model_type, kw = CONFIGS[name]
        save_tiny_deepseek(root / "hf", model_type, **kw)
        convert(str(root / "hf"), str(root / "store"), dtype="fp32")
        out[name] = str(root / "store")
    return out


DS_PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [1, 9, 33], [100, 2, 64, 7, 7, 120], [45], [3, 88, 19, 101, 5],
              [17, 17, 17, 17], [12, 90, 4, 71, 33, 2, 8], [66, 65, 64]]


def test_ray_engine_takes_the_expert_cache_and_its_hits_match(deepseek_stores, local_ray):
    """RayEngine's expert_cache (Engine's argument) is kept by the verifier: the same tokens as Engine with the
    same cache, the same bytes read, and the same experts served from the cache."""
    from streamspec_ray import RayEngine
    from streamspec_ray.runtime.executor import StreamingExecutor
    from streamspec_ray.store.store import LayerStore

    store = deepseek_stores["v3-lora-yarn"]
    cache = 100 * StreamingExecutor(LayerStore(store)).expert_need  # (room for every expert)
    ref = Engine(target=store, draft=None, expert_cache=cache)
    with RayEngine(target=store, draft=None, expert_cache=cache) as eng:
        a = ref.generate(prompt_ids=DS_PROMPTS[0], max_new_tokens=8, mode="naive")
        b = eng.generate(prompt_ids=DS_PROMPTS[0], max_new_tokens=8, mode="naive")
    ref.executor.close()
    assert b.token_ids == a.token_ids and b.stats["bytes_read"] == a.stats["bytes_read"]
    assert b.stats["stats"]["expert_hit_rate"] == a.stats["stats"]["expert_hit_rate"] > 0


def test_ray_engine_converts_a_target_to_its_target_dtype(tiny, local_ray):
    """RayEngine's target_dtype (Engine's argument): a Hugging Face folder converted on first use to that dtype,
    the store Engine would open, with Engine's tokens."""
    from streamspec_ray import RayEngine
    from streamspec_ray.store.store import LayerStore

    ref = Engine(target=tiny["hf_dir"], draft=None, target_dtype="fp16")
    with RayEngine(target=tiny["hf_dir"], draft=None, target_dtype="fp16") as eng:
        assert eng.root == ref.store.root and LayerStore(eng.root).manifest.dtype == "fp16"
        assert eng.generate(prompt_ids=PROMPT, max_new_tokens=8, mode="naive").token_ids == \
            ref.generate(prompt_ids=PROMPT, max_new_tokens=8, mode="naive").token_ids
    ref.executor.close()


@pytest.mark.parametrize("name", ["v2-group"])  # (V3's config runs these paths in test_families)
def test_deepseek_identical_on_ray(deepseek_stores, local_ray, name):
    """MLA + routed experts through the actors (the verifier is the in-process executor on the store actor's
    units): chain and tree, greedy and seeded-sampled, and a batch of 8 prompts (also on two verifier replicas),
    token for token Engine's, with the same bytes read (so the same experts)."""
    from streamspec_ray import RayEngine

    store = deepseek_stores[name]
    ref = Engine(target=store, draft="self-int4")
    with RayEngine(target=store, draft="self-int4") as eng:
        for kw in (dict(k=3), dict(k=3, temperature=0.9, seed=4), dict(mode="tree", budget=6),
                   dict(mode="tree", budget=8, temperature=0.8, seed=9)):
            a = ref.generate(prompt_ids=DS_PROMPTS[0], max_new_tokens=16, **kw)
            b = eng.generate(prompt_ids=DS_PROMPTS[0], max_new_tokens=16, **kw)
            assert b.token_ids == a.token_ids, kw
            assert b.stats["bytes_read"] == a.stats["bytes_read"], kw  # (the same experts read)
        reqs = [{"prompt_ids": p, "max_new_tokens": 10 + i} for i, p in enumerate(DS_PROMPTS)]
        want = [ref.generate(mode="naive", **r).token_ids for r in reqs]
        out = eng.generate_batch(reqs, batch_size=8, k=3)
        assert [r.token_ids for r in out] == want and out.stats["sequences_per_sweep"] > 1
        out = eng.generate_batch(reqs, batch_size=3, k=3, replicas=2)  # two verifiers on the one store actor
        assert [r.token_ids for r in out] == want and out.stats["replicas"] == 2
        sampled = [{**r, "temperature": 0.9, "seed": i} for i, r in enumerate(reqs)]
        out = eng.generate_batch(sampled, batch_size=8, mode="tree", budget=6)
        for r, got in zip(sampled, out):
            assert got.token_ids == ref.generate(mode="tree", budget=6, **r).token_ids
    ref.executor.close()


def test_deepseek_store_killed_mid_generation(deepseek_stores, local_ray):
    """The store actor dies while a DeepSeek sweep streams layers and experts from it: it is revived, the sweep
    re-run, and the tokens are Engine's."""
    from streamspec_ray import RayEngine

    store = deepseek_stores["v3-lora-yarn"]
    kw = dict(k=3, temperature=0.9, seed=3)
    ref = Engine(target=store, draft="self-int4")
    want = ref.generate(prompt_ids=DS_PROMPTS[0], max_new_tokens=16, **kw).token_ids
    with RayEngine(target=store, draft="self-int4", max_restarts=2) as eng:
        killed = []

        def kill(_tokens):
            if len(killed) < 2:
                killed.append(1)
                ray.kill(eng.actor("layer store"), no_restart=len(killed) == 2)

        out = eng.generate(prompt_ids=DS_PROMPTS[0], max_new_tokens=16, on_tokens=kill, **kw)
        assert out.token_ids == want and len(killed) == 2
    ref.executor.close()


@pytest.mark.slow
def test_smollm2_identical(smol_store, smol_engine, local_ray):
    """The embedded pair on Ray: greedy and seeded-sampled tokens equal Engine's. (The draft actor builds every
    draft from its spec string as it builds this one; the skip and n-gram drafts' exactness: test_spec, test_tree.)"""
    from streamspec_ray import RayEngine

    # self-int4 by name: the draft actor loads the draft Engine built and kept on disk (this node has the store's
    # files), so even the sampled tokens match seed for seed
    with RayEngine(target=smol_store, draft="self-int4") as eng:
        for kw in (dict(k=4), dict(k=4, temperature=0.8, seed=3), dict(mode="tree", budget=16)):
            a = smol_engine.generate("The capital of France is", max_new_tokens=24, **kw)
            b = eng.generate("The capital of France is", max_new_tokens=24, **kw)
            assert b.token_ids == a.token_ids, kw
            assert b.text == a.text


@pytest.mark.slow
def test_smollm2_kills_mid_sweep(smol_store, smol_naive, local_ray):
    """Kills timed to land inside a sweep (half a sweep after a round ends): the store for good (recreated),
    then the verifier (restarted by Ray, its cache replayed). Wherever they land, the tokens must not change."""
    import threading
    import time

    from streamspec_ray import RayEngine

    prompt, n = "The capital of France is", 8
    want = smol_naive(prompt, n)
    with RayEngine(target=smol_store, draft=None) as eng:
        t0, rounds, done = time.perf_counter(), [], []

        def kill_later(role, no_restart, delay):
            def run():
                time.sleep(delay)
                ray.kill(eng.actor(role), no_restart=no_restart)
                done.append(role)
            threading.Thread(target=run, daemon=True).start()

        def hook(_tokens):
            rounds.append(time.perf_counter())
            sweep = (rounds[-1] - t0) / len(rounds)
            if len(rounds) == 1:
                kill_later("layer store", True, sweep / 2)
            elif len(rounds) == 4:
                kill_later("verifier", False, sweep / 2)

        out = eng.generate(prompt, max_new_tokens=n, mode="naive", on_tokens=hook)
        assert out.token_ids == want
        assert done == ["layer store", "verifier"] and out.stats["ray"]["revivals"]["layer store"] == 1


ATTACH = """
import json, os, sys, time
from streamspec_ray import RayEngine
eng = RayEngine.attach(sys.argv[1], address=sys.argv[2])
open(sys.argv[3] + ".ready", "w").close()
while not os.path.exists(sys.argv[4]):
    time.sleep(0.005)
out = eng.generate(prompt_ids=json.loads(sys.argv[5]), max_new_tokens=int(sys.argv[6]))
print(json.dumps(out.token_ids))
"""


def test_two_processes_attached_to_one_controller_share_sweeps(tiny, local_ray, tmp_path):
    """A named ControllerActor (its own RayEngine: store, verifier and draft actors); two separate OS processes
    attach by name and generate at once: the sweeps carry both, and each output is what it gets alone."""
    from streamspec_ray.actors import controller

    ctl = controller.start("ctl-test", target=tiny["store"], draft="self-int4", mode="chain", k=4, batch_size=4)
    try:
        with pytest.raises(Exception, match="already runs"):
            controller.start("ctl-test", target=tiny["store"])
        prompts, n = [[5, 9, 13, 5, 9, 13], [200, 3, 77, 41]], 160
        want = [Engine(target=tiny["store"], draft=None).generate(prompt_ids=p, max_new_tokens=n, mode="naive")
                .token_ids for p in prompts]
        go = tmp_path / "go"
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        procs = [subprocess.Popen([sys.executable, "-c", ATTACH, "ctl-test", ray.get_runtime_context().gcs_address,
                                   str(tmp_path / f"p{i}"), str(go), json.dumps(p), str(n)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for i, p in enumerate(prompts)]
        deadline = time.monotonic() + 180
        while not all((tmp_path / f"p{i}.ready").exists() for i in range(2)) and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.05)
        before = ray.get(ctl.stats.remote())
        go.touch()  # both submit at once
        outs = [p.communicate(timeout=300) for p in procs]
        assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
        after = ray.get(ctl.stats.remote())
        assert [json.loads(o[0]) for o in outs] == want
        sweeps, seqs = after["sweeps"] - before["sweeps"], after["sequences"] - before["sequences"]
        assert seqs / sweeps > 1.0, (seqs, sweeps)  # sweeps carried both processes' sequences
    finally:
        ray.get(ctl.close.remote())
        ray.kill(ctl)


def test_attach_without_a_controller_is_one_error(local_ray):
    from streamspec_ray import RayEngine
    from streamspec_ray.errors import ConfigError

    with pytest.raises(ConfigError, match="no controller named 'nobody'"):
        RayEngine.attach("nobody")


# ---- last: a two-node cluster (the local session above is shut down first) -------------------------------

@pytest.fixture(scope="module")
def two_nodes(ray_tmp):
    from ray.cluster_utils import Cluster

    ray.shutdown()  # the module's local session, if it ran
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"streamspec_store": 1}, "object_store_memory": 200 * 2**20,
        "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"streamspec_verifier": 1}, object_store_memory=200 * 2**20)
    ray.init(address=cluster.address, log_to_driver=False, logging_level=logging.WARNING)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_two_nodes_store_and_verifier_apart(tiny, two_nodes):
    from streamspec_ray import RayEngine

    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    store_node = next(i for i, r in nodes.items() if "streamspec_store" in r)
    verifier_node = next(i for i, r in nodes.items() if "streamspec_verifier" in r)
    assert store_node != verifier_node
    ref = Engine(target=tiny["store"], draft="self-int4")
    with RayEngine(target=tiny["store"], draft="self-int4") as eng:
        where = eng.placement()
        assert where["layer_store"] == store_node and where["verifier"] == verifier_node
        assert eng.transport() == "object store"  # nodes apart: no ring to share
        for kw in (dict(k=4), dict(k=3, temperature=0.9, seed=7)):
            _same(ref, eng, **kw)


def test_two_nodes_deepseek(deepseek_stores, two_nodes):
    """A DeepSeek V3 store on the store node, its layers and routed experts served across nodes to the
    verifier: chain, tree and a batch equal the in-process engine's tokens."""
    from streamspec_ray import RayEngine

    store = deepseek_stores["v3-lora-yarn"]
    ref = Engine(target=store, draft="self-int4")
    with RayEngine(target=store, draft="self-int4") as eng:
        assert eng.transport() == "object store"
        for kw in (dict(k=3, temperature=0.9, seed=7), dict(mode="tree", budget=6)):
            a = ref.generate(prompt_ids=DS_PROMPTS[0], max_new_tokens=12, **kw)
            assert eng.generate(prompt_ids=DS_PROMPTS[0], max_new_tokens=12, **kw).token_ids == a.token_ids
        reqs = [{"prompt_ids": p, "max_new_tokens": 8} for p in DS_PROMPTS]
        out = eng.generate_batch(reqs, batch_size=8, k=3)
        assert [r.token_ids for r in out] == [ref.generate(mode="naive", **r).token_ids for r in reqs]
    ref.executor.close()
