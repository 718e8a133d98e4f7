"""``/v1/chat/completions`` over the model pool: messages -> chat template -> response or SSE,
with the reasoning and tool-call parsers of the model's handle."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from inference.images.features import PromptImage
from inference.openai.constraints import guided_grammar, response_format_grammar
from inference.openai.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    OpenAIError,
    error_body,
)
from inference.openai.handle import DONE, ModelHandle, to_json, usage_of
from inference.openai.images import (
    ImagePart,
    check_image_tokens,
    check_parts,
    expand_placeholders,
    image_parts,
    load_images,
    prompt_images,
    refuse_text_only,
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
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    NamedToolChoice,
    ResponseMessage,
    ToolCall,
    TopLogprobEntry,
    Usage,
)
from inference.openai.tool_parsers import (
    TOOL_PARSERS,
    ParsedToolCall,
    ToolCallEvent,
    ToolParser,
    ToolStream,
    forced_call_stream,
)
from inference.serving.engine_client import ChoiceRun, closing, collect_all, first_outputs, interleave
from inference.serving.generation import StepOutput, TokenLogprob
from inference.serving.generation_spec import GenerationSpec
from inference.serving.model_pool import ModelPool

__all__ = ["ChatDelta", "ChatEndpoint", "ChatResult", "ChatTurn", "check_text_length", "encode"]

#: ``apply_chat_template`` arguments a client may not override through ``chat_template_kwargs``.
_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "self"})


@dataclass
class ChatTurn:
    """A submitted chat request: its model, generation spec, rendered prompt, tool parsing and
    running choices."""

    handle: ModelHandle
    spec: GenerationSpec
    prompt: str
    tools: list[dict[str, Any]]
    tool_parser: ToolParser | None
    runs: list[ChoiceRun]
    #: A grammar forces tool calls (named ``tool_choice`` or ``required``): parse them as such.
    forced: bool = False
    #: The answer is streamed (``stream``), ending with the usage (``stream_options.include_usage``).
    stream: bool = False
    include_usage: bool = False
    #: Streamed turns: every choice's first output (awaited before the answer starts).
    firsts: list[StepOutput] | None = None
    #: Streamed turns: set when every choice has ended.
    usage: Usage | None = None


@dataclass(frozen=True)
class ChatResult:
    """One finished choice, parsed: content, reasoning, tool calls and why it ended."""

    index: int
    content: str | None
    reasoning: str | None
    tool_calls: list[ParsedToolCall]
    #: ``stop`` | ``length`` | ``tool_calls``
    finish_reason: str
    #: The stop string that ended it, if one did.
    stop_string: str | None
    logprobs: list[TokenLogprob]
    last: StepOutput


@dataclass(frozen=True)
class ChatDelta:
    """A piece of one streamed choice; the last one of a choice has its ``finish_reason``."""

    index: int
    content: str = ""
    reasoning: str = ""
    tool_calls: tuple[ToolCallEvent, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    stop_string: str | None = None


@dataclass(frozen=True)
class _ToolPlan:
    """What a request does with tools: the template's tools, the output's parser, forcing."""

    tools: list[dict[str, Any]] | None
    parser: ToolParser | None
    forced: bool = False  # a grammar forces tool calls (named tool_choice or "required")
    name: str | None = None  # the one function a named tool_choice forces


class ChatEndpoint:
    """``POST /v1/chat/completions`` over the model pool; also the chat turn (template, submit,
    parsed results and deltas) that ``/v1/messages``, ``/v1/responses`` and ``/tokenize`` share."""

    def __init__(self, pool: ModelPool[ModelHandle]) -> None:
        self.pool = pool

    def check_size(self, handle: ModelHandle, messages: Sequence[ChatMessage]) -> None:
        """Refuse, before any template work, a conversation that cannot fit the input limit.

        Every chat template renders at least one token (a role marker) per message, and the
        text of the messages at most ``max_token_chars`` characters per token.
        """
        limit = handle.options.max_input_len
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
        check_text_length(handle, chars, "messages")

    async def create_chat_completion(
        self, req: ChatCompletionRequest
    ) -> ChatCompletionResponse | AsyncIterator[str]:
        """``POST /v1/chat/completions``: a response, or an iterator of SSE data strings."""
        async with self.pool.hold(req.model, keep_alive=req.keep_alive) as held:
            turn = await self.start_turn(held.handle, req)
            rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
            if turn.stream:
                return held.held_by(closing(turn.runs, self._chat_stream(turn, rid, created, req.model)))
            return await self._chat_response(turn, req, rid, created)

    async def start_turn(self, handle: ModelHandle, req: ChatCompletionRequest) -> ChatTurn:
        """Validate, render the template, tokenize, convert the request into its generation spec
        and run the spec's ``n`` choices.

        Shared by every chat-shaped surface (``/v1/chat/completions``, ``/v1/messages``,
        ``/v1/responses``); a streamed turn has waited for every choice's first output already.
        """
        handle.client.check_admitting()
        req.check_supported()
        self.check_size(handle, req.messages)
        check_image_parts(handle, req.messages)
        tool_plan = _tool_setup(handle, req)
        tools = tool_plan.tools
        grammar = await _output_grammar(handle, req, tool_plan)
        rendered = await self.prompt_ids(
            handle,
            req.messages,
            tools=tools,
            add_generation_prompt=req.add_generation_prompt,
            chat_template_kwargs=req.chat_template_kwargs,
        )
        handle.check_generates()
        spec = req.to_spec(
            rendered.ids,
            handle.client.limits,
            prompt_param="messages",
            grammar=grammar,
            adapter=handle.lora_names.get(req.model),
        )
        if handle.vision is not None and rendered.parts:
            images = await prompt_images(handle.vision, rendered.parts, rendered.positions,
                                         handle.options.media, handle.image_cache, rendered.loaded,
                                         prompt_length=len(rendered.ids))
            spec = dataclasses.replace(spec, images=images)
        turn = ChatTurn(
            handle=handle,
            spec=spec,
            prompt=rendered.text,
            tools=tools or [],
            tool_parser=tool_plan.parser,
            runs=await handle.client.generate(spec),
            forced=tool_plan.forced,
            stream=req.stream,
            include_usage=req.stream_usage,
        )
        if turn.stream:
            turn.firsts = await first_outputs(turn.runs)
        return turn

    async def prompt_ids(
        self,
        handle: ModelHandle,
        messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
        add_special_tokens: bool = False,
    ) -> RenderedPrompt:
        """The prompt of ``messages`` as a chat turn runs it: the template applied, tokenized, and
        for a vision-language model each image placeholder replaced by its image tokens (the
        images are decoded here only where their size sets their tokens). Shared by the chat turn,
        ``/tokenize`` and ``/v1/messages/count_tokens``, so they count the same tokens."""
        parts = check_image_parts(handle, messages)
        vision = handle.vision
        prompt = await self.render(
            handle,
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
            parts_form=vision is not None,
        )
        # With images: the text as the model's processor tokenizes it (Gemma 3 adds newlines).
        text = vision.prompt_text(prompt) if vision is not None and parts else prompt
        ids = await encode(handle, text, add_special_tokens=add_special_tokens, param="messages")
        positions = np.zeros(0, np.int64)
        loaded: list[PromptImage] | None = None
        if vision is not None:
            # A family whose images take a fixed number of tokens is counted without reading them;
            # the others are read, decoded and prepared here (their tokens follow the image's size).
            if vision.tokens_per_image is None and parts:
                loaded = await load_images(vision, parts, handle.options.media)
                expansions: list[tuple[int, ...]] = [im.tokens for im in loaded]
            else:
                expansions = [vision.fixed_tokens()] * len(parts) if parts else []
            check_image_tokens(parts, expansions, vision, len(ids), handle.options.max_input_len)
            ids, positions = expand_placeholders(ids, vision, expansions)
        return RenderedPrompt(prompt, ids, parts, positions, loaded)

    async def render(
        self,
        handle: ModelHandle,
        messages: Sequence[ChatMessage],
        *,
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: dict[str, Any] | None,
        parts_form: bool = False,
    ) -> str:
        """The chat template applied to ``messages`` (off the event loop); ``parts_form`` (a
        vision-language model): every content as a list of parts, images as ``{"type": "image"}``,
        the form transformers' processors give their templates."""
        kwargs = dict(chat_template_kwargs or {})
        reserved = sorted(_RESERVED_TEMPLATE_KWARGS & kwargs.keys())
        if reserved:
            raise InvalidRequestError(
                f"chat_template_kwargs may not set {', '.join(reserved)}: they come from the request's "
                "own fields (messages, tools, add_generation_prompt)",
                param="chat_template_kwargs",
            )
        converted = _template_messages(messages, parts_form=parts_form)

        def render() -> str:
            return handle.tokenizer.apply_chat_template(
                converted, tools=tools, add_generation_prompt=add_generation_prompt, **kwargs
            )

        return await asyncio.to_thread(render)

    async def results(self, turn: ChatTurn) -> tuple[list[ChatResult], Usage]:
        """Every choice of a non-streamed turn, parsed (reasoning, tool calls), and the usage."""
        handle = turn.handle
        outcomes = await collect_all(turn.runs)
        results: list[ChatResult] = []
        for index, (text, lps, last) in enumerate(outcomes):
            reasoning: str | None = None
            content: str | None = text
            if handle.reasoning is not None:
                reasoning, content = handle.reasoning.extract(text, turn.prompt)
            calls: list[ParsedToolCall] = []
            if turn.forced and turn.tool_parser is not None and content is not None:
                forced = forced_call_stream(turn.tool_parser, turn.tools)
                rest = forced.feed(content)[0] + forced.finish()[0]
                calls = list(forced.calls)
                content = None if calls and not rest.strip() else content
            elif turn.tool_parser is not None and content is not None:
                content, calls = turn.tool_parser.extract(content, turn.tools)
            finish = last.finish_reason or "stop"
            if calls and finish == "stop":
                finish = "tool_calls"
            results.append(ChatResult(index, content, reasoning, calls, finish, last.stop_string, lps, last))
        return results, usage_of(*(r.last for r in results))

    async def deltas(self, turn: ChatTurn) -> AsyncIterator[ChatDelta]:
        """The deltas of a streamed turn, choice by choice as they arrive; each choice's last
        delta carries its finish reason (``tool_calls`` when it called one) and ``turn.usage``
        is set once all ended. Raises the OpenAI error that ended a choice."""
        assert turn.firsts is not None
        parser = turn.handle.reasoning
        reasonings = [
            parser.stream(turn.prompt) if parser is not None else None
            for _ in turn.runs
        ]
        maker = forced_call_stream if turn.forced else ToolParser.stream
        tool_streams: list[ToolStream | None] = [
            maker(turn.tool_parser, turn.tools) if turn.tool_parser is not None else None for _ in turn.runs
        ]
        called = [False] * len(turn.runs)
        lasts: list[StepOutput] = list(turn.firsts)
        async for i, out in interleave(turn.runs, turn.firsts):
            reasoning, tool_stream = reasonings[i], tool_streams[i]
            r, c = reasoning.feed(out.text) if reasoning is not None else ("", out.text)
            if out.finished and reasoning is not None:
                r2, c2 = reasoning.finish()
                r, c = r + r2, c + c2
            events: list[ToolCallEvent] = []
            if tool_stream is not None:
                c, events = tool_stream.feed(c)
                if out.finished:
                    c2, e2 = tool_stream.finish()
                    c, events = c + c2, events + e2
            called[i] = called[i] or bool(events)
            finish = out.finish_reason
            if called[i] and finish == "stop":
                finish = "tool_calls"
            lps = out.logprobs if turn.spec.logprobs else ()
            lasts[i] = out
            if r or c or events or lps or finish is not None:
                yield ChatDelta(i, c, r, tuple(events), tuple(lps), finish, out.stop_string)
        turn.usage = usage_of(*lasts)

    async def _chat_response(
        self, turn: ChatTurn, req: ChatCompletionRequest, rid: str, created: int
    ) -> ChatCompletionResponse:
        results, usage = await self.results(turn)
        choices = [
            ChatCompletionChoice(
                index=r.index,
                message=ResponseMessage(
                    content=r.content,
                    reasoning_content=r.reasoning,
                    tool_calls=[
                        ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                        for c in r.tool_calls
                    ]
                    or None,
                ),
                finish_reason=r.finish_reason,
                logprobs=_chat_logprobs(r.logprobs) if turn.spec.logprobs else None,
            )
            for r in results
        ]
        return ChatCompletionResponse(id=rid, created=created, model=req.model, choices=choices, usage=usage)

    async def _chat_stream(self, turn: ChatTurn, rid: str, created: int, model: str) -> AsyncIterator[str]:
        def chunk(
            index: int, delta: DeltaMessage, finish: str | None = None, lps: ChatLogprobs | None = None
        ) -> str:
            choice = ChatCompletionStreamChoice(index=index, delta=delta, finish_reason=finish, logprobs=lps)
            response = ChatCompletionStreamResponse(id=rid, created=created, model=model, choices=[choice])
            return to_json(response)

        try:
            for index in range(len(turn.runs)):
                yield chunk(index, DeltaMessage(role="assistant", content=""))
            async for d in self.deltas(turn):
                lps = _chat_logprobs(d.logprobs) if d.logprobs else None
                if d.reasoning or d.content or lps is not None:
                    yield chunk(
                        d.index,
                        DeltaMessage(content=d.content or None, reasoning_content=d.reasoning or None),
                        lps=lps,
                    )
                for ev in d.tool_calls:
                    fn = DeltaFunctionCall(
                        name=ev.name, arguments="" if ev.name is not None else ev.arguments
                    )
                    dtc = DeltaToolCall(
                        index=ev.index, function=fn, id=ev.id, type="function" if ev.id is not None else None
                    )
                    yield chunk(d.index, DeltaMessage(tool_calls=[dtc]))
                if d.finish_reason is not None:
                    yield chunk(d.index, DeltaMessage(), finish=d.finish_reason)
            if turn.include_usage and turn.usage is not None:
                yield to_json(
                    ChatCompletionStreamResponse(
                        id=rid, created=created, model=model, choices=[], usage=turn.usage
                    )
                )
        except OpenAIError as exc:
            # Headers are sent: a failure mid-stream can only be reported in the stream.
            yield to_json(error_body(exc))
        finally:
            for run in turn.runs:
                run.close()
        yield DONE


