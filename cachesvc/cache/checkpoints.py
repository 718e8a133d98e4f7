"""Checkpoints: resolve a local directory or a Hugging Face model id, and compute its identity.

The identity digest is what the cache keys bundles on, so it must be the same for the same
checkpoint wherever it lives (a copy, a move, an HF cache snapshot made of symlinks into
blobs) and whatever its mtimes, and it must be cheap: a 10 GB shard costs the same reads as a
10 MB one. For that it hashes every checkpoint file's relative path and size, small metadata
files in full, and for weights only the safetensors (or GGUF) header plus three fixed 64-byte
samples (start, middle, end). The trade-off, on purpose: an in-place edit of a weight byte
outside the samples that keeps the file size does not change the digest. Real checkpoint changes (a new
revision, a re-export, a different dtype or shape) change sizes, headers or metadata.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from cachesvc.cache.gguf_checkpoints import (
    CONVERTED_GGUF_FILE,
    GGUF_SUFFIX,
    convert_once,
    download_gguf,
    gguf_digest,
    local_gguf,
    split_hub_gguf,
)
from cachesvc.cache.hub_errors import (
    at_revision,
    hub_refused,
    is_connection_error,
    is_server_error,
    unreachable,
)
from cachesvc.cache.store.manifest import sample_offsets
from cachesvc.errors import CheckpointError, ConfigError, HubUnreachableError, UnsupportedModelError

#: Bumped whenever the digest recipe changes, so old and new digests can never be equal.
DIGEST_VERSION = 1

#: Weight files: hashed by size plus bounded samples. A converted GGUF checkpoint's weights are
#: its ``CONVERTED_GGUF_FILE`` (hashed by ``gguf_digest``): the one GGUF file a build reads, so
#: the only one that is part of the identity (any other ``.gguf`` in a directory is not).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
#: Metadata files: hashed in full. ``.txt`` (BPE merges) and ``.jinja`` (chat templates) change
#: what a served model does just like ``tokenizer.json`` does, so they are part of the identity.
METADATA_SUFFIXES = (".json", ".model", ".txt", ".jinja")
CHECKPOINT_SUFFIXES = WEIGHT_SUFFIXES + METADATA_SUFFIXES

#: A metadata file this big is not metadata; refusing it keeps reads bounded.
MAX_METADATA_BYTES = 64 * 2**20
#: Same limit the safetensors library enforces on its JSON header.
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
SAMPLE_BYTES = 64

#: What ``resolve_checkpoint`` asks the hub for when it cannot list the repo first (offline).
HUB_ALLOW_PATTERNS = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.json",
    "*.model",
    "*.jinja",
    "*.txt",
    "tokenizer*",
)

# Same rules as huggingface_hub's validate_repo_id: optional namespace, 96 chars per part,
# letters, digits, '-', '_', '.'; no '--' or '..'; no leading/trailing '-' or '.'.
_HUB_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"
_HUB_ID_RE = re.compile(rf"^(?:{_HUB_PART}/)?{_HUB_PART}$")

ReadCounter = Callable[[int], None]


@dataclass(frozen=True)
class ResolvedCheckpoint:
    """A checkpoint directory on local disk with its identity.

    ``source`` is what the user passed (path or hub id), ``path`` the absolute directory that
    holds the files, ``revision`` the hub commit hash for hub checkpoints (``None`` for local).
    """

    source: str
    path: Path
    digest: str
    size_bytes: int
    file_count: int
    revision: str | None = None


@dataclass(frozen=True)
class _CheckpointFile:
    relpath: str
    path: Path
    size: int


# --------------------------------------------------------------------------- identity


def checkpoint_digest(path: Path, *, read_counter: ReadCounter | None = None) -> str:
    """Return the SHA-256 hex identity of the checkpoint directory ``path``.

    Covers every checkpoint file (``CHECKPOINT_SUFFIXES``, recursive, hidden entries such as
    ``.git`` and ``.cache`` skipped, symlinks followed) in sorted relative-path order: its
    relative POSIX path, its size, and its content (metadata files in full; safetensors:
    header plus three 64-byte payload samples; a converted GGUF's ``model.gguf``: ``gguf_digest``,
    its header plus three 64-byte data samples; other weights: three 64-byte samples).
    ``read_counter`` is called with the byte count of every read. Raises ``CheckpointError``
    for a directory without checkpoint files, a broken symlink, an oversized metadata file or
    a malformed safetensors file.
    """
    return _digest_files(_checkpoint_files(path), read_counter)


def _digest_files(files: list[_CheckpointFile], read_counter: ReadCounter | None) -> str:
    h = hashlib.sha256()
    _frame(h, f"cachesvc-checkpoint-digest-v{DIGEST_VERSION}".encode())
    h.update(struct.pack("<Q", len(files)))
    count = read_counter or (lambda _n: None)
    for f in files:
        _frame(h, f.relpath.encode("utf-8", "surrogateescape"))
        h.update(struct.pack("<Q", f.size))
        chunks = _content_chunks(f, count)
        h.update(struct.pack("<Q", len(chunks)))
        for chunk in chunks:
            _frame(h, chunk)
    return h.hexdigest()


def checkpoint_size(path: Path) -> tuple[int, int]:
    """Return ``(total bytes, file count)`` of the checkpoint files under ``path`` (no reads)."""
    files = _checkpoint_files(path)
    return sum(f.size for f in files), len(files)


def _frame(h: hashlib._Hash, data: bytes) -> None:
    # Length-prefixing every field makes the byte stream parseable back into fields, so two
    # different file sets can never produce the same stream by shifting bytes between fields.
    h.update(struct.pack("<Q", len(data)))
    h.update(data)


def _checkpoint_files(root: Path) -> list[_CheckpointFile]:
    root = Path(root).expanduser()
    if not root.exists():
        raise CheckpointError(f"no such directory: {root}")
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory; pass the checkpoint directory")
    files: list[_CheckpointFile] = []
    for file_path in _walk(root):
        rel = PurePosixPath(*file_path.relative_to(root).parts).as_posix()
        if not file_path.name.endswith(CHECKPOINT_SUFFIXES) and rel != CONVERTED_GGUF_FILE:
            continue
        try:
            size = file_path.stat().st_size  # follows symlinks: HF snapshots link into blobs/
        except FileNotFoundError:
            raise CheckpointError(
                f"{file_path} is a broken symlink (its target is missing); the download is incomplete, "
                "download the checkpoint again"
            ) from None
        files.append(_CheckpointFile(rel, file_path, size))
    if not files:
        raise CheckpointError(
            f"no checkpoint files under {root} (expected some of: {', '.join(CHECKPOINT_SUFFIXES)})"
        )
    files.sort(key=lambda f: f.relpath)
    return files


def _walk(root: Path) -> Iterator[Path]:
    """Yield non-hidden regular files under ``root``, following directory symlinks without looping.

    A directory symlink is followed only when its target lies inside ``root``: a checkpoint
    named over HTTP must not make the service walk (and hash) the rest of the filesystem.
    File symlinks are followed (Hugging Face snapshots link every file into ``blobs/``).
    """
    seen: set[tuple[int, int]] = set()
    top = os.path.realpath(root)
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        st = os.stat(dirpath)
        key = (st.st_dev, st.st_ino)
        if key in seen:
            dirnames[:] = []
            continue
        seen.add(key)
        dirnames[:] = sorted(
            d
            for d in dirnames
            if not d.startswith(".")
            and (not os.path.islink(os.path.join(dirpath, d)) or _inside(os.path.join(dirpath, d), top))
        )
        for name in filenames:
            if name.startswith("."):
                continue
            p = Path(dirpath, name)
            if p.is_dir():
                continue
            yield p


def _inside(path: str, top: str) -> bool:
    target = os.path.realpath(path)
    return target == top or target.startswith(top.rstrip(os.sep) + os.sep)


def _content_chunks(f: _CheckpointFile, count: ReadCounter) -> list[bytes]:
    if f.relpath.endswith(METADATA_SUFFIXES):
        return [_read_metadata(f, count)]
    if f.relpath == CONVERTED_GGUF_FILE:
        return [_tag(b"gguf", 0) + bytes.fromhex(gguf_digest(f.path, read_counter=count))]
    with open(f.path, "rb") as fh:
        if f.relpath.endswith(".safetensors"):
            return _safetensors_chunks(f, fh, count)
        return _samples(fh, 0, f.size, count)


def _read_metadata(f: _CheckpointFile, count: ReadCounter) -> bytes:
    if f.size > MAX_METADATA_BYTES:
        raise CheckpointError(
            f"{f.path} is {f.size} bytes; metadata files ({', '.join(METADATA_SUFFIXES)}) over "
            f"{MAX_METADATA_BYTES // 2**20} MiB are not supported. Remove or rename it if it is not part "
            "of the checkpoint"
        )
    with open(f.path, "rb") as fh:
        data = _read_at(fh, 0, f.size, count)
    if len(data) != f.size:
        raise CheckpointError(f"{f.path} changed size while it was being read; retry once it is complete")
    return data


def _safetensors_chunks(f: _CheckpointFile, fh: BinaryIO, count: ReadCounter) -> list[bytes]:
    prefix = _read_at(fh, 0, 8, count)
    if len(prefix) < 8:
        raise CheckpointError(
            f"{f.path} is not a valid safetensors file: {f.size} bytes is too short for the 8-byte header "
            "length; the file is truncated, download it again"
        )
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > MAX_SAFETENSORS_HEADER_BYTES or 8 + header_len > f.size:
        raise CheckpointError(
            f"{f.path} is not a valid safetensors file: header length {header_len} does not fit the file "
            f"size {f.size}; the file is truncated or corrupt, download it again"
        )
    header = _read_at(fh, 8, header_len, count)
    payload_start = 8 + header_len
    payload_len = f.size - payload_start
    return [prefix + header, *_samples(fh, payload_start, payload_len, count)]


def _samples(fh: BinaryIO, start: int, length: int, count: ReadCounter) -> list[bytes]:
    """The tagged start, middle and end samples of the ``length`` bytes at ``start``."""
    return [
        _tag(b"sample", off) + _read_at(fh, start + off, SAMPLE_BYTES, count)
        for off in sample_offsets(length, SAMPLE_BYTES)
    ]


def _tag(name: bytes, offset: int) -> bytes:
    return name + struct.pack("<Q", offset)


def _read_at(fh: BinaryIO, offset: int, n: int, count: ReadCounter) -> bytes:
    fh.seek(offset)
    parts: list[bytes] = []
    remaining = n
    while remaining > 0:
        data = fh.read(remaining)
        if not data:
            break
        count(len(data))
        parts.append(data)
        remaining -= len(data)
    return b"".join(parts)


# --------------------------------------------------------------------------- resolution


def looks_like_path(model: str) -> bool:
    """True when ``model`` names a local path (exists, or starts with '/', './', '../', '~')."""
    return model.startswith(("/", "./", "../", "~")) or model in (".", "..") or os.path.exists(model)


def is_hub_id(model: str) -> bool:
    """True when ``model`` is a syntactically valid Hugging Face model id (``org/name`` or ``name``)."""
    return bool(_HUB_ID_RE.match(model)) and ".." not in model and "--" not in model


def resolve_checkpoint(
    model: str,
    checkpoints_dir: Path,
    *,
    offline: bool | None = None,
    revision: str | None = None,
) -> ResolvedCheckpoint:
    """Resolve ``model`` (a local checkpoint directory or a Hugging Face model id) and digest it.

    GGUF models (a ``.gguf`` file, a directory holding one, or ``org/name/FILE.gguf`` on the
    hub) resolve to their converted checkpoint directory under ``checkpoints_dir/gguf/``,
    converted on first use (see ``cachesvc.cache.gguf_checkpoints``).

    Hub ids are downloaded into ``checkpoints_dir`` with ``huggingface_hub.snapshot_download``
    (weights, JSON, tokenizer and template files only). ``offline`` defaults to huggingface_hub's
    offline mode (``HF_HUB_OFFLINE``); offline, only the local cache is used. Raises
    ``CheckpointError`` for a bad path, the wrong kind of directory, a bad id or a hub refusal,
    and ``HubUnreachableError`` when the hub cannot be reached and nothing is cached.
    """
    if not isinstance(model, str) or not model.strip():
        raise CheckpointError(
            "model is empty; pass a checkpoint directory or a Hugging Face model id (org/name)"
        )
    if looks_like_path(model):
        if revision is not None:
            raise CheckpointError(
                f"revision {revision!r} applies to Hugging Face model ids only; {model!r} is a local "
                "directory, drop the revision or check out that revision there"
            )
        directory = Path(model).expanduser()
        if not directory.exists():
            raise CheckpointError(f"no such directory: {model}")
        directory = directory.resolve()
        gguf_file = local_gguf(directory)
        if gguf_file is not None:
            check_gguf_family(gguf_file)
            directory = convert_once(gguf_file, Path(checkpoints_dir), source=model)
        _check_local_checkpoint(directory)
        rev = None
    elif (hub_gguf := split_hub_gguf(model)) is not None and is_hub_id(hub_gguf[0]):
        gguf_file, rev = download_gguf(
            *hub_gguf, Path(checkpoints_dir), offline=hub_offline_default() if offline is None else offline,
            revision=revision,
        )
        check_gguf_family(gguf_file)
        directory = convert_once(gguf_file, Path(checkpoints_dir), owned=True, source=model)
        _check_local_checkpoint(directory, source=model)
    elif is_hub_id(model):
        directory, rev = _download(model, Path(checkpoints_dir), offline=offline, revision=revision)
        _check_local_checkpoint(directory, source=model)
    else:
        raise CheckpointError(
            f"{model!r} is neither an existing directory nor a valid Hugging Face model id; pass a "
            "checkpoint directory (e.g. ./my-model or /models/llama) or an id like 'org/name' (letters, "
            "digits, '-', '_', '.')"
        )
    files = _checkpoint_files(directory)  # one walk for digest, size and count
    return ResolvedCheckpoint(
        source=model,
        path=directory,
        digest=_digest_files(files, None),
        size_bytes=sum(f.size for f in files),
        file_count=len(files),
        revision=rev,
    )


def _check_local_checkpoint(directory: Path, *, source: str | None = None) -> None:
    """Reject what is not a Hugging Face checkpoint directory, saying what to pass instead."""
    where = f"{directory}" if source is None else f"{directory} (downloaded for {source})"
    if not directory.is_dir():
        raise CheckpointError(
            f"{where} is not a directory; pass the checkpoint directory that holds config.json"
        )
    if not (directory / "config.json").is_file() and not any(directory.glob("*.onnx")):
        # Before any walk: a directory such as /usr or / is refused at the cost of one stat.
        raise CheckpointError(
            f"{where} has no config.json; pass a Hugging Face checkpoint directory (config.json next to "
            "the weights)"
        )
    if _is_bundle_dir(directory):
        raise CheckpointError(
            f"{where} is already a built engine bundle, not a checkpoint; pass the Hugging Face checkpoint "
            "it was built from (or inspect it with `cachesvc bundles show`)"
        )
    names = [p.name for p in _walk(directory)]
    has_weights = any(n.endswith(WEIGHT_SUFFIXES) for n in names)
    has_weights = has_weights or (directory / CONVERTED_GGUF_FILE).is_file()
    if not has_weights and any(n.endswith(".onnx") for n in names):
        raise CheckpointError(
            f"{where} is an ONNX export (.onnx files, no .safetensors/.bin weights); pass the original "
            "Hugging Face checkpoint directory instead, cachesvc builds its own engine from it"
        )
    if not (directory / "config.json").is_file():
        raise CheckpointError(
            f"{where} has no config.json; pass a Hugging Face checkpoint directory (config.json next to "
            "the weights)"
        )
    if not has_weights:
        raise CheckpointError(
            f"{where} has config.json but no weight files ({', '.join(WEIGHT_SUFFIXES)}); the checkpoint is "
            "incomplete, add its weights or download it again"
        )
    check_family(directory)


def check_family(directory: Path) -> None:
    """``UnsupportedModelError`` when ``directory``'s config.json names no registered model family
    (:mod:`inference.families`): bad input, refused before anything is recorded or built."""
    import json

    from inference.families import family_of_config

    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return  # the build says what is wrong with the file
    if not isinstance(raw, dict):
        return
    try:
        family_of_config(raw)
    except ValueError as exc:
        raise UnsupportedModelError(str(exc)) from None
    _check_layers(raw, "config.json")


def check_image_limits(directory: Path, max_image_tokens: int | None,
                       max_image_tokens_per_image: int | None) -> None:
    """``ConfigError`` naming the profile field when the image-token limits do not fit the
    checkpoint in ``directory``: set for a text-only model (it takes no images), or below what one
    image of a vision-language model takes. Reads config.json only; a config the build cannot read
    is the build's to report."""
    from inference.build_profile import ProfileError, check_image_limits_fit

    if max_image_tokens is None and max_image_tokens_per_image is None:
        return
    try:
        raw = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        raw = None
    if isinstance(raw, dict):
        tokens, model = _tokens_per_image(raw, directory)
    elif (directory / CONVERTED_GGUF_FILE).is_file():
        tokens, model = None, f"{directory.name} (a GGUF checkpoint)"
    else:
        return
    if tokens == 0:
        return
    try:
        check_image_limits_fit(tokens, max_image_tokens, max_image_tokens_per_image, model=model)
    except ProfileError as exc:
        raise ConfigError(exc.field, exc.detail) from None


