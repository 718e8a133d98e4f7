"""Loopback ports and readiness polling for tests and benchmarks that start real servers."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable, Mapping

import httpx


def free_port() -> int:
    """A loopback port that was free a moment ago (bind port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NotReadyError(RuntimeError):
    """A server did not answer in time, or its process exited first (``exited`` tells which)."""

    def __init__(self, message: str, *, exited: bool) -> None:
        super().__init__(message)
        self.exited = exited


def wait_http_ok(
    url: str,
    *,
    timeout: float,
    proc: subprocess.Popen[bytes] | None = None,
    alive: Callable[[], bool] | None = None,
    headers: Mapping[str, str] | None = None,
    interval: float = 0.1,
) -> httpx.Response:
    """Poll ``GET url`` until it answers 200; return that response.

    Raises :class:`NotReadyError` when ``proc`` exits (or ``alive()`` turns false) first, or when
    ``timeout`` seconds pass. Connection errors and non-200 answers count as not ready yet.
    """
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise NotReadyError(
                    f"process exited with {proc.returncode} before {url} answered", exited=True
                )
            if alive is not None and not alive():
                raise NotReadyError(f"server stopped before {url} answered", exited=True)
            try:
                response = client.get(url, headers=dict(headers or {}))
                if response.status_code == 200:
                    return response
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise NotReadyError(f"{url} did not answer 200 within {timeout:.0f} s", exited=False)
            time.sleep(interval)
