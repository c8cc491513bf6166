"""ModelArgs: the flat architecture description every layer function reads.

Built from a Hugging Face `config.json` dict (or the GGUF-derived config transformers produces) and
stored inside a layer store's manifest, so a store is self-describing.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

# model_type -> family implemented in streamspec_ray.models
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "smollm2", "smollm3")
DEEPSEEK_FAMILY = ("deepseek_v2", "deepseek_v3")  # MLA attention + routed experts (models/deepseek.py)
GEMMA_FAMILY = ("gemma3_text",)  # sliding-window + global attention, QK-norm, GeGLU (models/gemma.py)
SUPPORTED = LLAMA_FAMILY + DEEPSEEK_FAMILY + GEMMA_FAMILY
ACTIVATIONS = {"silu": LLAMA_FAMILY + DEEPSEEK_FAMILY, "gelu_pytorch_tanh": GEMMA_FAMILY}
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
    # Gemma 3; unused by the other families
    layer_types: list[str] = field(default_factory=list)  # per layer: full_attention | sliding_attention
    sliding_window: int = 0                # a sliding layer's query sees keys at positions q - window < k <= q
    rope_local_theta: float = 0.0          # sliding layers' rope base (global layers: rope_theta, rope_scaling)
    query_pre_attn_scalar: float = 0.0     # attention scale query_pre_attn_scalar ** -0.5 (0: head_dim's)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
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
    num_nextn_predict_layers: int = 0      # V3's multi-token-prediction layers (after the decoder): the mtp draft

    @property
    def is_deepseek(self) -> bool:
        return self.model_type in DEEPSEEK_FAMILY

    @property
    def is_gemma(self) -> bool:
        return self.model_type in GEMMA_FAMILY

    def is_sliding(self, i: int) -> bool:
        return bool(self.layer_types) and self.layer_types[i] == "sliding_attention"

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
        if self.model_type not in ACTIVATIONS.get(self.hidden_act, ()):
            raise ConfigError(f"unsupported activation {self.hidden_act!r} for {self.model_type}")
        if self.layer_types:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ConfigError(f"layer_types lists {len(self.layer_types)} layers, the model has "
                                  f"{self.num_hidden_layers}")
            odd = set(self.layer_types) - {"full_attention", "sliding_attention"}
            if odd:
                raise ConfigError(f"unsupported layer types {sorted(odd)} (supported: full_attention, "
                                  f"sliding_attention)")
            if "sliding_attention" in self.layer_types and self.sliding_window <= 0:
                raise ConfigError("sliding_attention layers need sliding_window > 0")
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        if self.is_deepseek:
            self._check_deepseek()

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelArgs":
        model_type = cfg.get("model_type", "")
        if model_type in GEMMA_FAMILY:
            cfg = _gemma_config(cfg)
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


def _gemma_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's config in the flat form: transformers 5 gives rope parameters per layer type
    ({"full_attention": {...}, "sliding_attention": {...}}); older configs give rope_theta, rope_scaling and
    rope_local_base_freq, and a sliding_window_pattern instead of layer_types."""
    cfg = dict(cfg)
    if cfg.get("attn_logit_softcapping") is not None:
        raise ConfigError("attention logit soft-capping (Gemma 2) is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ConfigError("bidirectional attention (an encoder's) is not supported")
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope:
        full, local = rope["full_attention"] or {}, rope.get("sliding_attention") or {}
        cfg["rope_parameters"] = full
        cfg["rope_local_theta"] = local.get("rope_theta", 10000.0)
        if local.get("rope_type", "default") != "default":
            raise ConfigError(f"unsupported rope scaling {local['rope_type']!r} on sliding layers")
    else:
        cfg["rope_local_theta"] = cfg.get("rope_local_base_freq", 10000.0)
    if not cfg.get("layer_types"):
        n, every = cfg["num_hidden_layers"], cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern", 6)
        cfg["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    cfg["hidden_act"] = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    cfg.setdefault("query_pre_attn_scalar", cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    return cfg


def home() -> str:
    """$STREAMSPEC_HOME, or ~/.cache/streamspec where it is unset or empty (an empty one would otherwise put
    stores under whatever folder the command runs in): stores, drafts and compiled kernels live under it."""
    return os.path.expanduser(os.environ.get("STREAMSPEC_HOME") or "~/.cache/streamspec")
