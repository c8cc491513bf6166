"""Supervised: an actor handle plus the recipe to make it again, so a call that fails because the actor died is
re-run on the restarted (or, once Ray's restarts are spent, recreated) actor."""
from __future__ import annotations

import logging
import time

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayTaskError

from .common import TIMEOUT_S, ActorFailure, StoreLost, cause, get

log = logging.getLogger("streamspec")


class Supervised:
    """`spawn()` creates the actor (a fresh handle). Ray restarts it in place up to `max_restarts` times; after
    that, or after `ray.kill(..., no_restart=True)`, a new one is spawned, within the same total of
    `max_restarts` revivals. max_restarts=0: the first death is final (ActorFailure)."""

    def __init__(self, role: str, spawn, max_restarts: int = 3, timeout_s: float = TIMEOUT_S, on_new=None,
                 wait: bool = True):
        self.role, self.spawn, self.max_restarts, self.timeout_s = role, spawn, max_restarts, timeout_s
        self.on_new = on_new  # called with the new handle after a recreation (e.g. tell the verifier)
        self.revivals = 0
        self.handle = spawn()
        self.info = None
        if wait:
            self.info = get(self.handle.ready.remote(), timeout_s, f"starting the {role} actor")

    @staticmethod
    def start_all(parts: list["Supervised"], timeout_s: float) -> None:
        """Wait for several actors' constructors at once (they build in parallel)."""
        try:
            infos = get([p.handle.ready.remote() for p in parts], timeout_s, "starting the actors")
        except RayActorError as e:
            raise ActorFailure(f"an actor died while starting: {e}") from None
        for p, info in zip(parts, infos):
            p.info = info

    def call(self, method: str, *args):
        """Run a method and wait for it (with the timeout); revive the actor and re-run it if the actor died."""
        while True:
            try:
                return get(getattr(self.handle, method).remote(*args), self.timeout_s, f"{self.role}.{method}")
            except RayActorError as e:
                self.revive(e)

    def revive(self, err: BaseException | None = None) -> None:
        """Wait for Ray's restart of the actor, or spawn a new one if it is dead for good."""
        if self.revivals >= self.max_restarts:
            raise ActorFailure(f"the {self.role} actor died and may not be restarted again "
                               f"(max_restarts={self.max_restarts}): {type(err).__name__ if err else 'lost'}")
        self.revivals += 1
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                self.info = get(self.handle.ready.remote(), self.timeout_s, f"restarting the {self.role} actor")
                log.warning("%s actor restarted by Ray (revival %d of %d)", self.role, self.revivals,
                            self.max_restarts)
                return
            except ActorDiedError:
                break  # restarts spent or killed with no_restart: make a new one
            except RayTaskError as e:  # restarted, but its setup failed with something we cannot fix
                raise ActorFailure(f"the {self.role} actor restarted but failed: {cause(e)!r}") from None
            except ActorUnavailableError:  # Ray is restarting it: ask again shortly
                if time.monotonic() > deadline:
                    raise ActorFailure(f"the {self.role} actor did not come back within {self.timeout_s:.0f} s") \
                        from None
                time.sleep(0.1)
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:  # already gone
            pass
        self.handle = self.spawn()
        try:
            self.info = get(self.handle.ready.remote(), self.timeout_s, f"recreating the {self.role} actor")
        except (RayActorError, RayTaskError) as e:
            raise ActorFailure(f"the {self.role} actor died and could not be recreated: {type(e).__name__}") from None
        log.warning("%s actor recreated (revival %d of %d)", self.role, self.revivals, self.max_restarts)
        if self.on_new is not None:
            self.on_new(self.handle)

    def kill(self) -> None:
        try:
            ray.kill(self.handle, no_restart=True)
        except Exception:
            pass


def with_store(store: Supervised, fn):
    """Run fn(); while it reports StoreLost (the layer store actor died under a verifier or draft), revive the
    store actor and run fn again. Bounded by the store's max_restarts (then ActorFailure)."""
    while True:
        try:
            return fn()
        except StoreLost as e:
            store.revive(e)


def spawn_named(spawn, timeout_s: float):
    """spawn() a named actor; if the name is still held by the actor just killed (Ray frees it once the death is
    recorded), try again for a while."""
    deadline = time.monotonic() + min(timeout_s, 60.0)
    while True:
        try:
            return spawn()
        except ValueError as e:
            if "already taken" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
