"""``/v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic Messages API) over the chat endpoint.

A messages request becomes a chat request (system, text, ``tool_use`` / ``tool_result`` history,
tools) and runs through the same chat turn as ``/v1/chat/completions``: template, scheduler,
reasoning and tool-call parsers. Only the answer's shape differs: content blocks, Anthropic stop
reasons, and a stream of Anthropic's typed events.

Reasoning split off by the model's reasoning parser comes back as a ``thinking`` block (with an
empty ``signature``: nothing here signs it), whether or not the request asked for ``thinking``.

``tool_choice``: ``auto``, ``any`` (chat's ``required``: a grammar forces at least one call),
``tool`` (only the named tool is offered to the model, then as ``any``: a call of it is forced)
and ``none``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
from litestar.response import ServerSentEventMessage

from inference.openai.anthropic_protocol import (
    AnthropicBlock,
    AnthropicCountTokensRequest,
    AnthropicCountTokensResponse,
    AnthropicMessagesRequest,
    AnthropicMessagesResponse,
    AnthropicTextBlock,
    AnthropicThinkingBlock,
    AnthropicToolUseBlock,
    AnthropicUsage,
)
from inference.openai.chat import ChatEndpoint, ChatTurn
from inference.openai.errors import InvalidRequestError, OpenAIError, anthropic_error_body, renamed_params
from inference.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    ImageUrl,
    JsonSchemaFormat,
    NamedToolChoice,
    ResponseFormat,
    Tool,
    ToolCall,
)
from inference.serving.engine_client import closing

__all__ = ["MessagesEndpoint", "anthropic_stop_reason"]

#: Chat request fields -> the Anthropic fields they came from (for the ``param`` of a 400).
_RENAMED = {
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "response_format.type": "output_config.format.type",
    "response_format.json_schema": "output_config.format.schema",
    "response_format.json_schema.schema": "output_config.format.schema",
}

#: chat finish reason -> Anthropic stop_reason (``stop`` by a stop string is ``stop_sequence``).
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def anthropic_stop_reason(finish_reason: str, stop_string: str | None) -> str:
    """Anthropic's ``stop_reason`` for a chat finish reason."""
    if finish_reason == "stop" and stop_string is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(finish_reason, "end_turn")


def _text_of(blocks: str | Sequence[AnthropicBlock | dict[str, Any]] | None, param: str) -> str:
    """The text of a string or of text blocks (system prompts, tool results)."""
    if blocks is None:
        return ""
    if isinstance(blocks, str):
        return blocks
    parts: list[str] = []
    for j, block in enumerate(blocks):
        kind: Any
        text: Any
        if isinstance(block, AnthropicBlock):
            kind, text = block.type, block.text
        else:
            kind, text = block.get("type"), block.get("text")
        if kind != "text" or not isinstance(text, str):
            raise InvalidRequestError(
                f"{param}[{j}] has type {kind!r}; only text blocks are supported here", param=f"{param}[{j}]"
            )
        parts.append(text)
    return "\n".join(parts)


def _image_part(b: AnthropicBlock, where: str) -> tuple[ContentPart, str]:
    """A user turn's ``image`` block as a chat ``image_url`` part, and the block's field that
    holds the image (for the ``param`` of a 400)."""
    source = b.source or {}
    kind = source.get("type")
    if kind == "base64":
        url = f"data:{source.get('media_type') or ''};base64,{source.get('data') or ''}"
        return ContentPart(type="image_url", image_url=ImageUrl(url=url)), f"{where}.source.data"
    if kind == "url" and isinstance(source.get("url"), str):
        return ContentPart(type="image_url", image_url=ImageUrl(url=source["url"])), f"{where}.source.url"
    raise InvalidRequestError(f"{where}.source must be {{'type': 'base64', 'media_type': ..., 'data': ...}}",
                              param=f"{where}.source")


