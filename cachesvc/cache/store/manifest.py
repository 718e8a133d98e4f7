"""Bundle manifests: what a published bundle must contain, and checking that it does.

``manifest.json`` sits at the top of every bundle directory and lists every other regular file
with its size and SHA-256. It is the bundle's own statement of completeness: a directory whose
files do not match it is corrupt and is rebuilt, never served.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from cachesvc.cache.profiles import LAYOUT_VERSION
from cachesvc.errors import CorruptBundleError

MANIFEST_NAME = "manifest.json"
MISMATCH_REASONS = ("missing", "size", "sha256", "unexpected")

_CHUNK = 1024 * 1024
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class FileEntry:
    """One component file of a bundle; ``path`` is POSIX and relative to the bundle dir."""

    path: str
    size: int
    sha256: str
    #: SHA-256 of fixed samples (start, middle, end; see ``sample_sha256``); None in manifests
    #: written before samples existed, whose files the quick check then hashes in full.
    sample_sha256: str | None = None


@dataclass(frozen=True)
class Manifest:
    """The contents of ``manifest.json``."""

    layout_version: int
    bundle_id: str
    checkpoint_digest: str
    draft_digest: str | None
    profile: dict[str, Any]
    backend: str
    versions: dict[str, str]
    engine: dict[str, Any]
    files: tuple[FileEntry, ...]
    created_at: str

    @property
    def size_bytes(self) -> int:
        """Sum of the listed files' sizes. ``manifest.json`` itself is not counted."""
        return sum(entry.size for entry in self.files)

    @property
    def file_count(self) -> int:
        """Number of listed files (``manifest.json`` itself is not counted)."""
        return len(self.files)

    def to_json(self) -> bytes:
        """Serialise as stable, human-readable JSON (sorted keys, files in path order)."""
        payload = {
            "layout_version": self.layout_version,
            "bundle_id": self.bundle_id,
            "checkpoint_digest": self.checkpoint_digest,
            "draft_digest": self.draft_digest,
            "profile": self.profile,
            "backend": self.backend,
            "versions": self.versions,
            "engine": self.engine,
            "files": [
                {"path": e.path, "size": e.size, "sha256": e.sha256}
                | ({"sample_sha256": e.sample_sha256} if e.sample_sha256 is not None else {})
                for e in sorted(self.files, key=lambda e: e.path)
            ],
            "created_at": self.created_at,
        }
        return (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes) -> Manifest:
        """Parse ``manifest.json`` strictly; any missing, unknown or mistyped key raises
        ``CorruptBundleError`` naming the key."""
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptBundleError(
                f"{MANIFEST_NAME} is not valid JSON ({exc}); rebuild the bundle"
            ) from exc
        if not isinstance(raw, dict):
            raise CorruptBundleError(f"{MANIFEST_NAME} must hold a JSON object, got {type(raw).__name__}")
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise CorruptBundleError(f"{MANIFEST_NAME}: unknown key {unknown[0]!r}; rebuild the bundle")
        # Every key is type-checked in declaration order, so the first problem is reported.
        layout_version = _get(raw, "layout_version", int)
        bundle_id = _get(raw, "bundle_id", str)
        checkpoint_digest = _get(raw, "checkpoint_digest", str)
        draft_digest = _get(raw, "draft_digest", str, nullable=True)
        profile = _get(raw, "profile", dict)
        backend = _get(raw, "backend", str)
        versions = _get(raw, "versions", dict)
        engine = _get(raw, "engine", dict)
        files = _get(raw, "files", list)
        created_at = _get(raw, "created_at", str)
        if layout_version != LAYOUT_VERSION:
            raise CorruptBundleError(
                f"{MANIFEST_NAME}: key 'layout_version' is {layout_version}, this cachesvc reads "
                f"layout {LAYOUT_VERSION}; rebuild the bundle"
            )
        for name, value in versions.items():
            if not isinstance(value, str):
                raise CorruptBundleError(f"{MANIFEST_NAME}: key 'versions.{name}' must be a string")
        try:
            stamp = datetime.fromisoformat(created_at)
        except ValueError:
            stamp = None
        if stamp is None or stamp.tzinfo is None:
            raise CorruptBundleError(
                f"{MANIFEST_NAME}: key 'created_at' must be an ISO 8601 UTC timestamp, got {created_at!r}"
            )
        return cls(
            layout_version=layout_version,
            bundle_id=bundle_id,
            checkpoint_digest=checkpoint_digest,
            draft_digest=draft_digest,
            profile=profile,
            backend=backend,
            versions=versions,
            engine=engine,
            files=_parse_files(files),
            created_at=created_at,
        )


