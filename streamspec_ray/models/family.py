"""Family: what the engine needs to know of a model family, in one object per family module.

llama.py, gemma.py and deepseek.py each export FAMILY; models/__init__.py maps a ModelArgs' model_type to it
(family_of). The executor, the drafts and hfref.py ask the family for what differs between architectures instead
of testing which one they run: the cache a sequence keeps, the rope state and the forward over a sweep's units,
how a resident draft's weights are prepared, and whether routed experts live in units of their own.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


def _as_read(w: dict) -> dict:
    return w


def _hf_rope(args, rope: dict) -> dict:
    return {"rope_parameters": rope}


@dataclass(frozen=True)
class Family:
    name: str
    # (args, layers, dtype, device) -> an empty cache of `layers` layers (runtime.kvcache.KVCache, LatentCache)
    new_cache: Callable
    # (args, device) -> the position state forward takes: inv_freq [hd / 2] fp32, or deepseek.RopeState
    rope: Callable
    # (args, embed, rope, units, ids [T], cache, positions=, mask=, logits_from=, experts=, on_hidden=, hidden=)
    #   -> logits [T - logits_from, vocab] fp32: a chunk through every unit (decoder layers, then "head"). A
    #   pipeline stage's units are a range of layers: it takes hidden [T, hidden] from the stage before (not ids'
    #   embedding), and without "head" returns its hidden states (layers.forward)
    forward: Callable
    # (args, embed, rope, units, chunks: [layers.Chunk], experts=, hidden=) -> logits per chunk: a ragged batch
    #   (a stage without the head: the batch's hidden states [sum T, hidden])
    forward_batch: Callable
    # (w) -> a resident draft unit's weights as its layer code runs them best (the Llama family's: llama.fuse)
    prepare: Callable = _as_read
    # MoE: (units) -> (an ExpertProvider over the routed experts' units "expert.LLL.EEE", held in memory, and the
    # other units). None: no routed experts
    resident_experts: Callable | None = None
    # (args, rope parameters) -> this family's fields of a transformers config beyond the common ones (hfref.py)
    hf_config: Callable = _hf_rope

    @property
    def moe(self) -> bool:
        """Routed experts in units of their own: a sweep reads those it routes to (runtime/experts.py)."""
        return self.resident_experts is not None

    def __repr__(self) -> str:
        return f"Family({self.name!r})"
