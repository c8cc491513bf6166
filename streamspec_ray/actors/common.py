"""Joining or starting Ray, placing actors by custom resource, and getting results with a timeout and a plain
error. Everything Ray-specific that the actor modules share lives here."""
from __future__ import annotations

import logging
import os
import secrets
import tempfile
import warnings

import numpy as np
import ray
import torch
from ray.exceptions import GetTimeoutError, RayTaskError

from ..errors import ConfigError, StreamspecError

STORE_RESOURCE = "streamspec_store"        # a node that holds the store's files
VERIFIER_RESOURCE = "streamspec_verifier"  # a node that runs the target (the accelerator node)
SHARE = 0.01                               # ask for a sliver: the resource marks a node, it does not count slots
TIMEOUT_S = 600.0                          # default for every ray.get (actor start includes building a draft)


class ActorFailure(StreamspecError):
    """An actor died and could not be brought back. `token_ids` (and `text`) hold what was emitted before."""

    def __init__(self, message: str, token_ids=()):
        super().__init__(message)
        self.token_ids = list(token_ids)
        self.text: str | None = None


class StoreLost(StreamspecError):
    """Raised inside the verifier when the layer store stops answering: the driver revives it and re-runs."""


class RingUnavailable(Exception):
    """The store actor could not map the verifier's shared ring (not on the same node after all, or /proc does
    not allow it): the verifier goes back to the object store."""


def ensure_ray(address: str | None = None) -> None:
    """Join `address` (or $RAY_ADDRESS) if given, else start an embedded, quiet, local Ray. No-op if connected."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_worker_niceness", "0")  # see normal_priority
    quiet = dict(log_to_driver=False, logging_level=logging.WARNING)
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, **quiet)
        return
    # a temp dir of our own (sockets, logs, spill), never the home folder; $RAY_TMPDIR wins if set
    tmp = os.environ.get("RAY_TMPDIR") or os.path.join(tempfile.gettempdir(), "streamspec-ray")
    if not any(v in os.environ for v in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        # Ray's default for a new local cluster: token auth with a token it writes to ~/.ray/auth_token, and a
        # warning on every start. Keep the auth, with a token for this session only, passed to Ray's processes
        # through the environment: nothing in the home folder, nothing printed
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
        ray._raylet.Config.initialize("")  # re-read the mode (cached when ray was imported), as Ray itself does
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, _temp_dir=tmp, **quiet)


def normal_priority() -> None:
    """Ray starts its workers at nice 15 (so its raylet wins the CPU); these actors are the engine's hot path,
    and at nice 15 any other busy process starves them (seen: sweeps 13x slower on a loaded 2-core VM). Raise
    back to 0 where allowed; ensure_ray also starts embedded Ray with RAY_worker_niceness=0."""
    try:
        if os.getpriority(os.PRIO_PROCESS, 0) > 0:
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    except OSError:  # not permitted (no CAP_SYS_NICE): keep Ray's default
        pass


def placement(resource: str | None, device: str = "cpu") -> dict:
    """Actor options that pin a role to the nodes carrying `resource`, if any node does (else Ray places it).
    On a CUDA device the actor also asks for half a GPU: Ray shows an actor only the GPUs it asked for, and the
    verifier and the draft share one."""
    have = ray.cluster_resources()
    opts: dict = {}
    if resource is not None and resource in have:
        opts["resources"] = {resource: SHARE}
    if device.startswith("cuda"):
        if have.get("GPU", 0) < 1:
            raise ConfigError(f"device {device!r} asked for, but the Ray cluster has no GPU")
        opts["num_gpus"] = 0.5
    return opts


def node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def cause(e: BaseException) -> BaseException:
    """The original exception behind (possibly nested) RayTaskErrors."""
    while isinstance(e, RayTaskError) and getattr(e, "cause", None) is not None and e.cause is not e:
        e = e.cause
    return e


def get(refs, timeout_s: float, what: str):
    """ray.get with a timeout; a StreamspecError raised inside an actor comes out as itself (one clear line).
    Actor deaths (RayActorError) pass through untouched: the caller decides whether to revive."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except GetTimeoutError:
        raise StreamspecError(f"{what}: no answer within {timeout_s:.0f} s") from None
    except RayTaskError as e:
        inner = cause(e)
        if isinstance(inner, StreamspecError):
            raise inner from None
        raise


def as_tensor(arr: np.ndarray) -> torch.Tensor:
    """A zero-copy uint8 tensor over an object-store buffer. Ray hands such buffers out read-only; nothing here
    writes to weights, so the (once-per-process) non-writable warning is noise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)
