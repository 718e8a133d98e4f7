"""``/v1/responses`` (OpenAI Responses API) over the chat endpoint.

The input (a string, or message / ``function_call`` / ``function_call_output`` items) and the
``instructions`` become a chat conversation and run through the same chat turn as
``/v1/chat/completions``; the answer is a ``response`` object with ``message`` and
``function_call`` output items (and a ``reasoning`` item with what the model's reasoning parser
split off), or a stream of the Responses API's typed events, each with its
``sequence_number``. Nothing is stored: ``store`` is accepted, ``previous_response_id`` is
refused (there is nothing to retrieve).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar.response import ServerSentEventMessage

from inference.openai.chat import ChatEndpoint, ChatTurn
from inference.openai.errors import InvalidRequestError, OpenAIError, renamed_params
from inference.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    ImageUrl,
    JsonSchemaFormat,
    ResponseFormat,
    Tool,
    ToolCall,
    Usage,
)
from inference.openai.responses_protocol import (
    ResponseFunctionCallItem,
    ResponseMessageItem,
    ResponseObject,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponsesRequest,
    ResponseUsage,
)
from inference.serving.engine_client import closing

__all__ = ["ResponsesEndpoint"]

# The chat request's field names in errors, as this surface names them.
_RENAMED = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "response_format.type": "text.format.type",
    "response_format.json_schema": "text.format.schema",
    "response_format.json_schema.schema": "text.format.schema",
}


def _response_format(req: ResponsesRequest) -> ResponseFormat | None:
    """``text.format`` as the chat request's ``response_format`` (a grammar enforces it)."""
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_schema":
        spec = JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.schema, strict=fmt.strict
        )
        return ResponseFormat(type="json_schema", json_schema=spec)
    return ResponseFormat(type=fmt.type)

_TEXT_PARTS = ("input_text", "output_text", "text")


def _parts_text(content: str | list[dict[str, Any]] | None, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        if part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"{param}[{j}] has type {part.get('type')!r}; only text parts "
                "(input_text, output_text) are supported",
                param=f"{param}[{j}].type",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _image_message(role: str, content: list[dict[str, Any]], where: str, chat: str,
                   renames: dict[str, str] | None) -> ChatMessage | None:
    """A message with ``input_image`` parts as chat parts (text and ``image_url``), None where it
    has none; ``renames`` receives each image's chat field -> its own (``chat``: the message's)."""
    if not any(part.get("type") == "input_image" for part in content):
        return None
    if role != "user":
        raise InvalidRequestError(f"{where}: images are accepted in user messages only", param=where)
    parts: list[ContentPart] = []
    for j, part in enumerate(content):
        if part.get("type") == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise InvalidRequestError(f"{where}[{j}]: an input_image needs image_url (a data: URL); "
                                          "file_id is not supported", param=f"{where}[{j}].image_url")
            if renames is not None:
                renames[f"{chat}.content[{j}]"] = f"{where}[{j}]"
                renames[f"{chat}.content[{j}].image_url.url"] = f"{where}[{j}].image_url"
            detail = part.get("detail")
            image = ImageUrl(url=url, detail=detail if isinstance(detail, str) else None)
            parts.append(ContentPart(type="image_url", image_url=image))
        elif part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append(ContentPart(type="text", text=part["text"]))
        else:
            raise InvalidRequestError(
                f"{where}[{j}] has type {part.get('type')!r}; text parts (input_text, output_text) and "
                "input_image are supported", param=f"{where}[{j}].type")
    return ChatMessage(role=role, content=parts)


def _conversation(req: ResponsesRequest, renames: dict[str, str] | None = None) -> list[ChatMessage]:
    """The chat messages of a Responses request; ``renames`` receives the image parts' fields."""
    out: list[ChatMessage] = []
    if req.instructions:
        out.append(ChatMessage(role="system", content=req.instructions))
    if isinstance(req.input, str):
        out.append(ChatMessage(role="user", content=req.input))
        return out
    if not req.input:
        raise InvalidRequestError("input must not be empty", param="input")
    for i, item in enumerate(req.input):
        kind = item.type or "message"
        where = f"input[{i}]"
        if kind == "message":
            if item.role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequestError(
                    f"{where}.role must be user, system, developer or assistant; got {item.role!r}",
                    param=f"{where}.role",
                )
            images = (_image_message(item.role, item.content, f"{where}.content", f"messages[{len(out)}]",
                                     renames) if isinstance(item.content, list) else None)
            out.append(images or ChatMessage(role=item.role,
                                             content=_parts_text(item.content, f"{where}.content")))
        elif kind == "function_call":
            if not item.call_id or not item.name:
                raise InvalidRequestError(f"{where}: a function_call needs call_id and name", param=where)
            call = ToolCall(
                id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments or "{}")
            )
            if out and out[-1].role == "assistant" and out[-1].tool_calls:
                out[-1].tool_calls.append(call)  # parallel calls of one turn
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "reasoning":
            continue  # earlier turns' reasoning: chat templates leave it out of the prompt anyway
        elif kind == "function_call_output":
            if not item.call_id:
                raise InvalidRequestError(
                    f"{where}: a function_call_output needs call_id", param=f"{where}.call_id"
                )
            text = _parts_text(item.output, f"{where}.output")
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id, content=text))
        else:
            raise InvalidRequestError(
                f"{where}.type {kind!r} is not supported; use message, function_call, function_call_output "
                "or reasoning",
                param=f"{where}.type",
            )
    return out


