"""Every admin route and /metrics: the admin key, never the completion key; loopback-only without a key."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import TestClient

from cachesvc.cache.manager import CacheManager
from cachesvc.http.auth import is_loopback, presented_keys
from tests.admin.conftest import ADMIN_KEY, COMPLETION_KEY, LOOPBACK, REMOTE, build_app, problem
from tests.support.cache import REPO_ROOT, child_env
from tests.support.net import free_port, wait_http_ok

Client = TestClient[Litestar]
BUNDLE_ID = "0123456789abcdef-0123456789ab"
BODIES = {
    "/admin/builds": {"model": "/nonexistent"},
    "/admin/cache/prune": {"dry_run": True},
    "/admin/lora-adapters": {"source": "/nonexistent", "base": "/nonexistent"},
    "/admin/pulls": {"model": "/nonexistent"},
}


def _operations(manager: CacheManager) -> list[tuple[str, str]]:
    """(method, concrete path) of every admin and metrics operation the real app documents."""
    app, _ = build_app(manager)
    spec = app.openapi_schema.to_schema()
    ops = []
    for template, item in spec["paths"].items():
        if not template.startswith(("/admin", "/metrics")):
            continue  # /v1 has its own key; /health is open by design
        if template.startswith("/admin/dashboard"):
            continue  # a static page without data, open by design; its API calls are guarded
        path = template.replace("{bundle_id}", BUNDLE_ID).replace("{build_id}", "build-0")
        path = path.replace("{node}", "node-x")
        path = path.replace("{name}", "some-alias").replace("{checkpoint_id}", "0123456789abcdef")
        path = path.replace("{adapter_id}", "0123456789abcdef").replace("{pull_id}", "pull-0")
        ops += [(method.upper(), path) for method in item]
    assert len(ops) == 38
    return sorted(ops)


def _call(client: Client, method: str, path: str, headers: dict[str, str]) -> Any:
    body = BODIES.get(path, {"dry_run": True}) if method == "POST" else None
    return client.request(method, path, headers=headers, json=body)


WRONG = [
    {},
    {"Authorization": "Bearer not-the-key"},
    {"x-api-key": "not-the-key"},
    {"Authorization": f"Bearer {COMPLETION_KEY}"},
    {"x-api-key": COMPLETION_KEY},
    {"Authorization": f"Basic {ADMIN_KEY}"},
    {"Authorization": f"Bearer {ADMIN_KEY}x"},
]


def test_with_admin_key_every_route_refuses_wrong_and_completion_keys(
    make_client: Callable[..., Client], manager: CacheManager
) -> None:
    client = make_client(admin_api_key=ADMIN_KEY, peer=LOOPBACK)
    for method, path in _operations(manager):
        for headers in WRONG:
            r = _call(client, method, path, headers)
            body = problem(r)
            assert body["status"] == 401, (method, path, headers, body)
            assert r.headers["www-authenticate"].startswith("Bearer")
        for headers in ({"Authorization": f"Bearer {ADMIN_KEY}"}, {"x-api-key": ADMIN_KEY}):
            r = _call(client, method, path, headers)
            assert r.status_code < 500 and r.status_code not in (401, 403), (method, path, r.text)


def test_admin_key_opens_routes_from_a_remote_client(
    make_client: Callable[..., Client], manager: CacheManager
) -> None:
    client = make_client(admin_api_key=ADMIN_KEY, peer=REMOTE)
    for method, path in _operations(manager):
        status = _call(client, method, path, {"x-api-key": ADMIN_KEY}).status_code
        assert status < 500 and status not in (401, 403), (method, path, status)
        assert problem(_call(client, method, path, {}))["status"] == 401
    both = {"Authorization": f"Bearer {COMPLETION_KEY}", "x-api-key": ADMIN_KEY}
    assert client.get("/admin/stats", headers=both).status_code == 200


def test_without_admin_key_only_loopback_clients_get_in(
    make_client: Callable[..., Client], manager: CacheManager
) -> None:
    remote = make_client(peer=REMOTE)
    local = make_client(peer=LOOPBACK)
    for method, path in _operations(manager):
        for headers in ({}, {"x-api-key": COMPLETION_KEY}, {"Authorization": f"Bearer {ADMIN_KEY}"}):
            body = problem(_call(remote, method, path, headers))
            assert body["status"] == 403, (method, path, body)
            assert "--admin-api-key" in body["detail"]
        status = _call(local, method, path, {}).status_code
        assert status < 500 and status not in (401, 403), (method, path, status)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("10.0.0.1", False),
        ("192.168.1.5", False),
        ("::ffff:10.0.0.1", False),
        ("2001:db8::1", False),
        ("testclient", False),
        ("localhost", False),  # a name is never trusted: only the socket's address counts
        ("", False),
        (None, False),
    ],
)
def test_is_loopback(host: str | None, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_presented_keys() -> None:
    assert presented_keys({"authorization": "Bearer  abc "}) == ["abc"]
    assert presented_keys({"authorization": "bearer abc", "x-api-key": "def"}) == ["abc", "def"]
    assert presented_keys({"authorization": "Basic abc"}) == []
    assert presented_keys({"authorization": "Bearer", "x-api-key": " "}) == []


def test_real_server_admits_loopback_without_a_key(cache_dir: Path, manager: CacheManager) -> None:
    """uvicorn fills the peer address from the socket: a loopback connection passes the guard."""
    port = free_port()
    # No PeerMiddleware here: the address the guard sees must come from the socket itself.
    script = (
        "import sys, uvicorn\n"
        "from pathlib import Path\n"
        "from cachesvc.serving.app import create_app\n"
        "from cachesvc.settings.config import ServeConfig\n"
        "from tests.admin.conftest import open_manager\n"
        "m = open_manager(Path(sys.argv[1]))\n"
        "config = ServeConfig(cache_dir=Path(sys.argv[1]), host='127.0.0.1', port=int(sys.argv[2]))\n"
        "app = create_app(config, m)\n"
        "uvicorn.run(app, host='127.0.0.1', port=int(sys.argv[2]), log_level='warning')\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(cache_dir), str(port)], cwd=REPO_ROOT, env=child_env()
    )
    try:
        r = wait_http_ok(f"http://127.0.0.1:{port}/admin/stats", timeout=30, proc=proc)
        assert r.status_code == 200, r.text
        assert r.json()["max_size_bytes"] == manager.max_size_bytes
    finally:
        proc.terminate()
        proc.wait(timeout=10)
