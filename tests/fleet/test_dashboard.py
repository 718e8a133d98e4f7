"""The dashboard in a real headless Chromium (Debian's, driven by Playwright for Python).

A real server process (the app under uvicorn) on a seeded catalog with two nodes: the page
loads with no console errors, every number it shows equals the JSON API's, it refreshes
itself when the catalog changes, switches nodes, fits a phone screen, and leaves screenshots
in ``$CACHESVC_TEST_ARTIFACTS`` (default ``test-artifacts/``) for people to look at.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.errors import BuildError
from tests.support.cache import REPO_ROOT, FileBuilder, child_env, make_checkpoint
from tests.support.net import free_port, wait_http_ok

pytestmark = pytest.mark.usefixtures("catalog_db")

CHROMIUM = os.environ.get("CACHESVC_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
ARTIFACTS = Path(os.environ.get("CACHESVC_TEST_ARTIFACTS", REPO_ROOT / "test-artifacts"))


class _Broken(FileBuilder):
    def build(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        raise ValueError("weights are missing tensor 'lm_head.weight'")


def _manager(root: Path, url: str, node: str) -> CacheManager:
    return CacheManager.open(
        root,
        catalog_url=url,
        node=node,
        max_size_bytes=50_000,
        builders={"onnxruntime": FileBuilder(files=2, file_size=3000)},
        offline=True,
    )


@pytest.fixture
def seeded(tmp_path: Path, fleet_url: str) -> Iterator[tuple[CacheManager, str, Path]]:
    """node-a: builds, hits, a failed build and evictions; node-b: one bundle. Returns a's server."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)")
    a = _manager(tmp_path / "a", fleet_url, "node-a")
    b = _manager(tmp_path / "b", fleet_url, "node-b")
    ckpts = [str(make_checkpoint(tmp_path / "models" / f"m{i}", seed=60 + i)) for i in range(4)]
    for i, ck in enumerate(ckpts):
        a.prepare(ck)
        for _ in range(i):
            a.prepare(ck)  # i hits
    a.prepare(ckpts[0], ProfileRequest(max_input_len=64))
    a.evictor.prune(4 * 6000)  # one lru eviction
    least_hit = a.queries.list_bundles(node="node-a", sort="hits", order="asc", limit=1).items[0].id
    a.evictor.remove(least_hit)  # one manual
    broken = CacheManager.open(
        tmp_path / "a",
        catalog_url=fleet_url,
        node="node-a",
        max_size_bytes=50_000,
        builders={"onnxruntime": _Broken()},
        offline=True,
    )
    with pytest.raises(BuildError):
        broken.prepare(str(make_checkpoint(tmp_path / "models" / "bad", seed=99)))  # one build_failed
    broken.close()
    b.prepare(ckpts[1])
    # node-b reports a cap far above its one bundle: its size chart labels the cap off scale
    b.fleet.heartbeat(pid=os.getpid(), max_size_bytes=5_000_000, heartbeat_seconds=3600.0, loaded_models=[],
                      started_at=datetime.now(UTC))
    b.close()
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.support.fleet_node",
            str(tmp_path / "a"),
            fleet_url,
            "node-a",
            str(port),
            "50000",
        ],
        cwd=REPO_ROOT,
        env=child_env(),
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{base}/health", timeout=60, proc=proc)
        yield a, base, tmp_path
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        a.close()


