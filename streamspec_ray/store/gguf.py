"""A GGUF file as a conversion source, read one tensor (or a few rows of one) at a time.

transformers' GGUF loader dequantizes the whole model into memory first (a 7B GGUF would need ~30 GB). Here
the file's header is parsed with gguf-py's GGUFReader (a memory map, of which only the header pages are
touched; its arrays read in bulk, see _fast_reader), and each tensor's bytes are read with pread when the
converter asks for them, dequantized with gguf-py's own numpy kernels (the functions transformers uses, so the
weights are bit for bit the reference's) and, for large tensors, a slab of rows at a time. Config, tensor names
and the per-architecture fix-ups (Llama's q/k row permutation) come from transformers' GGUF utilities, so the
store holds exactly what `AutoModelForCausalLM.from_pretrained(..., gguf_file=...)` would.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
from typing import NamedTuple

import numpy as np
import torch

from ..errors import StoreError

log = logging.getLogger("streamspec")

# The block types this converter reads (the ones llama.cpp's common k-quant and legacy files use). Anything else
# (IQ*, Q2_K, Q3_K, TQ*, MXFP4...) is refused before any work, with the type and the tensor named.
SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


class _Tensor(NamedTuple):
    gguf_name: str
    qtype: object       # gguf.GGMLQuantizationType
    offset: int         # absolute, in the file
    row_items: int      # items per row as stored (bytes for block types)
    item: np.dtype
    shape: tuple        # [out, in] (HF order)


class GGUFSource:
    """names() / shape(name) / rows(name, r0, r1) / get(name) over a GGUF file, in HF tensor names."""

    def __init__(self, path: str):
        from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                              get_gguf_hf_weights_map)

        if not os.path.exists(path):
            raise StoreError(f"GGUF file not found: {path}")
        self.path = os.path.abspath(path)
        try:  # (bad magic, a truncated file, counts or lengths past its end, unknown type codes or architecture)
            reader = _fast_reader()(self.path)
            parsed = _checkpoint_config(self.path, reader)
            arch = str(reader.fields["general.architecture"].contents())
            layers, tensors = parsed["config"].get("num_hidden_layers", 0), len(reader.tensors)
            if not 0 <= layers <= tensors:  # (a model of 2**40 layers would be built, on the meta device, next)
                raise ValueError(f"it says {layers} layers but holds {tensors} tensors")
        except OSError:
            raise
        except Exception as e:  # whatever a malformed header makes gguf-py or transformers raise: one line
            why = " ".join(str(e).split()) or type(e).__name__
            raise StoreError(f"cannot read {path} as GGUF: {why}") from None
        self.config = dict(parsed["config"])
        self.config.pop("quantization_config", None)
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=self.config)
        self._parsed = {"config": parsed["config"]}  # (the tokenizer's 150k-entry lists are not kept)
        with _name_maps_once():
            gguf_to_hf = get_gguf_hf_weights_map(_meta_model(self.config), self.processor)
        self.tensors = {}  # hf name -> _Tensor (the reader's parsed header is let go: it is large)
        bad = []
        for t in reader.tensors:
            if t.name not in gguf_to_hf:
                continue
            if t.tensor_type.name not in SUPPORTED:
                bad.append(f"{t.name} is {t.tensor_type.name}")
            rows = t.data.reshape(-1, t.data.shape[-1]) if t.data.ndim > 1 else t.data.reshape(1, -1)
            self.tensors[gguf_to_hf[t.name]] = _Tensor(t.name, t.tensor_type, int(t.data_offset), rows.shape[1],
                                                       rows.dtype, tuple(int(d) for d in reversed(t.shape)))
        del reader, parsed
        if bad:
            raise StoreError(f"{path}: unsupported GGUF tensor type ({'; '.join(bad[:3])}); "
                             f"supported: {', '.join(SUPPORTED)}")
        self._fd = os.open(self.path, os.O_RDONLY)

    def __del__(self):
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)

    def names(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return torch.float32  # every type is dequantized to fp32

    def qtype(self, name: str) -> str:
        return self.tensors[name].qtype.name

    def raw_rows(self, name: str, r0: int, r1: int) -> np.ndarray:
        """Rows r0..r1 of the tensor as stored: [r1 - r0, bytes per row] uint8 (or the plain dtype's items)."""
        t = self.tensors[name]
        row_bytes = t.row_items * t.item.itemsize
        buf = np.empty((r1 - r0) * row_bytes, dtype=np.uint8)
        start = t.offset + r0 * row_bytes
        view, done = memoryview(buf), 0
        while done < buf.size:
            n = os.preadv(self._fd, [view[done:]], start + done)
            if n == 0:
                raise StoreError(f"{self.path} is truncated (tensor {t.gguf_name} ends past the end of the file)")
            done += n
        return buf.view(t.item).reshape(r1 - r0, t.row_items)

    def rows(self, name: str, r0: int, r1: int) -> torch.Tensor:
        """Rows r0..r1 of a 2-D tensor, dequantized to fp32 as transformers does: [r1 - r0, in]."""
        from gguf import dequantize

        t = self.tensors[name]
        shape = t.shape
        if len(shape) == 1:
            r0, r1 = 0, 1  # a vector is one row
        w = dequantize(self.raw_rows(name, r0, r1), t.qtype)
        if len(shape) == 1 or (r0, r1) == (0, shape[0]):  # fix-ups (q/k permutation) act on whole tensors
            w = self.processor.process(weights=w.reshape(shape), name=t.gguf_name, tensor_key_mapping={},
                                       parsed_parameters=self._parsed).weights
            return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(shape)
        if self.needs_whole(name):
            raise ValueError(f"{name} must be read whole")
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(r1 - r0, *shape[1:])

    def needs_whole(self, name: str) -> bool:
        """The architecture's fix-ups rewrite some tensors across rows (Llama's q/k permutation)."""
        gguf_name = self.tensors[name].gguf_name
        return type(self.processor).__name__ != "TensorProcessor" and (".attn_q." in gguf_name or ".attn_k." in gguf_name)

    def get(self, name: str) -> torch.Tensor:
        return self.rows(name, 0, self.shape(name)[0])  # (a vector: read whole too)

    def row_permutation(self, name: str) -> np.ndarray | None:
        """For a 2-D tensor whose fix-ups only reorder its rows (Llama's q/k permutation): the file's row of
        each row of the result, so the raw blocks can be kept and reordered (int4pack keeps 4-bit codes that
        way). None when the fix-ups do anything else (or nothing)."""
        t = self.tensors[name]
        if len(t.shape) != 2 or not self.needs_whole(name):
            return None
        n = t.shape[0]
        probe = np.arange(n, dtype=np.float64).reshape(n, 1)
        try:
            out = self.processor.process(weights=probe, name=t.gguf_name, tensor_key_mapping={},
                                         parsed_parameters=self._parsed).weights
        except Exception:  # a fix-up that needs the real tensor's shape is not a plain reordering
            return None
        out = np.asarray(out).reshape(-1)
        if out.shape != (n,) or not np.array_equal(np.sort(out), np.arange(n)):
            return None
        return out.astype(np.int64)

    def save_tokenizer(self, out: str) -> bool:
        """transformers' tokenizer from the GGUF (what `AutoTokenizer.from_pretrained(gguf_file=...)` gives),
        its header parsed by _fast_reader: transformers parses the file twice here, and gguf-py's own reader took
        12.2 s per parse of Gemma 3's 262k-token vocabulary on this 2-core VM."""
        from transformers import AutoTokenizer

        folder, file = os.path.split(self.path)
        with _gguf_swapped("GGUFReader", _fast_reader()):
            try:
                tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
            except Exception as e:  # a GGUF without a usable tokenizer still converts; prompts then need ids
                log.warning("no tokenizer from %s (%s); the store will take --prompt-ids only", self.path, e)
                return False
        tok.save_pretrained(out)
        return True


_PATCH_LOCK = threading.Lock()  # (held while an attribute of the gguf module is swapped, see _gguf_swapped)


@contextlib.contextmanager
def _gguf_swapped(name: str, value):
    """gguf-py's module attribute `name` is `value` inside the block (for transformers' GGUF code, which looks
    it up at call time), one swap at a time, and what it was after."""
    import gguf

    with _PATCH_LOCK:
        orig = getattr(gguf, name)
        setattr(gguf, name, value)
        try:
            yield orig
        finally:
            setattr(gguf, name, orig)


@functools.cache
def _fast_reader():
    """gguf-py's GGUFReader, the same fields and tensors, parsed 25x faster: it reads every array item (each of
    a vocabulary's tokens, scores and types) through its generic path, each read a numpy.memmap slice whose
    __array_finalize__ dominates: 12.2 s for Gemma 3's 262k-token vocabulary on this 2-core VM, 0.44 s here.
    Arrays of scalars are read as one array and arrays of strings by a loop over plain-ndarray slices; the parts
    and data indices are the ones GGUFReader builds (tests/test_gguf.py compares every field)."""
    import gguf

    class FastReader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:  # (a plain ndarray over the same map: its slices skip memmap's bookkeeping)
                plain = self._plain = self.data.view(np.ndarray)
            dt, count, offset = np.dtype(dtype), int(count), int(offset)
            _fits(offset, dt.itemsize * count, plain.size, "a header field")  # (every read: none past the end)
            arr = plain[offset: offset + dt.itemsize * count].view(dt)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _build_fields(self, offs, count):
            _fits(offs, int(count) * 13, self.data.size, f"{int(count)} key-value pairs")  # (key, type, value)
            return super()._build_fields(offs, count)

        def _build_tensor_info(self, offs, count):
            _fits(offs, int(count) * 24, self.data.size, f"{int(count)} tensor entries")  # (name, dims, type, offset)
            return super()._build_tensor_info(offs, count)

        def _build_tensors(self, start_offs, fields):
            for field in fields:  # (each tensor's bytes inside the file, before gguf-py maps them)
                _, name, _, dims, raw_type, offset = field.parts
                name = bytes(name).decode(errors="replace")
                try:
                    block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(raw_type[0]))]
                except (ValueError, KeyError):
                    raise ValueError(f"tensor {name} has the unknown type code {int(raw_type[0])}") from None
                nbytes = math.prod(int(d) for d in dims) * type_size // block
                _fits(start_offs + int(offset[0]), nbytes, self.data.size, f"the data of tensor {name}")
            super()._build_tensors(start_offs, fields)

        def _get_field_parts(self, orig_offs, raw_type):
            try:
                gtype = gguf.GGUFValueType(int(raw_type))
            except ValueError:
                raise ValueError(f"unknown value type {int(raw_type)} at byte {orig_offs}") from None
            if gtype != gguf.GGUFValueType.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
            itype, n, offs = gguf.GGUFValueType(raw_itype[0]), int(alen[0]), orig_offs + 12
            types, parts = [gguf.GGUFValueType.ARRAY, itype], [raw_itype, alen]
            nptype = self.gguf_scalar_to_np.get(itype)
            least = np.dtype(nptype).itemsize if nptype is not None else 8 if itype == gguf.GGUFValueType.STRING else 12
            _fits(offs, n * least, self.data.size, f"an array of {n} items")  # (before any loop over them)
            if nptype is not None and n > 0:  # n items, each its own 1-item part
                vals = self._get(offs, nptype, n)
                return 12 + int(vals.nbytes), parts + [vals[i:i + 1] for i in range(n)], list(range(2, 2 + n)), types
            if itype == gguf.GGUFValueType.STRING and n > 0 and self.byte_order == "I":  # [length, bytes] per item
                plain, u64 = self._plain, np.dtype(np.uint64)
                for _ in range(n):  # (bounds checked here, not through _get: this runs once per vocabulary entry)
                    if offs + 8 > plain.size:
                        _fits(offs, 8, plain.size, "a string's length")
                    slen = plain[offs: offs + 8].view(u64)
                    end = offs + 8 + int(slen[0])
                    if end > plain.size:
                        _fits(offs + 8, int(slen[0]), plain.size, "a string")
                    parts += [slen, plain[offs + 8: end]]
                    offs = end
                return offs - orig_offs, parts, list(range(3, 2 + 2 * n, 2)), types
            return super()._get_field_parts(orig_offs, raw_type)  # (nested arrays, empty ones, swapped bytes)

    return FastReader


