"""Engine: the in-process reference. Streams the target from a store, drafts in memory, verifies exactly."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from .errors import ConfigError
from .runtime.executor import StreamingExecutor
from .spec import loop
from .spec.controller import make_budget_controller, make_controller
from .spec.drafts import Draft, make_draft
from .spec.sampling import SamplingParams
from .store.default import resolve_store
from .store.store import LayerStore

log = logging.getLogger("streamspec")
MODES = ("naive", "chain", "tree")


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str | None
    finish_reason: str
    stats: dict = field(default_factory=dict)  # the same keys as `streamspec generate --json`

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
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(store.tokenizer_path)


def encode_prompt(tokenizer, prompt: str | None, prompt_ids, chat: bool) -> list[int]:
    if prompt_ids is not None:
        ids = [int(t) for t in prompt_ids]
    elif prompt is None:
        raise ConfigError("give a prompt or prompt ids")
    elif tokenizer is None:
        raise ConfigError("this store has no tokenizer: pass token ids (--prompt-ids)")
    elif chat:
        ids = list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))
    else:
        ids = tokenizer(prompt)["input_ids"]
    if not ids:
        raise ConfigError("the prompt is empty")
    return ids


class Engine:
    def __init__(self, target: str | None = None, draft: str | Draft | None = "self-int4",
                 memory_budget: float | None = None, device: str = "cpu", cold: bool = False,
                 prefetch_depth: int = 1, dtype: torch.dtype = torch.float32, direct: bool = False):
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            raise ConfigError(f"unknown device {device!r} (e.g. cpu, cuda, cuda:0)") from None
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {device!r} asked for, but torch sees no CUDA device")
        self.store = LayerStore(resolve_store(target))
        self.args = self.store.args
        self.device, self.dtype = device, dtype
        self.executor = StreamingExecutor(self.store, device, dtype, memory_budget, cold, prefetch_depth, direct)
        self.tokenizer = load_tokenizer(self.store)
        self.draft_spec = draft
        self._draft = draft if isinstance(draft, Draft) else None
        if isinstance(draft, str):
            self._draft = make_draft(draft, self.store, dtype, device)  # fails fast on a bad draft

    @property
    def draft(self) -> Draft | None:
        return self._draft

    def encode(self, prompt=None, prompt_ids=None, chat=False) -> list[int]:
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
                 seed: int | None = 0, chat: bool = False, on_tokens=None, budget: int | str = "adaptive",
                 max_depth: int = 24) -> GenerationResult:
        """mode: naive (one sweep per token), chain (k drafts per sweep; k an int or "adaptive"/"ema") or tree
        (a token tree of at most `budget` nodes and `max_depth` levels per sweep; budget an int or "adaptive",
        which picks up to 128 nodes from measured costs)."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        if mode not in MODES:
            raise ConfigError(f"unknown mode {mode!r} (choose from {', '.join(MODES)})")
        if isinstance(k, int) and k <= 0:
            raise ConfigError(f"--k must be a positive number of draft tokens, got {k}")
        if max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
        if isinstance(budget, int) and budget <= 0:
            raise ConfigError(f"--budget must be a positive number of tree nodes, got {budget}")
        if mode != "naive" and self._draft is None:
            raise ConfigError(f"{mode} mode needs a draft")
        ids = self.encode(prompt, prompt_ids, chat)
        if len(ids) + max_new_tokens > self.args.max_position_embeddings:
            raise ConfigError(f"prompt ({len(ids)} tokens) + max-new-tokens ({max_new_tokens}) exceeds the model's "
                              f"context of {self.args.max_position_embeddings} tokens")
        generator = torch.Generator().manual_seed(seed if seed is not None else 0)
        draft = self._draft if mode != "naive" else None
        if draft is not None:
            draft.reset()
        t0 = time.perf_counter()
        target = LocalTarget(self.executor)
        if mode == "tree":
            controller = make_budget_controller(budget)
            tokens, reason, rounds = loop.generate_tree(target, draft, ids, max_new_tokens, params, controller,
                                                        self.args.eos_token_id, generator, on_tokens, max_depth)
        else:
            controller = make_controller(k) if draft is not None else None
            tokens, reason, rounds = loop.generate(target, draft, ids, max_new_tokens, params, controller,
                                                   self.args.eos_token_id, generator, on_tokens)
        wall = time.perf_counter() - t0
        stats = loop.summarize(rounds, len(tokens), wall, mode)
        text = self.decode(tokens)
        stats = {"text": text, "token_ids": tokens, "finish_reason": reason, **stats,
                 "prompt_tokens": len(ids), "draft": None if draft is None else draft.name,
                 "controller": None if controller is None else controller.name}
        return GenerationResult(tokens, text, reason, stats)
