"""Anthropic Messages API wire types (msgspec Structs): ``POST /v1/messages`` and
``POST /v1/messages/count_tokens`` as Anthropic clients send them, and our answers.

A request holds every field of Anthropic's API reference (those without meaning here, such as
``metadata``, ``service_tier`` or ``cache_control``, are accepted with no effect: see
``protocol.NO_EFFECT_FIELDS``) plus Ollama's ``keep_alive`` and vLLM's ``cache_salt``; any other
field is a 400 naming it.
The endpoint (:mod:`inference.openai.messages`) checks what the types cannot.
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "AnthropicBlock",
    "AnthropicCountTokensRequest",
    "AnthropicCountTokensResponse",
    "AnthropicErrorInfo",
    "AnthropicErrorResponse",
    "AnthropicMessage",
    "AnthropicMessagesRequest",
    "AnthropicMessagesResponse",
    "AnthropicTextBlock",
    "AnthropicThinkingBlock",
    "AnthropicTool",
    "AnthropicToolChoice",
    "AnthropicToolUseBlock",
    "AnthropicUsage",
]


# -- requests ---------------------------------------------------------------------------------


class AnthropicBlock(msgspec.Struct, kw_only=True):
    """One input content block: ``text``, ``tool_use`` and ``thinking`` (assistant) or
    ``tool_result`` and ``image`` (user)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    #: An ``image`` block's image: ``{"type": "base64", "media_type": ..., "data": ...}`` or
    #: ``{"type": "url", "url": ...}`` (refused: this server fetches nothing).
    source: dict[str, Any] | None = None


class AnthropicMessage(msgspec.Struct, kw_only=True):
    """One turn: ``user`` or ``assistant``, content as a string or blocks."""

    role: str
    content: str | list[AnthropicBlock]


class AnthropicTool(msgspec.Struct, kw_only=True):
    """A client tool: its JSON Schema is ``input_schema``."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: str | None = None


class AnthropicToolChoice(msgspec.Struct, kw_only=True):
    """``auto`` | ``any`` | ``tool`` (with ``name``) | ``none``."""

    type: str
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class _Conversation(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    messages: list[AnthropicMessage]
    system: str | list[AnthropicBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    # As Ollama: seconds the model stays loaded after this request.
    keep_alive: float | None = None
    # As vLLM's cache_salt on its OpenAI routes: cached prefixes shared only within one salt.
    cache_salt: str | None = None
    # ``output_config.format`` (``json_schema``) constrains the output; ``effort`` has no effect.
    output_config: dict[str, Any] | None = None
    # Anthropic's reference, no effect here: prompt caching is automatic (context reuse), the
    # reasoning parser decides what is thinking, and the rest configures Anthropic's platform.
    cache_control: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    speed: str | None = None


class AnthropicMessagesRequest(_Conversation, kw_only=True):
    """``POST /v1/messages``; ``max_tokens`` is required, as in Anthropic's API."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    container: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None
    service_tier: str | None = None


class AnthropicCountTokensRequest(_Conversation, kw_only=True):
    """``POST /v1/messages/count_tokens``: the prompt a messages request would have."""

    output_format: dict[str, Any] | None = None


# -- responses --------------------------------------------------------------------------------


class AnthropicTextBlock(msgspec.Struct, tag_field="type", tag="text"):
    """A text content block."""

    text: str


class AnthropicThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking"):
    """The model's reasoning (what the reasoning parser split off); no signature is made here."""

    thinking: str
    signature: str = ""


class AnthropicToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use"):
    """A tool call: ``input`` is the arguments object."""

    id: str
    name: str
    input: dict[str, Any]


class AnthropicUsage(msgspec.Struct):
    """Token counts, as Anthropic splits the prompt: ``input_tokens`` computed for this request,
    ``cache_read_input_tokens`` whose KV came from the context cache (their sum is the prompt).
    The context cache is automatic (no ``cache_control`` writes), so ``cache_creation_input_tokens``
    is 0."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, cached_tokens: int, output_tokens: int) -> AnthropicUsage:
        """The Anthropic split of a prompt of ``prompt_tokens`` of which ``cached_tokens`` were reused."""
        return cls(input_tokens=prompt_tokens - cached_tokens, output_tokens=output_tokens,
                   cache_read_input_tokens=cached_tokens)


class AnthropicMessagesResponse(msgspec.Struct, kw_only=True):
    """A message: content blocks, why it stopped and the usage."""

    id: str
    model: str
    content: list[AnthropicThinkingBlock | AnthropicTextBlock | AnthropicToolUseBlock]
    stop_reason: str | None
    stop_sequence: str | None
    usage: AnthropicUsage
    type: str = "message"
    role: str = "assistant"


class AnthropicCountTokensResponse(msgspec.Struct):
    """``POST /v1/messages/count_tokens``."""

    input_tokens: int


class AnthropicErrorInfo(msgspec.Struct):
    """The ``error`` object: ``invalid_request_error``, ``authentication_error``, ``not_found_error``..."""

    type: str
    message: str


class AnthropicErrorResponse(msgspec.Struct):
    """Every Anthropic-route error: ``{"type": "error", "error": {"type", "message"}}``."""

    error: AnthropicErrorInfo
    type: str = "error"
