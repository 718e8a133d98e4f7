"""Process lifecycle of ``cachesvc serve``: graceful SIGTERM, leases, a bad model, and its log
keeping the level and format it was started with.

SIGTERM during a stream: the stream runs to its end, new requests are refused, the process
exits 0 and its bundle lease is released, so another process can then evict the bundle. While
a server runs, neither its own admin API nor another process can evict the bundle it leases.
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam

from cachesvc.cache.manager import CacheManager
from inference.serving.tokenizer import load_tokenizer
from tests.service.conftest import (
    MODEL,
    ServerProcess,
    cachesvc_command,
    child_env,
    free_port,
    run_cli,
    running_server,
    serve_args,
)
from tests.support.engines import EngineScript, Reply

WORD = "step "
REPEAT = 30
SCRIPT = EngineScript(replies=(Reply(WORD, repeat=REPEAT),), delay=0.04)
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Go on."}]


def _bundle_path(cache_dir: Path, bundle_id: str) -> Path:
    manager = CacheManager.open(cache_dir, max_size_bytes=10**12)
    try:
        return manager.queries.bundle_dir(manager.catalog.bundles.require(bundle_id))
    finally:
        manager.close()


def test_sigterm_during_stream_finishes_it_exits_0_and_releases_the_lease(
    demo_dir: Path, cache_dir: Path, log_dir: Path
) -> None:
    reply_tokens = len(load_tokenizer(demo_dir).encode(WORD)) * REPEAT
    # A profile of its own (--max-input-len 500), so no other server of the session leases it.
    args = serve_args(max_input_len=500, max_kv_cache_capacity=1000)
    with running_server(demo_dir, cache_dir, log_dir, *args, env=SCRIPT.to_env()) as server:
        bundle_id = server.bundle_id()
        bundle_dir = _bundle_path(cache_dir, bundle_id)
        assert bundle_dir.is_dir()
        stream = server.client().chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=500, stream=True, stream_options={"include_usage": True}
        )
        chunks = iter(stream)
        seen = [next(chunks) for _ in range(3)]  # generation is under way
        server.proc.send_signal(signal.SIGTERM)
        seen += list(chunks)  # must end cleanly: no exception, not cut short

        # New work is refused while draining: the listener is closed or the answer is 503.
        try:
            server.client(timeout=5).models.list()
            refused = False
        except openai.APIConnectionError:
            refused = True
        except openai.APIStatusError as exc:
            refused = exc.status_code == 503 and exc.response.json()["error"]["code"] == "server_unavailable"
        assert refused, "a request sent after SIGTERM was admitted"

        status = server.terminate()
        log = server.log_tail(20000)
    text = "".join(c.choices[0].delta.content or "" for c in seen if c.choices)
    assert text == WORD * REPEAT, log
    finishes = [c.choices[0].finish_reason for c in seen if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert seen[-1].usage is not None and seen[-1].usage.completion_tokens == reply_tokens + 1
    assert "released the lease" in log

    # Another process can now evict the bundle.
    rm = run_cli(cache_dir, "bundles", "rm", bundle_id)
    assert rm.returncode == 0, rm.stdout + rm.stderr
    assert not bundle_dir.exists()

    # Last, so that a wrong status does not hide the checks above: a graceful drain exits 0.
    assert status == 0, f"cachesvc serve exited with {status} after SIGTERM\n{log}"


def test_leased_bundle_cannot_be_evicted(real_server: ServerProcess, cache_dir: Path) -> None:
    bundle_id = real_server.bundle_id()
    bundle_dir = _bundle_path(cache_dir, bundle_id)
    files_before = sorted(p.name for p in bundle_dir.iterdir())

    # Through the same server's admin API (loopback, no admin key): 409, nothing deleted.
    with real_server.http() as h:
        r = h.delete(f"/admin/bundles/{bundle_id}")
        assert r.status_code == 409, r.text
        assert str(real_server.pid) in r.text
        detail = h.get(f"/admin/bundles/{bundle_id}")
        assert detail.status_code == 200
    assert sorted(p.name for p in bundle_dir.iterdir()) == files_before

    # From another process: a non-zero exit naming the holder.
    rm = run_cli(cache_dir, "bundles", "rm", bundle_id)
    assert rm.returncode != 0
    assert f"pid {real_server.pid}" in rm.stderr, rm.stderr
    assert sorted(p.name for p in bundle_dir.iterdir()) == files_before

    # And the server still serves from it.
    resp = real_server.client().completions.create(model=MODEL, prompt="Still there?", max_tokens=2)
    assert resp.usage is not None and resp.usage.completion_tokens == 2


def test_bad_model_exits_nonzero_with_the_reason(cache_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-checkpoint"
    port = free_port()
    started = time.monotonic()
    argv = [*cachesvc_command(), "serve", str(missing), "--cache-dir", str(cache_dir)]
    proc = subprocess.run(
        [*argv, "--host", "127.0.0.1", "--port", str(port)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
        check=False,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode != 0
    assert str(missing) in proc.stderr, proc.stderr
    assert elapsed < 30, f"took {elapsed:.1f} s to give up"
    # Nothing listens on the port.
    try:
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
        listening = True
    except httpx.TransportError:
        listening = False
    assert not listening


def test_the_log_keeps_its_level_and_format_after_startup(
    demo_dir: Path, cache_dir: Path, log_dir: Path
) -> None:
    # The app must not reconfigure logging when it starts (Litestar's default config replaced the
    # root handlers: its own format, and INFO lines under --log-level warning).
    args = [*serve_args(max_input_len=500, max_kv_cache_capacity=1000), "--log-level", "warning"]
    with running_server(demo_dir, cache_dir, log_dir, *args, env=SCRIPT.to_env()) as server:
        server.client().chat.completions.create(model=MODEL, messages=ASK, max_tokens=4)
        assert server.terminate() == 0
    lines = server.log_path.read_text().splitlines()
    ours = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ (WARNING|ERROR|CRITICAL) [\w.]+: ")
    logged = [line for line in lines if re.match(r"^(\d{4}-|[A-Z]+ - )", line)]
    assert all(ours.match(line) for line in logged), "\n".join(logged)
    assert not any(" INFO " in line or line.startswith("INFO - ") for line in lines), "\n".join(lines)
