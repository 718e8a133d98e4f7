"""Item 7: work that outlives the shutdown grace ends with proper answers, not cut connections.

A real ``cachesvc serve`` (scripted engine, one slot) with a 2 s grace: after SIGTERM a new
request gets 503 ``server_unavailable`` (the socket stays open during the drain), and when the
grace is over the running stream ends with an error chunk and ``[DONE]`` and the queued
request gets an OpenAI 503 body; the process exits 0.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from inference.demo import write_demo_checkpoint
from tests.service.conftest import MODEL, running_server, serve_args
from tests.support.engines import EngineScript, Reply

GRACE = 2.0
SCRIPT = EngineScript(replies=(Reply("step ", repeat=400),), delay=0.05)  # ~20 s of work


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("demo") / "tiny", size="tiny")


def _sse_events(response: httpx.Response) -> list[Any]:
    events: list[Any] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_work_past_the_grace_gets_proper_answers(demo_dir: Path, tmp_path: Path) -> None:
    env = {**SCRIPT.to_env(), "CACHESVC_SHUTDOWN_GRACE_SECONDS": str(GRACE)}
    args = serve_args(max_batch_size=1, max_input_len=500, max_kv_cache_capacity=1000)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 500}
    with running_server(demo_dir, tmp_path / "cache", tmp_path, *args, env=env) as server:
        streamed: list[Any] = []
        queued: dict[str, Any] = {}
        with httpx.Client(base_url=server.base_url, timeout=60) as h:

            def stream() -> None:
                with h.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
                    streamed.extend(_sse_events(r))

            def wait_in_queue() -> None:
                with httpx.Client(base_url=server.base_url, timeout=60) as q:
                    r = q.post("/v1/chat/completions", json=chat)
                    queued.update(status=r.status_code, body=r.json(), ctype=r.headers["content-type"])

            runner = threading.Thread(target=stream)
            runner.start()
            time.sleep(1.0)  # the stream holds the only slot
            waiter = threading.Thread(target=wait_in_queue)
            waiter.start()
            time.sleep(0.5)
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with httpx.Client(base_url=server.base_url, timeout=10) as late:
                r = late.get("/v1/models")  # a new connection during the drain
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "server_unavailable"
            runner.join(60)
            waiter.join(60)
        status = server.terminate()
        log = server.log_tail(20000)
    assert streamed[-1] == "[DONE]", (streamed[-3:], log)
    assert "error" in streamed[-2] and streamed[-2]["error"]["code"] == "server_unavailable", streamed[-3:]
    assert any("choices" in e and e["choices"] for e in streamed[:-2])  # it had been generating
    assert queued["status"] == 503, (queued, log)
    assert queued["ctype"].startswith("application/json")
    assert queued["body"]["error"]["code"] == "server_unavailable"
    assert status == 0, log
