"""OpenAI Responses API wire types (msgspec Structs) for ``POST /v1/responses``.

``input`` items vary by ``type`` (messages, ``function_call``, ``function_call_output``), so they
arrive as a loose :class:`ResponseInputItem` and the endpoint (:mod:`inference.openai.responses`)
checks each one, naming its position.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "ResponseFunctionCallItem",
    "ResponseInputItem",
    "ResponseMessageItem",
    "ResponseObject",
    "ResponseOutputText",
    "ResponseReasoningItem",
    "ResponseTextConfig",
    "ResponseTextFormat",
    "ResponseUsage",
    "ResponsesRequest",
    "ResponsesTool",
]


# -- requests ---------------------------------------------------------------------------------


class ResponseInputItem(msgspec.Struct, kw_only=True):
    """One ``input`` item: a message (``role`` + ``content``), a ``function_call`` or a
    ``function_call_output``."""

    type: str | None = None
    role: str | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None
    id: str | None = None


class ResponsesTool(msgspec.Struct, kw_only=True):
    """A tool; only ``function`` tools exist here (flat: name, parameters at the top level)."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseTextFormat(msgspec.Struct, kw_only=True):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``,
    ``strict``; enforced by a grammar)."""

    type: str = "text"
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseTextConfig(msgspec.Struct, kw_only=True):
    """``text``: the output format (``verbosity`` has no effect)."""

    format: ResponseTextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``POST /v1/responses``: every field of OpenAI's reference (``background``, ``conversation``
    and ``prompt`` need stored state and are a 400 when set; ``protocol.NO_EFFECT_FIELDS`` lists
    those accepted with no effect) plus Ollama's ``keep_alive`` and vLLM's ``cache_salt``; any
    other field is a 400."""

    model: str
    input: str | list[ResponseInputItem]
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: ResponseTextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # As Ollama: seconds the model stays loaded after this request.
    keep_alive: float | None = None
    # As vLLM's cache_salt: cached prefixes shared only within one salt.
    cache_salt: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    access_programs: Any = None
    background_options: Any = None
    context_management: Any = None
    image: Any = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    moderation: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None
    reasoning: dict[str, Any] | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None


# -- responses --------------------------------------------------------------------------------


class ResponseOutputText(msgspec.Struct, kw_only=True):
    """An ``output_text`` content part."""

    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)
    type: str = "output_text"


class ResponseMessageItem(msgspec.Struct, kw_only=True):
    """An output ``message`` item."""

    id: str
    content: list[ResponseOutputText]
    status: str = "completed"
    role: str = "assistant"
    type: str = "message"


class ResponseReasoningItem(msgspec.Struct, kw_only=True):
    """An output ``reasoning`` item: what the model's reasoning parser split off, as
    ``reasoning_text`` content (no summary is written)."""

    id: str
    content: list[dict[str, str]]
    summary: list[dict[str, str]] = msgspec.field(default_factory=list)
    status: str = "completed"
    type: str = "reasoning"


class ResponseFunctionCallItem(msgspec.Struct, kw_only=True):
    """An output ``function_call`` item; answer it with a ``function_call_output`` input item."""

    id: str
    call_id: str
    name: str
    arguments: str
    status: str = "completed"
    type: str = "function_call"


class ResponseUsage(msgspec.Struct):
    """Token counts (``input_tokens_details.cached_tokens``: prompt tokens from the context cache;
    reasoning is not counted apart)."""

    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] = msgspec.field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens_details: dict[str, int] = msgspec.field(default_factory=lambda: {"reasoning_tokens": 0})


class ResponseObject(msgspec.Struct, kw_only=True):
    """The ``response`` object (returned, and carried by the stream's lifecycle events)."""

    id: str
    created_at: int
    model: str
    status: str
    output: list[ResponseReasoningItem | ResponseMessageItem | ResponseFunctionCallItem]
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    parallel_tool_calls: bool = True
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    incomplete_details: dict[str, str] | None = None
    error: dict[str, Any] | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    previous_response_id: str | None = None
    store: bool = False
    object: str = "response"
