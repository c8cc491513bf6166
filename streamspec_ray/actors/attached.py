"""A process attached to a ControllerActor (`RayEngine.attach`, `streamspec serve --attach`): its generate()
calls become requests in the controller's loop (actors/controller.py), tokens coming back round by round.
Apart from the controller, so that RayEngine can attach without importing what builds one."""
from __future__ import annotations

import queue
import threading
import time

import ray

from ..errors import ConfigError, StreamspecError
from .common import ensure_ray

NAMESPACE = "streamspec"


def _unwrap(e: Exception) -> Exception:
    """A StreamspecError raised in the actor comes back wrapped in a RayTaskError: give the original back."""
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, StreamspecError) else e


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

            from ..store import tokenizer

            with tempfile.TemporaryDirectory(prefix="streamspec-tok-") as tmp:
                for fname, data in info["tokenizer_files"].items():
                    with open(os.path.join(tmp, fname), "wb") as f:
                        f.write(data)
                self.tokenizer = tokenizer.load(tmp)

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
