"""Tool-call parsers: model output text -> OpenAI ``tool_calls``.

Like the reasoning parsers, each one is a stream (content deltas in; content text and
tool-call events out), and the non-streamed result is the stream run over the whole text.
A call is reported once it is complete: first an event with its id and name, then one with its
arguments (a JSON string). Text that looks like a call but does not parse stays content.
Output that a grammar forced into a parser's format (``tool_choice`` named or ``required``, see
``inference.serving.structured``) is split by :func:`forced_call_stream` instead, which reports the
header as soon as the name is known and then the arguments piece by piece.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number of them.
- ``qwen3_xml``: ``<tool_call><function=NAME><parameter=P>VALUE</parameter></function></tool_call>``;
  values are typed from the tool's JSON schema (strings stay strings).
- ``generic``: the whole output is one JSON object ``{"name", "arguments"|"parameters"}`` or a
  list of them (an optional leading ``[TOOL_CALLS]`` marker, as Mistral writes, is accepted).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from inference.serving.generation import held_suffix_length

__all__ = [
    "TOOL_PARSERS",
    "TOOL_PARSER_CHOICES",
    "ParsedToolCall",
    "ToolCallEvent",
    "ToolParser",
    "ToolStream",
    "forced_call_stream",
    "get_tool_parser",
]

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
UNSUPPORTED_TOOL_PARSERS = frozenset({"openai", "nemotron", "pythonic", "llama3_json", "mistral"})


@dataclass(frozen=True)
class ParsedToolCall:
    """A complete call: ``arguments`` is a JSON object serialized as a string."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallEvent:
    """A streamed piece of call ``index``: the header (id + name) or the arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _arguments_json(value: object) -> str | None:
    if value is None:
        return "{}"
    if isinstance(value, str):
        # Some models double-encode the arguments; keep them only if they are a JSON object.
        try:
            inner = json.loads(value)
        except ValueError:
            return None
        return json.dumps(inner, ensure_ascii=False) if isinstance(inner, dict) else None
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    return None


def _call_from_object(obj: object) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = _arguments_json(obj.get("arguments", obj.get("parameters")))
    if args is None:
        return None
    return obj["name"], args


def _parse_hermes_body(body: str, tools: Mapping[str, Mapping[str, Any]]) -> tuple[str, str] | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    return _call_from_object(obj)


_FUNCTION_RE = re.compile(r"<function=([^>\s]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAMETER_RE = re.compile(r"<parameter=([^>\s]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _typed_value(raw: str, schema: Mapping[str, Any] | None) -> object:
    # The XML format writes every value as text; the tool schema says what it should be.
    value = raw[1:] if raw.startswith("\n") else raw
    value = value[:-1] if value.endswith("\n") else value
    kind = schema.get("type") if schema else None
    if kind == "string" or kind is None:
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _parse_xml_body(body: str, tools: Mapping[str, Mapping[str, Any]]) -> tuple[str, str] | None:
    m = _FUNCTION_RE.search(body)
    if m is None:
        return None
    name, inner = m.group(1), m.group(2)
    props = tools.get(name, {}).get("properties", {})
    args: dict[str, object] = {}
    for pm in _PARAMETER_RE.finditer(inner):
        pname = pm.group(1)
        args[pname] = _typed_value(pm.group(2), props.get(pname) if isinstance(props, Mapping) else None)
    return name, json.dumps(args, ensure_ascii=False)


BodyParser = Callable[[str, Mapping[str, Mapping[str, Any]]], "tuple[str, str] | None"]


class ToolStream:
    """Stateful tool-call splitter for one response."""

    def feed(self, text: str) -> tuple[str, list[ToolCallEvent]]:
        """Return ``(content delta, call events)`` for one content delta."""
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCallEvent]]:
        """Flush at the end of the output."""
        raise NotImplementedError

    @property
    def calls(self) -> list[ParsedToolCall]:
        """The calls completed so far."""
        raise NotImplementedError


class _TaggedStream(ToolStream):
    """``<tool_call>BODY</tool_call>`` framing; the body format is pluggable."""

    def __init__(self, parse_body: BodyParser, tools: Mapping[str, Mapping[str, Any]]) -> None:
        self._parse = parse_body
        self._tools = tools
        self._in_call = False
        self._held = ""  # partial start tag outside a call, or the body inside one
        self._pending_ws = ""  # whitespace after a call: dropped unless more content follows
        self._calls: list[ParsedToolCall] = []

    @property
    def calls(self) -> list[ParsedToolCall]:
        return list(self._calls)

    def _content(self, text: str) -> str:
        if not self._calls:
            return text
        text = self._pending_ws + text
        stripped = text.rstrip()
        self._pending_ws = text[len(stripped) :]
        return stripped if stripped.strip() else ""

    def _close_call(self, body: str) -> tuple[str, list[ToolCallEvent]]:
        parsed = self._parse(body, self._tools)
        if parsed is None:
            return self._content(CALL_START + body + CALL_END), []
        call = ParsedToolCall(_new_call_id(), parsed[0], parsed[1])
        index = len(self._calls)
        self._calls.append(call)
        return "", [
            ToolCallEvent(index, id=call.id, name=call.name),
            ToolCallEvent(index, arguments=call.arguments),
        ]

    def feed(self, text: str) -> tuple[str, list[ToolCallEvent]]:
        content: list[str] = []
        events: list[ToolCallEvent] = []
        buf = self._held + text
        self._held = ""
        while buf:
            if self._in_call:
                idx = buf.find(CALL_END)
                if idx < 0:
                    self._held = buf
                    break
                self._in_call = False
                c, e = self._close_call(buf[:idx])
                content.append(c)
                events.extend(e)
                buf = buf[idx + len(CALL_END) :]
            else:
                idx = buf.find(CALL_START)
                if idx >= 0:
                    content.append(self._content(buf[:idx]))
                    self._in_call = True
                    buf = buf[idx + len(CALL_START) :]
                else:
                    hold = held_suffix_length(buf, (CALL_START,))
                    content.append(self._content(buf[: len(buf) - hold]))
                    self._held = buf[len(buf) - hold :]
                    break
        return "".join(content), events

    def finish(self) -> tuple[str, list[ToolCallEvent]]:
        held, self._held = self._held, ""
        if self._in_call:
            # The model stopped before closing the tag: keep the call if its body is complete.
            self._in_call = False
            parsed = self._parse(held, self._tools)
            if parsed is not None:
                return self._close_call(held)
            return self._content(CALL_START + held), []
        return self._content(held), []


class _WholeOutputJsonStream(ToolStream):
    """``generic``: decide from the first non-blank character whether the output is JSON."""

    _MARKER = "[TOOL_CALLS]"

    def __init__(self) -> None:
        self._mode = "start"
        self._buf = ""
        self._calls: list[ParsedToolCall] = []

    @property
    def calls(self) -> list[ParsedToolCall]:
        return list(self._calls)

    def feed(self, text: str) -> tuple[str, list[ToolCallEvent]]:
        if self._mode == "content":
            return text, []
        self._buf += text
        if self._mode == "start":
            head = self._buf.lstrip()
            if not head or self._MARKER.startswith(head):
                return "", []
            if head.startswith(("{", "[", self._MARKER)):
                self._mode = "json"
                return "", []
            self._mode = "content"
            out, self._buf = self._buf, ""
            return out, []
        return "", []

    def finish(self) -> tuple[str, list[ToolCallEvent]]:
        raw, self._buf = self._buf, ""
        if self._mode != "json":
            return raw, []
        body = raw.strip()
        body = body.removeprefix(self._MARKER).strip()
        try:
            obj = json.loads(body)
        except ValueError:
            return raw, []
        items = obj if isinstance(obj, list) else [obj]
        parsed = [_call_from_object(item) for item in items]
        if not items or any(p is None for p in parsed):
            return raw, []
        events: list[ToolCallEvent] = []
        for p in parsed:
            assert p is not None
            call = ParsedToolCall(_new_call_id(), p[0], p[1])
            index = len(self._calls)
            self._calls.append(call)
            events += [ToolCallEvent(index, id=call.id, name=call.name), ToolCallEvent(index, arguments=p[1])]
        return "", events


# The head of a JSON call up to its arguments, as a forcing grammar writes it (at most one space).
_CALL_HEAD_RE = re.compile(r'"name": ?("(?:[^"\\]|\\.)*"), ?"arguments": ?')


class _ForcedJsonCallStream(ToolStream):
    """Calls whose framing a grammar forced (``generic``, ``hermes``): the header goes out as
    soon as the name is complete, then the arguments piece by piece as they are generated.

    The arguments' end is found by scanning their JSON (strings, escapes, nesting); whatever is
    not arguments is framing and never content.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._in_args = False
        self._depth = 0
        self._in_str = False
        self._escaped = False
        self._started = False
        self._call: tuple[str, str] | None = None
        self._args: list[str] = []
        self._calls: list[ParsedToolCall] = []

    @property
    def calls(self) -> list[ParsedToolCall]:
        return list(self._calls)

    def _value_end(self, text: str) -> int | None:
        """Index just past the end of the arguments value in ``text``, or None if it goes on."""
        for i, ch in enumerate(text):
            if self._in_str:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_str = False
                    if self._depth == 0:
                        return i + 1
            elif ch == '"':
                self._in_str = self._started = True
            elif ch in "{[":
                self._depth += 1
                self._started = True
            elif ch in "}]":
                self._depth -= 1
                if self._depth <= 0:
                    return i + 1 if self._depth == 0 else i
            elif ch == "," and self._depth == 0 and self._started:
                return i
            elif not ch.isspace():
                self._started = True
        return None

    def feed(self, text: str) -> tuple[str, list[ToolCallEvent]]:
        events: list[ToolCallEvent] = []
        index = len(self._calls)
        while text:
            if not self._in_args:
                self._buf += text
                m = _CALL_HEAD_RE.search(self._buf)
                if m is None:
                    break
                text, self._buf = self._buf[m.end() :], ""
                self._call = (_new_call_id(), str(json.loads(m.group(1))))
                events.append(ToolCallEvent(index, id=self._call[0], name=self._call[1]))
                self._in_args, self._depth, self._in_str, self._escaped = True, 0, False, False
                self._started = False
                continue
            end = self._value_end(text)
            piece = text if end is None else text[:end]
            if piece:
                self._args.append(piece)
                events.append(ToolCallEvent(index, arguments=piece))
            if end is None:
                break
            assert self._call is not None
            self._calls.append(ParsedToolCall(self._call[0], self._call[1], "".join(self._args).strip()))
            self._args, self._in_args, text = [], False, text[end:]
            index += 1
        return "", events

    def finish(self) -> tuple[str, list[ToolCallEvent]]:
        # A call cut short (max_tokens) is not reported as a call; its pieces were streamed.
        self._buf = ""
        return "", []


