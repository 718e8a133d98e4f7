"""An unsupported model family is bad input everywhere: exit 2 / HTTP 400, one line naming the
family, the supported ones and the docs page; nothing recorded (issue 31, item 5)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from litestar import Litestar
from litestar.testing import TestClient

from inference.families import family_by_name, family_names
from tests.admin.conftest import problem
from tests.service.conftest import cachesvc_command
from tests.support.cache import child_env, make_checkpoint
from tests.support.tiny_models import TINY_CONFIG


def _gpt2(path: Path) -> Path:
    make_checkpoint(path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (path / "config.json").write_text(json.dumps(config))
    return path


def _rwkv_gguf(path: Path) -> Path:
    writer = gguf.GGUFWriter(path, "rwkv7")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _cli(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*cachesvc_command(), "--cache-dir", str(cache), *args], env=child_env(),
                          capture_output=True, text=True, timeout=120)


def _state(cache: Path) -> tuple[Any, Any]:
    ls = _cli(cache, "checkpoints", "ls", "--json")
    stats = _cli(cache, "stats", "--json")
    assert ls.returncode == 0 and stats.returncode == 0, (ls.stderr, stats.stderr)
    figures = json.loads(stats.stdout)
    figures.pop("uptime_seconds", None)
    return json.loads(ls.stdout), figures


def _check_line(text: str, family: str) -> None:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    assert f"unsupported model family '{family}'" in lines[0]
    assert ", ".join(family_names()) in lines[0] and "docs/model-families.md" in lines[0]
    assert "Traceback" not in text


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_the_command_line_refuses_with_exit_2_and_records_nothing(tmp_path: Path, kind: str) -> None:
    cache = tmp_path / "cache"
    model = _gpt2(tmp_path / "gpt2") if kind == "safetensors" else _rwkv_gguf(tmp_path / "m.gguf")
    before = _state(cache)
    r = _cli(cache, "prepare", str(model))
    assert r.returncode == 2, (r.stdout, r.stderr)
    _check_line(r.stderr, "GPT2LMHeadModel" if kind == "safetensors" else "rwkv7")
    assert _state(cache) == before
    assert not list((cache / "checkpoints").glob("gguf/*")) if (cache / "checkpoints").exists() else True


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_the_build_route_refuses_with_400_before_queueing(
    tmp_path: Path, kind: str, client: TestClient[Litestar], make_client: Callable[..., TestClient[Litestar]]
) -> None:
    model = _gpt2(tmp_path / "gpt2") if kind == "safetensors" else _rwkv_gguf(tmp_path / "m.gguf")
    before = (client.get("/admin/checkpoints").json(), client.get("/admin/builds").json())
    r = client.post("/admin/builds", json={"model": str(model)})
    assert r.status_code == 400, r.text
    _check_line(problem(r)["detail"], "GPT2LMHeadModel" if kind == "safetensors" else "rwkv7")
    assert (client.get("/admin/checkpoints").json(), client.get("/admin/builds").json()) == before


def _variant(path: Path, kind: str) -> tuple[Path, str]:
    """A checkpoint of a known family in a variant no engine builds, and the words that say so."""
    make_checkpoint(path)
    fam = family_by_name("gemma3_text" if kind == "encoder" else "llama")
    config: dict[str, Any] = {**TINY_CONFIG, **fam.tiny, "architectures": list(fam.architectures[:1]),
                              "model_type": fam.model_types[0]}
    if kind == "encoder":
        config["use_bidirectional_attention"] = True
        words = "use_bidirectional_attention (an encoder) is not supported"
    else:
        config["hidden_act"] = "xielu"
        words = "unsupported hidden_act 'xielu'"
    (path / "config.json").write_text(json.dumps(config))
    return path, words


@pytest.mark.parametrize("kind", ["encoder", "activation"])
def test_a_variant_no_engine_builds_is_refused_up_front_too(
    tmp_path: Path, kind: str, client: TestClient[Litestar]
) -> None:
    """Not a failed build (exit 1, a catalog row): exit 2 / HTTP 400 before anything is recorded,
    in the builder's own words."""
    model, words = _variant(tmp_path / "ckpt", kind)
    cache = tmp_path / "cache"
    before = _state(cache)
    r = _cli(cache, "prepare", str(model))
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "config.json: " in lines[0] and words in lines[0], r.stderr
    assert _state(cache) == before
    seen = (client.get("/admin/checkpoints").json(), client.get("/admin/builds").json())
    r2 = client.post("/admin/builds", json={"model": str(model)})
    assert r2.status_code == 400, r2.text
    assert words in problem(r2)["detail"]
    assert (client.get("/admin/checkpoints").json(), client.get("/admin/builds").json()) == seen