def _fits(offset: int, nbytes: int, size: int, what: str) -> None:
    """ValueError unless `nbytes` bytes from `offset` lie inside a file of `size` bytes: a count or length read
    from a corrupt or truncated header is bounded by the file before anything is allocated or looped over."""
    if nbytes < 0 or offset + nbytes > size:
        raise ValueError(f"truncated or corrupt: {what} at byte {offset} needs {nbytes} bytes, the file has "
                         f"{max(size - offset, 0)} left")


def _checkpoint_config(path: str, reader) -> dict:
    """transformers' load_gguf_checkpoint (config only) on the header `reader` already parsed, minus the
    tokenizer's arrays (its vocabulary, scores, types and merges): it would parse the file a second time and turn every vocabulary entry into Python
    values (26 s of the 30 s that opening Gemma 3 270M's 262k-entry vocabulary took on this 2-core VM, 12 s
    after). The vocabulary size then comes from the embedding's rows, what the model computes with."""
    import copy

    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    light = copy.copy(reader)  # (the tokenizer's arrays left out; its scalars, bos / eos / pad ids, kept)
    light.fields = {k: v for k, v in reader.fields.items() if not (k.startswith("tokenizer.") and len(v.data) > 1)}
    quiet = logging.getLogger("transformers.modeling_gguf_pytorch_utils")  # (its "no vocab_size" warning)
    with _gguf_swapped("GGUFReader", lambda *a, **kw: light):
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        try:
            parsed = load_gguf_checkpoint(path, return_tensors=False)
        finally:
            quiet.setLevel(level)
    if "vocab_size" not in parsed["config"]:
        embed = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embed is not None:
            parsed["config"]["vocab_size"] = int(embed.shape[-1])  # (gguf lists dims fastest first: [hidden, vocab])
    return parsed


