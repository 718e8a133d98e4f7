"""The cache directory tree: where things live, and how files get into it durably.

Everything the store writes goes through the helpers here: unique temp names, fsync, then
``os.replace`` (atomic on POSIX), and directories fsynced after an entry is added or removed
so that the rename itself survives a power cut. Directories and files the store creates take
the cache root's permission bits, so a private temp dir's 0700 never leaks into a shared cache.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
import stat
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from cachesvc.errors import CacheError, ConfigError

#: Standard cache directory tag (https://bford.info/cachedir/); backup tools skip the tree.
CACHEDIR_TAG_NAME = "CACHEDIR.TAG"
CACHEDIR_TAG_SIGNATURE = "Signature: 8a477f597d28d172789f06886806bc55"
CACHEDIR_TAG_CONTENT = (
    f"{CACHEDIR_TAG_SIGNATURE}\n"
    "# This file is a cache directory tag created by cachesvc (engine bundle cache).\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)

#: The converted file of a LoRA adapter, ``adapters/<adapter-digest16>/`` (onnxruntime's format).
ADAPTER_FILE_NAME = "adapter.onnx_adapter"


_ADAPTER_ID_RE = re.compile(r"^[0-9a-f]{16}$")


def is_adapter_id(name: str) -> bool:
    """Whether ``name`` is an adapter id (the first 16 lowercase hex digits of its digest), the
    only folder names the cache creates under ``adapters/``."""
    return bool(_ADAPTER_ID_RE.match(name))


def check_adapter_id(adapter_id: str) -> str:
    """``adapter_id`` if it is an adapter id, else ``ValueError``."""
    if not isinstance(adapter_id, str) or not is_adapter_id(adapter_id):
        raise ValueError(f"invalid adapter id {adapter_id!r}: expected 16 lowercase hex digits")
    return adapter_id


def adapter_lock_key(adapter_id: str) -> str:
    """The name an adapter's file lock has among the bundles' locks (``.locks/adapter-<id>.lock``):
    a serving process holds it shared while an engine has the adapter loaded, and eviction
    takes it exclusive, exactly as for a bundle. No bundle id starts with ``adapter-``."""
    return f"adapter-{check_adapter_id(adapter_id)}"


#: The node that owns a cache directory: its rows in a shared catalog describe this disk.
NODE_FILE_NAME = "cachesvc-node"
#: The name commands act as on a directory no server has claimed yet (unique to the directory;
#: the first ``serve`` takes its rows over and removes the file).
UNCLAIMED_NODE_FILE_NAME = "cachesvc-node.unclaimed"

# No dots: staging dirs are named "<bundle_id>.<random>", and the id must parse back unambiguously.
_BUNDLE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,127}$")


def check_bundle_id(bundle_id: str) -> str:
    """Return ``bundle_id`` if it is safe to use in file names, else raise ``ValueError``."""
    if not isinstance(bundle_id, str) or not _BUNDLE_ID_RE.match(bundle_id):
        raise ValueError(
            f"invalid bundle id {bundle_id!r}: use 1-128 characters from [A-Za-z0-9_-], "
            "starting with a letter or digit (e.g. '0123456789abcdef-0123456789ab')"
        )
    return bundle_id


def _subdir(name: str, doc: str) -> property:
    """A directory of the cache root, as a read-only property."""

    def get(self: CacheLayout) -> Path:
        return self.root / name

    return property(get, doc=doc)


@dataclass(frozen=True)
class CacheLayout:
    """The directory tree under a cache root (``--cache-dir``)."""

    root: Path

    def __post_init__(self) -> None:
        # Accept str too; a frozen dataclass needs object.__setattr__ to normalise a field.
        object.__setattr__(self, "root", Path(self.root).expanduser())

    engines = _subdir("engines", "Published bundles: ``engines/<model-digest16>/<profile-name>/``.")

    checkpoints = _subdir("checkpoints", "Checkpoint downloads (huggingface_hub cache).")

    staging = _subdir(
        ".staging",
        "Unique build dirs; on the same filesystem as ``engines`` so publishing is one rename.")

    locks = _subdir(".locks", "Per-bundle lock files and lease holder records.")

    trash = _subdir(
        ".trash",
        "Where directories are renamed before deletion, so they vanish from view atomically.")

    quarantine = _subdir(
        "quarantine",
        "Directories found under ``engines/`` that are not bundles: kept for a person to look at.")

    adapters = _subdir(
        "adapters",
        "Converted LoRA adapters: ``adapters/<adapter-digest16>/adapter.onnx_adapter`` (created "
        "with the first one).")

    def adapter_file(self, adapter_id: str) -> Path:
        """The converted file of one adapter (may not exist yet)."""
        return self.adapters / check_adapter_id(adapter_id) / ADAPTER_FILE_NAME

    context = _subdir(
        "context",
        "Context-cache records (prompt-prefix KV blocks) that survive a restart: "
        "``context/<bundle_id>/``, one directory per bundle, removed with it.")

    gate_references = _subdir(
        "gate-references",
        "The quality gate's fp32 answers, one file per checkpoint (``<digest32>.npz``), so that "
        "later quantized builds of the same weights skip the fp32 run; removed with the checkpoint.")

    def gate_reference_file(self, checkpoint_digest: str) -> Path:
        """The gate's fp32 answers for one checkpoint (may not exist)."""
        if not re.fullmatch(r"[0-9a-f]{32,64}", checkpoint_digest):
            raise ValueError(f"not a checkpoint digest: {checkpoint_digest!r}")
        return self.gate_references / f"{checkpoint_digest[:32]}.npz"

    def remove_gate_reference(self, checkpoint_digest: str) -> None:
        """Delete one checkpoint's gate answers (never through a linked folder)."""
        if not self.gate_references.is_symlink():
            self.gate_reference_file(checkpoint_digest).unlink(missing_ok=True)

    def context_dir(self, bundle_id: str) -> Path:
        """The record directory of one bundle (may not exist yet)."""
        return self.context / check_bundle_id(bundle_id)

    def checked_context_dir(self, bundle_id: str) -> Path:
        """:meth:`context_dir`, held to :meth:`check_subfolder` with ``context/`` above it: records
        are deleted in it (stale temp files, damaged records, the byte cap, the bundle's removal),
        so a link there (to anything) is refused with ``CacheError``, never followed."""
        self.check_subfolder(self.context)
        return self.check_subfolder(self.context_dir(bundle_id))

    def context_bytes(self, bundle_id: str | None = None) -> int:
        """Bytes of the context records of ``bundle_id`` (None: of every bundle); counted on disk."""
        if bundle_id is not None:
            return _files_bytes(self.context_dir(bundle_id))
        return sum(_files_bytes(self.context / name) for name in self.context_bundle_ids())

    def context_bundle_ids(self) -> list[str]:
        """Bundle ids that have a record directory."""
        try:
            entries = list(os.scandir(self.check_subfolder(self.context)))
        except FileNotFoundError:
            return []
        return sorted(
            e.name for e in entries if e.is_dir(follow_symlinks=False) and _BUNDLE_ID_RE.match(e.name)
        )

    def remove_context(self, bundle_id: str) -> bool:
        """Delete a bundle's context records (renamed into the trash first, so they vanish at
        once); True when there were any. The caller holds the bundle's exclusive lock or knows
        the bundle is gone."""
        path = self.checked_context_dir(bundle_id)
        if not path.is_dir():
            return False
        return remove_tree(self, path, f"context-{bundle_id}")

    @property
    def cachedir_tag(self) -> Path:
        """The ``CACHEDIR.TAG`` file at the root."""
        return self.root / CACHEDIR_TAG_NAME

    @property
    def node_file(self) -> Path:
        """The file recording the node that owns this directory (one line: its name)."""
        return self.root / NODE_FILE_NAME

    @property
    def unclaimed_node_file(self) -> Path:
        """The file naming the provisional node of commands run before any server claimed
        the directory."""
        return self.root / UNCLAIMED_NODE_FILE_NAME

    def recorded_node(self) -> str | None:
        """The node that owns this directory, or None when none is recorded yet."""
        return _read_name(self.node_file)

    def record_node(self, node: str) -> str:
        """Record ``node`` as the owner unless one is recorded already; the owner either way.

        Create-if-absent in one step (a complete temp file hard-linked to the final name), so
        two processes starting at once with different names never both own the directory:
        the loser reads the winner's name."""
        return self._record_once(self.node_file, node)

    def unclaimed_node(self) -> str | None:
        """The provisional node commands acted as before a server claimed the directory, or
        None when there is none (see :meth:`provisional_node`)."""
        return _read_name(self.unclaimed_node_file)

    def provisional_node(self) -> str:
        """The name commands act as on this directory while no server has claimed it: made up
        once (``unclaimed-<12 hex>``: no other directory's node can have it) and recorded, so
        that the first ``serve`` knows which rows are this directory's and takes them over."""
        return self.unclaimed_node() or self._record_once(
            self.unclaimed_node_file, f"unclaimed-{secrets.token_hex(6)}"
        )

    def forget_unclaimed_node(self) -> None:
        """The claiming server took the provisional node's rows over: its name is spent."""
        self.unclaimed_node_file.unlink(missing_ok=True)
        fsync_dir(self.root)

    def _record_once(self, path: Path, name: str) -> str:
        existing = _read_name(path)
        if existing is not None:
            return existing
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        write_atomic(tmp, f"{name}\n".encode(), self.file_mode())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process recorded its name first: that one holds
        finally:
            tmp.unlink()
        fsync_dir(self.root)
        recorded = _read_name(path)
        assert recorded is not None
        return recorded

    def owning_node(self, node: str | None, *, claim: bool) -> str:
        """The node this process acts as on this directory (see ``CacheManager.open``): the
        recorded one; with ``claim`` (a server starting) ``node`` (default: the host name) is
        recorded when none is. ConfigError when ``node`` is not the recorded one. A command
        on a directory no server has claimed acts as ``node`` when one is given, else as the
        directory's provisional node (:meth:`unclaimed_node`), never as the host name: a
        later ``serve --node-name`` takes over what it did."""
        recorded = self.recorded_node()
        if recorded is None:
            if not claim:
                return node or self.provisional_node()
            wanted = node or socket.gethostname()
            recorded = self.record_node(wanted)
        elif node is None and not claim:
            return recorded  # commands on the directory act as its node
        else:
            wanted = node or socket.gethostname()
        if wanted != recorded:
            raise ConfigError(
                "node_name",
                f"the cache directory {self.root} belongs to node {recorded!r} (recorded in "
                f"{self.node_file}), not {wanted!r}; run as node {recorded!r} or use another cache "
                "directory (two nodes on one directory would delete each other's bundles)",
            )
        return recorded

    def dir_mode(self) -> int:
        """Permission bits for directories the store creates: the root's own bits."""
        return stat.S_IMODE(self.root.stat().st_mode) & 0o777

    def file_mode(self) -> int:
        """Permission bits for files the store publishes: the root's bits without exec bits."""
        return self.dir_mode() & 0o666

    def ensure(self) -> None:
        """Create the root, its subdirectories and ``CACHEDIR.TAG``.

        Idempotent and safe when several processes race: ``mkdir`` tolerates existing dirs
        and the tag is written under a unique temp name and renamed into place.

        Refuses (``CacheError``) a non-empty root without ``CACHEDIR.TAG``: it is not a cache
        this service made, and reconcile would otherwise treat its contents as ours. The tag is
        written before anything else, so a racing process never sees an untagged non-empty
        root. A subfolder that is a symlink is refused too: deleting through it would delete
        whatever it points to.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.root.is_dir():
            raise NotADirectoryError(f"cache root {self.root} is not a directory; pick another --cache-dir")
        if not _has_tag(self.cachedir_tag):
            ours = (CACHEDIR_TAG_NAME, f".{CACHEDIR_TAG_NAME}.")  # a tag (maybe stale) or its temp file
            foreign = sorted(p.name for p in self.root.iterdir() if not p.name.startswith(ours))
            # Read the tag again after the listing: a racing process may have written it and
            # made its subfolders between our first read and the listing; the tag comes first,
            # so a listing that saw those subfolders is followed by a visible tag.
            if foreign and not _has_tag(self.cachedir_tag):
                raise CacheError(
                    f"{self.root} is not empty ({', '.join(foreign[:5])}) and has no {CACHEDIR_TAG_NAME}, "
                    "so it is not a cachesvc cache; pass an empty or new --cache-dir "
                    f"(or, if it is a cache that lost its tag, restore {CACHEDIR_TAG_NAME})"
                )
            write_atomic(self.cachedir_tag, CACHEDIR_TAG_CONTENT.encode(), self.file_mode())
        mode = self.dir_mode()
        for path in (self.engines, self.checkpoints, self.staging, self.locks, self.trash):
            make_dir(path, mode)

    def check_subfolder(self, path: Path) -> Path:
        """``path`` if it is a real directory (``lstat``), else ``CacheError`` (symlinks refused)."""
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return path
        if not stat.S_ISDIR(st.st_mode):
            raise CacheError(
                f"{path} is a symlink or not a directory; the cache deletes inside its folders and "
                "never follows links out of it. Replace it with a real directory"
            )
        return path

    def bundle_dir(self, relpath: Path | str) -> Path:
        """Absolute bundle directory for a path relative to the root (e.g. from the catalog).

        Raises ``ValueError`` for an absolute path, a ``..`` component or an empty path, so a
        bad catalog row can never point the store at something outside the cache.
        """
        rel = PurePosixPath(Path(relpath).as_posix())
        if rel.is_absolute() or Path(relpath).is_absolute():
            raise ValueError(f"bundle path {str(relpath)!r} must be relative to the cache root, not absolute")
        if ".." in rel.parts:
            raise ValueError(f"bundle path {str(relpath)!r} must not contain '..' (it would leave the cache)")
        if not rel.parts or rel.parts == (".",):
            raise ValueError("bundle path is empty; expected e.g. 'engines/<model-digest16>/<profile-name>'")
        return self.root.joinpath(*rel.parts)


def _read_name(path: Path) -> str | None:
    """The one-line name in ``path``, or None when the file is missing or empty."""
    try:
        name = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None
    return name or None


def remove_tree(layout: CacheLayout, path: Path, label: str) -> bool:
    """Rename ``path`` (a directory inside the cache) into the trash, so it vanishes at once,
    then delete it; True when it was there."""
    trashed = layout.check_subfolder(layout.trash) / f"{label}.{secrets.token_hex(6)}"
    try:
        os.replace(path, trashed)
    except FileNotFoundError:
        return False
    except OSError:  # the trash is on another filesystem or missing: delete in place
        trashed = path
    shutil.rmtree(trashed, ignore_errors=True)
    return True


def _files_bytes(directory: Path) -> int:
    """Bytes of the regular files directly in ``directory`` (0 when it is missing)."""
    total = 0
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    for entry in entries:
        with contextlib.suppress(OSError):
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def _has_tag(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            return fh.readline().rstrip(b"\r\n") == CACHEDIR_TAG_SIGNATURE.encode()
    except FileNotFoundError:
        return False


def make_dir(path: Path, mode: int) -> bool:
    """Create one directory with exactly ``mode`` (umask does not apply); True if created.

    An existing directory keeps its bits: an operator may have set them on purpose.
    """
    try:
        path.mkdir()
    except FileExistsError:
        # lstat: a symlink to a directory elsewhere is not one of our directories.
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise CacheError(
                f"{path} exists but is a symlink or not a directory; the cache never follows links "
                "out of its root. Replace it with a real directory"
            ) from None
        return False
    os.chmod(path, mode)
    fsync_dir(path.parent)
    return True


def make_dirs(path: Path, top: Path, mode: int) -> None:
    """Create ``path`` and any missing parents below ``top`` (which must exist), each with ``mode``."""
    missing: list[Path] = []
    current = path
    while current != top and not current.exists():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for directory in reversed(missing):
        make_dir(directory, mode)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (renames, creations) to disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush a regular file's data to disk (without following a symlink)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` so readers see the old file or the whole new one, never a part.

    The temp name is unique per writer, so concurrent writers never share a half-written file;
    the last ``os.replace`` wins.
    """
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        try:
            view = memoryview(data)
            while view:
                written = os.write(fd, view)
                view = view[written:]
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)
