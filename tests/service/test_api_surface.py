"""The wider API surface through a real ``cachesvc serve`` process and the official SDKs.

A scripted engine (:mod:`tests.support.engines`) makes greedy decoding write fixed replies through
the bundle's real tokenizer: a hermes ``<tool_call>`` when the prompt mentions the weather (tool
definitions do), a plain answer once a tool result is in the prompt, a pirate's answer for a
pirate system prompt, ``<think>`` reasoning then an answer when asked to think it through, and a
default answer otherwise. The ``openai`` SDK drives completions
(``n``, ``echo``, ``suffix``), ``models.retrieve`` and ``responses``; the ``anthropic`` SDK drives
``/v1/messages``; httpx drives ``/tokenize`` and ``/detokenize``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from inference.serving.tokenizer import Tokenizer
from tests.service.conftest import API_KEY, MODEL, ServerProcess, running_server, serve_args
from tests.service.test_parsers import (
    AFTER_TOOL_REPLY,
    ANSWER,
    CALL_ARGS,
    REASONING,
    THINKING_REPLY,
    TOOL_REPLY,
)
from tests.support.engines import EngineScript, Reply

PIRATE = "Arr, matey."
FRENCH = "Bonjour. Au revoir."

SCRIPT = EngineScript(
    replies=(
        # First match wins: a tool result in the prompt beats the weather in the tool definition.
        Reply(AFTER_TOOL_REPLY, when="<tool_response>"),
        Reply(TOOL_REPLY, when="weather"),
        Reply(PIRATE, when="You are a pirate"),
        Reply(FRENCH, when="French"),
        Reply(THINKING_REPLY, when="Think it through"),
        Reply(ANSWER),
    )
)
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_Q = "How is the weather in Paris?"


@pytest.fixture(scope="module")
def server(demo_dir: Path, cache_dir: Path, log_dir: Path) -> Iterator[ServerProcess]:
    args = serve_args(
        max_input_len=512,
        max_kv_cache_capacity=1024,
        max_batch_size=4,
        reasoning_parser="qwen3",
        tool_call_parser="hermes",
        enable_auto_tool_choice=True,
    )
    with running_server(demo_dir, cache_dir, log_dir, *args, env=SCRIPT.to_env(), api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return server.anthropic_client()


def _prompt_tokens(tok: Tokenizer, messages: list[dict[str, Any]], tools: Any = None) -> int:
    return len(tok.encode(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)))


# -- /v1/completions: n, echo, suffix ------------------------------------------------------------


def test_completions_n_choices(oai: openai.OpenAI) -> None:
    one = oai.completions.create(model=MODEL, prompt="Say something", max_tokens=30, temperature=0)
    many = oai.completions.create(model=MODEL, prompt="Say something", max_tokens=30, temperature=0, n=3)
    assert one.choices[0].text == ANSWER
    assert [(c.index, c.text, c.finish_reason) for c in many.choices] == [
        (i, ANSWER, "stop") for i in range(3)
    ]
    assert one.usage is not None and many.usage is not None
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_completions_n_streamed(oai: openai.OpenAI) -> None:
    texts: dict[int, str] = {}
    finishes: dict[int, str | None] = {}
    usage = None
    for chunk in oai.completions.create(
        model=MODEL,
        prompt="Say something",
        max_tokens=30,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    ):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert texts == {0: ANSWER, 1: ANSWER}
    assert finishes == {0: "stop", 1: "stop"}
    assert usage is not None and usage.completion_tokens % 2 == 0 and usage.completion_tokens > 2


def test_completions_n_over_8_names_the_limit(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="Say something", max_tokens=3, n=9)
    assert "between 1 and 8" in info.value.message


def test_completions_echo(oai: openai.OpenAI, tok: Tokenizer) -> None:
    r = oai.completions.create(model=MODEL, prompt="Say something", max_tokens=30, temperature=0, echo=True)
    assert r.choices[0].text == "Say something" + ANSWER
    lp = oai.completions.create(
        model=MODEL, prompt="Say something", max_tokens=30, temperature=0, echo=True, logprobs=0
    )
    assert lp.choices[0].logprobs is not None
    prompt_ids = tok.encode("Say something", add_special_tokens=True)
    tokens = lp.choices[0].logprobs.tokens or []
    assert tokens[: len(prompt_ids)] == [tok.token_text(t) for t in prompt_ids]
    assert (lp.choices[0].logprobs.token_logprobs or [])[: len(prompt_ids)] == [None] * len(prompt_ids)


def test_completions_suffix_is_refused(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model=MODEL, prompt="def f(", suffix="    return x", max_tokens=3)
    assert "suffix" in info.value.message and "insertion" in info.value.message
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "suffix"


# -- /v1/models/{id} --------------------------------------------------------------------------------


def test_models_retrieve(oai: openai.OpenAI) -> None:
    model = oai.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.owned_by == "cachesvc"
    with pytest.raises(openai.NotFoundError) as info:
        oai.models.retrieve("no-such-model")
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "model_not_found"
    assert "no-such-model" in info.value.message


# -- /tokenize, /detokenize -----------------------------------------------------------------------


def test_tokenize_detokenize_round_trip(server: ServerProcess, tok: Tokenizer) -> None:
    text = "Hello world, how are you?"
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with server.http() as h:
        r = h.post("/tokenize", json={"model": MODEL, "prompt": text}, headers=headers)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["tokens"] == tok.encode(text, add_special_tokens=True)
        assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 1024
        back = h.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]}, headers=headers)
        assert back.status_code == 200 and back.json() == {"prompt": tok.decode(body["tokens"])} == {
            "prompt": text
        }
        # No model: the server's own; messages through the chat template; token strings on request.
        msgs = [{"role": "user", "content": text}]
        chat = h.post("/tokenize", json={"messages": msgs, "return_token_strs": True}, headers=headers).json()
        rendered = tok.apply_chat_template(msgs, add_generation_prompt=True)
        assert chat["tokens"] == tok.encode(rendered)
        assert chat["token_strs"] == [tok.token_text(t) for t in chat["tokens"]]
        unknown = h.post("/tokenize", json={"model": "nope", "prompt": text}, headers=headers)
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        assert h.post("/detokenize", json={"tokens": [1]}).status_code == 401
        bad = h.post("/detokenize", json={"tokens": [10**9]}, headers=headers)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[0]"


# -- /v1/messages (Anthropic) ---------------------------------------------------------------------


def test_messages_plain(claude: anthropic.Anthropic, tok: Tokenizer) -> None:
    msgs: list[Any] = [{"role": "user", "content": "What is 2 + 2?"}]
    r = claude.messages.create(model=MODEL, max_tokens=64, messages=msgs, metadata={"user_id": "u1"})
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [(b.type, getattr(b, "text", None)) for b in r.content] == [("text", ANSWER)]
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert r.usage.input_tokens == _prompt_tokens(tok, msgs)
    assert r.usage.output_tokens == len(tok.encode(ANSWER)) + 1  # and the end-of-turn token
    short = claude.messages.create(model=MODEL, max_tokens=2, messages=msgs)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_messages_system_and_stop_sequences(claude: anthropic.Anthropic) -> None:
    msgs: list[Any] = [{"role": "user", "content": "Hello"}]
    r = claude.messages.create(model=MODEL, max_tokens=64, system="You are a pirate.", messages=msgs)
    assert r.content[0].type == "text" and r.content[0].text == PIRATE
    blocks = claude.messages.create(
        model=MODEL, max_tokens=64, system=[{"type": "text", "text": "You are a pirate."}], messages=msgs
    )
    assert blocks.content[0].type == "text" and blocks.content[0].text == PIRATE
    french: list[Any] = [{"role": "user", "content": "Speak French"}]
    cut = claude.messages.create(model=MODEL, max_tokens=64, messages=french, stop_sequences=["Au"])
    assert cut.content[0].type == "text" and cut.content[0].text == "Bonjour. "
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == "Au"


def _weather_tool() -> Any:
    return {"name": "get_weather", "description": "Current conditions for a city.", "input_schema": SCHEMA}


def test_messages_tool_use_round_trip(claude: anthropic.Anthropic) -> None:
    ask: list[Any] = [{"role": "user", "content": WEATHER_Q}]
    r = claude.messages.create(model=MODEL, max_tokens=128, messages=ask, tools=[_weather_tool()])
    assert r.stop_reason == "tool_use"
    calls = [b for b in r.content if b.type == "tool_use"]
    assert [(c.name, c.input) for c in calls] == [("get_weather", CALL_ARGS)]
    history: list[Any] = [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "sunny"}],
        },
    ]
    answer = claude.messages.create(model=MODEL, max_tokens=128, messages=history, tools=[_weather_tool()])
    assert answer.content[0].type == "text" and answer.content[0].text == AFTER_TOOL_REPLY
    assert answer.stop_reason == "end_turn"
    named = claude.messages.create(
        model=MODEL,
        max_tokens=128,
        messages=ask,
        tools=[_weather_tool()],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert [b.type for b in named.content] == ["tool_use"]


def test_messages_stream_events(claude: anthropic.Anthropic, server: ServerProcess) -> None:
    msgs: list[Any] = [{"role": "user", "content": "What is 2 + 2?"}]
    with claude.messages.stream(model=MODEL, max_tokens=64, messages=msgs) as stream:
        kinds = [e.type for e in stream if e.type not in ("text", "input_json")]
        final = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert final.content[0].type == "text" and final.content[0].text == ANSWER
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == len(kinds[2:-3]) + 1
    # The SDK drops pings: check the raw order on the wire.
    with server.http() as h:
        body = {"model": MODEL, "max_tokens": 64, "messages": msgs, "stream": True}
        raw = h.post("/v1/messages", json=body, headers={"x-api-key": API_KEY}).text
    events = [line.removeprefix("event: ") for line in raw.splitlines() if line.startswith("event: ")]
    assert events[:3] == ["message_start", "content_block_start", "ping"]
    assert events[-2:] == ["message_delta", "message_stop"]


def test_messages_stream_tool_use(claude: anthropic.Anthropic) -> None:
    ask: list[Any] = [{"role": "user", "content": WEATHER_Q}]
    with claude.messages.stream(model=MODEL, max_tokens=128, messages=ask, tools=[_weather_tool()]) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in deltas
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [("tool_use", CALL_ARGS)]


def test_messages_count_tokens(claude: anthropic.Anthropic, tok: Tokenizer) -> None:
    msgs: list[Any] = [{"role": "user", "content": "What is 2 + 2?"}]
    counted = claude.messages.count_tokens(model=MODEL, messages=msgs, system="You are a pirate.")
    expected = _prompt_tokens(tok, [{"role": "system", "content": "You are a pirate."}, *msgs])
    assert counted.input_tokens == expected
    used = claude.messages.create(model=MODEL, max_tokens=8, messages=msgs, system="You are a pirate.")
    # Anthropic's split: computed + read from the context cache = the prompt.
    assert used.usage.input_tokens + (used.usage.cache_read_input_tokens or 0) == expected


def test_messages_errors_in_anthropic_shape(claude: anthropic.Anthropic, server: ServerProcess) -> None:
    msgs: list[Any] = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as missing:
        claude.messages.create(model="no-such-model", max_tokens=8, messages=msgs)
    assert missing.value.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": missing.value.body["error"]["message"]},  # type: ignore[index]
    }
    assert "no-such-model" in missing.value.message
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(model=MODEL, max_tokens=0, messages=msgs)
    assert "max_tokens" in bad.value.message
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.AuthenticationError) as auth:
        anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=msgs
        )
    assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with server.http() as h:
        r = h.post("/v1/messages", json={"model": MODEL, "messages": msgs}, headers={"x-api-key": API_KEY})
    assert r.status_code == 400
    assert r.json()["type"] == "error" and "max_tokens" in r.json()["error"]["message"]


# -- /v1/responses --------------------------------------------------------------------------------


FUNCTION_TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Current conditions for a city.",
    "parameters": SCHEMA,
}


def test_responses_plain(oai: openai.OpenAI, tok: Tokenizer) -> None:
    r = oai.responses.create(model=MODEL, input="What is 2 + 2?", max_output_tokens=64, store=True)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == ANSWER
    assert [item.type for item in r.output] == ["message"]
    assert r.usage is not None
    assert r.usage.input_tokens == _prompt_tokens(tok, [{"role": "user", "content": "What is 2 + 2?"}])
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    pirate = oai.responses.create(
        model=MODEL, instructions="You are a pirate.", input=[{"role": "user", "content": "Hi"}]
    )
    assert pirate.output_text == PIRATE
    short = oai.responses.create(model=MODEL, input="What is 2 + 2?", max_output_tokens=2)
    assert short.status == "incomplete" and short.incomplete_details is not None
    assert short.incomplete_details.reason == "max_output_tokens"


def test_responses_streaming_events(oai: openai.OpenAI) -> None:
    events = list(oai.responses.create(model=MODEL, input="What is 2 + 2?", stream=True))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    done = events[-1]
    assert done.type == "response.completed" and done.response.output_text == ANSWER


def test_responses_function_tool_round_trip(oai: openai.OpenAI) -> None:
    ask: list[Any] = [{"role": "user", "content": WEATHER_Q}]
    r = oai.responses.create(model=MODEL, input=ask, tools=[FUNCTION_TOOL])
    calls = [item for item in r.output if item.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", CALL_ARGS)]
    follow: list[Any] = [
        *ask,
        {
            "type": "function_call",
            "call_id": calls[0].call_id,
            "name": "get_weather",
            "arguments": calls[0].arguments,
        },
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny"},
    ]
    answer = oai.responses.create(model=MODEL, input=follow, tools=[FUNCTION_TOOL])
    assert answer.output_text == AFTER_TOOL_REPLY
    streamed = list(oai.responses.create(model=MODEL, input=ask, tools=[FUNCTION_TOOL], stream=True))
    kinds = [e.type for e in streamed]
    assert "response.function_call_arguments.delta" in kinds
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == CALL_ARGS
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]


def test_responses_refuses_previous_response_id(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model=MODEL, input="hi", previous_response_id="resp_123")
    assert "previous_response_id" in info.value.message and "not supported" in info.value.message
    # text.format json_schema is enforced (tests/service/test_request_fields.py); other types are 400.
    with pytest.raises(openai.BadRequestError) as fmt:
        yaml: Any = {"format": {"type": "yaml"}}
        oai.responses.create(model=MODEL, input="hi", text=yaml)
    assert "text.format.type" in fmt.value.message
    assert fmt.value.response.json()["error"]["param"] == "text.format.type"


def test_http_client_statuses(server: ServerProcess) -> None:
    # The routes keep the JSON-only rule of /v1 (415) and the key (401).
    with httpx.Client(base_url=server.base_url, timeout=30) as h:
        r = h.post(
            "/v1/responses", content=b"{}", headers={"Content-Type": "text/plain", "x-api-key": API_KEY}
        )
        assert r.status_code == 415
        r = h.post("/v1/messages", json={"model": MODEL, "max_tokens": 1, "messages": []})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


THINK: list[Any] = [{"role": "user", "content": "Think it through: what is 2 + 2?"}]


def test_messages_thinking_blocks(claude: anthropic.Anthropic) -> None:
    r = claude.messages.create(model=MODEL, max_tokens=64, messages=THINK)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].type == "thinking" and r.content[0].thinking == REASONING
    assert r.content[1].type == "text" and r.content[1].text == ANSWER
    with claude.messages.stream(model=MODEL, max_tokens=64, messages=THINK) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas[0] == "thinking_delta" and "text_delta" in deltas
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].type == "thinking" and final.content[0].thinking == REASONING
    # The answer, thinking block included, goes back as history.
    history: list[Any] = [
        *THINK,
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {"role": "user", "content": "Thanks"},
    ]
    assert claude.messages.create(model=MODEL, max_tokens=64, messages=history).stop_reason == "end_turn"


def test_responses_reasoning_items(oai: openai.OpenAI) -> None:
    r = oai.responses.create(model=MODEL, input=THINK)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    first = r.output[0]
    assert first.type == "reasoning" and [c.text for c in first.content or []] == [REASONING]
    assert r.output_text == ANSWER
    events = list(oai.responses.create(model=MODEL, input=THINK, stream=True))
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    # Reasoning items sent back in input are accepted (and left out of the prompt).
    follow: list[Any] = [
        *THINK,
        *(item.model_dump() for item in r.output),
        {"role": "user", "content": "Thanks"},
    ]
    assert oai.responses.create(model=MODEL, input=follow).status == "completed"


def test_errors_name_each_surfaces_own_fields(oai: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    with pytest.raises(openai.BadRequestError) as too_long:
        oai.responses.create(model=MODEL, input="What is 2 + 2?", max_output_tokens=5000)
    assert isinstance(too_long.value.body, dict) and too_long.value.body["param"] == "max_output_tokens"
    assert "max_output_tokens" in too_long.value.message
    with pytest.raises(anthropic.BadRequestError) as empty_stop:
        claude.messages.create(model=MODEL, max_tokens=8, messages=THINK, stop_sequences=["ok", ""])
    assert "stop_sequences" in empty_stop.value.message
