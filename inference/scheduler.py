"""Admission queue and continuous batching around one ``Engine``.

One dedicated thread owns the engine (engines are not thread-safe). Requests arrive from the
asyncio side through :meth:`Scheduler.submit`; each gets an engine slot when one is free, its
prompt is prefilled in chunks one sequence at a time between decode steps, and every decode
step runs all sequences that have finished prefill together. Outputs go back through a
thread-safe :class:`OutputSink` (:class:`AsyncOutputStream` for asyncio consumers).

Admission: at most ``max_batch_size`` sequences run and ``max_queued_requests`` more wait;
beyond that :class:`QueueFullError`. A request that waits longer than ``queue_timeout`` gets
:class:`QueueTimeoutError`. The serving layer maps both to HTTP 429.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from inference.generation import GenerationState, StepOutput
from inference.runtime.protocol import Engine
from inference.sampling import Sampler

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

log = logging.getLogger(__name__)


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


@dataclass(eq=False)
class _Running:
    req: GenerationRequest
    slot: int
    prefilled: int = 0
    last_token: int | None = None


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
    ) -> None:
        """Configure; nothing runs until :meth:`start`."""
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
        self._observer = observer
        self._capacity = engine.info.max_kv_capacity
        self._cond = threading.Condition()
        self._waiting: deque[GenerationRequest] = deque()
        self._running: list[_Running] = []
        self._free_slots: list[int] = list(range(self.max_batch_size - 1, -1, -1))
        self._thread: threading.Thread | None = None
        self._stopping = False

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
                slot = self._free_slots.pop()
                self._engine.reset(slot)
                self._running.append(_Running(req, slot))
                changed = True
            else:
                kept.append(req)
        self._waiting = kept
        if changed:
            self._notify_queue()

    def _release(self, run: _Running) -> None:
        # Called on the scheduler thread only; the lock protects the lists the asyncio side reads.
        try:
            self._engine.reset(run.slot)
        except Exception:  # a broken engine must not leak the slot record
            log.exception("engine.reset(%d) failed", run.slot)
        with self._cond:
            if run in self._running:
                self._running.remove(run)
                self._free_slots.append(run.slot)
            self._notify_queue()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if self._stopping:
                        break
                    now = time.monotonic()
                    self._admit_locked(now)
                    if not self._running:
                        deadline = min((r.arrival + self.queue_timeout for r in self._waiting), default=None)
                        self._cond.wait(None if deadline is None else max(0.0, deadline - now) + 0.001)
                        continue
                    running = list(self._running)
                self._step(running)
        except BaseException:  # pragma: no cover - last resort; keeps clients from hanging
            log.exception("scheduler thread crashed")
            raise
        finally:
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
        if out.finished:
            # Free the slot before the client sees the end, so a follow-up request sent the
            # moment this one completes finds the slot free instead of a full queue (429).
            self._release(run)
            run.req.sink.put(out)
            return False
        if not run.req.sink.put(out):
            self._release(run)
            return False
        return True

    def _step(self, running: list[_Running]) -> None:
        for run in running:
            if run.req.cancelled:
                self._release(run)
        live = [r for r in running if not r.req.cancelled]
        prefilling = [r for r in live if r.last_token is None]
        if prefilling:
            self._prefill_chunk(prefilling[0])
        decoding = [r for r in live if r.last_token is not None]
        if decoding:
            self._decode(decoding)

    def _prefill_chunk(self, run: _Running) -> None:
        req = run.req
        ids = req.prompt_ids
        chunk = ids[run.prefilled : run.prefilled + self._chunk]
        try:
            logits = self._engine.prefill(run.slot, list(chunk))
        except Exception as exc:
            log.exception("prefill failed")
            req.sink.put(EngineFailure(f"prefill failed: {exc}"))
            self._release(run)
            return
        run.prefilled += len(chunk)
        if run.prefilled < len(ids):
            return
        sample = req.sampler.sample(np.asarray(logits).reshape(-1))
        if self._observer is not None:
            self._observer.first_token(time.monotonic() - req.arrival)
            self._observer.tokens_generated(1)
        out = req.state.push(sample)
        if self._emit(run, out):
            run.last_token = sample.token_id

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
                run.req.sink.put(EngineFailure(f"decode failed: {exc}"))
                self._release(run)
            return
        rows = np.asarray(logits).reshape(len(batch), -1)
        if self._observer is not None:
            self._observer.tokens_generated(len(batch))
        for run, row in zip(batch, rows, strict=True):
            sample = run.req.sampler.sample(row)
            out = run.req.state.push(sample)
            if self._emit(run, out):
                run.last_token = sample.token_id
