"""``cachesvc serve`` with no model argument: a real server answering with SmolLM2."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from cachesvc.serving.default_model import DEFAULT_SERVED_NAME
from tests.service.conftest import READY_TIMEOUT, ServerProcess, cachesvc_command, child_env, free_port


def _start(cache_dir: Path, log_path: Path, *flags: str) -> ServerProcess:
    """A model-less ``cachesvc serve`` on ``cache_dir``, once /health/ready says 200."""
    port = free_port()
    argv = [*cachesvc_command(), "serve", "--cache-dir", str(cache_dir), "--host", "127.0.0.1",
            "--port", str(port), "--max-kv-cache-capacity", "1024", *flags]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=child_env())
    server = ServerProcess(proc, port, log_path, cache_dir, None)
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{server.base_url}/health/ready", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.terminate()
    raise AssertionError(f"server never became ready\n{server.log_tail()}")


def _loaded(server: ServerProcess) -> list[dict[str, Any]]:
    """The loaded engines (``/admin/engines``), each with its bundle's profile."""
    reply = httpx.get(f"{server.base_url}/admin/engines", timeout=10)
    engines: list[dict[str, Any]] = reply.json()["engines"]
    for engine in engines:
        bundle = httpx.get(f"{server.base_url}/admin/bundles/{engine['bundle_id']}", timeout=10).json()
        engine["profile"] = bundle["bundle"]["profile"]
    return engines


def test_model_less_serve_answers_with_smollm2(smollm2_dir: Path, tmp_path: Path) -> None:
    cache_dir = smollm2_dir.parents[2]  # <cache>/checkpoints/gguf/<conversion>: converted already
    log_path = tmp_path / "serve.log"
    server = _start(cache_dir, log_path, "--max-input-len", "512")
    try:
        client = server.client()
        models = client.models.list().data
        # The startup name, one entry per model: the GGUF checkpoint's path and the bundle id
        # answer too but are not listed.
        assert models[0].id == DEFAULT_SERVED_NAME
        assert not any(m.id.startswith("/") for m in models)
        reply = client.chat.completions.create(
            model=DEFAULT_SERVED_NAME, temperature=0, max_tokens=32,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        assert "Paris" in (reply.choices[0].message.content or ""), server.log_tail()
        assert "converting" not in log_path.read_text()  # the conversion was a cache hit
    finally:
        server.terminate()


def test_a_later_model_less_run_loads_the_default_model_before_ready_and_applies_its_flags(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    cache_dir = smollm2_dir.parents[2]
    first = _start(cache_dir, tmp_path / "first.log", "--max-input-len", "512")
    first.terminate()
    # The catalog is not empty now. Another --max-input-len names another profile: the default
    # model's bundle is built with it (not ignored), and ready means it is loaded.
    second = _start(cache_dir, tmp_path / "second.log", "--max-input-len", "256")
    try:
        loaded = _loaded(second)
        assert len(loaded) == 1 and DEFAULT_SERVED_NAME in loaded[0]["names"], loaded
        profile = loaded[0]["profile"]
        assert profile["max_input_len"] == 256
        assert profile["precision"] == "int4"  # the Q4_1 file's own precision, gate passed
    finally:
        second.terminate()
