"""A real ``cachesvc serve`` whose context records cannot be written: on a full disk (a small
tmpfs under ``context/``) every record not written is counted (``disk_write_failures`` in
``/health`` and ``/metrics``), the outage is one ERROR line (no traceback per record), answers go
on, and writing resumes by itself once there is room; a directory where a record's file belongs
is counted and logged once, not on every attempt."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inference.serving.context_cache import PrefixStore
from tests.service.conftest import MODEL, ServerProcess, running_server, serve_args
from tests.support.disks import fill, small_tmpfs

PROFILE = serve_args(max_input_len=256, max_kv_cache_capacity=512)
OUTAGE = "context records cannot be written to"


def _prompt(i: int) -> str:
    """A prompt of three 64-token blocks and a tail (192 tokens), its own from the first token on."""
    return f"{i} " + "The quick brown fox jumps over the lazy dog. " * 10


def _wait_for(server: ServerProcess, done: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """``/health`` context_cache once ``done`` holds for it (the writer thread is asynchronous)."""
    deadline = time.monotonic() + 30
    while True:
        stats: dict[str, Any] = server.health()["context_cache"]
        if done(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def _lines(server: ServerProcess, needle: str) -> list[str]:
    return [line for line in server.log_path.read_text().splitlines() if needle in line]


def _bundle_id(demo_dir: Path, cache: Path, logs: Path) -> str:
    with running_server(demo_dir, cache, logs, *PROFILE) as server:
        return server.bundle_id()


def test_a_full_disk_is_counted_logged_once_and_writing_resumes(demo_dir: Path, tmp_path: Path) -> None:
    cache, logs = tmp_path / "cache", tmp_path / "logs"
    logs.mkdir()
    _bundle_id(demo_dir, cache, logs)  # builds the bundle off the small disk
    with small_tmpfs(cache / "context", 1 << 20) as context:
        filler = fill(context / "filler")
        with running_server(demo_dir, cache, logs, *PROFILE) as server:
            client = server.client()
            for i in range(20):
                out = client.completions.create(model=MODEL, prompt=_prompt(i), max_tokens=2, temperature=0)
                assert out.choices[0].finish_reason in ("length", "stop")
            # Three blocks and a tail for each request: at least 80 records not written.
            full = _wait_for(server, lambda s: s.get("disk_write_failures", 0) >= 80)
            log = server.log_path.read_text()
            print(f"\n20 requests on a full disk: {full.get('disk_write_failures')} records not written; "
                  f"{log.count('Traceback')} tracebacks, {len(_lines(server, OUTAGE))} outage line")
            assert "Traceback" not in log and len(_lines(server, OUTAGE)) == 1, log[-3000:]
            assert "No space left on device" in _lines(server, OUTAGE)[0]
            assert full["disk_writes"] == 0 and full["disk_write_failures"] >= 80, full
            assert full["records"] > 0, full  # in memory all the same
            with server.http() as h:
                metrics = h.get("/metrics").text
            assert (f'cachesvc_context_cache_disk_write_failures_total{{model="{MODEL}"}} '
                    f'{float(full["disk_write_failures"])}') in metrics

            filler.unlink()  # room again: the next records are written, without a restart
            for i in range(20, 23):
                client.completions.create(model=MODEL, prompt=_prompt(i), max_tokens=2, temperature=0)
            resumed = _wait_for(server, lambda s: s["disk_writes"] >= 3)
            assert resumed["disk_writes"] >= 3 and resumed["disk_records"] >= 3, resumed
            assert len(_lines(server, "context records are written to")) == 1
            assert len(_lines(server, OUTAGE)) == 1
            written = {p.name for p in context.glob("*/*.kv")}
        assert len(written) >= resumed["disk_records"]


def test_a_directory_in_a_records_place_is_logged_once(demo_dir: Path, tmp_path: Path) -> None:
    cache, logs = tmp_path / "cache", tmp_path / "logs"
    logs.mkdir()
    bid = _bundle_id(demo_dir, cache, logs)
    ids = list(range(5, 5 + 3 * 64 + 10))  # three blocks and a tail, as token ids
    first = PrefixStore(f"bundle:{bid}", max_records=1).block_keys(ids)[0]
    in_the_way = cache / "context" / bid / f"{first.hex()}.kv"
    in_the_way.mkdir(parents=True)
    # One record in memory: every request inserts (and tries to write) the blocks again.
    with running_server(demo_dir, cache, logs, *PROFILE, "--context-cache-max-records", "1") as server:
        client = server.client()
        for _ in range(4):
            client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
        stats = _wait_for(server, lambda s: s["disk_writes"] >= 2 and s.get("disk_write_failures", 0) >= 1)
        lines = _lines(server, first.hex())
        assert "Traceback" not in server.log_path.read_text() and len(lines) == 1, lines
        assert "is a directory" in lines[0], lines
        assert stats["disk_write_failures"] == 1 and stats["disk_writes"] >= 2, stats
    assert in_the_way.is_dir() and not any(in_the_way.iterdir())
