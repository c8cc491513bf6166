"""Layer store: conversion (fp32/bf16/fp16/int4), the manifest, validation errors, atomic conversion, and
streamed logits against transformers' own forward for the Llama-family variants (Qwen2 biases, llama3 rope
scaling, Mistral, tied embeddings)."""
from __future__ import annotations

import os

import msgpack
import pytest
import torch

from conftest import save_tiny
from streamspec_ray import Engine
from streamspec_ray.errors import ConfigError, StoreError, StreamspecError
from streamspec_ray.store import convert as convert_mod
from streamspec_ray.store import shard
from streamspec_ray.store.convert import convert
from streamspec_ray.store.manifest import MANIFEST, Manifest
from streamspec_ray.store.store import LayerStore

N_LAYERS = 3
UNIT_NAMES = ["embed", "layer.000", "layer.001", "layer.002", "head"]


@pytest.fixture(scope="module")
def stores(tiny, tmp_path_factory):
    """The tiny Llama converted to every store dtype (fp32 from the session fixture), plus a symmetric int4."""
    root = tmp_path_factory.mktemp("stores")
    out = {"fp32": tiny["store"]}
    for dtype in ("bf16", "fp16", "int4"):
        out[dtype] = str(root / dtype)
        convert(tiny["hf_dir"], out[dtype], dtype=dtype)
    out["int4-sym"] = str(root / "int4-sym")
    convert(tiny["hf_dir"], out["int4-sym"], dtype="int4", symmetric=True)
    return out


def _copy_store(src: str, dst) -> str:
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def _manifest_dict(store: str) -> dict:
    with open(os.path.join(store, MANIFEST), "rb") as f:
        return msgpack.unpackb(f.read())


def _write_manifest_dict(store: str, d: dict) -> None:
    with open(os.path.join(store, MANIFEST), "wb") as f:
        f.write(msgpack.packb(d))


# --------------------------------------------------------------------------------------------- conversion


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "int4"])
def test_manifest_fields(stores, tiny, dtype):
    path = stores[dtype]
    m = Manifest.load(path)
    assert m.dtype == dtype
    assert [u.name for u in m.units] == UNIT_NAMES
    assert m.args.model_type == "llama"
    assert m.args.num_hidden_layers == N_LAYERS
    assert m.args.vocab_size == 256 and m.args.hidden_size == 64
    assert m.group_size == (64 if dtype == "int4" else None)
    assert m.source == os.path.abspath(tiny["hf_dir"])
    for u in m.units:
        fp = os.path.join(path, u.file)
        assert u.file == u.name + ".safetensors"
        assert os.path.getsize(fp) == u.bytes
        assert shard.file_checksum(fp) == u.xxh3
        assert len(u.xxh3) == 16 and int(u.xxh3, 16) >= 0
    # no stray temporary folders next to the store
    assert not [p for p in os.listdir(os.path.dirname(path)) if ".partial-" in p]

    store = LayerStore(path)
    assert store.total_bytes() == sum(u.bytes for u in m.units)
    layer = store.read("layer.001")
    assert layer.nbytes == m.unit("layer.001").bytes
    assert store.bytes_read == layer.nbytes and store.reads == 1
    for name, meta in m.unit("layer.001").tensors.items():
        t = layer.tensors[name]
        assert list(t.shape) == meta["shape"]
        assert str(t.dtype).removeprefix("torch.") == meta["dtype"]
    head = store.read("head").tensors
    assert "norm.weight" in head and ("lm_head.weight" in head or "lm_head.qweight" in head)
    if dtype in ("fp32", "bf16", "fp16"):
        want = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        assert layer.tensors["self_attn.q_proj.weight"].dtype == want
        ref = tiny["model"].model.layers[1].self_attn.q_proj.weight.detach().to(want)
        assert torch.equal(layer.tensors["self_attn.q_proj.weight"], ref)


def test_store_sizes_shrink_with_dtype(stores):
    size = {d: LayerStore(stores[d]).total_bytes(["layer.000", "layer.001", "layer.002"]) for d in stores}
    assert size["bf16"] < 0.51 * size["fp32"]
    assert abs(size["fp16"] - size["bf16"]) < 256  # same payload, only the headers differ
    assert size["int4"] < 0.35 * size["bf16"]  # headers weigh a lot in a tiny model
    assert size["int4-sym"] < size["int4"]


