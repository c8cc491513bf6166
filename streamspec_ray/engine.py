"""Engine: the in-process reference. Streams the target from a store, drafts in memory, verifies exactly."""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass, field

import torch

from .errors import STATUS, ConfigError
from .runtime import memlimit
from .runtime.executor import StreamingExecutor
from .speculative import loop
from .speculative.draft_length import make_budget_controller, make_controller
from .speculative.drafts import Draft, make_draft
from .speculative.requests import MODES
from .speculative.sampling import SamplingParams
from .store.default import resolve_store
from .store.store import LayerStore

log = logging.getLogger("streamspec")


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    finish_reason: str
    stats: dict = field(default_factory=dict)  # the same keys as `streamspec generate --json`

    @property
    def error(self) -> str | None:
        """What failed, where finish_reason is "error" (generate_batch: this request alone)."""
        return self.stats.get("error")

    def __repr__(self) -> str:
        return (f"GenerationResult({len(self.token_ids)} tokens, {self.finish_reason}, "
                f"{self.stats.get('tokens_per_sweep', 0):.2f} tokens/sweep)")


class LocalTarget:
    """The target as the loop sees it: a streamed executor plus its resident KV cache."""

    def __init__(self, executor: StreamingExecutor):
        self.executor = executor
        self.cache = executor.new_cache()

    @property
    def length(self) -> int:
        return self.cache.length

    def sweep(self, tokens, logits_from, positions=None, mask=None):
        return self.executor.sweep(tokens, self.cache, positions, mask, logits_from)

    def truncate(self, n: int) -> None:
        self.cache.truncate(n)

    def compact(self, at: int, slots: list[int]) -> None:
        self.cache.compact(at, slots)


def load_tokenizer(store: LayerStore):
    if not store.tokenizer_path:
        return None
    from .store import tokenizer
    return tokenizer.load(store.tokenizer_path)


def has_chat_template(tokenizer) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None))


def encode_prompt(tokenizer, prompt: str | None, prompt_ids, chat: bool | None = None) -> list[int]:
    """Token ids of a prompt. chat None (the default): text goes through the model's chat template when it has
    one (as llama.cpp's CLI and Ollama do), else as it is; True: the template, or an error without one; False:
    the raw text, tokenized with the tokenizer's defaults. Token ids are taken as they are."""
    if prompt_ids is not None:
        ids = [int(t) for t in prompt_ids]
    elif prompt is None:
        raise ConfigError("give a prompt or prompt ids")
    elif tokenizer is None:
        raise ConfigError("this store has no tokenizer: pass token ids (--prompt-ids)")
    elif not isinstance(prompt, str):
        raise ConfigError(f"the prompt must be text, got {type(prompt).__name__}")
    elif not prompt:
        raise ConfigError("the prompt is empty")
    elif chat or (chat is None and has_chat_template(tokenizer)):
        if not has_chat_template(tokenizer):
            raise ConfigError("this model has no chat template: send the text as it is (--raw)")
        ids = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise ConfigError("the prompt is empty")
    return ids


def _peak_rss() -> int:
    """This process's peak resident set so far (the kernel's high-water mark), bytes."""
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _store_path(spec: str) -> str | None:
    """The store folder a draft spec names, if it names one that exists (a named model's once converted)."""
    import os

    from .store import sources
    if spec in sources.NAMED:
        return resolve_store(spec)  # (converted by make_draft already: a lookup)
    return spec if os.path.isdir(spec) else None


@dataclass(frozen=True)
class Setup:
    """What an engine is built from besides its device, dtype, threads and draft (Engine's arguments)."""
    target: str | None
    memory_budget: float | None
    cold: bool
    prefetch_depth: int | None
    direct: bool | None
    expert_cache: float | None
    target_dtype: str | None