_KEYS = frozenset(
    (
        "layout_version",
        "bundle_id",
        "checkpoint_digest",
        "draft_digest",
        "profile",
        "backend",
        "versions",
        "engine",
        "files",
        "created_at",
    )
)


def _get(raw: dict[str, Any], key: str, kind: type, *, nullable: bool = False, where: str = "") -> Any:
    name = f"{where}{key}"
    if key not in raw:
        raise CorruptBundleError(f"{MANIFEST_NAME}: missing key {name!r}; rebuild the bundle")
    value = raw[key]
    if value is None and nullable:
        return None
    # bool is an int subclass; a size of `true` is still a corrupt manifest.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        expected = kind.__name__ + (" or null" if nullable else "")
        raise CorruptBundleError(
            f"{MANIFEST_NAME}: key {name!r} must be {expected}, got {type(value).__name__}; "
            "rebuild the bundle"
        )
    return value


def _parse_files(items: list[Any]) -> tuple[FileEntry, ...]:
    entries: list[FileEntry] = []
    seen: set[str] = set()
    for index, item in enumerate(items):
        where = f"files[{index}]."
        if not isinstance(item, dict):
            raise CorruptBundleError(f"{MANIFEST_NAME}: key 'files[{index}]' must be an object")
        unknown = sorted(set(item) - {"path", "size", "sha256", "sample_sha256"})
        if unknown:
            raise CorruptBundleError(f"{MANIFEST_NAME}: unknown key '{where}{unknown[0]}'")
        path = _get(item, "path", str, where=where)
        size = _get(item, "size", int, where=where)
        digest = _get(item, "sha256", str, where=where)
        sample = _get(item, "sample_sha256", str, where=where) if "sample_sha256" in item else None
        if sample is not None and not _SHA256_RE.match(sample):
            raise CorruptBundleError(
                f"{MANIFEST_NAME}: key '{where}sample_sha256' must be 64 lowercase hex digits"
            )
        _check_relpath(path, f"{where}path")
        if size < 0:
            raise CorruptBundleError(f"{MANIFEST_NAME}: key '{where}size' must be >= 0, got {size}")
        if not _SHA256_RE.match(digest):
            raise CorruptBundleError(f"{MANIFEST_NAME}: key '{where}sha256' must be 64 lowercase hex digits")
        if path in seen:
            raise CorruptBundleError(f"{MANIFEST_NAME}: key '{where}path' repeats {path!r}")
        seen.add(path)
        entries.append(FileEntry(path=path, size=size, sha256=digest, sample_sha256=sample))
    return tuple(sorted(entries, key=lambda e: e.path))


def _check_relpath(path: str, key: str) -> None:
    # A manifest must never make verify (or anything else) read outside the bundle.
    pure = PurePosixPath(path)
    if (
        not path
        or pure.is_absolute()
        or "\\" in path
        or any(part in ("..", ".", "") for part in path.split("/"))
        or path == MANIFEST_NAME
    ):
        raise CorruptBundleError(
            f"{MANIFEST_NAME}: key {key!r} must be a normalised relative POSIX path inside the bundle, "
            f"got {path!r}"
        )


