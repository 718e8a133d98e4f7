"""Context-cache records on disk: the prefix store's KV blocks survive a restart.

One directory per bundle (the server gives ``<cache>/context/<bundle_id>/``; removing the bundle
removes it). One file per record, named by the record's chained block key (hex) + ``.kv``; the key
already names the bundle, the adapter (none yet) and the request's ``cache_salt``
(:meth:`~inference.serving.context_cache.PrefixStore.block_keys`), so a salted record is found only with
the same salt, after a restart too.

File layout (little-endian)::

    magic "CSVCCTX1" | version u32 | key 20 B | tokens u32 | dtype 16 B (numpy ``dtype.str``)
    | ndim u32 | shape u64 * ndim | logits u32 | logits_at u32 | sha256 32 B
    | tokens int64 * n | KV bytes (C order) | logits float32 * logits

The digest covers everything before it and after it (header, tokens, KV, logits). A prompt tail
may carry the logits that follow its first ``logits_at`` tokens (the end of a prompt; version 2);
other records carry none (``logits`` 0). Files of another version are removed at open. SHA-256 rather than
BLAKE2b: it runs at about twice BLAKE2b's speed where the CPU has SHA instructions (1.7 ms vs
3.2 ms for a 2.9 MB SmolLM2 block here), and a restart's first request checks every block it reads.

Writing: :meth:`DiskRecords.put` only queues (bounded; a full queue skips the write, the record
stays in memory); a writer thread, at the lowest CPU priority where threads have their own
(Linux), writes a temp name, fsyncs it and ``os.replace`` s it into place, so a reader sees the
whole record or none. Reading (:meth:`DiskRecords.read`, on the
scheduler thread on a memory miss) checks magic, version, length, key, digest, dtype and tokens;
a damaged record is unlinked and never used. The byte cap (``max_bytes``) holds over the files:
least recently used first, by an index rebuilt at open from the files' mtimes (a hit touches its
file), so the order survives a restart. Temp files left by a crash are removed at open, and so
are files of another format version (or not records at all: checked by magic and version).

The folder: the owner may pass a ``guard``, its rule for folders it deletes in (the cache's:
no link, :meth:`cachesvc.cache.store.layout.CacheLayout.checked_context_dir`), called before the folder
is read at open and before every write or removal in it; nothing is deleted or written where the
guard refuses. A write that fails (a full or read-only disk, a refused folder) leaves its record in
memory only and is counted (``disk_write_failures``); the failures are logged as one outage: one
line when writes start failing, reminders at a doubling interval, one line when a write goes
through again. A record whose name is taken by something that is not a file (a directory) is
counted and logged once, and not tried again.

Thread-safety: :meth:`put`, :meth:`read`, :meth:`touch`, :meth:`stats` and :meth:`close` may be
called from any thread; the index is guarded by a lock. One process writes a cache directory
(the service enforces one node per cache dir).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import re
import secrets
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger("inference.context_disk")

MAGIC = b"CSVCCTX1"
FORMAT_VERSION = 2
#: What ``--context-cache-disk-bytes`` defaults to: 1 GiB (~350 SmolLM2-135M blocks, ~22k tokens).
DEFAULT_DISK_BYTES = 1 << 30
#: Records waiting for the writer (64 SmolLM2 blocks: ~190 MB, ~4,000 prompt tokens); a full
#: queue skips writes rather than block decode, and a shutdown writes at most this many.
WRITE_QUEUE = 64
#: Threads that read records at once (:meth:`DiskRecords.read_records`).
_READERS = 4
SUFFIX = ".kv"
KEY_BYTES = 20

_HEAD = struct.Struct("<8sI20sI16sI")
_LOGITS = struct.Struct("<II")
_FORMAT = struct.Struct("<8sI")  # the start of _HEAD: magic and version
_DIGEST = 32
_NAME_RE = re.compile(r"^[0-9a-f]{40}\.kv$")
#: While writes fail: the first reminder after this many seconds, each later one twice as late,
#: up to the cap (as the catalog's outage log does).
FIRST_REMINDER_SECONDS = 30.0
MAX_REMINDER_SECONDS = 600.0


@dataclass(frozen=True)
class DiskStats:
    """Counters since open, and what the directory holds now."""

    disk_hits: int = 0  # records read back from disk (a memory miss)
    disk_writes: int = 0  # records written
    disk_dropped: int = 0  # damaged records found (at open: another format; on read) and removed
    disk_evictions: int = 0  # records removed for the byte cap
    disk_write_failures: int = 0  # records that could not be written (they stay in memory only)
    disk_records: int = 0
    disk_bytes: int = 0
    disk_max_bytes: int = 0


@dataclass(frozen=True)
class DiskRecord:
    """One record as read back: its tokens and KV, and for a prompt tail maybe the logits that
    follow its first ``logits_at`` tokens."""

    tokens: tuple[int, ...]
    kv: np.ndarray
    logits: np.ndarray | None = None
    logits_at: int = 0


def encode(key: bytes, tokens: Sequence[int], kv: np.ndarray, logits: np.ndarray | None = None,
           logits_at: int = 0) -> list[bytes | memoryview]:
    """The parts of one record file, in order (see the module docstring)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"record keys are {KEY_BYTES} bytes, got {len(key)}")
    kv = np.ascontiguousarray(kv)
    if kv.dtype.hasobject:
        raise ValueError("object arrays are not KV")
    dtype = kv.dtype.newbyteorder("<") if kv.dtype.byteorder == ">" else kv.dtype
    kv = kv.astype(dtype, copy=False)
    toks = np.asarray(tokens, dtype="<i8")
    tail = np.zeros(0, "<f4") if logits is None else np.ascontiguousarray(logits, dtype="<f4").reshape(-1)
    if logits is not None and not 0 < logits_at <= len(toks):
        raise ValueError(f"logits_at {logits_at} is not a position of {len(toks)} tokens")
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, key, len(toks), dtype.str.encode("ascii"), kv.ndim)
    head += struct.pack(f"<{kv.ndim}Q", *kv.shape)
    head += _LOGITS.pack(tail.size, logits_at if logits is not None else 0)
    payload = kv.reshape(-1).data.cast("B")
    digest = hashlib.sha256(head)
    digest.update(toks.tobytes())
    digest.update(payload)
    digest.update(tail.tobytes())
    return [head, digest.digest(), toks.tobytes(), payload, tail.tobytes()]


