"""Admission queue and continuous batching around one ``Engine``.

One dedicated thread owns the engine (engines are not thread-safe). Requests arrive from the
asyncio side through :meth:`Scheduler.submit`; each gets an engine slot when one is free, its
prompt is prefilled in chunks one sequence at a time between decode steps, and every decode
step runs all sequences that have finished prefill together. Outputs go back through a
thread-safe :class:`OutputSink` (:class:`AsyncOutputStream` for asyncio consumers).

Admission: at most ``max_batch_size`` sequences run and ``max_queued_requests`` more wait;
beyond that :class:`QueueFullError`. A request that waits longer than ``queue_timeout`` gets
:class:`QueueTimeoutError`. The serving layer maps both to HTTP 429.

Context reuse (when a :class:`~inference.serving.context_cache.PrefixStore` is given and the engine is a
:class:`~inference.runtime.protocol.KVEngine`): a finished sequence leaves its KV in its slot,
and its complete 64-token blocks as records in the store. A new request takes the free slot
whose content shares the longest prefix with its prompt (token granular: the slot is truncated
to it), then extends that prefix with records copied back block by block, and prefills only
the rest. At least the last prompt token is always prefilled (its logits pick the first token).
Requests with ``cache_prompt=False`` neither reuse nor leave anything behind; a request's
``cache_salt`` seeds the records' hash chain and tags its slot, so only requests with the same
salt reuse what it left. Outputs are the
same with and without reuse (the KV is the same numbers; see the tests).

Images (a vision-language prompt's :class:`~inference.images.features.PromptImages`): the cache
sees a request's ``cache_ids``, where each image row's id is drawn from its image's digest, so a
prefix is reused only with the same images. The features of the rows left to prefill are encoded
once the reuse is known (:meth:`PromptImages.missing`), in a worker thread of the scheduler's own:
a prefix that covers an image needs no encode of it, and the sequence waits (without holding up
the others' decode steps) until its features are there.

Speculative decoding (when a :data:`~inference.serving.speculative.ProposerFactory` is given and the
engine is a :class:`~inference.runtime.protocol.VerifyingEngine`): a decoding sequence whose
proposer guesses tokens is not in the batched decode step; instead its pending token and the
guesses run in one ``extend`` of its slot, :func:`~inference.serving.speculative.verify` keeps a prefix
of the guesses plus one token of the target's, and the slot is truncated to what was kept.
Output is what ordinary decoding gives (greedy: the same tokens; sampling: the same
distribution). Sequences without a guess, and requests with ``speculative=False`` (per-request
constraints that must see every token's logits in order), decode as usual.

Prefill and decode: the in-place CPU engine cannot run a multi-token chunk of one sequence in
the same batch as other sequences, so each step runs one prefill chunk (``prefill_chunk``
tokens, tunable) and then one decode step of every sequence past its prefill. A new request
therefore delays running streams by one chunk per step, never by a whole prompt.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np

from inference.images.features import PromptImages
from inference.runtime.protocol import Engine, ImageEngine, KVEngine, VerifyingEngine
from inference.serving.context_cache import ContextCacheStats, PrefixStore, common_prefix
from inference.serving.generation import GenerationState, StepOutput
from inference.serving.prefix_saves import PrefixSaves
from inference.serving.sampling import Sampler, SampleResult
from inference.serving.speculative import Proposer, ProposerFactory, SpeculativeStats
from inference.serving.speculative_steps import SpeculativeSteps

__all__ = [
    "AsyncOutputStream",
    "EngineFailure",
    "GenerationRequest",
    "OutputSink",
    "QueueFullError",
    "QueueTimeoutError",
    "Scheduler",
    "SchedulerObserver",
    "SchedulerStoppedError",
]

log = logging.getLogger("inference.scheduler")

#: Seconds the scheduler waits, idle, before it saves finished requests' blocks as records: a
#: follow-up request that extends the same prompt (a chat's next turn, an agent's next call)
#: usually comes sooner, and starts without waiting for the copy.
SAVE_DELAY = 0.5


class SchedulerError(Exception):
    """Base of the scheduler's errors."""


class QueueFullError(SchedulerError):
    """No slot free and the waiting queue is full."""


