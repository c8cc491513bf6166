"""DeepSeek V2/V3 (MLA + MoE) on tiny random models saved by transformers: streamed logits against
DeepseekV3ForCausalLM / DeepseekV2ForCausalLM, naive vs absorbed MLA, per-expert shards read only when routed
to, the latent cache's size, generation (naive == transformers, chain == naive), ragged batches (forward_batch ==
forward per chunk, generate_batch == one at a time) and config validation."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from streamspec_ray import Engine
from streamspec_ray.errors import ConfigError
from streamspec_ray.models import deepseek, llama
from streamspec_ray.runtime.kvcache import LatentCache
from streamspec_ray.runtime.executor import StreamingExecutor
from streamspec_ray.runtime.weights import materialize
from streamspec_ray.store.convert import convert, expert_name
from streamspec_ray.store.store import LayerStore

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, mscale=0.707,
            mscale_all_dim=1.0, beta_fast=32, beta_slow=1)
CONFIGS = {
    # V3: q LoRA, YaRN with DeepSeek's mscale, a dense first layer, group-limited routing (4 groups, keep 2)
    "v3-lora-yarn": ("deepseek_v3", dict(q_lora_rank=32, rope_parameters=YARN, first_k_dense_replace=1, n_group=4,
                                         topk_group=2)),
    # V3: plain q_proj, rope not interleaved, every layer MoE, one group
    "v3-plain": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False, first_k_dense_replace=0, n_group=1,
                                     topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.5)),
    # V2: softmax routing, group_limited_greedy, complex (interleaved) rope
    "v2-group": ("deepseek_v2", dict(q_lora_rank=None, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                     first_k_dense_replace=1, routed_scaling_factor=2.0)),
    # V2: q LoRA, greedy routing, two shared experts
    "v2-greedy": ("deepseek_v2", dict(q_lora_rank=24, topk_method="greedy", n_shared_experts=2)),
}
N_LAYERS, N_EXPERTS, TOP_K = 3, 8, 3


def save_tiny_deepseek(path, model_type, seed=0, **kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    base = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=N_LAYERS, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=N_EXPERTS,
                num_experts_per_tok=TOP_K, n_shared_experts=1, kv_lora_rank=32, qk_rope_head_dim=16,
                qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
                bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    base.update(kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **base), dtype=torch.float32).eval()
    with torch.no_grad():  # peaked logits (stable argmax) and a non-trivial load-balancing bias
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
        for name, b in list(model.named_parameters()) + list(model.named_buffers()):
            if "e_score_correction_bias" in name:
                b.normal_(0, 0.05)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def ds(request, tmp_path_factory):
    model_type, kw = CONFIGS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    model = save_tiny_deepseek(root / "hf", model_type, **kw)
    convert(str(root / "hf"), str(root / "store"), dtype="fp32")
    return {"name": request.param, "hf_dir": str(root / "hf"), "model": model, "store": str(root / "store")}


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    root = tmp_path_factory.mktemp("v3")
    model_type, kw = CONFIGS["v3-lora-yarn"]
    model = save_tiny_deepseek(root / "hf", model_type, **kw)
    convert(str(root / "hf"), str(root / "store"), dtype="fp32")
    return {"hf_dir": str(root / "hf"), "model": model, "store": str(root / "store")}


IDS = [5, 17, 33, 2, 99, 64, 7, 7, 120, 45, 3, 88, 19, 101]


def test_store_layout_one_unit_per_expert(ds):
    store = LayerStore(ds["store"])
    args = store.args
    names = [u.name for u in store.manifest.units]
    assert [u.name for u in store.manifest.layer_units] == [f"layer.{i:03d}" for i in range(N_LAYERS)]
    for i in range(N_LAYERS):
        experts = [n for n in names if n.startswith(f"expert.{i:03d}.")]
        assert experts == ([expert_name(i, e) for e in range(N_EXPERTS)] if args.is_moe_layer(i) else [])
        layer = store.manifest.unit(f"layer.{i:03d}").tensors
        assert not any(".experts." in t for t in layer)  # routed experts live only in their own shards
        assert ("mlp.gate.weight" in layer) == args.is_moe_layer(i)
    assert set(store.manifest.unit(expert_name(N_LAYERS - 1, 0)).tensors) == {
        "gate_proj.weight", "up_proj.weight", "down_proj.weight"}


def test_streamed_logits_match_transformers(ds):
    """A prefill, then chunks appended to the latent cache (naive path for the long chunk, absorbed for the
    short ones), against transformers' forward over the whole sequence."""
    with torch.no_grad():
        ref = ds["model"](torch.tensor([IDS])).logits[0]
    ex = StreamingExecutor(ds["store"])
    cache = ex.new_cache()
    got = []
    for a, b in [(0, 9), (9, 12), (12, 13), (13, 14)]:
        out, stats = ex.sweep(IDS[a:b], cache)
        got.append(out)
        assert stats.experts_read <= stats.experts_total
    ex.close()
    torch.testing.assert_close(torch.cat(got), ref, atol=1e-4, rtol=0)


