"""`streamspec serve`: an OpenAI-compatible HTTP server whose requests ride the same streamed sweeps.

A sweep costs its reads whether it carries one sequence or sixteen, so concurrent clients share them: one
generation loop (spec/batch.run, the batch job's continuous batching) runs in a thread and takes new requests
between rounds, up to --batch-size at once; the rest wait in a bounded queue (full: 429). Each request keeps its
own KV cache, draft state, K controller and seeded generator, so its greedy output is what `streamspec generate`
gives it alone. Tokens are pushed to their request as soon as their round emits them (server-sent events when
"stream" is true). A client that goes away, or a stop string that appears, ends its sequence after the current
round, which frees its slot.

Endpoints: GET /v1/models, POST /v1/completions (the text as it is, as `generate --raw`), POST
/v1/chat/completions (through the model's chat template, as `generate`), GET /health, GET /metrics (Prometheus
text). With an API key, /v1/* need `Authorization: Bearer KEY`. Errors are OpenAI's shape:
{"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import json
import logging
import queue
import secrets
import threading
import time

from fastapi import Request  # (at module level: FastAPI resolves the endpoints' string annotations here)

from .errors import ConfigError, StreamspecError
from .scheduler import Job, Scheduler
from .spec import batch
from .spec.sampling import SamplingParams

log = logging.getLogger("streamspec")

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class TextStream:
    """Token ids -> text deltas, holding back what is not yet final: a character still being spelled out by
    byte tokens, and a tail that may be the start of a stop string. A stop string ends the text before it."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""
        self.stopped = False

    def feed(self, ids: list[int], final: bool = False) -> str:
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hits = [text.find(s, max(0, self.sent - len(s))) for s in self.stop]
        hits = [h for h in hits if h >= 0]
        if hits:
            self.stopped, final = True, True
            text = text[: min(hits)]
        ready = len(text)
        if not final:
            if text.endswith("\ufffd"):
                ready = len(text.rstrip("\ufffd"))
            for s in self.stop:  # a tail that could begin a stop string waits for the next tokens
                for n in range(min(len(s) - 1, ready), 0, -1):
                    if text[:ready].endswith(s[:n]):
                        ready -= n
                        break
        ready = max(ready, self.sent)
        delta, self.sent, self.text = text[self.sent : ready], ready, text
        return delta


def _error(status: int, message: str, param: str | None = None, code: str | None = None, headers=None):
    from fastapi.responses import JSONResponse

    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            429: "rate_limit_error"}.get(status, "server_error")
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


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
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        raise BadRequest(f"{key} must be in {'(' if lo_open else '['}{lo}, {hi if hi is not None else 'inf'}], "
                         f"got {v}", key)
    return v


def make_app(scheduler: Scheduler, model_name: str, api_key: str | None = None, max_new_tokens: int = 128):
    """The FastAPI application over a running Scheduler."""
    from fastapi import FastAPI
    from fastapi.responses import Response
    from sse_starlette.sse import EventSourceResponse

    engine = scheduler.engine
    app = FastAPI(title="streamspec", version="0.1")
    created = int(time.time())

    def authorized(request: Request) -> bool:
        if api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode())

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "active": int(scheduler.metrics.active._value.get()),
                "queued": scheduler.source.waiting()}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        if hasattr(scheduler, "refresh"):  # (the loop runs in a Ray controller: its counters)
            scheduler.refresh()
        return Response(scheduler.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        if not authorized(request):
            return _error(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "streamspec"}]}

    async def parse(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            raise BadRequest(f"the body is not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        model = body.get("model")
        if model not in (None, model_name, "default"):
            raise BadRequest(f"unknown model {model!r}: this server has {model_name!r} (GET /v1/models)", "model")
        return body

    def build(body: dict, ids: list[int], default_max: int, loop) -> tuple[Job, TextStream]:
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
        req = batch.Request(ids, n, params, secrets.randbits(63) if seed is None else seed,
                            cancel=threading.Event())
        return Job(req, loop), TextStream(engine.tokenizer, stop)

    async def run(request: Request, kind: str):
        if not authorized(request):
            return _error(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")
        loop = asyncio.get_running_loop()
        try:
            body = await parse(request)
            if kind == "chat":
                try:
                    ids = batch.chat_ids(engine, body.get("messages"))
                except ConfigError as e:
                    raise BadRequest(str(e), "messages") from None
                default_max = max_new_tokens
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                    prompt = prompt[0]
                if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool)
                                                               for t in prompt):
                    ids = engine.encode(prompt_ids=prompt)
                elif isinstance(prompt, str) and prompt:
                    ids = engine.encode(prompt=prompt, chat=False)  # completions: the text as it is
                else:
                    raise BadRequest("prompt must be a non-empty string or a list of token ids", "prompt")
                default_max = COMPLETIONS_MAX_TOKENS
            job, text = build(body, ids, default_max, loop)
        except BadRequest as e:
            return _error(400, str(e), e.param)
        except StreamspecError as e:
            return _error(400, str(e))
        try:
            scheduler.submit(job)
        except queue.Full:
            return _error(429, "the server is busy: the request queue is full, retry shortly",
                          headers={"Retry-After": "1"})
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        if body.get("stream"):
            return EventSourceResponse(_stream(request, job, text, rid, kind, model_name, len(ids)),
                                       ping=15, send_timeout=30)
        return await _whole(request, job, text, rid, kind, model_name, len(ids))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, "text")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, "chat")

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return _error(404, f"no endpoint {request.method} {request.url.path}")

    @app.exception_handler(405)
    async def not_allowed(request: Request, exc):
        return _error(405, f"{request.method} is not allowed on {request.url.path}")

    app.state.scheduler = scheduler
    return app


def _finish(reason: str, text: TextStream) -> str:
    return "stop" if text.stopped or reason == "stop" else "length" if reason == "length" else reason


def _usage(prompt_tokens: int, text: TextStream) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(text.ids),
            "total_tokens": prompt_tokens + len(text.ids)}


async def _next(request, job: Job):
    """The job's next event; the client leaving cancels the job (its slot frees after the round)."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.req.cancel.set()
                return ("gone", None)


async def _whole(request, job: Job, text: TextStream, rid: str, kind: str, model: str, prompt_tokens: int):
    from fastapi.responses import JSONResponse

    while True:
        event, payload = await _next(request, job)
        if event == "tokens":
            text.feed(payload)
            if text.stopped:
                job.req.cancel.set()  # (the tokens after the stop string are not needed)
        elif event == "error":
            return _error(500, f"generation failed: {payload}")
        else:  # done or gone
            text.feed([], final=True)
            reason = _finish(payload or "cancelled", text)
            break
    choice = {"index": 0, "finish_reason": reason, "logprobs": None}
    if kind == "chat":
        choice["message"] = {"role": "assistant", "content": text.text}
    else:
        choice["text"] = text.text
    return JSONResponse({"id": rid, "object": "chat.completion" if kind == "chat" else "text_completion",
                         "created": int(time.time()), "model": model, "choices": [choice],
                         "usage": _usage(prompt_tokens, text)})


async def _stream(request, job: Job, text: TextStream, rid: str, kind: str, model: str, prompt_tokens: int):
    created = int(time.time())

    def chunk(delta: str | None, reason: str | None = None, role: bool = False) -> str:
        if kind == "chat":
            d = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
            choice = {"index": 0, "delta": d, "finish_reason": reason, "logprobs": None}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": delta or "", "finish_reason": reason, "logprobs": None}
            obj = "text_completion"
        out = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
        if reason is not None:
            out["usage"] = _usage(prompt_tokens, text)
        return json.dumps(out)

    try:
        if kind == "chat":
            yield {"data": chunk(None, role=True)}
        while True:
            event, payload = await _next(request, job)
            if event == "tokens":
                delta = text.feed(payload)
                if text.stopped:
                    job.req.cancel.set()
                if delta:
                    yield {"data": chunk(delta)}
            elif event == "error":
                yield {"event": "error", "data": json.dumps({"error": {"message": f"generation failed: {payload}",
                                                                       "type": "server_error"}})}
                return
            elif event == "gone":
                return
            else:
                delta = text.feed([], final=True)
                if delta:
                    yield {"data": chunk(delta)}
                yield {"data": chunk(None, _finish(payload, text))}
                yield {"data": "[DONE]"}
                return
    finally:  # the client went away mid-stream (the generator is closed): free the slot
        job.req.cancel.set()


class ServerThread:
    """A uvicorn server for `app` in a background thread (tests, benchmarks, embedding in a program);
    port 0 picks a free one. .url is its base URL; stop() shuts it down."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import socket

        import uvicorn

        if port == 0:
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
        self.port = port
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, name="streamspec-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            raise ConfigError(f"the HTTP server did not start on {host}:{port}")
        self.url = f"http://{host}:{port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve(a) -> int:
    """`streamspec serve` (a: the parsed flags): build the engine, start the loop, run uvicorn until Ctrl-C."""
    import uvicorn

    from .runtime.threads import choose_threads

    if a.host not in ("127.0.0.1", "localhost", "::1") and not a.api_key:
        log.warning("serving on %s without --api-key: anyone who can reach this port can use the model", a.host)
    controller = None
    if a.ray:  # the loop runs in a named ControllerActor that other processes can attach to
        choose_threads(a.threads)
        from .actors import controller as ctl
        controller = ctl.start(a.controller_name, target=a.target, draft=a.draft, mode=a.mode, k=a.k,
                               budget=a.budget, batch_size=a.batch_size, max_queue=a.max_queue,
                               memory_budget=a.memory_budget, cold=a.cold, device=a.device, threads=a.threads,
                               address=a.address)
        eng = ctl.AttachedEngine(a.controller_name)
        scheduler = ctl.RemoteScheduler(eng)
        log.info("controller %r runs the loop on Ray: other processes attach with RayEngine.attach(%r)",
                 a.controller_name, a.controller_name)
    else:
        from .engine import Engine
        eng = Engine(target=a.target, draft=a.draft if a.mode != "naive" else None, memory_budget=a.memory_budget,
                     device=a.device, cold=a.cold, threads=a.threads or "auto")
        eng._check_policy(a.mode, a.k, a.budget)
        scheduler = Scheduler(eng, a.mode, a.k, a.budget, a.batch_size, a.max_queue)
    if eng.tokenizer is None:
        raise ConfigError("serve needs a store with a tokenizer")
    name = a.model_name or _model_name(eng)
    app = make_app(scheduler, name, a.api_key, a.max_new_tokens)
    log.info("serving %s on http://%s:%d/v1 (mode %s, batch size %d)", name, a.host, a.port, a.mode, a.batch_size)
    try:
        uvicorn.run(app, host=a.host, port=a.port, log_level="warning")
    finally:
        scheduler.close()
        if controller is not None:
            import ray
            ray.get(controller.close.remote())
            ray.kill(controller)
    return 0


def _model_name(eng) -> str:
    import os

    store = getattr(eng, "store", None)
    root = getattr(eng, "root", None) or (store.root if store is not None else "streamspec")
    return os.path.basename(root.rstrip("/"))