@pytest.mark.parametrize("which,scheme,bpp", [("int4", "asym", 0.5625), ("int4-sym", "sym", 0.53125)])
def test_int4_store_tensors_and_bytes_per_param(stores, which, scheme, bpp):
    store = LayerStore(stores[which])
    m = store.manifest
    assert m.extra.get("int4_scheme") == scheme
    layer = store.read("layer.000").tensors
    quantized = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    n_params = n_bytes = 0
    for stem in quantized:
        assert stem + ".weight" not in layer
        assert layer[stem + ".qweight"].dtype == torch.uint8
        assert (stem + ".zeros" in layer) == (scheme == "asym")
        out_dim, half_in = layer[stem + ".qweight"].shape
        n_params += out_dim * half_in * 2
        for suffix in (".qweight", ".scales", ".zeros"):
            if stem + suffix in layer:
                t = layer[stem + suffix]
                n_bytes += t.numel() * t.element_size()
    assert n_bytes / n_params == pytest.approx(bpp, abs=1e-12)
    # norms stay floating point, not quantized
    assert layer["input_layernorm.weight"].dtype == torch.float32
    assert "lm_head.qweight" in store.read("head").tensors
    # the resident embedding is never quantized
    assert "weight" in store.read("embed").tensors


def _dequantized_reference(model, store: LayerStore):
    """A copy of the HF model carrying exactly the weights the store holds (INT4 dequantized, the fp16
    embedding, bf16 rounding): what the streamed forward must reproduce."""
    import copy

    from streamspec_ray import quant

    ref = copy.deepcopy(model)
    gs = store.manifest.group_size or 64

    def load(module, tensors):
        for name, t in tensors.items():
            if name.endswith(".scales") or name.endswith(".zeros"):
                continue
            if name.endswith(".qweight"):
                stem = name[: -len(".qweight")]
                t = quant.dequantize_int4(t, tensors[stem + ".scales"], gs, zeros=tensors.get(stem + ".zeros"))
                name = stem + ".weight"
            module.get_parameter(name).data.copy_(t.float())

    load(ref.model.embed_tokens, store.read("embed").tensors)
    for i, layer in enumerate(ref.model.layers):
        load(layer, store.read(f"layer.{i:03d}").tensors)
    head = store.read("head").tensors
    ref.model.norm.weight.data.copy_(head["norm.weight"].float())
    load(ref, {("lm_head." + k.split(".", 1)[1]): v for k, v in head.items() if k.startswith("lm_head.")})
    return ref


@pytest.mark.parametrize("dtype", ["bf16", "int4", "int4-sym"])
def test_reduced_precision_stores_generate(stores, tiny, dtype):
    eng = Engine(target=stores[dtype], draft=None)
    out = eng.generate(prompt_ids=[1, 5, 9, 33], mode="naive", max_new_tokens=8)
    assert 1 <= len(out.token_ids) <= 8
    assert all(0 <= t < 256 for t in out.token_ids)
    assert out.stats["mode"] == "naive" and out.stats["sweeps"] >= 1
    # the streamed logits are HF's forward on exactly the weights the store holds
    ids = [1, 5, 9, 33, 70, 100]
    ref_model = _dequantized_reference(tiny["model"], LayerStore(stores[dtype]))
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    got = eng.logits(ids)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    # and the greedy continuation is the reference model's own greedy continuation (one forward checks it:
    # every new token is the argmax after the tokens before it)
    seq = [1, 5, 9, 33] + out.token_ids
    with torch.no_grad():
        nxt = ref_model(torch.tensor([seq])).logits[0, 3:-1].argmax(-1).tolist()
    assert out.token_ids == nxt


def _flip_middle_byte(path: str) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    assert os.path.getsize(path) == size


@pytest.fixture
def corrupt_store(tiny, tmp_path):
    store = _copy_store(tiny["store"], tmp_path / "corrupt")
    _flip_middle_byte(os.path.join(store, "layer.001.safetensors"))
    return store


def test_corrupt_shard_fails_on_read(corrupt_store):
    store = LayerStore(corrupt_store)  # the size is right: open succeeds
    store.read("layer.000")
    with pytest.raises(StoreError, match="checksum") as e:
        store.read("layer.001")
    assert "layer.001.safetensors" in str(e.value)


