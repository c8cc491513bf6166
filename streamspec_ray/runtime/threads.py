"""How many threads torch computes with.

A streamed sweep runs torch's matmuls while a reader thread fills the next buffers (runtime/prefetch.py).
torch's default, one thread per core, leaves the reader no core of its own, and on a machine that is also busy
with other work its threads wait on each other at every parallel region: on a busy 2-core machine the default
ran ~9x slower than one thread (66.7 s against 4.7 s of generation for 16 tokens). So the default here is the
cores this process may use, minus those the machine's other work keeps busy now (sampled from /proc/stat),
minus one for the reader, and never less than one.

Drafting between sweeps is different: the reader then has at most the next sweep's first units to read, so
the draft takes the reader's core too (`plan_threads`). On the real pair (Qwen2.5-Coder 0.5B drafting for the
1.5B, 2 cores, warm) two threads cut drafting from 403 to 266 ms per chain round and from 839 to 548 per tree
round. The threads a draft computes with do not change any output: the target verifies every proposal.
"""
from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch


def _cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies of the whole machine from /proc/stat, or None where there is none."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return sum(v[:8]) - idle, sum(v[:8])


def free_cores(sample_s: float = 0.1) -> tuple[int, int, float]:
    """(cores this process may use, cores that other work keeps busy, that busy figure unrounded). Busy is
    measured over `sample_s` from /proc/stat while this process waits (the 1-minute load average where there
    is no /proc/stat: it lags, and right after another heavy process ended it still counts that one)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    a = _cpu_times()
    if a is not None:
        time.sleep(sample_s)
        b = _cpu_times()
        total = (b[1] - a[1]) or 1
        load = (b[0] - a[0]) / total * (os.cpu_count() or cores)
    else:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = 0.0
    return cores, min(cores - 1, int(load + 0.5)), load


def plan_threads() -> tuple[int, int, str]:
    """(compute threads, drafting threads, why) for a streaming run on this machine, now."""
    cores, busy, load = free_cores()
    n = max(1, cores - busy - 1)
    why = f"{cores} cores, {load:.1f} busy with other work: {cores} - {busy} - 1 for the reader"
    return n, max(n, cores - busy), why


def resolve(threads: int | str | None = "auto") -> tuple[int, int, str]:
    """An engine's threads -> (compute threads, drafting threads, why), torch set to the compute count.
    "auto": plan_threads(); an integer: that many for both; None: torch's count as it is. Engine and RayEngine
    both take their counts from here, so the in-process and the actors' sweeps compute on the same threads and
    give the same bits."""
    from ..errors import ConfigError

    if threads is not None and not (threads == "auto" or (isinstance(threads, int) and not isinstance(threads, bool)
                                                          and threads >= 1)):
        raise ConfigError(f"threads must be a positive integer, 'auto' or None, got {threads!r}")
    drafting, why = None, "as given"
    if threads == "auto":
        threads, drafting, why = plan_threads()
    threads = choose_threads(threads) if threads is not None else torch.get_num_threads()
    return threads, drafting or threads, why


def default_threads() -> tuple[int, str]:
    """(threads, why) for a streaming run on this machine, now."""
    n, _, why = plan_threads()
    return n, why


def choose_threads(requested: int | None = None) -> int:
    """Set torch's compute threads: `requested` (--threads) if given, else default_threads(). -> the count."""
    if requested is None:
        requested, _why = default_threads()
    if requested != torch.get_num_threads():
        torch.set_num_threads(requested)
    return requested


@contextmanager
def using(n: int | None):
    """torch computes with `n` threads inside the block (None: as it is), then as before."""
    old = torch.get_num_threads()
    if n is None or n == old:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
