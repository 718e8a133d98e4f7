"""Admission and shutdown on the real model: SmolLM2-135M-Instruct from its GGUF, real engine.

The scripted-engine tests pin down exact behaviour cheaply; these show the same promises hold
when the work is real inference: a full queue answers 429 with Retry-After while a real
generation holds the only slot, and SIGTERM lets a running real generation finish, answers a
new request with 503 ``server_unavailable`` meanwhile, exits 0 and releases the lease.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.service.conftest import MODEL, ServerProcess, run_cli, running_server, serve_args

#: SmolLM2's end-of-text and end-of-turn ids, banned so a generation runs its full length.
NO_EOS = {"0": -100, "2": -100}
ARGS = serve_args(max_batch_size=1, max_queued_requests=0, max_input_len=256, max_kv_cache_capacity=512)


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("smollm2-e2e")


@pytest.fixture
def smollm2(smollm2_gguf: Path, real_cache: Path, log_dir: Path) -> Iterator[ServerProcess]:
    with running_server(smollm2_gguf, real_cache, log_dir, *ARGS) as server:
        yield server


def _stream_body(max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": "List the numbers from one to one hundred in words:",
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": NO_EOS,
        "stream": True,
    }


def test_full_queue_is_429_while_a_real_generation_runs(smollm2: ServerProcess) -> None:
    with (
        httpx.Client(base_url=smollm2.base_url, timeout=120) as h,
        h.stream("POST", "/v1/completions", json=_stream_body(200)) as running,
    ):
        lines = running.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"], first  # the slot is busy generating
        with pytest.raises(openai.RateLimitError) as info:
            smollm2.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4)
        assert int(info.value.response.headers["retry-after"]) >= 1
        assert info.value.response.json()["error"]["code"] == "server_overloaded"
    # The hung-up stream frees the slot: the next request is served.
    deadline = time.monotonic() + 30
    while smollm2.health()["active_requests"]:
        assert time.monotonic() < deadline, smollm2.log_tail()
        time.sleep(0.1)
    reply = smollm2.client().completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4)
    assert reply.choices[0].text


def test_sigterm_drains_a_real_generation_and_releases_the_lease(
    smollm2: ServerProcess, real_cache: Path
) -> None:
    bundle = smollm2.bundle_id()
    events: list[Any] = []

    def stream() -> None:
        with (
            httpx.Client(base_url=smollm2.base_url, timeout=120) as h,
            # 400 tokens: still running when the late request comes 0.3 s after SIGTERM, on a
            # machine that decodes SmolLM2 at 150+ tok/s (48 tokens had finished by then).
            h.stream("POST", "/v1/completions", json=_stream_body(400)) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[6:]
                    events.append(data if data == "[DONE]" else json.loads(data))

    runner = threading.Thread(target=stream)
    runner.start()
    deadline = time.monotonic() + 60
    while not events:
        assert time.monotonic() < deadline and runner.is_alive(), smollm2.log_tail()
        time.sleep(0.02)
    smollm2.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with httpx.Client(base_url=smollm2.base_url, timeout=10) as late:
        refused = late.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "server_unavailable"
    runner.join(120)
    status = smollm2.terminate()
    assert status == 0, smollm2.log_tail()
    assert events[-1] == "[DONE]"
    choices = [c for e in events[:-1] for c in e.get("choices", [])]
    finishes = [c["finish_reason"] for c in choices if c.get("finish_reason")]
    assert finishes == ["length"], events[-3:]  # the running generation completed in the grace
    removed = run_cli(real_cache, "bundles", "rm", bundle)  # nobody holds the lease any more
    assert removed.returncode == 0, removed.stderr
