"""Drafts: cheap proposers of the next K tokens, all behind one small interface.

A draft sees the whole context each round and keeps whatever state it likes (a model draft keeps a KV cache
and re-syncs it to the longest common prefix with the new context, which is its rollback).
"""
from __future__ import annotations

import copy
import os
import threading
import time
from dataclasses import dataclass

import torch

from ..errors import ConfigError, StoreError, TokenizerMismatch
from ..models import family_of, lean
from ..models.layers import Chunk
from ..quant.kernel import HAS_KERNEL
from ..quant.packed import kernel_only, nbytes, packable, quantize_table, quantize_unit, row_block, widen
from ..runtime.embedding import load_embedding
from ..runtime.weights import materialize
from ..store.ggml_int4 import check_store_layout
from ..store.manifest import MANIFEST
from ..store import shard, tokenizer
from ..store.store import LayerStore
from .. import quant
from .sampling import SamplingParams, draw
from .tree import TokenTree, chain_tree, grow_tree


@dataclass
class Proposal:
    tokens: list[int]            # [K]
    probs: torch.Tensor | None   # [K, V] the draft's (processed) distributions; None on the greedy path
    draft_s: float = 0.0

    def __repr__(self) -> str:
        shape = None if self.probs is None else tuple(self.probs.shape)
        return f"Proposal(K={len(self.tokens)}, probs={shape}, draft_s={self.draft_s:.4f})"


def common_prefix(held: list[int], context: list[int]) -> int:
    """How many of a draft cache's tokens (`held`) a new context keeps: their longest common prefix, short of the
    context's last token (which is fed again, for the logits after it)."""
    n, limit = 0, min(len(held), len(context) - 1)
    while n < limit and held[n] == context[n]:
        n += 1
    return n


class Cancelled(Exception):
    """Raised before a draft forward once its lookahead is no longer wanted (ModelDraft.cancel is set)."""


