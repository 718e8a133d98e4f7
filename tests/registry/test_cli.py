"""``cachesvc prepare --registry-push``, ``bundles push``, ``bundles pull`` and ``registry ls``
with the real CPU builder on the tiny demo checkpoint and a real registry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cachesvc.cli import main
from inference.demo import write_demo_checkpoint
from tests.registry.conftest import Registry
from tests.support.net import free_port


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_prepare_pushes_and_another_node_pulls_without_building(
    tmp_path: Path, registry: Registry, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = write_demo_checkpoint(tmp_path / "demo", size="tiny")
    reg = ["--registry", registry.url, "--registry-insecure"]
    a = ["--cache-dir", str(tmp_path / "a")]
    b = ["--cache-dir", str(tmp_path / "b")]
    code, out, _ = run(
        capsys, *a, "prepare", str(ckpt), "--max-input-len", "256", *reg, "--registry-push", "--json"
    )
    assert code == 0
    built = json.loads(out)
    assert built["built"] is True
    bid = built["bundle_id"]

    code, out, _ = run(capsys, "registry", "ls", *b, *reg, "--json")
    assert code == 0
    (item,) = json.loads(out)["items"]
    assert item["bundle_id"] == bid and item["fits_this_node"] is True and item["model"] == str(ckpt)
    code, out, _ = run(capsys, "registry", "ls", *b, *reg, "--model", "no-such-model")
    assert code == 0 and bid not in out

    code, out, _ = run(capsys, "bundles", "pull", "--model", str(ckpt), "--max-input-len", "256", *b, *reg)
    assert code == 0 and out.startswith(f"{bid}  pulled from {registry.url}:{bid}")
    code, out, _ = run(capsys, "bundles", "pull", "--model", str(ckpt), "--max-input-len", "256", *b, *reg)
    assert code == 0 and "already in the cache" in out
    code, out, _ = run(capsys, *b, "bundles", "verify", bid)
    assert code == 0
    # A node that prepares with the registry serves the pulled bundle: a hit, nothing built.
    code, out, _ = run(capsys, *b, "prepare", str(ckpt), "--max-input-len", "256", *reg, "--json")
    assert json.loads(out)["built"] is False and json.loads(out)["pulled_from"] is None
    # A third node's prepare pulls on its miss and says so.
    c = ["--cache-dir", str(tmp_path / "c")]
    code, out, _ = run(capsys, *c, "prepare", str(ckpt), "--max-input-len", "256", *reg)
    assert code == 0 and out.startswith(f"{bid}  pulled from {registry.url}:{bid}")

    code, out, _ = run(capsys, *a, "bundles", "push", bid, *reg)
    assert code == 0 and "0 blobs uploaded" in out


def test_bad_registry_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = ["--cache-dir", str(tmp_path / "c")]
    code, _, err = run(capsys, "bundles", "pull", *cache, "--registry-insecure")
    assert code == 2 and err.count("\n") == 1 and "give a model" in err
    code, _, err = run(capsys, "registry", "ls", *cache, "--registry", "http://host/ns")
    assert code == 2 and "--registry: must start with oci://" in err and err.count("\n") == 1
    code, _, err = run(capsys, "registry", "ls", *cache)
    assert code == 2 and "no registry is configured" in err
    down = f"oci://127.0.0.1:{free_port()}/ns"
    code, _, err = run(capsys, "registry", "ls", *cache, "--registry", down, "--registry-insecure")
    assert code == 1 and "unreachable" in err and err.count("\n") == 1
