"""GGUF read tensor by tensor: every supported block type gives the weights transformers' loader gives, an
unsupported type is one clear error, and converting takes bounded memory whatever the model's size."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from streamspec_ray.errors import StoreError
from streamspec_ray.store.convert import convert
from streamspec_ray.store.store import LayerStore

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
# fp16 fields of the k-quant blocks (byte offsets), which random bytes must not fill with NaN or inf
_FP16_FIELDS = {"Q4_K": (144, (0, 2)), "Q5_K": (176, (0, 2)), "Q6_K": (210, (208,)), "Q2_K": (84, (80, 82))}


def _raw_kquant(rows: int, cols: int, qtype: str, rng) -> np.ndarray:
    """Random but valid k-quant blocks for a [rows, cols] tensor: [rows, cols / 256 * block bytes] uint8."""
    size, fields = _FP16_FIELDS[qtype]
    blocks = rng.integers(0, 256, size=(rows * cols // 256, size), dtype=np.uint8)
    for off in fields:
        blocks[:, off : off + 2] = (rng.uniform(0.001, 0.01, len(blocks)).astype(np.float16)
                                    .view(np.uint8).reshape(-1, 2))
    return blocks.reshape(rows, -1)


def write_llama_gguf(path, types: dict[str, str] | None = None, hidden=256, ffn=512, layers=2, vocab=320,
                     heads=4, kv_heads=2, seed=0, tied=False, file_type: int | None = None) -> None:
    """A tiny random Llama as a GGUF file; `types` maps a GGUF tensor name suffix (e.g. "ffn_down") to its
    block type (default F32); tied: no output.weight (the head is the embedding); file_type: the
    general.file_type it says (llama_ftype; None: no such key)."""
    types = types or {}
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    if file_type is not None:
        w.add_file_type(file_type)

    def add(name, shape):
        kind = types.get(name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0], "F32")
        if len(shape) == 1:
            w.add_tensor(name, (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        elif kind in _FP16_FIELDS:
            w.add_tensor(name, _raw_kquant(*shape, kind, rng), raw_dtype=getattr(T, kind))
        else:
            data = (rng.standard_normal(shape) * 0.08).astype(np.float32)
            if kind == "F16":
                w.add_tensor(name, data.astype(np.float16))
            elif kind == "F32":
                w.add_tensor(name, data)
            else:
                w.add_tensor(name, gguf.quants.quantize(data, getattr(T, kind)), raw_dtype=getattr(T, kind))

    add("token_embd.weight", (vocab, hidden))
    for i in range(layers):
        add(f"blk.{i}.attn_norm.weight", (hidden,))
        add(f"blk.{i}.attn_q.weight", (hidden, hidden))
        add(f"blk.{i}.attn_k.weight", (hidden // heads * kv_heads, hidden))
        add(f"blk.{i}.attn_v.weight", (hidden // heads * kv_heads, hidden))
        add(f"blk.{i}.attn_output.weight", (hidden, hidden))
        add(f"blk.{i}.ffn_norm.weight", (hidden,))
        add(f"blk.{i}.ffn_gate.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_up.weight", (ffn, hidden))
        add(f"blk.{i}.ffn_down.weight", (hidden, ffn))
    add("output_norm.weight", (hidden,))
    if not tied:
        add("output.weight", (vocab, hidden))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hf_state(path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(str(path))
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).state_dict()


def _store_state(store) -> dict[str, torch.Tensor]:
    s = LayerStore(store)
    out = {}
    for u in s.manifest.units:
        for k, t in s.read(u.name).tensors.items():
            if u.name == "embed":
                name = "model.embed_tokens." + k
            elif u.name == "head":
                name = k if k == "lm_head.weight" else "model." + k
            else:
                name = f"model.layers.{int(u.name[6:])}.{k}"
            out[name] = t.float()
    return out


TYPE_SETS = {  # every supported type, each on some tensors (k-quants need rows of 256)
    "legacy": {"attn_q": "Q8_0", "attn_k": "Q4_0", "attn_v": "Q4_1", "attn_output": "Q5_0", "ffn_gate": "Q5_1",
               "ffn_up": "F16", "ffn_down": "BF16", "token_embd": "Q8_0", "output": "F16"},
    "kquant": {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q4_K", "ffn_gate": "Q5_K",
               "ffn_up": "Q6_K", "ffn_down": "Q4_K", "token_embd": "Q6_K", "output": "Q4_K"},
}


@pytest.mark.parametrize("kind", list(TYPE_SETS))
def test_every_type_matches_transformers(tmp_path, kind):
    """The fp32 store holds exactly the tensors transformers' GGUF loader produces (dequantized the same way,
    q/k rows un-permuted the same way), read one tensor at a time."""
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, TYPE_SETS[kind])
    convert(str(path), str(tmp_path / "store"), dtype="fp32")
    ref, ours = _hf_state(path), _store_state(tmp_path / "store")
    assert set(ref) == set(ours)
    for k in ref:
        assert torch.equal(ref[k], ours[k]), k


def test_slabs_equal_whole(tmp_path, monkeypatch):
    """Big tensors are converted a slab of rows at a time: the result is the same bytes."""
    from streamspec_ray.store import encode

    path = tmp_path / "m.gguf"
    write_llama_gguf(path, TYPE_SETS["kquant"])
    convert(str(path), str(tmp_path / "whole"), dtype="int4pack")
    monkeypatch.setattr(encode, "SLAB_ELEMS", 1)  # every slab is the minimum (64 rows)
    convert(str(path), str(tmp_path / "slabs"), dtype="int4pack")
    a, b = LayerStore(tmp_path / "whole"), LayerStore(tmp_path / "slabs")
    assert [u.xxh3 for u in a.manifest.units] == [u.xxh3 for u in b.manifest.units]


def test_unsupported_type_is_one_error(tmp_path):
    path = tmp_path / "m.gguf"
    write_llama_gguf(path, {"ffn_down": "Q2_K"})
    with pytest.raises(StoreError, match=r"unsupported GGUF tensor type \(blk\.0\.ffn_down\.weight is Q2_K"):
        convert(str(path), str(tmp_path / "store"))
    assert not (tmp_path / "store").exists()
    r = subprocess.run([sys.executable, "-m", "streamspec_ray", "convert", str(path), str(tmp_path / "s2")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Q2_K" in r.stderr, r.stderr


_PEAK = """
import json, resource, sys
from streamspec_ray.store.convert import convert
from streamspec_ray.store.gguf import GGUFSource
GGUFSource(sys.argv[1])  # the interpreter, its imports and the header: the baseline
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
m = convert(sys.argv[1], sys.argv[2], dtype=sys.argv[3])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base": base, "peak": peak, "largest": max(u.bytes for u in m.units)}))
"""


@pytest.mark.parametrize("dtype", ["fp32", "int4pack"])
def test_convert_memory_is_bounded(tmp_path, dtype):
    """Peak RSS of a conversion stays within three of the largest units over the interpreter's, and does not
    grow with the model: 6 layers cost what 2 do."""
    peaks = {}
    for layers in (2, 6):
        path = tmp_path / f"m{layers}.gguf"
        write_llama_gguf(path, {"attn_q": "Q8_0", "ffn_gate": "Q4_0", "ffn_up": "F16", "ffn_down": "Q8_0"},
                         hidden=1024, ffn=2816, layers=layers, vocab=8192)
        r = subprocess.run([sys.executable, "-c", _PEAK, str(path), str(tmp_path / f"s{layers}"), dtype],
                           capture_output=True, text=True, check=True)
        peaks[layers] = json.loads(r.stdout.strip().splitlines()[-1])
    cost = {n: m["peak"] - m["base"] for n, m in peaks.items()}  # what converting adds to the interpreter
    for n, m in peaks.items():
        assert cost[n] <= 3 * m["largest"], (peaks, cost)
    assert cost[6] - cost[2] <= peaks[6]["largest"], (peaks, cost)


def test_config_equals_transformers_whole_parse():
    """GGUFSource reads the config without the tokenizer's arrays (faster): it must still be transformers' own
    config for the file, bos / eos ids included (an eos id lost once let answers run past <|im_end|>)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from streamspec_ray.store.sources import default_gguf
    from streamspec_ray.store.gguf import GGUFSource

    full = dict(load_gguf_checkpoint(default_gguf(), return_tensors=False)["config"])
    full.pop("quantization_config", None)
    mine = GGUFSource(default_gguf()).config
    assert mine == full
    assert mine["eos_token_id"] == 2 and mine["vocab_size"] == 49152


