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
DEEPSEEK_FAMILY = ("deepseek_v2", "deepseek_v3")  # MLA attention + routed experts (models/deepseek.py)
SUPPORTED = LLAMA_FAMILY + DEEPSEEK_FAMILY
TOPK_METHODS = {"deepseek_v2": ("greedy", "group_limited_greedy"), "deepseek_v3": ("noaux_tc",)}


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
    # DeepSeek V2/V3 (MLA + MoE); unused by the Llama family
    q_lora_rank: int | None = None         # None: a plain q_proj
    kv_lora_rank: int = 0                  # latent c_kv width: what the cache holds per token (+ rope key)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False          # rope dims in interleaved pairs (V2 always, V3 by default)
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = ""                  # V2: greedy | group_limited_greedy; V3: noaux_tc
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0

    @property
    def is_deepseek(self) -> bool:
        return self.model_type in DEEPSEEK_FAMILY

    def is_moe_layer(self, i: int) -> bool:
        return self.is_deepseek and self.n_routed_experts > 0 and i >= self.first_k_dense_replace

    def _check_deepseek(self) -> None:
        if self.kv_lora_rank <= 0 or self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise ConfigError("DeepSeek config needs kv_lora_rank > 0 and an even qk_rope_head_dim > 0")
        if self.n_routed_experts <= 0:
            return
        methods = TOPK_METHODS[self.model_type]
        if self.topk_method not in methods:
            raise ConfigError(f"unknown topk_method {self.topk_method!r} for {self.model_type} "
                              f"(supported: {', '.join(methods)})")
        E, G, k = self.n_routed_experts, self.n_group, self.num_experts_per_tok
        if not 0 < k <= E:
            raise ConfigError(f"num_experts_per_tok must be in 1..n_routed_experts ({E}), got {k}")
        grouped = self.topk_method in ("noaux_tc", "group_limited_greedy")
        if grouped:
            if G <= 0 or E % G:
                raise ConfigError(f"n_routed_experts ({E}) must be a multiple of n_group ({G})")
            if not 0 < self.topk_group <= G:
                raise ConfigError(f"topk_group ({self.topk_group}) must be in 1..n_group ({G})")
            if self.topk_group * (E // G) < k:
                raise ConfigError(f"topk_group * (n_routed_experts / n_group) = {self.topk_group} * {E // G} "
                                  f"< num_experts_per_tok ({k}): too few experts to choose from")
            if self.topk_method == "noaux_tc" and E // G < 2:
                raise ConfigError(f"noaux_tc routing scores groups by their top-2 experts: n_routed_experts / "
                                  f"n_group must be >= 2, got {E // G}")

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
        if self.is_deepseek:
            self._check_deepseek()

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
        if model_type in DEEPSEEK_FAMILY:
            # V2's rope is complex multiplication on adjacent pairs, i.e. always interleaved; V3 defaults to it
            kw["rope_interleave"] = True if model_type == "deepseek_v2" else cfg.get("rope_interleave", True) is not False
            if model_type == "deepseek_v3":
                kw.setdefault("topk_method", "noaux_tc")
            else:
                kw.setdefault("topk_method", "greedy")
            kw.setdefault("n_group", 1)
            kw.setdefault("topk_group", kw["n_group"])
            if kw["topk_method"] == "greedy":
                kw["n_group"] = kw["topk_group"] = 1  # (ignored by greedy routing)
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelArgs":
        return cls(**d)
