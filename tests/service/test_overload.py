"""64 concurrent streams against 2 slots and a queue of 16, through a real server and the
official client: every answer is a complete stream (200) or a 429 with Retry-After, nothing
else, and the request metrics add up to what the clients saw."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx2
import openai
import pytest

from inference.demo import write_demo_checkpoint
from tests.service.conftest import MODEL, running_server, serve_args
from tests.support.engines import EngineScript, Reply

STREAMS = 64
QUEUE = 16
SLOTS = 2
WORD = "tick "
SCRIPT = EngineScript(replies=(Reply(WORD, repeat=12),), delay=0.01)


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "tiny", size="tiny")


async def _one(client: openai.AsyncOpenAI) -> tuple[int, str]:
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=50, stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return 200, text
    except openai.RateLimitError as exc:
        retry_after = exc.response.headers.get("retry-after")
        assert retry_after is not None and int(retry_after) >= 1
        assert exc.response.json()["error"]["code"] == "server_overloaded"
        return 429, ""


def _requests_by_status(metrics: str) -> dict[str, float]:
    """``cachesvc_http_requests_total`` of POST /v1/chat/completions, by status."""
    out: dict[str, float] = {}
    for m in re.finditer(
        r"^cachesvc_http_requests_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$", metrics, re.M
    ):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group("labels")))
        if labels.get("route") == "/v1/chat/completions" and labels.get("method") == "POST":
            out[labels["status"]] = out.get(labels["status"], 0.0) + float(m.group("value"))
    return out


def test_64_streams_against_a_queue_of_16(demo_dir: Path, tmp_path: Path) -> None:
    args = serve_args(
        max_input_len=256, max_kv_cache_capacity=512, max_batch_size=SLOTS, max_queued_requests=QUEUE
    )
    with running_server(demo_dir, tmp_path / "cache", tmp_path, *args, env=SCRIPT.to_env()) as server:

        async def run() -> list[tuple[int, str]]:
            client = openai.AsyncOpenAI(
                base_url=f"{server.base_url}/v1",
                api_key="unused",
                max_retries=0,
                timeout=120,
                http_client=openai.DefaultAsyncHttpxClient(limits=httpx2.Limits(max_connections=STREAMS)),
            )
            async with client:
                return await asyncio.gather(*(_one(client) for _ in range(STREAMS)))

        results = asyncio.run(run())
        with server.http() as h:
            metrics = h.get("/metrics").text
            health = h.get("/health").json()
        log = server.log_tail()
    statuses = [s for s, _ in results]
    ok, limited = statuses.count(200), statuses.count(429)
    print(f"\n{STREAMS} streams vs {SLOTS} slots + queue {QUEUE}: {ok} x 200, {limited} x 429")
    assert ok + limited == STREAMS, log
    assert ok >= SLOTS + QUEUE // 2 and limited >= 1, statuses
    assert all(text == WORD * 12 for s, text in results if s == 200)
    assert _requests_by_status(metrics) == {"200": float(ok), "429": float(limited)}, metrics
    assert health["active_requests"] == 0 and health["queued_requests"] == 0
