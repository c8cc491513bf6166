"""The store manifest: a msgpack file that makes a store self-describing and verifiable.

    manifest.msgpack = {
      "format": "streamspec-store", "version": 1,
      "args": ModelArgs dict, "dtype": "fp32|bf16|fp16|int4|int4pack|gguf", "group_size": 64 | None,
      "tokenizer": "tokenizer" | None,          # folder inside the store
      "source": str,
      "units": [{"name": "embed" | "layer.000" | ... | "head", "file": "...", "bytes": int, "xxh3": hex,
                 "tensors": {local_name: {"dtype": str, "shape": [...]}}}, ...],
    }
A unit is one streaming unit: the embeddings, one decoder layer, or the final norm + head.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import msgpack

from ..config import ModelArgs
from ..errors import StoreError

MANIFEST = "manifest.msgpack"
FORMAT = "streamspec-store"
VERSION = 1


def layer_name(i: int) -> str:
    return f"layer.{i:03d}"


@dataclass
class Unit:
    name: str
    file: str
    bytes: int
    xxh3: str
    tensors: dict[str, dict]
    block_xxh3: list[str] = field(default_factory=list)  # per 256 KiB block, for units read in part (embed rows)

    def numel(self, tensor: str) -> int:
        n = 1
        for d in self.tensors[tensor]["shape"]:
            n *= d
        return n


@dataclass
class Manifest:
    args: ModelArgs
    dtype: str
    units: list[Unit]
    group_size: int | None = None
    tokenizer: str | None = None
    source: str = ""
    extra: dict = field(default_factory=dict)

    def unit(self, name: str) -> Unit:
        for u in self.units:
            if u.name == name:
                return u
        raise StoreError(f"store has no unit {name!r}")

    @property
    def layer_units(self) -> list[Unit]:
        return [u for u in self.units if u.name.startswith("layer.")]

    def to_bytes(self) -> bytes:
        return msgpack.packb({
            "format": FORMAT, "version": VERSION, "args": self.args.to_dict(), "dtype": self.dtype,
            "group_size": self.group_size, "tokenizer": self.tokenizer, "source": self.source, "extra": self.extra,
            "units": [u.__dict__ for u in self.units],
        })

    @classmethod
    def load(cls, root: str) -> "Manifest":
        path = os.path.join(root, MANIFEST)
        if os.path.isfile(root):
            raise StoreError(f"{root} is a file, not a store folder (a .gguf file or a Hugging Face folder can be "
                             f"converted with `streamspec convert SRC OUT`, or given as --target / --draft)")
        if not os.path.isdir(root):
            raise StoreError(f"no store at {root}: folder does not exist")
        if not os.path.exists(path):
            raise StoreError(f"no manifest in {root}: not a streamspec store (convert a model with `streamspec convert`)")
        try:
            with open(path, "rb") as f:
                d = msgpack.unpackb(f.read())
        except Exception as e:  # msgpack raises several unrelated types for bad bytes
            raise StoreError(f"manifest unreadable: {path} ({e})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise StoreError(f"not a streamspec manifest: {path}")
        if d.get("version") != VERSION:
            raise StoreError(f"store version {d.get('version')} is not supported (expected {VERSION}): {path}")
        args = ModelArgs.from_dict(d["args"])  # raises ConfigError for an unknown architecture
        return cls(args=args, dtype=d["dtype"], group_size=d.get("group_size"), tokenizer=d.get("tokenizer"),
                   source=d.get("source", ""), extra=d.get("extra") or {}, units=[Unit(**u) for u in d["units"]])