def check_text_length(handle: ModelHandle, chars: int, param: str) -> None:
    """Refuse, before tokenizing, text that cannot fit the model's ``max_input_len`` tokens.

    Tokenizing takes time proportional to the text; a prompt of many megabytes must be refused at
    the cost of a ``len``, not after seconds of work. Every prompt of every surface passes here.
    """
    limit = handle.max_prompt_chars
    if chars > limit:
        raise ContextLengthExceededError(
            f"the prompt has {chars} characters, more than this model's {handle.options.max_input_len} "
            f"input tokens can hold (at most {limit} characters); shorten it",
            param=param,
        )


async def encode(handle: ModelHandle, text: str, *, add_special_tokens: bool, param: str) -> list[int]:
    """Length check, then tokenize in a worker thread (the event loop keeps serving)."""
    check_text_length(handle, len(text), param)
    return await asyncio.to_thread(handle.tokenizer.encode, text, add_special_tokens=add_special_tokens)


@dataclass(frozen=True)
class RenderedPrompt:
    """A chat prompt ready to run: its text, its ids (image tokens expanded), its image parts and
    the positions of their rows in ``ids``."""

    text: str
    ids: list[int]
    parts: list[ImagePart]
    positions: np.ndarray
    #: the images read and prepared, where counting them needed it (else None: the turn reads them)
    loaded: list[PromptImage] | None = None