class Draft:
    name = "draft"
    resident_bytes = 0

    def propose(self, context: list[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Proposal:
        raise NotImplementedError

    def reset(self) -> None:
        pass

    def propose_tree(self, context: list[int], budget: int, params: SamplingParams, max_depth: int) -> TokenTree:
        """A draft that only proposes chains offers its chain as a tree (greedy: the tree is fixed before the
        target's draws, which verify_tree's exactness needs)."""
        p = self.propose(context, min(budget, max_depth), SamplingParams(), None)
        tree = chain_tree(p.tokens)
        tree.draft_s = p.draft_s
        return tree


class ModelDraft(Draft):
    """A resident model of any family (models/family.py) with its own cache (self-int4, skip:..., another store)."""

    def __init__(self, name: str, args, embed: torch.Tensor, units: list[tuple[str, dict]], resident_bytes: int):
        self.name, self.args, self.embed = name, args, embed
        self.family = family_of(args)
        weights = [t for _, w in units for t in w.values()] + [embed]  # (routed experts' too)
        self.experts = None
        if self.family.moe:  # routed experts ("expert.*" units) become a resident expert table
            self.experts, units = self.family.resident_experts(units)
        self.rope = self.family.rope(args, embed.device)  # inv_freq, or DeepSeek's RopeState
        self.units = units
        self.lean = lean.LeanForward.build(args, units)  # the same logits in fewer ops, where it applies
        # a draft's outputs need not match anything bit for bit: a batch of prompts multiplies densely (packed.widen)
        widen(weights)
        self.row_block = row_block(weights)  # (trees size their levels to it, see tree.grow_tree)
        self.cache = self.new_cache()
        self.vocab_size = args.vocab_size  # the target's, when it differs (see pad_vocab)
        self.tokens: list[int] = []  # what the cache holds, slot by slot (below the last tree's nodes)
        self._tree = None  # after propose_tree: (context length, {(parent slot, token): slot} of fed nodes)
        self.resident_bytes = resident_bytes
        self.cancel = threading.Event()  # set: the next forward raises Cancelled (a lookahead that lost its use)

    def reset(self) -> None:
        self.cache.length = 0
        self.tokens = []
        self._tree = None

    def new_cache(self):
        """An empty cache for this draft's layers: KVCache, or LatentCache for DeepSeek."""
        return self.family.new_cache(self.args, len(self.units) - 1, self.embed.dtype, self.embed.device)

    def twin(self) -> "ModelDraft":
        """The same resident weights with an empty cache and state of its own (a batch's trees: one per sequence)."""
        d = copy.copy(self)
        d.__dict__.pop("_lookahead_pool", None)  # (a lookahead thread stays with its own draft)
        d.cache, d.tokens, d._tree, d.cancel = self.new_cache(), [], None, threading.Event()
        return d

    def forward_batch(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        """Several sequences' chunks, each over its own cache from new_cache, through the draft at once (the
        model's forward_batch) -> logits per chunk [T_i - logits_from_i, vocab_size]."""
        out = self.family.forward_batch(self.args, self.embed, self.rope, self.units, chunks, experts=self.experts)
        return [pad_vocab(x, self.vocab_size) for x in out]

    def __getstate__(self) -> dict:
        """Pickled (a draft object handed to Ray actors) without its lookahead thread and cancel flag."""
        state = dict(self.__dict__)
        state.pop("_lookahead_pool", None)
        state["cancel"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.cancel = threading.Event()

    def _forward(self, ids: list[int], positions=None, mask=None, logits_from: int | None = None) -> torch.Tensor:
        """Append ids to the cache (at `positions` under `mask` for tree nodes) -> logits [T - logits_from, V]."""
        if self.cancel.is_set():
            raise Cancelled  # (before the forward: the cache and self.tokens still agree)
        ids_t = torch.tensor(ids)
        start = len(ids) - 1 if logits_from is None else logits_from
        if self.lean is not None and len(ids) < self.lean.max_rows:
            logits = self.lean(self.embed, self.rope, ids_t, self.cache, positions, mask, start)
        else:
            logits = self.family.forward(self.args, self.embed, self.rope, self.units, ids_t, self.cache,
                                         positions=positions, mask=mask, logits_from=start, experts=self.experts)
        return pad_vocab(logits, self.vocab_size)

    def _feed(self, ids: list[int]) -> torch.Tensor:
        """Append ids to the cache, return the logits after the last one [vocab]."""
        logits = self._forward(ids)
        self.tokens.extend(ids)
        return logits[-1]

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Roll the cache to `context` and return the logits after its last token. After a tree round, the
        nodes the new context accepted (and that were fed) are compacted into place first; then the longest
        common prefix of what the cache holds and the context is kept, and the rest fed."""
        if self._tree is not None:
            base, fed = self._tree
            self._tree = None
            slots, node = [], None
            if context[:base] == self.tokens[:base]:
                for t in context[base:]:
                    node = fed.get((node, t))
                    if node is None:
                        break
                    slots.append(node)
            self.cache.compact(base, slots)
            self.tokens = self.tokens[:base] + context[base : base + len(slots)]
        n = common_prefix(self.tokens, context)  # rollback: keep what the cache holds of the new context
        self.cache.truncate(n)
        del self.tokens[n:]
        return self._feed(context[n:])

    def snapshot(self):
        """What a lookahead (speculative/loop.Lookahead) may change: the cache slots past the committed context (a tree
        round's fed nodes included), the token list and the tree map; `restore` puts them back."""
        lo = min(self._tree[0] if self._tree is not None else len(self.tokens), self.cache.length)
        return list(self.tokens), self._tree, self.cache.save(lo)

    def restore(self, snap) -> None:
        self.tokens, self._tree, saved = snap
        self.cache.load(saved)

    @torch.inference_mode()
    def guess_next(self, context: list[int], path: list[int]) -> list[int]:
        """The next round's likeliest context: `context` + `path` (this round's proposal along the draft's own
        greedy choices, which a greedy target accepts whole as often as the draft agrees with it) + the draft's
        argmax after it, standing for the target's bonus token. The cache is left holding context + path."""
        logits = self._sync(context + path)
        return context + path + [int(logits.argmax())]

    @torch.inference_mode()
    def propose(self, context, k, params, generator):
        with kernel_only(not params.greedy):  # (seeded draws: the same whatever the batch, see packed.kernel_only)
            return self._propose(context, k, params, generator)

    def _propose(self, context, k, params, generator):
        t0 = time.perf_counter()
        logits = self._sync(context)
        tokens, probs = [], []
        for i in range(k):
            tok, q = draw(logits, params, generator)
            tokens.append(tok)
            if q is not None:
                probs.append(q)
            if i + 1 < k:
                logits = self._feed([tok])
        return Proposal(tokens, torch.stack(probs) if probs else None, time.perf_counter() - t0)

    @torch.inference_mode()
    def propose_tree(self, context, budget: int, params, max_depth: int) -> TokenTree:
        """The top-`budget` continuations of `context` by draft log-probability (see tree.grow_tree): one
        batched forward per depth, each new node attending to the context and its own ancestors only."""
        with kernel_only(not params.greedy):
            return self._propose_tree(context, budget, params, max_depth)

    def _propose_tree(self, context, budget: int, params, max_depth: int) -> TokenTree:
        t0 = time.perf_counter()
        root = self._sync(context)
        base = self.cache.length
        ancestors: dict[int, list[int]] = {}  # fed node slot -> slots of its fed ancestors and itself

        def expand(nodes):
            start = self.cache.length
            mask = torch.zeros(len(nodes), start + len(nodes), dtype=torch.bool)
            mask[:, :base] = True
            for i, n in enumerate(nodes):
                n.slot = start + i
                ancestors[n.slot] = (ancestors[n.parent.slot] if n.parent is not None else []) + [n.slot]
                mask[i, ancestors[n.slot]] = True
            positions = torch.tensor([base - 1 + n.depth for n in nodes])
            return self._forward([n.token for n in nodes], positions, mask, logits_from=0)

        tree, nodes = grow_tree(root, expand, budget, max_depth, params, row_block=self.row_block)
        # remember the fed nodes by (parent slot, token) so the next round can keep the accepted path
        self._tree = (base, {(None if n.parent is None else n.parent.slot, n.token): n.slot
                             for n in nodes if n.slot >= 0})
        tree.draft_s = time.perf_counter() - t0
        return tree


def pad_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A draft whose head has more or fewer rows than the target's vocabulary (padding ids past the tokenizer's
    last token): logits [T, V_draft] -> [T, vocab_size], rows it lacks at -inf (never proposed), extra ones cut."""
    v = logits.shape[-1]
    if v == vocab_size:
        return logits
    if v > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - v), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


class NgramDraft(Draft):
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n = max_n..1) and
    propose what followed it. No model; a point-mass draft, so q is one-hot on the sampled path."""
    name = "ngram"

    def __init__(self, vocab_size: int, max_n: int = 3):
        self.vocab_size, self.max_n = vocab_size, max_n

    def propose(self, context, k, params, generator):
        t0 = time.perf_counter()
        tokens: list[int] = []
        for n in range(min(self.max_n, len(context) - 1), 0, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start : start + n] == tail:
                    tokens = context[start + n : start + n + k]
                    break
            if tokens:
                break
        probs = None
        if tokens and not params.greedy:
            probs = torch.zeros(len(tokens), self.vocab_size)
            probs[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        return Proposal(list(tokens), probs, time.perf_counter() - t0)


    def propose_tree(self, context, budget, params, max_depth):
        """A trie of what followed every earlier occurrence of the context's tail (longest tails and latest
        occurrences first), up to `budget` nodes."""
        t0 = time.perf_counter()
        tokens, parents, index = [], [], {}
        for n in range(min(self.max_n, len(context) - 1), 0, -1):
            tail = context[-n:]
            for start in range(len(context) - n - 1, -1, -1):
                if context[start : start + n] != tail:
                    continue
                parent = -1
                for t in context[start + n : start + n + max_depth]:
                    if (parent, t) not in index:
                        if len(tokens) >= budget:
                            break
                        index[(parent, t)] = len(tokens)
                        tokens.append(t)
                        parents.append(parent)
                    parent = index[(parent, t)]
        # a trie filled by insertion puts children after parents, so it is already in a valid order
        return TokenTree(tokens, parents, draft_s=time.perf_counter() - t0)


def _unit_names(store: LayerStore, names: list[str]) -> list[str]:
    """`names` plus, for MoE stores, the routed experts ("expert.LLL.EEE" units) of the layers it keeps."""
    layers = {n.split(".")[1] for n in names if n.startswith("layer.")}
    return names + [u.name for u in store.manifest.units if u.name.startswith("expert.") and u.name.split(".")[1] in layers]


def _fuse(args, w: dict) -> dict:
    """A resident unit's weights as its family's layer code runs them best (the Llama family's: llama.fuse)."""
    return family_of(args).prepare(w)


def _load_units(store: LayerStore, names: list[str], dtype, device):
    """Each unit fused as it is read, so that its read buffer is released before the next one is read. Under a
    memory limit (mapped_draft) each is instead left as its weights stand in the shard file's mapped pages:
    pages the kernel can drop under pressure and fault back in, where copies in the process's own memory could
    only be killed with it."""
    check_store_layout(store.manifest)
    mapped = mapped_draft(device)
    out = []
    for name in _unit_names(store, names):
        data = store.read(name, mapped=mapped)
        w = materialize(data.tensors, dtype, device, store.manifest.group_size or quant.GROUP_SIZE)
        out.append((name, w if mapped else _fuse(store.args, w)))
    return out


def mapped_draft(device) -> bool:
    """Whether a draft read from a store holds its weights in the store's mapped pages (on the CPU, under a memory
    limit), not in fused copies. The real pair's 0.5B draft: 311 MB less of the process's own memory, drafting at
    the same 20-22 ms a token; SmolLM2's self-int4 draft: 82 MB less, 11.2-12.4 ms a token against 10.1-11.0 fused
    (4 kernel calls a layer instead of 7), which is why a run with no limit keeps the copies."""
    from ..runtime.memlimit import limit_bytes

    return torch.device(device).type == "cpu" and shard.MAPPED_OK and limit_bytes() is not None


def _table(store: LayerStore, dtype, device) -> torch.Tensor:
    """The whole embedding table, however big (a tied head needs every row)."""
    return load_embedding(store, dtype, device, resident_max=float("inf"))


def self_int4(store: LayerStore, dtype=torch.float32, device="cpu", group_size: int | None = None) -> ModelDraft:
    """A 4-bit copy of the target. On CPU with torch's int4 kernel, for a target that is not int4pack already,
    it is converted once from the target's original source and kept on disk (speculative/selfdraft.py: a GGUF's own
    4-bit blocks kept at group 32, 16/32-bit sources re-quantized at group 64), then loaded packed. Otherwise
    (an int4pack target, a store served by a Ray actor, CUDA, no kernel, nowhere writable) it is built in
    memory unit by unit (`self_int4_in_memory`). `group_size` forces the in-memory build at that group size."""
    kernel = HAS_KERNEL and torch.device(device).type == "cpu"
    if (group_size is None and kernel and isinstance(store, LayerStore) and store.manifest.dtype != "int4pack"
            and os.path.isfile(os.path.join(store.root, MANIFEST))):
        from . import selfdraft
        draft = selfdraft.load_or_build(store, lambda path: _load_self_int4(path, store, dtype, device))
        if draft is not None:
            return draft
    return self_int4_in_memory(store, dtype, device, group_size)


def _load_self_int4(path: str, target: LayerStore, dtype, device) -> ModelDraft:
    """A converted self-int4 draft store (int4pack; checksums checked on every read) as the target's draft. Its
    embedding lookups use the target's own table."""
    draft = LayerStore(path)
    m = draft.manifest
    if m.dtype != "int4pack" or m.args.to_dict() != target.args.to_dict():
        raise StoreError(f"{path} is not a self-int4 draft of this target")
    units = _load_units(draft, [u.name for u in m.layer_units] + ["head"], dtype, device)
    embed = load_embedding(target, dtype, device)  # (an EmbeddingRows for a big vocabulary)
    head = units[-1][1]
    if target.args.tie_word_embeddings and "lm_head.weight" not in head and not isinstance(embed, torch.Tensor):
        head["lm_head.weight"] = _table(target, dtype, device)  # (a table the kernel cannot take: whole)
    tensors = [t for _, w in units for t in w.values()] + [embed]
    out = ModelDraft("self-int4", target.args, embed, units, sum(nbytes(t) for t in tensors))
    out.vocab_size = target.args.vocab_size
    return out


def self_int4_in_memory(store: LayerStore, dtype=torch.float32, device="cpu",
                        group_size: int | None = None) -> ModelDraft:
    """The 4-bit copy built in memory, one unit at a time (read, quantize, let the fp32 copy go): CPU kernel,
    group 32 for a GGUF-made store and 64 otherwise (selfdraft.group_size_for), the same quantizer as the
    on-disk build; CUDA / no kernel: quant.quantize_int4_asym (fp16) at group 64. Tied models also get a 4-bit head
    copy of the embedding (the embedding lookup itself stays exact)."""
    from .selfdraft import group_size_for

    kernel = HAS_KERNEL and torch.device(device).type == "cpu"
    if group_size is None:
        group_size = group_size_for(store.manifest.source or "") if kernel else quant.GROUP_SIZE
    check_store_layout(store.manifest)
    units, total = [], 0
    for name in _unit_names(store, [u.name for u in store.manifest.layer_units] + ["head"]):
        w = materialize(store.read(name).tensors, dtype, device, store.manifest.group_size or quant.GROUP_SIZE)
        packed, n = quantize_unit(w, group_size, kernel, dtype)
        del w
        units.append((name, _fuse(store.args, packed)))
        total += n
    embed = load_embedding(store, dtype, device)  # (an EmbeddingRows for a big vocabulary)
    head = units[-1][1]
    if store.args.tie_word_embeddings and "lm_head.weight" not in head:
        if packable("lm_head.weight", torch.empty(embed.shape, device="meta"), group_size, kernel):
            head["lm_head.weight"] = quantize_table(embed, group_size, kernel, dtype)
            total += head["lm_head.weight"].nbytes
        elif not isinstance(embed, torch.Tensor):
            head["lm_head.weight"] = _table(store, dtype, device)  # (a big tied table that cannot be quantized)
            total += nbytes(head["lm_head.weight"])
    return ModelDraft("self-int4", store.args, embed, units, total + nbytes(embed))


def skip_layers(store: LayerStore, layers: list[int], dtype=torch.float32, device="cpu") -> ModelDraft:
    """The target minus some decoder layers, held in memory."""
    n = store.args.num_hidden_layers
    bad = [i for i in layers if not 0 <= i < n]
    if bad:
        raise ConfigError(f"skip draft: layer {bad[0]} out of range (the target has layers 0..{n - 1})")
    if len(set(layers)) >= n:
        raise ConfigError(f"skip draft: cannot skip all {n} layers of the target")
    names = [u.name for i, u in enumerate(store.manifest.layer_units) if i not in set(layers)] + ["head"]
    return _resident("skip:" + ",".join(map(str, layers)), store, names, dtype, device)


def from_store(path: str, dtype=torch.float32, device="cpu") -> ModelDraft:
    store = LayerStore(path)
    return _resident(path, store, [u.name for u in store.manifest.layer_units] + ["head"], dtype, device)


def _resident(name: str, store: LayerStore, names: list[str], dtype, device) -> ModelDraft:
    """A draft made of some of a store's units, materialized and held in memory."""
    units = _load_units(store, names, dtype, device)
    embed = load_embedding(store, dtype, device)  # (an EmbeddingRows for a big vocabulary)
    if store.args.tie_word_embeddings and not isinstance(embed, torch.Tensor):
        units[-1][1]["lm_head.weight"] = _table(store, dtype, device)  # a tied head needs the whole table
    tensors = [t for _, w in units for t in w.values()] + [embed]
    return ModelDraft(name, store.args, embed, units, sum(nbytes(t) for t in tensors))


def _convert_hf_draft(folder: str, target: LayerStore) -> str:
    """A Hugging Face folder as a draft: check its vocabulary first, then convert it once into the home."""
    import hashlib
    import json
    import os

    from ..store.convert import convert
    from ..store.default import home
    from ..store.manifest import MANIFEST

    with open(os.path.join(folder, "config.json")) as f:
        vocab = json.load(f).get("vocab_size")
    if vocab != target.args.vocab_size:
        raise TokenizerMismatch(f"draft vocabulary ({vocab} tokens, {folder}) differs from the target's "
                                f"({target.args.vocab_size} tokens)")
    folder = os.path.abspath(folder)
    tag = hashlib.sha1(folder.encode()).hexdigest()[:8]
    out = os.path.join(home(), "drafts", f"{os.path.basename(folder)}-{tag}")
    if not os.path.exists(os.path.join(out, MANIFEST)):
        convert(folder, out, dtype="fp32", force=True)
    return out


def make_draft(spec: str, target: LayerStore, dtype=torch.float32, device="cpu") -> Draft:
    """`self-int4`, `skip:I,J,...`, `ngram`, or a path to another store / Hugging Face folder."""
    import os

    if spec == "self-int4":
        return self_int4(target, dtype, device)
    if spec == "ngram":
        return NgramDraft(target.args.vocab_size)
    if spec == "mtp":  # (Engine.set_draft builds it beside its executor)
        raise ConfigError("the mtp draft reads the target's hidden states where the target sweeps: it runs with "
                          "the in-process engine (streamspec generate without --ray) so far")
    if spec.startswith("skip:"):
        try:
            layers = [int(x) for x in spec[5:].split(",") if x.strip()]
        except ValueError:
            raise ConfigError(f"bad --draft {spec!r}: expected skip:I,J,... with layer numbers") from None
        if not layers:
            raise ConfigError(f"bad --draft {spec!r}: name at least one layer to skip")
        return skip_layers(target, layers, dtype, device)
    from ..store import sources
    if spec in sources.NAMED or (spec.endswith(".gguf") and os.path.isfile(spec)):
        from ..store.default import resolve_store
        spec = resolve_store(spec)
    if os.path.isdir(spec):
        from ..store.manifest import MANIFEST
        if not os.path.exists(os.path.join(spec, MANIFEST)) and os.path.exists(os.path.join(spec, "config.json")):
            spec = _convert_hf_draft(spec, target)
        tokenizer.check_vocab(target, LayerStore(spec))
        draft = from_store(spec, dtype, device)
        draft.vocab_size = target.args.vocab_size
        return draft
    raise ConfigError(f"bad --draft {spec!r}: expected self-int4, skip:I,J,..., ngram, {', '.join(sources.NAMED)}, "
                      f"a .gguf file, or a store / model folder")