def test_fast_header_reader_gives_gguf_pys_fields_and_tensors(tmp_path):
    """The header parser that conversion uses (store/gguf._fast_reader) builds every field and tensor exactly as
    gguf-py's GGUFReader does: the same parts (values, dtypes, shapes), data indices and types, on the embedded
    model's 49k-token vocabulary, merges and scores, and on arrays of every kind (empty strings, floats,
    nested)."""
    from streamspec_ray.store.sources import default_gguf
    from streamspec_ray.store.gguf import _fast_reader

    def same(path):
        want, got = gguf.GGUFReader(path), _fast_reader()(path)
        assert list(got.fields) == list(want.fields)
        for k, a in want.fields.items():
            b = got.fields[k]
            assert (b.offset, b.name, b.data, b.types) == (a.offset, a.name, a.data, a.types), k
            assert len(b.parts) == len(a.parts), k
            assert all(x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
                       for x, y in zip(a.parts, b.parts)), k
        assert [(t.name, t.tensor_type, t.data_offset, list(t.shape)) for t in got.tensors] == \
            [(t.name, t.tensor_type, t.data_offset, list(t.shape)) for t in want.tensors]
        return got

    tokens = same(default_gguf()).fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 49152 and tokens.contents(0) == "<|endoftext|>"
    w = gguf.GGUFWriter(str(tmp_path / "a.gguf"), "llama")
    w.add_array("a.strings", ["x", "", "yz"])
    w.add_array("a.floats", [1.5, 2.0])
    w.add_array("a.nested", [[1, 2], [3]])
    w.add_uint32("a.scalar", 7)
    w.add_tensor("t", np.zeros((2, 3), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fields = same(str(tmp_path / "a.gguf")).fields
    assert fields["a.strings"].contents() == ["x", "", "yz"] and fields["a.floats"].contents() == [1.5, 2.0]


def test_tokenizer_from_the_fast_reader_is_transformers(tmp_path):
    """The store's tokenizer (saved through the fast header reader) encodes and decodes as transformers'
    AutoTokenizer on the GGUF itself, chat template included."""
    from transformers import AutoTokenizer

    from streamspec_ray.store.sources import default_gguf
    from streamspec_ray.store.gguf import GGUFSource

    assert GGUFSource(default_gguf()).save_tokenizer(str(tmp_path))
    folder, name = os.path.split(default_gguf())
    want, got = AutoTokenizer.from_pretrained(folder, gguf_file=name), AutoTokenizer.from_pretrained(str(tmp_path))
    text = "Hello, world! def f(x):\n    return x ** 2  # ünïcødé"
    assert got.encode(text) == want.encode(text) and got.decode(got.encode(text)) == want.decode(want.encode(text))
    chat = [{"role": "user", "content": "Hi"}]
    assert got.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        want.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
