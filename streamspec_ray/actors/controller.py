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
import time
import uuid

import ray

from ..errors import ConfigError, StreamspecError
from ..speculative import batch
from ..speculative.sampling import SamplingParams
from .common import ensure_ray, normal_priority

log = logging.getLogger("streamspec")

NAMESPACE = "streamspec"


class ControllerServer:
    """The plain class behind the actor. engine: "ray" (a RayEngine: store, verifier and draft actors) or
    "local" (an Engine inside this actor: the controller's node then reads the store itself)."""

    def __init__(self, target, draft, mode, k, budget, batch_size, max_queue, memory_budget, cold, device,
                 threads, engine="ray"):
        from ..scheduler import Scheduler

        normal_priority()
        kw = dict(target=target, draft=draft if mode != "naive" else None, memory_budget=memory_budget,
                  device=device, cold=cold)
        if engine == "ray":
            from .engine import RayEngine
            self.engine = RayEngine(**kw, threads=threads or "auto")
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


def _unwrap(e: Exception) -> Exception:
    """A StreamspecError raised in the actor comes back wrapped in a RayTaskError: give the original back."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, StreamspecError) else e


def start(name: str = "streamspec", *, target=None, draft="self-int4", mode="chain", k="adaptive",
          budget="adaptive", batch_size=8, max_queue=64, memory_budget=None, cold=False, device="cpu", threads=None,
          engine="ray", address=None, timeout_s: float = 600.0):
    """Start the named ControllerActor (refused if one with that name runs) and wait until its engine is built.
    Returns its handle; it lives as long as the process that started it."""
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
                                                threads or torch.get_num_threads(), engine)
    try:
        ray.get(actor.info.remote(), timeout=timeout_s)
    except ray.exceptions.RayActorError as e:
        cause = _unwrap(e)
        raise cause if cause is not e else StreamspecError(f"controller failed to start: {e}") from None
    return actor


class AttachedEngine:
    """A process's view of a running ControllerActor: generate() as Engine's, its requests sharing the
    controller's sweeps with everyone else's."""

    def __init__(self, name: str = "streamspec", address: str | None = None):
        ensure_ray(address)
        try:
            self.actor = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            raise ConfigError(f"no controller named {name!r} on this Ray cluster (start one with "
                              f"`streamspec serve --ray`)") from None
        info = ray.get(self.actor.info.remote())
        self.args, self.mode = info["args"], info["mode"]
        self.tokenizer = None
        if info["tokenizer_files"]:
            import os
            import tempfile

            from transformers import AutoTokenizer
            with tempfile.TemporaryDirectory(prefix="streamspec-tok-") as tmp:
                for fname, data in info["tokenizer_files"].items():
                    with open(os.path.join(tmp, fname), "wb") as f:
                        f.write(data)
                self.tokenizer = AutoTokenizer.from_pretrained(tmp)

    def encode(self, prompt=None, prompt_ids=None, chat=None) -> list[int]:
        from ..engine import encode_prompt

        return encode_prompt(self.tokenizer, prompt, prompt_ids, chat)

    def decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else None

    def generate(self, prompt=None, prompt_ids=None, max_new_tokens: int = 64, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int = 0, chat=None, on_tokens=None, **ignored):
        """As Engine.generate; the mode, K and draft are the controller's."""
        from ..engine import GenerationResult

        ids = self.encode(prompt, prompt_ids, chat)
        t0 = time.perf_counter()
        try:
            jid = ray.get(self.actor.submit.remote(ids, max_new_tokens, temperature, top_p, top_k, seed))
        except ray.exceptions.RayTaskError as e:
            raise _unwrap(e) from None
        tokens, reason = [], None
        try:
            while reason is None:
                ev = ray.get(self.actor.next.remote(jid, 1.0))
                if ev["tokens"]:
                    tokens.extend(ev["tokens"])
                    if on_tokens is not None:
                        on_tokens(ev["tokens"])
                if ev["error"] is not None:
                    err = StreamspecError(f"generation failed on the controller: {ev['error']}")
                    err.token_ids, err.text = tokens, self.decode(tokens)
                    raise err
                reason = ev["done"]
        except BaseException:
            if reason is None:
                self.actor.cancel.remote(jid)  # (Ctrl-C or an error here: free the slot)
            raise
        wall = time.perf_counter() - t0
        text = self.decode(tokens)
        return GenerationResult(tokens, text, reason, {"text": text, "token_ids": tokens, "finish_reason": reason,
                                                       "new_tokens": len(tokens), "mode": self.mode,
                                                       "wall_s": wall, "tokens_per_s": len(tokens) / wall
                                                       if wall > 0 else 0.0, "controller": "attached"})

    def stats(self) -> dict:
        return ray.get(self.actor.stats.remote())


