"""Speculative decoding through a real ``cachesvc serve``: the bundle's ``engine.json`` picks
the proposer, a ``draft_model`` bundle loads (and leases) its draft bundle, greedy answers equal
the plain bundle's, and ``/metrics`` counts the verification steps."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cachesvc.cache.manager import CacheManager
from tests.service.conftest import run_cli, running_server

PROFILE = ("--max-input-len", "64", "--max-kv-cache-capacity", "128")
# A prompt whose greedy continuation on the tiny random demo model repeats itself, so ngram
# lookups find matches.
PROMPT = "one two three one two three one two three one two"


def _greedy(base_url: str, model: str) -> str:
    r = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _spec_counters(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name.startswith("cachesvc_spec_decode"):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def _prepare(cache_dir: Path, model: Path, *extra: str) -> dict[str, object]:
    done = run_cli(cache_dir, "prepare", str(model), *PROFILE, *extra, "--json", timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_speculative_bundles_answer_like_the_plain_one(demo_dir: Path, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    plain = _prepare(cache_dir, demo_dir)
    ngram = _prepare(cache_dir, demo_dir, "--speculative-config", '{"method": "ngram"}')
    self_draft = json.dumps({"method": "draft_model", "model": str(demo_dir)})
    drafted = _prepare(cache_dir, demo_dir, "--speculative-config", self_draft)
    assert drafted["draft_bundle_id"] == plain["bundle_id"]  # the draft's own bundle: the plain one
    assert len({plain["bundle_id"], ngram["bundle_id"], drafted["bundle_id"]}) == 3
    with running_server(None, cache_dir, tmp_path) as server:
        expected = _greedy(server.base_url, str(plain["bundle_id"]))
        assert _spec_counters(server.base_url).get("cachesvc_spec_decode_drafts_total", 0.0) == 0.0
        assert _greedy(server.base_url, str(ngram["bundle_id"])) == expected
        assert _greedy(server.base_url, str(drafted["bundle_id"])) == expected
        counters = _spec_counters(server.base_url)
        assert counters["cachesvc_spec_decode_drafts_total"] > 0
        assert counters["cachesvc_spec_decode_accepted_tokens_total"] > 0  # the self-draft agrees
        # The loaded draft_model engine holds its draft bundle's lease too: with the plain
        # bundle's own engine unloaded, the draft bundle is still leased (it cannot be evicted).
        gone = httpx.delete(f"{server.base_url}/admin/engines/{plain['bundle_id']}", timeout=60)
        assert gone.status_code == 200, gone.text
        manager = CacheManager.open(cache_dir, max_size_bytes=10**12)
        try:
            assert manager.queries.holders(str(plain["bundle_id"]))
            httpx.delete(f"{server.base_url}/admin/engines/{drafted['bundle_id']}", timeout=60)
            assert not manager.queries.holders(str(plain["bundle_id"]))  # released with the target
        finally:
            manager.close()
