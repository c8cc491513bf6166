"""What an OpenAI request to `streamspec serve` asks for, checked: its JSON body, its prompt as token ids and its
sampling parameters. Anything the client got wrong is a BadRequest (400, with the offending parameter)."""
from __future__ import annotations

import json
import math
import secrets
import threading

from .errors import ConfigError
from .speculative.requests import Request, chat_ids
from .speculative.sampling import SamplingParams

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _number(body: dict, key: str, default, lo=None, hi=None, integer=False, lo_open=False):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int if integer else (int, float)):
        raise BadRequest(f"{key} must be {'an integer' if integer else 'a number'}, got {json.dumps(v)}", key)
    if not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        raise BadRequest(f"{key} must be in {'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}], "
                         f"got {v}", key)
    return v


def parse_json(raw: bytes, model_name: str) -> dict:
    """The request body as a JSON object naming this server's model (or none)."""
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise BadRequest(f"the body is not valid JSON ({e})") from None
    except RecursionError:  # (json's C scanner: 100000 '[' and the like)
        raise BadRequest("the body is not valid JSON: it is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    model = body.get("model")
    if model not in (None, model_name, "default"):
        raise BadRequest(f"unknown model {model!r}: this server has {model_name!r} (GET /v1/models)", "model")
    return body


def prompt_ids(engine, kind: str, body: dict) -> list[int]:
    """The prompt as token ids: "chat" through the model's chat template, "text" (completions) as it is, or the
    token ids a completions request gives."""
    if kind == "chat":
        try:
            return chat_ids(engine, body.get("messages"))
        except ConfigError as e:
            raise BadRequest(str(e), "messages") from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return engine.encode(prompt_ids=prompt)
    if isinstance(prompt, str) and prompt:
        return engine.encode(prompt=prompt, chat=False)  # completions: the text as it is
    raise BadRequest("prompt must be a non-empty string or a list of token ids", "prompt")


def sampling(engine, body: dict, ids: list[int], default_max: int) -> tuple[Request, list[str]]:
    """The Request for `ids` (max_tokens fitted to the context when the client gave none) and the stop
    strings."""
    if body.get("n", 1) != 1:
        raise BadRequest("only n=1 is supported", "n")
    n = _number(body, "max_tokens", None, lo=1, integer=True)
    n = _number(body, "max_completion_tokens", n, lo=1, integer=True) or default_max
    params = SamplingParams(temperature=_number(body, "temperature", 1.0, lo=0, hi=2),
                            top_p=_number(body, "top_p", 1.0, lo=0, hi=1, lo_open=True),
                            top_k=_number(body, "top_k", 0, lo=0, integer=True))
    seed = _number(body, "seed", None, lo=0, hi=2**63 - 1, integer=True)
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise BadRequest("stop must be a string or a list of at most 4 non-empty strings", "stop")
    limit = engine.args.max_position_embeddings
    if len(ids) >= limit:
        raise BadRequest(f"the prompt ({len(ids)} tokens) does not fit the model's context of {limit} tokens",
                         "messages" if "messages" in body else "prompt")
    if len(ids) + n > limit:
        if body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None:
            raise BadRequest(f"prompt ({len(ids)} tokens) + max_tokens ({n}) exceeds the model's context of "
                             f"{limit} tokens", "max_tokens")
        n = limit - len(ids)
    req = Request(ids, n, params, secrets.randbits(63) if seed is None else seed, cancel=threading.Event())
    return req, stop