def _chat_messages(req: AnthropicMessagesRequest | AnthropicCountTokensRequest,
                   renames: dict[str, str] | None = None) -> list[ChatMessage]:
    """The chat messages of an Anthropic request; ``renames`` receives, for each image block, its
    chat part's field -> the block's own (so a 400 names the field the client sent)."""
    out: list[ChatMessage] = []
    if req.system:
        out.append(ChatMessage(role="system", content=_text_of(req.system, "system")))
    if not req.messages:
        raise InvalidRequestError("messages: at least one message is required", param="messages")
    for i, m in enumerate(req.messages):
        if m.role not in ("user", "assistant"):
            raise InvalidRequestError(
                f"messages[{i}].role must be 'user' or 'assistant'; got {m.role!r}",
                param=f"messages[{i}].role",
            )
        if isinstance(m.content, str):
            out.append(ChatMessage(role=m.role, content=m.content))
            continue
        texts: list[str] = []
        parts: list[ContentPart] = []  # text and images in order, where the turn has an image
        images: list[tuple[int, str, str]] = []  # (part index, block, block's image field)
        thoughts: list[str] = []
        calls: list[ToolCall] = []
        results: list[ChatMessage] = []
        for j, b in enumerate(m.content):
            where = f"messages[{i}].content[{j}]"
            if b.type == "text" and b.text is not None:
                texts.append(b.text)
                parts.append(ContentPart(type="text", text=b.text))
            elif b.type == "image" and m.role == "user":
                part, field = _image_part(b, where)
                images.append((len(parts), where, field))
                parts.append(part)
            elif b.type == "tool_use" and m.role == "assistant" and b.id and b.name:
                args = json.dumps(b.input or {}, ensure_ascii=False)
                calls.append(ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=args)))
            elif b.type == "thinking" and m.role == "assistant":
                thoughts.append(b.thinking or "")
            elif b.type == "tool_result" and m.role == "user" and b.tool_use_id:
                text = _text_of(b.content, f"{where}.content")
                results.append(ChatMessage(role="tool", tool_call_id=b.tool_use_id, content=text))
            else:
                raise InvalidRequestError(
                    f"{where}: a {m.role} block of type {b.type!r} is not supported (text; tool_use "
                    "with id/name/input and thinking in assistant turns; tool_result with tool_use_id "
                    "and image in user turns)",
                    param=f"{where}.type",
                )
        # Tool results answer the previous assistant turn, so they come before the user's text.
        out.extend(results)
        if images:
            for k, where, field in images:
                chat = f"messages[{len(out)}].content[{k}]"
                if renames is not None:
                    renames[chat] = where
                    renames[f"{chat}.image_url.url"] = field
            out.append(ChatMessage(role=m.role, content=parts))
        elif texts or calls or thoughts or not results:
            said = "\n".join(texts) if texts or not calls else None
            thought = "\n".join(thoughts) if thoughts else None
            out.append(
                ChatMessage(role=m.role, content=said, tool_calls=calls or None, reasoning_content=thought)
            )
    return out


def _tools(
    req: AnthropicMessagesRequest | AnthropicCountTokensRequest,
) -> tuple[list[Tool] | None, str | NamedToolChoice | None]:
    tools = [
        Tool(function=FunctionDefinition(name=t.name, description=t.description, parameters=t.input_schema))
        for t in req.tools or []
    ]
    choice = req.tool_choice
    if choice is None:
        return tools or None, None
    if choice.type == "tool":
        picked = [t for t in tools if t.function.name == choice.name]
        if not picked:
            raise InvalidRequestError(
                f"tool_choice names the tool {choice.name!r}, which is not in tools", param="tool_choice.name"
            )
        return picked, "required"
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type)
    if mapped is None:
        raise InvalidRequestError(
            f"tool_choice.type must be 'auto', 'any', 'tool' or 'none'; got {choice.type!r}",
            param="tool_choice.type",
        )
    return tools or None, mapped