class RemoteScheduler:
    """The HTTP server's scheduler when the loop runs in a ControllerActor (`serve --ray`): each job is submitted
    to the controller and a thread relays its tokens back; a cancelled job (client gone, stop string) is
    cancelled there. Metrics are the controller's, read when scraped."""

    def __init__(self, attached: AttachedEngine):
        from ..scheduler import Metrics

        self.engine, self.actor = attached, attached.actor
        self.metrics = Metrics()
        self.source = self  # (the server asks source.waiting())
        self.refusing: str | None = None  # (shutting down: set by the server)
        self.relayed: dict[int, object] = {}  # id -> job, for the jobs whose tokens a thread relays now

    def waiting(self) -> int:
        """Requests waiting in the controller's queue, from every attached process."""
        return int(ray.get(self.actor.stats.remote())["queued"])

    def refusal(self) -> str | None:
        """This server's own refusal (shutting down); the controller refuses on its own while its loop fails."""
        return self.refusing

    def health(self) -> dict:
        """The controller's health (its loop's failure, its active and queued requests)."""
        if self.refusing is not None:
            return {"status": "shutting down", "error": self.refusing}
        try:
            return ray.get(self.actor.stats.remote(), timeout=10)["health"]
        except Exception as e:  # noqa: BLE001 (the controller died or does not answer)
            return {"status": "error", "error": f"the controller does not answer: {_unwrap(e)}"}

    def refuse(self, reason: str) -> None:
        self.refusing = reason

    def cancel_running(self) -> None:
        for job in list(self.relayed.values()):  # (each relay cancels its job on the controller)
            job.req.cancel.set()

    def submit(self, job) -> None:
        from ..scheduler import Unavailable

        if self.refusing is not None:
            raise Unavailable(self.refusing)
        r = job.req
        try:
            jid = ray.get(self.actor.submit.remote(r.prompt_ids, r.max_new_tokens, r.params.temperature,
                                                   r.params.top_p, r.params.top_k, r.seed))
        except ray.exceptions.RayTaskError as e:
            e = _unwrap(e)
            if "queue is full" in str(e):
                raise queue.Full from None
            raise e from None
        self.relayed[id(job)] = job
        threading.Thread(target=self._relay, args=(job, jid), daemon=True, name="streamspec-relay").start()

    def _relay(self, job, jid: str) -> None:
        try:
            while True:
                if job.req.cancel.is_set():
                    self.actor.cancel.remote(jid)
                ev = ray.get(self.actor.next.remote(jid, 0.5))
                if ev["tokens"]:
                    job.push("tokens", ev["tokens"])
                if ev["error"] is not None:
                    job.push("unavailable" if ev.get("unavailable") else "error", ev["error"])
                    return
                if ev["done"] is not None:
                    job.push("done", ev["done"])
                    return
        except Exception as e:  # noqa: BLE001 (the controller died: this request ends with the error)
            job.push("error", str(_unwrap(e)))
        finally:
            self.relayed.pop(id(job), None)

    def refresh(self) -> None:
        """Copy the controller's counters into this server's metrics (called when /metrics is scraped)."""
        s = ray.get(self.actor.stats.remote())
        m = self.metrics
        for counter, key in ((m.sweeps, "sweeps"), (m.rows, "sequences"), (m.tokens, "tokens"),
                             (m.bytes_read, "bytes_read")):
            counter._value.set(s[key])
        m.active.set(s["active"])
        m.queued.set(s["queued"])

    def close(self, timeout: float = 30.0) -> None:
        self.refuse(self.refusing or "the server is shutting down")
        self.cancel_running()
