"""Admission queue and continuous batching around one ``Engine``.

One dedicated thread owns the engine (engines are not thread-safe). Requests arrive from the
asyncio side through :meth:`Scheduler.submit`; each gets an engine slot when one is free, its
prompt is prefilled in chunks one sequence at a time between decode steps, and every decode
step runs all sequences that have finished prefill together. Outputs go back through a
thread-safe :class:`OutputSink` (:class:`AsyncOutputStream` for asyncio consumers).

Admission: at most ``max_batch_size`` sequences run and ``max_queued_requests`` more wait;
beyond that :class:`QueueFullError`. A request that waits longer than ``queue_timeout`` gets
:class:`QueueTimeoutError`. The serving layer maps both to HTTP 429.

Context reuse (a :class:`~inference.serving.context_cache.PrefixStore` and a
:class:`~inference.runtime.protocol.KVEngine`): a finished sequence leaves its KV in its slot and
its complete 64-token blocks as records (once idle); a new request takes the free slot sharing the
longest prefix with its prompt (else :mod:`.slot_choice`'s), extends it with records copied back
block by block and prefills the rest
(at least its last token). ``cache_prompt=False`` neither reuses nor leaves anything; a
``cache_salt`` seeds the records' hash chain. Outputs are the same with and without reuse.

Images (:class:`~inference.images.features.PromptImages`): the cache keys image rows by their
image's digest (``cache_ids``), and the features of the rows left after the reuse are encoded in a
worker thread of the scheduler's own while the other sequences keep decoding.

Speculative decoding (a :data:`~inference.serving.speculative.ProposerFactory` and a
:class:`~inference.runtime.protocol.VerifyingEngine`): a sequence whose proposer guesses tokens runs
its pending token and the guesses in one ``extend``; :func:`~inference.serving.speculative.verify`
keeps what ordinary decoding would have given, and the slot is truncated to it.

Prefill and decode: each step runs one prefill chunk (``prefill_chunk`` tokens) and then one
decode step of every sequence past its prefill, so a new request delays running streams by one
chunk per step, never by a whole prompt (the in-place CPU engine cannot batch them together).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from inference.runtime.protocol import Engine, ImageEngine, KVEngine, VerifyingEngine
from inference.serving.context_cache import ContextCacheStats, PrefixStore, common_prefix
from inference.serving.generation import StepOutput
from inference.serving.requests import (
    AdapterUnloadedError,
    AsyncOutputStream,
    EngineFailure,
    GenerationRequest,
    OutputSink,
    QueueFullError,
    QueueTimeoutError,
    SchedulerError,
    SchedulerObserver,
    SchedulerStoppedError,
)
from inference.serving.sampling import SampleResult
from inference.serving.slot_choice import fallback_slot
from inference.serving.speculative import Proposal, Proposer, ProposerFactory, SpeculativeStats, verify

__all__ = [
    "AdapterUnloadedError", "AsyncOutputStream", "EngineFailure", "GenerationRequest", "OutputSink",
    "QueueFullError", "QueueTimeoutError", "Scheduler", "SchedulerError", "SchedulerObserver",
    "SchedulerStoppedError",
]

log = logging.getLogger("inference.scheduler")

#: Seconds the scheduler waits, idle, before it saves finished requests' blocks as records: a
#: follow-up request that extends the same prompt (a chat's next turn, an agent's next call)
#: usually comes sooner, and starts without waiting for the copy.
SAVE_DELAY = 0.5


@dataclass(eq=False)
class _Running:
    req: GenerationRequest
    slot: int
    prefilled: int = 0
    last_token: int | None = None
    prepared: bool = False  # slot set up (reused prefix restored or slot emptied)
    broken: bool = False  # the engine failed: the slot's content is unknown
    reused: int = 0  # prompt tokens taken from the cache
    # The logits after the whole prompt: from a tail record that held it all (``resumed``, used
    # instead of a prefill), and (``prompt_logits``) for the tail record this run leaves.
    resumed: np.ndarray | None = None
    prompt_logits: np.ndarray | None = None
    output_ids: list[int] = field(default_factory=list)  # every token emitted so far
    # The encode of this prompt's images that the prefill waits for (:meth:`Scheduler._images_ready`).
    encoding: Future[None] | None = None


class Scheduler:
    """Drives one engine from one thread; see the module docstring."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_batch_size: int,
        max_queued_requests: int,
        queue_timeout: float,
        prefill_chunk: int = 256,
        observer: SchedulerObserver | None = None,
        context_cache: PrefixStore | None = None,
        proposer: ProposerFactory | None = None,
        save_delay: float = SAVE_DELAY,
    ) -> None:
        """Configure; nothing runs until :meth:`start`. ``save_delay``: :data:`SAVE_DELAY`."""
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if max_queued_requests < 0:
            raise ValueError("max_queued_requests must be 0 or more")
        if prefill_chunk < 1:
            raise ValueError("prefill_chunk must be at least 1")
        self._engine = engine
        self.max_batch_size = min(max_batch_size, engine.info.max_slots)
        self.max_queued_requests = max_queued_requests
        self.queue_timeout = queue_timeout
        self._chunk = prefill_chunk
        self._save_delay = save_delay
        self._observer = observer
        self._capacity = engine.info.max_kv_capacity
        self._cond = threading.Condition()
        self._waiting: deque[GenerationRequest] = deque()
        self._running: list[_Running] = []
        self._free_slots: list[int] = list(range(self.max_batch_size - 1, -1, -1))
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Context reuse needs the KV operations; a plain Engine runs without it.
        self._store = context_cache if isinstance(engine, KVEngine) else None
        self._kv: KVEngine | None = engine if self._store is not None else None  # type: ignore[assignment]
        if self._store is not None:  # the disk writer's figures reach the observer too
            self._store.set_listener(self._notify_cache)
        # Per slot: the tokens whose KV the slot holds, when that KV may serve other requests.
        self._slot_tokens: list[list[int]] = [[] for _ in range(self.max_batch_size)]
        # Per slot: the cache_salt and adapter of the request that left that KV (only a request
        # with the same salt and adapter reuses it).
        self._slot_owner: list[tuple[str | None, str | None]] = [(None, None)] * self.max_batch_size
        # Per slot: a finished request whose blocks are still to be saved as records, with the
        # tokens its slot held. Saving copies every new block (a 1,500-token SmolLM2 prompt: 69
        # MB, 100-190 ms), so it waits until the scheduler is idle or the slot's first
        # ``len(tokens)`` positions are about to change; a follow-up request that extends the
        # same prompt in the same slot (a chat's next turn) starts without waiting for it.
        self._pending_saves: dict[int, tuple[_Running, list[int]]] = {}
        # Engines that run LoRA adapters: each slot runs the adapter of its sequence.
        self._adapters = engine if hasattr(engine, "set_adapter") else None
        # n choices of one prompt share its prefill by copying KV between slots.
        self._fork_kv: KVEngine | None = engine if isinstance(engine, KVEngine) else None
        # Image features are encoded here, off the scheduler thread (made on first use).
        self._encoder: ThreadPoolExecutor | None = None
        self._woken = False  # an encode finished since the last look (set under the lock)
        self._proposer: Proposer | None = None
        self.speculative_stats: SpeculativeStats | None = None
        if proposer is not None and isinstance(engine, VerifyingEngine):
            self._proposer = proposer(engine)
            self.speculative_stats = SpeculativeStats()

    # -- asyncio side ------------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiting)

    @property
    def active(self) -> int:
        """Requests holding a slot."""
        return len(self._running)

    @property
    def context_reuse(self) -> bool:
        """Whether cached prefixes are reused."""
        return self._store is not None

    def context_cache_stats(self) -> ContextCacheStats | None:
        """Counters of the prefix store (None without context reuse); any thread."""
        return None if self._store is None else self._store.stats()

    @property
    def running(self) -> bool:
        """True between start() and stop()."""
        return self._thread is not None and not self._stopping

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="inference-scheduler", daemon=True)
            self._thread.start()

    def submit(self, req: GenerationRequest) -> None:
        """Queue ``req``; raise :class:`QueueFullError` or :class:`SchedulerStoppedError`."""
        with self._cond:
            if self._thread is None or self._stopping:
                raise SchedulerStoppedError("the scheduler is not running")
            if len(self._running) + len(self._waiting) >= self.max_batch_size + self.max_queued_requests:
                raise QueueFullError(
                    f"{len(self._running)} requests running and {len(self._waiting)} waiting "
                    f"(limits: {self.max_batch_size} running, {self.max_queued_requests} waiting)"
                )
            self._waiting.append(req)
            self._notify_queue()
            self._cond.notify_all()

    def submit_group(self, reqs: Sequence[GenerationRequest]) -> None:
        """Queue all of ``reqs`` or none (the n choices of one request); errors as :meth:`submit`."""
        with self._cond:
            if self._thread is None or self._stopping:
                raise SchedulerStoppedError("the scheduler is not running")
            busy = len(self._running) + len(self._waiting)
            if busy + len(reqs) > self.max_batch_size + self.max_queued_requests:
                raise QueueFullError(
                    f"{len(self._running)} requests running and {len(self._waiting)} waiting, "
                    f"{len(reqs)} more do not fit "
                    f"(limits: {self.max_batch_size} running, {self.max_queued_requests} waiting)"
                )
            self._waiting.extend(reqs)
            self._notify_queue()
            self._cond.notify_all()

    def cancel(self, req: GenerationRequest) -> None:
        """Stop generating for ``req`` and free its slot soon (thread-safe)."""
        req.cancelled = True
        with self._cond:
            self._cond.notify_all()

    def stop(self, timeout: float = 10.0) -> None:
        """Fail whatever is still queued or running, and join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        if self._encoder is not None:
            self._encoder.shutdown(wait=False, cancel_futures=True)
        if self._store is not None:
            self._store.close()  # the records still queued for the disk are written

    # -- scheduler thread ----------------------------------------------------------------------

    def _notify_queue(self) -> None:
        if self._observer is not None:
            self._observer.queue_changed(len(self._waiting), len(self._running))

    def _admit_locked(self, now: float) -> None:
        kept: deque[GenerationRequest] = deque()
        changed = False
        for req in self._waiting:
            if req.cancelled:
                changed = True
            elif now - req.arrival > self.queue_timeout:
                changed = True
                req.sink.put(QueueTimeoutError(f"waited more than {self.queue_timeout:g} s for a free slot"))
            elif self._free_slots:
                slot = self._pick_slot(req)
                if self._adapters is not None:
                    try:
                        self._adapters.set_adapter(slot, req.adapter)
                    except ValueError as exc:  # unloaded after the request was queued
                        changed = True
                        req.sink.put(AdapterUnloadedError(
                            f"LoRA adapter {req.adapter!r} was unloaded while this request waited for a "
                            f"slot; load it again or ask for another model ({exc})"))
                        continue
                self._free_slots.remove(slot)
                if self._store is None:
                    self._engine.reset(slot)
                self._running.append(_Running(req, slot))
                changed = True
            else:
                kept.append(req)
        self._waiting = kept
        if changed:
            self._notify_queue()

    def _pick_slot(self, req: GenerationRequest) -> int:
        """The free slot to run ``req`` in: the one holding the longest prefix of its prompt (at
        least a block's worth), else :func:`.slot_choice.fallback_slot`'s."""
        if self._store is None or not req.cache_prompt:
            return min(self._free_slots)
        best: int | None = None
        best_len = self._store.block_tokens - 1
        for slot in self._free_slots:
            if self._slot_owner[slot] != req.kv_owner:
                continue
            n = common_prefix(self._slot_tokens[slot], req.cache_ids, len(req.prompt_ids) - 1)
            if n > best_len or (n == best_len and best is not None and slot < best):
                best, best_len = slot, n
        if best is not None:
            return best
        owed = {slot: len(tokens) for slot, (_, tokens) in self._pending_saves.items()}
        return fallback_slot(self._free_slots, [r.slot for r in self._running], owed)

    def _prepare(self, run: _Running) -> None:
        """Before the first prefill chunk: resume from the longest cached prefix, or start empty."""
        run.prepared = True
        kv, store = self._kv, self._store
        slot, prompt = run.slot, run.req.cache_ids
        if kv is None or store is None or not run.req.cache_prompt:
            self._flush_saves([slot])
            self._slot_tokens[slot] = []
            self._engine.reset(slot)
            return
        block = store.block_tokens
        # Another slot's unsaved blocks that this prompt could use: saved now, so fetch finds them.
        self._flush_saves([other for other, (_, tokens) in self._pending_saves.items()
                           if other != slot and common_prefix(tokens, prompt, block) >= block])
        salt, adapter = run.req.kv_owner
        held = self._slot_tokens[slot][: kv.slot_length(slot)]  # the engine may have emptied it
        if self._slot_owner[slot] != run.req.kv_owner:
            held = []  # another tenant's (or adapter's) KV: never reused, only overwritten
        self._slot_owner[slot] = run.req.kv_owner
        limit = len(prompt) - 1  # the last prompt token is always prefilled
        reused = common_prefix(held, prompt, limit)
        keys = store.block_keys(prompt[: (limit // block) * block], salt, adapter)
        found = store.fetch(keys, prompt, reused, tails=True, cache_salt=salt, adapter=adapter, limit=limit)
        start = (reused // block) * block
        if found and start + sum(int(r.shape[2]) for r in found) > reused:
            self._save_from(slot, start)
            kv.truncate(slot, min(start, kv.slot_length(slot)))
            for record in found:
                kv.import_kv(slot, start, record)
                start += int(record.shape[2])
            reused = start
            # A tail that held the whole prompt and the logits after it: nothing to prefill.
            run.resumed = found.logits if reused == len(prompt) else None
        else:
            self._save_from(slot, reused)
            kv.truncate(slot, reused)
        self._slot_tokens[slot] = list(prompt[:reused])
        run.prefilled = run.reused = reused
        run.req.state.cached_tokens = reused
        store.note_lookup(reused)
        self._notify_cache()

    def _release(self, run: _Running) -> None:
        """Free ``run``'s slot; its blocks become the slot's pending save (:meth:`_defer_save`)."""
        # Called on the scheduler thread only; the lock protects the lists the asyncio side reads.
        if self._proposer is not None:
            self._release_proposal(run.slot)
        if self._store is not None and run.req.cache_prompt and not run.broken:
            # Unprepared: the slot still holds what an earlier request left there; keep it.
            if run.prepared:
                self._defer_save(run)
        else:
            if run.broken:
                self._pending_saves.pop(run.slot, None)  # what the slot holds is unknown now
            else:
                self._flush_saves([run.slot])
            self._slot_tokens[run.slot] = []
            try:
                self._engine.reset(run.slot)
            except Exception:  # a broken engine must not leak the slot record
                log.exception("engine.reset(%d) failed", run.slot)
        if self._adapters is not None and run.req.adapter is not None:
            self._adapters.set_adapter(run.slot, None)  # the adapter is free to unload now
        with self._cond:
            if run in self._running:
                self._running.remove(run)
                self._free_slots.append(run.slot)
            self._notify_queue()

    def _run(self) -> None:
        idle_since: float | None = None
        try:
            while True:
                with self._cond:
                    if self._stopping:
                        break
                    now = time.monotonic()
                    self._admit_locked(now)
                    if self._running:
                        idle_since = None
                    else:
                        idle_since = now if idle_since is None else idle_since
                        # Idle for SAVE_DELAY (no follow-up came): the finished requests' records now.
                        save_at = idle_since + self._save_delay if self._pending_saves else None
                        if save_at is None or now < save_at:
                            deadlines = [r.arrival + self.queue_timeout for r in self._waiting]
                            if save_at is not None:
                                deadlines.append(save_at)
                            deadline = min(deadlines, default=None)
                            self._cond.wait(None if deadline is None else max(0.0, deadline - now) + 0.001)
                            continue
                    running = list(self._running)
                if not running:
                    # One slot at a time: a request that arrives meanwhile waits for one slot's save.
                    self._flush_saves(list(self._pending_saves)[:1])
                    continue
                if not self._step(running):
                    self._wait_for_images()
        except BaseException:  # pragma: no cover - last resort; keeps clients from hanging
            log.exception("scheduler thread crashed")
            raise
        finally:
            try:
                self._flush_saves()  # what the last requests left is kept (and written to disk)
            except BaseException:  # pragma: no cover - the records are an optimisation
                log.exception("saving context records at stop failed")
            self._fail_all(SchedulerStoppedError("the server is shutting down"))

    def _fail_all(self, exc: SchedulerError) -> None:
        with self._cond:
            self._stopping = True
            pending = list(self._waiting)
            running = list(self._running)
            self._waiting.clear()
        for req in pending:
            req.sink.put(exc)
        for run in running:
            run.req.sink.put(exc)
            self._release(run)

    def _emit(self, run: _Running, out: StepOutput) -> bool:
        """Deliver; return True when the sequence goes on."""
        run.output_ids.extend(out.token_ids)
        if out.finished:
            # Free the slot before the client sees the end, so a follow-up request sent the
            # moment this one completes finds the slot free instead of a full queue (429); its
            # blocks are saved when the scheduler is idle or the slot is needed otherwise (a
            # 1,500-token prompt's 23 blocks are a 69 MB copy with SmolLM2): a follow-up that
            # extends this prompt in this slot does not wait for them.
            self._release(run)
            run.req.sink.put(out)
            return False
        if not run.req.sink.put(out):
            self._release(run)
            return False
        return True

    def _step(self, running: list[_Running]) -> bool:
        """One prefill chunk and one decode step; False when there was nothing to run (every
        sequence waits for its images' features)."""
        worked = False
        for run in running:
            if run.req.cancelled:
                self._release(run)
                worked = True
        live = [r for r in running if not r.req.cancelled]
        prefilling = [r for r in live if r.last_token is None]
        leaders = {id(r.req) for r in prefilling}
        for run in prefilling:
            # A choice that waits for its leader's prompt KV (``prefix_from``) is not started alone.
            if run.req.prefix_from is not None and id(run.req.prefix_from) in leaders and not run.prepared:
                continue
            if self._prefill_chunk(run):
                worked = True
                break
        decoding = [r for r in live if r.last_token is not None]
        if decoding and self._proposer is not None:
            decoding = self._speculate(decoding)
        if decoding:
            self._decode(decoding)
            worked = True
        return worked

    def _images_ready(self, run: _Running) -> bool:
        """Whether the features of the prompt's rows from ``run.prefilled`` on are there; if not,
        the encode of those still missing is started (or its failure fails ``run``)."""
        images = run.req.images
        if images is None:
            return True
        future = run.encoding
        if future is not None:
            if not future.done():
                return False
            run.encoding = None
            error = future.exception()
            if error is not None:
                log.error("encoding the images of a request failed: %s", error)
                self._fail(run, EngineFailure(f"encoding the images failed: {error}"))
                return False
        todo = images.missing(run.prefilled)
        if todo:
            if self._encoder is None:
                self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="image-encode")
            run.encoding = self._encoder.submit(images.encode, todo)
            run.encoding.add_done_callback(self._wake)
            return False
        return not images.waiting(run.prefilled)  # another choice's encode of them is under way

    def _wake(self, _: object = None) -> None:
        """An encode finished: the scheduler thread looks again."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def _wait_for_images(self) -> None:
        """Nothing could run: wait for an encode to finish (or anything else to change)."""
        with self._cond:
            if not self._woken and not self._stopping:
                self._cond.wait(0.05)
            self._woken = False

    def _fail(self, run: _Running, exc: EngineFailure) -> None:
        run.req.sink.put(exc)
        run.broken = True
        self._release(run)

    def _prefill_chunk(self, run: _Running) -> bool:
        """Prefill ``run``'s next chunk; False when it waits for its images' features instead."""
        req = run.req
        ids = req.prompt_ids
        try:
            if not run.prepared:
                self._prepare(run)
            if run.resumed is None and not self._images_ready(run):
                return run.req.cancelled or run not in self._running  # failed: that was work too
            resumed, run.resumed = run.resumed, None
            if resumed is not None:  # the whole prompt came back with its logits
                chunk: Sequence[int] = []
                logits = resumed
            else:
                end = run.prefilled + self._chunk
                if req.images is not None:  # where the images' rows must stay in one chunk
                    end = req.images.chunk_end(run.prefilled, end)
                chunk = ids[run.prefilled : end]
                logits = self._prefill(run, list(chunk))
        except Exception as exc:
            log.exception("prefill failed")
            self._fail(run, EngineFailure(f"prefill failed: {exc}"))
            return True
        if self._store is not None:
            self._slot_tokens[run.slot].extend(req.cache_ids[run.prefilled:run.prefilled + len(chunk)])
        run.prefilled += len(chunk)
        if run.prefilled < len(ids):
            return True
        self._share_prefix(run)
        if self._store is not None and req.cache_prompt:
            # Kept unchanged for the tail record (the sampler gets its own copy).
            run.prompt_logits = np.asarray(logits, dtype=np.float32).reshape(-1)
            logits = run.prompt_logits.copy()
        sample = self._sample(run, np.asarray(logits).reshape(-1))
        if sample is None:
            return True
        if self._observer is not None:
            self._observer.first_token(time.monotonic() - req.arrival)
            self._observer.tokens_generated(1)
        out = req.state.push(sample)
        if self._emit(run, out):
            run.last_token = sample.token_id
            # The prompt's blocks wait as a pending save (the slot only appends after them): a
            # request that could use them saves them first (:meth:`_prepare`), an idle moment
            # or the end of this request does otherwise; copying them here stalled this
            # request's second token (100-190 ms for a 1,500-token SmolLM2 prompt).
            self._defer_save(run)
        return True

    def _prefill(self, run: _Running, chunk: list[int]) -> np.ndarray:
        """One prefill chunk of ``run``, with its image features where the chunk has image tokens."""
        images = run.req.images
        if images is None:
            return self._engine.prefill(run.slot, chunk)
        if not isinstance(self._engine, ImageEngine):
            raise ValueError("this engine takes no image features")
        rows, features = images.window(run.prefilled, len(chunk))
        rope = images.rope_window(run.prefilled, len(chunk))
        if rope is not None:  # multimodal rotary positions (Qwen2.5-VL): given for every chunk
            return self._engine.prefill_images(run.slot, chunk, rows, features, rope_positions=rope)
        if not len(rows):
            return self._engine.prefill(run.slot, chunk)
        return self._engine.prefill_images(run.slot, chunk, rows, features)

    def _decode(self, runs: list[_Running]) -> None:
        batch: list[_Running] = []
        for run in runs:
            # The token about to be appended needs one more KV position.
            if len(run.req.prompt_ids) + run.req.state.completion_tokens > self._capacity:
                self._emit(run, run.req.state.finish_length())
            else:
                batch.append(run)
        if not batch:
            return
        tokens = [r.last_token for r in batch]
        try:
            logits = self._engine.decode([r.slot for r in batch], [t for t in tokens if t is not None])
        except Exception as exc:
            log.exception("decode failed")
            for run in batch:
                self._fail(run, EngineFailure(f"decode failed: {exc}"))
            return
        rows = np.asarray(logits).reshape(len(batch), -1)
        if self._observer is not None:
            self._observer.tokens_generated(len(batch))
        for run, row in zip(batch, rows, strict=True):
            if self._store is not None and run.last_token is not None:
                self._slot_tokens[run.slot].append(run.last_token)
            sample = self._sample(run, row)
            if sample is None:
                continue
            out = run.req.state.push(sample)
            if self._emit(run, out):
                run.last_token = sample.token_id

    def _sample(self, run: _Running, logits: np.ndarray) -> SampleResult | None:
        """The request's sampler on one row of logits. A sampler that raises (a grammar's
        matcher, say) fails that request only, never the scheduler thread; None then."""
        try:
            return run.req.sampler.sample(logits)
        except Exception as exc:
            log.exception("sampling failed")
            self._fail(run, EngineFailure(f"sampling failed: {exc}"))
            return None

    # -- prefix records: finished requests' blocks saved once idle; sibling choices share a prefill --
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

    # -- speculative decoding: a draft's guesses verified in one extend of the target --
    def _release_proposal(self, slot: int) -> None:
        assert self._proposer is not None
        try:
            self._proposer.release(slot)
        except Exception:  # the draft is an optimisation: never fail a request for it
            log.exception("releasing the proposer's slot %d failed", slot)

    def _speculate(self, runs: list[_Running]) -> list[_Running]:
        """Verify guesses for the runs that get some; return the runs left to decode normally."""
        rest: list[_Running] = []
        for run in runs:
            proposal = self._propose(run)
            if proposal is None:
                rest.append(run)
            else:
                self._verify(run, proposal)
        return rest

    def _propose(self, run: _Running) -> Proposal | None:
        """Guesses for ``run``'s next tokens, or None to decode it normally."""
        assert self._proposer is not None
        req = run.req
        state = req.state
        if not req.speculative or run.last_token is None:
            return None
        held = len(req.prompt_ids) + state.completion_tokens  # positions after the pending token
        # Room in the KV for the guesses, and no more of them than tokens still wanted.
        k = min(self._proposer.num_speculative_tokens, self._capacity - held,
                state.max_new_tokens - state.completion_tokens - 1)
        if k < 1:
            return None
        try:
            proposal = self._proposer.propose(run.slot, [*req.prompt_ids, *run.output_ids], req.sampler, k)
        except Exception:  # a failing draft must not fail the request: decode it normally
            log.exception("speculative proposal failed")
            return None
        if not proposal.tokens:
            return None
        return Proposal(proposal.tokens[:k], None if proposal.probs is None else proposal.probs[:k])

    def _verify(self, run: _Running, proposal: Proposal) -> None:
        """One ``extend`` of the pending token and the guesses; keep what verification keeps."""
        engine = self._engine
        assert isinstance(engine, VerifyingEngine) and run.last_token is not None
        req = run.req
        try:
            before = engine.slot_length(run.slot)
            logits = engine.extend(run.slot, [run.last_token, *proposal.tokens])
            results = verify(req.sampler, np.asarray(logits), proposal)
            kept = len(results) - 1
            engine.truncate(run.slot, before + 1 + kept)
        except Exception as exc:
            from inference.serving.scheduler import EngineFailure

            log.exception("speculative verification failed")
            self._fail(run, EngineFailure(f"decode failed: {exc}"))
            return
        if self._store is not None:
            self._slot_tokens[run.slot].extend([run.last_token, *proposal.tokens[:kept]])
        if self.speculative_stats is not None:
            self.speculative_stats.add(len(proposal.tokens), kept, len(results))
        hook = getattr(self._observer, "speculative_step", None)
        if hook is not None:
            hook(len(proposal.tokens), kept, len(results))
        emitted = 0
        for sample in results:
            out = req.state.push(sample)
            emitted += 1
            if not self._emit(run, out):
                break
            run.last_token = sample.token_id
        if self._observer is not None:
            self._observer.tokens_generated(emitted)