def _output_format(config: dict[str, Any] | None) -> ResponseFormat | None:
    """``output_config.format`` (``{"type": "json_schema", "schema": ...}``) as the chat
    request's ``response_format``; ``effort`` has no effect here."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise InvalidRequestError(
            "output_config.format must be {'type': 'json_schema', 'schema': {...}}",
            param="output_config.format.type",
        )
    schema = fmt.get("schema")
    spec = JsonSchemaFormat(name=None, schema=schema if isinstance(schema, dict) else None)
    return ResponseFormat(type="json_schema", json_schema=spec)


def _event(kind: str, **data: Any) -> ServerSentEventMessage:
    return ServerSentEventMessage(event=kind, data=msgspec.json.encode({"type": kind, **data}).decode())


class MessagesEndpoint:
    """``POST /v1/messages``, ``POST /v1/messages/count_tokens``: a chat turn of the chat
    endpoint, answered in Anthropic's shapes."""

    def __init__(self, chat: ChatEndpoint) -> None:
        self.chat = chat

    def _as_chat(self, req: AnthropicMessagesRequest, renames: dict[str, str]) -> ChatCompletionRequest:
        if req.max_tokens < 1:
            raise InvalidRequestError("max_tokens must be at least 1", param="max_tokens")
        if req.temperature is not None and not 0.0 <= req.temperature <= 1.0:
            raise InvalidRequestError(
                f"temperature must be between 0 and 1; got {req.temperature:g}", param="temperature"
            )
        tools, choice = _tools(req)
        return ChatCompletionRequest(
            model=req.model,
            messages=_chat_messages(req, renames),
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            stop=req.stop_sequences or None,
            stream=req.stream,
            tools=tools,
            tool_choice=choice,
            keep_alive=req.keep_alive,
            cache_salt=req.cache_salt,
            response_format=_output_format(req.output_config),
        )

    async def create_message(
        self, req: AnthropicMessagesRequest
    ) -> AnthropicMessagesResponse | AsyncIterator[ServerSentEventMessage]:
        """``POST /v1/messages``: a message, or Anthropic's event stream."""
        async with self.chat.pool.hold(req.model, keep_alive=req.keep_alive) as held:
            renames = dict(_RENAMED)
            with renamed_params(_RENAMED):  # the image renames are for the chat turn's errors only
                chat_req = self._as_chat(req, renames)
            with renamed_params(renames):
                turn = await self.chat.start_turn(held.handle, chat_req)
            mid = f"msg_{uuid.uuid4().hex}"
            if turn.stream:
                return held.held_by(closing(turn.runs, self._message_stream(turn, mid, req.model)))
            return await self._message(turn, req, mid)

    async def _message(
        self, turn: ChatTurn, req: AnthropicMessagesRequest, mid: str
    ) -> AnthropicMessagesResponse:
        (result,), usage = await self.chat.results(turn)
        content: list[AnthropicThinkingBlock | AnthropicTextBlock | AnthropicToolUseBlock] = []
        if result.reasoning:
            content.append(AnthropicThinkingBlock(thinking=result.reasoning))
        if result.content:
            content.append(AnthropicTextBlock(text=result.content))
        for call in result.tool_calls:
            content.append(
                AnthropicToolUseBlock(id=call.id, name=call.name, input=_arguments(call.arguments))
            )
        return AnthropicMessagesResponse(
            id=mid,
            model=req.model,
            content=content,
            stop_reason=anthropic_stop_reason(result.finish_reason, result.stop_string),
            stop_sequence=result.stop_string,
            usage=AnthropicUsage.of(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                                    usage.completion_tokens),
        )

    async def count_message_tokens(self, req: AnthropicCountTokensRequest) -> AnthropicCountTokensResponse:
        """``POST /v1/messages/count_tokens``: the prompt's tokens as ``/v1/messages`` renders it."""
        async with self.chat.pool.hold(req.model, keep_alive=req.keep_alive) as held:
            handle = held.handle
            handle.client.check_admitting()
            renames = dict(_RENAMED)
            messages = _chat_messages(req, renames)
            tools, _ = _tools(req)
            with renamed_params(renames):
                self.chat.check_size(handle, messages)
                rendered = await self.chat.prompt_ids(
                    handle,
                    messages,
                    tools=[msgspec.to_builtins(t) for t in tools] if tools else None,
                    add_generation_prompt=True,
                    chat_template_kwargs=None,
                )
            return AnthropicCountTokensResponse(input_tokens=len(rendered.ids))

    async def _message_stream(
        self, turn: ChatTurn, mid: str, model: str
    ) -> AsyncIterator[ServerSentEventMessage]:
        started: dict[str, Any] = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            # The cached share is known once the request is admitted: message_delta's usage says it.
            "usage": {"input_tokens": len(turn.spec.prompt_ids), "output_tokens": 0},
        }
        block = -1
        open_kind: str | None = None
        pinged = False
        finish, stop_string = "stop", None

        def open_block(kind: str, content_block: dict[str, Any]) -> list[ServerSentEventMessage]:
            nonlocal block, open_kind, pinged
            events = [] if open_kind is None else [_event("content_block_stop", index=block)]
            block += 1
            open_kind = kind
            events.append(_event("content_block_start", index=block, content_block=content_block))
            if not pinged:
                pinged = True
                events.append(_event("ping"))
            return events

        try:
            yield _event("message_start", message=started)
            async for d in self.chat.deltas(turn):
                if d.reasoning:
                    if open_kind != "thinking":
                        for e in open_block(
                            "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                        ):
                            yield e
                    delta = {"type": "thinking_delta", "thinking": d.reasoning}
                    yield _event("content_block_delta", index=block, delta=delta)
                if d.content:
                    if open_kind != "text":
                        for e in open_block("text", {"type": "text", "text": ""}):
                            yield e
                    yield _event(
                        "content_block_delta", index=block, delta={"type": "text_delta", "text": d.content}
                    )
                for ev in d.tool_calls:
                    if ev.name is not None:
                        for e in open_block(
                            "tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}}
                        ):
                            yield e
                    elif ev.arguments:
                        delta = {"type": "input_json_delta", "partial_json": ev.arguments}
                        yield _event("content_block_delta", index=block, delta=delta)
                if d.finish_reason is not None:
                    finish, stop_string = d.finish_reason, d.stop_string
            if open_kind is not None:
                yield _event("content_block_stop", index=block)
            if not pinged:
                yield _event("ping")
            usage = turn.usage
            yield _event(
                "message_delta",
                delta={
                    "stop_reason": anthropic_stop_reason(finish, stop_string),
                    "stop_sequence": stop_string,
                },
                usage=(msgspec.to_builtins(AnthropicUsage.of(
                    usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, usage.completion_tokens))
                       if usage else {"output_tokens": 0}),
            )
            yield _event("message_stop")
        except OpenAIError as exc:
            # Headers are sent: a failure mid-stream can only be reported in the stream.
            body = anthropic_error_body(exc)
            yield _event("error", error=body["error"])
        finally:
            for run in turn.runs:
                run.close()


def _arguments(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}
