"""The model families, one module each (llama.py, gemma.py, deepseek.py), and which one runs a model: family_of.

A new family is one module exporting FAMILY (models/family.py), its model types in config.py, and a line below."""
from __future__ import annotations

from ..config import DEEPSEEK_FAMILY, GEMMA_FAMILY, LLAMA_FAMILY, ModelArgs
from . import deepseek, gemma, llama
from .family import Family

# model_type -> the family that runs it
FAMILIES: dict[str, Family] = {
    **dict.fromkeys(LLAMA_FAMILY, llama.FAMILY),
    **dict.fromkeys(GEMMA_FAMILY, gemma.FAMILY),
    **dict.fromkeys(DEEPSEEK_FAMILY, deepseek.FAMILY),
}


def family_of(args: ModelArgs) -> Family:
    return FAMILIES[args.model_type]
