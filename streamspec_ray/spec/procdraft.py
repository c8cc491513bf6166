"""A resident draft in a process of its own, so that drafting the next round runs beside the target's sweep.

On a CPU, the draft's forward and the target's sweep are both torch work driven from Python. As two threads of
one process they share the GIL and each loses 25-35% of its speed (the draft forward is half Python dispatch);
as two processes on two cores each keeps 90-95% (measured on this project's 2-core VM: a draft forward took
30.8 ms alone and 33.9 ms beside a sweep-like loop in another process, 41.5 ms beside it in another thread). So
the lookahead (spec/loop.Lookahead) pays for itself only when the draft lives in another process.

`ProcessDraft` wraps a ModelDraft. The child process gets the draft's tensors as shared memory (torch's
multiprocessing reductions: the weights are not copied), and from then on holds the draft's cache and state;
this process keeps the same object for what needs no cache of its own (a batch's twins). Requests run one at a
time in the child's main thread; a lookahead job runs in the child's background thread, the same Lookahead as
in-process, started by one message and taken (used or cancelled) by another:

    parent                                  child
    propose_tree(context, ...)  ──────────▶  take the prepared tree if its guess is `context`, else draft it
    start(context, spine, ...)  ──────────▶  guess the next context, grow its tree (background thread)
    target sweep                            ... drafting on the other core ...
    propose_tree(next context)  ──────────▶  ...

Outputs do not change: the same draft computes the same proposals, and the target verifies them. A sampled
round's generator crosses as its state (as the Ray DraftActor's does), so a seeded run draws what it draws in
process.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from multiprocessing.connection import Connection

import torch

from ..errors import StreamspecError
from .drafts import Draft
from .loop import Lookahead, RoundLog

log = logging.getLogger("streamspec")


class DraftProcessLost(StreamspecError):
    """The draft's process ended (killed, out of memory) in the middle of a generation."""


def _child(fd: int, threads: int) -> None:
    """The child's entry point (python -c): its end of the socket, and the parent's key for the tensors'
    shared memory, which travels as file descriptors through multiprocessing's resource sharer."""
    mp.current_process().authkey = bytes.fromhex(os.environ.pop("STREAMSPEC_DRAFT_KEY"))
    _serve(Connection(fd), threads)


def _spawn(threads: int) -> tuple[Connection, subprocess.Popen]:
    """Start the child as `python -c` rather than multiprocessing's spawn, which re-runs the parent's main
    script in the child: a script without an `if __name__ == "__main__"` guard would then start it again."""
    mine, theirs = socket.socketpair()
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, STREAMSPEC_DRAFT_KEY=mp.current_process().authkey.hex(),
               PYTHONPATH=os.pathsep.join(p for p in (package, os.environ.get("PYTHONPATH")) if p))
    code = f"from streamspec_ray.spec.procdraft import _child; _child({theirs.fileno()}, {threads})"
    proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),), env=env,
                            stdin=subprocess.DEVNULL)
    theirs.close()
    return Connection(mine.detach()), proc


def _serve(conn, threads: int) -> None:
    """The child: receive the draft, then answer requests until "close" or the parent goes away."""
    torch.set_num_threads(threads)
    draft = conn.recv()
    ahead = Lookahead(draft, RoundLog())
    ahead.MIN_FULL = 0.0  # (the parent decides which rounds to prepare: its Lookahead observes the outcomes)
    ahead.threads = 1  # (the other core runs the sweep; a request the round waits for sets its own count)
    while True:
        try:
            op, *args = conn.recv()
        except (EOFError, OSError):
            return
        if op == "close":
            ahead.close()
            conn.send(("ok", None))
            return
        if op == "start":  # (no reply: the parent goes on to sweep)
            ahead.start(*args)
            continue
        try:
            if op == "take":
                before = (ahead.log.draft_hidden_s, ahead.log.reused)
                prepared, wait = ahead.take(args[0])
                reply = (prepared, wait, ahead.log.draft_hidden_s - before[0])
            elif op == "reset":
                ahead.close()
                draft.reset()
                reply = None
            elif op == "propose":
                context, k, params, state, n = args
                torch.set_num_threads(n)
                gen = None
                if state is not None:
                    gen = torch.Generator()
                    gen.set_state(state)
                out = draft.propose(context, k, params, gen)
                reply = (out, None if gen is None else gen.get_state())
            else:  # propose_tree
                *targs, n = args
                torch.set_num_threads(n)
                reply = draft.propose_tree(*targs)
            conn.send(("ok", reply))
        except Exception as e:  # the parent raises it: one clear error, the child keeps serving
            conn.send(("error", e))


