"""Item 1: no web page can drive the server (CSRF, DNS rebinding), and bodies are JSON only."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from cachesvc.settings.config import ServeConfig
from tests.support.whole_app import MODEL, App, running_app


def test_admin_refuses_a_text_plain_body(app: App) -> None:
    # What a cross-site <form enctype="text/plain"> or fetch(no-cors) can send without preflight.
    with app.http() as h:
        r = h.post("/admin/cache/clear", content=b'{"dry_run": true}', headers={"content-type": "text/plain"})
        assert r.status_code == 415, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
        assert "application/json" in r.json()["detail"]
        for ctype in ("application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = h.post("/admin/builds", content=b'{"model": "x"}', headers={"content-type": ctype})
            assert r.status_code == 415, r.text
        assert h.post("/admin/cache/clear", json={"dry_run": True}).status_code == 200


def test_admin_refuses_a_foreign_origin(app: App) -> None:
    with app.http() as h:
        for origin in ("https://evil.example", "null", f"http://localhost:{app.port + 1}"):
            r = h.post("/admin/cache/clear", json={"dry_run": True}, headers={"origin": origin})
            assert r.status_code == 403, (origin, r.text)
            assert "Origin" in r.json()["detail"]
        r = h.get("/admin/stats", headers={"origin": "https://evil.example"})
        assert r.status_code == 403
        # The server's own origin (its Swagger UI) is fine.
        same = h.post("/admin/cache/clear", json={"dry_run": True}, headers={"origin": app.url})
        assert same.status_code == 200, same.text


def test_foreign_host_header_is_refused_everywhere(app: App) -> None:
    # DNS rebinding: evil.example resolves to 127.0.0.1, the browser sends Host: evil.example.
    with app.http() as h:
        for path in ("/admin/stats", "/v1/models", "/health"):
            r = h.get(path, headers={"host": f"evil.example:{app.port}"})
            assert r.status_code == 400, (path, r.text)
        assert h.get("/admin/stats", headers={"host": f"localhost:{app.port}"}).status_code == 200
        assert h.get("/v1/models", headers={"host": f"127.0.0.1:{app.port}"}).status_code == 200


def test_v1_refuses_non_json_bodies(app: App) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    with app.http() as h:
        r = h.post("/v1/completions", content=body, headers={"content-type": "text/plain"})
        assert r.status_code == 415, r.text
        assert r.json()["error"]["code"] == "unsupported_media_type"
        r = h.post(
            "/v1/completions", content=body, headers={"content-type": "application/json; charset=utf-8"}
        )
        assert r.status_code == 200, r.text


def test_default_allowed_hosts_are_loopback_and_the_bind_address() -> None:
    cfg = ServeConfig(host="10.1.2.3", port=9000)
    assert set(cfg.http.allowed_host_names()) == {"localhost", "127.0.0.1", "::1", "10.1.2.3"}
    assert {"[::1]:9000", "10.1.2.3", "10.1.2.3:9000"} <= set(cfg.http.allowed_host_headers())
    assert ServeConfig(allowed_hosts="a.example, b.example").http.allowed_host_names() == (
        "a.example",
        "b.example",
    )
    assert ServeConfig(allowed_hosts="*").http.allowed_host_headers() == ("*",)


@pytest.fixture(scope="module")
def cors_app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    with running_app(tmp_path_factory.mktemp("cors"), cors_allowed_origins="https://app.example") as running:
        yield running


def test_cors_opens_v1_only(cors_app: App) -> None:
    origin = {"origin": "https://app.example"}
    with cors_app.http() as h:
        r = h.get("/v1/models", headers=origin)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        pre = h.options(
            "/v1/chat/completions",
            headers={
                **origin,
                "access-control-request-method": "POST",
                "access-control-request-headers": "content-type",
            },
        )
        assert pre.status_code in (200, 204)
        # The same origin still cannot touch the admin API.
        assert h.post("/admin/cache/clear", json={"dry_run": False}, headers=origin).status_code == 403
