"""The per-model handle: one loaded model's engine, tokenizer, scheduler, parsers and lifecycle.

:class:`ModelHandle` owns what every endpoint of one model shares: the scheduler thread that
drives the engine (through the ``Engine`` protocol only), the reasoning and tool-call parsers,
admission (ready, draining, unavailable), the checks that need the model (prompt length,
vocabulary, grammars) and submission. The model pool (:mod:`inference.model_pool`) holds one
handle per loaded model; the endpoints (``completions``, ``chat`` and the surfaces built on
chat) lease a handle from the pool for each request and call it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import weakref
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from inference.context_cache import PrefixStore
from inference.families import auto_parsers
from inference.generation import GenerationState, StepOutput, TokenLogprob
from inference.image_features import DEFAULT_IMAGE_CACHE_BYTES, ImageFeatureCache, PromptImages
from inference.media import MediaPolicy
from inference.openai.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    ServerUnavailableError,
    to_openai_error,
)
from inference.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    PromptTokensDetails,
    ResponseFormat,
    Usage,
)
from inference.openai.reasoning import ReasoningParser, get_reasoning_parser
from inference.openai.tool_parsers import ToolParser, get_tool_parser
from inference.runtime.protocol import Embedder, Engine, ImageEngine, VisionModel
from inference.sampling import Sampler, SamplingParams
from inference.scheduler import AsyncOutputStream, GenerationRequest, Scheduler, SchedulerObserver
from inference.speculative import ProposerFactory
from inference.structured import GrammarCompiler, GrammarLimits, StructuredOutputError, TokenConstraint
from inference.tokenizer import Tokenizer

__all__ = ["AUTO_PARSERS", "ModelHandle", "ServingObserver", "ServingOptions", "resolve_parsers"]

# Metrics hooks: the scheduler calls them from its thread.
ServingObserver = SchedulerObserver

#: Most prompts one ``/v1/completions`` request may list (OpenAI's own limit is 2048 for
#: embeddings-style batches; a generating server holds every choice of every prompt at once,
#: and the scheduler's slots and queue bound that further).
MAX_PROMPTS = 64
#: Most prompt tokens one ``/v1/completions`` request may list over all its prompts (each one
#: is also bounded by the model's ``max_input_len``): tokenizing and holding them is work done
#: before anything is admitted.
MAX_PROMPT_LIST_TOKENS = 65536
#: Safety factor on the cheap "too long to tokenize" bound (normalizers may fold characters).
CHARS_MARGIN = 2
DONE = "[DONE]"

# ``auto`` parser choice by config.json ``model_type``: (reasoning parser, tool-call parser),
# as each model family declares it (:mod:`inference.families`). Anything else: no parsing unless
# named.
AUTO_PARSERS: dict[str, tuple[str, str]] = auto_parsers()


def resolve_parsers(model_type: str, reasoning: str, tool_call: str) -> tuple[str, str]:
    """Turn ``auto`` into concrete parser names for ``model_type`` (see :data:`AUTO_PARSERS`)."""
    auto = AUTO_PARSERS.get(model_type.lower(), ("none", "none"))
    return (auto[0] if reasoning == "auto" else reasoning, auto[1] if tool_call == "auto" else tool_call)


@dataclass(frozen=True)
class ServingOptions:
    """What one model promises: its name, limits and parsers (auth is the router's)."""

    served_model_name: str
    max_model_len: int
    max_input_len: int
    max_batch_size: int
    max_queued_requests: int = 16
    queue_timeout: float = 600.0
    reasoning_parser: str = "auto"
    tool_call_parser: str = "auto"
    enable_auto_tool_choice: bool = False
    model_type: str = ""
    capabilities: Mapping[str, object] = field(default_factory=dict)
    #: What one request's structured-output constraint may cost (schema size, compile time).
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)
    #: Where image parts may come from besides data: URLs (local files, fetched hosts).
    media: MediaPolicy = field(default_factory=MediaPolicy)
    #: Bytes of image features a vision-language model keeps by image digest (0: none).
    image_cache_bytes: int = DEFAULT_IMAGE_CACHE_BYTES

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must not be empty")
        for name in ("max_model_len", "max_input_len", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be 0 or more")
        if self.queue_timeout <= 0:
            raise ValueError("queue_timeout must be positive")


def to_json(value: msgspec.Struct | dict[str, Any]) -> str:
    return msgspec.json.encode(value).decode("utf-8")


# -- request checks -----------------------------------------------------------------------------


def _schema_object(value: object, param: str) -> object:
    """A JSON Schema given as an object or (vLLM's ``guided_json``) as JSON text."""
    if isinstance(value, str):
        try:
            return msgspec.json.decode(value)
        except msgspec.DecodeError:
            message = f"{param} is neither a JSON Schema object nor its JSON text"
            raise StructuredOutputError(message, param) from None
    return value


@dataclass(frozen=True)
class Plan:
    """A validated request, ready for the scheduler."""

    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams
    max_new_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    want_logprobs: bool
    stream: bool
    include_usage: bool
    cache_prompt: bool = True
    #: vLLM's ``cache_salt``: seeds the context cache's hash chain (None: unsalted).
    cache_salt: str | None = None
    n: int = 1
    #: vLLM's ``ignore_eos``: end-of-sequence tokens do not end the choice.
    ignore_eos: bool = False
    #: The LoRA adapter the request's model name runs (None: the base weights).
    adapter: str | None = None
    #: A vision-language prompt's images (their digests key its KV; features as needed).
    images: PromptImages | None = None


class ChoiceRun:
    """One submitted request as seen from the event loop: outputs in order, then closed."""

    def __init__(self, handle: ModelHandle, req: GenerationRequest, sink: AsyncOutputStream) -> None:
        self._handle = handle
        self._req = req
        self._sink = sink
        self._closed = False

    async def next(self) -> StepOutput:
        """The next output; raises the OpenAI error that ended the request."""
        item = await self._sink.get()
        if isinstance(item, BaseException):
            self.close()
            raise to_openai_error(item)
        if item.finished:
            self.close()
        return item

    def close(self) -> None:
        """Stop listening; the scheduler frees the slot at its next step (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._sink.close()
        self._handle.scheduler.cancel(self._req)
        self._handle._request_done()


class ModelHandle:
    """One loaded model: engine, tokenizer, scheduler, parsers, admission and lifecycle."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        options: ServingOptions,
        *,
        observer: ServingObserver | None = None,
        context_cache: PrefixStore | None = None,
        prefill_chunk: int = 256,
        proposer: ProposerFactory | None = None,
        closers: Sequence[Callable[[], None]] = (),
    ) -> None:
        """Build the scheduler; raise ValueError for an unknown or unsupported parser name.

        ``context_cache`` enables context reuse (engines with the KV operations only).
        """
        self.engine = engine
        self.tokenizer = tokenizer
        self.options = options
        #: The engine's embedding side when the bundle is an embedding model (``/v1/embeddings``),
        #: else None; an embedding model answers no generation request.
        self.embedder: Embedder | None = engine if isinstance(engine, Embedder) else None
        #: The bundle's vision side (image parts accepted) or None (a text-only model).
        self.vision: VisionModel | None = engine.vision if isinstance(engine, ImageEngine) else None
        #: Image features by image digest (:mod:`inference.image_features`), for a vision model.
        self.image_cache: ImageFeatureCache | None = None if self.vision is None else ImageFeatureCache(
            options.image_cache_bytes, listener=getattr(observer, "image_cache_changed", None))
        #: Served names that run this model with a LoRA adapter loaded in its engine: name ->
        #: the engine's adapter name (``--lora-modules``; see :meth:`add_lora`).
        self.lora_names: dict[str, str] = {}
        reasoning_name, tool_name = resolve_parsers(
            options.model_type or engine.info.model_type, options.reasoning_parser, options.tool_call_parser
        )
        self.reasoning_parser_name = reasoning_name
        self.tool_call_parser_name = tool_name
        self.reasoning: ReasoningParser | None = get_reasoning_parser(reasoning_name)
        self.tool_parser: ToolParser | None = get_tool_parser(tool_name)
        # Ids the engine can emit but the tokenizer cannot decode (embedding padding) are out.
        self.vocab_size = min(engine.info.vocab_size, tokenizer.vocab_size)
        self._eos_ids = tuple(dict.fromkeys((*tokenizer.eos_token_ids, *engine.info.eos_token_ids)))
        self.grammars = GrammarCompiler(tokenizer, self.vocab_size, self._eos_ids, options.grammar_limits)
        self.scheduler = Scheduler(
            engine,
            max_batch_size=options.max_batch_size,
            max_queued_requests=options.max_queued_requests,
            queue_timeout=options.queue_timeout,
            observer=observer,
            context_cache=context_cache,
            prefill_chunk=prefill_chunk,
            proposer=proposer,
        )
        self._closers = tuple(closers)
        self._started = False
        self._draining = False
        self._stopped = False
        self._unavailable: str | None = None
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
        return self._started and not self._draining and not self._stopped and self._unavailable is None

    def mark_unavailable(self, reason: str) -> None:
        """Refuse every new request with 503 ``server_unavailable`` and ``reason`` (e.g. the
        model's bundle failed verification); ``/health`` reports it. Running requests go on."""
        self._unavailable = reason

    def begin_drain(self) -> None:
        """Stop admitting; new ``/v1`` requests get 503 ``server_unavailable``."""
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

    def health(self) -> dict[str, Any]:
        """Status for ``/health``: ok | draining | stopped (stopped also before start)."""
        if self._unavailable is not None:
            status = "unavailable"
        elif self._stopped or not self._started:
            status = "stopped"
        elif self._draining:
            status = "draining"
        else:
            status = "ok"
        caps: dict[str, Any] = {
            "chat": self.tokenizer.has_chat_template,
            "completions": True,
            "streaming": True,
            "reasoning_parser": self.reasoning_parser_name,
            "tool_call_parser": self.tool_call_parser_name,
            "auto_tool_choice": self.options.enable_auto_tool_choice,
            "max_model_len": self.options.max_model_len,
            "max_batch_size": self.scheduler.max_batch_size,
            "context_reuse": self.scheduler.context_reuse,
            "images": self.vision is not None,
        }
        caps.update(self.options.capabilities)
        extra = {"reason": self._unavailable} if self._unavailable is not None else {}
        health: dict[str, Any] = {
            **extra,
            "status": status,
            "model": self.options.served_model_name,
            "active_requests": self.scheduler.active,
            "queued_requests": self.scheduler.queued,
            "capabilities": caps,
        }
        cache = self.scheduler.context_cache_stats()
        if cache is not None:
            health["context_cache"] = cache.as_dict()
        if self.image_cache is not None:
            health["image_cache"] = self.image_cache.stats().as_dict()
        return health

    @property
    def memory_bytes(self) -> int:
        """What this model may take in memory: its engine's estimate plus the limit of its
        context-reuse record pool and of its image-feature cache (0 when the engine has no estimate)."""
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
        if self._unavailable is not None:
            raise ServerUnavailableError(self._unavailable)
        if not self._started or self._stopped:
            raise ServerUnavailableError("the model is not loaded; retry shortly")
        if self._draining:
            raise ServerUnavailableError("the server is shutting down and admits no new requests")

    def _request_done(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0:
            self._idle.set()

    # -- shared request handling ---------------------------------------------------------------

    def plan(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        *,
        prompt_ids: list[int],
        prompt_text: str,
        prompt_param: str,
        max_tokens: int | None,
        max_tokens_param: str,
        top_logprobs: int | None,
    ) -> Plan:
        opts = self.options
        if self.embedder is not None:
            raise InvalidRequestError(
                f"model {opts.served_model_name!r} is an embedding model: it computes vectors, not text; "
                "send its inputs to POST /v1/embeddings", param="model")
        params = req.to_sampling(self.vocab_size, top_logprobs)
        stop = req.stop_strings()
        stop_ids = tuple(req.stop_token_ids or ())
        for i, t in enumerate(stop_ids):
            if not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    f"stop token id {t} is outside the vocabulary", param=f"stop_token_ids[{i}]"
                )
        n = len(prompt_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", param=prompt_param)
        if n > opts.max_input_len:
            raise ContextLengthExceededError(
                f"the prompt has {n} tokens; this model accepts at most {opts.max_input_len} input tokens",
                param=prompt_param,
            )
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequestError(f"{max_tokens_param} must be at least 1", param=max_tokens_param)
        room = opts.max_model_len - n
        if room < 1:
            raise ContextLengthExceededError(
                f"the prompt has {n} tokens, leaving no room to generate within the "
                f"maximum context length of {opts.max_model_len} tokens",
                param=prompt_param,
            )
        if max_tokens is not None and max_tokens > room:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {opts.max_model_len} tokens; the prompt has {n} "
                f"and {max_tokens_param}={max_tokens} asks for more than the {room} left; "
                f"lower {max_tokens_param} or shorten the prompt",
                param=max_tokens_param,
            )
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        if req.stream_options is not None and not req.stream:
            raise InvalidRequestError(
                "stream_options is only allowed with stream=true", param="stream_options"
            )
        return Plan(
            prompt_ids=prompt_ids,
            prompt_text=prompt_text,
            params=params,
            max_new_tokens=room if max_tokens is None else max_tokens,
            stop=stop,
            stop_token_ids=stop_ids,
            want_logprobs=top_logprobs is not None,
            stream=req.stream,
            include_usage=include_usage,
            cache_prompt=req.cache_prompt,
            cache_salt=req.checked_cache_salt(),
            n=req.n,
            ignore_eos=req.ignore_eos,
            adapter=self.lora_names.get(req.model),
        )

    async def response_format_grammar(self, fmt: ResponseFormat | None) -> str | None:
        """The grammar ``response_format`` asks for (None for plain text); 400 when it is bad."""
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return await self.compile_grammar(self.grammars.json_object_grammar)
        if fmt.type != "json_schema":
            raise InvalidRequestError(
                f"response_format.type must be 'text', 'json_object' or 'json_schema'; got {fmt.type!r}",
                param="response_format.type",
            )
        spec = fmt.json_schema
        if spec is None or spec.schema is None:
            raise InvalidRequestError(
                "response_format of type 'json_schema' needs json_schema.schema",
                param="response_format.json_schema" + (".schema" if spec is not None else ""),
            )
        schema = spec.schema
        where = "response_format.json_schema.schema"
        return await self.compile_grammar(
            lambda: self.grammars.json_schema_grammar(schema, param=where), param=where
        )

    async def guided_grammar(
        self, req: CompletionRequest | ChatCompletionRequest, taken: str | None
    ) -> str | None:
        """The grammar of the extension constraint the request names (vLLM's ``guided_*`` and
        ``structured_outputs``, llama-server's ``grammar`` and ``json_schema``), None without one.

        ``taken``: the field that already constrains the output (``response_format``, a forcing
        ``tool_choice``); one request takes one constraint, so a second is a 400 naming it.
        """
        g = self.grammars
        asked: list[tuple[str, Callable[[], str]]] = []

        def schema(param: str, value: object) -> None:
            asked.append((param, lambda: g.json_schema_grammar(_schema_object(value, param), param=param)))

        def regex(param: str, value: object) -> None:
            asked.append((param, lambda: g.regex_grammar(value, param=param)))

        def choice(param: str, value: object) -> None:
            asked.append((param, lambda: g.choice_grammar(value, param=param)))

        def lark(param: str, value: object) -> None:
            asked.append((param, lambda: g.lark_grammar(value, param=param)))

        for name, value, add in (
            ("guided_json", req.guided_json, schema),
            ("guided_regex", req.guided_regex, regex),
            ("guided_choice", req.guided_choice, choice),
            ("guided_grammar", req.guided_grammar, lark),
            ("grammar", req.grammar, lark),
            ("json_schema", req.json_schema, schema),
        ):
            if value is not None:
                add(name, value)
        so = req.structured_outputs
        if so is not None:
            for name, value, add in (
                ("json", so.json, schema),
                ("regex", so.regex, regex),
                ("choice", so.choice, choice),
                ("grammar", so.grammar, lark),
            ):
                if value is not None:
                    add(f"structured_outputs.{name}", value)
            if so.json_object:
                asked.append(("structured_outputs.json_object", g.json_object_grammar))
        if not asked:
            return None
        first = asked[0][0]
        if taken is not None or len(asked) > 1:
            other, param = (taken, first) if taken is not None else (first, asked[1][0])
            raise InvalidRequestError(
                f"{param} cannot be combined with {other}: a request takes one output constraint",
                param=param,
            )
        grammar: str = await self.compile_grammar(asked[0][1], param=first)
        return grammar

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

    async def _constraint(self, grammar: str | None) -> TokenConstraint | None:
        """A request's own matcher for ``grammar`` (its first mask starts filling at once)."""
        if grammar is None:
            return None
        constraint: TokenConstraint = await self.compile_grammar(lambda: self.grammars.constraint(grammar))
        return constraint

    async def constraints(self, grammar: str | None, n: int) -> list[TokenConstraint | None] | None:
        """One matcher of ``grammar`` per choice (each follows its own tokens); None without one."""
        if grammar is None:
            return None
        return [await self._constraint(grammar) for _ in range(n)]

    def submit(
        self, plan: Plan, constraints: Sequence[TokenConstraint | None] | None = None
    ) -> list[ChoiceRun]:
        """Queue the plan's ``n`` choices (all or none); choice ``i`` samples with ``seed + i``
        and, with ``constraints``, follows ``constraints[i]`` (then it never speculates: every
        token must pass its grammar's mask).

        Choices after the first start from a copy of the first one's prompt KV (the scheduler's
        ``prefix_from``), so the prompt is prefilled once.
        """
        return self.submit_many([(plan, constraints)])[0]

    def submit_many(
        self, plans: Sequence[tuple[Plan, Sequence[TokenConstraint | None] | None]]
    ) -> list[list[ChoiceRun]]:
        """Queue the choices of several plans (a list of prompts) as one group, all or none, so
        the scheduler batches them; the runs of each plan, in order (see :meth:`_submit`)."""
        self.check_admitting()
        groups = [self._requests(plan, constraints) for plan, constraints in plans]
        reqs = [req for group in groups for req, _ in group]
        try:
            if len(reqs) == 1:
                self.scheduler.submit(reqs[0])
            else:
                self.scheduler.submit_group(reqs)
        except Exception as exc:
            raise to_openai_error(exc) from exc
        self._in_flight += len(reqs)
        self._idle.clear()
        return [[ChoiceRun(self, greq, sink) for greq, sink in group] for group in groups]

    def _requests(
        self, plan: Plan, constraints: Sequence[TokenConstraint | None] | None
    ) -> list[tuple[GenerationRequest, AsyncOutputStream]]:
        """The scheduler requests of one plan's ``n`` choices and their output streams."""
        loop = asyncio.get_running_loop()
        reqs: list[GenerationRequest] = []
        sinks: list[AsyncOutputStream] = []
        for i in range(plan.n):
            state = GenerationState(
                self.tokenizer,
                prompt_ids=plan.prompt_ids,
                max_new_tokens=plan.max_new_tokens,
                stop=plan.stop,
                stop_token_ids=plan.stop_token_ids,
                eos_token_ids=() if plan.ignore_eos else self._eos_ids,
                want_logprobs=plan.want_logprobs,
            )
            params = plan.params
            if params.seed is not None and i:
                params = dataclasses.replace(params, seed=(params.seed + i) % (1 << 64))
            sink = AsyncOutputStream(loop)
            constraint = constraints[i] if constraints is not None else None
            greq = GenerationRequest(
                plan.prompt_ids,
                Sampler(params, self.vocab_size, constraint, prompt_ids=plan.prompt_ids),
                state,
                sink,
                cache_prompt=plan.cache_prompt,
                prefix_from=reqs[0] if reqs else None,
                speculative=constraint is None,
                cache_salt=plan.cache_salt,
                adapter=plan.adapter,
                images=plan.images,
            )
            reqs.append(greq)
            sinks.append(sink)
        return list(zip(reqs, sinks, strict=True))

    async def first_outputs(self, runs: Sequence[ChoiceRun]) -> list[StepOutput]:
        """The first output of every choice."""
        # Waiting for the first output before answering lets queue errors (429) and engine
        # failures still become HTTP statuses, also for streamed requests.
        try:
            return list(await asyncio.gather(*(run.next() for run in runs)))
        except BaseException:
            for run in runs:
                run.close()
            raise

    async def collect_all(
        self, runs: Sequence[ChoiceRun]
    ) -> list[tuple[str, list[TokenLogprob], StepOutput]]:
        """Every choice to its end: (text, logprobs, last output) per choice."""
        try:
            return list(await asyncio.gather(*(self._collect(run) for run in runs)))
        finally:
            for run in runs:
                run.close()

    async def _collect(self, run: ChoiceRun) -> tuple[str, list[TokenLogprob], StepOutput]:
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

    # -- prompt checks shared by the endpoints ---------------------------------------------------

    def check_text_length(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, text that cannot fit ``max_input_len`` tokens.

        Tokenizing takes time proportional to the text; a prompt of many megabytes must be
        refused at the cost of a ``len``, not after seconds of work.
        """
        limit = self.options.max_input_len * self.tokenizer.max_token_chars * CHARS_MARGIN
        if chars > limit:
            raise ContextLengthExceededError(
                f"the prompt has {chars} characters, more than this model's {self.options.max_input_len} "
                f"input tokens can hold (at most {limit} characters); shorten it",
                param=param,
            )

    async def encode(self, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
        """Length check, then tokenize in a worker thread (the event loop keeps serving)."""
        self.check_text_length(len(text), param)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)


def closing(runs: Sequence[ChoiceRun], stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
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

    Raises the OpenAI error that ended a choice; closes every choice when it ends or is dropped.
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


def usage_of(*outs: StepOutput, n: int | None = None) -> Usage:
    """Usage of a request's choices: each prompt counted once, the completions summed.

    ``outs`` are the choices in order; with ``n``, every ``n`` of them share one prompt (a
    list of prompts, prompt-major), else all of them do."""
    per = n or len(outs)
    prompt = sum(out.prompt_tokens for out in outs[::per])
    cached = sum(out.cached_tokens for out in outs[::per])
    completion = sum(out.completion_tokens for out in outs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))
