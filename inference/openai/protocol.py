"""OpenAI wire types (msgspec Structs): requests as clients send them, responses as we answer.

A request struct holds every field of OpenAI's API reference for its route (those without
meaning here are accepted and have no effect: :data:`NO_EFFECT_FIELDS`) and the extensions we
implement (vLLM's sampling and guided-decoding fields, llama-server's ``grammar`` /
``json_schema`` / ``cache_prompt``, Ollama's ``keep_alive``). Anything else is refused
(``forbid_unknown_fields``): a misspelled ``max_token`` or a constraint we lack must be a 400
naming it, never silently ignored. Nested objects (messages, tools) stay lenient. A request
converts itself once into the generation spec the engine runs (:meth:`_SamplingFields.to_spec`,
as vLLM's ``to_sampling_params``), checking its own ranges and its prompt against the model's
limits on the way; what needs the tokenizer or the chat template is checked by the endpoint.
Every error names its field.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from inference.openai.errors import ContextLengthExceededError, InvalidRequestError
from inference.serving.generation_spec import GenerationSpec, ModelLimits
from inference.serving.sampling import SamplingParams

__all__ = [
    "NO_EFFECT_FIELDS",
    "ChatCompletionChoice",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatCompletionStreamChoice",
    "ChatCompletionStreamResponse",
    "ChatLogprobs",
    "ChatMessage",
    "ChatTokenLogprob",
    "CompletionChoice",
    "CompletionLogprobs",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionStreamChoice",
    "CompletionStreamResponse",
    "ContentPart",
    "DeltaFunctionCall",
    "DeltaMessage",
    "DeltaToolCall",
    "DetokenizeRequest",
    "DetokenizeResponse",
    "FunctionCall",
    "FunctionDefinition",
    "ImageUrl",
    "JsonSchemaFormat",
    "ModelCard",
    "ModelList",
    "NamedToolChoice",
    "ResponseFormat",
    "ResponseMessage",
    "StreamOptions",
    "StructuredOutputs",
    "TokenizeRequest",
    "TokenizeResponse",
    "Tool",
    "ToolCall",
    "TopLogprobEntry",
    "Usage",
]


#: Largest ``repetition_penalty`` (vLLM only asks > 0; past this the output is noise anyway).
MAX_REPETITION_PENALTY = 10.0
#: Most choices one request may ask for (``n``); they share one prefill of the prompt.
MAX_N = 8
#: Longest ``cache_salt``: a tenant id or a secret fits; it is hashed once per request.
MAX_CACHE_SALT_CHARS = 1024
#: Most alternatives per token ``logprobs`` / ``top_logprobs`` may ask for.
MAX_TOP_LOGPROBS = 20


def _check_range(value: float | None, param: str, lo: float, hi: float) -> None:
    if value is not None and not lo <= value <= hi:
        raise InvalidRequestError(f"{param} must be between {lo:g} and {hi:g}; got {value:g}", param=param)


# -- requests ---------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, omit_defaults=True):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage counts."""

    include_usage: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """``response_format.json_schema``: the schema the output must follow."""

    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """``response_format``: ``text``, ``json_object`` or ``json_schema`` (enforced by a grammar)."""

    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs``: exactly one of ``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``; the ``disable_*`` switches are accepted and change nothing here (JSON is
    always written with at most one space, and nothing falls back to unconstrained output)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None


#: Fields of OpenAI's (and Anthropic's) API references that are accepted with no effect here,
#: per route: they configure the vendor's platform (storage, billing, moderation, caching
#: hints, effort of models we do not run), not the output of this server.
NO_EFFECT_FIELDS: dict[str, tuple[str, ...]] = {
    "completions": ("user",),
    "chat/completions": (
        "metadata",
        "moderation",
        "prediction",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "reasoning_effort",
        "safety_identifier",
        "service_tier",
        "store",
        "user",
        "verbosity",
    ),
    "responses": (
        "access_programs",
        "background_options",
        "context_management",
        "image",
        "include",
        "max_tool_calls",
        "metadata",
        "moderation",
        "prompt_cache_key",
        "prompt_cache_options",
        "prompt_cache_retention",
        "reasoning",
        "safety_identifier",
        "service_tier",
        "store",
        "stream_options",
        "top_logprobs",
        "truncation",
        "user",
    ),
    "messages": (
        "cache_control",
        "container",
        "diagnostics",
        "inference_geo",
        "metadata",
        "output_format",
        "service_tier",
        "speed",
        "thinking",
    ),
}