def utc_now_iso() -> str:
    """Current time as an ISO 8601 UTC string (the manifest's ``created_at`` format)."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def sha256_file(path: Path) -> tuple[int, str]:
    """Stream a regular file through SHA-256 in 1 MiB chunks; returns (bytes read, hex digest).

    Opens with ``O_NOFOLLOW`` so a symlink swapped in after a check is refused, not followed.
    """
    digest = hashlib.sha256()
    size = 0
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb", buffering=0) as fh:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while True:
            n = fh.readinto(buf)
            if not n:
                break
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def walk_entries(root: Path) -> list[tuple[str, os.stat_result]]:
    """Every non-directory entry under ``root`` as (POSIX relpath, lstat), sorted; symlinks are
    listed, never followed. Entries that vanish during the walk are skipped; a missing ``root``
    yields nothing."""
    found: list[tuple[str, os.stat_result]] = []
    stack = [(Path(root), "")]
    while stack:
        directory, prefix = stack.pop()
        try:
            with os.scandir(directory) as it:
                for entry in it:
                    rel = f"{prefix}{entry.name}"
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if stat.S_ISDIR(st.st_mode):
                        stack.append((Path(entry.path), f"{rel}/"))
                    else:
                        found.append((rel, st))
        except (FileNotFoundError, NotADirectoryError):
            continue
    found.sort(key=lambda item: item[0])
    return found


def hash_files(root: Path) -> tuple[FileEntry, ...]:
    """Hash every regular file under ``root`` except the top-level ``manifest.json``, sorted by path.

    Raises ``CorruptBundleError`` for symlinks or special files: a bundle holds regular files only,
    so nothing it lists can point outside the cache.
    """
    entries: list[FileEntry] = []
    for rel, st in walk_entries(root):
        if rel == MANIFEST_NAME:
            continue
        if not stat.S_ISREG(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
            raise CorruptBundleError(
                f"{root / rel} is {kind}; bundles may contain only regular files (copy the target in)"
            )
        size, digest = sha256_file(root / rel)
        entries.append(FileEntry(path=rel, size=size, sha256=digest, sample_sha256=sample_sha256(root / rel)))
    return tuple(entries)


#: Bytes read at each sample point by ``sample_sha256``.
SAMPLE_BYTES = 64 * 1024


def sample_offsets(length: int, sample_bytes: int) -> tuple[int, int, int]:
    """Start, middle and end offsets of the three fixed ``sample_bytes`` samples of a region of
    ``length`` bytes: the one sampling rule of every bounded digest (a bundle file's
    ``sample_sha256``, a checkpoint's weights, a GGUF file's tensor data). Samples of a region
    shorter than three of them overlap; one shorter than a sample starts at 0 each time."""
    last = max(length - sample_bytes, 0)
    return 0, last // 2, last


def sample_sha256(path: Path) -> str:
    """SHA-256 over the size and three fixed 64 KiB samples (start, middle, end) of a file.

    Bounded reads (at most 192 KiB per file) for the check on every load; files up to three
    samples long are read whole. ``O_NOFOLLOW`` as in ``sha256_file``.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        digest = hashlib.sha256(size.to_bytes(8, "little"))
        if size <= 3 * SAMPLE_BYTES:
            offsets = [0]
            length = size
        else:
            offsets = list(sample_offsets(size, SAMPLE_BYTES))
            length = SAMPLE_BYTES
        for offset in offsets:
            digest.update(os.pread(fd, length, offset))
    finally:
        os.close(fd)
    return digest.hexdigest()


def read_manifest(bundle_dir: Path) -> Manifest:
    """Read and parse ``<bundle_dir>/manifest.json``; ``CorruptBundleError`` when missing or invalid."""
    path = Path(bundle_dir) / MANIFEST_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise CorruptBundleError(f"{path} is missing; the bundle is incomplete, rebuild it") from None
    except OSError as exc:
        raise CorruptBundleError(f"{path} cannot be read ({exc.strerror}); rebuild the bundle") from exc
    with os.fdopen(fd, "rb") as fh:
        data = fh.read()
    try:
        return Manifest.from_json(data)
    except CorruptBundleError as exc:
        raise CorruptBundleError(f"{bundle_dir}: {exc}") from None


