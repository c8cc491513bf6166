"""How many threads torch computes with.

A streamed sweep runs torch's matmuls while a reader thread fills the next buffers (runtime/prefetch.py).
torch's default, one thread per core, leaves the reader no core of its own, and on a machine that is also busy
with other work its threads wait on each other at every parallel region: on a busy 2-core machine the default
ran ~9x slower than one thread (66.7 s against 4.7 s of generation for 16 tokens). So the default here is the
cores this process may use, minus those the machine's other runnable work already keeps busy (the 1-minute
load average), minus one for the reader, and never less than one.
"""
from __future__ import annotations

import os

import torch


def default_threads() -> tuple[int, str]:
    """(threads, why) for a streaming run on this machine, now."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    busy = min(cores - 1, int(load + 0.5))
    n = max(1, cores - busy - 1)
    return n, f"{cores} cores, load {load:.1f}: {cores} - {busy} busy - 1 for the reader thread"


def choose_threads(requested: int | None = None) -> int:
    """Set torch's compute threads: `requested` (--threads) if given, else default_threads(). -> the count."""
    if requested is None:
        requested, _why = default_threads()
    if requested != torch.get_num_threads():
        torch.set_num_threads(requested)
    return requested
