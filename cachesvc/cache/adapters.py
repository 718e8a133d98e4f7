"""LoRA adapters in the cache: resolve and digest a PEFT adapter, convert it once, keep its row.

A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) or a Hugging
Face hub id is resolved like a checkpoint (hub ids are downloaded into the cache's
``checkpoints/`` with the same helper) and digested with the one checkpoint digest rule
(:func:`cachesvc.cache.checkpoints.checkpoint_digest`). It is converted once per digest into
``adapters/<digest16>/adapter.onnx_adapter`` (onnxruntime's adapter format, what
``GqaEngine.load_adapter`` reads): under the adapter's exclusive lock, into a temp name, fsynced,
then renamed into place, so a crash leaves nothing half written. Every prepare checks the adapter
against the base model's shapes (:func:`inference.builder.lora.adapter_arrays`); a mismatch is
refused with one line.

The ``adapters`` catalog table holds one row per adapter and node (size, last use, pin). The
converted files count in the cache's size and are evicted LRU together with bundles
(:mod:`cachesvc.cache.eviction`), never while pinned or while a serving process holds the adapter's
shared lock (:meth:`AdapterStore.lease`, the same file lock bundles use, named
``adapter-<id>``). Reconcile forgets rows whose file vanished and removes folders a conversion
left without a file; a converted file without a row is kept (preparing the adapter adopts it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from cachesvc.cache.catalog import Catalog
from cachesvc.cache.checkpoints import (
    _download,
    check_local_path,
    checkpoint_digest,
    is_hub_id,
    looks_like_path,
)
from cachesvc.cache.records import AdapterInfo, LeaseHolder
from cachesvc.cache.store import (
    ADAPTER_FILE_NAME,
    BundleStore,
    CacheLayout,
    Lease,
    adapter_lock_key,
    remove_tree,
)
from cachesvc.cache.store.layout import fsync_dir, fsync_file, make_dir
from cachesvc.errors import CheckpointError, ConfigError, LeasedError, NotFoundError, PinnedError

if TYPE_CHECKING:
    from inference.builder.lora import LoraInfo

#: PEFT's weights file (inference.builder.lora.ADAPTER_WEIGHTS; asserted equal in the tests).
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def _builder() -> Any:
    """inference.builder's lora, errors and model_config, imported on use: importing the
    package loads onnxruntime, which importing the service must not (tests/serving/test_pool_seams)."""
    from inference.builder import errors, lora, model_config

    return SimpleNamespace(BuildInputError=errors.BuildInputError, lora=lora,
                           load_model_config=model_config.load_model_config)

__all__ = [
    "ADAPTER_FILE_NAME",
    "AdapterStore",
    "ResolvedAdapter",
    "check_adapter_source",
    "check_against_base",
    "resolve_adapter",
]

log = logging.getLogger("cachesvc.adapters")

#: Hex digits of the digest that name an adapter (its id and its folder under ``adapters/``).
ADAPTER_ID_LEN = 16


@dataclass(frozen=True)
class ResolvedAdapter:
    """A PEFT adapter directory on local disk with its identity (``source``: what was given)."""

    digest: str
    source: str
    path: Path

    @property
    def id(self) -> str:
        """The adapter's id: the first 16 hex digits of its digest."""
        return self.digest[:ADAPTER_ID_LEN]


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def resolve_adapter(source: str, layout: CacheLayout, *, offline: bool | None = None) -> ResolvedAdapter:
    """Resolve ``source`` (a local PEFT adapter directory or a Hugging Face hub id) and digest it.

    Hub ids are downloaded into the cache's ``checkpoints/`` as model ids are. Anything that is
    not a PEFT LoRA adapter directory is refused (``CheckpointError``, one line)."""
    if not isinstance(source, str) or not source.strip():
        raise CheckpointError("adapter source is empty; pass a PEFT adapter directory or a hub id (org/name)")
    if looks_like_path(source):
        directory = Path(source).expanduser()
        if not directory.is_dir():
            raise CheckpointError(f"no such adapter directory: {source}")
        directory = directory.resolve()
    elif is_hub_id(source):
        directory, _revision = _download(source, layout.checkpoints, offline=offline, revision=None)
    else:
        raise CheckpointError(
            f"{source!r} is neither an existing directory nor a valid Hugging Face id; pass a PEFT adapter "
            "directory (adapter_config.json + adapter_model.safetensors) or an id like 'org/name'"
        )
    b = _builder()
    try:
        b.lora.read_adapter_config(directory)
    except b.BuildInputError as exc:
        raise CheckpointError(_one_line(exc)) from None
    if not (directory / ADAPTER_WEIGHTS).is_file():
        raise CheckpointError(
            f"{directory} has no {ADAPTER_WEIGHTS} (PEFT's safetensors weights); save the adapter with "
            "safe_serialization (the default of save_pretrained)"
        )
    return ResolvedAdapter(digest=checkpoint_digest(directory), source=source, path=directory)