def _wait(page: Any, check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    """Poll from Python: the page's CSP forbids the eval that ``wait_for_function`` needs."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        page.wait_for_timeout(100)


def _refreshes(page: Any) -> int:
    return int(page.get_attribute("body", "data-refreshes") or 0)


def _value(page: Any, testid: str) -> str:
    return str(page.get_attribute(f'[data-testid="{testid}"]', "data-value"))


def _check_numbers(page: Any, api: httpx.Client, node: str, *, cap_in_range: bool = True) -> None:
    stats = api.get("/admin/stats", params={"node": node}).json()
    for key in ("size_bytes", "max_size_bytes", "hits", "misses", "builds_ok", "builds_failed", "bundles",
                "pulls", "pushes", "pulled_bytes", "pushed_bytes"):
        assert _value(page, key) == str(stats[key]), key
    assert float(_value(page, "hit_rate")) == pytest.approx(stats["hit_rate"])
    chart = page.locator('[data-testid="size_chart"] svg')
    assert chart.get_attribute("data-current") == str(stats["size_bytes"])
    assert chart.get_attribute("data-cap") == str(stats["max_size_bytes"])
    # Scaled to the data: the cap is drawn where it is within 3x of the line's peak, else labelled
    # off scale (a 50 GB cap over 122 MB of bundles flattened the line onto the axis).
    ymax = int(chart.get_attribute("data-ymax"))
    assert ymax >= stats["size_bytes"]
    assert chart.get_attribute("data-cap-shown") == str(cap_in_range).lower()
    if cap_in_range:
        assert ymax >= stats["max_size_bytes"]
    else:
        assert ymax < stats["max_size_bytes"] and "off scale" in (chart.text_content() or "")
    evictions = {
        g.get_attribute("data-label"): int(g.get_attribute("data-value"))
        for g in page.locator('[data-testid="evict_chart"] g').all()
    }
    assert evictions == stats["evictions_by_reason"]
    per_model = {
        g.get_attribute("data-label"): (
            g.get_attribute("data-model"),
            int(g.get_attribute("data-hits")),
            int(g.get_attribute("data-misses")),
        )
        for g in page.locator('[data-testid="model_chart"] g').all()
    }
    # Models by served name (a local checkpoint: its path's last component), the path kept aside.
    assert per_model == {
        m["model_name"]: (m["model"], m["hits"], m["misses"])
        for m in stats["per_model"] if m["hits"] + m["misses"]
    }
    assert all(name == Path(model).name for name, (model, _, _) in per_model.items())
    for testid, sort, field in (("top_hits", "hits", "hit_count"), ("top_size", "size", "size_bytes")):
        listing = api.get("/admin/bundles", params={"node": node, "sort": sort, "limit": 10}).json()["items"]
        shown = [
            (g.get_attribute("data-id"), g.get_attribute("data-label"), int(g.get_attribute("data-value")))
            for g in page.locator(f'[data-testid="{testid}"] g').all()
        ]
        # Bundles by model and profile (the id in the tooltip and data-id).
        want = [(b["id"], f"{b['model_name']} · {b['profile_name']}", b[field]) for b in listing]
        assert shown == want, testid
    nodes = {n["name"]: n for n in api.get("/admin/nodes").json()["items"]}
    rows = page.locator('[data-testid="nodes"] tbody tr').all()
    assert {r.get_attribute("data-node") for r in rows} == set(nodes)
    for r in rows:
        n = nodes[str(r.get_attribute("data-node"))]
        got = [r.get_attribute(f"data-{k}") for k in ("bundles", "state", "pulled", "built")]
        assert got == [str(n["bundles"]), n["state"], str(n["pulled"]), str(n["built"])]


def test_dashboard_in_chromium_shows_the_api_numbers(seeded: tuple[CacheManager, str, Path]) -> None:
    from playwright.sync_api import sync_playwright

    manager, base, tmp_path = seeded
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    problems: list[str] = []
    api = httpx.Client(base_url=base, timeout=10.0)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1000})
            page.on(
                "console",
                lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None,
            )
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            external: list[str] = []
            page.on("request", lambda r: None if r.url.startswith(base) else external.append(r.url))
            page.goto(f"{base}/admin/dashboard?refresh=1")
            _wait(page, lambda: _refreshes(page) >= 1, "the first refresh")
            assert page.locator("#error").is_hidden(), page.text_content("#error")
            _check_numbers(page, api, "node-a")
            page.screenshot(path=str(ARTIFACTS / "dashboard-wide.png"), full_page=True)

            # Live refresh: a new hit shows up without a reload.
            hits_before = int(_value(page, "hits"))
            bid = manager.queries.list_bundles(node="node-a", state="ready", limit=1).items[0]
            manager.catalog.bundles.record_hit(bid.id)
            _wait(page, lambda: _value(page, "hits") == str(hits_before + 1), "the new hit", 15)
            _check_numbers(page, api, "node-a")

            # Another node's view.
            page.select_option("#node", "node-b")
            _wait(page, lambda: page.get_attribute("body", "data-node") == "node-b", "node-b's view", 15)
            _check_numbers(page, api, "node-b", cap_in_range=False)  # one 6 kB bundle under 5 MB

            # A phone: one column, nothing wider than the screen.
            phone = browser.new_page(viewport={"width": 390, "height": 844}, is_mobile=True)
            phone.on("pageerror", lambda e: problems.append(f"page error (phone): {e}"))
            phone.goto(f"{base}/admin/dashboard")
            _wait(phone, lambda: _refreshes(phone) >= 1, "the phone's first refresh")
            assert phone.evaluate("document.documentElement.scrollWidth") <= 390
            _check_numbers(phone, api, "node-a")
            phone.screenshot(path=str(ARTIFACTS / "dashboard-phone.png"), full_page=True)
        finally:
            browser.close()
    api.close()
    assert problems == []
    assert external == []
    assert (ARTIFACTS / "dashboard-wide.png").stat().st_size > 10_000
    shutil.copy(ARTIFACTS / "dashboard-wide.png", tmp_path / "dashboard-wide.png")