def test_corrupt_shard_never_yields_logits(corrupt_store):
    eng = Engine(target=corrupt_store, draft=None)
    got = []
    with pytest.raises(StoreError, match="checksum"):
        got.append(eng.logits([1, 2, 3]))
    assert got == []
    with pytest.raises(StreamspecError, match="layer.001.safetensors"):
        eng.generate(prompt_ids=[1, 2, 3], mode="naive", max_new_tokens=4)


def test_truncated_shard_fails_at_open(tiny, tmp_path):
    store = _copy_store(tiny["store"], tmp_path / "trunc")
    path = os.path.join(store, "layer.002.safetensors")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 100)
    with pytest.raises(StoreError, match="truncated") as e:
        LayerStore(store)
    assert "layer.002.safetensors" in str(e.value)
    with pytest.raises(StoreError, match="truncated"):
        Engine(target=store, draft=None)


def test_truncated_between_open_and_read(tiny, tmp_path):
    store_dir = _copy_store(tiny["store"], tmp_path / "trunc2")
    store = LayerStore(store_dir)
    path = os.path.join(store_dir, "head.safetensors")
    with open(path, "r+b") as f:
        f.truncate(10)
    with pytest.raises(StoreError, match="truncated") as e:
        store.read("head")
    assert "head.safetensors" in str(e.value)


