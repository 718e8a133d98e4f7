"""Bundle directories on disk: staging, atomic publish, removal, and scanning.

A bundle is built in a unique staging directory on the same filesystem as ``engines/``,
completed with ``manifest.json``, fsynced, and renamed into place in one ``os.replace``. A
crash at any point leaves either the previous state or the complete bundle; what a crash
leaves behind (staging dirs, trash) is invisible to readers and cleaned up by reconcile.

The caller holds ``locks.exclusive(bundle_id)`` around ``publish`` and ``remove``; the store
itself never consults the catalog.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import stat
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachesvc.cache.crashpoints import crash_point
from cachesvc.cache.profiles import LAYOUT_VERSION, BundleKey
from cachesvc.cache.store.layout import (
    CacheLayout,
    check_bundle_id,
    fsync_dir,
    fsync_file,
    make_dirs,
    write_atomic,
)
from cachesvc.cache.store.locks import BundleLocks
from cachesvc.cache.store.manifest import (
    MANIFEST_NAME,
    Manifest,
    hash_files,
    read_manifest,
    utc_now_iso,
    walk_entries,
)
from cachesvc.errors import CacheError, CorruptBundleError

logger = logging.getLogger("cachesvc.store")

# A concurrent remove() of a sibling bundle may rmdir the shared engines/<d16> parent between
# our mkdir and our rename; recreating it a few times is enough (each retry needs a new race).
_PUBLISH_ATTEMPTS = 5


@dataclass(frozen=True)
class ScannedBundle:
    """A directory found under ``engines/*/*``; ``manifest`` is None when ``error`` says why."""

    relpath: Path
    path: Path
    manifest: Manifest | None
    error: str | None


class BundleStore:
    """The bundles under one cache root."""

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self.locks = BundleLocks(layout.locks)

    # -- building ---------------------------------------------------------------------------

    def new_staging_dir(self, bundle_id: str) -> Path:
        """Create a unique, empty ``<staging>/<bundle_id>.<random>`` to build into.

        The caller holds ``locks.exclusive(bundle_id)`` while it uses the directory.
        """
        check_bundle_id(bundle_id)
        if not self.layout.staging.is_dir():
            self.layout.ensure()
        return Path(tempfile.mkdtemp(prefix=f"{bundle_id}.", dir=self.layout.staging))

    def publish(
        self, staging: Path, key: BundleKey, *, versions: dict[str, str], engine: dict[str, Any]
    ) -> Manifest:
        """Write the manifest into ``staging`` and move it to ``relpath`` atomically.

        Steps: hash the staged files, write ``manifest.json`` atomically, give every entry the
        cache root's permissions, fsync every file and directory, then ``os.replace`` the
        staging dir onto the final path and fsync its parent. An existing final directory (a
        corrupt or stale one the caller decided to rebuild) is renamed into the trash first and
        deleted after. Returns the manifest written.

        Crash safety: until the final rename nothing outside staging and trash has changed, so
        readers see the old state; after it, the complete bundle. The one window in between
        (old directory already moved aside, new one not yet renamed in) leaves no bundle at
        all, never a partial one; leftovers are cleared by ``empty_trash`` and reconcile.
        """
        check_bundle_id(key.id)
        staging = self._check_staging_path(staging)
        final = self._bundle_path(key.relpath)
        files = hash_files(staging)
        manifest = Manifest(
            layout_version=LAYOUT_VERSION,
            bundle_id=key.id,
            checkpoint_digest=key.checkpoint_digest,
            draft_digest=key.draft_digest,
            profile=dict(key.profile),
            backend=key.backend,
            versions=dict(versions),
            engine=dict(engine),
            files=files,
            created_at=utc_now_iso(),
        )
        self._install(staging, final, manifest, key.id)
        return manifest

    def publish_as(self, staging: Path, key: BundleKey, manifest: Manifest) -> Manifest:
        """Publish ``staging`` under an existing ``manifest`` (a bundle pulled from a registry,
        kept byte for byte as it was built): the staged files must match it exactly (every
        listed file with its size and SHA-256, nothing else), then the same atomic steps as
        :meth:`publish`. CorruptBundleError, with nothing published, when they do not."""
        check_bundle_id(key.id)
        staging = self._check_staging_path(staging)
        if manifest.bundle_id != key.id:
            raise CorruptBundleError(f"manifest of {manifest.bundle_id} cannot be published as {key.id}")
        final = self._bundle_path(key.relpath)
        files = {e.path: e for e in hash_files(staging)}
        for entry in manifest.files:
            got = files.pop(entry.path, None)
            if got is None or (got.size, got.sha256) != (entry.size, entry.sha256):
                raise CorruptBundleError(f"staged file {entry.path!r} does not match the manifest")
            if entry.sample_sha256 is not None and got.sample_sha256 != entry.sample_sha256:
                raise CorruptBundleError(f"staged file {entry.path!r} does not match its sampled digest")
        if files:
            raise CorruptBundleError(f"staged file {sorted(files)[0]!r} is not in the manifest")
        self._install(staging, final, manifest, key.id)
        return manifest

    def _install(self, staging: Path, final: Path, manifest: Manifest, bundle_id: str) -> None:
        """Write ``manifest`` into ``staging``, fsync everything and rename it onto ``final``."""
        dir_mode, file_mode = self.layout.dir_mode(), self.layout.file_mode()
        write_atomic(staging / MANIFEST_NAME, manifest.to_json(), file_mode)
        fix_modes_and_fsync(staging, dir_mode, file_mode)
        crash_point("publish:staged")

        self.layout.ensure()
        trashed = self._move_aside(final)
        if trashed is not None:
            crash_point("publish:moved-aside")
        for attempt in range(_PUBLISH_ATTEMPTS):
            try:
                make_dirs(final.parent, self.layout.root, dir_mode)
                os.replace(staging, final)
                break
            except FileNotFoundError:
                if attempt + 1 == _PUBLISH_ATTEMPTS or not staging.is_dir():
                    raise
            except OSError as exc:
                if exc.errno == errno.EXDEV:
                    raise CacheError(
                        f"cannot publish {final}: staging dir {staging} is on another filesystem; "
                        "keep the whole cache root on one filesystem"
                    ) from exc
                if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    # Someone published here between our move-aside and our rename; the
                    # caller's exclusive lock should make this impossible.
                    raise CacheError(
                        f"cannot publish {final}: it reappeared during publish; is another process "
                        f"building bundle {bundle_id} without holding its lock?"
                    ) from exc
                raise
        crash_point("publish:renamed")
        fsync_dir(final.parent)
        if trashed is not None:
            _rmtree_quiet(trashed)

    # -- removing ---------------------------------------------------------------------------

    def remove(self, relpath: Path) -> None:
        """Delete a bundle directory: renamed into the trash (it vanishes at once), then deleted.

        Idempotent: a missing directory is not an error. The caller holds the exclusive lock.
        """
        path = self._bundle_path(relpath)
        trashed = self._move_aside(path)
        if trashed is None:
            return
        _rmtree_quiet(trashed)
        parent = path.parent
        if parent.parent == self.layout.engines:
            # A sibling publish may be about to use it; rmdir only succeeds when empty, and
            # publish re-creates the parent if it loses this race.
            with contextlib.suppress(OSError):
                parent.rmdir()

    def empty_trash(self) -> int:
        """Delete leftovers in the trash (from a crash during remove or publish); returns a count."""
        trash = self.layout.check_subfolder(self.layout.trash)
        try:
            entries = list(trash.iterdir())
        except FileNotFoundError:
            return 0
        for entry in entries:
            _rmtree_quiet(entry)
        return len(entries)

    def quarantine(self, relpath: Path) -> Path | None:
        """Move a directory under ``engines/`` that is not a bundle into ``quarantine/``.

        Reconcile cannot tell whose it is, so it is kept (and out of the way) for a person to
        look at, never deleted. Returns the new path (None when it vanished).
        """
        path = self._bundle_path(relpath)
        if not os.path.lexists(path):
            return None
        folder = self.layout.check_subfolder(self.layout.quarantine)
        folder.mkdir(exist_ok=True)
        target = folder / f"{path.parent.name}-{path.name}-{uuid.uuid4().hex[:8]}"
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return None
        fsync_dir(path.parent)
        fsync_dir(folder)
        with contextlib.suppress(OSError):
            path.parent.rmdir()
        return target

    # -- staging ----------------------------------------------------------------------------

    def staging_dirs(self) -> list[tuple[str, Path]]:
        """Staging directories as ``(bundle_id, path)``; names that do not parse are skipped."""
        found: list[tuple[str, Path]] = []
        try:
            entries = sorted(self.layout.check_subfolder(self.layout.staging).iterdir())
        except FileNotFoundError:
            return []
        for entry in entries:
            bundle_id, dot, suffix = entry.name.rpartition(".")
            if not dot or not suffix or entry.is_symlink() or not entry.is_dir():
                logger.debug("ignoring %s in staging: not a '<bundle_id>.<random>' directory", entry)
                continue
            try:
                check_bundle_id(bundle_id)
            except ValueError:
                logger.debug("ignoring %s in staging: %r is not a bundle id", entry, bundle_id)
                continue
            found.append((bundle_id, entry))
        return found

    def remove_staging(self, path: Path) -> None:
        """Delete a staging directory (idempotent). Only paths directly inside staging are accepted."""
        path = self._check_staging_path(path, must_exist=False)
        _rmtree_quiet(path)

    # -- reading ----------------------------------------------------------------------------

    def scan(self) -> list[ScannedBundle]:
        """Every ``engines/*/*`` directory with its manifest, or the reason it has none.

        Reads only manifests; it does not hash files (``verify_bundle`` does). Symlinks are
        reported with an error rather than followed.
        """
        found: list[ScannedBundle] = []
        try:
            groups = sorted(self.layout.check_subfolder(self.layout.engines).iterdir())
        except FileNotFoundError:
            return []
        for group in groups:
            if group.is_symlink() or not group.is_dir():
                continue
            for path in sorted(group.iterdir()):
                relpath = Path("engines") / group.name / path.name
                if path.is_symlink():
                    found.append(ScannedBundle(relpath, path, None, f"{path} is a symlink, not a bundle dir"))
                    continue
                if not path.is_dir():
                    continue
                try:
                    found.append(ScannedBundle(relpath, path, read_manifest(path), None))
                except CorruptBundleError as exc:
                    found.append(ScannedBundle(relpath, path, None, str(exc)))
        return found

    # -- internals --------------------------------------------------------------------------

    def _bundle_path(self, relpath: Path) -> Path:
        # Only engines/<d16>/<name> is a bundle: scan() looks exactly there, and nothing else
        # under the root (checkpoints, locks) may ever be published over or removed.
        path = self.layout.bundle_dir(relpath)
        rel = path.relative_to(self.layout.root)
        if len(rel.parts) != 3 or rel.parts[0] != "engines":
            raise ValueError(
                f"bundle path {str(relpath)!r} must have the form 'engines/<model-digest16>/<profile-name>'"
            )
        return path

    def _check_staging_path(self, path: Path, *, must_exist: bool = True) -> Path:
        path = Path(path)
        if path.parent != self.layout.staging and path.parent.resolve() != self.layout.staging.resolve():
            raise ValueError(
                f"{path} is not a staging dir: expected a directory directly inside "
                f"{self.layout.staging} (use new_staging_dir)"
            )
        if must_exist and (path.is_symlink() or not path.is_dir()):
            raise ValueError(f"staging dir {path} does not exist or is not a directory")
        return path

    def _move_aside(self, path: Path) -> Path | None:
        """Rename ``path`` into the trash; None when it does not exist."""
        if not os.path.lexists(path):
            return None
        if not self.layout.trash.is_dir():
            self.layout.ensure()
        target = self.layout.check_subfolder(self.layout.trash) / uuid.uuid4().hex
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return None
        fsync_dir(path.parent)
        return target


def fix_modes_and_fsync(top: Path, dir_mode: int, file_mode: int) -> None:
    """Give every entry under ``top`` the cache's modes and flush it, bottom-up.

    Directories are flushed after their contents so each entry's name is durable before the
    single rename that publishes the tree.
    """
    for dirpath, _dirnames, filenames in os.walk(top, topdown=False):
        for name in filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode):
                raise CorruptBundleError(
                    f"{path} is not a regular file; bundles may contain only regular files"
                )
            os.chmod(path, file_mode)
            fsync_file(path)
        os.chmod(dirpath, dir_mode)
        fsync_dir(Path(dirpath))


def _rmtree_quiet(path: Path) -> None:
    """Delete a tree without following symlinks; tolerate a concurrent deleter."""
    try:
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, onerror=_ignore_missing)
    except FileNotFoundError:
        pass
    except OSError as exc:
        # The bundle is already out of sight; empty_trash() retries later.
        logger.warning("could not delete %s: %s", path, exc)


def _ignore_missing(func: Any, path: str, exc_info: Any) -> None:
    if isinstance(exc_info[1], FileNotFoundError):
        return
    raise exc_info[1]


def dir_size(path: Path) -> int:
    """Total size of the regular files under ``path`` (symlinks not followed; 0 if missing).

    Walks the tree: for progress reporting only, never on hot paths (the catalog has sizes).
    """
    return sum(st.st_size for _rel, st in walk_entries(path) if stat.S_ISREG(st.st_mode))
