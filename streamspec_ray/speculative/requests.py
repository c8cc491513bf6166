"""What a batch runs: one prompt made into a Request (token ids, budget, sampling, seed), checked before any work,
and where the loop (speculative/batch.run) takes requests from: a list (requests_from) or a queue that a server fills
while it runs (Source). Shared by generate_batch, the batch job (batchjob.py) and the server (request_args.py,
scheduler.py)."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Callable

from ..errors import ConfigError
from .sampling import SamplingParams


@dataclass
class Request:
    """One prompt of a batch, ready to run: token ids, budget, sampling and seed. `tag` is the caller's."""
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    seed: int
    tag: object = None
    # set (by another thread) to end the request after the current round: a client gone, a stop string seen
    cancel: threading.Event | None = None

    def __repr__(self) -> str:
        return f"Request({len(self.prompt_ids)} prompt tokens, max_new_tokens={self.max_new_tokens}, tag={self.tag!r})"


MODES = ("naive", "chain", "tree")


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ConfigError(f"unknown mode {mode!r} (choose from {', '.join(MODES)})")


OPTIONS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed")  # per request, else the defaults


def to_request(eng, item, defaults: dict, chat: bool | None = None, tag=None) -> Request:
    """A request from a prompt string, a list of token ids, or a dict with one of prompt / prompt_ids /
    messages (a chat, through the chat template) and optional max_new_tokens, temperature, top_p, top_k, seed
    overriding `defaults`, and `raw` (true: the prompt text as it is). A text prompt follows `chat` as
    Engine.generate does (None: the model's chat template when it has one). Raises ConfigError (one line) for
    anything that cannot run."""
    if isinstance(item, str):
        item = {"prompt": item}
    elif isinstance(item, (list, tuple)):
        item = {"prompt_ids": list(item)}
    if not isinstance(item, dict):
        raise ConfigError(f"a request is a prompt, a list of token ids or an object, got {type(item).__name__}")
    given = [key for key in ("prompt", "prompt_ids", "messages") if item.get(key) is not None]
    if len(given) != 1:
        raise ConfigError("give exactly one of prompt, prompt_ids, messages" + (f" (got {', '.join(given)})"
                                                                               if given else ""))
    opts = {**defaults, **{key: item[key] for key in OPTIONS if key in item}}
    n, seed = opts["max_new_tokens"], opts["seed"]
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"max_new_tokens must be a positive integer, got {n!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"seed must be an integer, got {seed!r}")
    params = SamplingParams(temperature=opts["temperature"], top_k=opts["top_k"], top_p=opts["top_p"])
    if "prompt_ids" not in given and eng.tokenizer is None:
        raise ConfigError("this store has no tokenizer: give prompt_ids")
    if "messages" in given:
        ids = chat_ids(eng, item["messages"])
    elif "prompt" in given:
        if not isinstance(item["prompt"], str):
            raise ConfigError(f"prompt must be a string, got {type(item['prompt']).__name__}")
        raw = item.get("raw", False)
        if not isinstance(raw, bool):
            raise ConfigError(f"raw must be true or false, got {json.dumps(raw)}")
        ids = eng.encode(prompt=item["prompt"], chat=False if raw else chat)
    else:
        ids = item["prompt_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ConfigError("prompt_ids must be a list of integers")
        ids = eng.encode(prompt_ids=ids)
    limit = eng.args.max_position_embeddings
    if len(ids) + n > limit:
        raise ConfigError(f"prompt ({len(ids)} tokens) + max_new_tokens ({n}) exceeds the model's context of "
                          f"{limit} tokens")
    return Request(ids, n, params, seed, tag)


def chat_ids(eng, messages) -> list[int]:
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    if not ok:
        raise ConfigError('messages must be a non-empty list of {"role": ..., "content": ...} objects')
    ids = list(eng.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False))
    return eng.encode(prompt_ids=ids)


class Source:
    """Requests that arrive while the loop runs (a server's): source(block) -> the next request, or None. With
    block False (sequences are running) it answers at once; with block True (nothing is running) it waits for
    one. After close() it answers None, and the loop ends once its running sequences finish."""

    def __init__(self, limit: int = 0):
        import queue

        self.queue: "queue.Queue[Request | None]" = queue.Queue(limit)
        self.closed = False

    def put(self, req: Request) -> None:
        """Queue a request; queue.Full if `limit` requests already wait."""
        self.queue.put_nowait(req)

    def close(self) -> None:
        self.closed = True
        try:
            self.queue.put_nowait(None)  # (wakes a waiting loop)
        except Exception:  # noqa: BLE001 (full: the loop is busy and will see `closed`)
            pass

    def waiting(self) -> int:
        return self.queue.qsize()

    def __call__(self, block: bool) -> Request | None:
        import queue

        while True:
            if self.closed and self.queue.empty():
                return None
            try:
                req = self.queue.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                if not block:
                    return None
                continue
            if req is not None:
                return req


def requests_from(items) -> Callable[[], Request | None]:
    """A thread-safe next_request over an iterable (replicas pull from one shared source)."""
    it, lock = iter(items), threading.Lock()

    def next_request():
        with lock:
            return next(it, None)
    return next_request
