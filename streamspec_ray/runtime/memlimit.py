"""Run a command inside a memory cgroup, to show that a model really streams.

`streamspec generate ... --memory-limit 1.2GB` runs the generation in a child process that is placed in a
fresh memory cgroup *before it execs*, so everything it ever holds (heap, mmaps, shared memory it faults
in, and the page cache of the files it reads) is charged to that cgroup and capped by its limit. The peak is
the kernel's own number (v1 memory.max_usage_in_bytes, v2 memory.peak), not a sampled RSS, which would
miss the page cache and short spikes.

Pages already in the page cache stay charged to whoever read them first, so the files the run will read
are evicted before it starts (`evict`); otherwise a store read earlier would be free to the limited run.

Also what this process's own cgroup says: its limit (`own_limit`, `limit_bytes`) and its memory-pressure counters
(`pressure`). The memory plan a streaming run makes from them is memplan.py's.

Plain Python on purpose (no ray, no torch): the parent only waits, and the child imports the heavy parts.
"""
from __future__ import annotations

import errno
import itertools
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from typing import Iterable

from ..errors import StreamspecError

CGROUP_ENV = "STREAMSPEC_CGROUP"  # set in the child: the cgroup it runs in, so it can report its own peak
_names = itertools.count()


class MemoryLimitError(StreamspecError):
    """Memory cannot be limited here (no memory cgroup controller, or no right to make a child cgroup)."""


def locate(proc_cgroup: str = "/proc/self/cgroup", mountinfo: str = "/proc/self/mountinfo") -> tuple[str, int]:
    """This process's memory cgroup directory and the cgroup version (1 or 2) that provides it.

    A v1 memory hierarchy wins over v2: on hybrid systems the v2 mount (/sys/fs/cgroup/unified) usually has
    no memory controller. The mount's root is stripped from the cgroup path, for containers without a
    cgroup namespace, where /proc/self/cgroup shows the host path but only its subtree is mounted."""
    paths = {}  # controller ("memory") or "" (v2) -> path
    with open(proc_cgroup) as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                paths[c] = path
    v1 = v2 = None
    with open(mountinfo) as f:
        for line in f:
            left, right = line.split(" - ", 1)
            root, mountpoint = left.split()[3:5]
            fstype, _, superopts = right.split()[:3]
            if fstype == "cgroup" and "memory" in superopts.split(",") and "memory" in paths:
                v1 = v1 or (root, mountpoint)
            elif fstype == "cgroup2" and "" in paths:
                with open(os.path.join(mountpoint, "cgroup.controllers")) as c:
                    if "memory" in c.read().split():
                        v2 = v2 or (root, mountpoint)
    for version, found, key in ((1, v1, "memory"), (2, v2, "")):
        if found:
            root, mountpoint = found
            path = paths[key]
            if root != "/" and (path + "/").startswith(root + "/"):
                path = path[len(root):]
            return os.path.normpath(os.path.join(mountpoint, path.lstrip("/"))), version
    raise MemoryLimitError("cannot limit memory: no memory cgroup controller is mounted (neither a cgroup v1 "
                           "memory hierarchy nor cgroup v2 with the memory controller)")


def _v2_parent(own: str) -> str:
    """Where a v2 child with its own memory.max can go. Enabling memory for children of our own cgroup fails
    (EBUSY) while it holds processes (the no-internal-process rule), so fall back to a sibling."""
    ctl = os.path.join(own, "cgroup.subtree_control")
    try:
        with open(ctl) as f:
            if "memory" not in f.read().split():
                with open(ctl, "w") as w:
                    w.write("+memory")
        return own
    except OSError as e:
        up = os.path.dirname(own)
        try:
            with open(os.path.join(up, "cgroup.subtree_control")) as f:
                if "memory" in f.read().split() and os.access(up, os.W_OK):
                    return up
        except OSError:
            pass
        raise MemoryLimitError(f"cannot limit memory: cgroup v2 will not enable the memory controller below "
                               f"{own} ({e.strerror}); run inside a delegated cgroup (e.g. `systemd-run --user "
                               f"--scope -p Delegate=yes ...`) or as root") from None