@pytest.mark.parametrize("mapped", [False, True])
def test_bad_shards_fail_the_same_read_or_mapped(tiny, tmp_path, mapped):
    """A warm read that maps the file (shard.map_file) gives the bytes a copy gives, and the same one error for a
    corrupt, truncated or missing shard: never a fault from touching a mapping past the file's end."""
    root = _copy_store(tiny["store"], tmp_path / "s")
    store = LayerStore(root)
    for name in ("layer.000", "head"):
        assert torch.equal(store.read_raw(name, mapped=mapped), store.read_raw(name))
        got, want = store.read(name, mapped=mapped).tensors, store.read(name).tensors
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    _flip_middle_byte(os.path.join(root, "layer.001.safetensors"))
    with pytest.raises(StoreError, match="checksum") as e:
        store.read("layer.001", mapped=mapped)
    assert "layer.001.safetensors" in str(e.value)
    with open(os.path.join(root, "head.safetensors"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(StoreError, match="truncated: .*head.safetensors has 10 bytes"):
        store.read("head", mapped=mapped)
    os.remove(os.path.join(root, "layer.000.safetensors"))
    with pytest.raises(StoreError, match="missing: .*layer.000.safetensors"):
        store.read("layer.000", mapped=mapped)


def test_missing_shard(tiny, tmp_path):
    store = _copy_store(tiny["store"], tmp_path / "missing")
    os.remove(os.path.join(store, "layer.000.safetensors"))
    with pytest.raises(StoreError, match="missing") as e:
        LayerStore(store)
    assert "layer.000.safetensors" in str(e.value)


def test_missing_manifest(tiny, tmp_path):
    store = _copy_store(tiny["store"], tmp_path / "nomanifest")
    os.remove(os.path.join(store, MANIFEST))
    with pytest.raises(StoreError, match="no manifest") as e:
        LayerStore(store)
    assert store in str(e.value)


def test_unreadable_manifest(tiny, tmp_path):
    store = _copy_store(tiny["store"], tmp_path / "badmanifest")
    with open(os.path.join(store, MANIFEST), "wb") as f:
        f.write(b"\xc1\x00garbage")
    with pytest.raises(StoreError, match="manifest") as e:
        LayerStore(store)
    assert MANIFEST in str(e.value)


def test_nonexistent_folder(tmp_path):
    missing = str(tmp_path / "does-not-exist")
    with pytest.raises(StoreError, match="does not exist") as e:
        LayerStore(missing)
    assert missing in str(e.value)
    with pytest.raises(StreamspecError):
        Engine(target=missing, draft=None)


def test_unknown_architecture_in_manifest(tiny, tmp_path):
    store = _copy_store(tiny["store"], tmp_path / "neox")
    d = _manifest_dict(store)
    d["args"]["model_type"] = "gpt_neox"
    _write_manifest_dict(store, d)
    with pytest.raises(StreamspecError, match="gpt_neox"):
        LayerStore(store)


def test_unknown_architecture_in_hf_folder(tmp_path):
    import json

    hf = tmp_path / "neox-hf"
    hf.mkdir()
    # a real GPT-NeoX tiny model would also do; the config alone is what the converter checks first
    save_tiny(hf, "llama")
    cfg = json.loads((hf / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    (hf / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "neox-store"
    with pytest.raises(StreamspecError, match="gpt_neox"):
        convert(str(hf), str(out))
    assert not out.exists()
    assert not [p for p in os.listdir(tmp_path) if ".partial-" in p]


def test_not_a_model_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="config.json"):
        convert(str(tmp_path / "empty"), str(tmp_path / "out"))
    with pytest.raises(StoreError, match="unknown source"):
        convert(str(tmp_path / "nope"), str(tmp_path / "out"))
    with pytest.raises(ConfigError, match="dtype"):
        convert(str(tmp_path / "empty"), str(tmp_path / "out"), dtype="int8")


# --------------------------------------------------------------------------------------------- atomic conversion


def test_convert_refuses_existing_folder(tiny, tmp_path):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(StoreError, match="already exists") as e:
        convert(tiny["hf_dir"], str(out))
    assert str(out) in str(e.value)
    assert os.listdir(out) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"
    # an existing empty folder is fine; --force replaces a store, never a folder of other files
    empty = tmp_path / "empty"
    empty.mkdir()
    convert(tiny["hf_dir"], str(empty))
    LayerStore(str(empty))
    convert(tiny["hf_dir"], str(empty), force=True)
    LayerStore(str(empty))
    with pytest.raises(StoreError, match="not a store"):
        convert(tiny["hf_dir"], str(out), force=True)
    assert os.listdir(out) == ["keep.txt"]


def test_failed_conversion_leaves_nothing(tiny, tmp_path, monkeypatch):
    real = convert_mod.shard.ShardWriter.close
    calls = {"n": 0}

    def flaky(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full (simulated)")
        return real(self)

    monkeypatch.setattr(convert_mod.shard.ShardWriter, "close", flaky)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="simulated"):
        convert(tiny["hf_dir"], str(out))
    assert calls["n"] == 3
    assert not out.exists()
    assert os.listdir(tmp_path) == []


def test_failed_forced_conversion_keeps_old_store(tiny, tmp_path, monkeypatch):
    out = _copy_store(tiny["store"], tmp_path / "out")
    before = _manifest_dict(out)

    def broken(*a, **kw):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(convert_mod.shard.ShardWriter, "write", broken)
    with pytest.raises(OSError):
        convert(tiny["hf_dir"], out, force=True)
    assert _manifest_dict(out) == before
    LayerStore(out)
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_convert_checks_free_space_first(tiny, tmp_path, monkeypatch):
    """A disk without room for the store: one error line naming the sizes, before anything is written."""
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(convert_mod.shard.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(StoreError, match=r"fp32 store .* needs 0\.\d+ GB but .* has 0\.00 GB free") as e:
        convert(tiny["hf_dir"], str(tmp_path / "out"))
    assert "\n" not in str(e.value)
    assert os.listdir(tmp_path) == []


def test_size_checked_is_the_size_written(tiny, tmp_path, monkeypatch):
    """The free-space check asks for what the shards then hold (payload; headers are the 1% margin)."""
    asked = []
    monkeypatch.setattr(convert_mod.shard, "check_space", lambda folder, need, what: asked.append(need))
    for dtype in ("fp32", "int4"):
        out = tmp_path / dtype
        convert(tiny["hf_dir"], str(out), dtype=dtype)
        shards = sum(os.path.getsize(out / f) for f in os.listdir(out) if f.endswith(".safetensors"))
        assert asked[-1] <= shards <= asked[-1] * 1.01 + 8192 * len(os.listdir(out)), (dtype, asked[-1], shards)


def test_disk_full_mid_write_is_one_error(tiny, tmp_path, monkeypatch):
    """ENOSPC from the kernel half way (the space check passed, something else filled the disk): one StoreError,
    no partial store."""
    import errno

    def full(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(convert_mod.shard.ShardWriter, "write", full)
    with pytest.raises(StoreError, match="disk filled up while writing .*nothing was kept"):
        convert(tiny["hf_dir"], str(tmp_path / "out"))
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------------------------- exactness vs HF

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 10000.0}
VARIANTS = {
    "qwen2": ("qwen2", {}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "mistral": ("mistral", {}),
    "tied-llama": ("llama", {"tie_word_embeddings": True}),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    model_type, kw = VARIANTS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    model = save_tiny(root / "hf", model_type, seed=1, **kw)
    convert(str(root / "hf"), str(root / "store"), dtype="fp32")
    return request.param, model, str(root / "store")


def test_variant_manifest(variant):
    name, model, store = variant
    args = LayerStore(store).args
    if name == "qwen2":
        assert args.attention_bias
        layer = LayerStore(store).read("layer.000").tensors
        assert {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"} <= set(layer)
    if name == "llama3-rope":
        assert args.rope_scaling and args.rope_scaling["rope_type"] == "llama3"
        assert args.rope_scaling["factor"] == 8.0
    if name == "tied-llama":
        assert args.tie_word_embeddings
        assert "lm_head.weight" not in LayerStore(store).read("head").tensors


def _hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_variant_prefill_matches_hf(variant):
    name, model, store = variant
    ids = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(7)).tolist()
    eng = Engine(target=store, draft=None)
    got = eng.logits(ids)
    ref = _hf_logits(model, ids)
    assert got.shape == (20, 256)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_variant_chunked_cache_matches_hf(variant):
    name, model, store = variant
    ids = torch.randint(3, 256, (13,), generator=torch.Generator().manual_seed(11)).tolist()
    eng = Engine(target=store, draft=None)
    ref = _hf_logits(model, ids)
    cache = eng.executor.new_cache()
    pos = 0
    for n in (7, 1, 5):
        chunk = ids[pos : pos + n]
        got, st = eng.executor.sweep(chunk, cache)
        assert got.shape == (n, 256) and st.tokens == n
        torch.testing.assert_close(got, ref[pos : pos + n], atol=1e-4, rtol=1e-4)
        pos += n
        assert cache.length == pos


@pytest.fixture(scope="module")
def qwen2_with_bias(tmp_path_factory):
    """Qwen2 with non-zero q/k/v biases (random init leaves them at zero), saved and converted."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("qwen2bias")
    model = save_tiny(root / "hf0", "qwen2", seed=2)
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.copy_(torch.randn(proj.bias.shape, generator=g))
    model.save_pretrained(root / "hf")
    convert(str(root / "hf"), str(root / "store"))
    return AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32).eval(), str(root / "store")


def test_qwen2_nonzero_bias_matches_hf(qwen2_with_bias):
    model, store = qwen2_with_bias
    assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    ids = torch.randint(3, 256, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    eng = Engine(target=store, draft=None)
    ref = _hf_logits(model, ids)
    torch.testing.assert_close(eng.logits(ids), ref, atol=1e-4, rtol=1e-4)
    cache = eng.executor.new_cache()
    pos = 0
    for n in (7, 1, 5):
        got, _ = eng.executor.sweep(ids[pos : pos + n], cache)
        torch.testing.assert_close(got, ref[pos : pos + n], atol=1e-4, rtol=1e-4)
        pos += n


def test_each_file_version_is_hashed_once(tiny, tmp_path, monkeypatch):
    """A shard's bytes are hashed at its first read; later reads of the same file skip the hash, a file changed
    in place since (or replaced) is hashed again and a corruption raises, and reverify=True hashes every read."""
    import shutil

    from streamspec_ray.store import shard as shard_mod

    root = shutil.copytree(tiny["store"], tmp_path / "store")
    hashed = []
    real = shard_mod.checksum
    monkeypatch.setattr(shard_mod, "checksum", lambda buf: (hashed.append(buf.numel()), real(buf))[1])
    store = LayerStore(str(root))
    for _ in range(3):
        store.read("layer.001", cold=True)
        store.read("layer.000")
    assert len(hashed) == 2
    path = store.path("layer.001")
    with open(path, "r+b") as f:  # flip a byte in place: same inode and size, a new ctime
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(StoreError, match="checksum mismatch"):
        store.read("layer.001")
    with pytest.raises(StoreError, match="checksum mismatch"):  # (and never remembered as good)
        store.read("layer.001")
    shutil.copy(os.path.join(tiny["store"], os.path.basename(path)), path)  # the right bytes back
    store.read("layer.001")
    n = len(hashed)
    store.read("layer.001")
    assert len(hashed) == n
    every = LayerStore(str(root), reverify=True)
    every.read("layer.000")
    every.read("layer.000")
    assert len(hashed) == n + 2