def check_adapter_source(field: str, source: str, allowed_roots: tuple[Path, ...] | None) -> None:
    """For a request over HTTP (``POST /admin/lora-adapters``, ``POST /v1/load_lora_adapter``): a
    hub id, or a local directory that passes the one rule for request-named paths
    (:func:`cachesvc.cache.checkpoints.check_local_path`: under ``allowed_roots``, no link out of
    them). ConfigError naming ``field`` otherwise."""
    if not looks_like_path(source):
        if not is_hub_id(source):
            raise ConfigError(
                field, f"{source!r} is not a Hugging Face id ('org/name') nor an existing directory"
            )
        return
    check_local_path(field, source, allowed_roots, what="adapter")


def check_against_base(adapter_dir: Path, base_checkpoint_dir: Path) -> LoraInfo:
    """What the adapter holds, checked against the base model's shapes (``CheckpointError``,
    one line, for an adapter of another model or one the graph cannot run)."""
    b = _builder()
    try:
        cfg = b.load_model_config(Path(base_checkpoint_dir))
        info: LoraInfo = b.lora.adapter_arrays(adapter_dir, cfg)[1]
        return info
    except b.BuildInputError as exc:
        raise CheckpointError(_one_line(exc)) from None


class AdapterStore:
    """The manager's ``adapters`` section: prepare (convert once), list, touch, pin (``set_pinned``),
    lease, remove.

    ``after_add`` runs after a new adapter was converted (the manager prunes the cache back
    under its cap, keeping the new adapter)."""

    def __init__(
        self,
        catalog: Catalog,
        store: BundleStore,
        *,
        holders: Callable[[str], list[LeaseHolder]],
        offline: bool | None = None,
        lock_timeout: float | None = None,
        after_add: Callable[[str], None] | None = None,
    ) -> None:
        self.catalog = catalog
        self.store = store
        self.layout = store.layout
        self._holders = holders
        self.offline = offline
        self.lock_timeout = lock_timeout
        self._after_add = after_add

    # -- prepare ---------------------------------------------------------------------------

    def prepare(self, source: str, base_checkpoint_dir: Path) -> AdapterInfo:
        """The converted adapter of ``source`` for the base model in ``base_checkpoint_dir``: a
        hit (its row, with the file there), or a conversion on miss. Checked against the base
        model every time (a hit for one base model may not fit another)."""
        resolved = resolve_adapter(source, self.layout, offline=self.offline)
        info = check_against_base(resolved.path, base_checkpoint_dir)
        aid = resolved.id
        final = self.layout.adapter_file(aid)
        hit = self._hit(aid, final)
        if hit is not None:
            return hit
        with self.store.locks.exclusive(adapter_lock_key(aid), timeout=self.lock_timeout):
            hit = self._hit(aid, final)  # converted by another process while we waited
            if hit is not None:
                return hit
            if not final.is_file():
                self._convert(resolved, base_checkpoint_dir, final)
            row, added = self.catalog.adapters.add(
                adapter_id=aid, digest=resolved.digest, source=source,
                path=final.relative_to(self.layout.root), rank=info.rank, targets=info.targets,
                size_bytes=final.stat().st_size,
            )
        if added:
            log.info("LoRA adapter %s from %s converted (%d bytes)", aid, source, row.size_bytes)
            if self._after_add is not None:
                self._after_add(aid)
        return self._absolute(row)

    def _hit(self, aid: str, final: Path) -> AdapterInfo | None:
        row = self.catalog.adapters.get(aid)
        if row is None:
            return None
        if not final.is_file():
            # The file vanished under its row: forget the row, convert again.
            self.catalog.adapters.delete(aid, reason="stale", nbytes=row.size_bytes, detail="file vanished")
            return None
        self.catalog.adapters.touch(aid)
        return self._absolute(self.catalog.adapters.require(aid))

    def _convert(self, resolved: ResolvedAdapter, base_checkpoint_dir: Path, final: Path) -> None:
        """Write the converted file: temp name, fsync, rename (the caller holds the lock)."""
        make_dir(self.layout.check_subfolder(self.layout.adapters), self.layout.dir_mode())
        make_dir(final.parent, self.layout.dir_mode())
        tmp = final.with_name(f".{final.name}.{secrets.token_hex(6)}.tmp")
        try:
            b = _builder()
            try:
                cfg = b.load_model_config(Path(base_checkpoint_dir))
                b.lora.convert_peft_adapter(resolved.path, cfg, tmp)
            except b.BuildInputError as exc:
                raise CheckpointError(_one_line(exc)) from None
            os.chmod(tmp, self.layout.file_mode())
            fsync_file(tmp)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        fsync_dir(final.parent)

    # -- rows ------------------------------------------------------------------------------

    def _absolute(self, info: AdapterInfo) -> AdapterInfo:
        return replace(info, path=self.layout.root / info.path)

    def list(self) -> list[AdapterInfo]:
        """This node's adapters, most recently used first (absolute paths)."""
        return [self._absolute(a) for a in self.catalog.adapters.all()]

    def get(self, ref: str) -> AdapterInfo:
        """The adapter ``ref`` names: its id, its digest (or its first 8+ digits), or the source
        it was prepared from. NotFoundError otherwise."""
        exact = self.catalog.adapters.get(ref)
        if exact is not None:
            return self._absolute(exact)
        wanted = ref.rstrip("/")
        every = self.catalog.adapters.all()
        by_digest = [a for a in every if len(ref) >= 8 and a.digest.startswith(ref.lower())]
        by_source = [a for a in every if a.source.rstrip("/") == wanted]
        found = by_digest or by_source
        if len(found) == 1:
            return self._absolute(found[0])
        if len(found) > 1:
            raise NotFoundError(f"{ref!r} names {len(found)} adapters; give more digits of the id")
        raise NotFoundError(f"no LoRA adapter {ref!r} in the cache (list them with `cachesvc adapters ls`)")

    def touch(self, adapter_id: str) -> None:
        """Record a use of the adapter (its ``last_used_at``: eviction is LRU)."""
        self.catalog.adapters.touch(adapter_id)

    def set_pinned(self, ref: str, pinned: bool) -> AdapterInfo:
        """Protect the adapter ``ref`` names (see ``get``) from eviction, or let it be evicted
        again; an ``adapter_pin``/``adapter_unpin`` event when it changes."""
        return self._absolute(self.catalog.adapters.set_pinned(self.get(ref).id, pinned))

    def lease(self, adapter_id: str, *, timeout: float | None = None) -> Lease:
        """A shared lock on the adapter's file for as long as an engine has it loaded: no
        process evicts or removes it meanwhile. Release it when the engine drops the adapter."""
        info = self.catalog.adapters.require(adapter_id)
        lease = self.store.locks.lease(
            adapter_lock_key(adapter_id), timeout=timeout if timeout is not None else self.lock_timeout
        )
        if not (self.layout.root / info.path).is_file():
            lease.release()
            raise NotFoundError(
                f"LoRA adapter {adapter_id} was evicted before it could be leased; prepare it again"
            )
        return lease

    def remove(self, ref: str) -> int:
        """Remove an adapter now (row and file; ``adapter_rm`` event, reason ``manual``); the
        bytes freed. Refused (409) while it is pinned or a serving process holds its lease."""
        info = self.get(ref)
        if info.pinned:
            raise PinnedError(
                f"LoRA adapter {info.id} is pinned; unpin it first (`cachesvc adapters unpin {info.id}`)"
            )
        key = adapter_lock_key(info.id)
        with self.store.locks.try_exclusive(key) as got:
            if not got:
                raise LeasedError.held_by(f"LoRA adapter {info.id} is in use", self._holders(key),
                                          "stop serving it first")
            remove_tree(self.layout, info.path.parent, f"adapter-{info.id}")
            self.catalog.adapters.delete(info.id, reason="manual", nbytes=info.size_bytes)
        return info.size_bytes