class QueueTimeoutError(SchedulerError):
    """The request waited longer than the queue timeout without getting a slot."""


class SchedulerStoppedError(SchedulerError):
    """The scheduler is not running (not started yet, or stopped)."""


class EngineFailure(SchedulerError):
    """The engine raised while running this request."""


class AdapterUnloadedError(SchedulerError):
    """The LoRA adapter the request names was unloaded while the request waited for a slot."""


class SchedulerObserver(Protocol):
    """Metrics hooks; called from the scheduler thread, so implementations must be thread-safe."""

    def first_token(self, seconds: float) -> None:
        """Time from submission to the first generated token of one request."""

    def tokens_generated(self, n: int) -> None:
        """``n`` more tokens were generated (summed over the batch)."""

    def queue_changed(self, queued: int, active: int) -> None:
        """Waiting and running request counts after a change."""


class OutputSink(Protocol):
    """Where the scheduler thread delivers a request's outputs."""

    def put(self, item: StepOutput | BaseException) -> bool:
        """Deliver one item; return False when nobody listens any more (the request is dropped)."""
        ...


class AsyncOutputStream:
    """An :class:`OutputSink` that hands items to an asyncio consumer on ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind to the consumer's event loop."""
        self._loop = loop
        self._queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        self._closed = False

    def put(self, item: StepOutput | BaseException) -> bool:
        """Thread-safe; False once the consumer closed the stream or its loop is gone."""
        if self._closed:
            return False
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # loop closed
            self._closed = True
            return False
        return True

    def close(self) -> None:
        """The consumer stops listening; the scheduler drops the request at its next step."""
        self._closed = True

    async def get(self) -> StepOutput | BaseException:
        """Next item (an output, or the exception that ended the request)."""
        return await self._queue.get()


@dataclass(eq=False)
class GenerationRequest:
    """One sequence to generate. After submit, only the scheduler thread touches its state."""

    prompt_ids: Sequence[int]
    sampler: Sampler
    state: GenerationState
    sink: OutputSink
    arrival: float = field(default_factory=time.monotonic)
    # Set from any thread; a plain bool write is atomic, and the scheduler only reads it.
    cancelled: bool = False
    # False: no cached prefix is used for this request and its KV is not kept for others.
    cache_prompt: bool = True
    # One of n choices of the same prompt: start from a copy of this request's prompt KV.
    prefix_from: GenerationRequest | None = None
    # False: never decoded speculatively (constraints that must process every token's logits).
    speculative: bool = True
    # vLLM's cache_salt: cached prefixes are shared only between requests with the same salt.
    cache_salt: str | None = None
    # The LoRA adapter this sequence runs with (None: the base weights); KV made with one
    # adapter is never reused by a sequence of another.
    adapter: str | None = None
    # A vision-language prompt's images (their rows replace those image tokens' embeddings).
    images: PromptImages | None = None

    @cached_property
    def cache_ids(self) -> list[int]:
        """The prompt as context reuse keys it: ``prompt_ids``, each image row's id replaced by
        one drawn from its image's digest (:meth:`PromptImages.cache_ids`)."""
        return list(self.prompt_ids) if self.images is None else self.images.cache_ids(self.prompt_ids)

    @property
    def kv_owner(self) -> tuple[str | None, str | None]:
        """Who may reuse the KV this request leaves: requests with the same salt and adapter."""
        return (self.cache_salt, self.adapter)


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


class Scheduler(PrefixSaves, SpeculativeSteps):
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
        """The free slot to run ``req`` in: the one holding the longest prefix of its prompt
        (at least a block's worth), else the lowest, which keeps running slots packed."""
        lowest = min(self._free_slots)
        if self._store is None or not req.cache_prompt:
            return lowest
        best, best_len = lowest, self._store.block_tokens - 1
        for slot in self._free_slots:
            if self._slot_owner[slot] != req.kv_owner:
                continue
            n = common_prefix(self._slot_tokens[slot], req.cache_ids, len(req.prompt_ids) - 1)
            if n > best_len or (n == best_len and slot < best):
                best, best_len = slot, n
        return best

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
                    self._flush_saves()
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
