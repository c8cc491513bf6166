"""How much memory a streaming run may use, and the plan it makes at its first sweep: which target units to keep
in memory and how many of the others to read ahead (`plan`, a `MemoryPlan`), and whether to read with O_DIRECT
(`reads_direct`), from what this process holds (`held_bytes`), its memory limit (memlimit.limit_bytes) and, with
none, the memory the machine has available.

Plain Python on purpose (no ray, no torch), as memlimit.py, which runs commands in memory cgroups.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from ..quant import q4q8
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


def int4_kernel() -> str:
    """What an int4pack weight multiplies by in this process: "q4q8" where quant/q4q8.py runs, else "int4"."""
    return "q4q8" if q4q8.available() else "int4"


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
    # the target units of a sweep, those kept in memory from the first sweep on (their indices in the sweep's
    # order, chosen in hold_order), the memory they take, and the store bytes a sweep after the first reads (the
    # others')
    units: int = 0
    resident: tuple[int, ...] = ()
    resident_bytes: int = 0
    sweep_bytes: int = 0
    # what 4-bit units multiply by: "q4q8" (4-bit x 8-bit, quant/q4q8.py) or torch's "int4" kernel, "int8" where
    # everything is held and STREAMSPEC_INT8=1 converted it
    kernel: str = field(default_factory=int4_kernel)

    @property
    def resident_units(self) -> int:
        return len(self.resident)

    def describe(self) -> str:
        mb = lambda n: f"{n / 1e6:.0f} MB"  # noqa: E731
        under = f"under the {self.limit / 1e9:.2f} GB limit" if self.limit else "(no memory limit)"
        streamed = (f"{mb(self.read_ahead)} of streamed weights ({self.depth} units read ahead)"
                    if self.resident_units < self.units else "none streamed")
        text = (f"memory plan {under}: {mb(self.held)} held (runtime, draft, "
                f"embedding), {mb(self.reserve)} reserved for KV caches and activations, "
                f"{self.resident_units} of {self.units} target units resident ({mb(self.resident_bytes)}), "
                f"{streamed}, {mb(self.headroom)} kept free; a sweep after the first reads {mb(self.sweep_bytes)}"
                + ("; held units multiply in int8" if self.kernel == "int8" else ""))
        return text if self.fits else text + ": the limit is too tight to read ahead, expect page reclaim and stalls"

    def as_dict(self) -> dict:
        return {"limit_bytes": self.limit, "held_bytes": self.held, "reserve_bytes": self.reserve,
                "headroom_bytes": self.headroom, "read_ahead_bytes": self.read_ahead, "depth": self.depth,
                "fits": self.fits, "units": self.units, "resident_units": self.resident_units,
                "resident_bytes": self.resident_bytes, "sweep_read_bytes": self.sweep_bytes, "kernel": self.kernel}


def available_bytes() -> int | None:
    """The machine's MemAvailable, or None where /proc/meminfo has none."""
    return _kb_field("/proc/meminfo", "MemAvailable")


def widest(needs: list[int], depth: int) -> int:
    """The most bytes alive in a cycling pass over units of these sizes read `depth` ahead: its widest window of
    depth + 1 consecutive units (windows wrap round; a pass shorter than that is one window). 0 for no units."""
    n = len(needs)
    w = min(depth + 1, n)
    return max((sum(needs[(i + j) % n] for j in range(w)) for i in range(n)), default=0)


def read_ahead(needs: list[int], room: int) -> tuple[int, int]:
    """(depth, window): the deepest read-ahead over a cycling pass whose every window fits in `room`, and that
    window's bytes; (0, the largest unit) where not even one unit ahead fits."""
    depth, window = 0, max(needs, default=0)
    for d in range(1, len(needs)):
        w = widest(needs, d)
        if w > room:
            break
        depth, window = d, w
    return depth, window


# Units read ahead before any unit is held: as many reads in flight as the stream makes (prefetch.MAX_READERS),
# which an SSD needs to near its bandwidth (prefetch.py: cold 135M fp32 sweeps 648 ms reading one unit at a time,
# 400-450 ms two, 360 ms four). A deeper window only moves reads into the gap between sweeps, and only as far as
# the gap has time; a held unit's bytes, the same memory, are not read at all.
HOLD_DEPTH = 4


def hold_order(needs: list[int]) -> list[int]:
    """The order in which to keep units in memory: the largest first, ties in the pass's order. A big unit held
    (the real pair's 146 MB head among 29 MB layers) costs its bytes once where streamed it widens every window
    of the read-ahead by them, and its bytes are read every sweep all the same."""
    return sorted(range(len(needs)), key=lambda i: -needs[i])


def resident_count(needs: list[int], room: int, depth: int = HOLD_DEPTH) -> int:
    """How many units, in hold_order, to keep in memory: the most k such that for every j <= k the first j of
    them and a `depth` read-ahead over the rest (widest, in the pass's order) fit in `room`. Checked for every j,
    so k never falls as the room grows; a unit is held at a time, so the bytes a sweep reads fall a unit at a
    time, and all are held once the room holds all of them. A held unit costs its bytes once instead of a read
    every sweep."""
    order = hold_order(needs)
    k, held = 0, 0
    for j, i in enumerate(order, 1):
        held += needs[i]
        kept = set(order[:j])
        if held + widest([n for x, n in enumerate(needs) if x not in kept], depth) > room:
            break
        k = j
    return k


def plan(unit_needs: list[int], reserve: int, limit: int | None = None, held: int | None = None,
         available: int | None = None, hold: bool = False, unit_bytes: list[int] | None = None) -> MemoryPlan | None:
    """How far a sweep over units of these sizes (in stream order, bytes each needs alive) may read ahead: under
    this process's memory limit, the limit less what the process holds now, less `reserve`, less the headroom,
    bounds the streamed bytes alive at once; with no limit, the memory the machine has available (MemAvailable)
    less the same reserve and headroom (limit 0 in the plan). None where neither is known.
    hold: first keep as many units in memory as that room leaves (resident_count, the largest first), and read
    ahead over the others with what is left. unit_bytes: the units' bytes in the store, for the bytes a sweep reads (default:
    unit_needs)."""
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
    unit_bytes = unit_needs if unit_bytes is None else unit_bytes
    k = resident_count(unit_needs, room) if hold else 0
    kept = tuple(sorted(hold_order(unit_needs)[:k]))
    streamed = [need for i, need in enumerate(unit_needs) if i not in kept]
    resident = sum(unit_needs[i] for i in kept)
    if not streamed:  # (everything held: nothing left to read ahead)
        return MemoryPlan(limit, held, reserve, headroom, 0, 0, True, n, kept, resident, 0)
    depth, window = read_ahead(streamed, room - resident)
    fits = depth >= 1
    return MemoryPlan(limit, held, reserve, headroom, window if fits else max(streamed) * 2, max(depth, 1), fits,
                      n, kept, resident, sum(b for i, b in enumerate(unit_bytes) if i not in kept))