@dataclass(frozen=True)
class Mismatch:
    """One way a bundle differs from its manifest; ``reason`` is one of ``MISMATCH_REASONS``."""

    path: str
    reason: str


@dataclass(frozen=True)
class VerifyReport:
    """Result of re-hashing a bundle. ``bytes_checked`` counts bytes actually hashed."""

    files_checked: int
    bytes_checked: int
    mismatches: tuple[Mismatch, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """True when every listed file matches and nothing else is on disk."""
        return not self.mismatches


def quick_verify_bundle(bundle_dir: Path, manifest: Manifest) -> VerifyReport:
    """The check on every load: every listed file present with its size and sampled hash.

    Reads a few hundred KiB per file instead of every byte (``verify_bundle`` does that, on
    ``serve`` start and on demand). A file whose manifest entry has no sample digest (an older
    bundle) is hashed in full. Files the manifest does not list are not looked for.
    """
    bundle_dir = Path(bundle_dir)
    mismatches: list[Mismatch] = []
    bytes_checked = 0
    for entry in manifest.files:
        try:
            st: os.stat_result | None = os.lstat(bundle_dir / entry.path)
        except OSError:
            st = None
        read, reason = _check_entry(bundle_dir, entry, st, _sampled_digest)
        bytes_checked += read
        if reason is not None:
            mismatches.append(Mismatch(entry.path, reason))
    return VerifyReport(
        files_checked=len(manifest.files), bytes_checked=bytes_checked, mismatches=tuple(mismatches)
    )


def _full_digest(path: Path, entry: FileEntry) -> tuple[int, str | None]:
    size, digest = sha256_file(path)
    if size != entry.size:
        return size, "size"
    return size, None if digest == entry.sha256 else "sha256"


def _sampled_digest(path: Path, entry: FileEntry) -> tuple[int, str | None]:
    if entry.sample_sha256 is None:
        return _full_digest(path, entry)
    ok = sample_sha256(path) == entry.sample_sha256
    return min(entry.size, 3 * SAMPLE_BYTES), None if ok else "sha256"


def _check_entry(
    bundle_dir: Path,
    entry: FileEntry,
    st: os.stat_result | None,
    digest: Callable[[Path, FileEntry], tuple[int, str | None]],
) -> tuple[int, str | None]:
    """(bytes read, mismatch reason or None) for one listed file, given its ``lstat``."""
    if st is None or not stat.S_ISREG(st.st_mode):
        return 0, "missing"
    if st.st_size != entry.size:
        return 0, "size"  # no need to hash: a size change already proves the file differs
    try:
        return digest(bundle_dir / entry.path, entry)
    except OSError:
        # Vanished, swapped for a symlink, or unreadable since the walk: not the listed file.
        return 0, "missing"


def verify_bundle(bundle_dir: Path, manifest: Manifest | None = None) -> VerifyReport:
    """Re-hash every file of a bundle against its manifest (read from disk when not given).

    Reports files that are missing (or no longer regular files), have the wrong size or
    SHA-256, and files on disk the manifest does not list. Raises ``CorruptBundleError`` only
    when the manifest itself is missing or invalid.
    """
    bundle_dir = Path(bundle_dir)
    if manifest is None:
        manifest = read_manifest(bundle_dir)
    on_disk = {rel: st for rel, st in walk_entries(bundle_dir) if rel != MANIFEST_NAME}
    mismatches: list[Mismatch] = []
    bytes_checked = 0
    for entry in manifest.files:
        read, reason = _check_entry(bundle_dir, entry, on_disk.pop(entry.path, None), _full_digest)
        bytes_checked += read
        if reason is not None:
            mismatches.append(Mismatch(entry.path, reason))
    mismatches.extend(Mismatch(rel, "unexpected") for rel in on_disk)
    mismatches.sort(key=lambda m: (m.path, m.reason))
    return VerifyReport(
        files_checked=len(manifest.files), bytes_checked=bytes_checked, mismatches=tuple(mismatches)
    )
