"""The `self-int4` draft built once per target store and kept on disk as an int4pack store.

Building a 4-bit copy of the target in memory on every run costs a dequantized copy of every layer and tens of
seconds; worse, a target converted from a 4-bit GGUF already had 4-bit weights, and re-quantizing its fp32
dequantization at another group size throws them away. So, on CPU with torch's int4 kernel, the draft is
converted once from the target's ORIGINAL source (manifest.source) with the streamed converter, dtype int4pack:

  * a GGUF (the embedded default, or a .gguf path that still exists): group 32, so Q4_0 / Q4_1 / Q4_K tensors
    keep the file's own codes, scales and minimums (quant/ggml.py DIRECT; scale and zero rounded to bf16), and
    other types (Q6_K, Q8_0, F16...) are re-quantized with quantize_asym's search (bf16);
  * a Hugging Face folder that still exists: group 64, re-quantized with the search;
  * otherwise (source moved or deleted, a named part-package model, anything that fails): the target store
    itself, read back unit by unit (convert.StoreSource), group 32 if it came from a GGUF, else 64.

A tied model's embedding is also written into the draft's head unit as a 4-bit `lm_head.weight`. The draft's
embedding lookups use the target's own table (exact), not the draft store's fp16 copy.

Where: $STREAMSPEC_HOME/drafts/self-int4-<store name>-<key>, else beside the store as
.<store name>.self-int4-<key>; key = a hash of the target's manifest file (so a changed store gets a new draft),
the kernel's packing layout and RECIPE. The build writes a .partial folder and renames it (convert), under a
lock file so two processes do not build the same draft at once. Loading reads it like any int4pack store (the
weights stay packed, every shard checksummed); a draft that fails to load is rebuilt once. When no folder is
writable, or building fails twice, `load_or_build` returns None and the caller builds the draft in memory.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import tempfile

import torch

from ..errors import STATUS, StreamspecError
from ..store.manifest import MANIFEST
from ..store.store import LayerStore

log = logging.getLogger("streamspec")

RECIPE = "1"  # bump when the build changes: drafts built by an older recipe are then not used


def draft_key(store: LayerStore) -> str:
    from ..store.ggml_int4 import layout_tag

    with open(os.path.join(store.root, MANIFEST), "rb") as f:
        h = hashlib.sha1(f.read())
    h.update(f"\0self-int4 recipe {RECIPE}\0{layout_tag()}".encode())
    return h.hexdigest()[:12]


def candidates(store: LayerStore, key: str) -> list[str]:
    """Where the draft may live, in order of preference."""
    from ..store.default import home

    base = os.path.basename(store.root.rstrip(os.sep)) or "store"
    return [os.path.join(home(), "drafts", f"self-int4-{base}-{key}"),
            os.path.join(os.path.dirname(store.root.rstrip(os.sep)), f".{base}.self-int4-{key}")]


def _writable(folder: str) -> bool:
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
        return True
    except OSError:
        return False


def gguf_origin(source: str) -> bool:
    """Did the store come from a GGUF (the default model, a .gguf file, a named real model)?"""
    from ..store import sources

    return source.startswith("default:") or source.endswith(".gguf") or source in sources.NAMED


def group_size_for(source: str) -> int:
    """32 for a store converted from a GGUF (its 4-bit blocks are groups of 32), 64 for 16/32-bit sources."""
    return 32 if gguf_origin(source) else 64


def _open_original(store: LayerStore):
    """-> (source, source name, group size, None) for the store's original source, or (None, None, None, why
    not)."""
    from ..store.convert import open_source
    from ..store import sources

    src = store.manifest.source or ""
    if src.startswith("default:"):
        from ..store.sources import default_gguf
        try:
            gguf = default_gguf()
        except StreamspecError as e:
            return None, None, None, str(e)
        if os.path.basename(gguf) != src[len("default:"):]:
            return None, None, None, f"the embedded model is now {os.path.basename(gguf)}, the store's is {src}"
        return *open_source("default"), 32, None
    if src in sources.NAMED:
        return None, None, None, f"{src} is kept as part packages (not assembled again for a draft)"
    if not os.path.isabs(src) or not os.path.exists(src):
        return None, None, None, f"its source {src or '(none recorded)'} is not there any more"
    if src.endswith(".gguf") and os.path.isfile(src):
        return *open_source(src), 32, None
    if os.path.isdir(src) and os.path.exists(os.path.join(src, "config.json")):
        return *open_source(src), 64, None
    return None, None, None, f"its source {src} is not a .gguf file or a model folder"


def _changed(source, store: LayerStore) -> str | None:
    """None if `source` still holds the store's model (the same configuration, the same layer-0 norm weights),
    else what differs."""
    from ..config import ModelArgs

    if ModelArgs.from_hf(source.config).to_dict() != store.args.to_dict():
        return "its source's configuration differs from the store's"
    name, local = "model.layers.0.input_layernorm.weight", "input_layernorm.weight"
    units = store.manifest.layer_units
    if not units or local not in units[0].tensors or name not in source.names():
        return None
    theirs = store.read(units[0].name).tensors[local]
    if not torch.equal(source.get(name).to(theirs.dtype), theirs):
        return "its source's weights differ from the store's (changed since the store was converted)"
    return None


def source_for(store: LayerStore):
    """-> (source, source name, group size) to build the draft from: the original source when it is still
    there and still the store's model, else the store itself (convert.StoreSource)."""
    from ..store.convert import StoreSource

    try:
        source, name, group, why = _open_original(store)
        if source is not None:
            why = _changed(source, store)
            if why is None:
                return source, name, group
    except Exception as e:  # an unreadable source is one more reason to read the store instead
        why = f"its source cannot be read ({type(e).__name__}: {e})"
    log.info("self-int4 draft: %s; building it from the store itself", why, extra=STATUS)
    return StoreSource(store), f"store:{store.root}", group_size_for(store.manifest.source or "")


