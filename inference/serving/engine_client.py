"""The engine client: one loaded model's engine, tokenizer and scheduler behind one entry.

A serving surface converts its request once into a
:class:`~inference.serving.generation_spec.GenerationSpec` (prompt ids, sampling, stop, limits,
constraint, adapter, cache salt, images) and :meth:`EngineClient.generate` runs it: one
:class:`ChoiceRun` per choice, whose outputs the surface writes as its answer. The client knows
no request format (as vLLM's engine client: ``generate(prompt, params)``): below it the scheduler
drives the engine through the ``Engine`` protocol only. It also owns the model's lifecycle as the
model pool drives it: start, admission (ready, draining, unavailable), drain, stop and close.
"""

from __future__ import annotations

import asyncio
import dataclasses
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from inference.images.features import DEFAULT_IMAGE_CACHE_BYTES, ImageFeatureCache
from inference.runtime.protocol import Engine, ImageEngine
from inference.serving.context_cache import PrefixStore
from inference.serving.errors import InvalidRequestError, ServerUnavailableError, serving_error
from inference.serving.generation import GenerationState, StepOutput, TokenLogprob
from inference.serving.generation_spec import GenerationSpec, ModelLimits
from inference.serving.sampling import Sampler
from inference.serving.scheduler import AsyncOutputStream, GenerationRequest, Scheduler, SchedulerObserver
from inference.serving.speculative import ProposerFactory
from inference.serving.structured import (
    GrammarCompiler,
    GrammarLimits,
    StructuredOutputError,
    TokenConstraint,
)
from inference.serving.tokenizer import Tokenizer

__all__ = [
    "ChoiceRun",
    "EngineClient",
    "closing",
    "collect_all",
    "first_outputs",
    "interleave",
]


