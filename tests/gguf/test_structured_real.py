"""Structured output with the real SmolLM2-135M-Instruct through the real serving stack.

A uvicorn server in this process serves the int8 bundle; the official ``openai`` client sends
200 sampled requests (temperature 1) over ten schemas of the kinds SDKs send, plus forced tool
calls, streamed and not. Every answer must parse and validate: a grammar that leaks shows up
here, because a 135M model at temperature 1 goes wherever the mask lets it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from inference.openai import ModelHandle, ServingOptions
from inference.runtime.onnxruntime_loader import load_engine
from inference.serving.tokenizer import load_tokenizer
from tests.serving.conftest import LiveServer, make_app

MODEL = "smollm2"
REQUESTS = 200
MAX_TOKENS = 320


class Step(BaseModel):
    explanation: str = Field(max_length=40)
    output: str = Field(max_length=16)


class MathReasoning(BaseModel):
    """The openai SDK's structured-outputs example (bounded so answers stay short)."""

    steps: list[Step] = Field(max_length=3)
    final_answer: str = Field(max_length=16)


class Ticket(BaseModel):
    title: str = Field(max_length=30)
    priority: Literal["low", "medium", "high"]
    assignee: str | None = Field(max_length=20)
    labels: list[Literal["bug", "feature", "docs"]] = Field(max_length=3)


def _sdk_schema(model: type[BaseModel]) -> dict[str, Any]:
    # What the SDK sends for response_format=<pydantic model>.
    from openai.lib._pydantic import to_strict_json_schema

    return to_strict_json_schema(model)


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


NAME = {"type": "string", "maxLength": 24}
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "student": {"type": "boolean"}}),
    "sentiment": _obj({"sentiment": {"enum": ["positive", "neutral", "negative"]},
                       "confidence": {"type": "integer", "minimum": 0, "maximum": 100}}),
    "address": _obj({"name": NAME, "address": _obj({"street": {"type": "string", "maxLength": 30},
                                                    "city": NAME,
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                                   ["city"])}),
    "tags": _obj({"tags": {"type": "array", "minItems": 1, "maxItems": 4,
                           "items": {"enum": ["news", "sports", "tech", "food", "travel"]}}}),
    "any_of": _obj({"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9999},
                                     {"type": "string", "maxLength": 12}]},
                    "parent": {"anyOf": [{"type": "null"},
                                         {"type": "integer", "minimum": 0, "maximum": 99}]}}),
    "event": _obj({"name": {"type": "string", "maxLength": 30},
                   "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
                   "participants": {"type": "array", "maxItems": 3, "items": NAME}}),
    "refs": {**_obj({"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}}),
             "$defs": {"point": _obj({"x": {"type": "integer", "minimum": -99, "maximum": 99},
                                      "y": {"type": "integer", "minimum": -99, "maximum": 99}})}},
    "optional": _obj({"title": NAME, "subtitle": NAME, "year": {"type": "integer", "minimum": 1900,
                                                                 "maximum": 2100}}, ["title"]),
    "pydantic_math": _sdk_schema(MathReasoning),
    "pydantic_ticket": _sdk_schema(Ticket),
}
PYDANTIC: dict[str, type[BaseModel]] = {"pydantic_math": MathReasoning, "pydantic_ticket": Ticket}
PROMPTS = {
    "person": "Describe a person as JSON.",
    "sentiment": "Classify the sentiment of: 'I love this phone'. Answer in JSON.",
    "address": "Give a name and a postal address as JSON.",
    "tags": "Tag this headline: 'Local team wins the cup'. JSON please.",
    "any_of": "Give an id and a parent id as JSON.",
    "event": "Alice and Bob go to a science fair on Friday. Extract the event as JSON.",
    "refs": "Give two points as JSON.",
    "optional": "Describe a book as JSON.",
    "pydantic_math": "Solve 8x + 7 = -23 step by step.",
    "pydantic_ticket": "File a ticket: the login page crashes on Safari.",
}
WEATHER = _obj({"city": NAME, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city"])
ALARM = _obj({"hour": {"type": "integer", "minimum": 0, "maximum": 23},
              "label": {"type": "string", "maxLength": 20}}, ["hour"])
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "set_alarm", "description": "Set an alarm",
                                      "parameters": ALARM}},
]
TOOL_SCHEMAS = {"get_weather": WEATHER, "set_alarm": ALARM}


