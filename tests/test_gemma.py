"""Gemma 3 (models/gemma.py) against transformers' Gemma3ForCausalLM on a tiny random config: sliding-window
layers (window 4) between global ones, QK-norm, (1 + w) norms, GeGLU, the scaled embedding, a query scale that
is not head_dim's, final logit soft-capping. Prefill, chunks appended to the cache across the window's edge, a
tree sweep, and every speculative mode against naive."""
from __future__ import annotations

import pytest
import torch

from streamspec_ray import Engine
from streamspec_ray.config import ModelArgs
from streamspec_ray.errors import ConfigError

WINDOW = 4  # (tiny_gemma's, in conftest)


@pytest.fixture(scope="module")
def gemma(tiny_gemma):
    return tiny_gemma


def _hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_config(gemma):
    args = Engine(target=gemma[1], draft=None).args
    assert args.is_gemma and args.sliding_window == WINDOW and args.rope_local_theta == 10_000.0
    assert args.rope_theta == 1_000_000.0 and [args.is_sliding(i) for i in range(3)] == [True, True, False]


def test_prefill_matches_transformers(gemma):
    model, store = gemma
    ids = _ids(20, 7)  # 20 tokens: five windows deep
    torch.testing.assert_close(Engine(target=store, draft=None).logits(ids), _hf_logits(model, ids),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunks", [(7, 1, 5, 3, 6), (2, 3, 3, 2, 1, 5, 6), (1,) * 11])
def test_chunks_across_the_window_edge_match_transformers(gemma, chunks):
    """Chunks appended to the cache, straddling the window's edge in every way (one longer than the window,
    ones that end just past it, one token at a time)."""
    model, store = gemma
    ids = _ids(sum(chunks), 11)
    ref = _hf_logits(model, ids)
    eng = Engine(target=store, draft=None)
    cache, pos = eng.executor.new_cache(), 0
    for n in chunks:
        got, _ = eng.executor.sweep(ids[pos : pos + n], cache)
        torch.testing.assert_close(got, ref[pos : pos + n], atol=1e-4, rtol=1e-4)
        pos += n


def test_tree_sweep_matches_each_path(gemma):
    """A tree after a 6-token prefix, one branch 5 deep (its leaf's window starts inside the tree): each node's
    logits equal transformers' on the sequence prefix + the node's path."""
    model, store = gemma
    prefix = _ids(6, 3)
    #         node: 0   1   2   3   4   5   6
    tokens = [40, 41, 42, 43, 44, 50, 51]
    parent = [-1, 0, 1, 2, 3, 0, 5]
    depth = [0, 1, 2, 3, 4, 1, 2]
    mask = torch.zeros(7, 7, dtype=torch.bool)
    for i in range(7):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parent[j]
    eng = Engine(target=store, draft=None)
    cache = eng.executor.new_cache()
    eng.executor.sweep(prefix, cache)
    got, _ = eng.executor.sweep(tokens, cache, positions=torch.tensor([6 + d for d in depth]), mask=mask)
    for i in range(7):
        path, j = [], i
        while j >= 0:
            path.insert(0, tokens[j])
            j = parent[j]
        torch.testing.assert_close(got[i], _hf_logits(model, prefix + path)[-1], atol=1e-4, rtol=1e-4)


def test_greedy_generate_matches_transformers(gemma):
    model, store = gemma
    prompt = _ids(5, 9)
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, 5:].tolist()
    out = Engine(target=store, draft=None).generate(prompt_ids=prompt, max_new_tokens=24, mode="naive")
    assert out.token_ids == want


@pytest.mark.parametrize("draft,mode", [("self-int4", "chain"), ("self-int4", "tree"), ("skip:1", "chain"),
                                        ("ngram", "chain")])
def test_speculative_modes_equal_naive(gemma, draft, mode):
    store = gemma[1]
    prompt = [5, 9, 13, 5, 9, 13, 5, 9]
    want = Engine(target=store, draft=None).generate(prompt_ids=prompt, max_new_tokens=24, mode="naive").token_ids
    out = Engine(target=store, draft=draft).generate(prompt_ids=prompt, max_new_tokens=24, mode=mode)
    assert out.token_ids == want


def test_config_errors():
    base = dict(model_type="gemma3_text", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=2)
    with pytest.raises(ConfigError, match="soft-capping"):
        ModelArgs.from_hf({**base, "attn_logit_softcapping": 50.0})
    with pytest.raises(ConfigError, match="layer_types lists 3 layers"):
        ModelArgs.from_hf({**base, "sliding_window": 4, "layer_types": ["full_attention"] * 3})
    with pytest.raises(ConfigError, match="activation"):
        ModelArgs.from_hf({**base, "model_type": "llama", "hidden_act": "gelu_pytorch_tanh"})


def test_transformers_rebuilt_from_the_store(gemma):
    """hfref (the benchmarks' in-memory floor) rebuilds a Gemma 3 store as transformers' model, weights and config."""
    from streamspec_ray.hfref import hf_model
    from streamspec_ray.store.store import LayerStore

    model, store = gemma
    ids = _ids(12, 13)
    torch.testing.assert_close(_hf_logits(hf_model(LayerStore(store)), ids), _hf_logits(model, ids))


@pytest.mark.parametrize("dtype", ["int4", "int4pack", "fp16"])
def test_quantized_stores_cold_speculation_equals_naive(gemma, tmp_path, dtype):
    """A Gemma 3 store in each smaller dtype, read cold: chain and tree give that store's naive tokens."""
    from streamspec_ray.store.convert import convert

    model, _ = gemma
    hf = tmp_path / "hf"
    model.save_pretrained(hf)
    convert(str(hf), str(tmp_path / dtype), dtype=dtype)
    store = str(tmp_path / dtype)
    prompt = [7, 3, 100, 21, 7, 3]
    want = Engine(target=store, draft=None, cold=True).generate(prompt_ids=prompt, max_new_tokens=20,
                                                                mode="naive").token_ids
    eng = Engine(target=store, draft="self-int4", cold=True)
    assert eng.generate(prompt_ids=prompt, max_new_tokens=20, mode="chain").token_ids == want
    assert eng.generate(prompt_ids=prompt, max_new_tokens=20, mode="tree", budget=12).token_ids == want