class MemoryCgroup:
    """A child memory cgroup `streamspec-<pid>-<n>`, by default under this process's own memory cgroup.

    `parent` (with `version`, guessed from the files if omitted) injects another place, e.g. in tests."""

    def __init__(self, parent: str | None = None, version: int | None = None):
        if parent is None:
            parent, version = locate()
            if version == 2:
                parent = _v2_parent(parent)
        elif version is None:
            version = 2 if os.path.exists(os.path.join(parent, "cgroup.controllers")) else 1
        self.version = version
        self.path = os.path.join(parent, f"streamspec-{os.getpid()}-{next(_names)}")
        try:
            os.mkdir(self.path)
        except OSError as e:
            hint = ("run as root or give this user a delegated cgroup" if e.errno in (errno.EACCES, errno.EPERM)
                    else "is cgroupfs mounted read-only?" if e.errno == errno.EROFS else "")
            raise MemoryLimitError(f"cannot create a memory cgroup under {parent} (cgroup v{version}): "
                                   f"{e.strerror}" + (f"; {hint}" if hint else "")) from None
        if not os.path.exists(self._file("memory.limit_in_bytes", "memory.max")):
            os.rmdir(self.path)
            raise MemoryLimitError(f"cannot limit memory: {parent} is not a cgroup v{version} memory cgroup")

    def _file(self, v1: str, v2: str) -> str:
        return os.path.join(self.path, v1 if self.version == 1 else v2)

    def _read(self, v1: str, v2: str) -> str | None:
        try:
            with open(self._file(v1, v2)) as f:
                return f.read()
        except OSError:
            return None

    def _write(self, name: str, value: str, required: bool = True) -> None:
        try:
            with open(os.path.join(self.path, name), "w") as f:
                f.write(value)
        except OSError as e:
            if required:
                raise MemoryLimitError(f"cannot write {value!r} to {self.path}/{name}: {e.strerror}") from None

    def _key(self, v1: str, v2: str, key: str) -> int | None:
        """A `key N` line of a flat-keyed file (memory.oom_control, memory.events)."""
        text = self._read(v1, v2)
        for line in (text or "").splitlines():
            k, _, n = line.partition(" ")
            if k == key:
                return int(n)
        return None

    def set_limit(self, limit_bytes: int) -> None:
        """Cap memory at `limit_bytes`, swap at zero where the kernel lets us: pages swapped out would escape
        the limit, and the run would look leaner than it is."""
        if self.version == 1:
            self._write("memory.limit_in_bytes", str(limit_bytes))
            self._write("memory.memsw.limit_in_bytes", str(limit_bytes), required=False)  # absent: no swap accounting
            self._write("memory.swappiness", "0", required=False)
        else:
            self._write("memory.max", str(limit_bytes))
            self._write("memory.swap.max", "0", required=False)

    def add(self, pid: int) -> None:
        """Move `pid` in; only what it allocates from now on is charged here."""
        self._write("cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        return [int(p) for p in (self._read("cgroup.procs", "cgroup.procs") or "").split()]

    def peak(self) -> int | None:
        text = self._read("memory.max_usage_in_bytes", "memory.peak")
        return int(text) if text else None

    def current(self) -> int | None:
        text = self._read("memory.usage_in_bytes", "memory.current")
        return int(text) if text else None

    def failcnt(self) -> int | None:
        """How often usage hit the limit (v1 memory.failcnt, v2 the `max` event)."""
        if self.version == 1:
            text = self._read("memory.failcnt", "")
            return int(text) if text else None
        return self._key("", "memory.events", "max")

    def oom_killed(self) -> bool:
        return bool(self._key("memory.oom_control", "memory.events", "oom_kill"))

    def remove(self) -> None:
        """Kill what is left in it (daemons the child left behind: a cgroup with tasks cannot be removed) and
        rmdir it; v1 reclaims its charged pages (force_empty) if the plain rmdir is refused."""
        for attempt in range(50):
            if not os.path.isdir(self.path):
                return
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if attempt == 49:
                    raise MemoryLimitError(f"cannot remove cgroup {self.path}: {e.strerror}") from None
                if self.version == 1 and attempt == 0:
                    self._write("memory.force_empty", "0", required=False)
            time.sleep(0.05)

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def available(parent: str | None = None) -> str | None:
    """None if a memory cgroup can be made here, else the one-line reason it cannot (tests skip with it)."""
    try:
        MemoryCgroup(parent).remove()
        return None
    except (MemoryLimitError, OSError) as e:
        return str(e)


def evict(paths: Iterable[str]) -> None:
    """Drop these files (directories: recursively) from the page cache, so that the limited run pays for
    reading them rather than finding them cached and charged to someone else. Dirty pages are written first
    (fdatasync), since DONTNEED skips them; files that vanish meanwhile are skipped."""
    for top in paths:
        files = [top]
        if os.path.isdir(top):
            files = [os.path.join(d, n) for d, _, names in os.walk(top) for n in names]
        for path in files:
            try:
                fd = os.open(path, os.O_RDONLY)
            except (FileNotFoundError, NotADirectoryError):
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


@dataclass
class LimitedRun:
    returncode: int  # negative: killed by that signal (-9 with oom_killed: the limit was too small)
    peak_bytes: int | None
    limit_bytes: int
    oom_killed: bool


def _wait_forwarding(proc: subprocess.Popen) -> int:
    """Wait, passing SIGINT/SIGTERM on to the child so it can stop cleanly (and the cgroup be removed)."""
    if threading.current_thread() is not threading.main_thread():
        return proc.wait()
    forward = lambda sig, frame: proc.send_signal(sig)  # noqa: E731  (no-op once the child is reaped)
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_limited(argv: list[str], limit_bytes: int, evict_paths: Iterable[str] = (), env: dict | None = None,
                stdout=None, parent: str | None = None, stderr=None) -> LimitedRun:
    """Run `argv` in a fresh memory cgroup limited to `limit_bytes`; the cgroup is gone when this returns.

    The child joins the cgroup itself between fork and exec (preexec_fn), so nothing it allocates is
    charged elsewhere. stdin is inherited; stdout and stderr too unless given (tests and benches capture them)."""
    with MemoryCgroup(parent) as cg:
        cg.set_limit(limit_bytes)
        evict(evict_paths)
        env = {**(os.environ if env is None else env), CGROUP_ENV: cg.path}
        procs = os.path.join(cg.path, "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))

        try:
            proc = subprocess.Popen(argv, env=env, stdout=stdout, stderr=stderr, preexec_fn=join)
        except subprocess.SubprocessError as e:
            raise MemoryLimitError(f"cannot start {argv[0]} in {cg.path}: {e}") from None
        returncode = _wait_forwarding(proc)
        return LimitedRun(returncode, cg.peak(), limit_bytes, cg.oom_killed())


def own_cgroup_peak() -> int | None:
    """In a child of run_limited: the peak of its cgroup so far (None when not run that way)."""
    path = os.environ.get(CGROUP_ENV)
    for name in ("memory.max_usage_in_bytes", "memory.peak") if path else ():
        try:
            with open(os.path.join(path, name)) as f:
                return int(f.read())
        except OSError:
            continue
    return None


def own_limit() -> int | None:
    """This process's memory cgroup limit in bytes (a run_limited child's cgroup, else its own), or None."""
    path = os.environ.get(CGROUP_ENV)
    if not path:
        try:
            path, _version = locate()
        except (MemoryLimitError, OSError, ValueError):
            return None
    for name in ("memory.limit_in_bytes", "memory.max"):
        try:
            with open(os.path.join(path, name)) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2 ** 60:  # (v1 says "no limit" with a page-rounded 2^63)
            return int(text)
        return None  # "max" (v2), or v1's no-limit figure
    return None


# memory.stat counters that say a limit is tight: pages faulted in from disk, pages charged in and out (v1),
# and pages the kernel evicted and then had to read again (v2's refaults)
_PRESSURE_KEYS = ("pgmajfault", "pgpgin", "pgpgout", "workingset_refault_file", "workingset_refault_anon")


def pressure() -> dict:
    """Memory-pressure counters now, to difference across a generation: this process's major page faults
    (getrusage: pages it had to read back from disk, its own code and libraries included) and, in a run_limited
    child, its cgroup's memory.stat counters (_PRESSURE_KEYS, as this kernel names them) and `limit_hits`, how
    often usage reached the limit and the kernel reclaimed (v1 memory.failcnt, v2 the `max` event)."""
    import resource

    out = {"major_faults": resource.getrusage(resource.RUSAGE_SELF).ru_majflt}
    path = os.environ.get(CGROUP_ENV)
    if not path:
        return out
    try:
        with open(os.path.join(path, "memory.stat")) as f:
            for line in f:
                k, _, n = line.partition(" ")
                if k in _PRESSURE_KEYS:
                    out["cgroup_" + k] = int(n)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(path, "memory.failcnt")) as f:
            out["limit_hits"] = int(f.read())
    except (OSError, ValueError):
        try:
            with open(os.path.join(path, "memory.events")) as f:
                for line in f:
                    k, _, n = line.partition(" ")
                    if k == "max":
                        out["limit_hits"] = int(n)
        except (OSError, ValueError):
            pass
    return out


def pressure_since(before: dict) -> dict:
    """pressure() now minus `before`, key by key (keys missing from either are left out)."""
    now = pressure()
    return {k: now[k] - before[k] for k in now if k in before}


def limit_bytes() -> int | None:
    """The memory limit this process runs under (its cgroup's, as own_limit), or None where there is none or it
    is no tighter than the machine's memory."""
    limit = own_limit()
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        total = None
    return None if limit is None or (total and limit >= total) else limit
