"""ModelArgs: the flat architecture description every layer function reads.

Built from a Hugging Face `config.json` dict (or the GGUF-derived config transformers produces) and
stored inside a layer store's manifest, so a store is self-describing.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

# model_type -> family implemented in streamspec_ray.models
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "smollm2", "smollm3")
SUPPORTED = LLAMA_FAMILY


@dataclass
class ModelArgs:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0                      # derived from hidden / heads when 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None       # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False           # Qwen2: q/k/v biases
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    hidden_act: str = "silu"

    def __post_init__(self):
        if self.model_type not in SUPPORTED:
            raise ConfigError(f"unknown architecture {self.model_type!r} (supported: {', '.join(SUPPORTED)})")
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act != "silu":
            raise ConfigError(f"unsupported activation {self.hidden_act!r}")
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelArgs":
        model_type = cfg.get("model_type", "")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type in (None, "default") else {k: v for k, v in rope.items() if k != "rope_theta"}
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in cfg.items() if k in names and v is not None}
        kw.update(model_type=model_type, rope_theta=float(rope_theta), rope_scaling=scaling)
        kw.setdefault("attention_bias", model_type == "qwen2")
        if model_type == "qwen2":
            kw["attention_bias"] = True
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in kw:
                raise ConfigError(f"config has no {key!r}")
        kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelArgs":
        return cls(**d)
