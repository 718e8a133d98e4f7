"""Served names -> built bundles: the model pool's view of the catalog (a ``ModelSource``).

A name resolves, first match wins, through:

1. the names ``serve`` was started with (``--served-model-name`` and the model argument);
2. the alias table operators manage (``PUT /admin/models/{name}``, ``cachesvc models alias``);
3. a bundle id;
4. a checkpoint id or path in the catalog: its most recently used ready bundle;
5. the last component of a local checkpoint's path (``qwen3-tiny`` for ``/data/qwen3-tiny``),
   when exactly one ready checkpoint has it: the name ``/v1/models`` lists for such a model.

``/v1/models`` lists one entry per servable model: the served names and aliases, and for a
ready checkpoint that has neither its hub id or the last component of its path. Bundle ids
and checkpoint paths stay accepted but are never listed (a client's model menu must not show
server paths).

``/v1`` never builds: a name whose bundles are not ready is 404 with a hint to
``POST /admin/builds``; an unknown name is 404 naming up to five close names. While the
catalog cannot be reached, a name that needs it (not an already loaded model) is 503
``catalog_unavailable`` with ``Retry-After``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from cachesvc.cache.manager import BundleLease, CacheManager, CombinedLease
from cachesvc.cache.model_names import is_path, public_name, short_name
from cachesvc.cache.records import AliasInfo, BundleInfo
from cachesvc.errors import CatalogUnavailableError, CorruptBundleError, NotFoundError
from inference.serving.errors import ModelNotFoundError, ServerUnavailableError
from inference.serving.model_pool import ModelRef, not_found

#: Ready bundles /v1/models looks at (most recently used first).
LIST_LIMIT = 500


class CatalogModels:
    """Implements the pool's ``ModelSource`` over a :class:`CacheManager`."""

    def __init__(
        self, manager: CacheManager, *, max_slots: int, startup: Mapping[str, str] | None = None,
        context_bytes: int = 0,
    ) -> None:
        self.manager = manager
        self.max_slots = max_slots
        #: Each loaded model's context-reuse record pool limit (0 without context reuse): part
        #: of its memory estimate.
        self.context_bytes = context_bytes
        #: name -> bundle id of the startup model (set by ``serve`` after it prepared it).
        self.startup: dict[str, str] = dict(startup or {})
        #: LoRA adapter names (``--lora-modules``, in ``startup`` too) -> their base model's name.
        self.parents: dict[str, str] = {}

    # -- resolution ----------------------------------------------------------------------------

    def resolve(self, name: str) -> ModelRef:
        """The bundle ``name`` means (404 ``model_not_found`` when none is ready)."""
        with _catalog_guard():
            return self._resolve(name)

    def _resolve(self, name: str) -> ModelRef:
        bid = self.startup.get(name)
        if bid is not None:
            return self._ready(name, self._bundle(name, bid))
        alias = next((a for a in self.manager.catalog.aliases.all() if a.name == name), None)
        if alias is not None:
            return self._alias(alias)
        try:
            info = self.manager.catalog.bundles.require(name)
        except NotFoundError:
            info = None
        if info is not None:
            return self._ready(name, info)
        for model in _spellings(name):
            ref = self._latest(name, model)
            if ref is not None:
                return ref
        ref = self._by_short_name(name)
        if ref is not None:
            return ref
        raise not_found(name, [r.name for r in self.servable()])

    def _by_short_name(self, name: str) -> ModelRef | None:
        """The checkpoint whose path ends in ``name`` (the name ``/v1/models`` lists for it),
        when exactly one ready checkpoint does."""
        if not name or "/" in name or os.sep in name:
            return None
        models = {b.model for b in self._ready_bundles() if is_path(b.model) and short_name(b.model) == name}
        if len(models) != 1:
            return None
        return self._latest(name, models.pop())

    def _ready_bundles(self) -> Sequence[BundleInfo]:
        return self.manager.queries.list_bundles(  # this node's bundles: their files are on this disk
            state="ready", node=self.manager.node, sort="last_used", order="desc", limit=LIST_LIMIT
        ).items

    def _alias(self, alias: AliasInfo) -> ModelRef:
        if alias.bundle_id is not None:
            return self._ready(alias.name, self._bundle(alias.name, alias.bundle_id))
        assert alias.model is not None
        ref = self._latest(alias.name, alias.model)
        if ref is None:
            raise _unbuilt(alias.name, alias.model)
        return ref

    def _bundle(self, name: str, bid: str) -> BundleInfo:
        try:
            return self.manager.catalog.bundles.require(bid)
        except NotFoundError:
            raise ModelNotFoundError(
                f"the model {name!r} names bundle {bid}, which is no longer in the catalog; "
                "build it again with POST /admin/builds",
                param="model",
            ) from None

    def _latest(self, name: str, model: str) -> ModelRef | None:
        """The most recently used ready bundle of checkpoint ``model``; None when the catalog has
        no bundle of it; 404 with a build hint when it has some but none is ready."""
        page = self.manager.queries.list_bundles(
            model=model, node=self.manager.node, sort="last_used", order="desc", limit=50
        )
        matches = [b for b in page.items if b.model == model]
        if not matches:
            return None
        ready = [b for b in matches if b.state == "ready"]
        if not ready:
            raise _unbuilt(name, model)
        return self._ref(name, ready[0])

    def _ready(self, name: str, info: BundleInfo) -> ModelRef:
        if info.state != "ready":
            raise ModelNotFoundError(
                f"the model {name!r} (bundle {info.id}) is {info.state}, not built and ready"
                f"{': ' + info.error if info.error else ''}; build it with POST /admin/builds",
                param="model",
            )
        return self._ref(name, info)

    def _ref(self, name: str, info: BundleInfo) -> ModelRef:
        bundle_dir = self.manager.queries.bundle_dir(info)
        from inference.runtime.registry import is_embedding, memory_estimate, read_meta

        context = self.context_bytes
        images = False
        try:
            memory = memory_estimate(bundle_dir, max_slots=self.max_slots)
            meta = read_meta(bundle_dir)
            if is_embedding(meta):
                context = 0  # no KV cache: nothing to reuse, no record pool
            images = isinstance(meta.get("vision"), dict)
        except Exception:  # an unreadable engine.json fails at load with the real reason
            memory = int(info.size_bytes)
        profile = info.profile
        draft = self.manager.queries.draft_bundle(info)
        return ModelRef(
            name=name,
            bundle_id=info.id,
            bundle_dir=bundle_dir,
            backend=info.backend,
            precision=str(profile.get("precision", "")),
            max_model_len=int(profile.get("max_kv_cache_capacity", 0) or 0),
            memory_bytes=memory + context,
            context_bytes=context,
            draft_bundle_dir=self.manager.queries.bundle_dir(draft) if draft is not None else None,
            parent=self.parents.get(name),
            images=images,
        )

    # -- listing -------------------------------------------------------------------------------

    def servable(self) -> list[ModelRef]:
        """One entry per servable model: the startup names and aliases, then each ready
        checkpoint no such name covers (by its hub id or the last component of its path).
        Checkpoint paths and bundle ids resolve but are not listed."""
        with _catalog_guard():
            return self._servable()

    def _servable(self) -> list[ModelRef]:
        ready = self._ready_bundles()
        by_id = {b.id: b for b in ready}
        refs: list[ModelRef] = []
        seen: set[str] = set()
        covered: set[str] = set()  # checkpoints that have an entry already

        def add(name: str, info: BundleInfo | None) -> None:
            if info is not None and name not in seen:
                seen.add(name)
                covered.add(info.model)
                refs.append(self._ref(name, info))

        for name, bid in self.startup.items():
            if not is_path(name):  # the model argument given as a directory
                add(name, by_id.get(bid))
        for alias in self.manager.catalog.aliases.all():
            if alias.bundle_id is not None:
                add(alias.name, by_id.get(alias.bundle_id))
            else:
                add(alias.name, next((b for b in ready if b.model == alias.model), None))
        shorts: dict[str, set[str]] = {}
        for b in ready:
            if is_path(b.model):
                shorts.setdefault(short_name(b.model), set()).add(b.model)
        for b in ready:  # most recently used first: a checkpoint names its latest bundle
            if b.model in covered:
                continue
            if not is_path(b.model):
                add(b.model, b)
            elif len(shorts[short_name(b.model)]) == 1:  # else only its path (or an alias) names it
                add(short_name(b.model), b)
        return refs

    def public_name(self, name: str) -> str:
        """A checkpoint path by its last component (as ``/v1/models`` lists it), any other name
        as it is: what ``/health`` shows, with no key asked."""
        return public_name(name)

    # -- leases and events ---------------------------------------------------------------------

    def lease(self, bundle_id: str) -> BundleLease:
        """The bundle's shared lease (blocks eviction until the engine unloads), with its draft
        bundle's when it speculates with one."""
        with _catalog_guard():
            return self._lease(bundle_id)

    def _lease(self, bundle_id: str) -> BundleLease:
        lease = self.manager.lease(bundle_id)
        try:
            draft = self.manager.queries.draft_bundle(lease.bundle)
            return lease if draft is None else CombinedLease(lease, self.manager.lease(draft.id))
        except BaseException:
            lease.release()
            raise

    def record(self, kind: str, bundle_id: str, detail: Mapping[str, Any]) -> None:
        """Append a load/unload event to the catalog's audit log (skipped while the catalog is
        down: the outage is logged once by its health tracker, serving goes on)."""
        with suppress(CatalogUnavailableError):
            self.manager.record_event(
                kind,
                bundle_id=bundle_id,
                model=detail.get("model"),
                reason=detail.get("reason"),
                seconds=detail.get("seconds"),
                nbytes=detail.get("memory_bytes"),
            )


