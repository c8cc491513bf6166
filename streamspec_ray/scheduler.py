"""The generation loop behind a server: requests arrive at any time and join the running batch between rounds.

One thread runs speculative/batch.run over a batch.Source (a bounded queue the loop polls without waiting while
sequences run, and waits on when none do), so up to `batch_size` requests share every streamed sweep and a
finished one's slot goes to the next. Each request's tokens are pushed to its Job as its rounds emit them.
Used by the HTTP server (serve.py) and by the Ray ControllerActor (actors/controller.py).

A loop that cannot run (its pipeline cannot be built, or fails outside any one sequence) is retried with a
backoff (0.5 s doubling to 30 s); until it runs again, `failure` says why, new requests are refused
(Unavailable) and the queued ones get an ("unavailable", message) event rather than waiting for a loop that may
never come back. A queued request whose client left (its cancel set) is dropped when the loop reaches it, never
admitted.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass

from .errors import StreamspecError, describe
from .speculative import batch

log = logging.getLogger("streamspec")


class Metrics:
    """Counters the /metrics endpoint exposes (prometheus_client, in a registry of the server's own)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = r = CollectorRegistry()
        self.tokens = Counter("streamspec_generated_tokens", "Tokens generated", registry=r)
        self.sweeps = Counter("streamspec_sweeps", "Target sweeps (each streams every layer once)", registry=r)
        self.rows = Counter("streamspec_sweep_sequences", "Sequences carried by sweeps, summed over sweeps",
                            registry=r)
        self.bytes_read = Counter("streamspec_bytes_read", "Weight bytes read from the store", registry=r)
        self.proposed = Counter("streamspec_draft_tokens_proposed", "Draft tokens verified", registry=r)
        self.accepted = Counter("streamspec_draft_tokens_accepted", "Draft tokens accepted", registry=r)
        self.requests = Counter("streamspec_requests", "Requests finished, by reason", ["reason"], registry=r)
        self.active = Gauge("streamspec_active_requests", "Requests generating now", registry=r)
        self.queued = Gauge("streamspec_queued_requests", "Requests waiting for a slot", registry=r)
        self.tokens_per_sweep = Gauge("streamspec_tokens_per_sweep", "Tokens generated per sweep, so far",
                                      registry=r)
        self.acceptance = Gauge("streamspec_acceptance_rate", "Draft tokens accepted / verified, so far", registry=r)

    def text(self) -> bytes:
        from prometheus_client import generate_latest

        sweeps = self.sweeps._value.get()
        proposed = self.proposed._value.get()
        self.tokens_per_sweep.set(self.tokens._value.get() / sweeps if sweeps else 0.0)
        self.acceptance.set(self.accepted._value.get() / proposed if proposed else 0.0)
        return generate_latest(self.registry)


class _Counted:
    """The loop's target, counting every sweep into the metrics."""

    def __init__(self, target, metrics: Metrics):
        self.target, self.metrics = target, metrics

    def __getattr__(self, name):
        return getattr(self.target, name)

    def sweep_batch(self, chunks):
        return self._count(*self.target.sweep_batch(chunks), len(chunks))

    def _count(self, logits, sweep, rows: int):
        self.metrics.sweeps.inc()
        self.metrics.rows.inc(rows)
        self.metrics.bytes_read.inc(sweep.bytes_read)
        return logits, sweep


class Unavailable(StreamspecError):
    """The scheduler takes no requests now: its loop cannot run, or the server is shutting down."""


@dataclass
class Job:
    """One request in flight: the engine thread pushes ("tokens", ids), ("done", reason), ("error", message) or
    ("unavailable", message) (it was queued when the loop failed or the server began shutting down) into
    `events`: an asyncio.Queue on `loop` (the HTTP server's), or without a loop a queue.Queue that threads
    read (the Ray controller's)."""
    req: batch.Request
    loop: asyncio.AbstractEventLoop | None = None
    events: object = None
    admitted: bool = False

    def __post_init__(self):
        if self.events is None:
            self.events = asyncio.Queue() if self.loop is not None else queue.Queue()

    def push(self, kind: str, payload) -> None:
        if self.loop is None:
            self.events.put((kind, payload))
        else:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


class Scheduler:
    """The generation loop, in a thread of its own: every submitted request joins the running batch between
    rounds (speculative/batch.run over a batch.Source). A failure of the loop ends the requests it was running with an
    error event and the queued ones with an unavailable event; the loop is retried after `backoff` seconds
    (doubling up to `max_backoff`, back to `backoff` once a sweep has run)."""

    def __init__(self, engine, mode: str = "chain", k="adaptive", budget="adaptive", batch_size: int = 8,
                 max_queue: int = 64, max_depth: int = 24, backoff: float = 0.5, max_backoff: float = 30.0):
        self.engine, self.batch_size = engine, batch_size
        self.policy = batch.Policy(mode, k, budget, max_depth)
        self.backoff, self.max_backoff = backoff, max_backoff
        self.metrics = Metrics()
        self.source = _Admitting(self, max_queue)
        self.jobs: dict[int, Job] = {}
        self.lock = threading.Lock()
        self.failure: str | None = None  # why the loop cannot run, while it cannot
        self.refusing: str | None = None  # why no request is taken (shutting down)
        self._wake = threading.Event()  # (cuts a backoff short on close)
        self.thread = threading.Thread(target=self._run, name="streamspec-serve-loop", daemon=True)
        self.thread.start()

    def refusal(self) -> str | None:
        """Why a new request would be refused now, or None."""
        if self.refusing is not None:
            return self.refusing
        if self.failure is not None:
            return f"the generation loop cannot run ({self.failure}); it is being retried"
        if not self.thread.is_alive():
            return "the generation loop has stopped"
        return None

    def health(self) -> dict:
        """{"status": "ok" | "error" | "shutting down", "active", "queued"} and, unless ok, "error": why."""
        why = self.refusing or self.failure or (None if self.thread.is_alive() else "the generation loop has stopped")
        out = {"status": "ok" if why is None else "shutting down" if self.refusing else "error",
               "active": int(self.metrics.active._value.get()), "queued": self.source.waiting()}
        if why is not None:
            out["error"] = why
        return out

    def submit(self, job: Job) -> None:
        """Queue a job; queue.Full when the queue is at its limit, Unavailable while the loop cannot run or the
        server is shutting down."""
        why = self.refusal()
        if why is not None:
            raise Unavailable(why)
        with self.lock:
            self.jobs[id(job.req)] = job
        try:
            self.source.put(job.req)
        except queue.Full:
            with self.lock:
                self.jobs.pop(id(job.req), None)
            raise
        self.metrics.queued.set(self.source.waiting())

    def refuse(self, reason: str) -> None:
        """Take no more requests (Unavailable(reason)); the queued ones get ("unavailable", reason) now, the
        running ones go on (cancel_running ends them)."""
        self.refusing = reason
        self._drain(reason)

    def cancel_running(self) -> None:
        """End every running sequence after its current round (finish_reason "cancelled")."""
        with self.lock:
            running = [j for j in self.jobs.values() if j.admitted]
        for j in running:
            if j.req.cancel is not None:
                j.req.cancel.set()

    def close(self, timeout: float = 30.0) -> None:
        """Stop: queued requests get an unavailable event, running ones are cancelled (not waited for), and the
        loop thread is given `timeout` seconds to end its current round."""
        self.refuse(self.refusing or "the server is shutting down")
        self.source.close()
        self.cancel_running()
        self._wake.set()
        self.thread.join(timeout=timeout)

    def _drain(self, reason: str) -> None:
        """Every request still queued gets ("unavailable", reason)."""
        while True:
            try:
                req = self.source.queue.get_nowait()
            except queue.Empty:
                break
            if req is not None:
                self._drop(req, "unavailable", reason)

    def _drop(self, req, kind: str, payload) -> None:
        """A queued request that will not run: its job gets (kind, payload), without ever being admitted."""
        with self.lock:
            job = self.jobs.pop(id(req), None)
        self.metrics.requests.labels("cancelled" if kind == "done" else kind).inc()
        self.metrics.queued.set(self.source.waiting())
        if job is not None:
            job.push(kind, payload)

    def _admitted(self, req) -> None:
        with self.lock:
            job = self.jobs.get(id(req))
        if job is not None:
            job.admitted = True
        self.metrics.active.inc()
        self.metrics.queued.set(self.source.waiting())

    def _tokens(self, req, tokens: list[int]) -> None:
        self.metrics.tokens.inc(len(tokens))
        with self.lock:
            job = self.jobs.get(id(req))
        if job is not None:
            job.push("tokens", list(tokens))

    def _finished(self, f: batch.Finished) -> None:
        self.metrics.active.dec()
        self.metrics.requests.labels(f.finish_reason).inc()
        self.metrics.proposed.inc(sum(f.log.nodes) if f.log.k else 0)
        self.metrics.accepted.inc(sum(f.log.accepted))
        with self.lock:
            job = self.jobs.pop(id(f.req), None)
        if job is not None:  # (a sequence that failed alone: the others in its batch went on)
            job.push(*(("error", f.error) if f.finish_reason == "error" else ("done", f.finish_reason)))

    def _run(self) -> None:
        import torch

        eos = self.engine.args.eos_token_id
        delay = self.backoff
        while not self.source.closed:
            sweeps = self.metrics.sweeps._value.get()
            try:
                with torch.inference_mode(), self.engine._batch_pipelines(self.policy.mode, 1) as pipelines:
                    self.failure = None  # (the pipeline was built: the loop runs)
                    counted = [(_Counted(t, self.metrics), d) for t, d in pipelines]
                    # (a staged engine's pipelines are groups of sequences over its stages, splitting the batch)
                    batch.run_all(counted, self.source, self.engine._batch_sizes(self.batch_size, len(counted)),
                                  self.policy, eos, self._finished, self._tokens)
            except Exception as e:  # noqa: BLE001 (the requests get the error; the loop is retried)
                message = describe(e)
                if self.metrics.sweeps._value.get() > sweeps:  # it had run: a new failure, not the same one again
                    delay = self.backoff
                self.failure = message
                log.error("the generation loop failed (%s): retrying in %.1f s", message, delay)
                with self.lock:
                    failed = [j for j in self.jobs.values() if j.admitted]
                    for j in failed:
                        self.jobs.pop(id(j.req), None)
                for j in failed:
                    self.metrics.active.dec()
                    self.metrics.requests.labels("error").inc()
                    j.push("error", message)
                self._drain(f"the generation loop cannot run ({message})")
                self._wake.wait(delay)
                delay = min(delay * 2, self.max_backoff)


class _Admitting(batch.Source):
    """A Source that tells the scheduler which requests the loop took (they are running, no longer queued), and
    drops the ones that should not start: their client left, or the server is shutting down."""

    def __init__(self, scheduler: Scheduler, limit: int):
        super().__init__(limit)
        self.scheduler = scheduler

    def __call__(self, block: bool):
        while True:
            req = super().__call__(block)
            if req is None:
                return None
            if req.cancel is not None and req.cancel.is_set():
                self.scheduler._drop(req, "done", "cancelled")
            elif self.scheduler.refusing is not None:
                self.scheduler._drop(req, "unavailable", self.scheduler.refusing)
            else:
                self.scheduler._admitted(req)
                return req
