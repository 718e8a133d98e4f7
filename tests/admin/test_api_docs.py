"""The OpenAPI viewers of a real ``cachesvc serve`` (issue 30, item 14): Swagger UI and ReDoc
from the server's own ``/schema/assets/`` (the ``openapi-ui-bundles`` files), never a CDN, behind
the admin key like the JSON; in Chromium (where installed) the pages render the API and make no
request to another origin."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.demo import write_demo_checkpoint
from tests.service.conftest import ServerProcess, running_server

KEY = "docs-admin-key"
VIEWERS = {"/schema/swagger": "SwaggerUIBundle", "/schema/redoc": "Redoc.init"}
CHROMIUM = os.environ.get("CACHESVC_TEST_CHROMIUM", "/usr/bin/chromium")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("docs")
    model = write_demo_checkpoint(root / "demo", arch="qwen2", size="tiny")
    with running_server(model, root / "cache", root, "--admin-api-key", KEY, "--max-input-len", "32",
                        "--max-kv-cache-capacity", "64") as srv:
        yield srv


def _references(page: str) -> list[str]:
    return re.findall(r"""(?:src|href)=["']([^"']+)["']""", page)


def test_the_viewers_and_their_assets_come_from_the_server(server: ServerProcess) -> None:
    with server.http() as h:
        for path, marker in VIEWERS.items():
            r = h.get(path, headers={"x-api-key": KEY})
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), r.text
            assert marker in r.text and '"/v1/chat/completions"' in r.text
            assert "default-src 'none'" in r.headers["content-security-policy"]
            refs = _references(r.text)
            assert refs and all(ref.startswith("/schema/assets/") for ref in refs), refs
            for ref in refs:
                asset = h.get(ref, headers={"Authorization": f"Bearer {KEY}"})
                assert asset.status_code == 200 and len(asset.content) > 500, (ref, asset.status_code)
                kind = {"js": "text/javascript", "css": "text/css", "png": "image/png"}[ref.rsplit(".", 1)[1]]
                assert asset.headers["content-type"].startswith(kind), (ref, asset.headers)
        assert h.get("/schema/assets/index.html", headers={"x-api-key": KEY}).status_code == 404
        assert h.get("/schema", headers={"x-api-key": KEY}).json()["info"]["title"] == "cachesvc"


def test_the_viewers_need_the_admin_key_as_the_schema_does(server: ServerProcess) -> None:
    paths = [*VIEWERS, "/schema/assets/swagger-ui-bundle.js", "/schema/assets/redoc.standalone.js", "/schema"]
    with server.http() as h:
        for path in paths:
            assert h.get(path).status_code == 401, path
            assert h.get(path, headers={"x-api-key": "wrong"}).status_code == 401, path


def test_the_viewers_render_in_chromium_without_another_origin(server: ServerProcess) -> None:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)")
    from playwright.sync_api import sync_playwright

    base = server.base_url
    external: list[str] = []
    problems: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu", "--no-first-run"])
        try:
            context = browser.new_context(extra_http_headers={"x-api-key": KEY})
            page = context.new_page()
            ours = (base, f"blob:{base}")
            # A load from elsewhere: a response, or a request the CSP did not stop. (ReDoc's
            # sidebar asks for a logo on cdn.redoc.ly; the policy blocks it in the browser.)
            page.on("response", lambda r: None if r.url.startswith(ours) else external.append(r.url))
            page.on("requestfailed", lambda r: None if r.url.startswith(ours) or (r.failure or "").lower()
                    in ("csp", "net::err_blocked_by_csp") else external.append(f"{r.url}: {r.failure}"))
            page.on("requestfinished", lambda r: None if r.url.startswith(ours) else external.append(r.url))
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.goto(f"{base}/schema/swagger")
            page.wait_for_selector(".swagger-ui .info .title", timeout=30_000)
            assert "cachesvc" in (page.text_content(".swagger-ui .info .title") or "")
            shows_routes = "document.body.innerText.includes('/v1/chat/completions')"
            page.wait_for_function(shows_routes, timeout=30_000)
            page.goto(f"{base}/schema/redoc")
            page.wait_for_function(shows_routes, timeout=60_000)
        finally:
            browser.close()
    assert external == [] and problems == [], (external, problems)
