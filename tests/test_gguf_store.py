"""The `gguf` store dtype: every matrix kept as the GGUF file's own blocks and dequantized in torch as each layer
is streamed, bit for bit what the fp32 store holds (gguf-py's dequantization), so its logits and tokens are the
fp32 store's at the file's bytes per sweep."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from streamspec_ray import Engine
from streamspec_ray.errors import ConfigError, StoreError
from streamspec_ray.quant import ggml
from streamspec_ray.runtime import executor as executor_mod
from streamspec_ray.runtime.embedding import EmbeddingRows, load_embedding
from streamspec_ray.runtime.weights import GGMLMatrix, materialize
from streamspec_ray.store.convert import StoreSource, convert
from streamspec_ray.store.store import LayerStore
from test_gguf import TYPE_SETS, write_llama_gguf

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
_FP16 = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2),
         "Q6_K": (208,)}  # byte offsets of each block's fp16 fields
IDS = [5, 9, 13, 5, 9, 13, 5, 9, 40, 41, 300]


def _random_blocks(qtype: str, rows: int, cols: int, rng) -> np.ndarray:
    """Random bytes (every code pattern) with finite fp16 scales of either sign, tiny (subnormal) to large."""
    values, size = ggml.BLOCKS[qtype]
    b = rng.integers(0, 256, size=(rows * cols // values, size), dtype=np.uint8)
    for off in _FP16[qtype]:
        d = rng.standard_normal(len(b)) * 10.0 ** rng.uniform(-7, 1, len(b))
        b[:, off: off + 2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(ggml.BLOCKS))
def test_dequantize_is_gguf_pys_bit_for_bit(qtype, monkeypatch):
    rng = np.random.default_rng(list(ggml.BLOCKS).index(qtype))
    cases = [_random_blocks(qtype, 12, 1024, rng)]
    if ggml.BLOCKS[qtype][0] == 32:  # (gguf-py quantizes the legacy types only: real blocks from real weights)
        w = (rng.standard_normal((12, 1024)) * 0.05).astype(np.float32)
        cases.append(gguf.quants.quantize(w, getattr(T, qtype)))
    for b in cases:
        want = torch.from_numpy(gguf.quants.dequantize(b, getattr(T, qtype)))
        assert torch.equal(ggml.dequantize(torch.from_numpy(b), qtype), want)
        monkeypatch.setattr(ggml, "CHUNK_VALUES", 3 * ggml.BLOCKS[qtype][0])  # several steps, a short last one
        assert torch.equal(ggml.dequantize(torch.from_numpy(b), qtype), want)
        monkeypatch.undo()


@pytest.mark.parametrize("tokens", [1, 5])
def test_ggml_matrix_is_dequantize_then_multiply_bit_for_bit(tokens):
    """The head multiplied a slab of vocabulary rows at a time (1000 rows: 256, 256, 256, 232) gives the dot
    products of the whole dequantized matrix."""
    rng = np.random.default_rng(tokens)
    blocks = torch.from_numpy(_random_blocks("Q6_K", 1000, 512, rng))
    x = torch.from_numpy(rng.standard_normal((tokens, 512)).astype(np.float32))
    m = GGMLMatrix(blocks, "Q6_K", torch.float32, block_bytes=256 * 512 * 4)
    assert m.rows == 256 and m.shape == (1000, 512)
    assert torch.equal(m(x), torch.nn.functional.linear(x, ggml.dequantize(blocks, "Q6_K")))


@pytest.fixture(scope="module", params=list(TYPE_SETS))
def pair(request, tmp_path_factory):
    """A tiny GGUF (every supported type, on some tensor) converted to gguf and to fp32."""
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    path = root / "m.gguf"
    write_llama_gguf(path, TYPE_SETS[request.param])
    for dtype in ("gguf", "fp32"):
        convert(str(path), str(root / dtype), dtype=dtype)
    return {"gguf_file": str(path), "gguf": str(root / "gguf"), "fp32": str(root / "fp32")}


def _dense(w: dict) -> dict:
    return {k: t.rows_of(0, t.shape[0]) if isinstance(t, GGMLMatrix) else t for k, t in w.items()}


def test_weights_are_the_fp32_stores(pair):
    """Each unit of the gguf store, materialized, is the fp32 store's unit bit for bit; its matrices are the
    file's blocks (as many bytes), F16 / BF16 matrices stay 16-bit, and a StoreSource over it (what a self-int4
    draft is built from when the GGUF is gone) reads the same weights and the same blocks."""
    ours, ref = LayerStore(pair["gguf"]), LayerStore(pair["fp32"])
    assert ours.manifest.dtype == "gguf" and ours.manifest.group_size is None
    for u in ref.manifest.units:
        a = _dense(materialize(ours.read(u.name).tensors, torch.float32))
        b = materialize(ref.read(u.name).tensors, torch.float32)
        assert a.keys() == b.keys(), u.name
        for k in b:
            assert torch.equal(a[k], b[k]), (u.name, k)
    stored = [(k, m) for u in ours.manifest.units for k, m in u.tensors.items()]
    blocks = sorted((ggml.split(k)[1], m["shape"][0] * m["shape"][1]) for k, m in stored if ggml.split(k))
    reader = gguf.GGUFReader(pair["gguf_file"])
    assert blocks == sorted((t.tensor_type.name, int(t.n_bytes)) for t in reader.tensors
                            if t.tensor_type.name in ggml.BLOCKS)
    assert all(m["dtype"] == "uint8" for k, m in stored if ggml.split(k))
    half = {t.tensor_type.name for t in reader.tensors} & {"F16", "BF16"}
    assert {m["dtype"] for k, m in stored if not ggml.split(k)} == {"float32"} | {
        {"F16": "float16", "BF16": "bfloat16"}[h] for h in half}
    src, fp = StoreSource(ours), StoreSource(ref)
    assert sorted(src.names()) == sorted(fp.names())
    for name in fp.names():
        assert src.shape(name) == fp.shape(name) and torch.equal(src.get(name).float(), fp.get(name)), name
        assert torch.equal(src.rows(name, 1, 3).float(), fp.get(name)[1:3]) or len(fp.shape(name)) < 2, name
    down = "model.layers.1.mlp.down_proj.weight"  # (a tensor the fix-ups leave in the file's row order)
    if src.qtype(down):
        from streamspec_ray.store.gguf import GGUFSource
        assert np.array_equal(src.raw_rows(down, 0, 7), GGUFSource(pair["gguf_file"]).raw_rows(down, 0, 7))


def test_logits_and_tokens_are_the_fp32_stores(pair):
    """The same logits, bit for bit, from one streamed sweep; the same greedy tokens, naive and chain."""
    ours = Engine(target=pair["gguf"], draft="self-int4", threads=1)
    ref = Engine(target=pair["fp32"], draft="self-int4", threads=1)
    assert torch.equal(ours.logits(IDS), ref.logits(IDS))
    naive = ref.generate(prompt_ids=IDS, max_new_tokens=12, mode="naive").token_ids
    assert ours.generate(prompt_ids=IDS, max_new_tokens=12, mode="naive").token_ids == naive
    for kw in (dict(mode="chain", k=4), dict(mode="chain")):
        assert ours.generate(prompt_ids=IDS, max_new_tokens=12, **kw).token_ids == naive, kw
    bytes_ours = sum(ours.store.manifest.unit(n).bytes for n in ours.executor.sweep_names)
    bytes_ref = sum(ref.store.manifest.unit(n).bytes for n in ref.executor.sweep_names)
    assert bytes_ours < bytes_ref / 2.5  # (the file's blocks: 1.7 MB against 5.1 for "legacy", 0.84 for "kquant")


def test_budget_counts_the_fp32_copy(pair):
    """A unit's need is its shard plus the fp32 copy its sweep dequantizes (a head: one slab of rows): a budget
    one byte short of the largest is refused, and at that budget a sweep's streamed weights stay within it."""
    from streamspec_ray.runtime.weights import extra_bytes

    s, f = LayerStore(pair["gguf"]), LayerStore(pair["fp32"])
    for name in [u.name for u in s.manifest.layer_units] + ["head"]:
        u, v = s.manifest.unit(name), f.manifest.unit(name)
        assert extra_bytes(u, torch.float32) == sum(v.numel(k) * 4 for k, m in v.tensors.items()
                                                    if len(m["shape"]) == 2), name
    need = max(u.bytes + extra_bytes(u, torch.float32) for u in s.stream_units)
    with pytest.raises(ConfigError, match="memory budget"):
        Engine(target=pair["gguf"], draft=None, memory_budget=need - 1, threads=1)
    eng = Engine(target=pair["gguf"], draft=None, memory_budget=need, threads=1)
    assert torch.equal(eng.logits(IDS), Engine(target=pair["fp32"], draft=None, threads=1).logits(IDS))
    assert eng.executor.residency.peak <= need


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-tied")
    path = root / "m.gguf"
    write_llama_gguf(path, TYPE_SETS["kquant"], tied=True, seed=3)
    for dtype in ("gguf", "fp32"):
        convert(str(path), str(root / dtype), dtype=dtype)
    return {"gguf": str(root / "gguf"), "fp32": str(root / "fp32")}


