"""Item 9: POST /admin/builds checks what it can before answering 202, and never walks the disk."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from cachesvc.cache.checkpoints import resolve_checkpoint
from tests.support.cache import make_checkpoint
from tests.support.whole_app import App


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
    # A walk of / or /usr takes minutes; 5 s leaves room for a loaded CI machine.
    assert elapsed < 5.0, elapsed
    assert app.manager.builds.all_builds() == []


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
    app.manager.builds.wait(r.json()["id"], timeout=60)


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


@pytest.mark.parametrize(
    "model",
    [
        "a/b/../../../../../etc/passwd.gguf",
        "org/name/../../x.gguf",
        "org/name/./x.gguf",
        "org/name//x.gguf",
        "org/../name",
    ],
)
def test_dot_dot_is_refused_before_202(app: App, model: str) -> None:
    builds = len(app.manager.builds.all_builds())  # the app is the module's: earlier tests built
    with app.http() as h:
        r = h.post("/admin/builds", json={"model": model})
    assert r.status_code == 400, r.text
    assert r.json()["field"] == "model"
    assert len(app.manager.builds.all_builds()) == builds


def test_a_link_inside_an_allowed_root_to_a_file_outside_is_refused(app: App, tmp_path: Path) -> None:
    root = app.manager.layout.checkpoints  # an allowed root by default
    secret = tmp_path / "secret.gguf"
    secret.write_bytes(b"GGUF not yours")
    gguf_dir = root / "linked-gguf"
    gguf_dir.mkdir()
    (gguf_dir / "x.gguf").symlink_to("/etc/passwd")
    hf_dir = root / "linked-weights"
    shutil.copytree(make_checkpoint(tmp_path / "ckpt", seed=14), hf_dir)
    weights = next(p for p in hf_dir.iterdir() if p.name.endswith(".safetensors"))
    weights.unlink()
    weights.symlink_to(secret)
    direct = root / "direct.gguf"
    direct.symlink_to(secret)
    builds = len(app.manager.builds.all_builds())
    with app.http() as h:
        for model, named in ((gguf_dir, "x.gguf"), (hf_dir, weights.name), (direct, None)):
            r = h.post("/admin/builds", json={"model": str(model)})
            assert r.status_code == 400, (model, r.text)
            assert r.json()["field"] == "model"
            if named is not None:
                assert named in r.json()["detail"], r.text
        # A link that stays inside the roots is fine (a hub snapshot links into its blobs).
        (gguf_dir / "x.gguf").unlink()
        shutil.rmtree(hf_dir)
        real = root / "real-ckpt"
        shutil.copytree(make_checkpoint(tmp_path / "ckpt2", seed=15), real)
        linked = root / "linked-inside"
        linked.mkdir()
        for f in real.iterdir():
            (linked / f.name).symlink_to(f)
        r = h.post("/admin/builds", json={"model": str(linked)})
        assert r.status_code == 202, r.text
    assert app.manager.builds.wait(r.json()["id"], timeout=60).state == "done"
    assert len(app.manager.builds.all_builds()) == builds + 1
