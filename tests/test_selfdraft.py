"""The self-int4 draft kept on disk (speculative/selfdraft.py): built once from the target's original source, reused,
rebuilt for a changed store or a corrupt copy, in memory when nothing is writable; on SmolLM2 it holds the GGUF's
own Q4_1 blocks."""
from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import pytest
import torch

from conftest import save_tiny
from streamspec_ray.models import llama
from streamspec_ray.runtime.kvcache import KVCache
from streamspec_ray.quant.kernel import HAS_KERNEL
from streamspec_ray.quant.packed import PackedInt4
from streamspec_ray.speculative import drafts, selfdraft
from streamspec_ray.store import convert as convert_mod
from streamspec_ray.store.convert import convert
from streamspec_ray.store.manifest import MANIFEST
from streamspec_ray.store.store import LayerStore

pytestmark = pytest.mark.skipif(not HAS_KERNEL, reason="the on-disk self-int4 draft needs torch's CPU int4 kernel")


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    monkeypatch.setenv("STREAMSPEC_HOME", str(h))
    return h


@pytest.fixture
def store(tiny, tmp_path):
    shutil.copytree(tiny["store"], tmp_path / "store")
    return LayerStore(str(tmp_path / "store"))


def kept(folder) -> list[str]:
    return sorted(p for p in os.listdir(folder) if "self-int4" in p and not p.endswith(".lock"))


def assert_same(a, b):
    """Two drafts hold bitwise the same weights (packed codes, scales and zeros; plain tensors; not the routed
    experts of a MoE draft, which are in .experts)."""
    assert [n for n, _ in a.units] == [n for n, _ in b.units]
    for (name, wa), (_, wb) in zip(a.units, b.units):
        same_weights(wa, wb, name)
    assert a.resident_bytes == b.resident_bytes


def same_weights(wa: dict, wb: dict, where) -> None:
    assert wa.keys() == wb.keys(), where
    for k in wa:
        x, y = wa[k], wb[k]
        assert type(x) is type(y), (where, k)
        if isinstance(x, PackedInt4):
            assert x.group_size == y.group_size and torch.equal(x.packed, y.packed), (where, k)
            assert torch.equal(x.scales_zeros, y.scales_zeros), (where, k)
        else:
            assert torch.equal(x, y), (where, k)


def _no_convert(*a, **k):
    raise AssertionError("the draft was converted again")


def test_built_once_then_loaded(store, home, monkeypatch, caplog):
    caplog.set_level(logging.INFO, "streamspec")
    first = drafts.self_int4(store)
    assert "building the self-int4 draft (first use, kept at" in caplog.text
    (name,) = kept(home / "drafts")
    path = home / "drafts" / name
    assert name.startswith("self-int4-store-")
    m = LayerStore(str(path)).manifest
    assert m.dtype == "int4pack" and m.group_size == 64 and m.source == os.path.abspath(store.manifest.source)
    stamp = os.stat(path / MANIFEST).st_mtime_ns
    monkeypatch.setattr(convert_mod, "_convert", _no_convert)
    caplog.clear()
    again = drafts.self_int4(store)
    assert "building" not in caplog.text and os.stat(path / MANIFEST).st_mtime_ns == stamp
    assert again.name == "self-int4" and again.vocab_size == store.args.vocab_size
    assert_same(first, again)
    # the in-memory build (a Ray draft actor's) quantizes the same fp32 values the same way: the same draft
    assert_same(first, drafts.self_int4_in_memory(store))
    assert any(isinstance(t, PackedInt4) for _, w in first.units for t in w.values())


def test_tied_head_is_4bit(tmp_path, home):
    save_tiny(tmp_path / "hf", tie_word_embeddings=True)
    convert(str(tmp_path / "hf"), str(tmp_path / "store"), dtype="fp32")
    st = LayerStore(str(tmp_path / "store"))
    d = drafts.self_int4(st)
    (name,) = kept(home / "drafts")
    head = LayerStore(str(home / "drafts" / name)).manifest.unit("head").tensors
    assert "lm_head.qweight" in head and "lm_head.scales_zeros" in head
    assert isinstance(d.units[-1][1]["lm_head.weight"], PackedInt4)
    assert_same(d, drafts.self_int4_in_memory(st))