@contextmanager
def _catalog_guard() -> Iterator[None]:
    """The pool speaks ``/v1`` errors: a catalog outage is its 503 with ``Retry-After``, a bundle
    the load check refuses a 503 naming it (the inference side never sees the cache's
    exception tree)."""
    try:
        yield
    except CatalogUnavailableError as exc:
        raise ServerUnavailableError(
            str(exc), code="catalog_unavailable", headers={"Retry-After": str(exc.retry_after)}
        ) from None
    except CorruptBundleError as exc:
        # The load check refused the bundle (marked corrupt; the next prepare rebuilds it).
        raise ServerUnavailableError(str(exc), code="bundle_corrupt") from None


def _spellings(name: str) -> list[str]:
    """``name`` as given, and as an absolute path when it is one on this machine."""
    out = [name]
    try:
        path = Path(name).expanduser()
        if path.exists():
            out.append(str(path.resolve()))
    except (OSError, ValueError, RuntimeError):  # RuntimeError: "~user" with no such home
        pass
    return list(dict.fromkeys(out))


def _unbuilt(name: str, model: str) -> ModelNotFoundError:
    # A local checkpoint's path stays out of a /v1 body: the operator knows where it is.
    shown = "its checkpoint" if is_path(model) else model
    return ModelNotFoundError(
        f"the model {name!r} ({shown}) has no ready bundle: /v1 never builds; build it with "
        f'POST /admin/builds {{"model": ...}} (or cachesvc prepare)',
        param="model",
    )


__all__ = ["CatalogModels"]
