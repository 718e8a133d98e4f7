"""Disk space: the one rule for writing into the cache when the disk may not hold it.

Every stage that writes a large artefact into the cache (a bundle build, a GGUF conversion)
keeps the same two promises, in one line each, as an ``InsufficientStorageError`` (507 on the
admin API, exit 1 on the CLI):

* **Up front** (:func:`require_free`): a stage whose estimated need exceeds the free space of
  the cache's filesystem is refused before it writes anything, naming both in GB/MB.
* **Part way** (:func:`disk_full`): a stage that still runs out of space (the estimate is a
  lower bound, or another process filled the disk meanwhile) turns ``ENOSPC``/``EDQUOT`` into
  the same error; the stage removes its staging directory, so nothing half-written stays.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from cachesvc.errors import DiskFullError, InsufficientStorageError

#: What the operator can do about either error.
REMEDY = "free space (e.g. `cachesvc prune`) or use a --cache-dir on a larger disk"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def human_size(n: int | float) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def free_bytes(path: Path) -> int:
    """Free bytes (for this user) of the filesystem holding ``path`` (its nearest existing parent)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


def require_free(path: Path, needed: int, what: str) -> None:
    """Refuse ``what`` (e.g. ``building org/m (profile)``) when it needs more than the free space
    of ``path``'s filesystem; nothing is written either way."""
    free = free_bytes(path)
    if needed > free:
        raise InsufficientStorageError(
            f"{what} needs about {human_size(needed)} of disk but {human_size(free)} is free in "
            f"{path}; {REMEDY}"
        )


def disk_full(exc: BaseException, what: str, path: Path) -> DiskFullError | None:
    """The one-line error for ``exc`` when it is the disk (or quota) being full, else None."""
    if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
        return DiskFullError(
            f"{what} ran out of disk space in {path}; nothing was kept. {REMEDY[0].upper()}{REMEDY[1:]}"
        )
    return None
