"""Stats and Prometheus metrics agree with the catalog's events, across processes and restarts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from litestar.testing import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cachesvc.cache.builders import BuildJob
from cachesvc.cache.manager import CacheManager
from cachesvc.errors import BuildError
from cachesvc.http.metrics import ServingMetrics, build_duration_buckets
from inference.serving.context_cache import ContextCacheStats
from tests.admin.conftest import build_app, open_manager
from tests.support.apps import LOOPBACK_URL
from tests.support.cache import REPO_ROOT, FileBuilder, child_env, make_checkpoint


class FailingBuilder(FileBuilder):
    """Writes one file, then fails like a builder that hits an unsupported architecture."""

    version = "failing-1"

    def build(self, job: BuildJob) -> dict[str, Any]:
        (job.out_dir / "partial.bin").write_bytes(b"x" * 10)
        raise BuildError("unsupported architecture for this test builder")


def _scripted_sequence(manager: CacheManager, tmp_path: Path) -> None:
    """hits, misses, builds ok and failed, evictions by manual / clear / lru."""
    ck = [str(make_checkpoint(tmp_path / f"ck{i}", seed=100 + i)) for i in range(3)]
    first = manager.prepare(ck[0]).bundle_id  # miss + build_ok
    manager.prepare(ck[0])  # hit
    manager.prepare(ck[0])  # hit
    second = manager.prepare(ck[1]).bundle_id  # miss + build_ok
    manager.evictor.remove(second)  # evict manual
    manager.prepare(ck[2])  # miss + build_ok
    manager.catalog.bundles.set_pinned(first, True)
    manager.evictor.clear()  # evict clear (ck[2]); ck[0] is pinned
    manager.catalog.bundles.set_pinned(first, False)
    manager.evictor.prune(0)  # evict lru (ck[0])
    failing = CacheManager.open(
        manager.layout.root,
        catalog_url=manager.catalog.url,
        max_size_bytes=manager.max_size_bytes,
        builders={"onnxruntime": FailingBuilder()},
    )
    try:
        with pytest.raises(BuildError):
            failing.prepare(ck[0])  # miss + build_failed (another builder version: another bundle)
    finally:
        failing.close()


def _metrics(client: TestClient[Any]) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def _expected_from_events(events: list[dict[str, Any]]) -> dict[str, Any]:
    kinds = Counter(e["kind"] for e in events)
    evict = [e for e in events if e["kind"] == "evict"]
    build_seconds = sorted(e["seconds"] for e in events if e["kind"] == "build_ok")
    return {
        "hits": kinds["hit"],
        "misses": kinds["miss"],
        "builds_ok": kinds["build_ok"],
        "builds_failed": kinds["build_failed"],
        "evictions_by_reason": dict(Counter(e["reason"] for e in evict)),
        "evicted_bytes_by_reason": {
            r: sum(e["bytes"] for e in evict if e["reason"] == r) for r in {e["reason"] for e in evict}
        },
        "build_seconds": build_seconds,
    }


def _stats_in_child(cache_dir: Path) -> dict[str, Any]:
    """Stats as another process sharing the catalog computes them."""
    code = (
        "import sys, msgspec\n"
        "from pathlib import Path\n"
        "from cachesvc.cache.manager import CacheManager\n"
        "from cachesvc.http.schemas import StatsOut, to_body\n"
        "from tests.support.databases import catalog_url_for\n"
        "root = Path(sys.argv[1])\n"
        "m = CacheManager.open(root, catalog_url=catalog_url_for(root), max_size_bytes=10**12, builders={})\n"
        "sys.stdout.write(msgspec.json.encode(to_body(m.queries.stats(), StatsOut)).decode())\n"
        "m.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(cache_dir)],
        cwd=REPO_ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


def test_stats_and_metrics_agree_with_events_and_survive_restart(
    manager: CacheManager, cache_dir: Path, tmp_path: Path
) -> None:
    _scripted_sequence(manager, tmp_path)
    app, _ = build_app(manager)
    with TestClient(app, base_url=LOOPBACK_URL) as client:
        events = client.get("/admin/events", params={"limit": 1000}).json()["items"]
        expected = _expected_from_events(events)
        # The script's own arithmetic, so a mapper that agrees with a wrong log still fails.
        assert (expected["hits"], expected["misses"], expected["builds_ok"], expected["builds_failed"]) == (
            2,
            4,
            3,
            1,
        )
        assert expected["evictions_by_reason"] == {"manual": 1, "clear": 1, "lru": 1}

        stats = client.get("/admin/stats").json()
        for key in (
            "hits",
            "misses",
            "builds_ok",
            "builds_failed",
            "evictions_by_reason",
            "evicted_bytes_by_reason",
        ):
            assert stats[key] == expected[key], key
        assert stats["hit_rate"] == pytest.approx(2 / 6)
        assert stats["median_build_seconds"] == pytest.approx(expected["build_seconds"][1])
        # The failed build left no row (its failure is an event), so no bundle is counted.
        assert stats["bundles"] == 0 and stats["bundles_by_state"] == {}
        assert stats["checkpoints"] == 3 and stats["size_bytes"] == 0
        assert stats["max_size_bytes"] == manager.max_size_bytes
        assert stats["since"] == min(
            e["at"] for e in events if e["kind"] in ("hit", "miss", "build_ok", "evict")
        )
        per_model = {m["model"]: m for m in stats["per_model"]}
        assert sum(m["hits"] for m in per_model.values()) == 2
        assert sum(m["misses"] for m in per_model.values()) == 4

        metrics = _metrics(client)
        assert metrics["cachesvc_cache_hits_total"][()] == expected["hits"]
        assert metrics["cachesvc_cache_misses_total"][()] == expected["misses"]
        for reason in ("lru", "manual", "clear", "stale", "corrupt"):
            labels = (("reason", reason),)
            assert metrics["cachesvc_evictions_total"][labels] == expected["evictions_by_reason"].get(
                reason, 0
            )
            assert metrics["cachesvc_evicted_bytes_total"][labels] == expected["evicted_bytes_by_reason"].get(
                reason, 0
            )
        assert metrics["cachesvc_builds_total"] == {(("result", "ok"),): 3, (("result", "failed"),): 1}
        assert metrics["cachesvc_cache_size_bytes"][()] == 0
        assert metrics["cachesvc_cache_max_size_bytes"][()] == manager.max_size_bytes
        assert metrics["cachesvc_bundles"][(("state", "failed"),)] == 0
        assert metrics["cachesvc_bundles"][(("state", "ready"),)] == 0
        assert metrics["cachesvc_build_duration_seconds_count"][()] == 3
        assert metrics["cachesvc_build_duration_seconds_sum"][()] == pytest.approx(
            sum(expected["build_seconds"])
        )
        inf = metrics["cachesvc_build_duration_seconds_bucket"][(("le", "+Inf"),)]
        assert inf == 3

    # Another process sharing the catalog computes the same numbers.
    assert _stats_in_child(cache_dir) == stats

    # Restart: a new manager and a new app (new registry) over the same cache.
    manager.close()
    reopened = open_manager(cache_dir)
    try:
        app2, _ = build_app(reopened)
        with TestClient(app2, base_url=LOOPBACK_URL) as client2:
            assert client2.get("/admin/stats").json() == stats
            again = _metrics(client2)
            for name in (
                "cachesvc_cache_hits_total",
                "cachesvc_cache_misses_total",
                "cachesvc_evictions_total",
                "cachesvc_evicted_bytes_total",
                "cachesvc_builds_total",
                "cachesvc_build_duration_seconds_bucket",
            ):
                assert again[name] == metrics[name], name
    finally:
        reopened.close()


def test_build_duration_buckets_are_cumulative() -> None:
    buckets = build_duration_buckets([0.5, 3.0, 3.0, 45.0, 5000.0], bounds=(1, 5, 60))
    assert buckets == [("1.0", 1.0), ("5.0", 3.0), ("60.0", 4.0), ("+Inf", 5.0)]
    assert build_duration_buckets([], bounds=(1,)) == [("1.0", 0.0), ("+Inf", 0.0)]


def test_serving_and_http_metrics(manager: CacheManager) -> None:
    app, metrics = build_app(manager)
    observer = metrics.serving.for_model("m")
    observer.first_token(0.2)
    observer.first_token(3.0)
    observer.tokens_generated(5)
    observer.tokens_generated(7)
    observer.queue_changed(3, 2)
    with TestClient(app, base_url=LOOPBACK_URL) as client:
        client.get("/admin/bundles/0123456789abcdef-0123456789ab")
        client.get("/admin/bundles/fedcba9876543210-fedcba987654")
        client.get("/admin/stats")
        m = _metrics(client)
    model = (("model", "m"),)
    assert m["cachesvc_time_to_first_token_seconds_count"][model] == 2
    assert m["cachesvc_time_to_first_token_seconds_sum"][model] == pytest.approx(3.2)
    assert m["cachesvc_time_to_first_token_seconds_bucket"][(("le", "0.25"), ("model", "m"))] == 1
    assert m["cachesvc_generated_tokens_total"][model] == 12
    assert m["cachesvc_queue_depth"][model] == 3
    assert m["cachesvc_active_requests"][model] == 2
    requests = m["cachesvc_http_requests_total"]
    # Route templates, not raw paths: two different ids count under one series.
    detail = (("method", "GET"), ("route", "/admin/bundles/{bundle_id}"), ("status", "404"))
    assert requests[detail] == 2
    assert requests[(("method", "GET"), ("route", "/admin/stats"), ("status", "200"))] == 1
    assert not any("0123456789abcdef" in dict(k)["route"] for k in requests)
    durations = m["cachesvc_http_request_duration_seconds_count"]
    assert durations[(("route", "/admin/bundles/{bundle_id}"),)] == 2


def test_each_app_has_its_own_registry(manager: CacheManager) -> None:
    _, a = build_app(manager)
    _, b = build_app(manager)
    a.serving.for_model("m").tokens_generated(4)
    assert b'cachesvc_generated_tokens_total{model="m"}' not in b.exposition()
    assert b'cachesvc_generated_tokens_total{model="m"} 4.0' in a.exposition()


def test_context_cache_metrics_are_per_model_and_survive_a_reload() -> None:
    registry = CollectorRegistry()
    serving = ServingMetrics(registry)
    first, second = serving.for_model("a"), serving.for_model("b")
    first.context_cache_changed(ContextCacheStats(lookups=230, hits=200, records=5, bytes=50))
    second.context_cache_changed(ContextCacheStats(lookups=12, hits=1, records=1, bytes=10))

    def samples() -> dict[tuple[str, str], float]:
        out: dict[tuple[str, str], float] = {}
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for s in family.samples:
                if s.name.startswith("cachesvc_context_cache_"):
                    out[(s.name, s.labels["model"])] = s.value
        return out

    got = samples()
    assert got[("cachesvc_context_cache_lookups_total", "a")] == 230
    assert got[("cachesvc_context_cache_lookups_total", "b")] == 12
    # "a" unloads: its gauges go, its counters stay; loaded again, its new engine counts on.
    serving.forget("a")
    got = samples()
    assert ("cachesvc_context_cache_records", "a") not in got
    assert got[("cachesvc_context_cache_lookups_total", "a")] == 230
    serving.for_model("a").context_cache_changed(ContextCacheStats(lookups=3, records=1))
    got = samples()
    assert got[("cachesvc_context_cache_lookups_total", "a")] == 233
    assert got[("cachesvc_context_cache_records", "a")] == 1