@contextlib.contextmanager
def _name_maps_once():
    """transformers' get_gguf_hf_weights_map builds gguf-py's TensorNameMap (arch, layers) again in every
    submodule it recurses into (~400 times for SmolLM2's 30 layers: 8.5 of the 15 s it took to open the file on
    this 2-core VM); the map depends only on its arguments, so while it runs each one is built once."""
    import gguf

    with _gguf_swapped("get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)):
        yield


def _meta_model(config: dict):
    """The HF model for this config on the meta device (no memory): only its parameter names are used."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    cfg_obj = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg_obj)


# general.file_type values (llama.cpp's llama_ftype) of files whose weights are mostly 4-bit blocks: Q4_0, Q4_1,
# Q4_K_S, Q4_K_M. Such a file's default store is int4pack (store/sources.default_dtype).
MOSTLY_4BIT = {2: "Q4_0", 3: "Q4_1", 14: "Q4_K_S", 15: "Q4_K_M"}

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value type -> bytes
_STRING, _ARRAY = 8, 9


def file_type(path: str) -> int | None:
    """A GGUF's `general.file_type` (llama_ftype), read from its header up to that key and no further (the
    vocabulary's arrays after it are skipped unread): ~1 ms where GGUFReader parses the whole header in ~0.5 s.
    None when the file has no such key or its header does not parse (the converter then says why)."""
    import struct

    try:
        with open(path, "rb") as f:
            head = f.read(24)
            if len(head) < 24 or head[:4] != b"GGUF":
                return None
            n_kv = struct.unpack_from("<Q", head, 16)[0]

            def take(n: int) -> bytes:
                b = f.read(n)
                if len(b) < n:
                    raise EOFError
                return b

            def skip(vtype: int) -> None:
                if vtype in _SCALAR:
                    f.seek(_SCALAR[vtype], 1)
                elif vtype == _STRING:
                    f.seek(struct.unpack("<Q", take(8))[0], 1)
                elif vtype == _ARRAY:
                    itype, count = struct.unpack("<IQ", take(12))
                    if itype in _SCALAR:
                        f.seek(_SCALAR[itype] * count, 1)
                    else:
                        for _ in range(count):
                            skip(itype)
                else:
                    raise ValueError(vtype)

            for _ in range(min(n_kv, 1 << 20)):
                key = take(struct.unpack("<Q", take(8))[0])
                vtype = struct.unpack("<I", take(4))[0]
                if key == b"general.file_type" and vtype in (4, 5):
                    return struct.unpack("<I" if vtype == 4 else "<i", take(4))[0]
                skip(vtype)
    except (OSError, EOFError, ValueError, struct.error):
        return None
    return None
