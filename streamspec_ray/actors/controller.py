"""The ControllerActor: one generation loop on a Ray cluster that several processes feed.

`streamspec serve --ray` (or `controller.start(...)`) starts a named actor in the "streamspec" namespace. It holds
the engine (a RayEngine: the LayerStoreActor, VerifierActor and DraftActor it owns, placed by Ray resources) and
runs the scheduler's loop (scheduler.py): everything submitted to it, from any process, shares its sweeps.
Another process on the same cluster attaches by name, `RayEngine.attach("streamspec")`, and its generate()
calls become requests in that loop; tokens come back by long polling, round by round.
"""
from __future__ import annotations

import logging
import queue
import threading
import uuid

import ray

from ..errors import ConfigError, StreamspecError
from ..speculative import batch
from ..speculative.sampling import SamplingParams
from .attached import NAMESPACE, AttachedEngine, RemoteScheduler, _unwrap  # noqa: F401 (controller.X users)
from .common import ensure_ray, normal_priority

log = logging.getLogger("streamspec")



class ControllerServer:
    """The plain class behind the actor. engine: "ray" (a RayEngine: store, verifier and draft actors) or
    "local" (an Engine inside this actor: the controller's node then reads the store itself). stages, split:
    RayEngine's (the target's layers on pipeline stage actors instead of one verifier; "ray" only)."""

    def __init__(self, target, draft, mode, k, budget, batch_size, max_queue, memory_budget, cold, device,
                 threads, engine="ray", stages=None, split=None):
        from ..scheduler import Scheduler

        normal_priority()
        kw = dict(target=target, draft=draft if mode != "naive" else None, memory_budget=memory_budget,
                  device=device, cold=cold)
        if engine == "ray":
            from .engine import RayEngine
            self.engine = RayEngine(**kw, threads=threads or "auto", stages=stages, split=split)
        elif stages is not None or split is not None:
            raise ConfigError("stages need engine=\"ray\" (a local engine has no stage actors)")
        else:
            from ..engine import Engine
            self.engine = Engine(**kw, threads=threads or "auto")
        self.engine._check_policy(mode, k, budget)
        self.mode = mode
        self.scheduler = Scheduler(self.engine, mode, k, budget, batch_size, max_queue)
        self.jobs: dict[str, object] = {}
        self.lock = threading.Lock()

    def info(self) -> dict:
        """What an attached client needs: the model's args and its tokenizer's files."""
        import os

        files = {}
        tok = self.engine.tokenizer
        if tok is not None:
            import tempfile
            with tempfile.TemporaryDirectory() as tmp:
                tok.save_pretrained(tmp)
                for name in os.listdir(tmp):
                    with open(os.path.join(tmp, name), "rb") as f:
                        files[name] = f.read()
        return {"args": self.engine.args, "tokenizer_files": files, "mode": self.mode}

    def submit(self, ids: list[int], max_new_tokens: int, temperature: float, top_p: float, top_k: int,
               seed: int) -> str:
        from ..scheduler import Job

        ids = self.engine.encode(prompt_ids=ids)
        self.engine.check_length(len(ids), max_new_tokens)
        req = batch.Request(ids, max_new_tokens, SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k),
                            seed, cancel=threading.Event())
        job = Job(req)
        try:
            self.scheduler.submit(job)
        except queue.Full:
            raise ConfigError("the controller is busy: its request queue is full, retry shortly") from None
        jid = uuid.uuid4().hex
        with self.lock:
            self.jobs[jid] = job
        return jid

    def next(self, jid: str, timeout: float = 1.0) -> dict:
        """The job's events since the last call (waiting up to `timeout` for the first): new tokens, and when it
        ended, why ("stop", "length", "cancelled") or the error."""
        with self.lock:
            job = self.jobs.get(jid)
        if job is None:
            raise ConfigError(f"no request {jid} on this controller")
        tokens, done, error, unavailable = [], None, None, False
        try:
            events = [job.events.get(timeout=timeout)]
        except queue.Empty:
            events = []
        while True:
            try:
                events.append(job.events.get_nowait())
            except queue.Empty:
                break
        for kind, payload in events:
            if kind == "tokens":
                tokens.extend(payload)
            elif kind == "done":
                done = payload
            else:  # error, or unavailable: it was queued when the loop failed or the controller closed
                error, unavailable = payload, kind == "unavailable"
        if done is not None or error is not None:
            with self.lock:
                self.jobs.pop(jid, None)
        return {"tokens": tokens, "done": done, "error": error, "unavailable": unavailable}

    def cancel(self, jid: str) -> None:
        with self.lock:
            job = self.jobs.get(jid)
        if job is not None:
            job.req.cancel.set()

    def stats(self) -> dict:
        m = self.scheduler.metrics
        return {"sweeps": m.sweeps._value.get(), "sequences": m.rows._value.get(), "tokens": m.tokens._value.get(),
                "bytes_read": m.bytes_read._value.get(), "active": m.active._value.get(),
                "queued": self.scheduler.source.waiting(), "health": self.scheduler.health()}

    def close(self) -> None:
        self.scheduler.close()
        if hasattr(self.engine, "close"):
            self.engine.close()


def start(name: str = "streamspec", *, target=None, draft="self-int4", mode="chain", k="adaptive",
          budget="adaptive", batch_size=8, max_queue=64, memory_budget=None, cold=False, device="cpu", threads=None,
          engine="ray", address=None, timeout_s: float = 600.0, stages=None, split=None):
    """Start the named ControllerActor (refused if one with that name runs) and wait until its engine is built.
    Returns its handle; it lives as long as the process that started it. stages, split: RayEngine's."""
    ensure_ray(address)
    try:
        ray.get_actor(name, namespace=NAMESPACE)
        raise ConfigError(f"a controller named {name!r} already runs on this cluster (attach to it instead)")
    except ValueError:
        pass
    import torch

    actor = ray.remote(num_cpus=0, max_concurrency=64)(ControllerServer).options(
        name=name, namespace=NAMESPACE).remote(target, draft, mode, k, budget, batch_size, max_queue,
                                                memory_budget, cold, device,
                                                threads or torch.get_num_threads(), engine, stages, split)
    try:
        ray.get(actor.info.remote(), timeout=timeout_s)
    except ray.exceptions.RayActorError as e:
        cause = _unwrap(e)
        raise cause if cause is not e else StreamspecError(f"controller failed to start: {e}") from None
    return actor
