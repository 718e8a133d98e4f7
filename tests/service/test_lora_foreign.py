"""Adapters that do not belong to the base model are refused at load, in one line, on every load
path of a real ``cachesvc serve`` (``POST /v1/load_lora_adapter``, ``POST /admin/lora-adapters``,
``--lora-modules``): one whose config declares another model family (a Llama adapter on the
Qwen2 demo, shapes alike), and one whose weights hold NaN (it answered ``''`` with 200). An
adapter that declares no family is judged by its shapes alone, and loads."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from tests.service.conftest import ServerProcess, cachesvc_command, child_env, running_server
from tests.support.adapters import write_adapter, write_base
from tests.support.net import free_port

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
FOREIGN = "the adapter was made for LlamaForCausalLM (llama) but the base model is Qwen2ForCausalLM (qwen2)"
NON_FINITE = "holds NaN or Inf values"


@pytest.fixture(scope="module")
def adapters(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Llama adapter of the demo's shapes (declared and not), and a NaN adapter of the demo."""
    root = tmp_path_factory.mktemp("foreign-adapters")
    demo = json.loads((demo_dir / "config.json").read_text())
    dims = {k: demo[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads", "num_key_value_heads", "head_dim")}
    llama = write_adapter(write_base(root / "llama-base", **dims), root / "llama", seed=2)
    assert json.loads((llama / CONFIG).read_text())["auto_mapping"]["base_model_class"] == "LlamaForCausalLM"
    undeclared = root / "undeclared"
    shutil.copytree(llama, undeclared)
    config = json.loads((undeclared / CONFIG).read_text())
    del config["auto_mapping"]
    (undeclared / CONFIG).write_text(json.dumps(config))
    nan = root / "nan"
    shutil.copytree(write_adapter(demo_dir, root / "demo", seed=4), nan)
    tensors = load_file(nan / WEIGHTS)
    first = sorted(tensors)[0]
    tensors[first] = np.full_like(tensors[first], np.nan)
    save_file(tensors, nan / WEIGHTS, metadata={"format": "pt"})
    return {"root": root, "llama": llama, "undeclared": undeclared, "nan": nan}


@pytest.fixture(scope="module")
def server(demo_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
           log_dir: Path) -> Iterator[ServerProcess]:
    with running_server(demo_dir, tmp_path_factory.mktemp("foreign-cache"), log_dir, "--enable-lora",
                        "--allowed-model-roots", f"{adapters['root']},{demo_dir}", "--max-input-len", "64",
                        "--max-kv-cache-capacity", "128") as s:
        yield s


@pytest.mark.parametrize(("case", "why"), [("llama", FOREIGN), ("nan", NON_FINITE)])
def test_an_adapter_of_another_base_is_refused_on_both_routes(
        server: ServerProcess, adapters: dict[str, Path], demo_dir: Path, case: str, why: str) -> None:
    path = str(adapters[case])
    with server.http() as h:
        runtime = h.post("/v1/load_lora_adapter", json={"lora_name": case, "lora_path": path})
        admin = h.post("/admin/lora-adapters", json={"source": path, "base": str(demo_dir)})
        for r in (runtime, admin):
            assert r.status_code == 400, r.text
            detail = r.json()["detail"]
            assert why in detail and "\n" not in detail, detail
        assert case not in {m["id"] for m in h.get("/v1/models").json()["data"]}
        assert h.get("/admin/lora-adapters").json()["items"] == []


def test_an_adapter_that_declares_no_family_is_judged_by_its_shapes(
        server: ServerProcess, adapters: dict[str, Path]) -> None:
    with server.http() as h:
        body = {"lora_name": "plain", "lora_path": str(adapters["undeclared"])}
        r = h.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 200, r.text
        assert h.post("/v1/unload_lora_adapter", json={"lora_name": "plain"}).status_code == 200


@pytest.mark.parametrize(("case", "why"), [("llama", FOREIGN), ("nan", NON_FINITE)])
def test_lora_modules_with_such_an_adapter_stop_the_start_in_one_line(
        demo_dir: Path, adapters: dict[str, Path], tmp_path: Path, case: str, why: str) -> None:
    proc = subprocess.run(
        [*cachesvc_command(), "serve", str(demo_dir), "--cache-dir", str(tmp_path / "cache"),
         "--lora-modules", f"x={adapters[case]}", "--max-input-len", "64", "--max-kv-cache-capacity", "128",
         "--port", str(free_port()), "--host", "127.0.0.1"],
        capture_output=True, text=True, env=child_env(), timeout=120, check=False)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if why in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
