"""Wiring of a real ``cachesvc serve`` process: what only the assembled service can show.

Unit tests check the admin guard and the metrics collectors on their own; these check that
``serve`` connects them: ``--admin-api-key`` guards ``/admin`` and ``/metrics`` of the real app,
and the serving metrics move when a real request runs through the real engine and scheduler.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service.conftest import API_KEY, MODEL, ServerProcess, running_server

ADMIN_KEY = "e2e-admin-key"


@pytest.fixture(scope="module")
def keyed_server(demo_dir: Path, cache_dir: Path, log_dir: Path) -> Iterator[ServerProcess]:
    """The real engine behind both keys."""
    args = ("--max-input-len", "64", "--max-kv-cache-capacity", "128", "--admin-api-key", ADMIN_KEY)
    with running_server(demo_dir, cache_dir, log_dir, *args, api_key=API_KEY) as server:
        yield server


def _metric(text: str, name: str, labels: str = "") -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    pattern = re.compile(rf"^{re.escape(name)}(\{{[^}}]*{re.escape(labels)}[^}}]*\}})?\s+(\S+)$", re.M)
    return sum(float(m.group(2)) for m in pattern.finditer(text))


def test_admin_key_guards_admin_routes_and_metrics(keyed_server: ServerProcess) -> None:
    with keyed_server.http() as h:
        for path in ("/admin/stats", "/admin/bundles", "/metrics"):
            assert h.get(path).status_code == 401, path
            assert h.get(path, headers={"x-api-key": "wrong"}).status_code == 401, path
            # The completion key is not an admin key.
            assert h.get(path, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 401, path
            assert h.get(path, headers={"x-api-key": ADMIN_KEY}).status_code == 200, path
        # And the admin key is not a completion key.
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"x-api-key": ADMIN_KEY})
        assert r.status_code == 401


def test_serving_metrics_move_with_a_real_request(keyed_server: ServerProcess) -> None:
    headers = {"x-api-key": ADMIN_KEY}
    with keyed_server.http() as h:
        before = h.get("/metrics", headers=headers).text
    reply = keyed_server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0)
    generated = reply.usage.completion_tokens if reply.usage else 0
    assert generated >= 1
    with keyed_server.http() as h:
        after = h.get("/metrics", headers=headers).text
    ttft = "cachesvc_time_to_first_token_seconds_count"
    assert _metric(after, ttft) == _metric(before, ttft) + 1
    tokens = "cachesvc_generated_tokens_total"
    assert _metric(after, tokens) - _metric(before, tokens) == generated
    # The request was counted by route and status, and nothing is left queued or running.
    requests = "cachesvc_http_requests_total"
    assert _metric(after, requests, 'status="200"') > _metric(before, requests, 'status="200"')
    assert _metric(after, "cachesvc_queue_depth") == 0
    assert _metric(after, "cachesvc_active_requests") == 0


def test_the_startup_model_counts_as_a_loaded_model(keyed_server: ServerProcess) -> None:
    """The model loaded before the pool started is a load like any other (issue 30, item 9)."""
    with keyed_server.http() as h:
        text = h.get("/metrics", headers={"x-api-key": ADMIN_KEY}).text
    assert _metric(text, "cachesvc_loaded_models") == 1
    assert _metric(text, "cachesvc_model_loads_total", f'model="{MODEL}"') == 1
    assert _metric(text, "cachesvc_model_load_seconds_count") == 1


def test_health_shows_served_names_never_a_server_path(
    keyed_server: ServerProcess, demo_dir: Path, cache_dir: Path
) -> None:
    """``/health`` is open even behind both keys: it names models as ``/v1/models`` lists them,
    never by the checkpoint path they were started from or asked for (issue 30, item 10)."""
    # A request may name the checkpoint by its path: that spelling answers, but is not shown.
    reply = keyed_server.client().completions.create(model=str(demo_dir), prompt="Hi", max_tokens=1)
    assert reply.choices
    with keyed_server.http() as h:
        r = h.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["model"] == MODEL
    assert [m["names"] for m in body["models"]] == [[MODEL]]
    for path in (str(demo_dir), str(cache_dir)):
        assert path not in r.text, r.text
    assert not re.search(r'"(/|~|\./|\.\./)', r.text), r.text  # no value that is a path
