"""StreamingExecutor: runs a chunk of new tokens through the target, streaming each layer exactly once.

A sweep embeds the chunk (the embedding table is resident, or read by rows when it is big), then for every
decoder layer: the layer's shard arrives from the UnitStream (read ahead on a worker thread), the whole chunk goes
through it as one batched matmul, and the weights are dropped; finally the head unit gives logits. The KV cache
stays resident, and so do as many target units as the memory plan leaves room for (see _plan_memory): those are
read once, at the first sweep, and the stream cycles through the others only.

A pipeline stage (`layers=`, actors/stages.py) is this executor over a range of the decoder layers: the first
stage embeds, the last computes the head, and between them a sweep takes and returns hidden states. `hold()`
keeps all of a stage's units in memory instead of streaming them.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace

import torch

from ..errors import ConfigError
from ..models import family_of
from ..models.layers import Chunk
from ..quant import int8
from ..store import shard
from ..store.ggml_int4 import check_store_layout
from ..store.store import LayerStore
from .kvcache import KVCache, LatentCache
from .embedding import EmbeddingRows, head_is_the_table, load_embedding
from .experts import ExpertReader, fit_readers, reserve
from .prefetch import MAX_READERS, Residency, StreamStats, UnitStream
from .threads import using
from .weights import extra_bytes, streamed_table

log = logging.getLogger("streamspec")


@dataclass
class SweepStats:
    tokens: int
    bytes_read: int
    io_s: float
    prep_s: float
    compute_s: float
    stall_s: float
    wall_s: float
    # MoE stores: routed experts used this sweep (the union over the chunk, per layer) vs all of them
    experts_read: int = 0
    experts_total: int = 0
    expert_bytes: int = 0        # (included in bytes_read)
    expert_bytes_all: int = 0    # what reading every routed expert of every MoE layer would have cost
    expert_hits: int = 0         # of experts_read, those found in the expert cache (not read from the store)
    expert_stall_s: float = 0.0  # time the sweep waited for expert reads (included in stall_s)
    # the next sweep's reads run ahead whole, during verification and drafting (UnitStream.whole_pass): a round
    # then takes about the longer of its reads (io_s) and its drafting plus the sweep's own work
    read_ahead: bool = False
    # the share of the sweep's reads that may run before it, during verification and drafting (1 where read_ahead;
    # under a memory limit, the plan's window: UnitStream.ahead_share); speculative/controller.round_time
    ahead: float = 0.0
    # between the last sweep and this one (verification and drafting): its length, and the disk's busy time in it,
    # the reads that ran there (StreamStats.gap_io_s); what drafting really hides, measured
    gap_s: float = 0.0
    gap_io_s: float = 0.0

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


# Sweeps of at least this many rows (by the store's weight format) compute with `wide_threads`: then compute, not
# the reads, sets their time. A 4-bit weight costs as much compute as an fp32 one for an eighth of the bytes, so
# its sweeps turn compute-bound at fewer rows. Measured, 2 threads against 1: Qwen2.5-Coder-1.5B int4pack, warm,
# 64 rows 2.4 -> 1.5 s, 256 rows 8.8 -> 4.8 s; SmolLM2-135M fp32, cold, a 712-row batch prefill 1.50 -> 1.12 s,
# but 135-row batch sweeps 0.42 -> 0.46 s (the reader's core taken)
ALL_CORES_ROWS = {"fp32": 400, "bf16": 200, "fp16": 200, "int4": 64, "int4pack": 64}

# "0" turns holding off where the executor is not told (hold None): every sweep streams every unit, as before
# holding was planned (for comparisons; StreamingExecutor(hold=False) is the same)
HOLD_ENV = "STREAMSPEC_HOLD"
INT8_ENV = "STREAMSPEC_INT8"  # "1": held int4 units multiply in int8 (StreamingExecutor._int8)


class StreamingExecutor:
    def __init__(self, store, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 memory_budget: float | None = None, cold: bool = False, prefetch_depth: int | None = None,
                 direct: bool = False, expert_readers: int = MAX_READERS, expert_cache: float | None = None,
                 layers: range | None = None, hold_what_fits: bool | None = None):
        # a LayerStore, its root, or any reader with its interface (actors.store.RemoteStore: a store actor's)
        self.store = LayerStore(store) if isinstance(store, str) else store
        self.args = self.store.args
        self.family = family_of(self.args)  # (models/family.py: what differs between architectures)
        self.device, self.dtype, self.cold, self.direct = torch.device(device), dtype, cold, direct
        self.budget = float("inf") if memory_budget is None else float(memory_budget)
        root = getattr(self.store, "root", None)  # (a remote store's root lies on its own node)
        if cold and isinstance(root, str) and (fs := shard.filesystem(root)) in shard.MEMORY_FILESYSTEMS:
            log.warning("the store %s lies on %s, which keeps files in memory: --cold reads cannot come from a "
                        "disk here, and read times measure memory", root, fs)
        # prefetch_depth None: 2 units read ahead, or under a memory limit as far as the limit leaves room for
        # (decided at the first sweep, see _plan_memory); a depth or a budget given is kept as given
        self.depth = 2 if prefetch_depth is None else prefetch_depth
        self.auto_depth = prefetch_depth is None and memory_budget is None
        self.memory_plan = None
        # hold: keep in memory as many target units as the plan leaves room for (None: unless HOLD_ENV is "0").
        # Only where the plan is made (auto_depth, a CPU run, not MoE) and from a local store: a remote store's
        # reads land in its shared ring, whose slots a held unit would keep for good
        # (cold: every sweep's reads come from the disk, by request)
        fits = os.environ.get(HOLD_ENV, "1") != "0" and not cold if hold_what_fits is None else hold_what_fits
        self.hold_what_fits = fits and isinstance(self.store, LayerStore)
        self.held: dict[str, dict] = {}  # unit name -> its weights, resident from the first sweep on (or hold())
        self._loaded: tuple[StreamStats, float] | None = None  # the held units' read (its stats, its wall s)
        self.pin = self.device.type == "cuda"
        self.residency = Residency()
        names = [u.name for u in self.store.manifest.layer_units]
        n = self.args.num_hidden_layers
        if len(names) != n:
            raise ConfigError(f"store has {len(names)} layers, config says {n}")
        # a stage's layers (default: all): the first stage embeds the tokens, the last computes the head
        self.layers = range(n) if layers is None else layers
        if not 0 <= self.layers.start < self.layers.stop <= n or self.layers.step != 1:
            raise ConfigError(f"a stage's layers must be a non-empty range within 0..{n}, got {self.layers}")
        self.first, self.last = self.layers.start == 0, self.layers.stop == n
        self.layer_names = names[self.layers.start : self.layers.stop]
        self._stream: UnitStream | None = None
        self.stream_budget = self.budget
        if self.family.moe:
            self._init_experts(expert_readers, expert_cache or 0)
        elif expert_cache:
            raise ConfigError("an expert cache needs a MoE store (DeepSeek): this store has no routed experts")
        if self.store.manifest.dtype == "int4pack":
            if self.device.type != "cpu":
                raise ConfigError("int4pack stores hold CPU int4-kernel weights: run them with --device cpu")
            check_store_layout(self.store.manifest)
        # a big vocabulary's embedding is read by rows (EmbeddingRows); a tied model then streams the table as
        # its head, after the head unit (the two are merged into one "head" unit for the model code)
        # (a later stage needs the table only as a tied head; a middle stage not at all)
        tied = head_is_the_table(self.store)
        self.embed = load_embedding(self.store, dtype, self.device) if self.first or (self.last and tied) else None
        rows = isinstance(self.embed, EmbeddingRows)
        self.stream_head_embed = rows and tied and self.last
        self.sweep_names = (self.layer_names + (["head"] if self.last else [])
                            + (["embed"] if self.stream_head_embed else []))
        self.stream_names = self.sweep_names  # those the sweep stream cycles through: all but the held units
        self.stream(self.sweep_names).check_budget()  # a budget below the largest unit fails here
        self.resident_bytes = 0 if rows or self.embed is None else self.embed.numel() * self.embed.element_size()
        self.rope = self.family.rope(self.args, self.device)  # inv_freq, or DeepSeek's RopeState
        self.sweeps = 0
        self.bytes_read = 0
        self.on_hidden = None  # DeepSeek sweeps: shown their final normed hidden states (deepseek.forward_batch)
        self.wide_threads: int | None = None  # torch's threads for sweeps of ALL_CORES_ROWS rows or more (see _run)

    def new_cache(self) -> KVCache | LatentCache:
        return self.family.new_cache(self.args, len(self.layer_names), self.dtype, self.device)

    def stream(self, names: list[str], cycle: bool = False, **kw) -> UnitStream:
        how = dict(budget=self.stream_budget, depth=self.depth, cold=self.cold, residency=self.residency,
                   pin=self.pin, direct=self.direct, cycle=cycle,
                   keep_dtype=frozenset({"embed"}) if self.stream_head_embed else frozenset(),
                   defer_verify=self.device.type == "cpu",  # (checksums beside the sweep, not the draft)
                   mapped=True)  # (warm CPU reads map the shards: see UnitStream)
        return UnitStream(self.store, names, dtype=self.dtype, device=self.device, **{**how, **kw})


    def hold(self) -> int:
        """Read every unit of the sweep once and keep it (_hold): later sweeps compute from memory and read
        nothing (a stage whose share of the model fits its node's memory). -> the bytes read."""
        if self.family.moe:
            raise ConfigError("holding a MoE store's units is not supported: its routed experts are read on demand")
        self.close()
        self._hold(self.sweep_names)
        self._loaded = None  # (read before any sweep: not a sweep's)
        return sum(self.store.manifest.unit(n).bytes for n in self.held)

    def _init_experts(self, readers: int, cache: float) -> None:
        """Routed experts are read on demand after the router has run, `readers` shards at once, the most
        recently used `cache` bytes of them kept in memory (runtime/experts.py). Their room is set aside: the
        cache's bytes are counted from the start, and layers stream within budget - reserve(readers), so while a
        layer's weights (and whatever is read ahead) are alive, the experts in use and in flight always fit and
        the reader never waits. A budget that leaves room for fewer reads in flight gets fewer (at least one)."""
        if readers < 1:
            raise ConfigError(f"expert readers must be at least 1, got {readers}")
        if cache < 0:
            raise ConfigError(f"the expert cache must be 0 bytes or more, got {cache}")
        same = self.device.type == "cpu"
        units = [u for u in self.store.manifest.units  # (this stage's decoder layers': not an MTP layer's, mtp.py)
                 if u.name.startswith("expert.") and int(u.name.split(".")[1]) in self.layers]
        self.expert_need = max((u.bytes + extra_bytes(u, self.dtype, same) for u in units), default=0)
        self.expert_bytes_all = sum(u.bytes for u in units)
        self.experts_total = len(units)
        if 0 < cache < self.expert_need:
            raise ConfigError(f"the expert cache ({int(cache)} bytes) holds not one expert ({self.expert_need} "
                              "bytes): raise --expert-cache, or 0 for none")
        cached = int(cache // self.expert_need) * self.expert_need if self.expert_need else 0
        need, name = max((u.bytes + extra_bytes(u, self.dtype, same), u.name) for u in
                         map(self.store.manifest.unit, self.layer_names + ["head"]))
        if need + cached + self.expert_need > self.budget:
            also = f" plus the expert cache ({cached} bytes)" if cached else ""
            raise ConfigError(f"memory budget {int(self.budget)} bytes is below unit {name!r} ({need} bytes) "
                              f"plus the largest expert ({self.expert_need} bytes){also}: raise --memory-budget"
                              + (" or lower --expert-cache" if cached else ""))
        readers = fit_readers(readers, self.expert_need, self.budget - cached - need)
        self.stream_budget = self.budget - reserve(readers, self.expert_need)
        self.experts = ExpertReader(self.store, self.expert_need, readers=readers, cache_bytes=cached,
                                    dtype=self.dtype, device=self.device, budget=self.budget, cold=self.cold,
                                    residency=self.residency, pin=self.pin, direct=self.direct)
        self._moe = SweepStats(0, 0, 0.0, 0.0, 0.0, 0.0, 0.0)

    def _read_experts(self, layer: int, ids: list[int]):
        """ExpertProvider: the experts `ids` of `layer` from the ExpertReader (the cache, or the store: read
        checksummed, several at once), its figures added to this sweep's (self._moe)."""
        clock = self._stream.clock if self._stream is not None else None
        return self.experts(layer, ids, self._moe, clock)

    def _sweep_stream(self) -> UnitStream:
        """One long-lived stream that cycles through the layers: while the caller verifies and drafts between
        sweeps, the worker already reads the next sweep's first layers (up to depth / the budget)."""
        if self._stream is None:
            if self.direct is None:
                self.direct = self._auto_direct()
            if self.auto_depth and self.memory_plan is None and not self.held:  # (hold(): nothing to plan)
                self._plan_memory()
            self._stream = self.stream(self.stream_names, cycle=True).start()
        return self._stream

    def _auto_direct(self) -> bool:
        """direct=None: O_DIRECT reads when the page cache cannot keep a sweep's bytes until the next sweep (a
        store bigger than the memory available, or than a memory limit leaves beside what the process holds,
        draft included: decided at the first sweep, once the draft is built; see memplan.reads_direct). The
        real pair under a 1.2 GB limit (chain, K = 8, 64 tokens, two runs each): 245 and 253 ms/token through
        the page cache, 190 and 183 with O_DIRECT. A store that fits keeps the page cache, which makes warm runs
        fast; CUDA runs keep it too. A cold run (--cold) reads with O_DIRECT: it asked for every read from disk."""
        from .memplan import reads_direct

        need = sum(self.store.manifest.unit(n).bytes for n in self.sweep_names)
        # (cold: every read comes from the disk by request, and a copy through the page cache is pure cost)
        return self.device.type == "cpu" and (self.cold or reads_direct(need))

    # positions of KV cache and rows of a sweep's activations a memory plan sets aside for what the run still grows
    PLAN_POSITIONS, PLAN_ROWS = 1024, 64

    def _plan_memory(self) -> None:
        """Read ahead as far as memory leaves room for (memplan.plan): under a limit, the limit less what the
        process holds now (the draft is built by the first sweep), the KV cache and activations still to grow,
        and the headroom; with none, the memory the machine has available less the same. The real pair under
        1.2 GB read 2 units ahead before this: its reads ran only while the sweep computed, not while the draft
        drafted, and the sweep stalled on them. A store that fits is read a whole pass ahead, during verification
        and drafting, as `--prefetch-depth 32` did by hand (the embedded fp32 store cold: 1.11x its pipeline bound
        with it, 2.00x with the old default depth of 2).

        Before reading ahead, the plan keeps target units in memory (hold_what_fits; memplan.resident_count): the
        largest first (a head bigger than a layer), then the layers in the sweep's order, one at a time, while they
        and a 4-unit read-ahead over the rest fit in that room; the rest of the room then sets the read-ahead over
        the units still streamed. A held unit costs its bytes once instead of a read every sweep, so a sweep's
        reads fall a unit at a time as memory grows, to none where the whole store fits (with no limit: in the
        memory the machine has available). An explicit depth or budget (auto_depth False) holds nothing."""
        from . import memplan

        if self.device.type != "cpu" or self.family.moe:
            return  # (a MoE sweep's routed experts share the budget, sized in _init_experts: not planned here)
        a = self.args
        kv = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim
        scratch = self.PLAN_ROWS * 4 * (2 * a.vocab_size + 4 * max(a.intermediate_size or 0, a.hidden_size))
        grow = kv * self.dtype.itemsize * self.PLAN_POSITIONS + scratch
        if self.direct and self.hold_what_fits and memplan.limit_bytes():
            # Under a limit a unit far larger than the others (the real pair's 146 MB head among 29 MB layers) is
            # mapped from its file and held, not streamed: streamed, it needs a read buffer of its size beside a
            # layer's, anonymous memory the kernel can only kill; mapped, its pages are the page cache's, used once
            # a sweep, so under pressure the kernel drops them before the draft's (used every drafted token) and
            # reads them back at the next sweep. The real pair's chat prompt: 171 ms/token under 0.8 GB against
            # 256, 231 under 0.7 GB against 486; 144-157 against 154-159 under 1.0 and 0.9 GB (a sweep reads 830 MB
            # where it read 965: the head's pages stay)
            sizes = {n: self.store.manifest.unit(n).bytes for n in self.sweep_names}
            big = max(sizes, key=sizes.get)
            if sizes[big] > 2 * sorted(sizes.values())[len(sizes) // 2]:
                self._hold([big], mapped=True)
        names = [n for n in self.sweep_names if n not in self.held]
        probe = self.stream(names)
        plan = memplan.plan([probe.need(n) for n in names], grow, hold=self.hold_what_fits,
                            unit_bytes=[self.store.manifest.unit(n).bytes for n in names])
        if plan is None:
            return
        (log.info if plan.limit else log.debug)(plan.describe())
        if plan.resident:  # (a read that fails here fails the sweep, and the next sweep plans again)
            self._hold([names[i] for i in plan.resident])
        self.memory_plan = plan = self._int8(plan)
        # The depth alone holds the plan: the stream keeps at most depth + 1 units read and not yet released, and
        # the plan's window is the widest depth + 1 consecutive ones. (A byte budget would too, but a unit whose
        # tensors outlive their pass, a head a draft shares, would then stall the reader for good.) A plan that
        # does not fit still reads one unit ahead, the least that overlaps reads with compute; with no limit, a
        # store whose whole pass fits is read a whole pass ahead (UnitStream.whole_pass). Everything held: depth 0,
        # a stream of no units, no reader.
        n = len(self.stream_names)
        self.depth = n if not plan.limit and plan.depth >= n - 1 else plan.depth

    def _int8(self, plan):
        """Opt-in (INT8_ENV "1"), everything held, no limit: the held int4 weights become fbgemm int8 ones
        (quant/int8.py), row for row the same whatever the batch, q/k/v and gate/up joined first (family.prepare:
        4 calls a layer, not 7). On the real pair a layer's 8-10-row GEMMs take about half the int4 kernel's time,
        but the weights are twice the bytes (one row is slower), converting takes 20-35 s at the first sweep, and
        a chain round gained 1.3x in a long-lived engine (docs/benchmarks.md): not the default. Only where memory
        available holds the weights twice over. The plan says so (kernel, resident_bytes)."""
        from . import memplan

        if (plan.limit or self.stream_names or not self.held or not int8.HAS_INT8
                or os.environ.get(INT8_ENV) != "1" or (memplan.available_bytes() or 0) < 2 * plan.resident_bytes):
            return plan
        t0, added = time.perf_counter(), 0
        for name, w in self.held.items():
            self.held[name], more = int8.as_int8(self.family.prepare(w))
            added += more
        if not added:  # (a float store: nothing on the int4 kernel)
            return plan
        log.info("held units in int8 for the sweep's GEMMs: +%.0f MB, %.1f s", added / 1e6, time.perf_counter() - t0)
        return replace(plan, kernel="int8", resident_bytes=plan.resident_bytes + added)

    def _hold(self, names: list[str], mapped: bool = False) -> None:
        """Read `names` once, here, checksums verified as on every read, and keep their weights for every later
        sweep: the same tensors a stream hands over, so the same kernels give the same bits. Warm CPU reads map
        the shard files (shard.map_file: the page cache's own pages, no copy; a mapping's clean pages can be
        reclaimed under pressure and read again, where a copy could only be killed); O_DIRECT and cold reads land
        in buffers of their own. Either way the plan counted their bytes. The read counts in the first sweep's
        figures (_reads). (The embedded store warm, everything held: copying the pages stalled the first sweep
        0.55-0.94 s on its own, mapping them 0.05 s.) mapped: map the files whatever the reads (O_DIRECT too)."""
        t0 = time.perf_counter()
        once = self.stream(names, depth=MAX_READERS, residency=Residency(), defer_verify=False,
                           **(dict(direct=False) if mapped else {}))
        try:  # (read as the stream reads: MAX_READERS at once, which a disk needs to near its bandwidth)
            for name, w in once.start().take():
                self.held[name] = w
                del w
        finally:
            once.close()
        self.stream_names = [n for n in self.sweep_names if n not in self.held]
        st, wall = once.stats, time.perf_counter() - t0
        if self._loaded is not None:  # (a second read of held units before the first sweep's figures)
            (st0, wall0) = self._loaded
            st = StreamStats(st.bytes_read + st0.bytes_read, st.io_s + st0.io_s, st.prep_s + st0.prep_s)
            wall += wall0
        self._loaded = (st, wall)

    def threads_why(self, base: str) -> str:
        """Why sweeps compute on the threads they do (for --json): `base`, the engine's count, and the wide rule."""
        wide = self.wide_threads or torch.get_num_threads()
        s = self._stream
        whole = s is not None and s.whole_pass and (self.direct or s.mapped or not s.names)
        return (f"{base}; sweeps of {ALL_CORES_ROWS.get(self.store.manifest.dtype, 400)} rows or more compute on {wide}"
                + (", and so does every sweep here: " + ("every unit is held in memory, there is nothing to read"
                                                         if not s.names else "its whole pass is read ahead, the "
                                                         "reader has little left to do")
                   if whole else ", shorter ones on one: the other core reads ahead, checks checksums and drafts "
                   "the next round (two threads measured no faster under a 1.2 GB limit on the real pair)"))

    def _pass(self, stream: UnitStream):
        """(name, weights) for every unit of the sweep in order: the held ones from memory, the others from one
        pass of the stream."""
        streamed = stream.take()
        for name in self.sweep_names:
            if name in self.held:
                yield name, self.held[name]
            else:
                yield next(streamed)
        for _ in streamed:  # (none left: this ends the pass, the stream's last unit released, the gap timed)
            pass

    def _units(self, stream: UnitStream):
        """One pass of the sweep as the model code wants it: a tied table streamed as the head joins the head
        unit."""
        if not self.stream_head_embed:
            yield from self._pass(stream)
            return
        head = None
        for name, w in self._pass(stream):
            if name == "head":
                head = w
            elif name == "embed":
                # (in the store's form: cast, or dequantized from GGUF blocks, block by block as it multiplies)
                w = {**head, "lm_head.weight": streamed_table(w, self.dtype)}
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
              mask: torch.Tensor | None = None, logits_from: int = 0,
              hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, SweepStats]:
        """One streamed sweep: tokens [T] -> logits [T - logits_from, vocab] (fp32, on CPU); see llama.forward.
        A stage after the first takes the stage before's hidden [T, hidden]; one before the last returns its own."""
        t_start = time.perf_counter()
        ids = torch.as_tensor(tokens, dtype=torch.long)
        self._check_chunk(ids, cache, positions)

        def forward(units):
            return self.family.forward(self.args, self.embed, self.rope, units, ids, cache, positions=positions,
                                       mask=mask, logits_from=logits_from, experts=self._read_experts,
                                       on_hidden=self.on_hidden, hidden=hidden)

        out, stats = self._run(forward, ids.numel(), t_start)
        return out.cpu(), stats

    def _check_chunk(self, ids: torch.Tensor, cache, positions) -> None:
        check_chunk(self.args, ids, cache, positions)

    def _finish(self, st: StreamStats, t_start: float) -> tuple[float, float]:
        """Count a finished sweep (st: its reads) -> (wall s, compute s: wall minus what the compute thread waited
        for)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - t_start
        self.sweeps += 1
        self.bytes_read += st.bytes_read
        # (depth 0 reads in the sweep, on its thread; with every unit held, there is only the held units' one read)
        return wall, wall - st.stall_s if self.depth > 0 or not self.stream_names else wall - st.io_s - st.prep_s

    @torch.inference_mode()
    def sweep_batch(self, chunks: list[Chunk],
                    hidden: torch.Tensor | None = None) -> tuple[list[torch.Tensor] | torch.Tensor, SweepStats]:
        """One streamed sweep for several sequences, each with its own cache (a ragged batch, see
        llama.forward_batch / deepseek.forward_batch): every layer is read once and applied to all chunks' rows
        together (a MoE layer's routed experts too: the union over the batch, each read once).
        -> (logits per chunk [T_i - logits_from_i, vocab] fp32 on CPU, SweepStats of the whole sweep). A stage
        (as sweep's) takes and returns the batch's hidden states [sum T, hidden] instead of ids' and logits."""
        if not chunks:
            raise ValueError("a batch sweep needs at least one chunk")
        t_start = time.perf_counter()
        for c in chunks:
            self._check_chunk(c.ids, c.cache, c.positions)

        def forward(units):
            return self.family.forward_batch(self.args, self.embed, self.rope, units, chunks,
                                             experts=self._read_experts, hidden=hidden)

        out, stats = self._run(forward, sum(c.ids.numel() for c in chunks), t_start)
        return (out.cpu() if isinstance(out, torch.Tensor) else [x.cpu() for x in out]), stats

    def _run(self, forward, tokens: int, t_start: float):
        """forward(units) over one pass of the sweep stream -> (its result, the sweep's SweepStats). A DeepSeek
        sweep's expert reads (_read_experts, counted in self._moe) start after routing: the time the sweep waited
        for them counts as stall, not compute."""
        stream = self._sweep_stream()
        moe = self._moe = SweepStats(0, 0, 0.0, 0.0, 0.0, 0.0, 0.0) if self.family.moe else None
        try:
            # a long chunk (a prompt, a big batch) is compute-bound, and its reads leave the reader's core idle:
            # it computes on every core the engine has (the same chunk always with the same count, so the same
            # bits). Short chunks keep one thread: a reader beside two threads slowed the int4 kernel 2-7x. Except
            # where the reader has little left to do: O_DIRECT reads (no kernel copies) of a pass read ahead whole
            # while the round verified and drafted (SmolLM2 fp32, cold, tree 16: sweeps' compute 6.62 and 6.90 s
            # -> 5.90 and 6.27, wall 14.53 and 15.09 -> 13.84 and 14.03 s), and warm reads that map the shards
            # (shard.map_file; the same store warm, a 17-row sweep: 147 ms copied on one thread, 90 mapped on two)
            # (and where every unit is held: nothing to read)
            wide = (tokens >= ALL_CORES_ROWS.get(self.store.manifest.dtype, 400)
                    or ((self.direct or stream.mapped or not stream.names) and stream.whole_pass))
            with using(self.wide_threads if wide else None):
                out = forward(self._units(stream))
        except BaseException:
            self.close()  # a failed or interrupted sweep leaves the cycle mid-pass: start afresh next time
            raise
        st = self._reads(stream)
        wall, compute = self._finish(st, t_start)
        if moe is None:
            return out, SweepStats(tokens, st.bytes_read, st.io_s, st.prep_s, compute, st.stall_s, wall,
                                   read_ahead=stream.whole_pass, ahead=stream.ahead_share, gap_s=st.gap_s,
                                   gap_io_s=st.gap_io_s)
        self.bytes_read += moe.expert_bytes
        return out, SweepStats(tokens, st.bytes_read + moe.expert_bytes, st.io_s + moe.io_s, st.prep_s + moe.prep_s,
                               compute - moe.stall_s, st.stall_s + moe.stall_s, wall, moe.experts_read,
                               self.experts_total, moe.expert_bytes, self.expert_bytes_all, moe.expert_hits,
                               moe.stall_s, read_ahead=stream.whole_pass)

    def _reads(self, stream: UnitStream) -> StreamStats:
        """This sweep's reads: its pass of the stream's, and at the first sweep the held units' one read, which
        the sweep waited for (stall)."""
        st = stream.stats
        if self._loaded is None:
            return st
        (once, waited), self._loaded = self._loaded, None
        return StreamStats(st.bytes_read + once.bytes_read, st.io_s + once.io_s, st.prep_s + once.prep_s,
                           st.stall_s + waited, st.gap_s, st.gap_io_s)