def _resident(store: LayerStore):
    units = [(n, materialize(store.read(n).tensors, torch.float32)) for n in
             [u.name for u in store.manifest.layer_units] + ["head"]]
    table = {tuple(int(x) for x in u.name.split(".")[1:]): materialize(store.read(u.name).tensors, torch.float32)
             for u in store.manifest.units if u.name.startswith("expert.")}
    embed = materialize(store.read("embed").tensors, torch.float32)["weight"]
    return units, deepseek.ResidentExperts(table), embed


def test_naive_and_absorbed_mla_agree(ds):
    store = LayerStore(ds["store"])
    units, experts, embed = _resident(store)
    rope = deepseek.RopeState(store.args)
    ex = StreamingExecutor(store)
    outs = {}
    for absorb in (False, True):
        cache = ex.new_cache()
        outs[absorb] = [deepseek.forward(store.args, embed, rope, units, torch.tensor(IDS[a:b]), cache, experts,
                                         absorb=absorb) for a, b in [(0, 10), (10, 11), (11, 14)]]
        assert cache.length == 14
        assert torch.isfinite(torch.cat(outs[absorb])).all()
    torch.testing.assert_close(torch.cat(outs[True]), torch.cat(outs[False]), atol=1e-4, rtol=0)


def test_greedy_naive_generation_matches_transformers(ds):
    prompt = IDS[:6]
    with torch.no_grad():
        ref = ds["model"].generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(prompt):].tolist()
    eng = Engine(target=ds["store"], draft="ngram")
    out = eng.generate(prompt_ids=prompt, max_new_tokens=12, mode="naive")
    eng.executor.close()
    assert out.token_ids[: len(ref)] == ref
    if out.finish_reason != "eos":
        assert len(out.token_ids) == 12


@pytest.fixture(scope="module")
def v3_naive(v3):
    eng = Engine(target=v3["store"], draft=None)
    out = eng.generate(prompt_ids=[5, 6, 7, 8, 9, 5, 6, 7], max_new_tokens=12, mode="naive")
    eng.executor.close()
    return out


@pytest.mark.parametrize("draft", ["ngram", "skip:1", "self-int4"])
def test_chain_and_tree_equal_naive(v3, v3_naive, draft):
    """Chain and tree (tree masks and positions through MLA, the latent cache compacted) against naive."""
    eng = Engine(target=v3["store"], draft=draft)
    for kw in (dict(mode="chain", k=4), dict(mode="tree", budget=6), dict(mode="tree", budget=32)):
        out = eng.generate(prompt_ids=[5, 6, 7, 8, 9, 5, 6, 7], max_new_tokens=12, **kw)
        assert out.token_ids == v3_naive.token_ids, kw
        assert out.stats["sweeps"] <= v3_naive.stats["sweeps"]
    eng.executor.close()