def _tokens_per_image(raw: dict[str, Any], directory: Path) -> tuple[int | None, str]:
    """(tokens one image takes, the model in words) of a config.json: None for a text model, 0
    for a vision config the build will refuse in its own words."""
    from inference.builder.vision_config import vision_config_from
    from inference.errors import BuildInputError, UnsupportedFeatureError
    from inference.families import vision_family_of

    family = vision_family_of(raw)
    if family is None:
        arch = (raw.get("architectures") or ["?"])[0] if isinstance(raw.get("architectures"), list) else "?"
        return None, f"{directory.name} ({arch})"
    try:
        vision = vision_config_from(raw, text_hidden=0)
    except (BuildInputError, UnsupportedFeatureError, ValueError, TypeError):
        return 0, ""
    return (0, "") if vision is None else (vision.tokens_per_image, f"this {family.name} checkpoint")


def _check_layers(raw: dict[str, Any], source: str) -> None:
    """``UnsupportedModelError`` when the builder's reading of a config (``source``: config.json, or
    a GGUF's metadata) refuses a variant of a known family that no engine builds (Gemma's
    bidirectional attention, a rope type or activation of no family, a quantization_config, ...):
    bad input, refused before anything is recorded, in the words the build would fail with. A
    config the builder cannot read for other reasons (a missing field) is the build's to report."""
    from inference.builder.model_config import model_config_from
    from inference.errors import BuildInputError, UnsupportedFeatureError

    try:
        model_config_from(raw)
    except UnsupportedFeatureError as exc:
        raise UnsupportedModelError(f"{source}: {exc}") from None
    except (BuildInputError, ValueError, TypeError, KeyError):
        return


