"""Admission through a real server: a full queue answers 429 with Retry-After; a client that
hangs up mid-stream frees its slot.

The server runs one slot (``--max-batch-size 1``) and no queue (``--max-queued-requests 0``)
with a slow scripted engine, so a request that has streamed its first chunk is surely still
running when the next one arrives.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from inference.serving.tokenizer import load_tokenizer
from tests.service.conftest import MODEL, ServerProcess, running_server, serve_args
from tests.support.engines import EngineScript, Reply

WORD = "tick "
REPEAT = 40
STEP_DELAY = 0.03  # seconds per engine call: the whole reply takes a few seconds
SCRIPT = EngineScript(replies=(Reply(WORD, repeat=REPEAT),), delay=STEP_DELAY)
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Count."}]


@pytest.fixture(scope="module")
def server(demo_dir: Path, cache_dir: Path, log_dir: Path) -> Iterator[ServerProcess]:
    args = serve_args(max_input_len=512, max_kv_cache_capacity=1024, max_batch_size=1, max_queued_requests=0)
    with running_server(demo_dir, cache_dir, log_dir, *args, env=SCRIPT.to_env()) as s:
        yield s


def _wait_idle(server: ServerProcess, timeout: float = 10.0) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while True:
        health = server.health()
        if health["active_requests"] == 0 and health["queued_requests"] == 0:
            return health
        if time.monotonic() > deadline:
            pytest.fail(f"server still busy after {timeout} s: {health}\n{server.log_tail()}")
        time.sleep(0.05)


def test_full_queue_is_429_with_retry_after(server: ServerProcess) -> None:
    first, second = server.client(), server.client()
    stream = first.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, stream=True)
    chunks = iter(stream)
    assert next(chunks).choices[0].delta.role == "assistant"  # the first request holds the slot
    assert server.health()["active_requests"] == 1

    with pytest.raises(openai.RateLimitError) as info:
        second.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5)
    assert info.value.status_code == 429
    retry_after = info.value.response.headers.get("retry-after")
    assert retry_after is not None and int(retry_after) >= 1
    err = info.value.response.json()["error"]
    assert err["code"] == "server_overloaded"
    # A streamed request is refused the same way, before any SSE is sent.
    with pytest.raises(openai.RateLimitError):
        second.completions.create(model=MODEL, prompt="Count.", max_tokens=5, stream=True)

    # The first request is unharmed and runs to its end.
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == WORD * REPEAT
    _wait_idle(server)
    # The slot is free again.
    ok = second.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3)
    assert ok.choices[0].finish_reason == "length"


def test_client_disconnect_frees_the_slot(server: ServerProcess, demo_dir: Path) -> None:
    reply_tokens = len(load_tokenizer(demo_dir).encode(WORD)) * REPEAT
    client = server.client()
    stream = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, stream=True)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert server.health()["active_requests"] == 1
    stream.close()  # hang up mid-stream
    closed = time.monotonic()
    _wait_idle(server)
    # Freed long before the rest of the reply (one engine call per token) would have run.
    remaining = (reply_tokens - 3) * STEP_DELAY
    assert time.monotonic() - closed < remaining / 2, (remaining, server.log_tail())
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert ok.usage is not None and ok.usage.completion_tokens == 2


def test_back_to_back_requests_are_admitted(server: ServerProcess) -> None:
    # With no queue, a request sent right after the previous response must find the slot free:
    # the slot has to be released before the last output reaches the client, not after.
    client = server.client()
    quick: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Count."}]
    refused = 0
    for _ in range(30):
        try:
            client.chat.completions.create(model=MODEL, messages=quick, max_tokens=1)
        except openai.RateLimitError:
            refused += 1
    assert refused == 0, f"{refused} of 30 back-to-back requests got 429\n{server.log_tail()}"


def test_queue_timeout_is_429(demo_dir: Path, cache_dir: Path, log_dir: Path) -> None:
    args = serve_args(
        max_input_len=512,
        max_kv_cache_capacity=1024,
        max_batch_size=1,
        max_queued_requests=1,
        queue_timeout=0.5,
    )
    with running_server(demo_dir, cache_dir, log_dir, *args, env=SCRIPT.to_env()) as server:
        first, second = server.client(), server.client()
        stream = first.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, stream=True)
        chunks = iter(stream)
        next(chunks)  # the slot is taken for the next couple of seconds
        started = time.monotonic()
        with pytest.raises(openai.RateLimitError) as info:
            second.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
        waited = time.monotonic() - started
        assert info.value.response.headers.get("retry-after")
        assert info.value.response.json()["error"]["code"] == "server_overloaded"
        assert 0.4 <= waited < 2.0, f"answered after {waited:.2f} s; --queue-timeout is 0.5 s"
        stream.close()


def test_non_streamed_client_disconnect_frees_the_slot(server: ServerProcess, demo_dir: Path) -> None:
    reply_tokens = len(load_tokenizer(demo_dir).encode(WORD)) * REPEAT
    # The client gives up after 0.5 s, long before the reply (one engine call per token) is done.
    impatient = server.client(timeout=0.5)
    started = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        impatient.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200)
    _wait_idle(server)
    remaining = reply_tokens * STEP_DELAY
    assert time.monotonic() - started < remaining / 2, (remaining, server.log_tail())
    ok = server.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert ok.usage is not None and ok.usage.completion_tokens == 2