def check_image_parts(handle: ModelHandle, messages: Sequence[ChatMessage]) -> list[ImagePart]:
    """The image parts of ``messages``, refused before any work where the model takes text only,
    where there are too many, or where a URL is not an image this server reads."""
    parts = image_parts(messages)
    if parts and handle.vision is None:
        refuse_text_only(messages, handle.options.served_model_name)
    check_parts(parts, handle.options.media)
    return parts


def _content_parts(m: ChatMessage) -> list[dict[str, Any]]:
    """A message's content as a vision-language template takes it: a list of text and image parts."""
    if m.content is None:
        return []
    if isinstance(m.content, str):
        return [{"type": "text", "text": m.content}]
    return [{"type": "image"} if part.type == "image_url" else {"type": "text", "text": part.text or ""}
            for part in m.content]


def _template_messages(messages: Sequence[ChatMessage], *, parts_form: bool = False) -> list[dict[str, Any]]:
    """The messages as the chat template takes them (text parts joined, or with ``parts_form`` a
    list of parts; tool-call arguments as mappings)."""
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
        content: str | list[dict[str, Any]] | None
        if parts_form:
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if part.type not in ("text", "image_url") or (part.type == "text" and part.text is None):
                    raise InvalidRequestError(
                        f"messages[{i}].content[{j}] has type {part.type!r}; text and image_url parts are "
                        "supported", param=f"messages[{i}].content[{j}].type")
            content = _content_parts(m) if m.content is not None else None
        elif isinstance(m.content, list):
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
        msg: dict[str, Any] = {"role": role,
                               "content": content if content is not None else ([] if parts_form else "")}
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