class ChoiceRun:
    """One submitted choice as seen from the event loop: outputs in order, then closed."""

    def __init__(self, client: EngineClient, req: GenerationRequest, sink: AsyncOutputStream) -> None:
        self._client = client
        self._req = req
        self._sink = sink
        self._closed = False

    async def next(self) -> StepOutput:
        """The next output; raises the serving error that ended the choice."""
        item = await self._sink.get()
        if isinstance(item, BaseException):
            self.close()
            raise serving_error(item)
        if item.finished:
            self.close()
        return item

    def close(self) -> None:
        """Stop listening; the scheduler frees the slot at its next step (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._sink.close()
        self._client.scheduler.cancel(self._req)
        self._client._request_done()


class EngineClient:
    """One loaded model's engine, tokenizer and scheduler: its lifecycle and :meth:`generate`."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        *,
        max_model_len: int,
        max_input_len: int,
        max_batch_size: int,
        max_queued_requests: int = 16,
        queue_timeout: float = 600.0,
        grammar_limits: GrammarLimits | None = None,
        observer: SchedulerObserver | None = None,
        context_cache: PrefixStore | None = None,
        prefill_chunk: int = 256,
        proposer: ProposerFactory | None = None,
        closers: Sequence[Callable[[], None]] = (),
        image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES,
    ) -> None:
        """Build the scheduler (nothing runs until :meth:`start`). ``context_cache`` enables
        context reuse (engines with the KV operations only); ``closers`` close what was loaded
        with the engine (a speculative draft engine); ``image_cache_bytes`` bounds a
        vision-language model's image-feature cache."""
        self.engine = engine
        vision = engine.vision if isinstance(engine, ImageEngine) else None
        #: Image features by image digest (:mod:`inference.images.features`), for a vision model.
        self.image_cache: ImageFeatureCache | None = None if vision is None else ImageFeatureCache(
            image_cache_bytes, listener=getattr(observer, "image_cache_changed", None))
        self.tokenizer = tokenizer
        # Ids the engine can emit but the tokenizer cannot decode (embedding padding) are out.
        vocab_size = min(engine.info.vocab_size, tokenizer.vocab_size)
        self.limits = ModelLimits(max_model_len, max_input_len, vocab_size)
        self.eos_ids = tuple(dict.fromkeys((*tokenizer.eos_token_ids, *engine.info.eos_token_ids)))
        limits = grammar_limits or GrammarLimits()
        self.grammars = GrammarCompiler(tokenizer, vocab_size, self.eos_ids, limits)
        self.scheduler = Scheduler(
            engine,
            max_batch_size=max_batch_size,
            max_queued_requests=max_queued_requests,
            queue_timeout=queue_timeout,
            observer=observer,
            context_cache=context_cache,
            prefill_chunk=prefill_chunk,
            proposer=proposer,
        )
        self._closers = tuple(closers)
        self._started = False
        self._draining = False
        self._stopped = False
        #: Why every new request is refused (503), once the model is marked unavailable.
        self.unavailable: str | None = None
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the scheduler thread."""
        self.scheduler.start()
        self._started = True

    @property
    def ready(self) -> bool:
        """True while requests are admitted."""
        return self._started and not self._draining and not self._stopped and self.unavailable is None

    @property
    def status(self) -> str:
        """``ok`` | ``draining`` | ``stopped`` (also before start) | ``unavailable``."""
        if self.unavailable is not None:
            return "unavailable"
        if self._stopped or not self._started:
            return "stopped"
        return "draining" if self._draining else "ok"

    def mark_unavailable(self, reason: str) -> None:
        """Refuse every new request with 503 ``server_unavailable`` and ``reason`` (e.g. the
        model's bundle failed verification); ``/health`` reports it. Running requests go on."""
        self.unavailable = reason

    def begin_drain(self) -> None:
        """Stop admitting; new requests get 503 ``server_unavailable``."""
        self._draining = True

    async def drain(self, grace_seconds: float) -> bool:
        """Wait up to ``grace_seconds`` for in-flight requests; True when all finished."""
        self.begin_drain()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=max(0.0, grace_seconds))
        except TimeoutError:
            return False
        return True

    def close_engine(self) -> None:
        """Close the engine and what was loaded with it (a speculative draft engine)."""
        try:
            self.engine.close()
        finally:
            for close in self._closers:
                close()

    async def stop(self) -> None:
        """Fail what is left and stop the scheduler thread (the engine itself is not closed).

        Idempotent: the shutdown path and the lifespan may both call it."""
        if self._stopped:
            return
        self._draining = True
        self._stopped = True
        await asyncio.to_thread(self.scheduler.stop)

    @property
    def memory_bytes(self) -> int:
        """What this model may take in memory: its engine's estimate plus the limit of its
        context-reuse record pool and of its image-feature cache (0 when the engine has no
        estimate)."""
        engine = self.engine.info.memory_bytes
        cache = self.scheduler.context_cache_stats()
        images = self.image_cache.max_bytes if engine and self.image_cache is not None else 0
        return (engine + cache.max_bytes if engine and cache is not None else engine) + images

    @property
    def queued(self) -> int:
        """Requests of this model waiting for a slot."""
        return int(self.scheduler.queued)

    def check_admitting(self) -> None:
        """Raise 503 unless requests are admitted now."""
        if self.unavailable is not None:
            raise ServerUnavailableError(self.unavailable)
        if not self._started or self._stopped:
            raise ServerUnavailableError("the model is not loaded; retry shortly")
        if self._draining:
            raise ServerUnavailableError("the server is shutting down and admits no new requests")

    def _request_done(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    # -- generation ----------------------------------------------------------------------------

    async def compile_grammar(self, make: Any, *, param: str = "response_format") -> Any:
        """Run a grammar step off the event loop under the compile deadline; turn its complaint
        into a 400 naming the field.

        A compile past the deadline answers 400 at once; its thread cannot be interrupted and
        finishes in the background (the size limits keep that rare and short)."""
        timeout = self.grammars.limits.compile_timeout
        try:
            return await asyncio.wait_for(asyncio.to_thread(make), timeout)
        except StructuredOutputError as exc:
            raise InvalidRequestError(str(exc), param=exc.param) from None
        except TimeoutError:
            raise InvalidRequestError(
                f"{param}: the constraint took longer than {timeout:g} s to compile; simplify it",
                param=param,
            ) from None

    async def generate(self, *specs: GenerationSpec) -> list[ChoiceRun]:
        """Queue every choice of ``specs`` as one group, all or none (a list of prompts is
        batched by the scheduler); the runs in order, spec-major (``index = spec_i * n + j``).

        Choice ``j`` samples with ``seed + j``; with a ``grammar`` it follows its own matcher
        (compiled here, off the event loop) and never speculates: every token must pass its
        grammar's mask. Choices after a spec's first start from a copy of the first one's prompt
        KV (the scheduler's ``prefix_from``), so each prompt is prefilled once.
        """
        constraints = [await self._constraints(spec) for spec in specs]
        self.check_admitting()
        groups = [self._requests(spec, c) for spec, c in zip(specs, constraints, strict=True)]
        reqs = [req for group in groups for req, _ in group]
        try:
            if len(reqs) == 1:
                self.scheduler.submit(reqs[0])
            else:
                self.scheduler.submit_group(reqs)
        except Exception as exc:
            raise serving_error(exc) from exc
        self._in_flight += len(reqs)
        self._idle.clear()
        return [ChoiceRun(self, greq, sink) for group in groups for greq, sink in group]

    async def _constraints(self, spec: GenerationSpec) -> list[TokenConstraint | None] | None:
        """One matcher of the spec's grammar per choice (each follows its own tokens; its first
        mask starts filling at once); None without a grammar."""
        grammar = spec.grammar
        if grammar is None:
            return None
        return [await self.compile_grammar(lambda: self.grammars.constraint(grammar)) for _ in range(spec.n)]

    def _requests(
        self, spec: GenerationSpec, constraints: Sequence[TokenConstraint | None] | None
    ) -> list[tuple[GenerationRequest, AsyncOutputStream]]:
        """The scheduler requests of one spec's ``n`` choices and their output streams."""
        loop = asyncio.get_running_loop()
        reqs: list[GenerationRequest] = []
        sinks: list[AsyncOutputStream] = []
        for i in range(spec.n):
            state = GenerationState(
                self.tokenizer,
                prompt_ids=spec.prompt_ids,
                max_new_tokens=spec.max_tokens,
                stop=spec.stop,
                stop_token_ids=spec.stop_token_ids,
                eos_token_ids=() if spec.ignore_eos else self.eos_ids,
                want_logprobs=spec.logprobs,
            )
            params = spec.sampling
            if params.seed is not None and i:
                params = dataclasses.replace(params, seed=(params.seed + i) % (1 << 64))
            sink = AsyncOutputStream(loop)
            constraint = constraints[i] if constraints is not None else None
            greq = GenerationRequest(
                spec.prompt_ids,
                Sampler(params, self.limits.vocab_size, constraint, prompt_ids=spec.prompt_ids),
                state,
                sink,
                # Image features change the KV behind the same token ids: never reused, never kept.
                # A prompt whose images set its rotary positions (Qwen2.5-VL's M-RoPE) neither
                # reuses nor leaves KV: the positions of a restored block are not kept with it.
                cache_prompt=spec.cache_prompt and (spec.images is None or spec.images.rope is None),
                prefix_from=reqs[0] if reqs else None,
                speculative=constraint is None,
                cache_salt=spec.cache_salt,
                adapter=spec.adapter,
                images=spec.images,
            )
            reqs.append(greq)
            sinks.append(sink)
        return list(zip(reqs, sinks, strict=True))


# -- reading the runs -------------------------------------------------------------------------


async def first_outputs(runs: Sequence[ChoiceRun]) -> list[StepOutput]:
    """The first output of every choice."""
    # Waiting for the first output before answering lets queue errors (429) and engine
    # failures still become HTTP statuses, also for streamed requests.
    try:
        return list(await asyncio.gather(*(run.next() for run in runs)))
    except BaseException:
        for run in runs:
            run.close()
        raise


async def collect_all(runs: Sequence[ChoiceRun]) -> list[tuple[str, list[TokenLogprob], StepOutput]]:
    """Every choice to its end: (text, logprobs, last output) per choice."""
    try:
        return list(await asyncio.gather(*(_collect(run) for run in runs)))
    finally:
        for run in runs:
            run.close()


async def _collect(run: ChoiceRun) -> tuple[str, list[TokenLogprob], StepOutput]:
    texts: list[str] = []
    lps: list[TokenLogprob] = []
    try:
        while True:
            out = await run.next()
            texts.append(out.text)
            lps.extend(out.logprobs)
            if out.finished:
                return "".join(texts), lps, out
    finally:
        run.close()


def closing(runs: Sequence[ChoiceRun], stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``stream``, with the runs closed when it is dropped (also before its first iteration)."""
    # A stream that is dropped before its first iteration never runs its ``finally``; tie the
    # requests' release to the generator's lifetime as well, so the slots and the in-flight
    # count are freed either way (close() is idempotent).
    for run in runs:
        weakref.finalize(stream, run.close)
    return stream


async def interleave(
    runs: Sequence[ChoiceRun], firsts: Sequence[StepOutput]
) -> AsyncIterator[tuple[int, StepOutput]]:
    """``(choice index, output)`` of every choice as they arrive, starting with ``firsts``.

    Raises the serving error that ended a choice; closes every choice when it ends or is dropped.
    """
    pending: dict[asyncio.Future[StepOutput], int] = {}
    try:
        for i, out in enumerate(firsts):
            yield i, out
            if not out.finished:
                pending[asyncio.ensure_future(runs[i].next())] = i
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                i = pending.pop(task)
                out = task.result()
                yield i, out
                if not out.finished:
                    pending[asyncio.ensure_future(runs[i].next())] = i
    finally:
        for task in pending:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: the error that ended the stream is already raised
            task.cancel()
        for run in runs:
            run.close()
