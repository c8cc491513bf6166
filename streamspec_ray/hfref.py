"""Rebuild a Hugging Face transformers model from a layer store: the in-memory reference point for
benchmarks and tests ("transformers' plain generate on the same weights")."""
from __future__ import annotations

import torch

from .models import family_of
from .runtime.weights import materialize
from .store.store import LayerStore


def hf_config(store: LayerStore):
    from transformers import AutoConfig

    a = store.args
    rope = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.rope_scaling:
        rope.update(a.rope_scaling)
    return AutoConfig.for_model(
        a.model_type, vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
        num_hidden_layers=a.num_hidden_layers, num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads, head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps,
        max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=a.tie_word_embeddings,
        attention_bias=a.attention_bias, mlp_bias=a.mlp_bias,
        bos_token_id=a.bos_token_id, eos_token_id=a.eos_token_id or None,
        **family_of(a).hf_config(a, rope))  # (rope_parameters, and a family's own fields)


@torch.no_grad()
def hf_model(store: LayerStore, dtype=torch.float32):
    """A transformers CausalLM holding exactly the store's weights (INT4 dequantized), in memory."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(hf_config(store), dtype=dtype).eval()
    state = {}
    gs = store.manifest.group_size or 64
    for u in store.manifest.units:
        w = materialize(store.read(u.name).tensors, dtype, "cpu", gs)
        for k, t in w.items():
            if not isinstance(t, torch.Tensor):  # a gguf store's head (weights.GGMLMatrix): whole, in memory
                t = t.rows_of(0, t.shape[0])
            if u.name == "embed":
                state["model.embed_tokens.weight"] = t
            elif u.name == "head":
                state["model.norm.weight" if k == "norm.weight" else "lm_head.weight"] = t
            else:
                state[f"model.layers.{int(u.name.split('.')[1])}.{k}"] = t
    if store.args.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise RuntimeError(f"store -> transformers mismatch: missing {missing[:3]}, unexpected {unexpected[:3]}")
    return model
