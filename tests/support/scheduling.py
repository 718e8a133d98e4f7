"""Drive a real :class:`~inference.serving.scheduler.Scheduler` from a test: submit token prompts,
collect the emitted tokens (no tokenizer needed: ids are rendered as ``<id>``)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from inference.serving.generation import GenerationState, StepOutput
from inference.serving.sampling import Sampler, SamplingParams
from inference.serving.scheduler import GenerationRequest, Scheduler
from inference.serving.speculative import ProposerFactory


class IdTokens:
    """The little of a tokenizer GenerationState needs."""

    hidden_token_ids: frozenset[int] = frozenset()

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


class CollectingSink:
    """An OutputSink that keeps every item and signals the end."""

    def __init__(self) -> None:
        self.items: list[StepOutput | BaseException] = []
        self.done = threading.Event()

    def put(self, item: StepOutput | BaseException) -> bool:
        self.items.append(item)
        if isinstance(item, BaseException) or item.finished:
            self.done.set()
        return True

    def tokens(self, timeout: float = 300) -> list[int]:
        """Every emitted token id, once the request finished (re-raises its error)."""
        assert self.done.wait(timeout), "request did not finish"
        out: list[int] = []
        for item in self.items:
            if isinstance(item, BaseException):
                raise item
            out.extend(item.token_ids)
        return out


class SchedulerRunner:
    """A started scheduler over ``engine``; :meth:`stop` it (or use it as a context manager)."""

    def __init__(self, engine: Any, *, batch: int = 1, proposer: ProposerFactory | None = None,
                 eos_ids: Sequence[int] = (), **kw: Any) -> None:
        self.engine = engine
        self.eos_ids = tuple(eos_ids)
        self.sched = Scheduler(engine, max_batch_size=batch, max_queued_requests=256, queue_timeout=300,
                               proposer=proposer, **kw)
        self.sched.start()

    def submit(self, prompt: Sequence[int], steps: int, params: SamplingParams | None = None,
               **req: Any) -> CollectingSink:
        sink = CollectingSink()
        state = GenerationState(IdTokens(), prompt_ids=prompt, max_new_tokens=steps,  # type: ignore[arg-type]
                                eos_token_ids=self.eos_ids)
        sampler = Sampler(params or SamplingParams(temperature=0.0), self.engine.info.vocab_size)
        self.sched.submit(GenerationRequest(list(prompt), sampler, state, sink, **req))
        return sink

    def run(self, prompts: Sequence[Sequence[int]], steps: int, params: SamplingParams | None = None,
            **req: Any) -> list[list[int]]:
        """Submit all prompts at once; their tokens in order."""
        sinks = [self.submit(p, steps, params, **req) for p in prompts]
        return [s.tokens() for s in sinks]

    def stop(self) -> None:
        self.sched.stop()

    def __enter__(self) -> SchedulerRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
