"""Eviction: LRU plans computed from catalog sizes, executed under each bundle's exclusive lock.

A plan changes nothing: it takes ``stale`` bundles first (built for another GPU or TensorRT
version, they cannot run here; reason ``stale``), then reads the least recently used rows a
keyset page at a time until the cache would fit the cap, skipping pinned bundles and (checked
only for the ones that would go, so planning reads few locks) bundles whose lock another
process holds. Executing re-checks
both for every bundle at delete time, under the exclusive lock taken non-blocking: a bundle
pinned or leased since the plan was made is skipped, never deleted. Every eviction is an event.

Converted LoRA adapters (``adapters/<digest16>/``, :mod:`cachesvc.cache.adapters`) count in the total
and take their place in the same LRU order by ``last_used_at`` (plan items with ``kind``
``adapter``), under the same rules: pinned ones stay, leased ones (their ``adapter-<id>`` lock
held) stay, each eviction is an ``adapter_rm`` event with the plan's reason.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterator
from datetime import datetime
from itertools import chain
from pathlib import Path

from cachesvc.cache.catalog import Catalog
from cachesvc.cache.checkpoints import owned_checkpoint_path, remove_checkpoint_files
from cachesvc.cache.records import (
    BundleInfo,
    CheckpointInfo,
    CheckpointRemoval,
    EvictionPlan,
    EvictionResult,
    LeaseHolder,
    PlannedEviction,
    SkippedBundle,
)
from cachesvc.cache.store import BundleStore, adapter_lock_key, remove_tree
from cachesvc.errors import CacheError, ConfigError, ConflictError, LeasedError, PinnedError

log = logging.getLogger("cachesvc.eviction")

#: (id, size, last_used_at, pinned, path) of an eviction candidate.
_Row = tuple[str, int, datetime | None, bool, str]
#: A candidate, whether it is stale, and its kind (``bundle`` or ``adapter``).
_Candidate = tuple[_Row, bool, str]

#: Rows read per batch while planning an eviction (planning stops once under the cap).
PLAN_BATCH = 512


class Evictor:
    """Plans and carries out evictions over one catalog and one store."""

    def __init__(
        self,
        catalog: Catalog,
        store: BundleStore,
        *,
        max_size_bytes: int,
        holders: Callable[[str], list[LeaseHolder]],
    ) -> None:
        self.catalog = catalog
        self.store = store
        self.max_size_bytes = max_size_bytes
        self._holders = holders

    def remove(self, bid: str) -> int:
        """Evict one bundle now (reason ``manual``); returns bytes freed."""
        info = self.catalog.bundles.require(bid)
        if info.pinned:
            raise PinnedError(f"bundle {bid} is pinned; unpin it first (`cachesvc bundles unpin {bid}`)")
        with self.store.locks.try_exclusive(bid) as got:
            if not got:
                raise self._busy(f"bundle {bid}", [info], "stop that server first")
            context = self.store.layout.context_bytes(bid)
            self.store.remove(info.path)
            self.store.layout.remove_context(bid)  # its context records go with it
            self.catalog.bundles.delete(bid, reason="manual", nbytes=info.size_bytes)
        return info.size_bytes + context

    def _busy(self, subject: str, bundles: list[BundleInfo], then: str) -> ConflictError:
        """Why ``bundles`` (of ``subject``: ``bundle <id>`` or ``checkpoint <digest>``), whose locks
        are held, cannot be removed now. A bundle being built is said to be, by this process
        (this server's own build) or by another: nobody leases one, its lock is the build's. A
        leased bundle names its holders (``LeasedError``), then ``then``."""
        one = subject.startswith("bundle ")

        def state(what: str, ids: list[str]) -> str:
            return f"is {what}" if one else f"has bundle(s) {what} ({', '.join(ids)})"

        leased = [b.id for b in bundles if b.state != "building"]
        holders = [h for bid in leased for h in self._holders(bid)]
        in_use = LeasedError.held_by(f"{subject} {state('in use', leased)}", holders, then)
        building = [b.id for b in bundles if b.state == "building"]
        if not building:
            return in_use
        here = [bid for bid in building if self.store.locks.held_exclusive_here(bid)]
        there = [bid for bid in building if bid not in here]
        said = [
            f"{subject} {state(f'being built by {who}', ids)}"
            for who, ids in (("this process", here), ("another process", there)) if ids
        ]
        hint = " (GET /admin/builds)" if here else ""
        said.append(f"wait for the build to finish{hint}, then retry")
        if leased:
            said.append(str(in_use))
        return ConflictError("; ".join(said), reason="building", holders=in_use.holders)

    def plan(
        self, max_bytes: int | None = None, *, exclude: frozenset[str] = frozenset(), reason: str = "lru"
    ) -> EvictionPlan:
        """Plan an eviction down to ``max_bytes`` (default: the cache cap): stale bundles first,
        then least recently used. Changes nothing."""
        cap = self.max_size_bytes if max_bytes is None else max_bytes
        if cap < 0:
            raise ConfigError("max_size_bytes", f"must not be negative, got {cap}")
        total = self.total_size()
        remaining = total
        evict: list[PlannedEviction] = []
        skipped: list[SkippedBundle] = []
        for (bid, size, last_used, pinned, path), stale, kind in chain(self._stale_rows(), self._lru_rows()):
            if remaining <= cap:
                break
            if bid in exclude:
                continue
            lock = adapter_lock_key(bid) if kind == "adapter" else bid
            if pinned:
                skipped.append(SkippedBundle(bid, size, "pinned", stale=stale, kind=kind))
            elif self.store.locks.is_locked(lock):
                # Checked only for bundles that would go, so planning reads few locks.
                skipped.append(SkippedBundle(bid, size, "leased", stale=stale, kind=kind))
            else:
                if kind == "bundle":
                    size += self.store.layout.context_bytes(bid)
                why = "stale" if stale else reason
                evict.append(PlannedEviction(bid, size, last_used, Path(path), reason=why, kind=kind))
                remaining -= size
        return EvictionPlan(
            max_bytes=cap,
            total_before=total,
            evict=tuple(evict),
            skipped=tuple(skipped),
            freed_bytes=total - remaining,
            total_after=remaining,
            reason=reason,
        )

    def total_size(self) -> int:
        """The cache's size as eviction counts it: bundles (catalog sizes), their context records
        (``context/<bundle_id>/``, which go with their bundle) and converted LoRA adapters."""
        return (self.catalog.bundles.total_size() + self.store.layout.context_bytes()
                + self.catalog.adapters.total_size())

    def _stale_rows(self) -> Iterator[_Candidate]:
        """Stale rows (few: one node's bundles for another GPU), least recently used first."""
        for b in self.catalog.bundles.all(states=("stale",)):
            yield (b.id, b.size_bytes, b.last_used_at, b.pinned, str(b.path)), True, "bundle"

    def _lru_rows(self) -> Iterator[_Candidate]:
        """Other evictable bundles and the converted LoRA adapters, together least recently used
        first (adapters are few and read at once; bundles in keyset pages)."""
        adapters = ((row, False, "adapter") for row in self.catalog.adapters.eviction_candidates())
        yield from heapq.merge(self._lru_bundle_rows(), adapters, key=lambda c: (c[0][2], c[0][0]))

    def _lru_bundle_rows(self) -> Iterator[_Candidate]:
        """Other evictable bundle rows, least recently used first, read in keyset pages (stops
        when not needed)."""
        after: tuple[datetime, str] | None = None
        while True:
            rows = self.catalog.bundles.eviction_candidates(limit=PLAN_BATCH, after=after)
            for row in rows:
                yield row, False, "bundle"
            if len(rows) < PLAN_BATCH:
                return
            after = (rows[-1][2], rows[-1][0])

    def execute(self, plan: EvictionPlan) -> EvictionResult:
        """Carry out a plan; a bundle leased or pinned since planning is skipped, not deleted."""
        evicted: list[str] = []
        skipped = list(plan.skipped)
        freed = 0
        for item in plan.evict:
            if item.kind == "adapter":
                adapter_freed = self._evict_adapter(item, skipped)
                if adapter_freed is not None:
                    evicted.append(item.bundle_id)
                    freed += adapter_freed
                continue
            info = self.catalog.bundles.get(item.bundle_id)
            if info is None:
                continue
            if info.pinned:
                skipped.append(SkippedBundle(item.bundle_id, item.size_bytes, "pinned"))
                continue
            with self.store.locks.try_exclusive(item.bundle_id) as got:
                if not got:
                    skipped.append(SkippedBundle(item.bundle_id, item.size_bytes, "leased"))
                    continue
                context = self.store.layout.context_bytes(item.bundle_id)
                self.store.remove(info.path)
                self.store.layout.remove_context(item.bundle_id)
                self.catalog.bundles.delete(
                    item.bundle_id,
                    reason=item.reason,
                    nbytes=info.size_bytes,
                    detail=info.error if item.reason == "stale" else None,
                )
            evicted.append(item.bundle_id)
            freed += info.size_bytes + context
        return EvictionResult(
            plan=plan,
            evicted=tuple(evicted),
            skipped=tuple(skipped),
            freed_bytes=freed,
            total_after=self.total_size(),
            dry_run=False,
        )

    def _evict_adapter(self, item: PlannedEviction, skipped: list[SkippedBundle]) -> int | None:
        """Evict one planned adapter under its exclusive lock (taken non-blocking; pin re-read);
        the bytes freed, or None when it was skipped or is gone."""
        info = self.catalog.adapters.get(item.bundle_id)
        if info is None:
            return None
        if info.pinned:
            skipped.append(SkippedBundle(item.bundle_id, item.size_bytes, "pinned", kind="adapter"))
            return None
        with self.store.locks.try_exclusive(adapter_lock_key(item.bundle_id)) as got:
            if not got:
                skipped.append(SkippedBundle(item.bundle_id, item.size_bytes, "leased", kind="adapter"))
                return None
            layout = self.store.layout
            remove_tree(layout, layout.root / info.path.parent, f"adapter-{info.id}")
            self.catalog.adapters.delete(info.id, reason=item.reason, nbytes=info.size_bytes)
        return info.size_bytes

    def prune(
        self, max_bytes: int | None = None, *, dry_run: bool = False, exclude: frozenset[str] = frozenset()
    ) -> EvictionResult:
        """Evict idle bundles, stale ones first, then least recently used, until the cache fits
        ``max_bytes``."""
        plan = self.plan(max_bytes, exclude=exclude)
        return dry_result(plan) if dry_run else self.execute(plan)

    def clear(self, *, dry_run: bool = False) -> EvictionResult:
        """Remove every idle bundle (pinned and leased ones stay). Checkpoints are never touched."""
        plan = self.plan(0, reason="clear")
        return dry_result(plan) if dry_run else self.execute(plan)

    def remove_checkpoint(self, ckpt: CheckpointInfo, *, with_bundles: bool = False) -> CheckpointRemoval:
        """Remove a checkpoint from the cache: its catalog row, its files when they are the
        cache's own (a hub download or converted GGUF under ``checkpoints/``; a user's directory
        is only forgotten) and, with ``with_bundles``, this node's bundles of it (those built
        from it and those that use it as their speculative draft).

        Refused (ConflictError, nothing changed) while a bundle of it is pinned or leased, when
        it has bundles and ``with_bundles`` is false, or when other nodes hold bundles of it
        (their files are on their disks: remove those there first). Events: ``evict`` (reason
        ``manual``) per bundle, then ``checkpoint_rm`` with the bytes deleted.
        """
        digest, short, layout = ckpt.digest, ckpt.digest[:16], self.store.layout
        bundles = self.catalog.checkpoints.bundles_of(digest)
        mine = [b for b in bundles if b.node == self.catalog.node]
        others = sorted({b.node for b in bundles if b.node != self.catalog.node})
        pinned = [b.id for b in mine if b.pinned]
        if pinned:
            raise PinnedError(
                f"checkpoint {short} has {len(pinned)} pinned bundle(s) ({', '.join(pinned)}); "
                "unpin them first (`cachesvc bundles unpin ID`)"
            )
        busy = [b for b in mine if self.store.locks.is_locked(b.id)]
        if busy:
            raise self._busy(f"checkpoint {short}", busy, "stop serving them first")
        if others:
            raise ConflictError(
                f"checkpoint {short} has bundles on other nodes ({', '.join(others)}); remove them "
                "there first (a node only deletes files on its own disk)",
                reason="other_nodes",
            )
        if mine and not with_bundles:
            raise ConflictError(
                f"checkpoint {short} has {len(mine)} bundle(s) ({', '.join(b.id for b in mine)}); "
                "remove them with it: --with-bundles (CLI) or ?with_bundles=true (HTTP)",
                reason="has_bundles",
            )
        removed: list[str] = []
        bundle_bytes = 0
        for b in mine:
            # Re-checks pin and lease under the bundle's exclusive lock (a lease may have
            # started since): a conflict stops here with the checkpoint row still in place.
            bundle_bytes += self.remove(b.id)
            removed.append(b.id)
        row = self.catalog.checkpoints.get_with_node(digest)
        owned = (
            row is not None
            and row[1] == self.catalog.node
            and owned_checkpoint_path(layout.checkpoints, ckpt.path)
        )
        file_bytes = 0
        if owned:
            try:
                file_bytes = remove_checkpoint_files(layout.checkpoints, layout.trash, ckpt.path)
            except OSError as exc:
                raise CacheError(f"could not delete checkpoint {short} at {ckpt.path}: {exc}") from exc
            detail = f"deleted {ckpt.path}"
        else:
            detail = f"forgotten; files at {ckpt.path} left in place (not the cache's own)"
        self.catalog.checkpoints.delete(digest, nbytes=file_bytes, detail=detail)
        layout.remove_gate_reference(digest)
        log.info("checkpoint %s removed (%s; %d bundle(s))", short, detail, len(removed))
        return CheckpointRemoval(
            digest=digest,
            source=ckpt.source,
            path=ckpt.path,
            bundles_removed=tuple(removed),
            bundle_bytes=bundle_bytes,
            files_deleted=owned,
            file_bytes=file_bytes,
        )


def dry_result(plan: EvictionPlan) -> EvictionResult:
    """What executing ``plan`` would report, without doing it."""
    return EvictionResult(
        plan=plan,
        evicted=tuple(e.bundle_id for e in plan.evict),
        skipped=plan.skipped,
        freed_bytes=plan.freed_bytes,
        total_after=plan.total_after,
        dry_run=True,
    )