def _tools(req: ResponsesRequest) -> tuple[list[Tool] | None, str | None]:
    tools: list[Tool] = []
    for i, t in enumerate(req.tools or []):
        if t.type != "function" or not t.name:
            raise InvalidRequestError(
                f"tools[{i}]: only function tools (type 'function' with a name) are supported; "
                f"got {t.type!r}",
                param=f"tools[{i}].type",
            )
        tools.append(
            Tool(
                function=FunctionDefinition(
                    name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
                )
            )
        )
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return tools or None, choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        picked = [t for t in tools if t.function.name == choice["name"]]
        if not picked:
            raise InvalidRequestError(
                f"tool_choice names the function {choice['name']!r}, which is not in tools",
                param="tool_choice",
            )
        return picked, "required"
    raise InvalidRequestError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
        param="tool_choice",
    )


def _reasoning_item(text: str, *, status: str = "completed") -> ResponseReasoningItem:
    return ResponseReasoningItem(
        id=f"rs_{uuid.uuid4().hex}", content=[{"type": "reasoning_text", "text": text}], status=status
    )


def _usage(usage: Usage | None) -> ResponseUsage | None:
    if usage is None:
        return None
    return ResponseUsage(
        input_tokens=usage.prompt_tokens,
        output_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        input_tokens_details={"cached_tokens": usage.prompt_tokens_details.cached_tokens},
    )