class _SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # As llama-server: false = no cached prompt prefix is used and this prompt's KV is not kept.
    cache_prompt: bool = True
    # As Ollama: seconds the model stays loaded after this request (-1 forever, 0 unload when idle).
    keep_alive: float | None = None
    # As vLLM: cached prompt prefixes are shared only between requests with the same salt.
    cache_salt: str | None = None
    # vLLM's sampling extensions.
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    # vLLM's guided decoding (the older flat fields and the ``structured_outputs`` object) and
    # llama-server's ``grammar`` (GBNF) / ``json_schema``: all compiled by llguidance.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None

    def output_limit(self) -> tuple[int | None, str]:
        """The most tokens to generate (None: what the context leaves) and the field that said so."""
        return self.max_tokens, "max_tokens"

    def top_logprobs_asked(self) -> int | None:
        """How many alternatives per token to return (None: no logprobs)."""
        return None

    @property
    def stream_usage(self) -> bool:
        """``stream_options.include_usage``: a streamed answer ends with a chunk of the usage."""
        return bool(self.stream_options and self.stream_options.include_usage)

    def to_spec(
        self,
        prompt_ids: list[int],
        limits: ModelLimits,
        *,
        prompt_param: str,
        grammar: str | None = None,
        adapter: str | None = None,
    ) -> GenerationSpec:
        """This request on ``prompt_ids`` as the engine runs it: sampling, stop strings and token
        ids, the output limit (all the context leaves after the prompt when the request sets
        none), checked against the model's ``limits`` (400 naming the field; ``prompt_param``:
        the prompt's), with the output ``grammar`` and the LoRA ``adapter`` the request runs."""
        max_tokens, max_tokens_param = self.output_limit()
        params = self.to_sampling(limits.vocab_size, self.top_logprobs_asked())
        stop = self.stop_strings()
        stop_ids = tuple(self.stop_token_ids or ())
        for i, t in enumerate(stop_ids):
            if not 0 <= t < limits.vocab_size:
                raise InvalidRequestError(
                    f"stop token id {t} is outside the vocabulary", param=f"stop_token_ids[{i}]"
                )
        n = len(prompt_ids)
        if n == 0:
            raise InvalidRequestError("the prompt is empty", param=prompt_param)
        if n > limits.max_input_len:
            raise ContextLengthExceededError(
                f"the prompt has {n} tokens; this model accepts at most {limits.max_input_len} input tokens",
                param=prompt_param,
            )
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequestError(f"{max_tokens_param} must be at least 1", param=max_tokens_param)
        room = limits.max_model_len - n
        if room < 1:
            raise ContextLengthExceededError(
                f"the prompt has {n} tokens, leaving no room to generate within the "
                f"maximum context length of {limits.max_model_len} tokens",
                param=prompt_param,
            )
        if max_tokens is not None and max_tokens > room:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {limits.max_model_len} tokens; the prompt has {n} "
                f"and {max_tokens_param}={max_tokens} asks for more than the {room} left; "
                f"lower {max_tokens_param} or shorten the prompt",
                param=max_tokens_param,
            )
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options is only allowed with stream=true", param="stream_options"
            )
        return GenerationSpec(
            prompt_ids=prompt_ids,
            sampling=params,
            max_tokens=room if max_tokens is None else max_tokens,
            stop=stop,
            stop_token_ids=stop_ids,
            n=self.n,
            ignore_eos=self.ignore_eos,
            grammar=grammar,
            adapter=adapter,
            cache_prompt=self.cache_prompt,
            cache_salt=self.checked_cache_salt(),
        )

    def to_sampling(self, vocab_size: int, top_logprobs: int | None) -> SamplingParams:
        """The sampling parameters this request asks for, every range checked (400 naming the
        field); ``logit_bias`` keys must be token ids below ``vocab_size``."""
        req = self
        if not 1 <= req.n <= MAX_N:
            raise InvalidRequestError(f"n must be between 1 and {MAX_N}; got n={req.n}", param="n")
        _check_range(req.temperature, "temperature", 0.0, 2.0)
        _check_range(req.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        _check_range(req.presence_penalty, "presence_penalty", -2.0, 2.0)
        if req.top_p is not None and not 0.0 < req.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1]; got {req.top_p:g}", param="top_p")
        if req.top_k is not None and req.top_k < -1:
            raise InvalidRequestError("top_k must be -1 or 0 (off) or a positive count", param="top_k")
        _check_range(req.min_p, "min_p", 0.0, 1.0)
        rep = req.repetition_penalty
        if rep is not None and not (0.0 < rep <= MAX_REPETITION_PENALTY):
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off); got {rep:g}",
                param="repetition_penalty",
            )
        bias: dict[int, float] = {}
        for key, value in (req.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids; got {key!r}", param="logit_bias"
                ) from None
            if not 0 <= token < vocab_size:
                raise InvalidRequestError(
                    f"logit_bias token {token} is outside the vocabulary (0..{vocab_size - 1})",
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
            min_p=req.min_p or 0.0,
            repetition_penalty=1.0 if rep is None else rep,
        )

    def stop_strings(self) -> tuple[str, ...]:
        """``stop`` as a tuple (400 for an empty string)."""
        if self.stop is None:
            return ()
        items = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        for i, s in enumerate(items):
            if not s:
                raise InvalidRequestError("stop strings must not be empty", param=f"stop[{i}]")
        return tuple(items)

    def checked_cache_salt(self) -> str | None:
        """vLLM's ``cache_salt``: a non-empty string of bounded length, or None."""
        salt = self.cache_salt
        if salt is None:
            return None
        if not salt:
            raise InvalidRequestError("cache_salt must be a non-empty string when given", param="cache_salt")
        if len(salt) > MAX_CACHE_SALT_CHARS:
            raise InvalidRequestError(
                f"cache_salt has {len(salt)} characters; at most {MAX_CACHE_SALT_CHARS} are allowed",
                param="cache_salt",
            )
        return salt


class CompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token ids or
    a list of lists of token ids (several prompts: choices indexed prompt-major)."""

    prompt: str | list[str | int | list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    response_format: ResponseFormat | None = None

    def check_supported(self) -> None:
        """400 for what this server cannot do: ``suffix`` (insertion), ``best_of`` > 1, more
        ``logprobs`` alternatives than :data:`MAX_TOP_LOGPROBS`."""
        if self.suffix:
            raise InvalidRequestError(
                f"suffix is not supported: the model {self.model!r} on this server does not do insertion "
                "(fill-in-the-middle); send the whole prompt without suffix",
                param="suffix",
            )
        if self.best_of not in (None, 1):
            raise InvalidRequestError("only best_of=1 is supported", param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="logprobs")

    def top_logprobs_asked(self) -> int | None:
        """``logprobs``: how many alternatives per token to return (None: no logprobs)."""
        return self.logprobs


class ImageUrl(msgspec.Struct):
    """An image part's image: a ``data:`` URL (base64); ``detail`` is accepted with no effect
    (one image is always the vision model's fixed number of tokens)."""

    url: str
    detail: str | None = None


class ContentPart(msgspec.Struct):
    """One part of a message's content: ``{"type": "text", "text": ...}``, or for a
    vision-language model ``{"type": "image_url", "image_url": {"url": "data:..."}}``."""

    type: str
    text: str | None = None
    image_url: ImageUrl | None = None


class FunctionCall(msgspec.Struct):
    """A function call: ``arguments`` is a JSON string."""

    name: str
    arguments: str = "{}"


class ToolCall(msgspec.Struct, kw_only=True):
    """A tool call made by the assistant."""

    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, kw_only=True):
    """One input message (system, developer, user, assistant or tool)."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(msgspec.Struct, kw_only=True):
    """A callable function offered to the model."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True):
    """A tool offered to the model (only functions exist)."""

    function: FunctionDefinition
    type: Literal["function"] = "function"


