"""A big vocabulary's tied head: the embedding table streamed as the head in its stored dtype (fp16 in 4-bit
stores) and cast a block of rows at a time as it multiplies (runtime.weights.BlockCast), instead of casting the
whole table every sweep."""
from __future__ import annotations

import pickle

import pytest
import torch

from conftest import save_tiny
from streamspec_ray import Engine
from streamspec_ray.runtime import executor as executor_mod
from streamspec_ray.runtime.embedding import EmbeddingRows, load_embedding
from streamspec_ray.runtime.weights import BlockCast
from streamspec_ray.store.convert import convert


@pytest.mark.parametrize("T", [1, 5])
def test_blockcast_is_cast_then_multiply_bit_for_bit(T):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 96, generator=g).half()  # 1000 rows in blocks of 256: a short last block
    x = torch.randn(T, 96, generator=g)
    bc = BlockCast(w, torch.float32, block_bytes=256 * 96 * 4)
    assert bc.rows == 256
    assert torch.equal(bc(x), torch.nn.functional.linear(x, w.float()))


@pytest.fixture(scope="module")
def tied_int4(tmp_path_factory):
    root = tmp_path_factory.mktemp("tied")
    save_tiny(root / "hf", tie_word_embeddings=True, seed=6)
    convert(str(root / "hf"), str(root / "int4"), dtype="int4")  # (the embedding stays fp16)
    return str(root / "int4")


def test_streamed_fp16_head_equals_the_resident_table(tied_int4, monkeypatch):
    """The same store with its embedding resident (cast once) and read by rows (the head streamed as fp16 and
    cast block by block): the same logits, and the same tokens in every mode."""
    resident = Engine(target=tied_int4, draft=None)
    ids = [5, 9, 13, 5, 9, 13, 5, 9, 40, 41]
    want = resident.logits(ids)
    ref = resident.generate(prompt_ids=ids, max_new_tokens=16, mode="naive").token_ids
    monkeypatch.setattr(executor_mod, "load_embedding", lambda store, dtype, device: load_embedding(
        store, dtype, device, resident_max=0))
    rows = Engine(target=tied_int4, draft="self-int4")
    assert isinstance(rows.executor.embed, EmbeddingRows) and rows.executor.sweep_names[-1] == "embed"
    assert rows.executor.stream(["embed"]).keep_dtype == {"embed"}
    torch.testing.assert_close(rows.logits(ids), want, atol=1e-5, rtol=1e-5)
    for kw in (dict(mode="naive"), dict(mode="chain", k=4), dict(mode="tree", budget=8)):
        assert rows.generate(prompt_ids=ids, max_new_tokens=16, **kw).token_ids == ref, kw
    # a draft sent to another process (a draft process, a Ray actor) takes the embedding's path, not the descriptor
    copy = pickle.loads(pickle.dumps(rows.executor.embed))
    assert copy._fd != rows.executor.embed._fd and torch.equal(copy[ids], rows.executor.embed[ids])
    del copy  # (closes its own descriptor only)
    assert torch.equal(rows.executor.embed[ids], rows.executor.embed[ids])


def test_int4pack_layers_are_batch_invariant(tiny_gemma, tmp_path):
    """An int4pack store (the int4 kernel rounds activations to bf16): the keys and values that tokens verified
    together in one chunk leave in every layer's cache are bit for bit those of the same tokens swept one at a
    time (naive). This is what keeps chain and tree output equal to naive's on real int4pack stores, where a
    batched attention call's rounding, amplified by bf16, changed greedy tokens (tests/test_gemma_real.py; this
    tiny model's batched call happens to round the same). The fp32 head after the last layer still rounds by
    the chunk's size (~1e-6)."""
    model, _ = tiny_gemma
    model.save_pretrained(tmp_path / "hf")
    convert(str(tmp_path / "hf"), str(tmp_path / "pack"), dtype="int4pack")
    eng = Engine(target=str(tmp_path / "pack"), draft=None)
    prefix, chunk = list(range(10, 250)) + list(range(3, 200)), list(range(60, 124))

    def gap() -> float:
        c1, c2 = eng.executor.new_cache(), eng.executor.new_cache()
        eng.executor.sweep(prefix, c1)
        eng.executor.sweep(prefix, c2)
        eng.executor.sweep(chunk, c1)
        for t in chunk:
            eng.executor.sweep([t], c2)
        end = len(prefix) + len(chunk)
        return max(float((a[:, :end] - b[:, :end]).abs().max()) for a, b in zip(c1.k + c1.v, c2.k + c2.v))

    assert gap() == 0.0