class _StreamItems:
    """The output items of a streamed response and the events that open, fill and close them
    (one item open at a time: reasoning, a message or a function call)."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[ResponseReasoningItem | ResponseMessageItem | ResponseFunctionCallItem] = []
        self.thinking: ResponseReasoningItem | None = None
        self.message: ResponseMessageItem | None = None
        self.call: ResponseFunctionCallItem | None = None

    def event(self, kind: str, **data: Any) -> ServerSentEventMessage:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return ServerSentEventMessage(event=kind, data=msgspec.json.encode(body).decode())

    def close_open(self) -> list[ServerSentEventMessage]:
        event = self.event
        events: list[ServerSentEventMessage] = []
        index = len(self.output) - 1
        if self.thinking is not None:
            thinking = self.thinking
            ids = {"item_id": thinking.id, "output_index": index, "content_index": 0}
            events.append(event("response.reasoning_text.done", **ids, text=thinking.content[0]["text"]))
            thinking.status = "completed"
            events.append(event("response.output_item.done", output_index=index, item=thinking))
            self.thinking = None
        if self.message is not None:
            message = self.message
            part = message.content[0]
            ids = {"item_id": message.id, "output_index": index, "content_index": 0}
            events.append(event("response.output_text.done", **ids, text=part.text, logprobs=[]))
            events.append(event("response.content_part.done", **ids, part=part))
            message.status = "completed"
            events.append(event("response.output_item.done", output_index=index, item=message))
            self.message = None
        if self.call is not None:
            call = self.call
            events.append(
                event(
                    "response.function_call_arguments.done",
                    item_id=call.id,
                    output_index=index,
                    name=call.name,
                    arguments=call.arguments,
                )
            )
            call.status = "completed"
            events.append(event("response.output_item.done", output_index=index, item=call))
            self.call = None
        return events

    def reasoning(self, delta: str) -> list[ServerSentEventMessage]:
        events: list[ServerSentEventMessage] = []
        if self.thinking is None:
            events += self.close_open()
            self.thinking = _reasoning_item("", status="in_progress")
            self.output.append(self.thinking)
            shown = ResponseReasoningItem(id=self.thinking.id, content=[], status="in_progress")
            events.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                     item=shown))
        self.thinking.content[0]["text"] += delta
        events.append(self.event(
            "response.reasoning_text.delta",
            item_id=self.thinking.id,
            output_index=len(self.output) - 1,
            content_index=0,
            delta=delta,
        ))
        return events

    def text(self, delta: str) -> list[ServerSentEventMessage]:
        events: list[ServerSentEventMessage] = []
        if self.message is None:
            events += self.close_open()
            self.message = ResponseMessageItem(
                id=f"msg_{uuid.uuid4().hex}",
                content=[ResponseOutputText(text="")],
                status="in_progress",
            )
            self.output.append(self.message)
            index = len(self.output) - 1
            events.append(self.event(
                "response.output_item.added",
                output_index=index,
                item=ResponseMessageItem(id=self.message.id, content=[], status="in_progress"),
            ))
            events.append(self.event(
                "response.content_part.added",
                item_id=self.message.id,
                output_index=index,
                content_index=0,
                part=ResponseOutputText(text=""),
            ))
        self.message.content[0].text += delta
        events.append(self.event(
            "response.output_text.delta",
            item_id=self.message.id,
            output_index=len(self.output) - 1,
            content_index=0,
            delta=delta,
            logprobs=[],
        ))
        return events

    def tool_call(self, name: str | None, call_id: str | None, arguments: str | None,
                  ) -> list[ServerSentEventMessage]:
        events: list[ServerSentEventMessage] = []
        if name is not None:
            events += self.close_open()
            self.call = ResponseFunctionCallItem(
                id=f"fc_{uuid.uuid4().hex}",
                call_id=call_id or f"call_{uuid.uuid4().hex}",
                name=name,
                arguments="",
                status="in_progress",
            )
            self.output.append(self.call)
            events.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                     item=self.call))
        elif arguments and self.call is not None:
            self.call.arguments += arguments
            events.append(self.event(
                "response.function_call_arguments.delta",
                item_id=self.call.id,
                output_index=len(self.output) - 1,
                delta=arguments,
            ))
        return events


class ResponsesEndpoint:
    """``POST /v1/responses``: a chat turn of the chat endpoint, answered as a Responses object
    or event stream."""

    def __init__(self, chat: ChatEndpoint) -> None:
        self.chat = chat

    def _responses_chat(self, req: ResponsesRequest, renames: dict[str, str]) -> ChatCompletionRequest:
        if req.previous_response_id is not None:
            raise InvalidRequestError(
                "previous_response_id is not supported: this server stores no responses (retrieval is not "
                "supported); send the whole conversation in input",
                param="previous_response_id",
            )
        for name in ("background", "conversation", "prompt"):
            if getattr(req, name) not in (None, False):
                raise InvalidRequestError(
                    f"{name} is not supported: this server stores no responses, conversations or "
                    "prompts; send the whole request",
                    param=name,
                )
        if req.max_output_tokens is not None and req.max_output_tokens < 1:
            raise InvalidRequestError("max_output_tokens must be at least 1", param="max_output_tokens")
        tools, choice = _tools(req)
        return ChatCompletionRequest(
            model=req.model,
            messages=_conversation(req, renames),
            max_completion_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            stream=req.stream,
            tools=tools,
            tool_choice=choice,
            keep_alive=req.keep_alive,
            cache_salt=req.cache_salt,
            response_format=_response_format(req),
        )

    def _response(self, req: ResponsesRequest, rid: str, created: int, **fields: Any) -> ResponseObject:
        return ResponseObject(
            id=rid,
            created_at=created,
            model=req.model,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
            tools=[msgspec.to_builtins(t) for t in req.tools or []],
            parallel_tool_calls=req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            metadata=dict(req.metadata or {}),
            store=req.store,
            **fields,
        )

    async def create_response(
        self, req: ResponsesRequest
    ) -> ResponseObject | AsyncIterator[ServerSentEventMessage]:
        """``POST /v1/responses``: a response object, or the Responses event stream."""
        async with self.chat.pool.hold(req.model, keep_alive=req.keep_alive) as held:
            renames = dict(_RENAMED)
            with renamed_params(_RENAMED):  # the image renames are for the chat turn's errors only
                chat_req = self._responses_chat(req, renames)
            with renamed_params(renames):
                turn = await self.chat.start_turn(held.handle, chat_req)
            rid, created = f"resp_{uuid.uuid4().hex}", int(time.time())
            if turn.stream:
                return held.held_by(closing(turn.runs, self._response_stream(turn, req, rid, created)))
            return await self._response_object(turn, req, rid, created)

    async def _response_object(
        self, turn: ChatTurn, req: ResponsesRequest, rid: str, created: int
    ) -> ResponseObject:
        (result,), usage = await self.chat.results(turn)
        output: list[ResponseReasoningItem | ResponseMessageItem | ResponseFunctionCallItem] = []
        if result.reasoning:
            output.append(_reasoning_item(result.reasoning))
        if result.content:
            output.append(
                ResponseMessageItem(
                    id=f"msg_{uuid.uuid4().hex}", content=[ResponseOutputText(text=result.content)]
                )
            )
        for call in result.tool_calls:
            output.append(
                ResponseFunctionCallItem(
                    id=f"fc_{uuid.uuid4().hex}", call_id=call.id, name=call.name, arguments=call.arguments
                )
            )
        incomplete = result.finish_reason == "length"
        return self._response(
            req,
            rid,
            created,
            status="incomplete" if incomplete else "completed",
            output=output,
            usage=_usage(usage),
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
        )

    async def _response_stream(
        self, turn: ChatTurn, req: ResponsesRequest, rid: str, created: int
    ) -> AsyncIterator[ServerSentEventMessage]:
        items = _StreamItems()
        event = items.event
        finish = "stop"
        try:
            started = self._response(req, rid, created, status="in_progress", output=[])
            yield event("response.created", response=started)
            yield event("response.in_progress", response=started)
            async for d in self.chat.deltas(turn):
                if d.reasoning:
                    for e in items.reasoning(d.reasoning):
                        yield e
                if d.content:
                    for e in items.text(d.content):
                        yield e
                for ev in d.tool_calls:
                    for e in items.tool_call(ev.name, ev.id, ev.arguments):
                        yield e
                if d.finish_reason is not None:
                    finish = d.finish_reason
            for e in items.close_open():
                yield e
            incomplete = finish == "length"
            done = self._response(
                req,
                rid,
                created,
                status="incomplete" if incomplete else "completed",
                output=items.output,
                usage=_usage(turn.usage),
                incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            )
            yield event("response.incomplete" if incomplete else "response.completed", response=done)
        except OpenAIError as exc:
            # Headers are sent: a failure mid-stream can only be reported in the stream.
            yield event("error", code=exc.code or exc.type, message=exc.message, param=exc.param)
        finally:
            for run in turn.runs:
                run.close()
