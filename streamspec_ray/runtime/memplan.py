"""How much memory a streaming run may use, and the plan it makes at its first sweep: how many units to read
ahead (`plan`, a `MemoryPlan`) and whether to read with O_DIRECT (`reads_direct`), from what this process holds
(`held_bytes`), its memory limit (memlimit.limit_bytes) and, with none, the memory the machine has available.

Plain Python on purpose (no ray, no torch), as memlimit.py, which runs commands in memory cgroups.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from .memlimit import CGROUP_ENV, limit_bytes, own_limit

log = logging.getLogger("streamspec")


def page_cache_room() -> int | None:
    """Bytes of page cache this process's reads could keep from one sweep to the next: the memory the machine
    has available (MemAvailable), or, in a memory cgroup with a limit, that limit minus what the process holds
    (its resident set), when smaller. None where neither is known."""
    room = available_bytes()
    limit = own_limit()
    if limit is not None:
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            rss = 0
        room = limit - rss if room is None else min(room, limit - rss)
    return None if room is None else max(0, room)


def reads_direct(sweep_bytes: int) -> bool:
    """Whether a store whose sweep reads `sweep_bytes` should be read with O_DIRECT: when the page cache has no
    room to keep those bytes until the next sweep (page_cache_room), every sweep reads the disk anyway, and reads
    through the page cache cost the kernel's copies (187-229 ms of CPU per 425 MB sweep on a 2-core VM, against
    12 ms with O_DIRECT). Says so in one log line when it chooses O_DIRECT."""
    room = page_cache_room()
    direct = room is not None and sweep_bytes > room
    if direct:
        log.info("reading the store with O_DIRECT: a sweep reads %.0f MB, and the page cache has room for %.0f MB "
                 "(--no-direct to read through it)", sweep_bytes / 1e6, room / 1e6)
    return direct


def held_bytes() -> int:
    """Bytes this process holds that its memory limit counts and that the kernel cannot drop for free: in a
    run_limited child, its cgroup's anonymous memory plus the file pages it maps (v1 rss + mapped_file, v2 anon +
    file_mapped; the page cache of files merely read is left out, it is dropped as needed), else its resident
    set. Freed heap is handed back to the system first (malloc_trim), so what a finished load left is not counted."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    path = os.environ.get(CGROUP_ENV)
    if path:
        try:
            with open(os.path.join(path, "memory.stat")) as f:
                stat = dict(line.split() for line in f if len(line.split()) == 2)
            if "rss" in stat:
                return int(stat["rss"]) + int(stat.get("mapped_file", 0))
            if "anon" in stat:
                return int(stat["anon"]) + int(stat.get("file_mapped", 0))
        except (OSError, ValueError):
            pass
    return resident_bytes()


def _kb_field(path: str, key: str) -> int | None:
    """The `key:  N kB` line of a /proc file, in bytes, or None where it has none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def resident_bytes() -> int:
    """This process's resident set now (VmRSS: its heap, the draft, buffers and the mapped code it touched)."""
    return _kb_field("/proc/self/status", "VmRSS") or 0


# Kept free under a limit: at the limit the kernel reclaims file pages, torch's and Python's own code among them,
# and they fault back in on the next call (issue 37: the real pair's sweep at 1.18 s of compute on its pages'
# refaults, the cgroup's peak 1.199997 GB of 1.200)
HEADROOM_FRACTION, HEADROOM_MIN = 0.08, 64 << 20


@dataclass
class MemoryPlan:
    """What a streaming run plans to hold under a memory limit, decided at its first sweep (StreamingExecutor)."""
    limit: int        # the cgroup's limit (0: none, the machine's available memory bounds the plan)
    held: int         # resident when the plan was made: the runtime, the draft, a resident embedding, caches
    reserve: int      # growth still to come: KV caches and a sweep's activations and logits
    headroom: int     # kept free, so the kernel need not reclaim the process's own pages
    read_ahead: int   # bytes of streamed weights alive at once: the unit computing and those read ahead
    depth: int        # units read ahead
    fits: bool        # whether the largest unit plus one read ahead fit beside the rest

    def describe(self) -> str:
        mb = lambda n: f"{n / 1e6:.0f} MB"  # noqa: E731
        under = f"under the {self.limit / 1e9:.2f} GB limit" if self.limit else "(no memory limit)"
        text = (f"memory plan {under}: {mb(self.held)} held (runtime, draft, "
                f"embedding), {mb(self.reserve)} reserved for KV caches and activations, {mb(self.read_ahead)} of "
                f"streamed weights ({self.depth} units read ahead), {mb(self.headroom)} kept free")
        return text if self.fits else text + ": the limit is too tight to read ahead, expect page reclaim and stalls"

    def as_dict(self) -> dict:
        return {"limit_bytes": self.limit, "held_bytes": self.held, "reserve_bytes": self.reserve,
                "headroom_bytes": self.headroom, "read_ahead_bytes": self.read_ahead, "depth": self.depth,
                "fits": self.fits}


def available_bytes() -> int | None:
    """The machine's MemAvailable, or None where /proc/meminfo has none."""
    return _kb_field("/proc/meminfo", "MemAvailable")


def plan(unit_needs: list[int], reserve: int, limit: int | None = None, held: int | None = None,
         available: int | None = None) -> MemoryPlan | None:
    """How far a sweep over units of these sizes (in stream order, bytes each needs alive) may read ahead: under
    this process's memory limit, the limit less what the process holds now, less `reserve`, less the headroom,
    bounds the streamed bytes alive at once; with no limit, the memory the machine has available (MemAvailable)
    less the same reserve and headroom (limit 0 in the plan). None where neither is known."""
    limit = limit_bytes() if limit is None else limit
    if not unit_needs:
        return None
    if limit:
        held = held_bytes() if held is None else held
        budget = limit
    else:
        available = available_bytes() if available is None else available
        if available is None:
            return None
        limit, held, budget = 0, 0, available
    headroom = max(HEADROOM_MIN, int(HEADROOM_FRACTION * budget))
    room = budget - held - reserve - headroom
    n = len(unit_needs)
    # the widest window of d + 1 consecutive units (the stream cycles: windows wrap) must fit in the room
    depth, window = 0, max(unit_needs)
    for d in range(1, n):
        widest = max(sum(unit_needs[(i + j) % n] for j in range(d + 1)) for i in range(n))
        if widest > room:
            break
        depth, window = d, widest
    fits = depth >= 1
    return MemoryPlan(limit, held, reserve, headroom, window if fits else max(unit_needs) * 2, max(depth, 1), fits)