def forced_call_stream(parser: ToolParser, tools: Sequence[Mapping[str, Any]] = ()) -> ToolStream:
    """The splitter for output a tool-call grammar forced into ``parser``'s format.

    JSON formats stream the arguments piece by piece (as vLLM does); the XML format types its
    values from the schema, so its arguments come whole when the call is complete.
    """
    if parser.name in ("generic", "hermes"):
        return _ForcedJsonCallStream()
    return parser.stream(tools)


@dataclass(frozen=True)
class ToolParser:
    """A named tool-call format."""

    name: str

    def stream(self, tools: Sequence[Mapping[str, Any]] = ()) -> ToolStream:
        """A splitter for one response; ``tools`` are the request's tool definitions (dicts)."""
        schemas: dict[str, Mapping[str, Any]] = {}
        for tool in tools:
            fn = tool.get("function") or {}
            if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
                params = fn.get("parameters")
                schemas[fn["name"]] = params if isinstance(params, Mapping) else {}
        if self.name == "hermes":
            return _TaggedStream(_parse_hermes_body, schemas)
        if self.name == "qwen3_xml":
            return _TaggedStream(_parse_xml_body, schemas)
        return _WholeOutputJsonStream()

    def extract(
        self, text: str, tools: Sequence[Mapping[str, Any]] = ()
    ) -> tuple[str | None, list[ParsedToolCall]]:
        """Return ``(content, calls)``; content is None when only calls (or blanks) remain."""
        s = self.stream(tools)
        c1, _ = s.feed(text)
        c2, _ = s.finish()
        content = c1 + c2
        calls = s.calls
        if calls and not content.strip():
            return None, calls
        return (content or None), calls


TOOL_PARSERS: dict[str, ToolParser] = {name: ToolParser(name) for name in ("hermes", "qwen3_xml", "generic")}


#: Every value ``--tool-call-parser`` accepts: ``auto`` picks by model type, ``none`` parses nothing.
TOOL_PARSER_CHOICES: tuple[str, ...] = ("auto", "none", *TOOL_PARSERS)


def get_tool_parser(name: str) -> ToolParser | None:
    """The parser called ``name``; None for ``none``. Raise ValueError for unknown/unsupported."""
    if name == "none":
        return None
    if name in TOOL_PARSERS:
        return TOOL_PARSERS[name]
    known = ", ".join(["none", *sorted(TOOL_PARSERS)])
    if name in UNSUPPORTED_TOOL_PARSERS:
        raise ValueError(
            f"tool-call parser {name!r} is not supported by this server; choose one of: {known}, auto"
        )
    raise ValueError(f"unknown tool-call parser {name!r}; choose one of: {known}, auto")