class Engine:
    def __init__(self, target: str | None = None, draft: str | Draft | None = "self-int4",
                 memory_budget: float | None = None, device: str = "cpu", cold: bool = False,
                 prefetch_depth: int | None = None, dtype: torch.dtype = torch.float32, direct: bool | None = None,
                 threads: int | str | None = "auto", expert_cache: float | None = None,
                 target_dtype: str | None = None):
        """threads: torch's compute threads; "auto" (the default) picks the free cores minus one for the reader
        thread (runtime/threads.py), None leaves torch's setting alone. With "auto", drafting between sweeps
        also takes the reader's core (runtime/threads.plan_threads). expert_cache: bytes of a MoE store's most
        recently used routed experts kept in memory, within memory_budget (runtime/experts.py; None: none).
        direct: read shards with O_DIRECT; None (the default) decides at the first sweep: O_DIRECT when the page
        cache cannot keep a sweep's bytes (StreamingExecutor._auto_direct). target_dtype: the store dtype of a
        target converted on first use (a named model, a .gguf file, a Hugging Face folder, the default model:
        int4pack, gguf, fp32, ...; None: int4pack for named models and 4-bit GGUF files, else fp32;
        store/default.resolve_store)."""
        from .runtime.threads import resolve

        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            raise ConfigError(f"unknown device {device!r} (e.g. cpu, cuda, cuda:0)") from None
        self.threads, self.draft_threads, self.threads_why = resolve(threads)
        self.device, self.dtype = device, dtype
        self._start(Setup(target, memory_budget, cold, prefetch_depth, direct, expert_cache, target_dtype), draft)

    def _start(self, s: "Setup", draft: str | Draft | None) -> None:
        """Everything that differs between engines: where the store is read, where the target sweeps, where the
        draft runs (RayEngine: actors). Here: a StreamingExecutor over the store in this process."""
        device = self.device
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} asked for, but torch sees no CUDA device")
        self.store = LayerStore(resolve_store(s.target, s.target_dtype))
        self.args = self.store.args
        self.executor = StreamingExecutor(self.store, device, self.dtype, s.memory_budget, s.cold, s.prefetch_depth,
                                          s.direct, expert_cache=s.expert_cache)
        if self.draft_threads > self.threads:  # long chunks take the drafting count too (executor.ALL_CORES_ROWS)
            self.executor.wide_threads = self.draft_threads
        self.tokenizer = load_tokenizer(self.store)
        stream = self.store.total_bytes() - self.store.manifest.unit("embed").bytes
        log.info("target %s: %s, %d layers, %s, %.0f MB streamed per sweep, %d compute threads (%d drafting)",
                 self.store.root, self.args.model_type, self.args.num_hidden_layers, self.store.manifest.dtype,
                 stream / 1e6, torch.get_num_threads(), self.draft_threads, extra=STATUS)
        self.set_draft(draft)

    def set_draft(self, draft: str | Draft | None) -> None:
        """Use another draft from now on: a spec (as the constructor's) is built here, and a bad one fails here."""
        self.draft_spec = draft
        if isinstance(draft, str):
            spec = draft
            t0 = time.perf_counter()
            if draft == "mtp":  # (it reads the target's hidden states from this process's executor)
                from .speculative.mtp import MTPDraft
                draft = MTPDraft(self.store, self.executor, self.dtype, self.device)
            else:
                draft = make_draft(draft, self.store, self.dtype, self.device)
            log.info("draft %s ready in %.1f s (%.0f MB in memory)", draft.name, time.perf_counter() - t0,
                     getattr(draft, "resident_bytes", 0) / 1e6, extra=STATUS)
            if memlimit.limit_bytes() is not None:
                # under a memory limit the files the draft was built from are not read again whole: drop their
                # pages, or they sit in the limit until the kernel reclaims them at its edge (the real pair's peak
                # was the limit itself, 316 MB of it the draft's store in the page cache)
                memlimit.evict([self.store.root] + [p for p in (_store_path(spec),) if p])
        self._use_draft(draft)

    def _use_draft(self, draft: Draft | None) -> None:
        """Every engine's draft is set here (RayEngine's remote one too), with what goes with it."""
        self._draft = draft
        # the adaptive controllers' last state, by mode and setting: what sweeps and drafting cost with this
        # draft on this machine is learned once, not again by every generate call (Controller.resume)
        self._learned: dict[tuple, object] = {}

    @property
    def draft(self) -> Draft | None:
        return self._draft

    def check_length(self, prompt_tokens: int, max_new_tokens: int) -> None:
        if max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
        if prompt_tokens + max_new_tokens > self.args.max_position_embeddings:
            raise ConfigError(f"prompt ({prompt_tokens} tokens) + max-new-tokens ({max_new_tokens}) exceeds the "
                              f"model's context of {self.args.max_position_embeddings} tokens")

    def encode(self, prompt=None, prompt_ids=None, chat: bool | None = None) -> list[int]:
        ids = encode_prompt(self.tokenizer, prompt, prompt_ids, chat)
        bad = [t for t in ids if not 0 <= t < self.args.vocab_size]
        if bad:
            raise ConfigError(f"token id {bad[0]} is outside the vocabulary (0..{self.args.vocab_size - 1})")
        return ids

    def decode(self, ids: list[int]) -> str | None:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else None

    @torch.inference_mode()
    def logits(self, ids) -> torch.Tensor:
        """[len(ids), vocab] target logits from one streamed sweep over a fresh cache."""
        out, _ = self.executor.sweep(list(ids), self.executor.new_cache())
        return out

    def generate(self, prompt: str | None = None, prompt_ids=None, max_new_tokens: int = 64, mode: str = "chain",
                 k: int | str = "adaptive", temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 seed: int | None = 0, chat: bool | None = None, on_tokens=None, budget: int | str = "adaptive",
                 max_depth: int = 24, overlap: bool | None = None) -> GenerationResult:
        """mode: naive (one sweep per token), chain (k drafts per sweep; k an int or "adaptive"/"ema") or tree
        (a token tree of at most `budget` nodes and `max_depth` levels per sweep; budget an int or "adaptive",
        which picks up to 128 nodes from measured costs). overlap: greedy rounds draft the next round while the
        target sweeps (speculative/loop.Lookahead); None (the default) does so in chain mode only. On the real pair a
        tree's lookahead gained nothing on code (213 against 215 ms/token, budget 16), lost on chat (464 against
        425) and added ~50 MB at the peak, enough to thrash budget 32 under a 1.2 GB limit. chat: None (default)
        applies the model's chat template to a text prompt when it has one, False sends the text as it is, True
        requires the template."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        self._check_policy(mode, k, budget)
        ids = self.encode(prompt, prompt_ids, chat)
        self.check_length(len(ids), max_new_tokens)
        generator = torch.Generator().manual_seed(seed if seed is not None else 0)
        draft = self._draft if mode != "naive" else None
        if draft is not None:
            draft.reset()
        pressure0 = memlimit.pressure()
        t0 = time.perf_counter()
        target = LocalTarget(self.executor)
        if overlap is None:
            overlap = mode == "chain"
        # a draft that predicts from the target's hidden states (mtp) sees this generation's sweeps
        self.executor.on_hidden = getattr(draft, "observe", None)
        try:
            tokens, reason, rounds, controller = self._loop(target, draft, ids, max_new_tokens, params, mode, k,
                                                            budget, max_depth, generator, on_tokens, overlap)
        finally:
            self.executor.on_hidden = None
        out = self._result(tokens, reason, rounds, time.perf_counter() - t0, mode, len(ids),
                           None if draft is None else draft.name, None if controller is None else controller.name)
        out.stats["pressure"] = memlimit.pressure_since(pressure0)
        return out

    def _loop(self, target, draft, ids, max_new_tokens, params, mode, k, budget, max_depth, generator, on_tokens,
              overlap):
        controller = (make_budget_controller(budget) if mode == "tree" else
                      make_controller(k) if draft is not None else None)
        key = (mode, budget if mode == "tree" else k)
        before = self._learned.get(key)
        if controller is not None and type(before) is type(controller):
            controller.resume(before)
        if mode == "tree":
            tokens, reason, rounds = loop.generate_tree(target, draft, ids, max_new_tokens, params, controller,
                                                        self.args.eos_token_id, generator, on_tokens, max_depth,
                                                        overlap, self.draft_threads)
        else:
            tokens, reason, rounds = loop.generate(target, draft, ids, max_new_tokens, params, controller,
                                                   self.args.eos_token_id, generator, on_tokens, overlap,
                                                   self.draft_threads)
        if controller is not None:
            self._learned[key] = controller
        return tokens, reason, rounds, controller

    def _check_policy(self, mode: str, k, budget) -> None:
        """What generate and generate_batch both check: the mode, K, the tree budget, a draft where needed."""
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r} (choose from {', '.join(MODES)})")
        if isinstance(k, int) and k <= 0:
            raise ConfigError(f"--k must be a positive number of draft tokens, got {k}")
        if isinstance(budget, int) and budget <= 0:
            raise ConfigError(f"--budget must be a positive number of tree nodes, got {budget}")
        if mode != "naive" and self._draft is None:
            raise ConfigError(f"{mode} mode needs a draft")

    def generate_batch(self, requests, batch_size: int = 8, mode: str = "chain", k: int | str = "adaptive",
                       max_new_tokens: int = 64, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                       seed: int = 0, chat: bool | None = None, replicas: int = 1, on_result=None, on_tokens=None,
                       budget: int | str = "adaptive", max_depth: int = 24):
        """Generate for many requests, up to `batch_size` at once sharing every streamed sweep; a finished
        request's slot goes to the next one (continuous batching, see speculative/batch.py).

        A request is a prompt string, a list of token ids, a dict with one of prompt / prompt_ids / messages
        and optional max_new_tokens, temperature, top_p, top_k, seed (the keyword arguments are the defaults),
        or a speculative.batch.Request. Every request is checked before any work starts (ConfigError on the first bad
        one). Returns a BatchResults: one GenerationResult per request, in order (stats as generate's, for that
        request; its bytes_read is its share of the sweeps it rode), and `.stats` for the whole batch. A request
        that fails while generating ends alone: its result has finish_reason "error", the tokens it had and
        stats["error"], and the other requests run on as they would have.
        on_result(i, result) is called as each request completes, on_tokens(i, tokens) after every round.
        mode, k, budget, max_depth: as generate's, for every sequence. replicas > 1 (RayEngine): that many
        verifier pipelines share the requests."""
        from .speculative import batch

        self._check_policy(mode, k, budget)
        if batch_size < 1 or replicas < 1:
            raise ConfigError(f"batch size and replicas must be at least 1, got {batch_size} and {replicas}")
        defaults = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        # (each a new object: results are matched to requests by identity)
        reqs = [dataclasses.replace(r) if isinstance(r, batch.Request) else batch.to_request(self, r, defaults, chat)
                for r in requests]
        index = {id(r): i for i, r in enumerate(reqs)}
        results = batch.BatchResults([None] * len(reqs))

        def finished(f: batch.Finished) -> None:
            i = index[id(f.req)]
            results[i] = self._result(f.token_ids, f.finish_reason, f.log, f.wall_s, mode, len(f.req.prompt_ids),
                                      None if mode == "naive" else self._draft.name, f.controller)
            if f.error is not None:  # (finish_reason "error": this request failed alone, the others went on)
                results[i].stats["error"] = f.error
            if on_result is not None:
                on_result(i, results[i])

        hook = None if on_tokens is None else (lambda req, tokens: on_tokens(index[id(req)], tokens))
        t0 = time.perf_counter()
        with self._batch_pipelines(mode, replicas) as pipelines:
            sizes = self._batch_sizes(batch_size, len(pipelines))
            totals = batch.run_all(pipelines, batch.requests_from(reqs), sizes,
                                   batch.Policy(mode, k, budget, max_depth), self.args.eos_token_id, finished, hook)
        results.stats = batch.batch_stats(results, totals, time.perf_counter() - t0, mode, batch_size, replicas)
        return results

    def _result(self, tokens: list[int], reason: str, rounds, wall_s: float, mode: str, prompt_tokens: int,
                draft: str | None, controller: str | None) -> GenerationResult:
        """A GenerationResult whose stats carry the keys of `generate --json`."""
        text = self.decode(tokens)
        stats = {"text": text, "token_ids": tokens, "finish_reason": reason,
                 **loop.summarize(rounds, len(tokens), wall_s, mode), "prompt_tokens": prompt_tokens, "draft": draft,
                 "controller": controller, "peak_rss_bytes": _peak_rss(),
                 "draft_resident_bytes": getattr(self._draft, "resident_bytes", 0) if draft else 0,
                 "threads": torch.get_num_threads(), "draft_threads": self.draft_threads if draft else None,
                 # (None on Ray: the verifier actor's sweeps choose their threads there)
                 "threads_why": why(self.threads_why) if (why := getattr(self.executor, "threads_why", None)) else None,
                 "direct_reads": bool(getattr(self.executor, "direct", False)),
                 # under a memory limit: what the engine planned to hold at its first sweep (memplan.MemoryPlan)
                 "memory_plan": plan.as_dict() if (plan := getattr(self.executor, "memory_plan", None)) else None}
        return GenerationResult(tokens, text, reason, stats)

    def _batch_sizes(self, batch_size: int, pipelines: int) -> int | list[int]:
        """The sequences each pipeline runs at once: batch_size each (a staged RayEngine splits it)."""
        return batch_size

    @contextlib.contextmanager
    def _batch_pipelines(self, mode: str, replicas: int):
        """Yields [(target, BatchDraft or None)], one per pipeline: in process, the executor and the draft."""
        from .speculative.batch import BatchDraft

        if replicas != 1:
            raise ConfigError("replicas need Ray (--ray / RayEngine): in process there is one executor")
        yield [(self.executor, None if mode == "naive" else BatchDraft(self._draft, mode, self.draft_threads))]
