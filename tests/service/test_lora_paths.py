"""Every path a request names passes one rule (``--allowed-model-roots``, no link out of them), on
both LoRA surfaces of a real ``cachesvc serve``: ``POST /v1/load_lora_adapter`` (vLLM's) and
``POST /admin/lora-adapters``. A directory outside the roots, a linked directory, a weights file
or a config linked out of them (to ``/etc/shadow``, ``/etc/passwd``) are a 400 naming what to
fix, before any file is opened (nothing of the target's content or size in the answer), and
serve nothing; an adapter laid out like the hub cache (links to blobs inside a root) loads."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service.conftest import ServerProcess, running_server
from tests.support.adapters import write_adapter

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@pytest.fixture(scope="module")
def layout(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The allowed root with one good adapter and the four ways out of it, and an adapter outside."""
    top = tmp_path_factory.mktemp("lora-paths")
    root, outside = top / "root", top / "outside"
    root.mkdir()
    good = write_adapter(demo_dir, root / "good", seed=3)
    away = write_adapter(demo_dir, outside / "adapter", seed=5)
    (root / "linked-dir").symlink_to(away, target_is_directory=True)
    weights_out = root / "weights-out"
    weights_out.mkdir()
    shutil.copy(good / CONFIG, weights_out / CONFIG)
    (weights_out / WEIGHTS).symlink_to(away / WEIGHTS)
    shadow = root / "shadow"
    shadow.mkdir()
    shutil.copy(good / CONFIG, shadow / CONFIG)
    (shadow / WEIGHTS).symlink_to("/etc/shadow")
    passwd = root / "passwd"
    passwd.mkdir()
    (passwd / CONFIG).symlink_to("/etc/passwd")
    shutil.copy(good / WEIGHTS, passwd / WEIGHTS)
    # The hub cache's layout: snapshot files are links to blobs, all inside the root.
    blobs, snapshot = root / "hub" / "blobs", root / "hub" / "snapshots" / "main"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in (CONFIG, WEIGHTS):
        shutil.copy(good / name, blobs / name)
        (snapshot / name).symlink_to(blobs / name)
    return {"root": root, "outside": away, "linked-dir": root / "linked-dir", "weights-out": weights_out,
            "shadow": shadow, "passwd": passwd, "hub": snapshot}


@pytest.fixture(scope="module")
def server(demo_dir: Path, layout: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
           log_dir: Path) -> Iterator[ServerProcess]:
    roots = f"{layout['root']},{demo_dir}"
    with running_server(demo_dir, tmp_path_factory.mktemp("lora-paths-cache"), log_dir, "--enable-lora",
                        "--allowed-model-roots", roots, "--max-input-len", "64",
                        "--max-kv-cache-capacity", "128") as s:
        yield s


ESCAPES = {
    "outside": "outside the directories requests may name",
    "linked-dir": "outside the directories requests may name",
    "weights-out": f"{WEIGHTS}, a link leading outside",
    "shadow": f"{WEIGHTS}, a link leading outside",
    "passwd": f"{CONFIG}, a link leading outside",
}


@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_a_path_out_of_the_roots_is_refused_alike_on_both_routes(
        server: ServerProcess, layout: dict[str, Path], demo_dir: Path, case: str) -> None:
    path = str(layout[case])
    with server.http() as h:
        runtime = h.post("/v1/load_lora_adapter", json={"lora_name": f"x-{case}", "lora_path": path})
        admin = h.post("/admin/lora-adapters", json={"source": path, "base": str(demo_dir)})
        for r, field in ((runtime, "lora_path"), (admin, "source")):
            assert r.status_code == 400, r.text
            detail = r.json()["detail"]
            assert detail.startswith(f"{field}: ") and ESCAPES[case] in detail and "\n" not in detail, detail
            assert "--allowed-model-roots" in detail or "replace the link" in detail, detail
            # Refused on names alone: nothing of the target is read (no header, size or JSON error).
            for leak in ("header", "size", "bytes", "JSON", "safetensors file", "root:"):
                assert leak not in detail, detail
        assert f"x-{case}" not in {m["id"] for m in h.get("/v1/models").json()["data"]}
        assert h.get("/admin/lora-adapters").json()["items"] == []


def test_links_inside_the_roots_load(server: ServerProcess, layout: dict[str, Path]) -> None:
    """The rule refuses links out of the roots, not links: the hub cache's snapshot links load."""
    with server.http() as h:
        r = h.post("/v1/load_lora_adapter", json={"lora_name": "hub-style", "lora_path": str(layout["hub"])})
        assert r.status_code == 200, r.text
        assert "hub-style" in {m["id"] for m in h.get("/v1/models").json()["data"]}
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "hub-style"}).status_code == 200

