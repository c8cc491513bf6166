"""Convert a Hugging Face folder, a GGUF file or the embedded default model into a layer store.

HF folders are converted tensor by tensor through safetensors (one unit in memory at a time). GGUF files go
through transformers' GGUF loader, which dequantizes the whole model to fp32 in memory first (fine for the
small GGUF models this is used with). The store is written into a temporary sibling folder and renamed into
place at the end, so a crash never leaves a half store that looks whole.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from ..config import ModelArgs
from ..errors import ConfigError, StoreError
from .. import quant
from . import shard
from .default import default_gguf
from .manifest import MANIFEST, Manifest, Unit, layer_name

log = logging.getLogger("streamspec")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int4": None}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")  # [E, 2I, H] / [E, H, I] (transformers 5)


def expert_name(layer: int, expert: int) -> str:
    """Each routed expert of each layer is its own unit (and shard), read only when a sweep routes to it.
    Not "layer.LLL.*": manifest.layer_units means the decoder layers only."""
    return f"expert.{layer:03d}.{expert:03d}"


def _deepseek_units(hf_name: str, args: ModelArgs):
    """DeepSeek per-expert tensors -> [(unit, local name, (hf_name, expert | None, part | None))], or None."""
    m = _LAYER.match(hf_name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= args.num_hidden_layers:
        return []  # multi-token-prediction layers (V3's layer 61): not part of the decoder
    e = _EXPERT.match(rest)
    if e:
        return [(expert_name(layer, int(e.group(1))), e.group(2) + ".weight", (hf_name, None, None))]
    f = _FUSED.match(rest)
    if f:
        E = args.n_routed_experts
        if f.group(1) == "down_proj":
            return [(expert_name(layer, i), "down_proj.weight", (hf_name, i, None)) for i in range(E)]
        return [(expert_name(layer, i), p + "_proj.weight", (hf_name, i, p)) for i in range(E) for p in ("gate", "up")]
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

    def save_tokenizer(self, out: str) -> bool:
        found = [f for f in TOKENIZER_FILES if os.path.exists(os.path.join(self.path, f))]
        # a folder with only generation_config.json / tokenizer_config.json has no loadable tokenizer
        if not any(f in ("tokenizer.json", "tokenizer.model", "vocab.json") for f in found):
            return False
        os.makedirs(out, exist_ok=True)
        for f in found:
            shutil.copy(os.path.join(self.path, f), out)
        return True


class _GGUF:
    def __init__(self, path: str):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not os.path.exists(path):
            raise StoreError(f"GGUF file not found: {path}")
        folder, name = os.path.split(os.path.abspath(path))
        log.info("loading %s through transformers' GGUF loader", path)
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        except ValueError as e:  # transformers raises ValueError for architectures it cannot read from GGUF
            raise StoreError(f"cannot load {path}: {e}") from None
        self.config = model.config.to_dict()
        self.config.pop("quantization_config", None)
        self.state = model.state_dict()
        self.tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)

    def names(self):
        return list(self.state)

    def get(self, name: str) -> torch.Tensor:
        return self.state[name]

    def save_tokenizer(self, out: str) -> bool:
        self.tokenizer.save_pretrained(out)
        return True


def open_source(src: str):
    if src == "default":
        return _GGUF(default_gguf()), "default:" + os.path.basename(default_gguf())
    if src.endswith(".gguf"):
        return _GGUF(src), os.path.abspath(src)
    if os.path.isdir(src):
        return _HFFolder(src), os.path.abspath(src)
    raise StoreError(f"unknown source {src!r}: give a Hugging Face model folder, a .gguf file, or 'default'")


def _encode(unit: str, name: str, t: torch.Tensor, dtype: str, group_size: int,
            symmetric: bool) -> dict[str, torch.Tensor]:
    """One source tensor -> the store tensors for it (INT4: name.qweight + name.scales [+ name.zeros])."""
    if not t.is_floating_point():
        return {name: t.contiguous()}
    if name.startswith("mlp.gate."):  # the MoE router stays fp32 (as transformers keeps it): routing is discrete
        return {name: t.float().contiguous()}
    if dtype != "int4":
        return {name: t.to(DTYPES[dtype]).contiguous()}
    if unit != "embed" and name.endswith(".weight") and quant.can_quantize(name, t.shape, group_size):
        stem = name[: -len(".weight")]
        if symmetric:
            q, s = quant.quantize_int4(t.float(), group_size)
            return {stem + ".qweight": q, stem + ".scales": s}
        q, s, z = quant.quantize_int4_asym(t.float(), group_size)
        return {stem + ".qweight": q, stem + ".scales": s, stem + ".zeros": z}
    # norms and biases stay fp32 (tiny); the resident embedding table is kept fp16
    return {name: t.to(torch.float16 if unit == "embed" else torch.float32).contiguous()}


def convert(src: str, out: str, dtype: str = "fp32", group_size: int = quant.GROUP_SIZE,
            force: bool = False, symmetric: bool = False) -> Manifest:
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if group_size <= 0 or group_size % 2:
        raise ConfigError(f"--group-size must be a positive even number, got {group_size}")
    out = os.path.abspath(os.path.expanduser(out))
    if os.path.exists(out) and os.listdir(out) and not force:
        raise StoreError(f"{out} already exists and is not empty (pass --force to replace it)")
    source, source_name = open_source(src)
    args = ModelArgs.from_hf(source.config)

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
    order = ["embed"]
    for i in range(args.num_hidden_layers):
        order.append(layer_name(i))
        if args.is_moe_layer(i):
            order += [expert_name(i, e) for e in range(args.n_routed_experts)]
    order.append("head")
    missing = [u for u in order if u not in groups]
    if missing:
        raise StoreError(f"{src}: no tensors for {', '.join(missing[:4])} (is the config right for these weights?)")

    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    tmp = f"{out}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        units = []
        fetch = _Fetch(source)
        for name in tqdm(order, desc=f"convert {dtype}", unit="unit", disable=None):
            tensors = {}
            for local, hf_name in sorted(groups[name].items()):
                tensors.update(_encode(name, local, fetch(hf_name), dtype, group_size, symmetric))
            fname = name + ".safetensors"
            path = os.path.join(tmp, fname)
            save_file(tensors, path)
            shard.sync(path)
            units.append(Unit(name=name, file=fname, bytes=os.path.getsize(path), xxh3=shard.file_checksum(path),
                              tensors={k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
                                       for k, v in tensors.items()}))
        has_tok = source.save_tokenizer(os.path.join(tmp, "tokenizer"))
        manifest = Manifest(args=args, dtype=dtype, units=units, group_size=group_size if dtype == "int4" else None,
                            tokenizer="tokenizer" if has_tok else None, source=source_name,
                            extra={"int4_scheme": "sym" if symmetric else "asym"} if dtype == "int4" else {})
        with open(os.path.join(tmp, MANIFEST), "wb") as f:  # written last: a store without it is not a store
            f.write(manifest.to_bytes())
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(out):
            shutil.rmtree(out)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest
