"""`streamspec serve`: an OpenAI-compatible HTTP server whose requests ride the same streamed sweeps.

A sweep costs its reads whether it carries one sequence or sixteen, so concurrent clients share them: one
generation loop (speculative/batch.run, the batch job's continuous batching) runs in a thread and takes new requests
between rounds, up to --batch-size at once; the rest wait in a bounded queue (full: 429). Each request keeps its
own KV cache, draft state, K controller and seeded generator, so its greedy output is what `streamspec generate`
gives it alone. Tokens are pushed to their request as soon as their round emits them (server-sent events when
"stream" is true). A client that goes away (running or still queued), or a stop string that appears, ends its
sequence after the current round, which frees its slot; a queued one never starts.

Endpoints: GET /v1/models, POST /v1/completions (the text as it is, as `generate --raw`), POST
/v1/chat/completions (through the model's chat template, as `generate`), GET /health (503 while the loop cannot
run or the server shuts down), GET /metrics (Prometheus text). With an API key, /v1/* and /metrics need
`Authorization: Bearer KEY`. httpguard.py checks every request first (body size, Host, Origin, Content-Type).
Errors are OpenAI's shape: {"error": {"message", "type", "param", "code"}}, an unexpected one included (500).

Prompts are tokenized in one thread of their own, never on the event loop, where a multi-megabyte prompt stalled
every other client (/health for 3.7 s). One thread: a fast tokenizer used by two threads at once can fail with
"Already borrowed". Decoding new tokens (TextStream) stays on the loop: it is small and only reads the
tokenizer's state, as encoding does.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import secrets
import threading
import time

from fastapi import Request  # (at module level: FastAPI resolves the endpoints' string annotations here)

from . import httpguard, request_args
from .errors import ConfigError, StreamspecError
from .httpguard import error as _error
from .request_args import BadRequest
from .scheduler import Job, Scheduler, Unavailable

log = logging.getLogger("streamspec")


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


class OneThread:
    """Runs blocking calls in one daemon thread, in order, for the event loop to await (a daemon thread: a
    tokenization still running does not hold the process at exit)."""

    def __init__(self, name: str):
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._work, name=name, daemon=True).start()

    def _work(self) -> None:
        while True:
            future, fn = self.calls.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:  # noqa: BLE001 (raised again in the awaiting handler)
                    future.set_exception(e)

    async def __call__(self, fn):
        future = concurrent.futures.Future()
        self.calls.put((future, fn))
        return await asyncio.wrap_future(future)


class Departure:
    """Watches for a non-streaming request's client leaving. Once the body is read, uvicorn's receive() answers
    only when the connection is lost (http.disconnect), so awaiting it sees the loss at once. (This server
    polled request.is_disconnected() when no token had come for 0.5 s: tokens arriving more often than that
    kept the poll from ever running, and a request whose client left ran on to max_tokens.) attach(job): the
    client leaving then cancels the job and wakes its handler with a ("gone", None) event."""

    def __init__(self, request: Request):
        self.gone, self.job = False, None
        self.task = asyncio.ensure_future(self._wait(request.receive))

    async def _wait(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self._cancel()

    def attach(self, job: Job) -> None:
        self.job = job
        self._cancel()

    def _cancel(self) -> None:
        if self.gone and self.job is not None:
            self.job.req.cancel.set()
            self.job.events.put_nowait(("gone", None))

    def stop(self) -> None:
        self.task.cancel()


def make_app(scheduler: Scheduler, model_name: str, api_key: str | None = None, max_new_tokens: int = 128, *,
             host: str = "127.0.0.1", max_body_bytes: int = httpguard.DEFAULT_MAX_BODY,
             shutdown_timeout: float = 5.0):
    """The FastAPI application over a running Scheduler. host: the address the server binds (a loopback one
    without a key turns on the Host and Content-Type checks, see httpguard)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, Response
    from sse_starlette.sse import EventSourceResponse

    engine = scheduler.engine
    remote = hasattr(scheduler, "refresh")  # (the loop runs in a Ray controller: asking it blocks)
    app = FastAPI(title="streamspec", version="0.1")
    app.add_middleware(httpguard.Guard, local=httpguard.is_loopback(host), keyed=api_key is not None,
                       max_body=max_body_bytes)
    created = int(time.time())
    tokenize = OneThread("streamspec-tokenize")  # (see the module docstring: one thread, off the loop)

    def authorized(request: Request) -> bool:
        if api_key is None:
            return True
        given = request.headers.get("authorization", "")
        return secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode())

    def unauthorized():
        return _error(401, "invalid or missing API key (Authorization: Bearer KEY)", code="invalid_api_key")

    @app.get("/health")
    async def health():
        h = await asyncio.to_thread(scheduler.health) if remote else scheduler.health()
        return JSONResponse({"model": model_name, **h}, status_code=200 if h["status"] == "ok" else 503)

    @app.get("/metrics")
    async def metrics(request: Request):
        from prometheus_client import CONTENT_TYPE_LATEST

        if not authorized(request):
            return unauthorized()
        if remote:  # (the controller's counters)
            await asyncio.to_thread(scheduler.refresh)
        return Response(scheduler.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        if not authorized(request):
            return unauthorized()
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "streamspec"}]}

    async def parse(request: Request) -> dict:
        return request_args.parse_json(await httpguard.read_body(request, max_body_bytes), model_name)

    async def run(request: Request, kind: str):
        if not authorized(request):
            return unauthorized()
        why = scheduler.refusal()  # (answered before the body is read)
        if why is not None:
            return _error(503, why, code="unavailable")
        loop = asyncio.get_running_loop()
        watch = None
        try:
            body = await parse(request)
            watch = Departure(request)
            ids = await tokenize(lambda: request_args.prompt_ids(engine, kind, body))
            default_max = max_new_tokens if kind == "chat" else request_args.COMPLETIONS_MAX_TOKENS
            req, stop = request_args.sampling(engine, body, ids, default_max)
            job, text = Job(req, loop), TextStream(engine.tokenizer, stop)
            scheduler.submit(job)
        except Exception as e:  # noqa: BLE001 (the client's errors are answered; others go on to the 500 handler)
            if watch is not None:
                watch.stop()
            return _refused(e, max_body_bytes)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        if body.get("stream"):
            watch.stop()  # (sse-starlette watches for the client leaving from here on)
            return EventSourceResponse(_stream(job, text, rid, kind, model_name, len(ids)), ping=15,
                                       send_timeout=30, shutdown_grace_period=shutdown_timeout)
        watch.attach(job)
        try:
            return await _whole(job, text, rid, kind, model_name, len(ids))
        finally:
            watch.stop()

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

    @app.exception_handler(Exception)
    async def internal(request: Request, exc):  # (anything unexpected: JSON, never Starlette's plain text)
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return _error(500, f"internal server error ({type(exc).__name__})")

    app.state.scheduler = scheduler
    return app


def _refused(e: Exception, max_body: int):
    """The answer to a request refused before it was queued."""
    if isinstance(e, httpguard.TooLarge):
        return httpguard.too_large(max_body)
    if isinstance(e, BadRequest):
        return _error(400, str(e), e.param)
    if isinstance(e, queue.Full):
        return _error(429, "the server is busy: the request queue is full, retry shortly", headers={"Retry-After": "1"})
    if isinstance(e, Unavailable):
        return _error(503, str(e), code="unavailable")
    if isinstance(e, StreamspecError):
        return _error(400, str(e))
    raise e


def _finish(reason: str, text: TextStream) -> str:
    return "stop" if text.stopped or reason == "stop" else "length" if reason == "length" else reason


def _usage(prompt_tokens: int, text: TextStream) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(text.ids),
            "total_tokens": prompt_tokens + len(text.ids)}


async def _whole(job: Job, text: TextStream, rid: str, kind: str, model: str, prompt_tokens: int):
    from fastapi.responses import JSONResponse

    while True:
        event, payload = await job.events.get()  # (the client leaving: ("gone", None), from Departure)
        if event == "tokens":
            text.feed(payload)
            if text.stopped:
                job.req.cancel.set()  # (the tokens after the stop string are not needed)
        elif event == "error":
            return _error(500, f"generation failed: {payload}")
        elif event == "unavailable":
            return _error(503, payload, code="unavailable")
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


async def _stream(job: Job, text: TextStream, rid: str, kind: str, model: str, prompt_tokens: int):
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
        while True:  # (the client leaving: sse-starlette closes this generator)
            event, payload = await job.events.get()
            if event == "tokens":
                delta = text.feed(payload)
                if text.stopped:
                    job.req.cancel.set()
                if delta:
                    yield {"data": chunk(delta)}
            elif event in ("error", "unavailable"):
                message = f"generation failed: {payload}" if event == "error" else payload
                yield _error_event(message, "unavailable" if event == "unavailable" else None)
                return
            else:
                delta = text.feed([], final=True)
                if delta:
                    yield {"data": chunk(delta)}
                yield {"data": chunk(None, _finish(payload, text))}
                yield {"data": "[DONE]"}
                return
    except Exception as e:  # noqa: BLE001 (the 200 and its headers are sent: the error goes in the stream)
        log.error("streaming %s failed: %s: %s", rid, type(e).__name__, e)
        yield _error_event(f"internal server error ({type(e).__name__})", None)
    finally:  # the client went away mid-stream (the generator is closed): free the slot
        job.req.cancel.set()


def _error_event(message: str, code: str | None) -> dict:
    return {"event": "error", "data": json.dumps({"error": {"message": message, "type": "server_error",
                                                            "param": None, "code": code}})}


class ServerThread:
    """A uvicorn server for `app` in a background thread (tests, benchmarks, embedding in a program);
    port 0 picks a free one. .url is its base URL; stop() shuts it down (what is still open after
    `shutdown_timeout` seconds is closed)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, shutdown_timeout: float = 5.0):
        import socket

        import uvicorn

        if port == 0:
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
        self.port = port
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    timeout_graceful_shutdown=shutdown_timeout))
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


def _draining(config, scheduler, deadline: float):
    """A uvicorn server that, when asked to stop (SIGTERM, Ctrl-C), stops taking requests (new ones and the
    queued ones get 503 / an error event), lets the running ones finish for the first half of `deadline` seconds,
    then cancels them, so their clients still get a proper end (finish_reason "cancelled", the text so far) in the
    second half; at the deadline uvicorn closes whatever is still open (config.timeout_graceful_shutdown)."""
    import uvicorn

    class Draining(uvicorn.Server):
        began: float | None = None

        async def shutdown(self, sockets=None):
            self.began = time.monotonic()
            scheduler.refuse("the server is shutting down")
            asyncio.get_running_loop().call_later(deadline / 2, scheduler.cancel_running)
            await super().shutdown(sockets)

        def left(self) -> float:
            """Seconds left of the deadline (at least half a second, for the loop's current round)."""
            spent = 0.0 if self.began is None else time.monotonic() - self.began
            return max(0.5, deadline - spent)

    return Draining(config)


def serve(a) -> int:
    """`streamspec serve` (a: the parsed flags): build the engine, start the loop, run uvicorn until SIGTERM or
    Ctrl-C, then drain within --shutdown-timeout."""
    import signal

    import uvicorn

    from .runtime.threads import choose_threads

    api_key = httpguard.resolve_api_key(a.api_key, getattr(a, "api_key_file", None))  # (before any loading)
    deadline = getattr(a, "shutdown_timeout", 5.0)
    if not httpguard.is_loopback(a.host) and api_key is None:
        log.warning("serving on %s without an API key: anyone who can reach this port can use the model", a.host)
    controller = None
    if a.ray:  # the loop runs in a named ControllerActor that other processes can attach to
        choose_threads(a.threads)
        from .actors import controller as ctl
        controller = ctl.start(a.controller_name, target=a.target, draft=a.draft, mode=a.mode, k=a.k,
                               budget=a.budget, batch_size=a.batch_size, max_queue=a.max_queue,
                               memory_budget=a.memory_budget, cold=a.cold, device=a.device, threads=a.threads,
                               address=a.address, stages=getattr(a, "stages", None),
                               split=getattr(a, "split", None))
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
    app = make_app(scheduler, name, api_key, a.max_new_tokens, host=a.host,
                   max_body_bytes=getattr(a, "max_body_bytes", httpguard.DEFAULT_MAX_BODY), shutdown_timeout=deadline)
    server = _draining(uvicorn.Config(app, host=a.host, port=a.port, log_level="warning",
                                      timeout_graceful_shutdown=deadline), scheduler, deadline)
    if threading.current_thread() is threading.main_thread():
        # uvicorn sends itself the SIGTERM it caught again once it has shut down (for the default action, death
        # by signal): this handler takes it instead, so a requested stop exits with status 0
        signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    log.info("serving %s on http://%s:%d/v1 (mode %s, batch size %d)", name, a.host, a.port, a.mode, a.batch_size)
    try:
        server.run()
    finally:
        scheduler.close(timeout=server.left())
        if controller is not None:
            import ray
            try:
                ray.get(controller.close.remote(), timeout=server.left())
            except Exception as e:  # noqa: BLE001 (it is killed next either way)
                log.warning("the controller did not close cleanly: %s", e)
            ray.kill(controller)
    return 0


def _model_name(eng) -> str:
    import os

    store = getattr(eng, "store", None)
    root = getattr(eng, "root", None) or (store.root if store is not None else "streamspec")
    return os.path.basename(root.rstrip("/"))
