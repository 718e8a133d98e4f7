"""A kill during GGUF conversion leaks no disk (issue 22, item 4).

A real ``cachesvc prepare FILE.gguf`` child is SIGKILLed at the ``gguf:converted`` crash point,
leaving ``checkpoints/gguf/.<digest16>-gguf-N.<random>``. ``stats`` counts it (checkpoint bytes),
reconcile leaves it alone while its lock is held (a conversion running) and removes it once the
lock is free; directories that do not match our name pattern are never touched.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

from cachesvc.cache.crashpoints import ENV_VAR
from cachesvc.cache.store.locks import BundleLocks
from tests.gguf.ggufs import write_pair
from tests.service.conftest import REPO_ROOT, cachesvc_command, child_env

LEFTOVER = re.compile(r"^\.(?P<key>[0-9a-f]{16}-gguf-[0-9]+)\.[A-Za-z0-9_]+$")


def _cli(cache: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*cachesvc_command(), "--cache-dir", str(cache), *args],
        capture_output=True,
        text=True,
        env=child_env({**env}),
        cwd=REPO_ROOT,
        timeout=300,
        check=False,
    )


def _checkpoint_bytes(cache: Path) -> int:
    r = _cli(cache, "stats", "--json")
    assert r.returncode == 0, r.stderr
    return int(json.loads(r.stdout)["checkpoint_bytes"])


def test_a_conversion_killed_half_way_is_counted_then_removed_by_reconcile(tmp_path: Path) -> None:
    gguf_file, _ = write_pair("qwen2", "F32", tmp_path / "gguf")
    cache = tmp_path / "cache"
    r = _cli(cache, "prepare", str(gguf_file), **{ENV_VAR: "gguf:converted"})
    assert r.returncode == -signal.SIGKILL, (r.returncode, r.stderr)

    root = cache / "checkpoints" / "gguf"
    leftovers = [p for p in root.iterdir() if LEFTOVER.match(p.name)]
    assert len(leftovers) == 1, sorted(p.name for p in root.iterdir())
    leftover = leftovers[0]
    size = sum(f.stat().st_size for f in leftover.rglob("*") if f.is_file())
    assert size > 0
    assert _checkpoint_bytes(cache) >= size, "stats does not count the leftover"

    # Not ours by name: never touched.
    decoys = [root / ".keep-me", root / "0123456789abcdef-gguf-1.notstaging", root / ".abc.xyz"]
    for decoy in decoys:
        decoy.mkdir()
        (decoy / "f").write_text("x")

    # A conversion holding its key's lock: its staging directory is in use.
    key = LEFTOVER.match(leftover.name)["key"]  # type: ignore[index]
    locks = BundleLocks(root / ".locks")
    with locks.exclusive(f"gguf-{key}"):
        r = _cli(cache, "reconcile", "--json")
        assert r.returncode == 0, r.stderr
        assert leftover.is_dir(), "reconcile removed the staging directory of a running conversion"

    r = _cli(cache, "reconcile", "--json")
    assert r.returncode == 0, r.stderr
    assert f"checkpoints/gguf/{leftover.name}" in json.loads(r.stdout)["staging_removed"]
    assert not leftover.exists()
    assert all(d.is_dir() for d in decoys)
    assert _checkpoint_bytes(cache) < size


def test_a_killed_conversion_leaves_a_build_failed_event_as_a_killed_build_does(tmp_path: Path) -> None:
    """Both stages of a GGUF build killed (the conversion, then the bundle build of the converted
    checkpoint): the reconcile after each records one ``build_failed`` event for the model."""
    from cachesvc.cache.manager import CacheManager

    gguf_file, _ = write_pair("qwen2", "F32", tmp_path / "gguf")
    cache = tmp_path / "cache"

    def failures() -> list[tuple[str | None, str | None]]:
        m = CacheManager.open(cache, max_size_bytes=2**30, offline=True)
        try:
            return [(e.model, e.detail) for e in reversed(m.catalog.events.recent(kind="build_failed"))]
        finally:
            m.close()

    for point in ("gguf:converted", "publish:staged"):
        r = _cli(cache, "prepare", str(gguf_file), **{ENV_VAR: point})
        assert r.returncode == -signal.SIGKILL, (point, r.returncode, r.stderr)
        r = _cli(cache, "reconcile", "--json")
        assert r.returncode == 0, r.stderr
    assert failures() == [
        (str(gguf_file), "GGUF conversion interrupted (the converting process died)"),
        (str(gguf_file), "build interrupted (the building process died)"),
    ]
    root = cache / "checkpoints" / "gguf"
    assert not [p.name for p in root.iterdir() if p.name.startswith(".") and p.name != ".locks"]