def test_forward_batch_equals_each_chunk_alone(v3):
    """Three sequences in one ragged batch (a short absorbed chunk, a tree under its mask and positions, a long
    naive prefill) give each chunk forward's own logits and latent cache, with the routed experts asked for
    once per MoE layer: the union over the batch."""
    store = LayerStore(v3["store"])
    a = store.args
    units, experts, embed = _resident(store)
    rope = deepseek.RopeState(a)
    calls = []

    def spy(layer, ids):
        calls.append((layer, ids))
        return experts(layer, ids)

    def caches():  # sequence 0 holds 5 tokens, sequence 1 holds 9, sequence 2 none
        out = [LatentCache(a.num_hidden_layers, a.kv_lora_rank, a.qk_rope_head_dim) for _ in range(3)]
        for c, n in zip(out, (5, 9)):
            deepseek.forward(a, embed, rope, units, torch.tensor(IDS[:n]), c, experts)
        return out

    parents = [-1, 0, 0, 1, 2]  # a tree of 5 nodes: each sees its ancestors and itself
    tree_mask = torch.eye(5, dtype=torch.bool)
    for i, p in enumerate(parents):
        while p >= 0:
            tree_mask[i, p], p = True, parents[p]
    depth = torch.tensor([0, 1, 1, 2, 2])

    def chunks(cs):  # 3 tokens after 5 (absorbed), a tree after 9 (absorbed), 11 from nothing (naive)
        return [llama.Chunk([40, 41, 42], cs[0]),
                llama.Chunk([50, 51, 52, 53, 54], cs[1], positions=9 + depth, mask=tree_mask),
                llama.Chunk(IDS[:11], cs[2], logits_from=4)]

    alone, alone_caches = [], caches()
    for c in chunks(alone_caches):
        alone.append(deepseek.forward(a, embed, rope, units, c.ids, c.cache, spy, c.positions, c.mask, c.logits_from))
    union: dict[int, set] = {}
    for layer, ids in calls:
        union.setdefault(layer, set()).update(ids)
    calls.clear()
    batch_caches = caches()
    got = deepseek.forward_batch(a, embed, rope, units, chunks(batch_caches), spy)
    moe_layers = [i for i in range(a.num_hidden_layers) if a.is_moe_layer(i)]
    assert [layer for layer, _ in calls] == moe_layers  # one provider call per MoE layer for the whole batch
    assert {layer: set(ids) for layer, ids in calls} == union
    assert all(ids == sorted(ids) for _, ids in calls)
    for x, y, cb, ca in zip(got, alone, batch_caches, alone_caches):
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        assert torch.equal(x.argmax(-1), y.argmax(-1))
        assert cb.length == ca.length
        for t, u in zip(cb.ckv + cb.kpe, ca.ckv + ca.kpe):
            torch.testing.assert_close(t[: cb.length], u[: ca.length], atol=1e-5, rtol=1e-5)


def test_sweep_batch_reads_each_routed_expert_once(v3, monkeypatch):
    """A streamed batch sweep reads each expert the batch routed to once, counts it in its SweepStats as a
    single sweep does, and gives each sequence its single sweep's logits."""
    store = LayerStore(v3["store"])
    reads = []
    real = store.read
    monkeypatch.setattr(store, "read", lambda name, **kw: (reads.append(name), real(name, **kw))[1])
    ex = StreamingExecutor(store, prefetch_depth=0)
    seqs = [IDS[:3], IDS[4:11], IDS[11:]]
    alone = [ex.sweep(ids, ex.new_cache())[0] for ids in seqs]
    reads.clear()
    got, stats = ex.sweep_batch([llama.Chunk(ids, ex.new_cache()) for ids in seqs])
    ex.close()
    experts = [n for n in reads if n.startswith("expert.")]
    assert len(set(experts)) == len(experts) == stats.experts_read < stats.experts_total
    unit_bytes = {u.name: u.bytes for u in store.manifest.units}
    assert stats.expert_bytes == sum(unit_bytes[n] for n in experts)
    assert stats.bytes_read == sum(unit_bytes[n] for n in reads) and stats.tokens == sum(map(len, seqs))
    for x, y in zip(got, alone):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_latent_cache_is_smaller_than_full_kv(v3):
    ex = StreamingExecutor(v3["store"])
    a = ex.args
    cache = ex.new_cache()
    ex.sweep(IDS[:5], cache)
    ex.close()
    latent = cache.bytes_per_token()
    full = a.num_hidden_layers * a.num_attention_heads * ((a.qk_nope_head_dim + a.qk_rope_head_dim) + a.v_head_dim) * 4
    assert latent == a.num_hidden_layers * (a.kv_lora_rank + a.qk_rope_head_dim) * 4
    # per layer: (r + dr) = 48 floats instead of H * (dn + dr + dv) = 4 * 48 = 192
    assert latent / full == pytest.approx((a.kv_lora_rank + a.qk_rope_head_dim)
                                          / (a.num_attention_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim
                                                                      + a.v_head_dim)))
    assert latent * 4 == full


