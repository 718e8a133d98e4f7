"""Concurrency over a real uvicorn server on a loopback port: 429s, batching, disconnects, and
the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest

from inference.openai import ModelHandle
from inference.serving.tokenizer import Tokenizer
from tests.serving.conftest import MODEL, LiveServer, TableEngine, TokenScriptEngine, make_app, make_options

pytestmark = pytest.mark.anyio


def _serving(tokenizer: Tokenizer, engine: Any, **opts: Any) -> ModelHandle:
    return ModelHandle(engine, tokenizer, make_options(**opts))


async def _wait_for(cond: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def test_queue_full_gives_429_with_retry_after(tokenizer: Tokenizer) -> None:
    serving = _serving(tokenizer, TableEngine(delay=0.02), max_batch_size=1, max_queued_requests=0)
    req = {"model": MODEL, "prompt": "slow", "max_tokens": 30}
    with LiveServer(make_app(serving)) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
            first = asyncio.create_task(c.post("/v1/completions", json=req))
            await _wait_for(lambda: serving.health()["active_requests"] == 1)
            second = await c.post("/v1/completions", json=req)
            assert second.status_code == 429
            assert second.json()["error"]["code"] == "server_overloaded"
            assert int(second.headers["retry-after"]) >= 1
            assert (await first).status_code == 200


async def test_queue_timeout_gives_429(tokenizer: Tokenizer) -> None:
    serving = _serving(
        tokenizer, TableEngine(delay=0.05), max_batch_size=1, max_queued_requests=1, queue_timeout=0.2
    )
    req = {"model": MODEL, "prompt": "slow", "max_tokens": 20}
    with LiveServer(make_app(serving)) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
            first = asyncio.create_task(c.post("/v1/completions", json=req))
            await _wait_for(lambda: serving.health()["active_requests"] == 1)
            waited = await c.post("/v1/completions", json=req)
            assert waited.status_code == 429 and "waited" in waited.json()["error"]["message"]
            assert (await first).status_code == 200


async def test_batching_runs_sequences_together(tokenizer: Tokenizer) -> None:
    engine = TableEngine(delay=0.005)
    serving = _serving(tokenizer, engine)
    reqs = [{"model": MODEL, "prompt": f"prompt {i}", "max_tokens": 15, "temperature": 0} for i in range(3)]
    with LiveServer(make_app(serving)) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
            results = await asyncio.gather(*(c.post("/v1/completions", json=r) for r in reqs))
    for r, q in zip(results, reqs, strict=True):
        ids = tokenizer.encode(str(q["prompt"]), add_special_tokens=True)
        assert r.json()["choices"][0]["text"] == tokenizer.decode(engine.greedy(ids, 15))
    assert max(engine.decode_batches) > 1


async def test_disconnect_mid_stream_frees_the_slot(tokenizer: Tokenizer) -> None:
    engine = TableEngine(delay=0.02)
    serving = _serving(tokenizer, engine, max_batch_size=1)
    req = {"model": MODEL, "prompt": "long story", "max_tokens": 200, "stream": True}
    with LiveServer(make_app(serving)) as srv:
        async with httpx.AsyncClient(base_url=srv.url, timeout=30) as c:
            async with c.stream("POST", "/v1/completions", json=req) as resp:
                assert resp.status_code == 200
                seen = 0
                async for line in resp.aiter_lines():
                    if line.startswith("data: "):
                        seen += 1
                    if seen >= 3:
                        break
            await _wait_for(lambda: serving.health()["active_requests"] == 0)
            generated = len(engine.decode_batches)
            assert generated < 150  # stopped long before max_tokens
            await asyncio.sleep(0.2)
            assert len(engine.decode_batches) == generated  # and stays stopped
            assert engine.resets  # the slot was reset for reuse
            # The freed slot serves the next request.
            r = await c.post("/v1/completions", json={**req, "stream": False, "max_tokens": 3})
            assert r.status_code == 200
            assert await serving.client.drain(1.0)


def test_official_openai_client(tokenizer: Tokenizer) -> None:
    script = tokenizer.encode(
        "<think>tool time</think><tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    engine = TokenScriptEngine(script, model_type="qwen3")
    serving = _serving(
        tokenizer, engine, enable_auto_tool_choice=True, max_model_len=512, max_input_len=400
    )
    tools: Any = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    with LiveServer(make_app(serving, api_key="k")) as srv:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="k", max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
        msgs: Any = [{"role": "user", "content": "weather?"}]
        chat = client.chat.completions.create(model=MODEL, messages=msgs, tools=tools)
        choice = chat.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls
        call: Any = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Oslo"}
        assert getattr(choice.message, "reasoning_content", None) == "tool time"
        stream = client.chat.completions.create(
            model=MODEL, messages=msgs, tools=tools, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(script) + 1
        names = [
            tc.function.name
            for ch in chunks
            if ch.choices
            for tc in ch.choices[0].delta.tool_calls or []
            if tc.function and tc.function.name
        ]
        assert names == ["get_weather"]
        text = client.completions.create(model=MODEL, prompt="hello", max_tokens=1)
        assert text.choices[0].finish_reason == "length" and text.usage and text.usage.completion_tokens == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{srv.url}/v1", api_key="bad", max_retries=0).models.list()
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="x")
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt="x", n=9)
        assert "between 1 and 8" in str(bad.value)