class ProcessDraft(Draft):
    """A ModelDraft served from a child process (see the module docstring). `threads`: torch's threads for the
    drafting a round waits for (the lookahead drafts on one)."""

    def __init__(self, draft, threads: int = 1):
        self.local = draft
        self.name, self.resident_bytes = draft.name, draft.resident_bytes
        self.threads = threads
        t0 = time.perf_counter()
        self.conn, self.proc = _spawn(threads)
        self.conn.send(draft)  # the tensors travel as shared memory, not copies
        _trim()
        self.lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _stop, self.conn, self.proc)
        log.debug("draft process %d started in %.1f s", self.proc.pid, time.perf_counter() - t0)

    def __getattr__(self, name):  # what needs no cache of its own (twin, forward_batch, args): the local draft
        if name in ("local", "__setstate__"):
            raise AttributeError(name)
        return getattr(self.local, name)

    def __getstate__(self):
        raise TypeError("a ProcessDraft stays in its process: ship its .local draft instead")

    def _call(self, op: str, *args, reply: bool = True):
        with self.lock:
            try:
                self.conn.send((op, *args))
                if not reply:
                    return None
                status, value = self.conn.recv()
            except (EOFError, OSError, BrokenPipeError):
                code = self.proc.poll()
                code = "still running" if code is None else code
                raise DraftProcessLost(f"the draft process ended (exit code {code}); "
                                       f"restart the engine to draft again") from None
        if status == "error":
            raise value
        return value

    def reset(self) -> None:
        self._call("reset")

    def propose(self, context, k, params, generator):
        t0 = time.perf_counter()
        out, state = self._call("propose", list(context), k, params,
                                None if generator is None else generator.get_state(), self.threads)
        if generator is not None:
            generator.set_state(state)
        out.draft_s = time.perf_counter() - t0  # (the round waited for the messages too)
        return out

    def propose_tree(self, context, budget, params, max_depth):
        t0 = time.perf_counter()
        tree = self._call("propose_tree", list(context), budget, params, max_depth, self.threads)
        tree.draft_s = time.perf_counter() - t0
        return tree

    def lookahead(self, log_: RoundLog) -> "RemoteLookahead":
        return RemoteLookahead(self, log_)

    def close(self) -> None:
        self._finalizer()


def _trim() -> None:
    """Give back to the system the heap that the draft's tensors left when they moved into shared memory: glibc
    keeps freed blocks of this size (on the real pair's draft, ~200 MB stayed resident without this)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # (not glibc)
        pass


def _stop(conn, proc) -> None:
    try:
        conn.send(("close",))
        if conn.poll(5):
            conn.recv()
    except (EOFError, OSError, BrokenPipeError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    conn.close()


class RemoteLookahead(Lookahead):
    """Lookahead for a ProcessDraft: this process decides which rounds to prepare (observe, MIN_FULL) and the
    child prepares them beside the sweep."""

    def __init__(self, draft: ProcessDraft, log_: RoundLog):
        self.draft, self.log = draft, log_
        self.full = 0.5
        self.job = None

    def start(self, context, path, method: str, *args) -> None:
        if self.full < self.MIN_FULL:
            return
        self.draft._call("start", list(context), list(path), method, *args, reply=False)
        self.job = True
        self.log.prepared += 1

    def take(self, context):
        if self.job is None:
            return None, 0.0
        self.job = None
        prepared, wait, hidden = self.draft._call("take", list(context))
        self.log.draft_hidden_s += hidden
        if prepared is not None:
            self.log.reused += 1
        return prepared, wait
