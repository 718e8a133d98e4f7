"""Items 8 and 11: one-line errors with a repair for a broken catalog; no traceback on a closed pipe."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.admin.conftest import open_manager
from tests.service.conftest import cachesvc_command
from tests.support.cache import child_env, make_checkpoint


def _cli(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*cachesvc_command(), "--cache-dir", str(cache), *args],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_garbage_catalog_is_one_line_with_a_repair_and_the_repair_works(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    m = open_manager(cache)
    ckpt = make_checkpoint(tmp_path / "ckpt")
    built = m.prepare(str(ckpt))
    m.close()
    (cache / "catalog.sqlite3").write_bytes(os.urandom(8192))
    for args in (("stats",), ("bundles", "ls"), ("reconcile",), ("db", "current")):
        r = _cli(cache, *args)
        assert r.returncode == 1, (args, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1, (args, r.stderr)
        assert "cachesvc db repair" in lines[0] and "Traceback" not in r.stderr
    r = _cli(cache, "db", "repair")
    assert r.returncode == 0, r.stderr
    assert "re-adopted 1 bundles" in r.stdout
    assert list(cache.glob("catalog.sqlite3.broken-*"))
    r = _cli(cache, "bundles", "ls", "--json")
    assert r.returncode == 0, r.stderr
    assert built.bundle_id in r.stdout
    # A readable catalog is left alone.
    r = _cli(cache, "db", "repair")
    assert r.returncode == 0 and "nothing to repair" in r.stdout


def test_a_closed_pipe_is_not_a_traceback(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    open_manager(cache).close()
    proc = subprocess.Popen(
        [*cachesvc_command(), "--cache-dir", str(cache), "stats", "--json"],
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # `| head` that has read enough, before the command writes
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 141


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (("serve", "--draft-top-k", "2"), {}, "--draft-top-k"),
        (("serve", "--allowed-local-media-path", "/nowhere/media"), {}, "--allowed-local-media-path"),
        (("serve", "--context-cache-recurrent-snapshot-pool-bytes", "4096"), {},
         "--context-cache-recurrent-snapshot-pool-bytes"),
        (("prepare", "org/model", "--verify-tree-size", "8"), {}, "--verify-tree-size"),
        (("prepare", "org/model", "--draft-step", "3"), {}, "--draft-step"),
        (("serve",), {"CACHESVC_PREFILL_CHUNK": "lots"}, "CACHESVC_PREFILL_CHUNK"),
    ],
)
def test_a_setting_that_would_change_nothing_or_is_invalid_is_refused_in_one_line(
    tmp_path: Path, args: tuple[str, ...], env: dict[str, str], named: str
) -> None:
    """A compatibility flag without effect in this version (or a bad CACHESVC_ value) is refused
    before anything happens: exit 2, one line that names it, no cache created, nothing served."""
    cache = tmp_path / "cache"
    r = subprocess.run(
        [*cachesvc_command(), "--cache-dir", str(cache), *args],
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"cachesvc: error: {named}: ")
    if named == "--allowed-local-media-path":  # a directory that is not there
        assert "'/nowhere/media' is not an existing directory" in lines[0]
    elif named.startswith("--"):
        assert "has no effect in this version" in lines[0] and lines[0].endswith(f"drop {named}")
    assert not cache.exists()
