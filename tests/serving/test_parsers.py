"""Reasoning and tool-call parsers: whole text and streamed in small pieces agree."""

from __future__ import annotations

import json

import pytest

from inference.openai.reasoning import get_reasoning_parser
from inference.openai.tool_parsers import ToolCallEvent, get_tool_parser


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize(
    ("name", "text", "prompt", "reasoning", "content"),
    [
        ("qwen3", "<think>\nstep 1\n</think>\n\nThe answer.", "", "\nstep 1\n", "The answer."),
        ("qwen3", "No thinking here.", "", None, "No thinking here."),
        ("qwen3", "step 1</think>answer", "<|im_start|>assistant\n<think>\n", "step 1", "answer"),
        ("deepseek_r1", "plan it</think>\nanswer", "", "plan it", "answer"),
        ("deepseek_r1", "<think>plan</think>answer", "", "plan", "answer"),
        ("deepseek_r1", "still thinking", "", "still thinking", None),
        ("nemotron", "<think>a</think>b", "", "a", "b"),
    ],
)
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_reasoning_split(
    name: str, text: str, prompt: str, reasoning: str | None, content: str | None, size: int
) -> None:
    parser = get_reasoning_parser(name)
    assert parser is not None
    assert parser.extract(text, prompt) == (reasoning, content)
    stream = parser.stream(prompt)
    r_all, c_all = "", ""
    for piece in _pieces(text, size):
        r, c = stream.feed(piece)
        r_all, c_all = r_all + r, c_all + c
    r, c = stream.finish()
    assert (r_all + r or None, c_all + c or None) == (reasoning, content)


def test_unknown_parsers_fail_clearly() -> None:
    assert get_reasoning_parser("none") is None and get_tool_parser("none") is None
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'zz'.*qwen3"):
        get_reasoning_parser("zz")
    with pytest.raises(ValueError, match=r"not supported.*hermes"):
        get_tool_parser("openai")


HERMES = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
XML = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    }
]


@pytest.mark.parametrize(
    ("name", "text", "content", "calls"),
    [
        (
            "hermes",
            HERMES,
            "Let me check.\n",
            [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
        ),
        ("hermes", "plain answer", "plain answer", []),
        ("hermes", "<tool_call>{not json}</tool_call>", "<tool_call>{not json}</tool_call>", []),
        ("hermes", '<tool_call>{"name": "f", "arguments": {}}', None, [("f", {})]),
        ("qwen3_xml", XML, None, [("get_weather", {"city": "Paris", "days": 3})]),
        ("generic", '{"name": "f", "parameters": {"x": 1}}', None, [("f", {"x": 1})]),
        (
            "generic",
            '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"y": "z"}}]',
            None,
            [("f", {}), ("g", {"y": "z"})],
        ),
        ("generic", "Hello {there}", "Hello {there}", []),
        ("generic", '{"no": "name"}', '{"no": "name"}', []),
    ],
)
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_tool_calls(
    name: str, text: str, content: str | None, calls: list[tuple[str, dict[str, object]]], size: int
) -> None:
    parser = get_tool_parser(name)
    assert parser is not None
    got_content, got_calls = parser.extract(text, TOOLS)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") for c in got_calls)

    stream = parser.stream(TOOLS)
    streamed, events = "", list[ToolCallEvent]()
    for piece in _pieces(text, size):
        c, ev = stream.feed(piece)
        streamed, events = streamed + c, events + ev
    c, ev = stream.finish()
    streamed, events = streamed + c, events + ev
    assert (streamed or None) == content or (not calls and streamed == text)
    # Per call: first the header (id + name), then the arguments.
    rebuilt: dict[int, list[ToolCallEvent]] = {}
    for e in events:
        rebuilt.setdefault(e.index, []).append(e)
    assert [(evs[0].name, json.loads(evs[1].arguments or "")) for evs in rebuilt.values()] == calls
    assert all(evs[0].id and evs[1].id is None for evs in rebuilt.values())