def test_tied_head_by_rows_is_the_fp32_stores(tied, monkeypatch):
    """A tied table read by rows (as a big vocabulary's is): lookups read and dequantize only their rows' blocks,
    and the streamed head multiplies the blocks a slab of rows at a time (GGMLMatrix, 320 rows: 256 + 64): the
    fp32 store's logits bit for bit, resident or by rows."""
    from streamspec_ray.runtime import weights

    resident = {d: Engine(target=tied[d], draft=None, threads=1) for d in tied}
    assert torch.equal(resident["gguf"].logits(IDS), resident["fp32"].logits(IDS))
    monkeypatch.setattr(executor_mod, "load_embedding", lambda store, dtype, device: load_embedding(
        store, dtype, device, resident_max=0))
    monkeypatch.setattr(weights, "BLOCK_BYTES", 1)  # (blocks of 256 rows, the least)
    rows = {d: Engine(target=tied[d], draft=None, threads=1) for d in tied}
    emb = rows["gguf"].executor.embed
    assert isinstance(emb, EmbeddingRows) and emb.qtype == "Q6_K" and rows["gguf"].executor.sweep_names[-1] == "embed"
    assert torch.equal(emb[IDS], rows["fp32"].executor.embed[IDS])
    assert torch.equal(rows["gguf"].logits(IDS), rows["fp32"].logits(IDS))
    assert torch.equal(rows["gguf"].logits(IDS), resident["fp32"].logits(IDS))