class DamagedRecord(ValueError):
    """A record file that must not be used (and is removed)."""


class _NameTaken(OSError):
    """The record's file name is taken by something that is not a file (a directory)."""


def decode(data: bytes | bytearray, key: bytes) -> DiskRecord:
    """The record in a file's bytes; :class:`DamagedRecord` when anything is off."""
    view = memoryview(data)
    _check_format(view)
    if len(view) < _HEAD.size:
        raise DamagedRecord("shorter than a header")
    _, _, stored_key, n_tokens, dtype_raw, ndim = _HEAD.unpack_from(view, 0)
    if stored_key != key:
        raise DamagedRecord("key does not match the file name")
    if not 1 <= ndim <= 8:
        raise DamagedRecord(f"bad rank {ndim}")
    shape_end = _HEAD.size + 8 * ndim
    head_end = shape_end + _LOGITS.size
    if len(view) < head_end + _DIGEST:
        raise DamagedRecord("truncated header")
    shape = struct.unpack_from(f"<{ndim}Q", view, _HEAD.size)
    n_logits, logits_at = _LOGITS.unpack_from(view, shape_end)
    try:
        dtype = np.dtype(dtype_raw.rstrip(b"\0").decode("ascii"))
    except (TypeError, ValueError, UnicodeDecodeError):
        raise DamagedRecord("bad dtype") from None
    if dtype.hasobject or dtype.kind not in "fiub" or dtype.byteorder == ">":
        raise DamagedRecord(f"dtype {dtype} is not KV")
    if n_logits and not 0 < logits_at <= n_tokens:
        raise DamagedRecord(f"logits at {logits_at} of {n_tokens} tokens")
    count = 1
    for dim in shape:
        count *= int(dim)
    tok_start = head_end + _DIGEST
    kv_start = tok_start + 8 * n_tokens
    logits_start = kv_start + count * dtype.itemsize
    if len(view) != logits_start + 4 * n_logits:
        raise DamagedRecord("length does not match the header")
    digest = hashlib.sha256(view[:head_end])
    digest.update(view[tok_start:])
    if digest.digest() != bytes(view[head_end:tok_start]):
        raise DamagedRecord("checksum mismatch")
    tokens = tuple(int(t) for t in np.frombuffer(data, dtype="<i8", count=n_tokens, offset=tok_start))
    kv = np.frombuffer(data, dtype=dtype, count=count, offset=kv_start).reshape(shape)
    logits = np.frombuffer(data, dtype="<f4", count=n_logits, offset=logits_start) if n_logits else None
    return DiskRecord(tokens, kv, logits, logits_at if n_logits else 0)


