"""Where a conversion puts its store: what OUT may already be, the leftovers of killed conversions beside it,
and the swap of the finished store into place.

A store is written into the sibling folder `OUT.partial-PID` and renamed to OUT only once its manifest is on
disk, so a failed conversion never leaves a half store that looks whole, nor loses the store OUT held. A
conversion replaces only a store (a folder with a manifest) or an empty folder: it never deletes what a
conversion did not write.
"""
from __future__ import annotations

import logging
import os
import re
import shutil

from ..errors import StoreError
from .manifest import MANIFEST

log = logging.getLogger("streamspec")

# OUT.partial-PID: a store being written by process PID; OUT.replaced-PID: the store OUT held, set aside by
# PID while it renames the new one into place
_LEFTOVER = re.compile(r"\.(partial|replaced)-(\d{1,9})")


def is_store(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, MANIFEST))


def check_out(out: str, force: bool) -> None:
    """StoreError unless OUT is absent, an empty folder, or (force) a store. Checked before any work, and again
    just before the swap (OUT may have changed during a long conversion)."""
    if not os.path.lexists(out):
        return
    if os.path.islink(out):
        raise StoreError(f"{out} is a symbolic link: give the folder it points to, or another OUT")
    if not os.path.isdir(out):
        raise StoreError(f"{out} is a file, not a store folder: choose another OUT (nothing was changed)")
    if not os.listdir(out):
        return
    if not os.path.exists(os.path.join(out, MANIFEST)):
        raise StoreError(f"{out} already exists and is not a store (it has files but no {MANIFEST}); convert, "
                         f"even with --force, replaces only a store or an empty folder: choose another OUT")
    if not force:
        raise StoreError(f"{out} already exists and holds a store (pass --force to replace it)")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process)
        return True
    return True


def clean_stale(out: str) -> list[str]:
    """Remove what conversions into OUT that were killed left beside it: OUT.partial-PID folders, and
    OUT.replaced-PID folders when OUT holds a store again, whose process PID is gone. A live process's are its
    work in progress and are left. -> the paths removed."""
    parent, base = os.path.split(out)
    removed = []
    for name in os.listdir(parent or "."):
        m = _LEFTOVER.fullmatch(name[len(base):]) if name.startswith(base + ".") else None
        if m is None or _alive(int(m.group(2))):
            continue
        if m.group(1) == "replaced" and not is_store(out):
            continue  # (killed between its two renames: this is the only whole store left; keep it)
        path = os.path.join(parent, name)
        shutil.rmtree(path, ignore_errors=True)
        log.info("removed %s, left by a conversion whose process (pid %s) is gone", path, m.group(2))
        removed.append(path)
    return removed


def swap_in(tmp: str, out: str, force: bool) -> None:
    """Rename the finished store `tmp` to OUT. A store that OUT holds is first renamed aside and removed only
    once the new one is in place, so at every moment one whole store is at OUT or beside it."""
    check_out(out, force)
    aside = None
    if os.path.lexists(out):
        if is_store(out):
            aside = f"{out}.replaced-{os.getpid()}"
            shutil.rmtree(aside, ignore_errors=True)
            os.rename(out, aside)
        else:
            os.rmdir(out)  # (empty, as check_out just saw; rmdir refuses one that is not)
    try:
        os.rename(tmp, out)
    except BaseException:
        if aside is not None:
            os.rename(aside, out)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