def test_corrupt_shard_is_one_store_error(pair, tmp_path, monkeypatch):
    store = tmp_path / "store"
    shutil.copytree(pair["gguf"], store)
    with open(store / "layer.001.safetensors", "r+b") as f:
        f.seek(-100, 2)  # (in the last tensor's blocks)
        byte = f.read(1)
        f.seek(-100, 2)
        f.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(StoreError, match="checksum mismatch"):
        Engine(target=str(store), draft=None, threads=1).logits(IDS)
    with open(store / "embed.safetensors", "r+b") as f:
        f.seek(-10, 2)
        byte = f.read(1)
        f.seek(-10, 2)
        f.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(StoreError, match="checksum mismatch"):
        EmbeddingRows(LayerStore(str(store)), torch.float32)[[0, 319]]


def test_gguf_dtype_needs_a_gguf_source(tiny, tmp_path, capsys):
    from streamspec_ray.cli import main

    with pytest.raises(ConfigError, match="--dtype gguf keeps a GGUF file's own blocks"):
        convert(tiny["hf_dir"], str(tmp_path / "s"), dtype="gguf")
    assert not (tmp_path / "s").exists()
    assert main(["convert", tiny["hf_dir"], str(tmp_path / "s2"), "--dtype", "gguf"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --dtype gguf"), err
    with pytest.raises(ConfigError, match="not a GGUF file"):
        Engine(target=tiny["hf_dir"], draft=None, target_dtype="gguf")


def test_target_dtype_picks_the_store(pair, tmp_path, capsys):
    """A .gguf target converted on first use: one store per dtype, side by side, picked by target_dtype
    (Engine) or --target-dtype (CLI); a store given with another dtype is one error."""
    import json

    from streamspec_ray.cli import main
    from streamspec_ray.store.default import resolve_store

    path = str(tmp_path / "m.gguf")
    shutil.copy(pair["gguf_file"], path)
    as_gguf, as_fp32 = resolve_store(path, "gguf"), resolve_store(path)
    assert as_gguf != as_fp32 and as_gguf.endswith("-gguf") and as_fp32.endswith("-fp32")
    assert LayerStore(as_gguf).manifest.dtype == "gguf" and LayerStore(as_fp32).manifest.dtype == "fp32"
    eng = Engine(target=path, draft=None, target_dtype="gguf", threads=1)
    assert eng.store.root == as_gguf
    with pytest.raises(ConfigError, match="is a fp32 store"):
        resolve_store(as_fp32, "gguf")
    want = eng.generate(prompt_ids=IDS, max_new_tokens=4, mode="naive").token_ids
    capsys.readouterr()
    assert main(["generate", "--target", path, "--target-dtype", "gguf", "--prompt-ids", ",".join(map(str, IDS)),
                 "--mode", "naive", "--max-new-tokens", "4", "--threads", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == want


def test_the_embedded_smollm2_is_its_fp32_store(smol_store):
    """The real embedded model (Q4_1 blocks, Llama's q/k rows reordered as blocks, a Q8_0 table), converted on
    first use by target_dtype: the fp32 store's logits bit for bit and its greedy tokens, at a sixth of its
    bytes per sweep (66.5 MB against 424.8)."""
    ours = Engine(target=None, draft=None, target_dtype="gguf", threads=1)
    ref = Engine(target=smol_store, draft=None, threads=1)
    assert ours.store.manifest.dtype == "gguf" and ours.store.root.endswith("smollm2-135m-instruct-gguf")
    ids = ours.encode("The capital of France is", None, False)
    assert torch.equal(ours.logits(ids), ref.logits(ids))
    assert (ours.generate(prompt_ids=ids, max_new_tokens=8, mode="naive").token_ids
            == ref.generate(prompt_ids=ids, max_new_tokens=8, mode="naive").token_ids)
    per_sweep = {e: sum(e.store.manifest.unit(n).bytes for n in e.executor.sweep_names) for e in (ours, ref)}
    assert per_sweep[ours] * 6 < per_sweep[ref]
