"""StreamingExecutor: runs a chunk of new tokens through the target, streaming each layer exactly once.

A sweep embeds the chunk (the embedding table is resident, or read by rows when it is big), then for every decoder layer: the layer's shard
arrives from the UnitStream (read ahead on a worker thread), the whole chunk goes through it as one batched
matmul, and the weights are dropped; finally the head unit gives logits. The KV cache stays resident.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..errors import ConfigError
from ..models import deepseek, llama, rope
from ..store.ggml_int4 import check_store_layout
from ..store.store import LayerStore
from .kvcache import KVCache, LatentCache
from .embedding import EmbeddingRows, head_is_the_table, load_embedding
from .prefetch import Residency, UnitStream
from .weights import BlockCast, extra_bytes


@dataclass
class SweepStats:
    tokens: int
    bytes_read: int
    io_s: float
    prep_s: float
    compute_s: float
    stall_s: float
    wall_s: float
    # MoE stores: routed experts read this sweep (the union over the chunk, per layer) vs all of them
    experts_read: int = 0
    experts_total: int = 0
    expert_bytes: int = 0        # (included in bytes_read)
    expert_bytes_all: int = 0    # what reading every routed expert of every MoE layer would have cost

    def __repr__(self) -> str:
        return (f"SweepStats(tokens={self.tokens}, read={self.bytes_read / 1e6:.1f} MB, io={self.io_s * 1e3:.1f} ms, "
                f"compute={self.compute_s * 1e3:.1f} ms, stall={self.stall_s * 1e3:.1f} ms)")


def check_chunk(args, ids: torch.Tensor, cache, positions) -> None:
    """A sweep's chunk must hold a token and stay within the model's context (positions: a tree's)."""
    if ids.numel() == 0:
        raise ConfigError("a sweep needs at least one token")
    last = cache.length + ids.numel() if positions is None else int(max(positions)) + 1
    if last > args.max_position_embeddings:
        raise ConfigError(f"sequence of {last} tokens exceeds the model's context ({args.max_position_embeddings})")


class StreamingExecutor:
    def __init__(self, store, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 memory_budget: float | None = None, cold: bool = False, prefetch_depth: int = 2,
                 direct: bool = False):
        # a LayerStore, its root, or any reader with its interface (actors.store.RemoteStore: a store actor's)
        self.store = LayerStore(store) if isinstance(store, str) else store
        self.args = self.store.args
        self.device, self.dtype, self.cold, self.direct = torch.device(device), dtype, cold, direct
        self.budget = float("inf") if memory_budget is None else float(memory_budget)
        self.depth = prefetch_depth
        self.pin = self.device.type == "cuda"
        self.residency = Residency()
        self.layer_names = [u.name for u in self.store.manifest.layer_units]
        if len(self.layer_names) != self.args.num_hidden_layers:
            raise ConfigError(f"store has {len(self.layer_names)} layers, config says {self.args.num_hidden_layers}")
        self._stream: UnitStream | None = None
        self.stream_budget = self.budget
        if self.args.is_deepseek:
            self._init_experts()
        if self.store.manifest.dtype == "int4pack":
            if self.device.type != "cpu":
                raise ConfigError("int4pack stores hold CPU int4-kernel weights: run them with --device cpu")
            check_store_layout(self.store.manifest)
        # a big vocabulary's embedding is read by rows (EmbeddingRows); a tied model then streams the table as
        # its head, after the head unit (the two are merged into one "head" unit for the model code)
        self.embed = load_embedding(self.store, dtype, self.device)
        rows = isinstance(self.embed, EmbeddingRows)
        self.stream_head_embed = rows and head_is_the_table(self.store)
        self.sweep_names = self.layer_names + ["head"] + (["embed"] if self.stream_head_embed else [])
        self.stream(self.sweep_names).check_budget()  # a budget below the largest unit fails here
        self.resident_bytes = 0 if rows else self.embed.numel() * self.embed.element_size()
        if self.args.is_deepseek:
            self.rope = deepseek.RopeState(self.args, self.device)
        else:
            self.inv_freq = rope.inv_freq(self.args).to(self.device)
        self.sweeps = 0
        self.bytes_read = 0

    def new_cache(self) -> KVCache:
        a = self.args
        if a.is_deepseek:
            return LatentCache(a.num_hidden_layers, a.kv_lora_rank, a.qk_rope_head_dim, self.dtype, self.device)
        return KVCache(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, self.dtype, self.device)

    def stream(self, names: list[str], cycle: bool = False) -> UnitStream:
        return UnitStream(self.store, names, dtype=self.dtype, device=self.device, budget=self.stream_budget,
                          depth=self.depth, cold=self.cold, residency=self.residency, pin=self.pin,
                          direct=self.direct, cycle=cycle,
                          keep_dtype=frozenset({"embed"}) if self.stream_head_embed else frozenset())

    def _init_experts(self) -> None:
        """Routed experts are read on demand, one at a time, after the router has run (see _read_experts).
        Their room is set aside: layers stream within budget - largest expert, so while a layer's weights
        (and whatever is read ahead) are alive, one expert always still fits and the reader never waits."""
        same = self.device.type == "cpu"
        units = [u for u in self.store.manifest.units if u.name.startswith("expert.")]
        self.expert_need = max((u.bytes + extra_bytes(u, self.dtype, same) for u in units), default=0)
        self.expert_bytes_all = sum(u.bytes for u in units)
        self.experts_total = len(units)
        self.stream_budget = self.budget - self.expert_need
        for name in self.layer_names + ["head"]:
            u = self.store.manifest.unit(name)
            need = u.bytes + extra_bytes(u, self.dtype, same)
            if need > self.stream_budget:
                raise ConfigError(f"memory budget {int(self.budget)} bytes is below unit {name!r} ({need} bytes) "
                                  f"plus the largest expert ({self.expert_need} bytes): raise --memory-budget")
        self._moe = SweepStats(0, 0, 0.0, 0.0, 0.0, 0.0, 0.0)

    def _read_experts(self, layer: int, ids: list[int]):
        """ExpertProvider: the experts `ids` of `layer`, read through the store (checksummed) one at a time,
        each dropped by the caller before the next is read, within the memory budget."""
        from ..store.convert import expert_name

        names = [expert_name(layer, e) for e in ids]
        s = UnitStream(self.store, names, dtype=self.dtype, device=self.device, budget=self.budget, depth=0,
                       cold=self.cold, residency=self.residency, pin=self.pin, direct=self.direct)
        it = s.take()
        for e in ids:
            _, w = next(it)
            yield e, w
            del w  # (the caller drops its reference too, so the next read finds room)
        for _ in it:  # resume take() once more so it lets go of the last expert
            pass
        m = self._moe
        m.experts_read += len(ids)
        m.expert_bytes += s.stats.bytes_read
        m.io_s += s.stats.io_s
        m.prep_s += s.stats.prep_s

    def _sweep_stream(self) -> UnitStream:
        """One long-lived stream that cycles through the layers: while the caller verifies and drafts between
        sweeps, the worker already reads the next sweep's first layers (up to depth / the budget)."""
        if self._stream is None:
            self._stream = self.stream(self.sweep_names, cycle=True).start()
        return self._stream

    def _units(self, stream: UnitStream):
        """One pass of the stream as the model code wants it: a streamed tied table joins the head unit."""
        if not self.stream_head_embed:
            yield from stream.take()
            return
        head = None
        for name, w in stream.take():
            if name == "head":
                head = w
            elif name == "embed":
                table = w["weight"]  # (in the store's dtype: cast block by block as it multiplies)
                w = {**head, "lm_head.weight": table if table.dtype == self.dtype else BlockCast(table, self.dtype)}
                head = None
                yield "head", w
            else:
                yield name, w
            del w

    def close(self) -> None:
        """Stop reading ahead (units read ahead for a sweep that never comes are dropped)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    @torch.inference_mode()
    def sweep(self, tokens, cache: KVCache, positions: torch.Tensor | None = None,
              mask: torch.Tensor | None = None, logits_from: int = 0) -> tuple[torch.Tensor, SweepStats]:
        """One streamed sweep: tokens [T] -> logits [T - logits_from, vocab] (fp32, on CPU); see llama.forward."""
        t_start = time.perf_counter()
        ids = torch.as_tensor(tokens, dtype=torch.long)
        self._check_chunk(ids, cache, positions)
        stream = self._sweep_stream()
        moe = None
        try:
            if self.args.is_deepseek:
                moe = self._moe = SweepStats(0, 0, 0.0, 0.0, 0.0, 0.0, 0.0)
                logits = deepseek.forward(self.args, self.embed, self.rope, self._units(stream), ids, cache,
                                          self._read_experts, positions, mask, logits_from)
            else:
                logits = llama.forward(self.args, self.embed, self.inv_freq, self._units(stream), ids, cache, positions,
                                       mask, logits_from)
        except BaseException:
            self.close()  # a failed or interrupted sweep leaves the cycle mid-pass: start afresh next time
            raise
        wall, compute = self._finish(stream, t_start)
        st = stream.stats
        if moe is not None:  # expert reads block the sweep (read after routing): I/O and stall, not compute
            self.bytes_read += moe.expert_bytes
            compute -= moe.io_s + moe.prep_s
            return logits.cpu(), SweepStats(
                ids.numel(), st.bytes_read + moe.expert_bytes, st.io_s + moe.io_s, st.prep_s + moe.prep_s, compute,
                st.stall_s + moe.io_s + moe.prep_s, wall, moe.experts_read, self.experts_total, moe.expert_bytes,
                self.expert_bytes_all)
        return logits.cpu(), SweepStats(ids.numel(), st.bytes_read, st.io_s, st.prep_s, compute, st.stall_s, wall)

    def _check_chunk(self, ids: torch.Tensor, cache, positions) -> None:
        check_chunk(self.args, ids, cache, positions)

    def _finish(self, stream: UnitStream, t_start: float) -> tuple[float, float]:
        """Count a finished sweep -> (wall s, compute s: wall minus what the compute thread waited for)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - t_start
        st = stream.stats
        self.sweeps += 1
        self.bytes_read += st.bytes_read
        return wall, wall - st.stall_s if self.depth > 0 else wall - st.io_s - st.prep_s

    @torch.inference_mode()
    def sweep_batch(self, chunks: list[llama.Chunk]) -> tuple[list[torch.Tensor], SweepStats]:
        """One streamed sweep for several sequences, each with its own cache (a ragged batch, see
        llama.forward_batch): every layer is read once and applied to all chunks' rows together.
        -> (logits per chunk [T_i - logits_from_i, vocab] fp32 on CPU, SweepStats of the whole sweep)."""
        if self.args.is_deepseek:
            raise ConfigError("batch sweeps run Llama-family stores only so far (DeepSeek MLA/MoE stores: "
                              "generate one prompt at a time)")
        if not chunks:
            raise ValueError("a batch sweep needs at least one chunk")
        t_start = time.perf_counter()
        for c in chunks:
            self._check_chunk(c.ids, c.cache, c.positions)
        stream = self._sweep_stream()
        try:
            logits = llama.forward_batch(self.args, self.embed, self.inv_freq, self._units(stream), chunks)
        except BaseException:
            self.close()  # as sweep: a failed sweep leaves the cycle mid-pass
            raise
        wall, compute = self._finish(stream, t_start)
        st = stream.stats
        return [x.cpu() for x in logits], SweepStats(sum(c.ids.numel() for c in chunks), st.bytes_read, st.io_s,
                                                     st.prep_s, compute, st.stall_s, wall)
