"""GGUF files as checkpoints: find them, name them, convert each once into ``checkpoints/gguf/``.

Three ways to name one: a ``.gguf`` file, a directory holding exactly one ``.gguf`` (and no
``config.json``), or a hub file ``org/name/FILE.gguf`` (what ``--gguf-file FILE`` builds from
``org/name``), downloaded with ``huggingface_hub.hf_hub_download``.

Conversion (``inference.builder.gguf_convert``) writes a Hugging Face-style checkpoint
directory: config and tokenizer files next to a copy of the GGUF (``model.gguf``, its tensors
in their own types; the builder dequantizes them while it reads). It is keyed by the GGUF's
digest (header, metadata and tensor table in full, plus fixed samples of the tensor data:
bounded reads, independent of the file's name and place) and the converter version, built in
a unique hidden staging directory next to its final place, checked (the copy has the digest
of the key), flushed, and renamed into ``checkpoints/gguf/<digest16>-<converter>/`` in one
``os.replace`` under an exclusive per-key lock. A second resolve of the same file finds that
directory and reads no tensor; a crash leaves at most a stale staging directory (and the
``.source`` file beside it naming the model), removed by the next conversion of that key or by
reconcile, which records the death as a ``build_failed`` event. The copy follows the cache's
disk-space rule (``cachesvc.cache.store.space``): refused up front when the file is larger than the
free space, one ``DiskFullError`` line when the disk fills up part way.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cachesvc.cache.crashpoints import crash_point
from cachesvc.cache.store.bundles import fix_modes_and_fsync
from cachesvc.cache.store.layout import fsync_dir, make_dirs
from cachesvc.cache.store.locks import BundleLocks
from cachesvc.cache.store.manifest import sample_offsets
from cachesvc.cache.store.space import disk_full, require_free
from cachesvc.errors import CheckpointError

log = logging.getLogger("cachesvc.checkpoints")

GGUF_SUFFIX = ".gguf"
#: The GGUF inside a converted checkpoint directory (``inference.builder.gguf_reader.GGUF_FILE``,
#: named again here so that resolving a checkpoint imports no builder).
CONVERTED_GGUF_FILE = "model.gguf"
GGUF_DIGEST_VERSION = 1
#: Where converted checkpoints live, under the cache's ``checkpoints/``.
GGUF_SUBDIR = "gguf"
#: A header (metadata + tensor table) this large is not a model's; refusing it bounds the reads.
MAX_GGUF_HEADER_BYTES = 512 * 2**20
SAMPLE_BYTES = 64
DEFAULT_ALIGNMENT = 32
#: How long a conversion waits for another process converting the same file.
CONVERT_LOCK_TIMEOUT = 1800.0

# GGUF metadata value types -> fixed byte sizes (8 = string, 9 = array are variable).
_FIXED_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


# --------------------------------------------------------------------------- naming


def split_hub_gguf(model: str) -> tuple[str, str] | None:
    """``org/name/FILE.gguf`` -> (``org/name``, ``FILE.gguf``); None for anything else."""
    parts = model.split("/")
    if len(parts) < 3 or not model.endswith(GGUF_SUFFIX) or any(not p for p in parts):
        return None
    return f"{parts[0]}/{parts[1]}", "/".join(parts[2:])


def hub_gguf_spec(repo: str, filename: str) -> str:
    """The model string for a GGUF file in a hub repo (see :func:`split_hub_gguf`)."""
    if not filename.endswith(GGUF_SUFFIX):
        raise CheckpointError(f"--gguf-file {filename!r} must name a {GGUF_SUFFIX} file in the repo")
    if repo.count("/") != 1:
        raise CheckpointError(f"--gguf-file needs a hub repo id 'org/name' as the model, got {repo!r}")
    return f"{repo}/{filename}"


def local_gguf(path: Path) -> Path | None:
    """The GGUF file ``path`` names: itself, or the one ``.gguf`` in a directory without config.json.

    None when ``path`` is not GGUF-shaped (an HF checkpoint dir); ``CheckpointError`` for a
    directory with several ``.gguf`` files and no config.json (which one is meant?).
    """
    if path.is_file():
        return path if path.name.endswith(GGUF_SUFFIX) else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(p for p in path.iterdir() if p.name.endswith(GGUF_SUFFIX) and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:5])
        raise CheckpointError(
            f"{path} holds {len(found)} .gguf files ({names}); pass the one to serve as the model"
        )
    return found[0] if found else None


# --------------------------------------------------------------------------- identity


def gguf_digest(path: Path, *, read_counter: Callable[[int], None] | None = None) -> str:
    """SHA-256 identity of a GGUF file: header, metadata and tensor table, plus data samples.

    ``read_counter`` is called with the number of bytes hashed (the header and the samples).
    Raises ``CheckpointError`` for a file that is not GGUF or whose header is cut short.
    """
    size = path.stat().st_size
    with path.open("rb") as fh:
        if size < 24:
            raise CheckpointError(f"{path} is not a GGUF file ({size} bytes); it is truncated or corrupt")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            data_start = _gguf_data_offset(mm, path)
            h = hashlib.sha256()
            for part in (f"cachesvc-gguf-digest-v{GGUF_DIGEST_VERSION}".encode(), struct.pack("<Q", size)):
                h.update(struct.pack("<Q", len(part)) + part)
            h.update(mm[:data_start])
            for off in sample_offsets(size - data_start, SAMPLE_BYTES):
                start = data_start + off
                h.update(struct.pack("<Q", off) + mm[start:start + SAMPLE_BYTES])
    if read_counter is not None:
        read_counter(data_start + 3 * min(SAMPLE_BYTES, size - data_start))
    return h.hexdigest()


def _gguf_data_offset(buf: mmap.mmap, path: Path) -> int:
    """Walk the header (metadata and tensor infos) without decoding it; return where data starts."""
    if buf[:4] != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file (no GGUF magic); pass a .gguf model file")
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in (2, 3):
        raise CheckpointError(f"{path} is GGUF version {version}; versions 2 and 3 are supported")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    pos = 24
    limit = min(len(buf), MAX_GGUF_HEADER_BYTES)
    alignment = DEFAULT_ALIGNMENT

    def need(n: int) -> None:
        if pos + n > limit:
            raise CheckpointError(
                f"{path}: the GGUF header is cut short (needs byte {pos + n}, file has {len(buf)}); "
                "the file is truncated or corrupt, download it again"
            )

    def skip_string() -> None:
        nonlocal pos
        need(8)
        (n,) = struct.unpack_from("<Q", buf, pos)
        need(8 + n)
        pos += 8 + n

    def skip_value(kind: int) -> None:
        nonlocal pos
        if kind == _STRING:
            skip_string()
        elif kind == _ARRAY:
            need(12)
            elem, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if elem in _FIXED_SIZES:
                need(_FIXED_SIZES[elem] * count)
                pos += _FIXED_SIZES[elem] * count
            else:
                for _ in range(count):
                    skip_value(elem)
        elif kind in _FIXED_SIZES:
            need(_FIXED_SIZES[kind])
            pos += _FIXED_SIZES[kind]
        else:
            raise CheckpointError(f"{path}: unknown GGUF metadata type {kind}; the file is corrupt")

    for _ in range(n_kv):
        need(8)
        (klen,) = struct.unpack_from("<Q", buf, pos)
        need(8 + klen + 4)
        key = bytes(buf[pos + 8:pos + 8 + klen])
        pos += 8 + klen
        (kind,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if key == b"general.alignment" and kind == 4:
            need(4)
            (alignment,) = struct.unpack_from("<I", buf, pos)
        skip_value(kind)
    for _ in range(n_tensors):
        skip_string()
        need(4)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        need(4 + 8 * n_dims + 12)
        pos += 4 + 8 * n_dims + 12
    if alignment < 1:
        raise CheckpointError(f"{path}: general.alignment {alignment} is invalid; the file is corrupt")
    return min(pos + (-pos) % alignment, len(buf))


# --------------------------------------------------------------------------- conversion


def converted_dir(checkpoints_dir: Path, digest: str) -> Path:
    """Where the conversion of the GGUF with ``digest`` lives."""
    from inference.builder.gguf_convert import CONVERTER_VERSION

    return Path(checkpoints_dir) / GGUF_SUBDIR / f"{digest[:16]}-{CONVERTER_VERSION}"


def convert_once(
    gguf_path: Path, checkpoints_dir: Path, *, lock_timeout: float = CONVERT_LOCK_TIMEOUT,
    owned: bool = False, source: str | None = None,
) -> Path:
    """The converted checkpoint directory of ``gguf_path``: found, or converted and published.

    ``owned``: the file is the cache's own (a hub download under ``checkpoints_dir``), so the
    converted directory takes it as a hard link instead of a second copy (a user's file is
    always copied: its permissions and later edits stay its own). ``source``: the model as the
    user named it (default: the path), recorded beside the staging directory so that the
    reconcile after a crash reports whose conversion died (:func:`remove_orphaned_conversions`).

    Raises ``CheckpointError`` when the file cannot be converted, ``InsufficientStorageError``
    when the disk cannot hold the copy (refused before it starts when the free space is already
    short, or when the disk fills up part way); nothing is left behind then.
    """
    digest = gguf_digest(gguf_path)
    final = converted_dir(checkpoints_dir, digest)
    if (final / "config.json").is_file():
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    locks = BundleLocks(root / ".locks")
    key = f"gguf-{final.name}"
    with locks.exclusive(key, timeout=lock_timeout):
        if (final / "config.json").is_file():  # another process converted it while we waited
            return final
        _remove_stale_staging(root, final.name)
        what = f"converting {gguf_path.name}"
        if not owned:  # an owned file is linked, not copied
            require_free(root, gguf_path.stat().st_size, what)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
        marker = staging.parent / f"{staging.name}{_SOURCE_SUFFIX}"
        try:
            marker.write_text(source or str(gguf_path))
            log.info("converting %s into %s", gguf_path, final)
            _convert(gguf_path, staging, owned)
            _check_copy(gguf_path, staging, digest)
            crash_point("gguf:converted")
            mode = _cache_mode(Path(checkpoints_dir))
            fix_modes_and_fsync(staging, mode, mode & 0o666)
            if final.exists():  # a directory without config.json: a broken leftover
                shutil.rmtree(final)
            make_dirs(final.parent, Path(checkpoints_dir), mode)
            os.replace(staging, final)
            fsync_dir(final.parent)
        except BaseException as exc:
            shutil.rmtree(staging, ignore_errors=True)
            full = disk_full(exc, what, root)
            if full is not None:
                raise full from exc
            raise
        finally:
            marker.unlink(missing_ok=True)
    return final


def _convert(gguf_path: Path, out_dir: Path, link: bool) -> None:
    from inference.builder.errors import BuildInputError
    from inference.builder.gguf_convert import convert_gguf

    try:
        convert_gguf(gguf_path, out_dir, link=link)
    except BuildInputError as exc:
        raise CheckpointError(f"cannot use {gguf_path.name}: {exc}") from exc


def _check_copy(gguf_path: Path, staging: Path, digest: str) -> None:
    """The copied file must be the one the key names (the source may change while it is copied)."""
    if gguf_digest(staging / CONVERTED_GGUF_FILE) != digest:
        raise CheckpointError(
            f"{gguf_path} changed while it was being converted; retry once the file is complete"
        )


def _cache_mode(checkpoints_dir: Path) -> int:
    # Published directories take the cache's permissions, as bundles do.
    probe = checkpoints_dir if checkpoints_dir.is_dir() else checkpoints_dir.parent
    return probe.stat().st_mode & 0o7777


#: A conversion's staging directory: ``.<digest16>-<converter>.<mkdtemp suffix>`` (see above).
_STAGING_NAME = re.compile(r"^\.(?P<key>[0-9a-f]{16}-gguf-[0-9]+)\.[A-Za-z0-9_]+$")
#: Beside it while it exists, ``<staging name>.source``: the model the conversion is for.
_SOURCE_SUFFIX = ".source"


@dataclass(frozen=True)
class OrphanedConversion:
    """A conversion whose process died: its staging directory (removed; relative to the
    checkpoints directory) and the model it was converting (None when that was not recorded)."""

    path: str
    source: str | None


def remove_orphaned_conversions(checkpoints_dir: Path) -> list[OrphanedConversion]:
    """Delete the staging directories of conversions whose process died (reconcile calls this,
    and records each as a failed build, as it does a bundle build that died).

    Only names of our own pattern are touched, and only while nobody holds their key's lock: a
    conversion running now holds it for as long as its staging directory exists."""
    root = Path(checkpoints_dir) / GGUF_SUBDIR
    try:
        entries = sorted(root.iterdir())
    except FileNotFoundError:
        return []
    locks = BundleLocks(root / ".locks")
    removed: list[OrphanedConversion] = []
    for entry in entries:
        match = _STAGING_NAME.match(entry.name.removesuffix(_SOURCE_SUFFIX))
        if match is None or entry.is_symlink():
            continue
        with locks.try_exclusive(f"gguf-{match['key']}") as got:
            if not got:  # a conversion is running
                continue
            if entry.is_dir():
                marker = entry.parent / f"{entry.name}{_SOURCE_SUFFIX}"
                source = _read_source(marker)
                shutil.rmtree(entry, ignore_errors=True)
                if not entry.exists():
                    marker.unlink(missing_ok=True)
                    removed.append(OrphanedConversion(f"{GGUF_SUBDIR}/{entry.name}", source))
                    log.info("removed %s, left by a conversion that did not finish", entry)
            elif entry.name.endswith(_SOURCE_SUFFIX) and not entry.with_name(
                    entry.name.removesuffix(_SOURCE_SUFFIX)).exists():
                entry.unlink(missing_ok=True)  # its directory went, the process died before this
    return removed


def _read_source(marker: Path) -> str | None:
    try:
        return marker.read_text()[:1000] or None
    except (OSError, UnicodeDecodeError):
        return None


def _remove_stale_staging(root: Path, name: str) -> None:
    """Staging dirs of this key left by a crash, with their markers (we hold its lock, so none
    is in use)."""
    for entry in root.glob(f".{name}.*"):
        if entry.is_symlink():
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir():
                shutil.rmtree(entry)
            elif entry.name.endswith(_SOURCE_SUFFIX):
                entry.unlink()


# --------------------------------------------------------------------------- hub


def download_gguf(
    repo: str, filename: str, cache_dir: Path, *, offline: bool, revision: str | None
) -> tuple[Path, str]:
    """Fetch ``filename`` of hub repo ``repo`` (or take it from the cache offline); (path, commit)."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    from cachesvc.cache.hub_errors import hub_refused, is_connection_error, is_server_error, unreachable
    from cachesvc.errors import HubUnreachableError

    cache_dir.mkdir(parents=True, exist_ok=True)
    spec = f"{repo}/{filename}"

    def fetch(local_only: bool) -> Path:
        return Path(huggingface_hub.hf_hub_download(
            repo, filename, cache_dir=cache_dir, revision=revision, local_files_only=local_only
        ))

    try:
        path = fetch(offline)
    except LocalEntryNotFoundError as exc:
        cause = exc.__cause__ if not offline else None
        if cause is not None and not isinstance(cause, EntryNotFoundError):
            raise unreachable(spec, cause) from exc
        raise HubUnreachableError(
            f"{spec} is not in the local cache ({cache_dir}) and offline mode is on or the hub is out "
            "of reach; set HF_HUB_OFFLINE=0 to download it, or pass a local .gguf file"
        ) from exc
    except Exception as exc:
        if is_connection_error(exc) or is_server_error(exc):
            raise unreachable(spec, exc) from exc
        raise hub_refused(spec, revision, exc) from exc
    # .../snapshots/<commit>/<filename>: the snapshot folder names the resolved revision.
    snapshot = path
    for _ in filename.split("/"):
        snapshot = snapshot.parent
    return path.resolve(), snapshot.name