def test_only_routed_experts_are_read(v3, monkeypatch):
    """Spy on the store's reads; the expert shards read per layer must be exactly the union of the experts
    transformers' own router picks for the chunk."""
    model = v3["model"]
    picked: dict[int, set] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            hooks.append(gate.register_forward_hook(
                lambda mod, inp, out, i=i: picked.setdefault(i, set()).update(out[2].flatten().tolist())))
    ids = IDS[:4]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    store = LayerStore(v3["store"])
    reads = []
    real = store.read
    monkeypatch.setattr(store, "read", lambda name, **kw: (reads.append(name), real(name, **kw))[1])
    ex = StreamingExecutor(store, prefetch_depth=0)
    reads.clear()
    _, stats = ex.sweep(ids, ex.new_cache())
    ex.close()
    expert_reads = [n for n in reads if n.startswith("expert.")]
    want = sorted(expert_name(i, e) for i, es in picked.items() for e in es)
    assert sorted(expert_reads) == want
    assert len(set(expert_reads)) == len(expert_reads)  # each routed expert once per sweep
    assert stats.experts_read == len(want) < stats.experts_total
    unit_bytes = {u.name: u.bytes for u in store.manifest.units}
    assert stats.expert_bytes == sum(unit_bytes[n] for n in want)
    assert stats.bytes_read == sum(unit_bytes[n] for n in reads)  # layers + head + routed experts, all counted


def test_memory_budget_holds_with_experts(v3):
    store = LayerStore(v3["store"])
    ex0 = StreamingExecutor(store)
    need = max(ex0.store.manifest.unit(n).bytes for n in ex0.layer_names + ["head"])
    budget = need + ex0.expert_need + 1
    ex0.close()
    ex = StreamingExecutor(store, memory_budget=budget)
    cache = ex.new_cache()
    with torch.no_grad():
        ref = v3["model"](torch.tensor([IDS[:8]])).logits[0]
    out, _ = ex.sweep(IDS[:8], cache)
    ex.close()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    assert 0 < ex.residency.peak <= budget
    with pytest.raises(ConfigError, match="largest expert"):
        StreamingExecutor(store, memory_budget=need + 1)


CHUNKS = [(0, 6), (6, 7), (7, 8), (8, 12), (12, 13)]  # a prefill, then chunks appended to the cache


def _sweeps(ex, ids=IDS):
    """Logits and SweepStats of each chunk of CHUNKS, swept in turn over one cache."""
    cache = ex.new_cache()
    outs = [ex.sweep(ids[a:b], cache) for a, b in CHUNKS]
    ex.close()
    return [o for o, _ in outs], [s for _, s in outs]


def _experts(ex) -> int:
    return ex.experts_total // sum(ex.args.is_moe_layer(i) for i in range(ex.args.num_hidden_layers))


def test_concurrent_expert_reads_and_cache_are_exact(v3):
    """Experts read several at once, and served from a cache (that holds them all, or 3 that keep evicting),
    give the logits of one-at-a-time reads bit for bit."""
    store = LayerStore(v3["store"])
    ref, _ = _sweeps(StreamingExecutor(store, expert_readers=1))
    e = StreamingExecutor(store).expert_need
    for kw in (dict(expert_readers=4), dict(expert_readers=4, expert_cache=100 * e),
               dict(expert_readers=4, expert_cache=3 * e), dict(expert_readers=1, expert_cache=3 * e)):
        ex = StreamingExecutor(store, **kw)
        assert ex.experts.readers == kw["expert_readers"]
        got, stats = _sweeps(ex)
        for x, y in zip(got, ref):
            assert torch.equal(x, y), kw
        if kw.get("expert_cache") == 100 * e:
            assert sum(s.expert_hits for s in stats) > 0


