"""Disk full during a build, on a real full filesystem (a small tmpfs; needs root to mount).

The build fails with a clear error naming the cause and the way out, nothing stays in staging,
the catalog has no row for the bundle (the failure is an event) and the cache works again as
soon as there is room.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachesvc.cache.manager import CacheManager
from cachesvc.errors import InsufficientStorageError
from tests.admin.conftest import open_manager
from tests.cache.conftest import assert_consistent
from tests.support.cache import FileBuilder, make_checkpoint
from tests.support.disks import fill, small_tmpfs

TMPFS_BYTES = 4 * 1024 * 1024


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "small", TMPFS_BYTES) as mount:
        yield mount


def test_disk_full_during_a_build(small_disk: Path, tmp_path: Path) -> None:
    cache = small_disk / "cache"
    ckpt = make_checkpoint(tmp_path / "ckpt", seed=21)
    # 8 MiB of bundle on a 4 MiB filesystem (the catalog lives there too).
    m = open_manager(cache, FileBuilder(files=8, file_size=1024 * 1024))
    try:
        with pytest.raises(InsufficientStorageError, match="disk space") as info:
            m.prepare(str(ckpt))
        assert "cachesvc prune" in str(info.value)
        assert list((cache / ".staging").iterdir()) == []
        assert m.queries.list_bundles().total == 0
        assert [e.kind for e in m.catalog.events.recent(kind="build_failed")] == ["build_failed"]
        m.reconciler.reconcile()
        assert_consistent(m)
        # With a builder that fits, the same cache works at once.
        m.builders["onnxruntime"] = FileBuilder(files=2, file_size=256 * 1024)
        assert m.prepare(str(ckpt)).built
        assert_consistent(m)
    finally:
        m.close()


def test_disk_full_through_the_cli_is_one_line(small_disk: Path, tmp_path: Path) -> None:
    from tests.service.conftest import cachesvc_command
    from tests.support.cache import child_env

    cache = small_disk / "cache"
    open_manager(cache).close()
    fill(small_disk / "filler")  # leave the filesystem full
    r = subprocess.run(
        [*cachesvc_command(), "--cache-dir", str(cache), "prepare", str(make_checkpoint(tmp_path / "c"))],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "Traceback" not in r.stderr, r.stderr
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "full" in r.stderr


# -- the same rule for every stage: refused up front, one line part way ---------------------


def _leave_free(mount: Path, free: int) -> None:
    """Fill ``mount`` (a tmpfs) with one file so that ``free`` bytes (a page multiple) stay free."""
    size = shutil.disk_usage(mount).free - free
    assert size > 0, (shutil.disk_usage(mount).free, free)
    with (mount / "filler").open("wb") as fh:
        fh.write(b"\0" * size)
    assert shutil.disk_usage(mount).free == free, (shutil.disk_usage(mount).free, free)


def _prepare_cli(cache: Path, catalog: Path, model: Path) -> subprocess.CompletedProcess[str]:
    from tests.service.conftest import cachesvc_command
    from tests.support.cache import child_env

    return subprocess.run(
        [*cachesvc_command(), "--cache-dir", str(cache), "--catalog-url", f"sqlite:///{catalog}",
         "prepare", str(model)],
        env=child_env(), capture_output=True, text=True, timeout=300,
    )


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    """The command's one error line (log lines of the progress may come before it)."""
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if " INFO " not in line]
    assert r.returncode == 1 and len(errors) == 1, r.stderr
    return errors[0].removeprefix("cachesvc: error: ")


def _events(cache: Path, catalog: Path) -> list[tuple[str, str | None, str | None]]:
    m = CacheManager.open(cache, catalog_url=f"sqlite:///{catalog}", max_size_bytes=2**30, offline=True)
    try:
        return [(e.kind, e.model, e.detail) for e in reversed(m.catalog.events.recent(limit=100))]
    finally:
        m.close()


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    from tests.gguf.ggufs import write_pair

    return write_pair("llama", "Q8_0", tmp_path / "gguf")[0]