@pytest.fixture(scope="module")
def client(smollm2_bundle: Callable[[str], Path]) -> Iterator[openai.OpenAI]:
    bundle = smollm2_bundle("int8")
    engine = load_engine(bundle, threads=2)
    options = ServingOptions(served_model_name=MODEL, max_model_len=1024, max_input_len=512, max_batch_size=8,
                             max_queued_requests=256, queue_timeout=900.0)
    serving = ModelHandle(engine, load_tokenizer(bundle), options)
    try:
        with LiveServer(make_app(serving)) as server:
            yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=900)
    finally:
        engine.close()


def _ask(client: openai.OpenAI, name: str, seed: int) -> tuple[str, Any, str | None]:
    messages: Any = [{"role": "user", "content": PROMPTS[name]}]
    if name in PYDANTIC:
        parsed = client.chat.completions.parse(
            model=MODEL, messages=messages, response_format=PYDANTIC[name], temperature=1.0, seed=seed,
            max_tokens=MAX_TOKENS,
        )
        choice = parsed.choices[0]
        assert choice.message.parsed is not None
        return name, json.loads(choice.message.content or ""), choice.finish_reason
    fmt: Any = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}
    resp = client.chat.completions.create(
        model=MODEL, messages=messages, response_format=fmt, temperature=1.0, seed=seed, max_tokens=MAX_TOKENS
    )
    return name, json.loads(resp.choices[0].message.content or ""), resp.choices[0].finish_reason


def test_200_sampled_answers_all_parse_and_validate(client: openai.OpenAI) -> None:
    names = list(SCHEMAS)
    jobs = [(names[i % len(names)], i) for i in range(REQUESTS)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda job: _ask(client, *job), jobs))
    assert len(results) == REQUESTS
    for name, value, finish in results:
        jsonschema.validate(value, SCHEMAS[name])
        assert finish == "stop", (name, value)


def test_json_object(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object with your name."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=64,
    )
    text = resp.choices[0].message.content or ""
    assert text.lstrip().startswith("{")
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def _check_calls(calls: list[tuple[str, str]], only: str | None) -> None:
    assert calls
    for name, arguments in calls:
        assert only is None or name == only
        jsonschema.validate(json.loads(arguments), TOOL_SCHEMAS[name])


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_tool_calls(client: openai.OpenAI, choice: str) -> None:
    named = {"type": "function", "function": {"name": "set_alarm"}}
    tool_choice: Any = named if choice == "named" else "required"
    only = "set_alarm" if choice == "named" else None
    messages: Any = [{"role": "user", "content": "Wake me up at 7 and tell me the weather in Oslo."}]
    for seed in range(4):
        resp = client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=seed,
            max_tokens=MAX_TOKENS, parallel_tool_calls=seed % 2 == 0,
        )
        choice_ = resp.choices[0]
        assert choice_.finish_reason == "tool_calls", choice_
        assert choice_.message.tool_calls and not choice_.message.content
        _check_calls([(c.function.name, c.function.arguments) for c in choice_.message.tool_calls
                      if c.type == "function"], only)

        stream = client.chat.completions.create(
            model=MODEL, messages=messages, tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=seed,
            max_tokens=MAX_TOKENS, stream=True, parallel_tool_calls=seed % 2 == 0,
        )
        names: dict[int, str] = {}
        args: dict[int, list[str]] = {}
        finishes: list[str] = []
        for chunk in stream:
            for ch in chunk.choices:
                assert not (ch.delta.content or "").strip()
                for tc in ch.delta.tool_calls or []:
                    if tc.id:
                        assert tc.function is not None and tc.function.name
                        names[tc.index] = tc.function.name
                    if tc.function is not None and tc.function.arguments:
                        args.setdefault(tc.index, []).append(tc.function.arguments)
                if ch.finish_reason:
                    finishes.append(ch.finish_reason)
        assert finishes == ["tool_calls"]
        assert all(len(pieces) > 1 for pieces in args.values()), "arguments are streamed piece by piece"
        _check_calls([(names[i], "".join(args[i])) for i in sorted(names)], only)