def _tool_setup(handle: ModelHandle, req: ChatCompletionRequest) -> _ToolPlan:
    """Tools for the template, the parser of the output, and whether a call is forced.

    As in vLLM, a named ``tool_choice`` and ``required`` are enforced by a grammar and need
    no ``--enable-auto-tool-choice``; without a configured parser the forced call is written
    (and parsed) in the ``generic`` JSON format.
    """
    tools = [msgspec.to_builtins(t) for t in req.tools] if req.tools else None
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, NamedToolChoice):
        if not tools:
            raise InvalidRequestError("a named tool_choice needs tools", param="tool_choice")
        parser = handle.tool_parser or TOOL_PARSERS["generic"]
        return _ToolPlan(tools, parser, forced=True, name=choice.function.name)
    if choice not in ("none", "auto", "required"):
        raise InvalidRequestError(
            f"tool_choice must be 'none', 'auto', 'required' or a named function; got {choice!r}",
            param="tool_choice",
        )
    if choice == "none":
        return _ToolPlan(tools, None)
    if not tools:
        raise InvalidRequestError(f"tool_choice={choice!r} needs tools", param="tool_choice")
    if choice == "required":
        return _ToolPlan(tools, handle.tool_parser or TOOL_PARSERS["generic"], forced=True)
    if not handle.options.enable_auto_tool_choice or handle.tool_parser is None:
        raise InvalidRequestError(
            f"tool_choice={choice!r} needs the server to run with --enable-auto-tool-choice and a "
            f"--tool-call-parser (this one: {handle.tool_call_parser_name})",
            param="tool_choice",
        )
    return _ToolPlan(tools, handle.tool_parser)



async def _output_grammar(handle: ModelHandle, req: ChatCompletionRequest, plan: _ToolPlan) -> str | None:
    """The grammar the output must follow: a forced tool call, or ``response_format``."""
    rf, client = req.response_format, handle.client
    if not plan.forced or plan.parser is None:
        taken = "response_format" if rf is not None and rf.type != "text" else None
        return await guided_grammar(client, req, taken) or await response_format_grammar(client, rf)
    if rf is not None and rf.type != "text":
        raise InvalidRequestError(
            "response_format cannot constrain the output when tool_choice forces a tool call",
            param="response_format",
        )
    await guided_grammar(client, req, "tool_choice")  # refuses a second constraint
    tools, fmt, name = plan.tools or [], plan.parser.name, plan.name
    parallel = name is None and req.parallel_tool_calls is not False
    grammar: str = await client.compile_grammar(
        lambda: client.grammars.tool_call_grammar(tools, call_format=fmt, name=name, parallel=parallel),
        param="tool_choice",
    )
    return grammar


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
