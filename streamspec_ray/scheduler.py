"""The generation loop behind a server: requests arrive at any time and join the running batch between rounds.

One thread runs spec/batch.run over a batch.Source (a bounded queue the loop polls without waiting while
sequences run, and waits on when none do), so up to `batch_size` requests share every streamed sweep and a
finished one's slot goes to the next. Each request's tokens are pushed to its Job as its rounds emit them.
Used by the HTTP server (serve.py) and by the Ray ControllerActor (actors/controller.py).
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass

from .spec import batch

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
        logits, sweep = self.target.sweep_batch(chunks)
        self.metrics.sweeps.inc()
        self.metrics.rows.inc(len(chunks))
        self.metrics.bytes_read.inc(sweep.bytes_read)
        return logits, sweep


@dataclass
class Job:
    """One request in flight: the engine thread pushes ("tokens", ids), ("done", reason) or ("error", message)
    into `events`: an asyncio.Queue on `loop` (the HTTP server's), or without a loop a queue.Queue that threads
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
    rounds (spec/batch.run over a batch.Source). A failure of the loop ends the requests it was running with an
    error event, and the loop starts again for the ones still waiting."""

    def __init__(self, engine, mode: str = "chain", k="adaptive", budget="adaptive", batch_size: int = 8,
                 max_queue: int = 64, max_depth: int = 24):
        self.engine, self.batch_size = engine, batch_size
        self.policy = batch.Policy(mode, k, budget, max_depth)
        self.metrics = Metrics()
        self.source = _Admitting(self, max_queue)
        self.jobs: dict[int, Job] = {}
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="streamspec-serve-loop", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        """Queue a job; queue.Full when the queue is at its limit."""
        with self.lock:
            self.jobs[id(job.req)] = job
        try:
            self.source.put(job.req)
        except queue.Full:
            with self.lock:
                self.jobs.pop(id(job.req), None)
            raise
        self.metrics.queued.set(self.source.waiting())

    def close(self) -> None:
        self.source.close()
        self.thread.join(timeout=30)

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
        if job is not None:
            job.push("done", f.finish_reason)

    def _run(self) -> None:
        import torch

        eos = self.engine.args.eos_token_id
        while not self.source.closed:
            try:
                with torch.inference_mode(), self.engine._batch_pipelines(self.policy.mode, 1) as pipelines:
                    counted = [(_Counted(t, self.metrics), d) for t, d in pipelines]
                    batch.run_all(counted, self.source, self.batch_size, self.policy, eos, self._finished,
                                  self._tokens)
            except Exception as e:  # noqa: BLE001 (each running request gets the error; the loop goes on)
                log.error("generation failed: %s", e)
                with self.lock:
                    failed = [j for j in self.jobs.values() if j.admitted]
                    for j in failed:
                        self.jobs.pop(id(j.req), None)
                for j in failed:
                    self.metrics.active.dec()
                    self.metrics.requests.labels("error").inc()
                    j.push("error", str(e))


class _Admitting(batch.Source):
    """A Source that tells the scheduler which requests the loop took (they are running, no longer queued)."""

    def __init__(self, scheduler: Scheduler, limit: int):
        super().__init__(limit)
        self.scheduler = scheduler

    def __call__(self, block: bool):
        req = super().__call__(block)
        if req is not None:
            self.scheduler._admitted(req)
        return req