def test_gguf_conversion_disk_full_part_way_is_one_line_and_leaves_nothing(
        small_disk: Path, tmp_path: Path, tiny_gguf: Path) -> None:
    """Room for the GGUF's copy (so the up-front check lets it start) but not for the tokenizer
    files written before it: the disk fills up part way. Same one line as the bundle stage, the
    staging directory gone, a build_failed event; with room again the same file converts."""
    cache, catalog = small_disk / "cache", tmp_path / "catalog.sqlite3"
    CacheManager.open(cache, catalog_url=f"sqlite:///{catalog}", max_size_bytes=2**30).close()
    page = 4096
    _leave_free(small_disk, -(-tiny_gguf.stat().st_size // page) * page + 2 * page)
    line = _one_line(_prepare_cli(cache, catalog, tiny_gguf))
    assert "converting model.gguf ran out of disk space" in line and "cachesvc prune" in line, line
    assert "Errno" not in line and str(tiny_gguf) not in line, line
    gguf_root = cache / "checkpoints" / "gguf"
    assert [p.name for p in gguf_root.iterdir() if p.name != ".locks"] == []  # no staging, no marker
    failed = [e for e in _events(cache, catalog) if e[0] == "build_failed"]
    assert failed == [("build_failed", str(tiny_gguf), line)], failed
    (small_disk / "filler").unlink()
    m = CacheManager.open(cache, catalog_url=f"sqlite:///{catalog}", max_size_bytes=2**30, offline=True)
    try:
        assert (m.resolve(str(tiny_gguf)).path / "model.gguf").is_file()
    finally:
        m.close()


def test_a_gguf_larger_than_the_free_space_is_refused_before_it_is_copied(
        small_disk: Path, tmp_path: Path, tiny_gguf: Path) -> None:
    cache, catalog = small_disk / "cache", tmp_path / "catalog.sqlite3"
    CacheManager.open(cache, catalog_url=f"sqlite:///{catalog}", max_size_bytes=2**30).close()
    _leave_free(small_disk, 16 * 4096)
    line = _one_line(_prepare_cli(cache, catalog, tiny_gguf))
    assert "converting model.gguf needs about 112.2 KiB of disk but 64.0 KiB is free" in line, line
    assert list((cache / "checkpoints").rglob("*.gguf")) == []
    assert [e for e in _events(cache, catalog) if e[0] != "reconcile"] == []  # nothing started


def test_a_build_larger_than_the_free_space_is_refused_before_it_starts(
        small_disk: Path, tmp_path: Path, tiny_gguf: Path) -> None:
    """The bundle stage: the fp32 build of the reference checkpoint needs its weights three
    times over while it builds (inference.builder.disk_estimate); refused in one line naming
    both figures, before a row, a staging directory or an event."""
    from cachesvc.cache.store.space import human_size
    from inference.builder.disk_estimate import estimate_disk

    ckpt = tiny_gguf.parent / "reference"
    needed = estimate_disk(ckpt, backend="onnxruntime", precision="fp32").peak
    cache, catalog = small_disk / "cache", tmp_path / "catalog.sqlite3"
    CacheManager.open(cache, catalog_url=f"sqlite:///{catalog}", max_size_bytes=2**30).close()
    _leave_free(small_disk, (needed // 2) // 4096 * 4096)
    line = _one_line(_prepare_cli(cache, catalog, ckpt))
    assert f"needs about {human_size(needed)} of disk but" in line and "is free in" in line, line
    assert "cachesvc prune" in line
    assert list((cache / ".staging").iterdir()) == []
    assert [e[0] for e in _events(cache, catalog)] == []  # not even a miss: nothing started


def test_builds_through_a_real_server_on_a_small_disk(small_disk: Path, tmp_path: Path) -> None:
    """``cachesvc serve`` with its cache on the small disk: a startup build larger than the free
    space exits 1 with the one line; a server that started (its model built while there was
    room) answers ``POST /admin/builds`` of a known checkpoint that no longer fits with 507 up
    front, and a background build whose GGUF conversion fills the disk part way fails with the
    one line (no errno text, no paths of the copy)."""
    import time

    from tests.gguf.ggufs import write_pair
    from tests.service.conftest import running_server

    cache, catalog = small_disk / "cache", tmp_path / "catalog.sqlite3"
    flags = ("--catalog-url", f"sqlite:///{catalog}", "--allowed-model-roots", str(tmp_path),
             "--max-input-len", "32", "--max-kv-cache-capacity", "64")
    served = write_pair("qwen2", "F32", tmp_path / "served")[0]
    other = write_pair("llama", "Q8_0", tmp_path / "other")[0]
    with running_server(served, cache, tmp_path, *flags) as server, server.http() as h:
        page = 4096
        _leave_free(small_disk, -(-other.stat().st_size // page) * page + 2 * page)
        r = h.post("/admin/builds", json={"model": str(served), "max_input_len": 16})
        assert r.status_code == 507, r.text
        detail = r.json()["detail"]
        assert "needs about" in detail and "of disk but" in detail and "is free in" in detail, detail
        r = h.post("/admin/builds", json={"model": str(other)})
        assert r.status_code == 202, r.text
        build_id = r.json()["id"]
        deadline = time.monotonic() + 120
        while (status := h.get(f"/admin/builds/{build_id}").json())["state"] in ("queued", "running"):
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        error = status["error"]
        assert status["state"] == "failed" and error.startswith("converting model.gguf ran out of disk space")
        assert "Errno" not in error and "\n" not in error, error
        assert [p.name for p in (cache / "checkpoints" / "gguf").iterdir()
                if p.name.startswith(".") and p.name != ".locks"] == []
    from tests.service.conftest import cachesvc_command
    from tests.support.cache import child_env
    from tests.support.net import free_port

    done = subprocess.run(
        [*cachesvc_command(), "serve", str(other.parent / "reference"), "--cache-dir", str(cache),
         "--host", "127.0.0.1", "--port", str(free_port()), *flags],
        env=child_env(), capture_output=True, text=True, timeout=300,
    )
    lines = [line for line in done.stderr.splitlines() if "needs about" in line]
    assert done.returncode == 1 and "Traceback" not in done.stderr and len(lines) == 1, done.stderr
    assert "of disk but" in lines[0] and "is free in" in lines[0], lines