def test_changed_store_gets_a_new_draft(tiny, tmp_path, home):
    out = str(tmp_path / "store")
    convert(tiny["hf_dir"], out, dtype="fp32")
    old = drafts.self_int4(LayerStore(out))
    save_tiny(tmp_path / "hf2", seed=1)
    convert(str(tmp_path / "hf2"), out, dtype="fp32", force=True)  # same folder, another model
    st = LayerStore(out)
    new = drafts.self_int4(st)
    assert len(kept(home / "drafts")) == 2
    assert_same(new, drafts.self_int4_in_memory(st))
    with pytest.raises(AssertionError):
        assert_same(new, old)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_draft_is_rebuilt(store, home, caplog, damage):
    first = drafts.self_int4(store)
    (name,) = kept(home / "drafts")
    shard_path = home / "drafts" / name / "layer.001.safetensors"
    data = bytearray(shard_path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0xFF  # (inside the tensor data: the size still matches, the checksum does not)
    else:
        data = data[:-100]
    shard_path.write_bytes(bytes(data))
    caplog.set_level(logging.INFO, "streamspec")
    again = drafts.self_int4(store)
    assert "unusable" in caplog.text and "rebuilding it" in caplog.text
    assert "building the self-int4 draft (first use" in caplog.text
    assert_same(first, again)
    assert LayerStore(str(home / "drafts" / name)).read("layer.001")  # the rebuilt copy checks out


def test_unwritable_home_keeps_it_beside_the_store(store, tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setenv("STREAMSPEC_HOME", str(tmp_path / "a-file" / "home"))  # (not a folder: even root fails)
    d = drafts.self_int4(store)
    (name,) = kept(tmp_path)
    assert name.startswith(".store.self-int4-")
    assert_same(d, drafts.self_int4(store))


def test_nowhere_writable_builds_in_memory(store, tmp_path, monkeypatch, caplog):
    (tmp_path / "a-file").write_text("x")
    monkeypatch.setattr(selfdraft, "candidates", lambda s, key: [str(tmp_path / "a-file" / "x"),
                                                                 str(tmp_path / "a-file" / "y")])
    caplog.set_level(logging.INFO, "streamspec")
    d = drafts.self_int4(store)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "in memory" in warnings[0].getMessage() and warnings[0].exc_info is None
    assert_same(d, drafts.self_int4_in_memory(store))


def test_source_gone_builds_from_the_store(tiny, tmp_path, home, caplog):
    shutil.copytree(tiny["hf_dir"], tmp_path / "hf")
    convert(str(tmp_path / "hf"), str(tmp_path / "store"), dtype="fp32")
    shutil.rmtree(tmp_path / "hf")
    st = LayerStore(str(tmp_path / "store"))
    caplog.set_level(logging.INFO, "streamspec")
    d = drafts.self_int4(st)
    assert "building it from the store itself" in caplog.text
    (name,) = kept(home / "drafts")
    assert LayerStore(str(home / "drafts" / name)).manifest.source.startswith("store:")
    assert_same(d, drafts.self_int4_in_memory(st))  # (fp32 store = the source's values: the same draft)


def test_smollm2_draft_keeps_the_q4_1_blocks(smol_store, smol_engine):
    """The embedded GGUF is Q4_1 in every layer matrix: the draft's codes are the file's (Llama's q/k rows
    reordered as transformers reorders them), its scale and zero bf16(d) and bf16(m + 8d), so its weights are
    the fp32 store's within the bf16 rounding of scale and zero."""
    from streamspec_ray.quant import ggml, kernel
    from streamspec_ray.store.sources import default_gguf
    from streamspec_ray.store.gguf import GGUFSource

    draft = smol_engine.draft
    assert draft.name == "self-int4"
    src = GGUFSource(default_gguf())
    target = LayerStore(smol_store)
    last = target.args.num_hidden_layers - 1
    for i in (0, last):
        w = llama.unfuse(target.args, dict(draft.units)[f"layer.{i:03d}"])  # (q/k/v, gate/up joined: see fuse)
        ref = target.read(f"layer.{i:03d}").tensors
        packed = [k for k, t in w.items() if isinstance(t, PackedInt4)]
        assert len(packed) == 7
        for k in packed:
            hf = f"model.layers.{i}.{k}"
            assert src.qtype(hf) == "Q4_1"
            n, kk = src.shape(hf)
            u, s, z = ggml.DIRECT["Q4_1"](src.raw_rows(hf, 0, n), (n, kk))
            perm = src.row_permutation(hf)
            assert (perm is not None) == (k in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"))
            if perm is not None:
                u, s, z = u[perm], s[perm], z[perm]
            t = w[k]
            assert t.group_size == 32
            assert np.array_equal(kernel.unpack_codes(t.packed, kk), u), k
            sz = t.scales_zeros.float()
            s, z = torch.from_numpy(s), torch.from_numpy(z)
            assert torch.equal(sz[..., 0].t(), s.bfloat16().float())
            assert torch.equal(sz[..., 1].t(), z.bfloat16().float())
            got = kernel.unpack_reference(t.packed, t.scales_zeros, 32, kk)
            bound = 2.0 ** -8 * (8 * s.abs() + z.abs()).repeat_interleave(32, dim=1) + 1e-6
            assert bool(((got - ref[k]).abs() <= bound).all()), k
    prompt = "The three most important inventions of the last century are"
    out = smol_engine.generate(prompt, max_new_tokens=16, mode="chain", k=8, chat=False)
    assert out.token_ids == smol_engine.generate(prompt, max_new_tokens=16, mode="naive", chat=False).token_ids
    assert out.stats["acceptance_rate"] > 0.6


@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_store_as_source_round_trip(tiny, tmp_path, kind):
    """convert.StoreSource reads a store back as a conversion source: an fp32 store converted from it is the
    same store, tensor for tensor (MoE expert units included)."""
    from streamspec_ray.store.convert import StoreSource, _convert

    if kind == "llama":
        src = tiny["store"]
    else:
        from test_deepseek import save_tiny_deepseek
        save_tiny_deepseek(tmp_path / "hf", "deepseek_v3", q_lora_rank=None, first_k_dense_replace=1, n_group=1,
                           topk_group=1)
        src = str(tmp_path / "store0")
        convert(str(tmp_path / "hf"), src, dtype="fp32")
    a = LayerStore(src)
    _convert(StoreSource(a), "store:" + src, str(tmp_path / "again"), "fp32", 64, False)
    b = LayerStore(str(tmp_path / "again"))
    assert [u.name for u in a.manifest.units] == [u.name for u in b.manifest.units]
    assert b.manifest.args.to_dict() == a.manifest.args.to_dict()
    for u in a.manifest.units:
        ta, tb = a.read(u.name).tensors, b.read(u.name).tensors
        assert ta.keys() == tb.keys(), u.name
        for k in ta:
            assert torch.equal(ta[k], tb[k]), (u.name, k)
    if kind != "llama":  # and the self-int4 draft of a MoE store, built on disk, is the in-memory one
        disk, mem = drafts.self_int4(a), drafts.self_int4_in_memory(a)
        assert_same(disk, mem)
        assert disk.experts.table.keys() == mem.experts.table.keys() and disk.experts.table
        for key, w in disk.experts.table.items():
            assert isinstance(w["gate_proj.weight"], PackedInt4)
            same_weights(w, mem.experts.table[key], key)


def test_no_kernel_builds_in_memory_at_group_64(store, home, monkeypatch):
    """Where the draft cannot use torch's CPU int4 kernel (CUDA, or a torch without it) nothing is kept on disk:
    quant.quantize_int4_asym at group 64, unit by unit, as before."""
    from streamspec_ray import Engine

    monkeypatch.setattr(drafts, "HAS_KERNEL", False)
    d = drafts.self_int4(store)
    assert not (home / "drafts").exists()
    packed = [t for _, w in d.units for t in w.values() if isinstance(t, PackedInt4)]
    assert packed and all(t.group_size == 64 for t in packed)
    ids = [5, 9, 13, 5, 9, 13, 5, 9]
    want = Engine(target=store.root, draft=None).generate(prompt_ids=ids, max_new_tokens=12, mode="naive").token_ids
    assert Engine(target=store.root, draft=d).generate(prompt_ids=ids, max_new_tokens=12, k=4).token_ids == want


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fused_projections_give_the_same_logits(store, tmp_path, home, kind):
    """A resident draft joins gate/up, and q/k/v where each is whole blocks of 64 rows of the kernel's packing,
    into one int4 kernel weight each (llama.fuse): fewer kernel calls per layer, logits equal bit for bit to
    the unfused layers'. The tiny llama's k and v have 32 rows and stay apart; the qwen2 one (64-row heads,
    q/k/v biases) joins all."""
    if kind == "qwen2":
        save_tiny(tmp_path / "hf", model_type="qwen2", hidden_size=128, num_attention_heads=2,
                  num_key_value_heads=1)
        convert(str(tmp_path / "hf"), str(tmp_path / "qstore"), dtype="fp32")
        store = LayerStore(str(tmp_path / "qstore"))
    d = drafts.self_int4(store)
    layers = [w for n, w in d.units if n.startswith("layer")]
    assert all("mlp.gate_up_proj.weight" in w and "mlp.up_proj.weight" not in w for w in layers)
    assert all(("self_attn.qkv_proj.weight" in w) == (kind == "qwen2") for w in layers)
    assert all(("self_attn.qkv_proj.bias" in w) == (kind == "qwen2") for w in layers)
    a = store.args
    split = [(n, llama.unfuse(a, w)) for n, w in d.units]  # the same weights taken apart again
    ids = torch.tensor([5, 9, 13, 2, 7])

    def logits(units):
        cache = KVCache(len(units) - 1, a.num_key_value_heads, a.head_dim, d.embed.dtype, "cpu")
        return llama.forward(a, d.embed, d.rope, units, ids, cache, None, None, 0)

    assert torch.equal(logits(d.units), logits(split))


def test_a_draft_multiplies_wide_calls_densely(store, home):
    """A resident draft's int4 weights take calls of packed.DENSE_ROWS rows or more (prompts entering the draft
    together) through a dense bf16 matmul of the dequantized weight, within bf16 rounding of the kernel; narrower
    calls, and any call under kernel_only (sampled drafting), stay on the kernel, row for row. A draft layer is
    then not batch-invariant, so its attention is batched; a weight built for a target never widens."""
    from streamspec_ray.quant import kernel as gi
    from streamspec_ray.quant import packed as int4

    d = drafts.self_int4(store)
    ws = [t for _, w in d.units for t in w.values() if isinstance(t, PackedInt4) and t.kernel]
    assert ws and all(t.wide_rows == int4.DENSE_ROWS for t in ws)
    assert not any(llama.batch_invariant(w) for n, w in d.units if n.startswith("layer"))
    w = max(ws, key=lambda t: t.out_features * t.in_features)
    ref = gi.unpack_reference(w.packed, w.scales_zeros, w.group_size, w.in_features)  # fp32 (u - 8) s + z
    assert (w.dense().float() - ref).abs().max() <= ref.abs().max() * 2 ** -7
    x = torch.randn(int4.DENSE_ROWS, w.in_features, generator=torch.Generator().manual_seed(0))
    kernel = int4.int4_matmul(x.to(int4.int4_input_dtype()), w.packed, w.group_size, w.scales_zeros).float()
    wide = w(x)
    assert torch.equal(wide, torch.nn.functional.linear(x.bfloat16(), w.dense()).float())
    assert (wide - kernel).abs().max() <= 0.02 * kernel.abs().max()
    assert torch.equal(w(x[:8]), kernel[:8])  # narrow: the kernel
    with int4.kernel_only():
        assert torch.equal(w(x), kernel)
    assert PackedInt4.from_packed(w.packed, w.scales_zeros, w.group_size).wide_rows is None
