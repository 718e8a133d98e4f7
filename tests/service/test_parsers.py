"""Reasoning and tool-call parsing through a real server, with a scripted engine.

The server runs ``--reasoning-parser qwen3 --tool-call-parser hermes --enable-auto-tool-choice``
with :mod:`tests.support.engines`, which makes greedy decoding emit a fixed text through
the bundle's real tokenizer: a ``<think>`` block for plain questions, a hermes ``<tool_call>``
when the prompt asks about the weather, and a plain answer once a tool result is in the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from inference.serving.tokenizer import load_tokenizer
from tests.service.conftest import MODEL, ServerProcess, running_server, serve_args
from tests.support.engines import EngineScript, Reply

REASONING = "plan"
ANSWER = "The answer is 4."
THINKING_REPLY = f"<think>{REASONING}</think>{ANSWER}"
CALL_ARGS = {"city": "Paris"}
TOOL_REPLY = "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": CALL_ARGS}) + "\n</tool_call>"
AFTER_TOOL_REPLY = "It is sunny in Paris."

SCRIPT = EngineScript(
    replies=(
        # First match wins: a tool result in the prompt beats the weather question before it.
        Reply(AFTER_TOOL_REPLY, when="<tool_response>"),
        Reply(TOOL_REPLY, when="weather"),
        Reply(THINKING_REPLY),
    )
)

TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current conditions for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
ASK_MATH: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is 2 + 2?"}]
ASK_WEATHER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "How is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(demo_dir: Path, cache_dir: Path, log_dir: Path) -> Iterator[ServerProcess]:
    args = serve_args(
        max_input_len=512,
        max_kv_cache_capacity=1024,
        reasoning_parser="qwen3",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    with running_server(demo_dir, cache_dir, log_dir, *args, env=SCRIPT.to_env()) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def token_count(demo_dir: Path) -> Any:
    tok = load_tokenizer(demo_dir)
    return lambda text: len(tok.encode(text))


def _extra(obj: Any, name: str) -> Any:
    # reasoning_content is not in the openai SDK's types; it arrives as an extra field.
    return (obj.model_extra or {}).get(name)


def test_health_reports_parsers(server: ServerProcess) -> None:
    caps = server.health()["capabilities"]
    assert caps["reasoning_parser"] == "qwen3"
    assert caps["tool_call_parser"] == "hermes"
    assert caps["auto_tool_choice"] is True
    assert caps["backend"] == "scripted"


def test_reasoning_content(client: openai.OpenAI, token_count: Any) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=ASK_MATH, max_tokens=64, temperature=0)
    message = resp.choices[0].message
    assert _extra(message, "reasoning_content") == REASONING
    assert message.content == ANSWER
    assert resp.choices[0].finish_reason == "stop"
    # The scripted tokens plus the EOS that ended them.
    assert resp.usage is not None and resp.usage.completion_tokens == token_count(THINKING_REPLY) + 1


def test_reasoning_content_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK_MATH, max_tokens=64, temperature=0, stream=True
    )
    reasoning: list[str] = []
    content: list[str] = []
    finishes: list[str] = []
    for chunk in stream:
        for choice in chunk.choices:
            reasoning.append(_extra(choice.delta, "reasoning_content") or "")
            content.append(choice.delta.content or "")
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert "".join(reasoning) == REASONING
    assert "".join(content) == ANSWER
    # Markup never leaks into either channel.
    assert not any("think>" in piece for piece in reasoning + content)
    assert finishes == ["stop"]


def test_completions_endpoint_leaves_markup_alone(client: openai.OpenAI) -> None:
    # /v1/completions does not parse: the markup tokens come back as text, decoded intact.
    resp = client.completions.create(model=MODEL, prompt="What is 2 + 2?", max_tokens=64, temperature=0)
    assert resp.choices[0].text == THINKING_REPLY


def test_tool_call(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="auto", max_tokens=64, temperature=0
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls is not None and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == CALL_ARGS
    assert not (choice.message.content or "").strip()


def test_tool_call_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK_WEATHER,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=64,
        temperature=0,
        stream=True,
    )
    ids: list[str] = []
    names: list[str] = []
    arguments: list[str] = []
    content: list[str] = []
    finishes: list[str] = []
    for chunk in stream:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for tc in choice.delta.tool_calls or []:
                assert tc.index == 0
                if tc.id:
                    ids.append(tc.id)
                    assert tc.type == "function"
                if tc.function is not None:
                    names.append(tc.function.name or "")
                    arguments.append(tc.function.arguments or "")
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert len(ids) == 1, "the call id is sent once, with the first delta of the call"
    assert "".join(names) == "get_weather"
    assert json.loads("".join(arguments)) == CALL_ARGS
    assert not "".join(content).strip()
    assert "<tool_call>" not in "".join(content)
    assert finishes == ["tool_calls"]


def test_tool_result_round_trip(client: openai.OpenAI) -> None:
    # The assistant's call and the tool's answer go back through the chat template; the
    # scripted engine answers in prose only if it sees the rendered <tool_response>.
    first = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=64, temperature=0
    )
    calls = first.choices[0].message.tool_calls
    assert calls
    call = calls[0]
    assert call.type == "function"
    messages: list[ChatCompletionMessageParam] = [
        *ASK_WEATHER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear", "temp_c": 21})},
    ]
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=64, temperature=0
    )
    assert resp.choices[0].message.content == AFTER_TOOL_REPLY
    assert resp.choices[0].message.tool_calls is None
    assert resp.choices[0].finish_reason == "stop"


def test_tool_choice_none_keeps_call_as_text(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="none", max_tokens=64, temperature=0
    )
    assert resp.choices[0].message.tool_calls is None
    assert resp.choices[0].message.content == TOOL_REPLY
    assert resp.choices[0].finish_reason == "stop"
