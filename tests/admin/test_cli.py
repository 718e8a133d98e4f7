"""The ``cachesvc`` CLI with the real CPU builder on a tiny demo checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cachesvc.cache.store.space import human_size
from cachesvc.cli import main
from cachesvc.cli.output import table
from inference.demo import write_demo_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_checkpoint(tmp_path_factory.mktemp("ckpt") / "demo", size="tiny")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_prepare_ls_show_pin_verify_prune(
    tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = ["--cache-dir", str(tmp_path / "c")]
    code, out, _ = run(capsys, *cache, "prepare", str(ckpt), "--max-input-len", "256", "--json")
    assert code == 0
    first = json.loads(out)
    assert {"bundle_id", "bundle_dir", "model_dir", "built"} <= set(first) and first["built"] is True
    assert Path(first["bundle_dir"]).is_relative_to(tmp_path / "c" / "engines")
    code, out, _ = run(capsys, *cache, "prepare", str(ckpt), "--max-input-len", "256", "--json")
    assert json.loads(out)["built"] is False and json.loads(out)["bundle_id"] == first["bundle_id"]
    bid = first["bundle_id"]

    code, out, _ = run(capsys, *cache, "bundles", "ls", "--json")
    rows = json.loads(out)
    assert len(rows) == 1
    need = {
        "id",
        "model",
        "checkpoint_digest",
        "profile",
        "backend",
        "size_bytes",
        "created_at",
        "last_used_at",
    }
    assert need | {"hit_count", "pinned", "state", "path"} <= set(rows[0])
    assert rows[0]["id"] == bid and rows[0]["hit_count"] == 1 and rows[0]["state"] == "ready"
    assert rows[0]["path"] == first["bundle_dir"]

    code, out, _ = run(capsys, *cache, "bundles", "ls")
    header = out.splitlines()[0]
    assert header.split()[:4] == ["ID", "MODEL", "PROFILE", "STATE"] and bid in out
    assert "MiB" in out or "KiB" in out

    assert run(capsys, *cache, "bundles", "pin", bid)[0] == 0
    code, out, _ = run(capsys, *cache, "prune", "--max-size-bytes", "1", "--dry-run", "--json")
    plan = json.loads(out)
    assert plan["evict"] == [] and plan["skipped"] == [
        {"id": bid, "size_bytes": rows[0]["size_bytes"], "reason": "pinned", "stale": False}
    ]
    assert plan["freed_bytes"] == 0
    assert run(capsys, *cache, "bundles", "unpin", bid)[0] == 0

    code, out, _ = run(capsys, *cache, "bundles", "verify", bid)
    assert code == 0 and "ok" in out
    code, out, _ = run(capsys, *cache, "bundles", "show", bid, "--json")
    detail = json.loads(out)
    assert detail["bundle"]["id"] == bid and any(f["path"] == "engine.json" for f in detail["files"])

    code, out, _ = run(capsys, *cache, "bundles", "prune", "--max-size-bytes", "1", "--dry-run", "--json")
    plan = json.loads(out)
    assert [e["id"] for e in plan["evict"]] == [bid] and plan["freed_bytes"] == rows[0]["size_bytes"]
    code, out, _ = run(capsys, *cache, "stats", "--json")
    stats = json.loads(out)
    assert (stats["hits"], stats["misses"], stats["bundles"]) == (1, 1, 1)
    code, out, _ = run(capsys, *cache, "prune", "--max-size-bytes", "1", "--json")
    assert [e["id"] for e in json.loads(out)["evict"]] == [bid]
    code, out, _ = run(capsys, *cache, "bundles", "ls", "--json")
    assert json.loads(out) == []
    code, out, _ = run(capsys, *cache, "checkpoints", "ls", "--json")
    assert len(json.loads(out)) == 1 and ckpt.exists()
    code, out, _ = run(capsys, *cache, "reconcile", "--json")
    assert json.loads(out)["forgotten"] == []
    code, out, _ = run(capsys, *cache, "db", "current")
    assert code == 0 and "up to date" in out


def test_prepare_with_fp16_kv_is_its_own_gated_bundle_with_half_the_kv(
    tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = ["--cache-dir", str(tmp_path / "c")]
    code, out, _ = run(capsys, *cache, "prepare", str(ckpt), "--max-input-len", "256", "--json")
    assert code == 0
    full = json.loads(out)
    code, out, err = run(capsys, *cache, "prepare", str(ckpt), "--max-input-len", "256",
                         "--kv-cache-dtype", "fp16", "--json")
    assert code == 0, err
    half = json.loads(out)
    assert half["built"] is True and half["bundle_id"] != full["bundle_id"]
    engine = [json.loads((Path(b["bundle_dir"]) / "engine.json").read_text()) for b in (full, half)]
    assert [e["kv_cache"]["dtype"] for e in engine] == ["float32", "float16"]
    assert engine[1]["kv_bytes_per_token"] * 2 == engine[0]["kv_bytes_per_token"]
    code, out, _ = run(capsys, *cache, "bundles", "show", half["bundle_id"])
    assert code == 0 and "-kvfp16-" in out
    assert "float16, " in out and "float16 KV, greedy agreement" in out
    code, out, _ = run(capsys, *cache, "bundles", "show", full["bundle_id"])
    assert "float32, " in out and "quality" not in out


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["bundles", "rm", "0000000000000000-000000000000"], "no bundle with id"),
        (["bundles", "verify", "nope"], "no bundle with id"),
        (["prune", "--max-size-bytes", "-1"], "--max-size-bytes"),
        (["prepare", "/definitely/not/here"], "no such directory"),
        (["prepare", "/tmp", "--max-batch-size", "0"], "--max-batch-size"),
        (["prepare", "/tmp", "--kv-cache-dtype", "q8_0"], "--kv-cache-dtype"),
        (["prepare", "/tmp", "--kv-cache-dtype", "fp16", "--task", "embed"], "--kv-cache-dtype"),
        (["prepare", "/tmp", "--kv-cache-dtype", "fp16", "--backend", "tensorrt"], "--kv-cache-dtype"),
        (["prepare", "/tmp", "--max-image-tokens", "0"], "--max-image-tokens"),
        (["prepare", "/tmp", "--max-image-tokens", "8192"], "--max-image-tokens: (8192) must not exceed "
                                                            "--max-input-len (4096)"),
        (["prepare", "/tmp", "--max-image-tokens", "32", "--max-image-tokens-per-image", "64"],
         "--max-image-tokens-per-image: (64) must not exceed --max-image-tokens (32)"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    try:
        code, _, err = run(capsys, "--cache-dir", str(tmp_path / "c"), *argv)
    except SystemExit as exc:  # argparse-level errors
        code, err = int(exc.code or 0), capsys.readouterr().err
    assert code == 2
    assert needle in err
    assert len(err.splitlines()) == 1, err


def test_image_token_limits_for_a_text_checkpoint_are_one_line_and_exit_2(
    tmp_path: Path, ckpt: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(capsys, "--cache-dir", str(tmp_path / "c"), "prepare", str(ckpt),
                       "--max-input-len", "256", "--max-image-tokens-per-image", "64")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "--max-image-tokens-per-image: applies only to a vision-language checkpoint" in err
    assert "takes text only: leave the image-token limits unset" in err


def test_console_script_runs(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("cachesvc")
    proc = subprocess.run(
        [str(exe), "--cache-dir", str(tmp_path / "c"), "stats", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["bundles"] == 0


def test_formatting_helpers() -> None:
    assert human_size(0) == "0 B" and human_size(1536) == "1.5 KiB" and human_size(3 * 1024**3) == "3.0 GiB"
    assert table(["A", "BB"], [["xxx", 1]], right=(1,)).splitlines() == ["A    BB", "xxx   1"]
