"""The /v1 router over HTTP (Litestar test client) with numpy engines behind the real stack.

Litestar's test client runs one request at a time; concurrency cases are in ``test_live.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from litestar.testing import AsyncTestClient

from inference.openai import ModelHandle
from inference.serving.tokenizer import Tokenizer
from tests.serving.conftest import MODEL, TableEngine, TokenScriptEngine, make_app, make_options, pool_app
from tests.support.apps import one_model_pool

pytestmark = pytest.mark.anyio


def _serving(tokenizer: Tokenizer, engine: Any = None, **opts: Any) -> ModelHandle:
    return ModelHandle(engine or TableEngine(), tokenizer, make_options(**opts))


async def _client(serving: ModelHandle, api_key: str | None = None) -> AsyncIterator[AsyncTestClient[Any]]:
    async with AsyncTestClient(app=make_app(serving, api_key=api_key)) as client:
        yield client


def _sse(body: str) -> list[Any]:
    events = []
    for block in body.replace("\r\n", "\n").split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _error(
    resp: httpx.Response, status: int, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return dict(err)


async def test_models_list(tokenizer: Tokenizer) -> None:
    async for c in _client(_serving(tokenizer)):
        r = await c.get("/v1/models")
        assert r.status_code == 200
        data = r.json()
        assert data["object"] == "list"
        assert [(m["id"], m["max_model_len"]) for m in data["data"]] == [(MODEL, 256)]


async def test_completion_greedy_equals_engine_greedy(tokenizer: Tokenizer) -> None:
    engine = TableEngine()
    async for c in _client(_serving(tokenizer, engine)):
        r = await c.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        prompt_ids = tokenizer.encode("Once upon a time", add_special_tokens=True)
        expected = tokenizer.decode(engine.greedy(prompt_ids, 12))
        assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
        assert isinstance(body["created"], int)
        assert body["choices"][0]["text"] == expected
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"] == {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": 12,
            "total_tokens": len(prompt_ids) + 12,
            "prompt_tokens_details": {"cached_tokens": 0},
        }


async def test_chat_completion_and_stream_agree(tokenizer: Tokenizer) -> None:
    engine = TableEngine()
    req = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
        "max_completion_tokens": 10,
        "temperature": 0,
    }
    async for c in _client(_serving(tokenizer, engine)):
        r = await c.post("/v1/chat/completions", json=req)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
        msg = body["choices"][0]["message"]
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}])
        ids = tokenizer.encode(prompt)
        assert msg["role"] == "assistant"
        assert msg["content"] == tokenizer.decode(engine.greedy(ids, 10))
        assert body["usage"]["prompt_tokens"] == len(ids)

        s = await c.post(
            "/v1/chat/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}}
        )
        assert s.status_code == 200
        assert s.headers["content-type"].startswith("text/event-stream")
        events = _sse(s.text)
        assert events[-1] == "[DONE]"
        chunks = events[:-1]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert all(ch["object"] == "chat.completion.chunk" and ch["id"] == chunks[0]["id"] for ch in chunks)
        text = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks if ch["choices"])
        assert text == msg["content"]
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]


async def test_completion_stream(tokenizer: Tokenizer) -> None:
    async for c in _client(_serving(tokenizer)):
        base = {"model": MODEL, "prompt": ["The cat"], "max_tokens": 6, "temperature": 0}
        whole = (await c.post("/v1/completions", json=base)).json()["choices"][0]["text"]
        s = await c.post("/v1/completions", json={**base, "stream": True})
        events = _sse(s.text)
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == whole
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert all(e.get("usage") is None for e in events[:-1])


async def test_seed_determinism_and_stop(tokenizer: Tokenizer) -> None:
    async for c in _client(_serving(tokenizer)):
        req = {"model": MODEL, "prompt": "Seeds", "max_tokens": 20, "temperature": 1.0, "seed": 42}
        a = (await c.post("/v1/completions", json=req)).json()["choices"][0]["text"]
        b = (await c.post("/v1/completions", json=req)).json()["choices"][0]["text"]
        other = (await c.post("/v1/completions", json={**req, "seed": 43})).json()["choices"][0]["text"]
        assert a == b and a != other
        # Stop on a piece of the seeded text; it is cut there and not included.
        stop = a[5:9]
        cut = a[: a.index(stop)]
        r = (await c.post("/v1/completions", json={**req, "stop": [stop]})).json()["choices"][0]
        assert (r["text"], r["finish_reason"]) == (cut, "stop")
        s = await c.post("/v1/completions", json={**req, "stop": stop, "stream": True})
        events = _sse(s.text)
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == cut


async def test_max_tokens_one_is_length_and_logprobs(tokenizer: Tokenizer) -> None:
    async for c in _client(_serving(tokenizer)):
        r = (
            await c.post(
                "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1, "logprobs": 2}
            )
        ).json()
        choice = r["choices"][0]
        assert choice["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 1
        assert len(choice["logprobs"]["tokens"]) == 1 and len(choice["logprobs"]["top_logprobs"][0]) <= 2
        chat = (
            await c.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 3,
                    "temperature": 0,
                    "logprobs": True,
                    "top_logprobs": 2,
                },
            )
        ).json()
        content = chat["choices"][0]["logprobs"]["content"]
        assert len(content) == 3
        assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in content)
        # greedy picks the most likely token
        assert all(t["logprob"] == pytest.approx(t["top_logprobs"][0]["logprob"]) for t in content)


async def test_errors(tokenizer: Tokenizer) -> None:
    async for c in _client(_serving(tokenizer)):
        msgs = [{"role": "user", "content": "hi"}]
        _error(
            await c.post("/v1/completions", json={"model": "nope", "prompt": "x"}),
            404,
            "model_not_found",
            "model",
        )
        _error(await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 9}), 400, param="n")
        _error(
            await c.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": msgs, "max_tokens": 5, "max_completion_tokens": 6},
            ),
            400,
            param="max_completion_tokens",
        )
        long_prompt = "word " * 300
        _error(
            await c.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt}),
            400,
            "context_length_exceeded",
            "prompt",
        )
        _error(
            await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1000}),
            400,
            "context_length_exceeded",
            "max_tokens",
        )
        err = _error(
            await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": "many"}),
            400,
            param="max_tokens",
        )
        assert "max_tokens" in err["message"]
        _error(await c.post("/v1/completions", json={"model": MODEL}), 400, param="prompt")
        _error(
            await c.post(
                "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
            ),
            400,
        )
        _error(
            await c.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [
                        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                    ],
                },
            ),
            400,
            param="messages[0].content[0].type",
        )
        _error(
            await c.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
            ),
            400,
            param="messages[0].role",
        )
        _error(
            await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "temperature": 5}),
            400,
            param="temperature",
        )
        _error(
            await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logit_bias": {"99999": 1}}),
            400,
            param="logit_bias",
        )
        tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        _error(
            await c.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": msgs, "tools": tools, "tool_choice": "auto"},
            ),
            400,
            param="tool_choice",
        )


async def test_api_key(tokenizer: Tokenizer) -> None:
    async for c in _client(_serving(tokenizer), api_key="s3cret"):
        _error(await c.get("/v1/models"), 401, "invalid_api_key")
        _error(await c.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        _error(await c.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 401)
        assert (await c.get("/v1/models", headers={"Authorization": "Bearer s3cret"})).status_code == 200
        assert (await c.get("/v1/models", headers={"x-api-key": "s3cret"})).status_code == 200


async def test_draining_gives_503(tokenizer: Tokenizer) -> None:
    serving = _serving(tokenizer)
    pool = one_model_pool(serving)
    async with AsyncTestClient(app=pool_app(pool)) as c:
        pool.begin_drain()
        assert serving.health()["status"] == "draining" and not serving.client.ready
        _error(
            await c.post("/v1/completions", json={"model": MODEL, "prompt": "x"}), 503, "server_unavailable"
        )
        _error(await c.get("/v1/models"), 503, "server_unavailable")
        assert await pool.drain(0.5)


THINK_TOOL = (
    "<think>\nUser wants weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


async def test_reasoning_and_tool_calls(tokenizer: Tokenizer) -> None:
    engine = TokenScriptEngine(tokenizer.encode(THINK_TOOL))
    serving = _serving(
        tokenizer,
        engine,
        enable_auto_tool_choice=True,
        model_type="qwen3",
        max_model_len=512,
        max_input_len=400,
    )
    assert serving.health()["capabilities"]["reasoning_parser"] == "qwen3"
    req = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS}
    async for c in _client(serving):
        body = (await c.post("/v1/chat/completions", json=req)).json()
        choice = body["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        msg = choice["message"]
        assert msg["reasoning_content"] == "\nUser wants weather.\n"
        assert msg["content"] is None
        (call,) = msg["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}

        events = _sse((await c.post("/v1/chat/completions", json={**req, "stream": True})).text)
        chunks = [e for e in events[:-1]]
        reasoning = "".join(ch["choices"][0]["delta"].get("reasoning_content") or "" for ch in chunks)
        content = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
        deltas = [tc for ch in chunks for tc in ch["choices"][0]["delta"].get("tool_calls") or []]
        assert reasoning == "\nUser wants weather.\n" and content == ""
        assert deltas[0]["function"]["name"] == "get_weather" and deltas[0]["id"].startswith("call_")
        assert json.loads("".join(d["function"].get("arguments") or "" for d in deltas)) == {"city": "Paris"}
        assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_reasoning_only_and_eos(tokenizer: Tokenizer) -> None:
    engine = TokenScriptEngine(tokenizer.encode("<think>hmm</think>Bonjour!"))
    serving = _serving(tokenizer, engine, reasoning_parser="deepseek_r1")
    req = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}]}
    async for c in _client(serving):
        body = (await c.post("/v1/chat/completions", json=req)).json()
        msg = body["choices"][0]["message"]
        assert (msg["reasoning_content"], msg["content"]) == ("hmm", "Bonjour!")
        assert body["choices"][0]["finish_reason"] == "stop"  # scripted EOS
        events = _sse((await c.post("/v1/chat/completions", json={**req, "stream": True})).text)
        parts = [ch["choices"][0]["delta"] for ch in events[:-1]]
        assert "".join(p.get("reasoning_content") or "" for p in parts) == "hmm"
        assert "".join(p.get("content") or "" for p in parts) == "Bonjour!"


async def test_stream_dropped_before_iteration_is_released(tokenizer: Tokenizer) -> None:
    import gc

    from inference.openai.completions import CompletionEndpoint
    from inference.openai.protocol import CompletionRequest

    engine = TableEngine(delay=0.01)
    serving = _serving(tokenizer, engine)
    pool = one_model_pool(serving)
    await pool.start()
    try:
        stream = await CompletionEndpoint(pool).create_completion(
            CompletionRequest(model=MODEL, prompt="x", max_tokens=200, stream=True)
        )
        assert serving.health()["active_requests"] == 1
        assert pool.engines()[0].references == 1  # the stream holds the model's lease
        del stream
        gc.collect()
        assert pool.engines()[0].references == 0
        assert await serving.client.drain(2.0)  # in-flight count back to zero at once
        for _ in range(200):
            if serving.health()["active_requests"] == 0:
                break
            await asyncio.sleep(0.01)
        assert serving.health()["active_requests"] == 0
        assert len(engine.decode_batches) < 150
    finally:
        await pool.stop()


async def test_model_without_chat_template_gives_400(
    tokenizer: Tokenizer, demo_dir: Any, tmp_path: Any
) -> None:
    import json as _json
    import shutil

    from inference.serving.tokenizer import load_tokenizer

    d = tmp_path / "tok"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_dir / name, d / name)
    cfg = _json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(_json.dumps(cfg))
    serving = ModelHandle(TableEngine(), load_tokenizer(d), make_options())
    assert serving.health()["capabilities"]["chat"] is False
    async for c in _client(serving):
        r = await c.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        )
        err = _error(r, 400, param="messages")
        assert "no chat template" in err["message"]
        assert (
            await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        ).status_code == 200


async def test_prompt_over_the_input_limit_after_tokenizing(tokenizer: Tokenizer) -> None:
    """A prompt short enough in characters to pass the cheap pre-check but longer than
    max_input_len in tokens is refused by the token count (context_length_exceeded, 400)."""
    serving = _serving(tokenizer)
    limit = serving.options.max_input_len
    prompt = " ".join(["a"] * (limit + 20))
    assert len(tokenizer.encode(prompt, add_special_tokens=False)) > limit
    async for c in _client(serving):
        err = _error(
            await c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}),
            400,
            "context_length_exceeded",
            "prompt",
        )
        assert "tokens" in err["message"]