class _NamedFunction(msgspec.Struct):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True):
    """``tool_choice`` naming one function."""

    function: _NamedFunction
    type: Literal["function"] = "function"


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's reference: what this server cannot do is a 400 when asked for (audio output,
    # web search, the deprecated functions); the rest is accepted with no effect.
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    moderation: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None
    reasoning_effort: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    verbosity: str | None = None


    def check_supported(self) -> None:
        """400 for fields of OpenAI's reference that ask for what this server cannot do (text-only
        models, no web access), accepted when they ask for nothing; then for an output limit or
        ``top_logprobs`` that cannot be met (checked again where :meth:`to_spec` reads them), so
        these 400s come before any template work."""
        if self.audio is not None:
            raise InvalidRequestError(
                "audio output is not supported: the models here write text", param="audio"
            )
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise InvalidRequestError("only the 'text' modality is supported", param="modalities")
        if self.web_search_options is not None:
            raise InvalidRequestError(
                "web search is not supported by this server", param="web_search_options"
            )
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                raise InvalidRequestError(
                    f"{name} (deprecated by OpenAI) is not supported: send tools and tool_choice", param=name
                )
        self.output_limit()
        self.top_logprobs_asked()

    def output_limit(self) -> tuple[int | None, str]:
        """The most tokens to generate (None: what the context leaves) and the field that said so:
        ``max_completion_tokens``, or the older ``max_tokens`` (400 when both differ)."""
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise InvalidRequestError(
                "max_tokens and max_completion_tokens differ; send only max_completion_tokens",
                param="max_completion_tokens",
            )
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def top_logprobs_asked(self) -> int | None:
        """How many alternatives per token to return (None: no logprobs)."""
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequestError(
                    f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}", param="top_logprobs"
                )
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /tokenize`` (vLLM's shape): ``prompt``, or ``messages`` rendered by the chat template.

    ``model`` defaults to the server's model; ``add_special_tokens`` defaults to true for a
    prompt and false for messages (the template writes its own).
    """

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    keep_alive: float | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /detokenize`` (vLLM's shape): token ids back to text."""

    tokens: list[int]
    model: str | None = None
    keep_alive: float | None = None


# -- responses --------------------------------------------------------------------------------


class TokenizeResponse(msgspec.Struct, omit_defaults=True):
    """``POST /tokenize``: the ids, their count and the model's context length."""

    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    """``POST /detokenize``."""

    prompt: str


class PromptTokensDetails(msgspec.Struct):
    """What the prompt count is made of: ``cached_tokens``, the prompt tokens whose KV came from
    the context cache (a reused prefix) instead of a prefill, as OpenAI reports its prompt cache."""

    cached_tokens: int = 0


class Usage(msgspec.Struct):
    """Token counts."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)


class ModelCard(msgspec.Struct):
    """One entry of ``GET /v1/models``."""

    id: str
    created: int
    owned_by: str
    max_model_len: int
    object: str = "model"
    root: str | None = None
    # Extensions: what the name runs on and whether it is in memory now.
    backend: str | None = None
    precision: str | None = None
    bundle_id: str | None = None
    loaded: bool | None = None
    #: vLLM's: the base model a LoRA adapter's name runs on (None for a base model).
    parent: str | None = None
    #: What the model takes: ``["text"]``, or ``["text", "image"]`` for a vision-language model.
    input_modalities: list[str] | None = None


class ModelList(msgspec.Struct):
    """``GET /v1/models``."""

    data: list[ModelCard]
    object: str = "list"


class CompletionLogprobs(msgspec.Struct):
    """Legacy completions logprobs."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    """One choice of a text completion."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(msgspec.Struct):
    """``POST /v1/completions`` (not streamed)."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    object: str = "text_completion"


class CompletionStreamChoice(msgspec.Struct):
    """One choice of a streamed text completion chunk."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class CompletionStreamResponse(msgspec.Struct):
    """One SSE chunk of a streamed text completion."""

    id: str
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: Usage | None = None
    object: str = "text_completion"


class TopLogprobEntry(msgspec.Struct):
    """One alternative token (chat logprobs)."""

    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    """One generated token (chat logprobs)."""

    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobEntry]


class ChatLogprobs(msgspec.Struct):
    """Chat logprobs of a choice or a chunk."""

    content: list[ChatTokenLogprob]


class ResponseMessage(msgspec.Struct):
    """The assistant message of a chat choice."""

    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatCompletionChoice(msgspec.Struct):
    """One choice of a chat completion."""

    index: int
    message: ResponseMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(msgspec.Struct):
    """``POST /v1/chat/completions`` (not streamed)."""

    id: str
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    object: str = "chat.completion"


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    """Part of a streamed function call: the name first, then pieces of the arguments."""

    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """Part of a streamed tool call; ``id`` and ``type`` come with the first part only."""

    index: int
    function: DeltaFunctionCall
    id: str | None = None
    type: str | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    """The delta of a streamed chat chunk."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(msgspec.Struct):
    """One choice of a streamed chat chunk."""

    index: int
    delta: DeltaMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class ChatCompletionStreamResponse(msgspec.Struct):
    """One SSE chunk of a streamed chat completion."""

    id: str
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class ErrorInfo(msgspec.Struct, kw_only=True):
    """The ``error`` object of an OpenAI error response."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """Every ``/v1`` error: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo
