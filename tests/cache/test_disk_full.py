"""Disk full during a build, on a real full filesystem (a small tmpfs; needs root to mount).

The build fails with a clear error naming the cause and the way out, nothing stays in staging,
the catalog has no row for the bundle (the failure is an event) and the cache works again as
soon as there is room.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

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
        assert [e.kind for e in m.queries.events(kind="build_failed")] == ["build_failed"]
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
