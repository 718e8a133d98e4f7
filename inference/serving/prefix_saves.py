"""The scheduler's prefix records: what a finished request's slot holds is saved as context-cache
records once the scheduler is idle (or the slot is about to change), and the sibling choices of one
prompt share its prefill (:class:`inference.serving.scheduler.Scheduler` mixes this in)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from inference.runtime.protocol import KVEngine
from inference.serving.context_cache import PrefixStore

if TYPE_CHECKING:
    from inference.serving.scheduler import SchedulerObserver, _Running

log = logging.getLogger("inference.scheduler")


class PrefixSaves:
    """The pending saves of :class:`~inference.serving.scheduler.Scheduler` (its attributes, set there)."""

    _kv: KVEngine | None
    _fork_kv: KVEngine | None
    _store: PrefixStore | None
    _observer: SchedulerObserver | None
    _running: list[_Running]
    _slot_tokens: list[list[int]]
    _slot_owner: list[tuple[str | None, str | None]]
    _pending_saves: dict[int, tuple[_Running, list[int]]]

    @property
    def pending_record_saves(self) -> int:
        """Slots whose blocks are still to be saved as records (they are, once idle for
        ``save_delay``); for tests and diagnostics."""
        return len(self._pending_saves)

    def _defer_save(self, run: _Running) -> None:
        """Save ``run``'s blocks later (:attr:`_pending_saves`); an earlier pending save of its
        slot is absorbed (:meth:`_absorb_pending`)."""
        kv = self._kv
        if kv is None or self._store is None or not run.req.cache_prompt:
            return
        tokens = list(self._slot_tokens[run.slot][: kv.slot_length(run.slot)])
        self._absorb_pending(run.slot, replace_with=(run, tokens))

    def _flush_saves(self, slots: Sequence[int] | None = None) -> None:
        """Make the pending saves of ``slots`` (all when None)."""
        for slot in list(self._pending_saves) if slots is None else slots:
            pending = self._pending_saves.get(slot)
            if pending is not None:
                self._save_blocks(*pending)
                del self._pending_saves[slot]  # after the save: pending_record_saves never reads 0 early

    def _save_from(self, slot: int, position: int) -> None:
        """The slot's positions from ``position`` on are about to change: the pending save's
        records there (the block holding ``position`` on, and the tail) are made now; its
        complete blocks below stay pending."""
        pending = self._pending_saves.get(slot)
        if pending is None or self._store is None:
            return
        run, tokens = pending
        if position >= len(tokens):
            return
        keep = position // self._store.block_tokens
        self._save_blocks(run, tokens, from_block=keep)
        if keep:
            self._pending_saves[slot] = (run, tokens[: keep * self._store.block_tokens])
        else:
            del self._pending_saves[slot]

    def _absorb_pending(self, slot: int, replace_with: tuple[_Running, list[int]]) -> None:
        """``replace_with`` becomes the slot's pending save. Its run extends what an earlier
        pending save of the slot holds (one survives a new run only when that run reused all of
        it, :meth:`_prepare`), so the new save covers the same blocks: only the earlier tail (a
        partial block, with its prompt's logits) is made now. One assignment: the count never
        reads 0 in between."""
        pending = self._pending_saves.get(slot)
        if pending is not None and self._store is not None:
            run, tokens = pending
            self._save_blocks(run, tokens, from_block=len(tokens) // self._store.block_tokens)
        self._pending_saves[slot] = replace_with

    def _save_blocks(self, run: _Running, tokens: list[int], from_block: int = 0) -> None:
        """Keep the complete blocks of ``tokens`` (the first positions ``run``'s slot still holds)
        as records (new ones copied), from block ``from_block`` on, and the partial last block."""
        kv, store = self._kv, self._store
        if kv is None or store is None or not run.req.cache_prompt:
            return
        slot, salt, adapter = run.slot, run.req.cache_salt, run.req.adapter
        block = store.block_tokens
        try:
            keys = store.block_keys(tokens, salt, adapter)
            for i, key in enumerate(keys):
                if i >= from_block and not store.touch(key):
                    records = kv.export_kv(slot, i * block, block)
                    store.insert(key, tokens[i * block:(i + 1) * block], records)
            first = len(keys) * block
            if first < len(tokens):  # the partial last block: the prompt's (or turn's) tail
                # Right after the prompt (the slot holds it, nothing more): with its logits.
                at_end = len(tokens) == len(run.req.prompt_ids)
                store.save_tail(store.tail_key(keys, salt, adapter), tokens[first:],
                                lambda: kv.export_kv(slot, first, len(tokens) - first),
                                logits=run.prompt_logits if at_end else None)
        except Exception:  # the cache is an optimisation: never fail a request for it
            log.exception("saving context records failed")
        self._notify_cache()

    def _notify_cache(self) -> None:
        hook = getattr(self._observer, "context_cache_changed", None)
        if hook is not None and self._store is not None:
            hook(self._store.stats())

    def _share_prefix(self, leader: _Running) -> None:
        """Give the prompt's KV to the sibling choices that wait in slots (``prefix_from``).

        Runs right after the leader's last prefill chunk, before its first token can finish it
        and free its slot. A sibling then prefills only the last prompt token (its own logits,
        its own first sample); one without a slot yet, or on an engine without KV operations,
        prefills the whole prompt itself.
        """
        kv = self._fork_kv
        prompt = leader.req.cache_ids
        n = len(prompt) - 1
        if kv is None or n < 1:
            return
        for run in self._running:
            if run.req.prefix_from is not leader.req or run.prepared or run.req.cancelled:
                continue
            try:
                self._flush_saves([run.slot])
                kv.copy_prefix(leader.slot, run.slot, n)
            except Exception:  # an optimisation: the sibling prefills on its own instead
                log.exception("copy_prefix(%d -> %d) failed", leader.slot, run.slot)
                self._slot_tokens[run.slot] = []  # its content is unknown now: nothing to reuse
                continue
            run.prepared = True
            run.prefilled = n
            if self._store is not None:
                self._slot_tokens[run.slot] = list(prompt[:n])
                self._slot_owner[run.slot] = run.req.kv_owner
