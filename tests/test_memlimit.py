"""run_limited really caps memory (page cache included), reports the kernel's peak, and leaves no cgroup; the
memory plan (memplan) reads ahead as far as the limit leaves room for."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

from streamspec_ray.runtime import memlimit, memplan
from streamspec_ray.runtime.memlimit import MemoryCgroup, MemoryLimitError, locate, own_cgroup_peak, run_limited

MiB = 2**20
REASON = memlimit.available()
needs_cgroup = pytest.mark.skipif(REASON is not None, reason=f"no writable memory cgroup: {REASON}")


def alloc(mib: int) -> list[str]:
    """A child that allocates `mib` MiB and touches every page (untouched pages are never charged)."""
    code = f"b = bytearray({mib} * 2**20); b[::4096] = b'x' * len(b[::4096])"
    return [sys.executable, "-c", code]


@pytest.fixture
def no_leak():
    """After the test no streamspec cgroup of this process is left behind."""
    yield
    if REASON is None:
        parent, _ = locate()
        assert glob.glob(os.path.join(parent, f"streamspec-{os.getpid()}-*")) == []


@needs_cgroup
def test_peak_within_limit(no_leak):
    run = run_limited(alloc(200), 2**30)
    assert run.returncode == 0 and not run.oom_killed
    assert 200 * MiB <= run.peak_bytes <= 2**30, run


@needs_cgroup
def test_over_limit_is_killed(no_leak):
    run = run_limited(alloc(600), 256 * MiB)
    assert run.returncode != 0, run
    assert run.peak_bytes <= 256 * MiB, run
    if run.returncode == -9:  # killed by the OOM killer: v1 oom_control / v2 memory.events report it
        assert run.oom_killed, run


@needs_cgroup
def test_page_cache_is_charged_and_reclaimed(tmp_path, no_leak):
    path = tmp_path / "big.bin"
    block = os.urandom(MiB)
    with open(path, "wb") as f:
        for _ in range(300):
            f.write(block)
    code = (f"f = open({str(path)!r}, 'rb', buffering=0)\n"
            "n = 0\n"
            "while (b := f.read(1 << 20)): n += len(b)\n"
            "assert n == 300 << 20, n\n")
    run = run_limited([sys.executable, "-c", code], 128 * MiB, evict_paths=[str(tmp_path)])
    # a file over twice the limit is read: its cached pages are charged to the cgroup and reclaimed at the limit
    assert run.returncode == 0 and not run.oom_killed, run
    assert 100 * MiB <= run.peak_bytes <= 128 * MiB + 4 * MiB, run


@needs_cgroup
def test_child_sees_its_cgroup(tmp_path, no_leak):
    code = ("import os; from streamspec_ray.runtime.memlimit import own_cgroup_peak, CGROUP_ENV; "
            "print(os.environ[CGROUP_ENV]); print(own_cgroup_peak())")
    with open(tmp_path / "out", "w+") as out:
        run = run_limited([sys.executable, "-c", code], 2**30, stdout=out)
        out.seek(0)
        cgroup, peak = out.read().split()
    assert run.returncode == 0, run
    assert os.path.basename(cgroup).startswith(f"streamspec-{os.getpid()}-")
    assert not os.path.exists(cgroup)  # removed after the run
    assert 0 < int(peak) <= run.peak_bytes
    if memlimit.CGROUP_ENV not in os.environ:  # this process was not started by run_limited
        assert own_cgroup_peak() is None


@needs_cgroup
def test_cgroup_api(no_leak):
    with MemoryCgroup() as cg:
        assert os.path.isdir(cg.path)
        cg.set_limit(64 * MiB)
        assert cg.current() == 0 and cg.failcnt() == 0 and not cg.oom_killed()
        proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        cg.add(proc.pid)
        assert cg.pids() == [proc.pid]
        proc.stdin.close()
        proc.wait()
    assert not os.path.exists(cg.path)


def test_errors_are_one_clear_line(tmp_path, monkeypatch):
    with pytest.raises(MemoryLimitError, match="cannot create a memory cgroup under .*No such file"):
        MemoryCgroup(str(tmp_path / "absent"))
    with pytest.raises(MemoryLimitError, match="is not a cgroup v1 memory cgroup"):
        MemoryCgroup(str(tmp_path))
    assert os.listdir(tmp_path) == []  # the plain directory it made is gone again

    def denied(path, mode=0o777):
        raise PermissionError(13, "Permission denied", path)
    monkeypatch.setattr(memlimit.os, "mkdir", denied)
    with pytest.raises(MemoryLimitError, match="run as root or give this user a delegated cgroup"):
        MemoryCgroup(str(tmp_path))
    assert memlimit.available(str(tmp_path)).startswith("cannot create a memory cgroup")


def test_locate(tmp_path):
    cg = tmp_path / "cgroup"
    cg.write_text("4:memory:/docker/abc\n1:cpu:/\n0::/user.slice/x.scope\n")
    v1 = tmp_path / "v1"
    v1.write_text("35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n")
    assert locate(str(cg), str(v1)) == ("/sys/fs/cgroup/memory", 1)
    (tmp_path / "unified").mkdir()
    (tmp_path / "unified" / "cgroup.controllers").write_text("cpu io memory pids\n")
    v2 = tmp_path / "v2"
    v2.write_text(f"41 31 0:38 / {tmp_path}/unified rw,relatime - cgroup2 cgroup2 rw\n")
    assert locate(str(cg), str(v2)) == (f"{tmp_path}/unified/user.slice/x.scope", 2)
    (tmp_path / "unified" / "cgroup.controllers").write_text("cpu io pids\n")  # hybrid: v2 without memory
    with pytest.raises(MemoryLimitError, match="no memory cgroup controller"):
        locate(str(cg), str(v2))


def test_a_plan_reads_ahead_as_far_as_the_limit_leaves_room_for():
    """Under a limit the streamed bytes alive at once (the unit computing plus those read ahead, any window of
    the cycling pass) fit in the limit less what is held, the reserve and the headroom; with no limit, in the
    memory the machine has available less the same."""
    needs = [30 * MiB] * 28 + [120 * MiB]  # a pass: 28 layers, then the head
    plan = memplan.plan(needs, reserve=150 * MiB, limit=1200 * MiB, held=630 * MiB)
    room = 1200 * MiB - 630 * MiB - 150 * MiB - plan.headroom
    assert plan.fits and plan.headroom >= memplan.HEADROOM_MIN
    assert plan.read_ahead == 120 * MiB + plan.depth * 30 * MiB <= room < 120 * MiB + (plan.depth + 1) * 30 * MiB
    assert "kept free" in plan.describe() and plan.as_dict()["depth"] == plan.depth
    roomy = memplan.plan(needs, reserve=0, limit=64 << 30, held=0)
    assert roomy.depth == len(needs) - 1 and roomy.read_ahead == sum(needs)  # the whole pass
    tight = memplan.plan(needs, reserve=150 * MiB, limit=900 * MiB, held=630 * MiB)
    assert not tight.fits and "too tight" in tight.describe()
    free = memplan.plan(needs, reserve=0, limit=0, available=64 << 30)  # no limit: the machine's available memory
    assert free.limit == 0 and free.depth == len(needs) - 1 and "no memory limit" in free.describe()


@needs_cgroup
def test_a_limited_child_counts_what_it_holds_not_its_page_cache(tmp_path, no_leak):
    """held_bytes in a run_limited child: its anonymous memory, not the page cache of a file it only read."""
    big = tmp_path / "f"
    big.write_bytes(os.urandom(64 * MiB))
    code = ("from streamspec_ray.runtime import memlimit, memplan\n"
            "h0 = memplan.held_bytes()\n"
            f"data = open({str(big)!r}, 'rb').read(); del data  # (64 MB of page cache, the copy freed)\n"
            "h1 = memplan.held_bytes()\n"
            "b = bytearray(100 * 2**20); b[::4096] = b'x' * len(b[::4096])\n"
            "print(h0, h1, memplan.held_bytes(), memlimit.limit_bytes())")
    out = tmp_path / "out"
    with open(out, "w") as f:
        run = run_limited([sys.executable, "-c", code], 1 << 30, evict_paths=[str(big)], stdout=f)
    assert run.returncode == 0, run
    h0, h1, h2, limit = map(int, out.read_text().split())
    assert limit == 1 << 30
    assert abs(h1 - h0) < 16 * MiB and 100 * MiB <= h2 - h1 < 116 * MiB, (h0, h1, h2)
