"""Context records on disk with a real server: written under ``<cache>/context/<bundle_id>/``,
found again after a restart (counted as disk hits in /health and /metrics), a salted prefix only
with its salt, a damaged record dropped with the answer still right; the records count in the
cache's size and go when the bundle is removed."""

from __future__ import annotations

import json
from pathlib import Path

from tests.service.conftest import (
    MODEL,
    ServerProcess,
    run_cli,
    running_server,
    serve_args,
    settled_context_cache,
)
from tests.service.test_context_reuse import PROFILE, PROMPT, _metric

SALTED = "A tenant's own prompt, one it keeps to itself: " * 12


def _complete(server: ServerProcess, prompt: str, salt: str | None = None) -> tuple[str, int]:
    """The greedy text of ``prompt`` and how many prompt tokens it did not prefill."""
    before = server.health()["context_cache"]["tokens_reused"]
    out = server.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
        extra_body={"cache_salt": salt} if salt is not None else None,
    )
    after: int = server.health()["context_cache"]["tokens_reused"]
    return out.choices[0].text, after - before


def _size(cache: Path, *command: str) -> int:
    """``size_bytes`` of ``cachesvc stats --json`` (or of another command's JSON)."""
    done = run_cli(cache, *(command or ("stats",)), "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    body = json.loads(done.stdout)
    return int(body.get("size_bytes", body.get("bundle", {}).get("size_bytes", -1)))


def test_records_survive_a_restart(demo_dir: Path, log_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"  # its own cache: other tests' servers expect cold prefixes
    args = serve_args(context_cache_disk_bytes=1 << 26, **PROFILE)
    with running_server(demo_dir, cache, log_dir, *args) as server:
        bid = server.bundle_id()
        cold, reused = _complete(server, PROMPT)
        assert reused == 0
        assert _complete(server, SALTED, "tenant-a")[1] == 0
        stats = settled_context_cache(server, written=True)
        assert stats["disk_max_bytes"] == 1 << 26 and stats["disk_hits"] == 0
        # A tail record is rewritten in place when its sequence grew: more writes than files.
        assert stats["disk_writes"] >= stats["disk_records"] >= 2 and stats["disk_bytes"] > stats["bytes"] / 2
    records = cache / "context" / bid
    files = sorted(records.glob("*.kv"))
    assert len(files) == stats["disk_records"] and not list(records.glob(".*.tmp"))
    on_disk = sum(p.stat().st_size for p in files)
    assert on_disk == stats["disk_bytes"]
    assert _size(cache) == _size(cache, "bundles", "show", bid) + on_disk

    with running_server(demo_dir, cache, log_dir, *args) as server:  # a restart
        text, reused = _complete(server, PROMPT)
        assert text == cold and reused >= 64
        stats = server.health()["context_cache"]
        assert stats["disk_hits"] >= 1 and stats["hits"] == 1 and stats["disk_writes"] == 0
        with server.http() as h:
            metrics = h.get("/metrics").text
        assert _metric(metrics, "cachesvc_context_cache_disk_hits_total") == stats["disk_hits"]
        assert _metric(metrics, "cachesvc_context_cache_disk_bytes") == on_disk
        # The salted prefix: found only with its salt, after the restart too.
        assert _complete(server, SALTED)[1] == 0
        assert _complete(server, SALTED, "tenant-b")[1] == 0
        assert _complete(server, SALTED, "tenant-a")[1] >= 64

    for path in records.glob("*.kv"):  # every record damaged (one flipped byte each)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    with running_server(demo_dir, cache, log_dir, *args) as server:
        text, reused = _complete(server, PROMPT)
        assert text == cold and reused == 0  # nothing damaged is used, the answer is still right
        stats = server.health()["context_cache"]
        # The lookup reads its chain's records at once: each one read is found damaged and removed.
        dropped = stats["disk_dropped"]
        assert dropped >= 1 and stats["disk_hits"] == 0
        with server.http() as h:
            assert _metric(h.get("/metrics").text, "cachesvc_context_cache_disk_dropped_total") == dropped

    done = run_cli(cache, "bundles", "rm", bid)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not records.exists()
    assert _size(cache) == 0


def test_zero_turns_the_disk_off(demo_dir: Path, cache_dir: Path, log_dir: Path) -> None:
    args = serve_args(context_cache_disk_bytes=0, **PROFILE)
    with running_server(demo_dir, cache_dir, log_dir, *args) as server:
        _complete(server, PROMPT + " off")
        stats = server.health()["context_cache"]
        assert stats["disk_max_bytes"] == 0 and stats["disk_writes"] == 0 and stats["records"] >= 1