def _is_bundle_dir(directory: Path) -> bool:
    if (directory / "engine.json").is_file():
        return True
    manifest = directory / "manifest.json"
    if not manifest.is_file() or manifest.stat().st_size > MAX_METADATA_BYTES:
        return False
    try:
        data = json.loads(manifest.read_bytes())
    except (ValueError, OSError):
        return False
    return isinstance(data, dict) and "layout_version" in data


# --------------------------------------------------------------------------- hub


def hub_offline_default() -> bool:
    """huggingface_hub's offline mode: its constant, or ``HF_HUB_OFFLINE`` set truthy now."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE")
    return bool(constants.HF_HUB_OFFLINE) or (
        env is not None and env.upper() in constants.ENV_VARS_TRUE_VALUES
    )


def select_hub_files(repo_files: list[str]) -> list[str]:
    """Pick the files of a hub repo listing that make up the checkpoint.

    Top-level files only (repos keep alternative exports such as ``original/*.pth`` or
    ``onnx/`` in subfolders), and one weight format: safetensors when the repo has them,
    else PyTorch pickles; many repos ship both and downloading both doubles the bytes.
    """
    top = [f for f in repo_files if "/" not in f]
    has_safetensors = any(f.endswith(".safetensors") for f in top)
    weights: tuple[str, ...] = (".safetensors",) if has_safetensors else (".bin", ".pt", ".pth")
    return sorted(f for f in top if f.endswith(weights + METADATA_SUFFIXES) or f.startswith("tokenizer"))


def _download(model: str, cache_dir: Path, *, offline: bool | None, revision: str | None) -> tuple[Path, str]:
    import huggingface_hub
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError, OfflineModeIsEnabled

    if offline is None:
        offline = hub_offline_default()
    cache_dir.mkdir(parents=True, exist_ok=True)

    def from_cache(cause: BaseException | None) -> Path:
        try:
            return Path(
                huggingface_hub.snapshot_download(
                    model,
                    cache_dir=cache_dir,
                    revision=revision,
                    allow_patterns=_cached_selection(model, cache_dir, revision),
                    local_files_only=True,
                )
            )
        except IncompleteSnapshotError as exc:
            raise CheckpointError(
                f"the cached snapshot of {model}{at_revision(revision)} in {cache_dir} is incomplete and "
                f"the hub cannot be used to complete it ({exc}); download it again with network access"
            ) from exc
        except LocalEntryNotFoundError as exc:
            if cause is None or isinstance(cause, OfflineModeIsEnabled):
                # errors.py: HubUnreachableError covers "offline mode forbids it" too; it is a
                # CheckpointError, so callers that only know the base class still catch it.
                raise HubUnreachableError(
                    f"{model}{at_revision(revision)} is not in the local cache ({cache_dir}) and offline "
                    "mode is on; set HF_HUB_OFFLINE=0 to download it, pre-download it into that cache, "
                    "or pass a local checkpoint directory"
                ) from exc
            raise unreachable(model, cause) from cause

    if offline:
        path = from_cache(None)
    else:
        try:
            # model_info is one request without retries (list_repo_files backs off for ~20 s on a
            # dead connection); its siblings are the repo's full file listing.
            info = huggingface_hub.HfApi().model_info(model, revision=revision)
            repo_files = [sibling.rfilename for sibling in info.siblings or []]
        except Exception as exc:
            if isinstance(exc, OfflineModeIsEnabled) or is_connection_error(exc) or is_server_error(exc):
                # Same as snapshot_download does on its own: a cached snapshot still serves.
                path = from_cache(exc)
            else:
                raise hub_refused(model, revision, exc) from exc
        else:
            allow = select_hub_files(repo_files)
            try:
                path = Path(
                    huggingface_hub.snapshot_download(
                        model, cache_dir=cache_dir, revision=revision, allow_patterns=allow
                    )
                )
            except Exception as exc:
                if is_connection_error(exc) or is_connection_error(exc.__cause__):
                    raise unreachable(model, exc.__cause__ or exc) from exc
                raise hub_refused(model, revision, exc) from exc
    # snapshots/<commit hash>/ : the folder name is the resolved revision.
    return path.resolve(), path.name


def _cached_selection(model: str, cache_dir: Path, revision: str | None) -> list[str]:
    """The files an earlier online resolve selected, from huggingface_hub's cached tree listing.

    Offline, snapshot_download checks the snapshot against that listing; asking it for the
    generic patterns would call the formats we deliberately skipped "missing".
    """
    import huggingface_hub

    get_cached_repo_tree = getattr(huggingface_hub, "get_cached_repo_tree", None)  # newer releases only
    if get_cached_repo_tree is None:
        return list(HUB_ALLOW_PATTERNS)
    try:
        listing = [f.path for f in get_cached_repo_tree(model, revision=revision, cache_dir=cache_dir)]
    except Exception:
        # No listing cached (e.g. a hand-made or older cache): snapshot_download cannot check
        # completeness either, so the generic patterns are as good as any.
        return list(HUB_ALLOW_PATTERNS)
    return select_hub_files(listing) or list(HUB_ALLOW_PATTERNS)


# -- removal ----------------------------------------------------------------------------------


def owned_checkpoint_path(checkpoints_dir: Path, path: Path) -> bool:
    """Whether ``path`` is one of the cache's own checkpoints: strictly inside ``checkpoints_dir``
    (hub downloads, converted GGUFs), reached without a symbolic link on the way.

    A link anywhere from ``checkpoints_dir`` down could point at a user's files, so a path
    through one is never ours; nor is anything outside (a user's local checkpoint directory).
    """
    top = Path(os.path.abspath(checkpoints_dir))
    target = Path(os.path.abspath(path))
    if target == top or not target.is_relative_to(top) or top.is_symlink():
        return False
    current = top
    for part in target.relative_to(top).parts:
        if part in ("", ".", ".."):
            return False
        current = current / part
        if current.is_symlink():
            return False
    return True


def remove_checkpoint_files(checkpoints_dir: Path, trash_dir: Path, path: Path) -> int:
    """Delete one of the cache's own checkpoints (see :func:`owned_checkpoint_path`, which the
    caller checks first); returns the bytes freed (0 when it is already gone).

    A hub snapshot (``models--org--name/snapshots/<commit>``) is deleted with huggingface_hub's
    own cache API, which frees the blobs no other revision uses and drops the repo folder when
    it was the last revision; any other directory (a converted GGUF) is renamed into the
    cache's trash (it vanishes at once) and then deleted.
    """
    if not owned_checkpoint_path(checkpoints_dir, path):
        raise ValueError(f"{path} is not a checkpoint of this cache")
    target = Path(os.path.abspath(path))
    if not os.path.lexists(target):
        return 0
    parts = target.relative_to(Path(os.path.abspath(checkpoints_dir))).parts
    if len(parts) == 3 and parts[0].startswith("models--") and parts[1] == "snapshots":
        freed = _remove_hub_revision(checkpoints_dir, target, parts[2])
        if freed is not None:
            return freed
    # A file with another name too (a converted hub GGUF shares its download's inode) frees nothing.
    stats = [(Path(root) / name).lstat() for root, _, names in os.walk(target) for name in names]
    size = sum(st.st_size for st in stats if st.st_nlink <= 1)
    trash_dir.mkdir(exist_ok=True)
    aside = trash_dir / f"checkpoint-{target.name}-{uuid.uuid4().hex[:8]}"
    os.rename(target, aside)
    shutil.rmtree(aside, ignore_errors=True)
    return size


def _remove_hub_revision(checkpoints_dir: Path, snapshot: Path, commit: str) -> int | None:
    """Delete one revision of a hub repo in the cache; None when huggingface_hub does not list it."""
    import huggingface_hub

    info = huggingface_hub.scan_cache_dir(checkpoints_dir)
    for repo in info.repos:
        for revision in repo.revisions:
            if Path(os.path.abspath(revision.snapshot_path)) == snapshot and revision.commit_hash == commit:
                strategy = info.delete_revisions(commit)
                strategy.execute()
                return int(strategy.expected_freed_size)
    return None


#: Entries a local checkpoint directory may hold for the allowed-roots check (a checkpoint has
#: tens of files; bounding the walk keeps a request from listing a huge tree).
MAX_CHECKPOINT_ENTRIES = 10_000


def check_model_name(field: str, model: str, allowed_roots: tuple[Path, ...] | None) -> None:
    """A hub id (or ``org/name/FILE.gguf``), or a local checkpoint that passes
    :func:`check_local_path`: a directory with ``config.json``, a ``.gguf`` file, or a directory
    holding one."""
    if not looks_like_path(model):
        if any(part in ("", ".", "..") or "\\" in part for part in model.split("/")):
            raise ConfigError(
                field, f"{model!r} has an empty, '.' or '..' component; name a hub model or file plainly"
            )
        hub_gguf = split_hub_gguf(model)
        if not is_hub_id(hub_gguf[0] if hub_gguf else model):
            raise ConfigError(
                field,
                f"{model!r} is not a Hugging Face model id ('org/name': letters, digits, '-', '_', '.'; "
                "or 'org/name/FILE.gguf') nor an existing directory",
            )
        return
    path = check_local_path(field, model, allowed_roots, what="checkpoint")
    if path.is_file() and path.name.endswith(GGUF_SUFFIX):
        check_gguf_family(path)
        return
    if not path.is_dir():
        raise CheckpointError(f"no such directory: {model}")
    gguf_file = local_gguf(path) if not (path / "config.json").is_file() else None
    if not (path / "config.json").is_file() and gguf_file is None:
        raise CheckpointError(
            f"{model} has no config.json and no .gguf file; pass a Hugging Face checkpoint directory "
            "(config.json next to the weights) or a GGUF file"
        )
    if gguf_file is not None:
        check_gguf_family(gguf_file)
    else:
        check_family(path)


def check_gguf_family(path: Path) -> None:
    """``UnsupportedModelError`` when the GGUF file's ``general.architecture`` is of no registered
    family or its metadata describes a variant no engine builds (its header
    only; anything else wrong with the file is the conversion's to say)."""
    from inference.builder.gguf_reader import gguf_config, gguf_metadata, read_gguf_header
    from inference.errors import UnsupportedFeatureError
    from inference.families import family_of_gguf

    try:
        header = read_gguf_header(path)
        arch = gguf_metadata(header, "general.architecture")
    except (OSError, ValueError):
        return
    try:
        family_of_gguf(arch)
    except ValueError as exc:
        raise UnsupportedModelError(str(exc)) from None
    try:
        raw = gguf_config(header)
    except UnsupportedFeatureError as exc:
        raise UnsupportedModelError(f"{path.name}: {exc}") from None
    except (OSError, ValueError, KeyError, TypeError):
        return  # the conversion says what is wrong with the file
    _check_layers(raw, f"{path.name} (its metadata)")


def check_local_path(field: str, given: str, allowed_roots: tuple[Path, ...] | None, *, what: str) -> Path:
    """The one rule for a local path that a request or an admin call names (a checkpoint, a GGUF
    file, a LoRA adapter): resolved (``..`` and links followed), it lies under one of
    ``allowed_roots`` (``--allowed-model-roots``; None: anywhere, for the command line), and, for a
    directory, no link in it leads out of every root, since the build or load opens those files.

    Only names are looked at (nothing is opened), so a refusal tells nothing of a file's content
    or size. Returns the resolved path; ``ConfigError`` naming ``field`` and what to do otherwise
    (``what``: the kind of thing, for the message)."""
    path = Path(given).expanduser().resolve()
    if allowed_roots is None:
        return path
    roots = tuple(root.resolve() for root in allowed_roots)
    listed = ", ".join(str(r) for r in allowed_roots)
    if not _inside_any(path, roots):
        raise ConfigError(
            field,
            f"{given!r} is outside the directories requests may name ({listed}); move the {what} "
            "there or start the server with --allowed-model-roots",
        )
    if path.is_dir():
        escaping = _link_out_of(path, roots)
        if escaping is not None:
            raise ConfigError(field, f"{given!r} holds {escaping} ({listed})")
    return path


def _inside_any(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path.is_relative_to(root) for root in roots)


def _link_out_of(directory: Path, roots: tuple[Path, ...]) -> str | None:
    """Why ``directory`` cannot be read within ``roots``: its first link that resolves outside
    them (or too many entries to check); None when every entry is inside. Links to
    directories are checked, not descended into."""
    seen = 0
    for parent, dirs, files in os.walk(directory, followlinks=False):
        for name in (*dirs, *files):
            seen += 1
            if seen > MAX_CHECKPOINT_ENTRIES:
                return (
                    f"more than {MAX_CHECKPOINT_ENTRIES} files: not a model or adapter directory, and "
                    "too many to check against the directories requests may name"
                )
            entry = Path(parent, name)
            if entry.is_symlink() and not _inside_any(entry.resolve(), roots):
                return (
                    f"{entry.relative_to(directory)}, a link leading outside the directories requests "
                    "may name; replace the link with the file itself"
                )
    return None
