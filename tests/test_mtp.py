"""DeepSeek V3's multi-token-prediction layer as the draft (`--draft mtp`), on a tiny random V3 given one MTP
layer (transformers builds none: its tensors are added to the checkpoint here, named as in V3's): the converter
keeps it, greedy chains equal naive, sampled chains follow the target's distribution, and what it cannot do is
one clear error."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import second_token_tv
from test_deepseek import CONFIGS, save_tiny_deepseek

from streamspec_ray import Engine
from streamspec_ray.errors import ConfigError
from streamspec_ray.store.convert import convert, expert_name, mtp_name
from streamspec_ray.store.store import LayerStore

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [1, 9, 33, 2], [100, 64, 7, 7, 120, 45, 3]]


def add_mtp_layer(folder, seed: int = 1) -> None:
    """Give a saved DeepSeek V3 checkpoint one MTP layer (model.layers.N.*): a copy of its last decoder layer's
    tensors plus noise, and enorm, hnorm, eh_proj, the shared head and V3's copy of the embedding."""
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    n, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    w = load_file(folder / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    last = f"model.layers.{n - 1}."
    for name, t in list(w.items()):
        if name.startswith(last):
            w[f"model.layers.{n}." + name[len(last):]] = t + 0.1 * t.std() * torch.randn(t.shape, generator=g)
    mtp = f"model.layers.{n}."
    w[mtp + "enorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    w[mtp + "hnorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=g)
    w[mtp + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5
    w[mtp + "shared_head.norm.weight"] = w["model.norm.weight"].clone()
    w[mtp + "shared_head.head.weight"] = w["lm_head.weight"].clone()
    w[mtp + "embed_tokens.weight"] = w["model.embed_tokens.weight"].clone()
    save_file({k: v.contiguous() for k, v in w.items()}, folder / "model.safetensors", metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 1
    cfg_path.write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def v3_mtp(tmp_path_factory):
    root = tmp_path_factory.mktemp("v3mtp")
    model_type, kw = CONFIGS["v3-lora-yarn"]
    save_tiny_deepseek(root / "hf", model_type, **kw)
    add_mtp_layer(root / "hf")
    convert(str(root / "hf"), str(root / "store"), dtype="fp32")
    return str(root / "store")


def _naive_and_mtp(store: str, **kw):
    """(naive engine, MTP-drafting engine) on `store`, both closed after (kw: Engine's options)."""
    naive, mtp = (Engine(target=store, draft=d, **kw) for d in (None, "mtp"))
    yield naive, mtp
    naive.executor.close()
    mtp.executor.close()


@pytest.fixture(scope="module")
def engines(v3_mtp):
    yield from _naive_and_mtp(v3_mtp)


def test_store_keeps_the_mtp_layer_outside_the_sweep(v3_mtp):
    store = LayerStore(v3_mtp)
    a = store.args
    assert a.num_nextn_predict_layers == 1
    unit = store.manifest.unit(mtp_name(0))
    assert {"enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.head.weight",
            "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.weight"} <= set(unit.tensors)
    assert "embed_tokens.weight" not in unit.tensors  # (the model's own table serves)
    store.manifest.unit(expert_name(a.num_hidden_layers, a.n_routed_experts - 1))  # its routed experts
    assert not any(u.name.startswith("mtp.") or u.name.startswith(f"expert.{a.num_hidden_layers:03d}.")
                   for u in store.stream_units)  # never streamed by a sweep


def test_greedy_chain_equals_naive(engines):
    naive, mtp = engines
    for prompt in PROMPTS:
        want = naive.generate(prompt_ids=prompt, max_new_tokens=16, mode="naive")
        for kw in (dict(k=1), dict(k=3), dict(k=3, overlap=True), dict(mode="tree", budget=4)):
            out = mtp.generate(prompt_ids=prompt, max_new_tokens=16, **kw)
            assert out.token_ids == want.token_ids, (prompt, kw)
            drafted = out.stats["stats"]["k_per_round"]
            assert out.stats["draft"] == "mtp" and drafted[0] == 0 and all(k > 0 for k in drafted[1:-1]), kw


@pytest.fixture(scope="module")
def cached_engines(v3_mtp):
    """As `engines`, with every routed expert kept in memory after its first read (expert_cache): the sampled
    test's ~750 generations measure the draws, which do not depend on where an expert comes from, and streaming
    each expert through the prefetcher made that test 56 s instead of 20 (a tiny expert's handoff dominates)."""
    yield from _naive_and_mtp(v3_mtp, expert_cache=1e9)


def test_sampled_chain_matches_target_distribution(cached_engines):
    """The second generated token (the first the MTP layer drafts) over many seeds against the target's own
    distribution given the first, as tests/test_spec.py checks the other drafts."""
    naive, mtp = cached_engines
    # (its first token has p = 0.4; the first round has no hidden state to draft from, and the second, capped at
    # one draft by max_new_tokens, drafts the second token)
    hits, tv = second_token_tv(naive, mtp, [91, 6, 122, 80], 300, 1500, max_new_tokens=3, k=2)
    assert hits == 300 and tv < 0.1, (hits, tv)


def test_cli_generates_with_mtp_and_refuses_it_in_one_line(v3_mtp, tiny, capsys, tmp_path):
    from test_cli import assert_one_error_line, run_main

    rc, out, _ = run_main(["generate", "--prompt-ids", "5,6,7,8", "--target", v3_mtp, "--draft", "mtp", "--k", "2",
                           "--max-new-tokens", "8", "--json"], capsys)
    assert rc == 0 and json.loads(out)["draft"] == "mtp"
    rc, _, err = run_main(["generate", "--prompt-ids", "5,6", "--target", tiny["store"], "--draft", "mtp"], capsys)
    assert_one_error_line(rc, err, contains="multi-token-prediction")
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": 1, "prompt_ids": [5, 6, 7]}) + "\n")
    rc, _, err = run_main(["batch", str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), "--target", v3_mtp,
                           "--draft", "mtp"], capsys)
    assert_one_error_line(rc, err, contains="one sequence at a time")
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()


def test_what_mtp_cannot_do_is_one_error(engines, v3_mtp, tiny):
    _, mtp = engines
    with pytest.raises(ConfigError, match="one sequence at a time"):
        mtp.generate_batch([[5, 6, 7], [8, 9]], k=2)
    with pytest.raises(ConfigError, match="multi-token-prediction layer"):
        Engine(target=tiny["store"], draft="mtp")
    from streamspec_ray.speculative.drafts import make_draft

    with pytest.raises(ConfigError, match="in-process engine"):
        make_draft("mtp", LayerStore(v3_mtp))
