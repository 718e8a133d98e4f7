"""Item 9: POST /admin/builds checks what it can before answering 202, and never walks the disk."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from cachesvc.checkpoints import resolve_checkpoint
from tests.hardening.conftest import App
from tests.support.cache import make_checkpoint


@pytest.mark.parametrize(
    "model",
    ["/usr", "/", "../../", "/proc/self", "not a valid id!", "org/name/extra", "a--b/c", "~"],
)
def test_bad_models_are_refused_before_202_without_a_walk(app: App, model: str) -> None:
    with app.http() as h:
        t0 = time.monotonic()
        r = h.post("/admin/builds", json={"model": model})
        elapsed = time.monotonic() - t0
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "model" or "config.json" in r.json()["detail"]
    assert elapsed < 1.0, elapsed
    assert app.manager.list_builds() == []


def test_profile_constraints_are_checked_before_202(app: App) -> None:
    with app.http() as h:
        r = h.post(
            "/admin/builds",
            json={"model": "org/model", "max_input_len": 4096, "max_kv_cache_capacity": 128},
        )
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "max_input_len"


def test_local_checkpoints_must_lie_under_an_allowed_root(app: App, tmp_path: Path) -> None:
    outside = make_checkpoint(tmp_path / "outside", seed=11)
    with app.http() as h:
        r = h.post("/admin/builds", json={"model": str(outside)})
        assert r.status_code == 400, r.text
        assert "--allowed-model-roots" in r.json()["detail"]
        # Under the cache's own checkpoints dir (a default root) it is accepted.
        inside = app.manager.layout.checkpoints / "local-tiny"
        shutil.copytree(outside, inside)
        r = h.post("/admin/builds", json={"model": str(inside)})
        assert r.status_code == 202, r.text
    app.manager.wait_for_build(r.json()["id"], timeout=60)


def test_the_walk_does_not_follow_directory_links_out_of_the_checkpoint(tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", seed=12)
    before = resolve_checkpoint(str(ckpt), tmp_path / "hub", offline=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "stolen.json").write_text('{"secret": 1}')
    os.symlink(elsewhere, ckpt / "linked")
    os.symlink("/usr", ckpt / "usr")
    t0 = time.monotonic()
    after = resolve_checkpoint(str(ckpt), tmp_path / "hub", offline=True)
    assert time.monotonic() - t0 < 2.0
    assert (after.digest, after.file_count) == (before.digest, before.file_count)
