"""Per-bundle file locks (portalocker, i.e. ``flock`` on POSIX).

One lock file per bundle, ``<locks>/<bundle_id>.lock``, taken in two modes:

* **exclusive** while building or deleting a bundle;
* **shared** (a *lease*) for as long as a process serves the bundle. Any number of processes
  can hold leases at once; a lease blocks the exclusive lock, so a bundle in use can be
  evicted by no process, this one included.

The kernel drops a lock when its holder dies, so a crashed process never leaves a bundle
locked. Correctness of the files themselves comes from atomic renames (see ``bundles``);
the lock only keeps two processes from doing the same work or deleting what is in use.

``flock`` locks belong to an *open file description*, not to a process: every acquisition
here opens the lock file afresh, so two acquisitions in one process conflict exactly as two
processes do (a lease taken through one ``BundleLocks`` blocks ``exclusive`` through another,
or through the same one). Lock files are never deleted: unlinking a lock file while another
process is about to lock it would let two processes "hold" different inodes under one name.

Holder records (``<locks>/<bundle_id>.holders/<host>-<pid>.json``) are for display only.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import stat
import threading
import time
import warnings
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any

import portalocker
from portalocker.exceptions import AlreadyLocked

from cachesvc.cache.store.layout import check_bundle_id, make_dir, write_atomic
from cachesvc.errors import LockTimeoutError

logger = logging.getLogger("cachesvc.store")

#: How often a blocked acquisition logs that it is still waiting (seconds).
LOG_INTERVAL = 5.0
_POLL_MIN = 0.01
_POLL_MAX = 0.2

# Leases held by this process, per holder-record path: the record is shared by all of them
# (its name is host-pid) and removed when the last one is released.
_local_leases: dict[Path, int] = {}
_local_leases_guard = threading.Lock()
# Exclusive locks held by this process, per lock file: who holds a bundle's lock can then be
# told apart (this process's build, or another process) without a record on disk.
_local_exclusive: dict[Path, int] = {}


def _host() -> str:
    return socket.gethostname() or "localhost"


def _safe_name(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", value)


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists on this host and is not a zombie."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        # A killed but unreaped child still answers kill(0); its locks are already gone.
        stat_line = Path(f"/proc/{pid}/stat").read_text()
        return stat_line.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


class Lease:
    """A shared lock on one bundle, held until :meth:`release` (or the end of a ``with`` block).

    Keep a reference for as long as the bundle is in use: the lock lives in an open file.
    """

    def __init__(self, bundle_id: str, fh: Any, record: Path) -> None:
        self.bundle_id = bundle_id
        self._fh: Any = fh
        self._record = record
        self._guard = threading.Lock()

    @property
    def held(self) -> bool:
        """True until the lease is released."""
        return self._fh is not None

    def release(self) -> None:
        """Drop the lease (idempotent). The holder record goes first, so it never outlives the lock."""
        with self._guard:
            fh, self._fh = self._fh, None
        if fh is None:
            return
        try:
            _drop_record(self._record)
        finally:
            _unlock_and_close(fh)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __del__(self) -> None:
        if getattr(self, "_fh", None) is not None:
            warnings.warn(
                f"lease on bundle {self.bundle_id} was garbage-collected without release()",
                ResourceWarning,
                stacklevel=2,
            )
            with contextlib.suppress(Exception):
                self.release()

    def __repr__(self) -> str:
        return f"Lease(bundle_id={self.bundle_id!r}, held={self.held})"


class BundleLocks:
    """Lock files for bundles under ``locks_dir`` (created on first use)."""

    def __init__(self, locks_dir: Path, *, log_interval: float = LOG_INTERVAL) -> None:
        self.locks_dir = Path(locks_dir)
        self.log_interval = log_interval

    def lock_path(self, bundle_id: str) -> Path:
        """The lock file of a bundle (``ValueError`` for an unsafe id)."""
        return self.locks_dir / f"{check_bundle_id(bundle_id)}.lock"

    def holders_dir(self, bundle_id: str) -> Path:
        """Where lease holder records for a bundle are written."""
        return self.locks_dir / f"{check_bundle_id(bundle_id)}.holders"

    @contextlib.contextmanager
    def exclusive(self, bundle_id: str, *, timeout: float | None = None) -> Iterator[None]:
        """Hold the exclusive lock (build, delete); waits, logging every few seconds.

        ``timeout=None`` waits forever; otherwise ``LockTimeoutError`` after ``timeout`` seconds.
        """
        fh = self._acquire(bundle_id, portalocker.LockFlags.EXCLUSIVE, timeout, "exclusive")
        key = self.lock_path(bundle_id).absolute()
        _count_exclusive(key, +1)
        try:
            yield
        finally:
            _count_exclusive(key, -1)
            _unlock_and_close(fh)

    @contextlib.contextmanager
    def try_exclusive(self, bundle_id: str) -> Iterator[bool]:
        """Take the exclusive lock if nobody (shared or exclusive) holds it; yields whether it did."""
        fh = self._open(bundle_id)
        try:
            portalocker.lock(fh, portalocker.LockFlags.EXCLUSIVE | portalocker.LockFlags.NON_BLOCKING)
            acquired = True
        except AlreadyLocked:
            acquired = False
        except BaseException:
            fh.close()
            raise
        key = self.lock_path(bundle_id).absolute()
        if acquired:
            _count_exclusive(key, +1)
        try:
            yield acquired
        finally:
            if acquired:
                _count_exclusive(key, -1)
                _unlock_and_close(fh)
            else:
                fh.close()

    def lease(self, bundle_id: str, *, timeout: float | None = None) -> Lease:
        """Take a shared lock for serving the bundle; waits while a build or delete holds it.

        Writes a holder record (display only) after the lock is held.
        """
        fh = self._acquire(bundle_id, portalocker.LockFlags.SHARED, timeout, "shared")
        try:
            record = self._add_record(bundle_id)
        except BaseException:
            _unlock_and_close(fh)
            raise
        return Lease(bundle_id, fh, record)

    def held_exclusive_here(self, bundle_id: str) -> bool:
        """True while this process holds the bundle's exclusive lock (builds and deletes)."""
        with _local_leases_guard:
            return _local_exclusive.get(self.lock_path(bundle_id).absolute(), 0) > 0

    def is_locked(self, bundle_id: str) -> bool:
        """True when anyone holds the lock, shared or exclusive (this process included)."""
        with self.try_exclusive(bundle_id) as acquired:
            return not acquired

    def holders(self, bundle_id: str) -> list[dict[str, Any]]:
        """Lease holder records ``{pid, host, since}`` whose process is still alive.

        Records from this host whose pid is gone (a crashed holder) are deleted. Records from
        other hosts (a shared filesystem) cannot be checked and are returned as they are.
        """
        directory = self.holders_dir(bundle_id)
        host = _host()
        found: list[dict[str, Any]] = []
        try:
            paths = sorted(directory.glob("*.json"))
        except OSError:
            return []
        for path in paths:
            try:
                record = json.loads(path.read_bytes())
                pid, rec_host, since = int(record["pid"]), str(record["host"]), str(record["since"])
            except FileNotFoundError:
                continue  # released while we looked
            except (OSError, ValueError, KeyError, TypeError):
                logger.warning("ignoring unreadable lease holder record %s", path)
                continue
            if rec_host == host and not pid_alive(pid):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            found.append({"pid": pid, "host": rec_host, "since": since})
        return found

    # -- internals ---------------------------------------------------------------------------

    def _open(self, bundle_id: str) -> Any:
        path = self.lock_path(bundle_id)
        self.locks_dir.mkdir(parents=True, exist_ok=True)
        # Read-only is enough for flock, and lets other users of a shared cache lock a file
        # they cannot write.
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        return os.fdopen(fd, "rb")

    def _acquire(self, bundle_id: str, flags: portalocker.LockFlags, timeout: float | None, kind: str) -> Any:
        if timeout is not None and timeout < 0:
            raise ValueError(f"lock timeout must be >= 0 seconds or None (wait forever), got {timeout}")
        fh = self._open(bundle_id)
        start = time.monotonic()
        next_log = start + self.log_interval
        delay = _POLL_MIN
        try:
            while True:
                try:
                    portalocker.lock(fh, flags | portalocker.LockFlags.NON_BLOCKING)
                    return fh
                except AlreadyLocked:
                    pass
                now = time.monotonic()
                waited = now - start
                if timeout is not None and waited >= timeout:
                    raise LockTimeoutError(self._timeout_message(bundle_id, kind, timeout))
                if now >= next_log:
                    logger.info(
                        "waiting for lock on %s (held by another process) ... %.0fs so far (%s lock)",
                        bundle_id,
                        waited,
                        kind,
                    )
                    next_log = now + self.log_interval
                sleep = delay if timeout is None else min(delay, max(0.0, start + timeout - now))
                time.sleep(sleep)
                delay = min(delay * 2, _POLL_MAX)
        except BaseException:
            fh.close()
            raise

    def _timeout_message(self, bundle_id: str, kind: str, timeout: float) -> str:
        holders = self.holders(bundle_id)
        who = (
            ", ".join(f"pid {h['pid']} on {h['host']} since {h['since']}" for h in holders)
            if holders
            else "a build or delete in progress, or a holder that left no record"
        )
        return (
            f"timed out after {timeout:g}s waiting for the {kind} lock on bundle {bundle_id} "
            f"(held by: {who}); retry later, raise the timeout, or stop the process that holds it"
        )

    def _add_record(self, bundle_id: str) -> Path:
        directory = self.holders_dir(bundle_id)
        record = directory / f"{_safe_name(_host())}-{os.getpid()}.json"
        with _local_leases_guard:
            count = _local_leases.get(record, 0)
            if count == 0:
                mode = stat.S_IMODE(self.locks_dir.stat().st_mode)
                make_dir(directory, mode)
                payload = {
                    "pid": os.getpid(),
                    "host": _host(),
                    "since": datetime.now(UTC).isoformat(timespec="seconds"),
                }
                write_atomic(record, json.dumps(payload).encode(), mode & 0o666)
            _local_leases[record] = count + 1
        return record


def _count_exclusive(key: Path, delta: int) -> None:
    with _local_leases_guard:
        count = _local_exclusive.get(key, 0) + delta
        if count > 0:
            _local_exclusive[key] = count
        else:
            _local_exclusive.pop(key, None)


def _drop_record(record: Path) -> None:
    with _local_leases_guard:
        count = _local_leases.get(record, 0) - 1
        if count > 0:
            _local_leases[record] = count
            return
        _local_leases.pop(record, None)
        try:
            record.unlink(missing_ok=True)
        except OSError as exc:
            # Display only: a leftover record is dropped by holders() once this pid is gone.
            logger.warning("could not remove lease holder record %s: %s", record, exc)


def _unlock_and_close(fh: Any) -> None:
    try:
        portalocker.unlock(fh)
    finally:
        fh.close()
