"""``cachesvc serve`` with no model argument: a real server answering with SmolLM2."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import httpx

from cachesvc.default_model import DEFAULT_SERVED_NAME
from tests.e2e.conftest import READY_TIMEOUT, ServerProcess, cachesvc_command, child_env, free_port


def test_model_less_serve_answers_with_smollm2(smollm2_dir: Path, tmp_path: Path) -> None:
    cache_dir = smollm2_dir.parents[2]  # <cache>/checkpoints/gguf/<conversion>: converted already
    port = free_port()
    log_path = tmp_path / "serve.log"
    argv = [*cachesvc_command(), "serve", "--cache-dir", str(cache_dir), "--host", "127.0.0.1",
            "--port", str(port), "--max-kv-cache-capacity", "1024", "--max-input-len", "512"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=child_env())
    server = ServerProcess(proc, port, log_path, cache_dir, None)
    try:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{server.base_url}/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise AssertionError(f"server never became ready\n{server.log_tail()}")
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