def test_expert_cache_hits_on_a_repeated_sweep(v3):
    """A second identical sweep finds every expert in a cache that holds them all: none is read again, and
    the bytes read are the layers' and the head's only. The engine reports the hit rate."""
    store = LayerStore(v3["store"])
    e = StreamingExecutor(store).expert_need
    ex = StreamingExecutor(store, expert_cache=100 * e)
    first = ex.sweep(IDS[:8], ex.new_cache())
    second = ex.sweep(IDS[:8], ex.new_cache())
    ex.close()
    assert torch.equal(first[0], second[0])
    a, b = first[1], second[1]
    assert a.expert_hits == 0 and a.experts_read > 0 and a.expert_bytes > 0
    assert b.expert_hits == b.experts_read == a.experts_read and b.expert_bytes == 0
    assert b.bytes_read == a.bytes_read - a.expert_bytes
    for cache in (100 * e, None):
        eng = Engine(target=v3["store"], draft=None, expert_cache=cache)
        s = eng.generate(prompt_ids=IDS[:5], max_new_tokens=6, mode="naive").stats["stats"]
        eng.executor.close()
        assert s["experts_read"] > 0 and (0 < s["expert_hit_rate"] <= 1 if cache else s["expert_hit_rate"] == 0)


def test_memory_budget_holds_with_concurrent_reads_and_cache(v3):
    """On a budget with just room for the largest layer, a 3-expert cache and 4 reads in flight (5 experts
    outside the cache), the residency's peak (the cache counted from the start) stays within it; on less, fewer
    reads are in flight (down to one at a time), still within it. Logits as one-at-a-time reads, no cache."""
    store = LayerStore(v3["store"])
    ref, _ = _sweeps(StreamingExecutor(store, expert_readers=1))
    ex0 = StreamingExecutor(store)
    need = max(ex0.store.manifest.unit(n).bytes for n in ex0.layer_names + ["head"])
    e = ex0.expert_need
    for budget, readers in ((need + 3 * e + 5 * e, 4), (need + 3 * e + 5 * e - 1, 3),
                            (need + 3 * e + 3 * e - 1, 1)):
        ex = StreamingExecutor(store, memory_budget=budget, expert_readers=4, expert_cache=3 * e)
        assert ex.experts.readers == readers and ex.experts.slots == 3
        got, stats = _sweeps(ex)
        assert 0 < ex.residency.peak <= budget, (budget, readers)
        assert len(ex.experts.cache) == 3  # (full: every sweep after the first evicts)
        for x, y in zip(got, ref):
            assert torch.equal(x, y)


def test_budget_too_small_for_the_expert_cache(v3):
    store = LayerStore(v3["store"])
    ex0 = StreamingExecutor(store)
    need = max(ex0.store.manifest.unit(n).bytes for n in ex0.layer_names + ["head"])
    e = ex0.expert_need
    StreamingExecutor(store, memory_budget=need + 3 * e, expert_cache=2 * e).close()
    with pytest.raises(ConfigError, match="expert cache"):
        StreamingExecutor(store, memory_budget=need + 3 * e - 1, expert_cache=2 * e)
    with pytest.raises(ConfigError, match="not one expert"):
        StreamingExecutor(store, expert_cache=e - 1)