def _check_format(head: bytes | memoryview) -> None:
    """:class:`DamagedRecord` unless ``head`` starts with this format's magic and version."""
    if len(head) < _FORMAT.size:
        raise DamagedRecord("shorter than a header")
    magic, version = _FORMAT.unpack_from(head, 0)
    if magic != MAGIC:
        raise DamagedRecord("bad magic")
    if version != FORMAT_VERSION:
        raise DamagedRecord(f"format version {version}, expected {FORMAT_VERSION}")


def _other_format(path: str) -> bool:
    """Whether the file at ``path`` does not start like a record of this format version."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(_FORMAT.size)
    except OSError:
        return False  # unreadable now: its first read decides
    try:
        _check_format(head)
    except DamagedRecord:
        return True
    return False


def _yield_cpu() -> None:
    """Run the calling thread at the lowest CPU priority where the OS has per-thread priorities
    (Linux: a thread's nice value is its own), so the writer's hashing and copying take what the
    engine's threads leave instead of slowing the next request's steps (on 2 cores, a decode
    right after a 1,500-token prompt ran at 83 tok/s against 125 while the prompt's records were
    written)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class DiskRecords:
    """One bundle's records in ``directory``; see the module docstring."""

    def __init__(self, directory: Path | str, *, max_bytes: int = DEFAULT_DISK_BYTES,
                 queue_size: int = WRITE_QUEUE, dir_mode: int = 0o755,
                 guard: Callable[[], object] | None = None) -> None:
        """``directory`` (and its parent) are made on the first write, with ``dir_mode``.

        ``guard``: the owner's rule for the folder (see the module docstring); what it raises at
        open is raised here, and nothing in the folder has been touched then."""
        if max_bytes < 1:
            raise ValueError("max_bytes must be at least 1 (leave the disk store out for none)")
        self.directory = Path(directory)
        self._dir_mode = dir_mode
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, LRU first
        self._pending: set[bytes] = set()
        self._bytes = 0
        self._stats = DiskStats(disk_max_bytes=max_bytes)
        self._queue: queue.Queue[tuple[bytes, tuple[int, ...], np.ndarray, np.ndarray | None, int] | None] = (
            queue.Queue(queue_size))
        self._thread: threading.Thread | None = None
        self._readers: ThreadPoolExecutor | None = None
        self._closed = False
        self._guard = guard
        # Write failures: since when writes fail (None: they work), how many since, the next
        # reminder; record names taken by something else (never tried again).
        self._failing_since: float | None = None
        self._failures_now = 0
        self._reminder = FIRST_REMINDER_SECONDS
        self._next_reminder = 0.0
        self._name_taken: set[bytes] = set()
        self.on_change: Callable[[], None] | None = None  # called after the writer changed the figures
        self._open()

    @property
    def max_bytes(self) -> int:
        """The byte cap over the record files."""
        return self._stats.disk_max_bytes

    def _path(self, key: bytes) -> Path:
        return self.directory / (key.hex() + SUFFIX)

    def _open(self) -> None:
        """Index the records already there (oldest mtime first), drop temp files, apply the cap."""
        if self._guard is not None:
            self._guard()
        found: list[tuple[int, bytes, int]] = []
        stale = 0
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            entries = []
        for entry in entries:
            if entry.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                continue
            if not _NAME_RE.match(entry.name) or not entry.is_file(follow_symlinks=False):
                continue
            if _other_format(entry.path):
                # Written by another version of this store (or not a record): never readable
                # here, so removed now rather than one warning per file on its first lookup.
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    stale += 1
                continue
            st = entry.stat(follow_symlinks=False)
            found.append((st.st_mtime_ns, bytes.fromhex(entry.name[: 2 * KEY_BYTES]), st.st_size))
        if stale:
            log.warning("removed %d context records of another format from %s", stale, self.directory)
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._index[key] = size
                self._bytes += size
            evicted = self._evict_locked(0)
            self._set_locked(disk_evictions=self._stats.disk_evictions + evicted,
                             disk_dropped=self._stats.disk_dropped + stale)

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def put(self, key: bytes, tokens: Sequence[int], kv: np.ndarray, *, replace: bool = False,
            logits: np.ndarray | None = None, logits_at: int = 0) -> bool:
        """Queue ``kv`` for writing unless the record is there or queued; False when skipped.

        ``replace``: write even over a record of that key (a prompt tail, whose key names its
        place, not its tokens); the file is swapped whole, as any write. ``logits``: those that
        follow the first ``logits_at`` tokens (a prompt tail's)."""
        size = (_HEAD.size + 8 * kv.ndim + _LOGITS.size + _DIGEST + 8 * len(tokens) + int(kv.nbytes)
                + (0 if logits is None else 4 * int(logits.size)))
        with self._lock:
            known = key in self._index or key in self._pending or key in self._name_taken
            if self._closed or (known and not replace) or size > self.max_bytes:
                return False
            self._pending.add(key)
            if self._thread is None:
                self._thread = threading.Thread(target=self._write_loop, name="context-cache-writer",
                                                daemon=True)
                self._thread.start()
        try:
            self._queue.put_nowait((key, tuple(int(t) for t in tokens), kv, logits, logits_at))
        except queue.Full:
            with self._lock:
                self._pending.discard(key)
            return False
        return True

    def read(self, key: bytes, tokens: Sequence[int]) -> np.ndarray | None:
        """The KV of record ``key`` if its file is whole and holds ``tokens``; else None (a damaged
        file, or one of other tokens, is removed). A hit becomes most recently used."""
        record = self.read_record(key, tuple(int(t) for t in tokens))
        return None if record is None else record.kv

    def read_records(self, keys: Sequence[bytes]) -> list[DiskRecord | None]:
        """:meth:`read_record` of each key, several at once (the file reads and SHA-256 run
        outside the GIL: a restart's first request reads a whole prefix, 23 files for 1,500
        tokens of SmolLM2, in about half the time on 2 cores). Not counted as disk hits: the
        caller counts those it uses (:meth:`count_hits`)."""
        with self._lock:
            parallel = len(keys) >= 2 and not self._closed
            if parallel and self._readers is None:
                self._readers = ThreadPoolExecutor(max_workers=_READERS,
                                                   thread_name_prefix="context-cache-reader")
            pool = self._readers if parallel else None
        if pool is None:
            return [self.read_record(k, count=False) for k in keys]
        return list(pool.map(lambda k: self.read_record(k, count=False), keys))

    def count_hits(self, n: int) -> None:
        """Count ``n`` records of :meth:`read_records` as used (disk hits)."""
        with self._lock:
            self._set_locked(disk_hits=self._stats.disk_hits + n)

    def read_record(self, key: bytes, tokens: tuple[int, ...] | None = None, *,
                    count: bool = True) -> DiskRecord | None:
        """Record ``key`` if its file is whole (and holds ``tokens`` when
        given); else None (a damaged file is removed). A hit becomes most recently used (and is
        counted as a disk hit with ``count``)."""
        with self._lock:
            if key not in self._index:
                return None
        path = self._path(key)
        try:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                data = fh.read(size + 1)  # no zeroed buffer first: one pass over the memory
                got = len(data)
        except FileNotFoundError:
            self._forget(key, dropped=False)
            return None
        except OSError as exc:
            log.warning("context record %s unreadable: %s", path.name, exc)
            return None
        try:
            if got != size:
                raise DamagedRecord("short read")
            record = decode(data, key)
            if tokens is not None and record.tokens != tokens:
                raise DamagedRecord("tokens do not match")
        except DamagedRecord as exc:
            log.warning("context record %s is damaged (%s); removed", path.name, exc)
            self.drop(key)
            return None
        self.touch(key)
        if count:
            self.count_hits(1)
        return record

    def touch(self, key: bytes) -> None:
        """Make record ``key`` most recently used (in the index and its file's mtime)."""
        with self._lock:
            if key not in self._index:
                return
            self._index.move_to_end(key)
        with contextlib.suppress(OSError):
            os.utime(self._path(key))

    def drop(self, key: bytes) -> None:
        """Remove a record that must not be used (its file too, where the guard allows)."""
        if self._guard_allows():
            with contextlib.suppress(FileNotFoundError):
                self._path(key).unlink()
        self._forget(key, dropped=True)

    def _guard_allows(self) -> bool:
        if self._guard is None:
            return True
        try:
            self._guard()
        except Exception:  # the writer logs why (a write fails the same way)
            return False
        return True

    def _forget(self, key: bytes, *, dropped: bool) -> None:
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._bytes -= size
            self._set_locked(disk_dropped=self._stats.disk_dropped + (1 if dropped else 0))

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued record is written (tests, benches, shutdown)."""
        if timeout is None:
            self._queue.join()
            return
        done = threading.Event()

        def wait() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=wait, daemon=True).start()
        done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to ``timeout`` s), then stop the writer; later puts are skipped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread, readers = self._thread, self._readers
        if readers is not None:
            readers.shutdown(wait=False)
        if thread is None:
            return
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        thread.join(timeout)

    def stats(self) -> DiskStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return self._stats

    # -- writer thread -----------------------------------------------------------------------

    def _write_loop(self) -> None:
        _yield_cpu()
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, tokens, kv, logits, logits_at = item
                try:
                    self._write(key, tokens, kv, logits, logits_at)
                except Exception as exc:  # a full or read-only disk: the record stays in memory only
                    self._write_failed(key, exc)
                else:
                    self._write_worked()
                finally:
                    with self._lock:
                        self._pending.discard(key)
                hook = self.on_change
                if hook is not None:
                    try:
                        hook()
                    except Exception:
                        log.exception("context cache change hook failed")
            finally:
                self._queue.task_done()

    def _write_failed(self, key: bytes, exc: Exception) -> None:
        """Count a record not written; log it as part of the outage (or once for a taken name)."""
        reason = " ".join(str(exc).split()) or type(exc).__name__
        now = time.monotonic()
        line: tuple[int, str, tuple[object, ...]] | None = None
        with self._lock:
            self._set_locked(disk_write_failures=self._stats.disk_write_failures + 1)
            if isinstance(exc, _NameTaken):
                self._name_taken.add(key)
                line = (logging.WARNING, "context record %s is not written: %s; it stays in memory only "
                        "(remove what is in the way: records are tried again after a restart)",
                        (key.hex(), reason))
            elif self._failing_since is None:
                self._failing_since, self._failures_now = now, 1
                self._reminder = FIRST_REMINDER_SECONDS
                self._next_reminder = now + self._reminder
                line = (logging.ERROR, "context records cannot be written to %s: %s; they stay in memory "
                        "only, and writing resumes by itself once a write works again (free space, or "
                        "fix the folder)", (self.directory, reason))
            else:
                self._failures_now += 1
                if now >= self._next_reminder:
                    self._reminder = min(self._reminder * 2, MAX_REMINDER_SECONDS)
                    self._next_reminder = now + self._reminder
                    line = (logging.WARNING, "context records still cannot be written to %s after %.0f s "
                            "(%d records not written): %s",
                            (self.directory, now - self._failing_since, self._failures_now, reason))
        if line is not None:
            log.log(line[0], line[1], *line[2])

    def _write_worked(self) -> None:
        """A write went through: an outage of failed writes (if any) is over."""
        if self._failing_since is None:  # the common case: no lock
            return
        with self._lock:
            since, failed = self._failing_since, self._failures_now
            self._failing_since, self._failures_now = None, 0
        if since is not None:
            log.warning("context records are written to %s again after %.0f s (%d records were not "
                        "written)", self.directory, time.monotonic() - since, failed)

    def _write(self, key: bytes, tokens: tuple[int, ...], kv: np.ndarray, logits: np.ndarray | None,
               logits_at: int) -> None:
        if self._guard is not None:
            self._guard()  # nothing is written or deleted in a folder the owner refuses
        parts = encode(key, tokens, kv, logits, logits_at)
        size = sum(len(p) for p in parts)
        path = self._path(key)
        for directory in (self.directory.parent, self.directory):
            if not directory.is_dir():
                with contextlib.suppress(FileExistsError):
                    directory.mkdir()
                    os.chmod(directory, self._dir_mode)  # umask does not apply
        tmp = self.directory / f".{path.name}.{secrets.token_hex(6)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                for part in parts:
                    view = memoryview(part)
                    while view:
                        view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            with self._lock:
                evicted = self._evict_locked(size)
            try:
                os.replace(tmp, path)
            except IsADirectoryError as exc:
                raise _NameTaken(f"{path} is a directory, not a record file") from exc
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        with self._lock:
            old = self._index.pop(key, None)
            self._bytes += size - (old or 0)
            self._index[key] = size
            self._set_locked(disk_writes=self._stats.disk_writes + 1,
                             disk_evictions=self._stats.disk_evictions + evicted)

    def _evict_locked(self, incoming: int) -> int:
        """Remove least recently used records until ``incoming`` more bytes fit the cap."""
        evicted = 0
        while self._index and self._bytes + incoming > self.max_bytes:
            key, size = self._index.popitem(last=False)
            self._bytes -= size
            with contextlib.suppress(FileNotFoundError):
                self._path(key).unlink()
            evicted += 1
        return evicted

    def _set_locked(self, **changes: int) -> None:
        self._stats = DiskStats(**{**self._stats.__dict__, **changes,
                                   "disk_records": len(self._index), "disk_bytes": self._bytes})