@contextlib.contextmanager
def _lock(path: str):
    import fcntl

    with open(path + ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build(store: LayerStore, path: str, key: str) -> None:
    """Convert the draft into `path` (replacing whatever is there)."""
    from ..store.convert import StoreSource, _convert

    # said before the source is opened: opening a GGUF takes seconds, which would otherwise pass in silence
    log.info("building the self-int4 draft (first use, kept at %s)", path, extra=STATUS)
    source, name, group = source_for(store)
    log.info("self-int4 draft: from %s, int4pack group %d", name, group, extra=STATUS)
    opts = dict(search=True, head_copy=True, desc="self-int4 draft", extra={"self_int4_of": key}, tokenizer=False)
    try:
        _convert(source, name, path, "int4pack", group, False, **opts)
    except Exception as e:
        if isinstance(source, StoreSource):
            raise
        log.warning("self-int4 draft: building from %s failed (%s: %s); building it from the store itself",
                    name, type(e).__name__, e)
        group = group_size_for(store.manifest.source or "")
        _convert(StoreSource(store), f"store:{store.root}", path, "int4pack", group, False, **opts)


def load_or_build(store: LayerStore, load):
    """The draft from its folder (`load(path)` -> a Draft), building it first if needed; None when it cannot be
    kept on disk (nothing writable) or built (then the caller builds it in memory)."""
    key = draft_key(store)
    places = candidates(store, key)
    path = next((p for p in places if os.path.exists(os.path.join(p, MANIFEST))), None)
    if path is None:
        path = next((p for p in places if _writable(os.path.dirname(p))), None)
        if path is None:
            log.warning("self-int4 draft: no writable folder to keep it in (%s); building it in memory "
                        "(set STREAMSPEC_HOME to a writable folder to build it once)", " or ".join(
                            os.path.dirname(p) for p in places))
            return None
    for attempt in range(2):
        try:
            if not os.path.exists(os.path.join(path, MANIFEST)):
                with _lock(path):
                    if not os.path.exists(os.path.join(path, MANIFEST)):  # (another process may have built it)
                        build(store, path, key)
            return load(path)
        except Exception as e:  # whatever fails, the in-memory build still gives a draft
            debug = log.isEnabledFor(logging.DEBUG)
            if attempt == 0 and os.path.exists(os.path.join(path, MANIFEST)):
                log.warning("self-int4 draft at %s is unusable (%s: %s); rebuilding it", path, type(e).__name__, e,
                            exc_info=debug)
                try:
                    with _lock(path):
                        shutil.rmtree(path)
                    continue
                except OSError as e2:
                    e = e2
            log.warning("self-int4 draft: cannot keep it at %s (%s: %s); building it in memory", path,
                        type(e).__name__, e, exc_info=debug)
            return None
    return None
