"""What the scheduler takes and gives: a request to generate (:class:`GenerationRequest`), where its
outputs go (:class:`OutputSink`, :class:`AsyncOutputStream`), what it reports
(:class:`SchedulerObserver`) and the errors it raises (:class:`SchedulerError` and its kinds).
The scheduler itself is :mod:`inference.serving.scheduler`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

from inference.images.features import PromptImages
from inference.serving.generation import GenerationState, StepOutput
from inference.serving.sampling import Sampler


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