def test_cli_expert_cache(v3, tmp_path, monkeypatch, capsys):
    """--expert-cache reaches the executor; --json reports the hit rate; a cache the budget cannot hold is one
    error line."""
    from streamspec_ray import cli

    monkeypatch.setenv("STREAMSPEC_HOME", str(tmp_path))
    base = ["generate", "--target", v3["store"], "--prompt-ids", "5,17,33,2", "--mode", "naive", "--max-new-tokens",
            "4", "--json", "--expert-cache", "1MB"]
    assert cli.main(base) == 0
    s = json.loads(capsys.readouterr().out)["stats"]
    assert s["experts_read"] > 0 and 0 < s["expert_hit_rate"] <= 1
    assert cli.main(base + ["--memory-budget", "1MB"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expert cache" in err[0], err


@pytest.mark.parametrize("kw", [dict(expert_readers=1), dict(expert_readers=4, expert_cache=1 << 20)])
def test_corrupt_expert_shard_raises_the_store_error(v3, tmp_path, kw):
    """Expert reads in flight still verify each shard: a corrupt one is the store's checksum error, not bad
    logits or a hang, and the executor sweeps again once the shard is repaired."""
    from streamspec_ray.errors import StoreError

    root = tmp_path / "store"
    shutil.copytree(v3["store"], root)
    shards = sorted(root.glob("expert.001.*.safetensors"))
    good = {p: p.read_bytes() for p in shards}
    for p, data in good.items():  # every expert of layer 1, so whatever the chunk routes to is corrupt
        bad = bytearray(data)
        bad[len(bad) // 2] ^= 0xFF
        p.write_bytes(bytes(bad))
    ex = StreamingExecutor(str(root), **kw)
    with pytest.raises(StoreError, match=r"checksum mismatch.*expert\.001\."):
        ex.sweep(IDS[:4], ex.new_cache())
    for p, data in good.items():
        p.write_bytes(data)
    out, _ = ex.sweep(IDS[:4], ex.new_cache())
    ex.close()
    ref, _ = StreamingExecutor(v3["store"], expert_readers=1).sweep(IDS[:4], LatentCache(
        N_LAYERS, ex.args.kv_lora_rank, ex.args.qk_rope_head_dim, torch.float32, "cpu"))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("dtype", ["bf16", "int4"])
def test_low_precision_stores(v3, tmp_path, dtype):
    out = str(tmp_path / dtype)
    convert(v3["hf_dir"], out, dtype=dtype)
    store = LayerStore(out)
    layer = store.manifest.unit("layer.001").tensors
    assert layer["mlp.gate.weight"]["dtype"] == "float32"  # the router stays fp32: routing is discrete
    with torch.no_grad():
        ref = v3["model"](torch.tensor([IDS])).logits[0]
    ex = StreamingExecutor(store)
    got, _ = ex.sweep(IDS, ex.new_cache())
    ex.close()
    assert torch.isfinite(got).all()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= (0.8 if dtype == "bf16" else 0.5)


def test_fused_expert_tensors_are_split(v3, tmp_path):
    """transformers 5 models hold experts fused ([E, 2I, H] gate_up_proj, [E, H, I] down_proj); a checkpoint
    saved in that layout converts to the same per-expert shards."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "fused"
    shutil.copytree(v3["hf_dir"], src)
    (path,) = [p for p in os.listdir(src) if p.endswith(".safetensors")]
    sd = load_file(str(src / path))
    for i in range(1, N_LAYERS):
        pre = f"model.layers.{i}.mlp.experts"
        gate = [sd.pop(f"{pre}.{e}.gate_proj.weight") for e in range(N_EXPERTS)]
        up = [sd.pop(f"{pre}.{e}.up_proj.weight") for e in range(N_EXPERTS)]
        down = [sd.pop(f"{pre}.{e}.down_proj.weight") for e in range(N_EXPERTS)]
        sd[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        sd[f"{pre}.down_proj"] = torch.stack(down)
    save_file(sd, str(src / path), metadata={"format": "pt"})
    convert(str(src), str(tmp_path / "store"))
    a, b = LayerStore(v3["store"]), LayerStore(str(tmp_path / "store"))
    assert [u.name for u in a.manifest.units] == [u.name for u in b.manifest.units]
    for u in a.manifest.units:
        ta, tb = a.read(u.name).tensors, b.read(u.name).tensors
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.parametrize("change, message", [
    (dict(n_routed_experts=8, n_group=3, topk_group=1), "multiple of n_group"),
    (dict(n_group=4, topk_group=1, num_experts_per_tok=3), "too few experts"),
    (dict(topk_method="softmax_topk"), "unknown topk_method"),
])
def test_invalid_configs_fail_at_convert(v3, tmp_path, change, message):
    src = tmp_path / "bad"
    shutil.copytree(v3["hf_dir"], src)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(change)
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message) as info:
        convert(str(src), str(tmp_path / "store"))
    assert "\n" not in str(info.value)
    assert not os.path.exists(tmp_path / "store")


# ------------------------------------------------------------------------------------ routing, pure functions


@pytest.mark.parametrize("n_group, topk_group, norm", [(8, 3, True), (4, 2, False), (1, 1, True)])
def test_v3_routing_matches_transformers_router(n_group, topk_group, norm):
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from streamspec_ray.models.moe import route_v3

    cfg = AutoConfig.for_model("deepseek_v3", hidden_size=32, n_routed_experts=32, num_experts_per_tok=6,
                               n_group=n_group, topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(n_group)
    with torch.no_grad():
        router.weight.normal_(generator=g)
        router.e_score_correction_bias.normal_(0, 0.5, generator=g)
    x = torch.randn(64, 32, generator=g)
    with torch.no_grad():
        logits, ref_w, ref_ids = router(x)
    ids, w = route_v3(logits, router.e_score_correction_bias, 6, n_group, topk_group, norm, 2.5)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order))
    if topk_group < n_group:  # the chosen experts come from at most topk_group groups
        groups = ids // (32 // n_group)
        assert max(len(set(r)) for r in groups.tolist()) <= topk_group


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_v2_routing_matches_transformers_router(method):
    from transformers import AutoConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from streamspec_ray.models.moe import route_v2

    cfg = AutoConfig.for_model("deepseek_v2", hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
                               topk_method=method, n_group=4, topk_group=2, routed_scaling_factor=1.5)
    router = DeepseekV2TopkRouter(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.weight.normal_(generator=g)
    x = torch.randn(64, 32, generator=g)
    with torch.no_grad():
        logits, ref_w, ref_ids = router(x)
    ids, w = route_v2(logits, 4, method, 4, 2, 1.5)
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order))


# ------------------------------------------------------------------------------------ ragged batches

BATCH_PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [17, 33], [99, 64, 7, 7, 120, 45, 3, 88, 19, 101, 64, 7], [3],
                 [40, 41, 40, 41, 40], [120, 119, 118, 117, 116, 115], [7, 7, 7], [88, 19, 101, 88, 19],
                 [64, 33, 17, 5]]
BATCH_REQUESTS = [{"prompt_ids": p, "max_new_tokens": 8 + (3 * i) % 13} for i, p in enumerate(BATCH_PROMPTS)]


@pytest.fixture(scope="module")
def v3_engines(v3):
    engines = {d: Engine(target=v3["store"], draft=d) for d in ("ngram", "self-int4")}
    yield engines
    for eng in engines.values():
        eng.executor.close()


def _greedy_batches_equal_alone(eng, cases):
    want = [eng.generate(prompt_ids=r["prompt_ids"], max_new_tokens=r["max_new_tokens"], mode="naive")
            for r in BATCH_REQUESTS]
    for kw in cases:
        out = eng.generate_batch(BATCH_REQUESTS, batch_size=8, **kw)
        for i, (got, w) in enumerate(zip(out, want)):
            assert (got.token_ids, got.finish_reason) == (w.token_ids, w.finish_reason), (i, kw)
        assert out.stats["sequences_per_sweep"] > 1, kw
        assert out.stats["sweeps"] < sum(r.stats["sweeps"] for r in out)


@pytest.mark.parametrize("draft", ["ngram", "self-int4"])
def test_greedy_batch_equals_one_at_a_time(v3_engines, draft):
    """generate_batch on a DeepSeek V3 store (MLA per sequence, experts read once per layer for the batch):
    every prompt's tokens and finish reason are naive one-at-a-time generation's, chain and tree."""
    _greedy_batches_equal_alone(v3_engines[draft], [dict(mode="chain", k=3), dict(mode="tree", budget=6)])


def test_sampled_batch_follows_each_request_seed(v3_engines):
    eng = v3_engines["self-int4"]
    reqs = [{**r, "temperature": 0.9, "top_p": 0.95, "seed": 100 + i} for i, r in enumerate(BATCH_REQUESTS)]
    for kw in (dict(mode="chain", k=3), dict(mode="tree", budget=6)):
        out = eng.generate_batch(reqs, batch_size=8, **kw)
        for i, (r, got) in enumerate(zip(reqs, out)):
            want = eng.generate(prompt_ids=r["prompt_ids"], max_new_tokens=r["max_new_tokens"], temperature=0.9,
                                top_p=0.95, seed=r["seed"], **kw)
            assert got.token_ids == want.token_ids, (i, kw)
        assert len({tuple(r.token_ids) for r in out}) > 1
        assert out.stats["sequences_per_sweep"] > 1


def test_v2_greedy_batch_equals_one_at_a_time(tmp_path):
    model_type, kw = CONFIGS["v2-group"]
    save_tiny_deepseek(tmp_path / "hf", model_type, **kw)
    convert(str(tmp_path / "hf"), str(tmp_path / "store"), dtype="fp32")
    eng = Engine(target=str(tmp_path / "store"), draft="self-int4")
    _greedy_batches_equal_alone(eng, [dict(mode="chain", k=3)])
    eng.executor.close()
