"""OpenAI request -> engine -> response or SSE chunks. Talks only to the ``Engine`` protocol.

:class:`OpenAIServing` validates a request (every error names its field), renders the prompt,
hands a :class:`~inference.scheduler.GenerationRequest` to the scheduler thread and turns the
outputs it gets back into OpenAI responses. Streams are async iterators of JSON strings (one
per SSE ``data:`` line) ending in ``[DONE]``; the routes wrap them in Litestar's SSE response.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from inference.context_cache import PrefixStore
from inference.generation import GenerationState, StepOutput, TokenLogprob
from inference.openai.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    OpenAIError,
    ServerUnavailableError,
    error_body,
    to_openai_error,
)
from inference.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ModelCard,
    ModelList,
    ResponseMessage,
    ToolCall,
    TopLogprobEntry,
    Usage,
)
from inference.openai.reasoning import ReasoningParser, get_reasoning_parser
from inference.openai.tool_parsers import ToolCallEvent, ToolParser, get_tool_parser
from inference.runtime.protocol import Engine
from inference.sampling import Sampler, SamplingParams
from inference.scheduler import AsyncOutputStream, GenerationRequest, Scheduler, SchedulerObserver
from inference.tokenizer import Tokenizer

__all__ = ["AUTO_PARSERS", "OpenAIServing", "ServingObserver", "ServingOptions", "resolve_parsers"]

# Metrics hooks: the scheduler calls them from its thread.
ServingObserver = SchedulerObserver

MAX_TOP_LOGPROBS = 20
#: Safety factor on the cheap "too long to tokenize" bound (normalizers may fold characters).
_CHARS_MARGIN = 2
#: ``apply_chat_template`` arguments a client may not override through ``chat_template_kwargs``.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "self"})
_DONE = "[DONE]"

# ``auto`` parser choice by config.json ``model_type``: (reasoning parser, tool-call parser).
# Qwen2/2.5 and Qwen3 write hermes-style <tool_call>{json}</tool_call>; Qwen3 thinks in
# <think>; DeepSeek-R1 distills (llama/qwen2 bodies aside) think without an opening tag;
# Llama 3.x and Mistral emit a bare JSON call. Anything else: no parsing unless named.
AUTO_PARSERS: dict[str, tuple[str, str]] = {
    "qwen3": ("qwen3", "hermes"),
    "qwen3_moe": ("qwen3", "hermes"),
    "qwen2": ("none", "hermes"),
    "qwen2_moe": ("none", "hermes"),
    "deepseek_v2": ("deepseek_r1", "none"),
    "deepseek_v3": ("deepseek_r1", "none"),
    "llama": ("none", "generic"),
    "mistral": ("none", "generic"),
}


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
    #: False when a pool resolved the request's name already (aliases answer as themselves).
    check_model_name: bool = True
    model_type: str = ""
    capabilities: Mapping[str, object] = field(default_factory=dict)

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


def _json(value: msgspec.Struct | dict[str, Any]) -> str:
    return msgspec.json.encode(value).decode("utf-8")


# -- request checks -----------------------------------------------------------------------------


def _check_range(value: float | None, param: str, lo: float, hi: float) -> None:
    if value is not None and not lo <= value <= hi:
        raise InvalidRequestError(f"{param} must be between {lo:g} and {hi:g}; got {value:g}", param=param)


def _stop_list(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else list(stop)
    for i, s in enumerate(items):
        if not s:
            raise InvalidRequestError("stop strings must not be empty", param=f"stop[{i}]")
    return tuple(items)


@dataclass(frozen=True)
class _Plan:
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


class _Run:
    """One submitted request as seen from the event loop: outputs in order, then closed."""

    def __init__(self, serving: OpenAIServing, req: GenerationRequest, sink: AsyncOutputStream) -> None:
        self._serving = serving
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
        self._serving._scheduler.cancel(self._req)
        self._serving._request_done()


class OpenAIServing:
    """The OpenAI endpoints' logic for one engine and tokenizer."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Tokenizer,
        options: ServingOptions,
        *,
        observer: ServingObserver | None = None,
        context_cache: PrefixStore | None = None,
        prefill_chunk: int = 256,
    ) -> None:
        """Build the scheduler; raise ValueError for an unknown or unsupported parser name.

        ``context_cache`` enables context reuse (engines with the KV operations only).
        """
        self.engine = engine
        self.tokenizer = tokenizer
        self.options = options
        reasoning_name, tool_name = resolve_parsers(
            options.model_type or engine.info.model_type, options.reasoning_parser, options.tool_call_parser
        )
        self.reasoning_parser_name = reasoning_name
        self.tool_call_parser_name = tool_name
        self._reasoning: ReasoningParser | None = get_reasoning_parser(reasoning_name)
        self._tools: ToolParser | None = get_tool_parser(tool_name)
        # Ids the engine can emit but the tokenizer cannot decode (embedding padding) are out.
        self._vocab_size = min(engine.info.vocab_size, tokenizer.vocab_size)
        self._eos_ids = tuple(dict.fromkeys((*tokenizer.eos_token_ids, *engine.info.eos_token_ids)))
        self._scheduler = Scheduler(
            engine,
            max_batch_size=options.max_batch_size,
            max_queued_requests=options.max_queued_requests,
            queue_timeout=options.queue_timeout,
            observer=observer,
            context_cache=context_cache,
            prefill_chunk=prefill_chunk,
        )
        self._created = int(time.time())
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
        self._scheduler.start()
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

    async def stop(self) -> None:
        """Fail what is left and stop the scheduler thread (the engine itself is not closed).

        Idempotent: the shutdown path and the lifespan may both call it."""
        if self._stopped:
            return
        self._draining = True
        self._stopped = True
        await asyncio.to_thread(self._scheduler.stop)

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
            "max_batch_size": self._scheduler.max_batch_size,
            "context_reuse": self._scheduler.context_reuse,
        }
        caps.update(self.options.capabilities)
        extra = {"reason": self._unavailable} if self._unavailable is not None else {}
        health: dict[str, Any] = {
            **extra,
            "status": status,
            "model": self.options.served_model_name,
            "active_requests": self._scheduler.active,
            "queued_requests": self._scheduler.queued,
            "capabilities": caps,
        }
        cache = self._scheduler.context_cache_stats()
        if cache is not None:
            health["context_cache"] = cache.as_dict()
        return health

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

    # -- models --------------------------------------------------------------------------------

    def list_models(self) -> ModelList:
        """``GET /v1/models``."""
        self.check_admitting()
        name = self.options.served_model_name
        card = ModelCard(
            id=name,
            created=self._created,
            owned_by="cachesvc",
            max_model_len=self.options.max_model_len,
            root=name,
        )
        return ModelList(data=[card])

    def _check_model(self, model: str) -> None:
        if self.options.check_model_name and model != self.options.served_model_name:
            raise ModelNotFoundError(
                f"the model {model!r} does not exist; this server serves {self.options.served_model_name!r}",
                param="model",
            )

    # -- shared request handling ---------------------------------------------------------------

    def _sampling(
        self, req: CompletionRequest | ChatCompletionRequest, top_logprobs: int | None
    ) -> SamplingParams:
        if req.n != 1:
            raise InvalidRequestError(f"only n=1 is supported; got n={req.n}", param="n")
        _check_range(req.temperature, "temperature", 0.0, 2.0)
        _check_range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        _check_range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
        if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1]; got {req.top_p:g}", param="top_p")
        if req.top_k is not None and req.top_k < -1:
            raise InvalidRequestError("top_k must be -1 or 0 (off) or a positive count", param="top_k")
        bias: dict[int, float] = {}
        for key, value in (req.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids; got {key!r}", param="logit_bias"
                ) from None
            if not 0 <= token < self._vocab_size:
                raise InvalidRequestError(
                    f"logit_bias token {token} is outside the vocabulary (0..{self._vocab_size - 1})",
                    param="logit_bias",
                )
            _check_range(value, "logit_bias", -100.0, 100.0)
            bias[token] = float(value)
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=req.top_k or 0,
            seed=None if req.seed is None else req.seed % (1 << 64),
            frequency_penalty=req.frequency_penalty,
            presence_penalty=req.presence_penalty,
            logit_bias=bias,
            top_logprobs=top_logprobs,
        )

    def _plan(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        *,
        prompt_ids: list[int],
        prompt_text: str,
        prompt_param: str,
        max_tokens: int | None,
        max_tokens_param: str,
        top_logprobs: int | None,
    ) -> _Plan:
        opts = self.options
        params = self._sampling(req, top_logprobs)
        stop = _stop_list(req.stop)
        stop_ids = tuple(req.stop_token_ids or ())
        for i, t in enumerate(stop_ids):
            if not 0 <= t < self._vocab_size:
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
        return _Plan(
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
        )

    def _submit(self, plan: _Plan) -> _Run:
        self.check_admitting()
        state = GenerationState(
            self.tokenizer,
            prompt_ids=plan.prompt_ids,
            max_new_tokens=plan.max_new_tokens,
            stop=plan.stop,
            stop_token_ids=plan.stop_token_ids,
            eos_token_ids=self._eos_ids,
            want_logprobs=plan.want_logprobs,
        )
        sink = AsyncOutputStream(asyncio.get_running_loop())
        sampler = Sampler(plan.params, self._vocab_size)
        greq = GenerationRequest(plan.prompt_ids, sampler, state, sink, cache_prompt=plan.cache_prompt)
        try:
            self._scheduler.submit(greq)
        except Exception as exc:
            raise to_openai_error(exc) from exc
        self._in_flight += 1
        self._idle.clear()
        return _Run(self, greq, sink)

    async def _first(self, run: _Run) -> StepOutput:
        # Waiting for the first output before answering lets queue errors (429) and engine
        # failures still become HTTP statuses, also for streamed requests.
        try:
            return await run.next()
        except BaseException:
            run.close()
            raise

    async def _collect(self, run: _Run) -> tuple[str, list[TokenLogprob], StepOutput]:
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

    # -- /v1/completions -----------------------------------------------------------------------

    def _check_text_length(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing, text that cannot fit ``max_input_len`` tokens.

        Tokenizing takes time proportional to the text; a prompt of many megabytes must be
        refused at the cost of a ``len``, not after seconds of work.
        """
        limit = self.options.max_input_len * self.tokenizer.max_token_chars * _CHARS_MARGIN
        if chars > limit:
            raise ContextLengthExceededError(
                f"the prompt has {chars} characters, more than this model's {self.options.max_input_len} "
                f"input tokens can hold (at most {limit} characters); shorten it",
                param=param,
            )

    async def _encode(self, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
        """Length check, then tokenize in a worker thread (the event loop keeps serving)."""
        self._check_text_length(len(text), param)
        return await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=add_special_tokens)

    async def _completion_prompt(self, req: CompletionRequest) -> tuple[list[int], str]:
        prompt = req.prompt
        if isinstance(prompt, str):
            return await self._encode(prompt, add_special_tokens=True, param="prompt"), prompt
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return await self._encode(prompt[0], add_special_tokens=True, param="prompt"), prompt[0]
        if len(prompt) > self.options.max_input_len or (
            len(prompt) == 1 and isinstance(prompt[0], list) and len(prompt[0]) > self.options.max_input_len
        ):
            n = len(prompt) if len(prompt) > 1 else len(prompt[0])  # type: ignore[arg-type]
            raise ContextLengthExceededError(
                f"the prompt has {n} tokens; this model accepts at most {self.options.max_input_len} "
                "input tokens",
                param="prompt",
            )
        if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = [int(t) for t in prompt]  # type: ignore[arg-type]
        elif len(prompt) == 1 and isinstance(prompt[0], list):
            ids = list(prompt[0])
        else:
            raise InvalidRequestError(
                "prompt must be a string, a list with exactly one string, or a list of token ids "
                "(batched prompts are not supported)",
                param="prompt",
            )
        for t in ids:
            if not 0 <= t < self._vocab_size:
                raise InvalidRequestError(f"prompt token id {t} is outside the vocabulary", param="prompt")
        return ids, await asyncio.to_thread(self.tokenizer.decode, ids)

    async def create_completion(self, req: CompletionRequest) -> CompletionResponse | AsyncIterator[str]:
        """``POST /v1/completions``: a response, or an iterator of SSE data strings."""
        self.check_admitting()
        self._check_model(req.model)
        if req.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        if req.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if req.best_of not in (None, 1):
            raise InvalidRequestError("only best_of=1 is supported", param="best_of")
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="logprobs")
        ids, text = await self._completion_prompt(req)
        plan = self._plan(
            req,
            prompt_ids=ids,
            prompt_text=text,
            prompt_param="prompt",
            max_tokens=req.max_tokens,
            max_tokens_param="max_tokens",
            top_logprobs=req.logprobs,
        )
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        run = self._submit(plan)
        if plan.stream:
            first = await self._first(run)
            return _closing(run, self._completion_stream(run, first, plan, rid, created, req.model))
        text_out, lps, last = await self._collect(run)
        choice = CompletionChoice(
            index=0,
            text=text_out,
            finish_reason=last.finish_reason,
            logprobs=_completion_logprobs(lps, 0) if plan.want_logprobs else None,
        )
        return CompletionResponse(
            id=rid, created=created, model=req.model, choices=[choice], usage=_usage(last)
        )

    async def _completion_stream(
        self, run: _Run, first: StepOutput, plan: _Plan, rid: str, created: int, model: str
    ) -> AsyncIterator[str]:
        offset = 0
        try:
            out = first
            while True:
                if out.text or out.logprobs or out.finished:
                    lps = _completion_logprobs(out.logprobs, offset) if plan.want_logprobs else None
                    offset += sum(len(lp.token) for lp in out.logprobs)
                    choice = CompletionStreamChoice(
                        index=0, text=out.text, finish_reason=out.finish_reason, logprobs=lps
                    )
                    yield _json(
                        CompletionStreamResponse(id=rid, created=created, model=model, choices=[choice])
                    )
                if out.finished:
                    break
                out = await run.next()
            if plan.include_usage:
                usage = CompletionStreamResponse(
                    id=rid, created=created, model=model, choices=[], usage=_usage(out)
                )
                yield _json(usage)
        except OpenAIError as exc:
            yield _json(error_body(exc))
        finally:
            run.close()
        yield _DONE

    # -- /v1/chat/completions ------------------------------------------------------------------

    def _check_chat_size(self, messages: Sequence[ChatMessage]) -> None:
        """Refuse, before any template work, a conversation that cannot fit the input limit.

        Every chat template renders at least one token (a role marker) per message, and the
        text of the messages at most ``max_token_chars`` characters per token.
        """
        limit = self.options.max_input_len
        if len(messages) > limit:
            raise ContextLengthExceededError(
                f"the conversation has {len(messages)} messages; this model accepts at most {limit} "
                "input tokens (each message takes at least one)",
                param="messages",
            )
        chars = 0
        for m in messages:
            if isinstance(m.content, str):
                chars += len(m.content)
            elif isinstance(m.content, list):
                chars += sum(len(p.text or "") for p in m.content)
        self._check_text_length(chars, "messages")

    def _chat_messages(self, messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
        if not messages:
            raise InvalidRequestError("messages must contain at least one message", param="messages")
        out: list[dict[str, Any]] = []
        for i, m in enumerate(messages):
            role = "system" if m.role == "developer" else m.role
            if role not in ("system", "user", "assistant", "tool"):
                raise InvalidRequestError(
                    f"messages[{i}].role must be system, developer, user, assistant or tool; got {m.role!r}",
                    param=f"messages[{i}].role",
                )
            content: str | None
            if isinstance(m.content, list):
                parts: list[str] = []
                for j, part in enumerate(m.content):
                    if part.type != "text" or part.text is None:
                        raise InvalidRequestError(
                            f"messages[{i}].content[{j}] has type {part.type!r}; only text parts "
                            "({'type': 'text', 'text': ...}) are supported",
                            param=f"messages[{i}].content[{j}].type",
                        )
                    parts.append(part.text)
                content = "\n".join(parts)
            else:
                content = m.content
            if content is None and not (role == "assistant" and m.tool_calls):
                raise InvalidRequestError(
                    f"messages[{i}].content is required", param=f"messages[{i}].content"
                )
            msg: dict[str, Any] = {"role": role, "content": content if content is not None else ""}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            if m.reasoning_content is not None:
                msg["reasoning_content"] = m.reasoning_content
            if m.tool_calls:
                calls = []
                for tc in m.tool_calls:
                    # Templates expect arguments as a mapping (they tojson it themselves).
                    try:
                        args: Any = json.loads(tc.function.arguments)
                    except ValueError:
                        args = tc.function.arguments
                    calls.append(
                        {
                            "id": tc.id,
                            "type": "function",
                            "function": {"name": tc.function.name, "arguments": args},
                        }
                    )
                msg["tool_calls"] = calls
            out.append(msg)
        return out

    def _tool_setup(self, req: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, bool]:
        """Return (tools for the template, whether to parse tool calls)."""
        tools = [msgspec.to_builtins(t) for t in req.tools] if req.tools else None
        choice = req.tool_choice
        if choice is None:
            choice = "auto" if tools else "none"
        if not isinstance(choice, str):
            raise InvalidRequestError(
                "a named tool_choice is not supported (output cannot be constrained); "
                "use 'auto' or 'required'",
                param="tool_choice",
            )
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"tool_choice must be 'none', 'auto' or 'required'; got {choice!r}", param="tool_choice"
            )
        if choice == "none":
            return tools, False
        if not tools:
            raise InvalidRequestError(f"tool_choice={choice!r} needs tools", param="tool_choice")
        if not self.options.enable_auto_tool_choice or self._tools is None:
            raise InvalidRequestError(
                f"tool_choice={choice!r} needs the server to run with --enable-auto-tool-choice and a "
                f"--tool-call-parser (this one: {self.tool_call_parser_name})",
                param="tool_choice",
            )
        return tools, True

    async def create_chat_completion(
        self, req: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """``POST /v1/chat/completions``: a response, or an iterator of SSE data strings."""
        self.check_admitting()
        self._check_model(req.model)
        if req.response_format is not None and req.response_format.type != "text":
            raise InvalidRequestError(
                f"response_format {req.response_format.type!r} is not supported; only 'text'",
                param="response_format",
            )
        if (
            req.max_tokens is not None
            and req.max_completion_tokens is not None
            and req.max_tokens != req.max_completion_tokens
        ):
            raise InvalidRequestError(
                "max_tokens and max_completion_tokens differ; send only max_completion_tokens",
                param="max_completion_tokens",
            )
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        top: int | None = None
        if req.top_logprobs is not None:
            if not req.logprobs:
                raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
            if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(
                    f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs"
                )
        if req.logprobs:
            top = req.top_logprobs or 0
        kwargs = dict(req.chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(reserved)}: they come from the request's "
                "own fields (messages, tools, add_generation_prompt)",
                param="chat_template_kwargs",
            )
        self._check_chat_size(req.messages)
        messages = self._chat_messages(req.messages)
        tools, parse_tools = self._tool_setup(req)

        def render() -> str:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=req.add_generation_prompt, **kwargs
            )

        prompt = await asyncio.to_thread(render)
        ids = await self._encode(prompt, add_special_tokens=False, param="messages")
        plan = self._plan(
            req,
            prompt_ids=ids,
            prompt_text=prompt,
            prompt_param="messages",
            max_tokens=max_tokens,
            max_tokens_param=param,
            top_logprobs=top,
        )
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        tool_parser = self._tools if parse_tools else None
        run = self._submit(plan)
        if plan.stream:
            first = await self._first(run)
            stream = self._chat_stream(run, first, plan, rid, created, req.model, tool_parser, tools or [])
            return _closing(run, stream)
        text, lps, last = await self._collect(run)
        reasoning: str | None = None
        content: str | None = text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.extract(text, prompt)
        calls: list[ToolCall] = []
        if tool_parser is not None and content is not None:
            content, parsed = tool_parser.extract(content, tools or [])
            calls = [
                ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed
            ]
        finish = last.finish_reason
        if calls and finish == "stop":
            finish = "tool_calls"
        message = ResponseMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None)
        choice = ChatCompletionChoice(
            index=0,
            message=message,
            finish_reason=finish,
            logprobs=_chat_logprobs(lps) if plan.want_logprobs else None,
        )
        return ChatCompletionResponse(
            id=rid, created=created, model=req.model, choices=[choice], usage=_usage(last)
        )

    async def _chat_stream(
        self,
        run: _Run,
        first: StepOutput,
        plan: _Plan,
        rid: str,
        created: int,
        model: str,
        tool_parser: ToolParser | None,
        tools: list[dict[str, Any]],
    ) -> AsyncIterator[str]:
        def chunk(delta: DeltaMessage, finish: str | None = None, lps: ChatLogprobs | None = None) -> str:
            choice = ChatCompletionStreamChoice(index=0, delta=delta, finish_reason=finish, logprobs=lps)
            return _json(ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[choice]))

        reasoning = self._reasoning.stream(plan.prompt_text) if self._reasoning is not None else None
        tool_stream = tool_parser.stream(tools) if tool_parser is not None else None
        called = False

        def split(text: str, final: bool) -> tuple[str, str, list[ToolCallEvent]]:
            r, c = reasoning.feed(text) if reasoning is not None else ("", text)
            if final and reasoning is not None:
                r2, c2 = reasoning.finish()
                r, c = r + r2, c + c2
            events: list[ToolCallEvent] = []
            if tool_stream is not None:
                c, events = tool_stream.feed(c)
                if final:
                    c2, e2 = tool_stream.finish()
                    c, events = c + c2, events + e2
            return r, c, events

        try:
            yield chunk(DeltaMessage(role="assistant", content=""))
            out = first
            while True:
                r, c, events = split(out.text, out.finished)
                lps = _chat_logprobs(out.logprobs) if plan.want_logprobs and out.logprobs else None
                if r or c or lps is not None:
                    yield chunk(DeltaMessage(content=c or None, reasoning_content=r or None), lps=lps)
                for ev in events:
                    called = True
                    fn = DeltaFunctionCall(
                        name=ev.name, arguments="" if ev.name is not None else ev.arguments
                    )
                    dtc = DeltaToolCall(
                        index=ev.index, function=fn, id=ev.id, type="function" if ev.id is not None else None
                    )
                    yield chunk(DeltaMessage(tool_calls=[dtc]))
                if out.finished:
                    break
                out = await run.next()
            finish = out.finish_reason
            if called and finish == "stop":
                finish = "tool_calls"
            yield chunk(DeltaMessage(), finish=finish)
            if plan.include_usage:
                yield _json(
                    ChatCompletionStreamResponse(
                        id=rid, created=created, model=model, choices=[], usage=_usage(out)
                    )
                )
        except OpenAIError as exc:
            # Headers are sent: a failure mid-stream can only be reported in the stream.
            yield _json(error_body(exc))
        finally:
            run.close()
        yield _DONE


def _closing(run: _Run, stream: AsyncIterator[str]) -> AsyncIterator[str]:
    # A stream that is dropped before its first iteration never runs its ``finally``; tie the
    # request's release to the generator's lifetime as well, so the slot and the in-flight
    # count are freed either way (close() is idempotent).
    weakref.finalize(stream, run.close)
    return stream


# -- response helpers -------------------------------------------------------------------------------


def _usage(out: StepOutput) -> Usage:
    return Usage(
        prompt_tokens=out.prompt_tokens,
        completion_tokens=out.completion_tokens,
        total_tokens=out.prompt_tokens + out.completion_tokens,
    )


def _completion_logprobs(lps: Sequence[TokenLogprob], start_offset: int) -> CompletionLogprobs:
    offsets: list[int] = []
    pos = start_offset
    for lp in lps:
        offsets.append(pos)
        pos += len(lp.token)
    return CompletionLogprobs(
        tokens=[lp.token for lp in lps],
        token_logprobs=[lp.logprob for lp in lps],
        top_logprobs=[{t.token: t.logprob for t in lp.top} for lp in lps],
        text_offset=offsets,
    )


def _chat_logprobs(lps: Sequence[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=lp.token,
                logprob=lp.logprob,
                bytes=list(lp.bytes),
                top_logprobs=[
                    TopLogprobEntry(token=t.token, logprob=t.logprob, bytes=list(t.bytes)) for t in lp.top
                ],
            )
            for lp in lps
        ]
    )
