"""The seams the model pool stands on: lazy engine loaders, one vocabulary of unload reasons."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cachesvc.cache.records import UNLOAD_REASONS
from inference.runtime import registry
from inference.runtime.errors import EngineLoadError
from inference.serving import model_pool


def test_importing_the_service_and_admin_api_does_not_import_onnxruntime() -> None:
    code = (
        "import sys\n"
        "import cachesvc.serving.app, cachesvc.cli, cachesvc.serving.server, cachesvc.http.admin.router\n"
        "print('onnxruntime' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_unload_reasons_agree() -> None:
    assert model_pool.UNLOAD_REASONS == UNLOAD_REASONS


def test_registry_dispatches_by_backend_and_names_unknown_ones(tmp_path: Path) -> None:
    (tmp_path / "engine.json").write_text(json.dumps({"backend": "nosuch"}))
    with pytest.raises(EngineLoadError, match="nosuch"):
        registry.load_engine(tmp_path)
    assert registry.bundle_backend(tmp_path) == "nosuch"
    registry.register_loader("nosuch", "tests.serving.test_pool_seams:_fake_loader")
    try:
        assert registry.load_engine(tmp_path, max_slots=2) == ("loaded", 2)
    finally:
        registry.LOADERS.pop("nosuch")


def _fake_loader(bundle_dir: Path, *, max_slots: int | None, threads: int | None) -> object:
    return ("loaded", max_slots)


def test_memory_estimate_is_weights_plus_kv_slots(tmp_path: Path) -> None:
    meta = {
        "backend": "onnxruntime",
        "max_batch_size": 4,
        "max_kv_cache_capacity": 100,
        "portable_model": "model.onnx",
        "kv_cache": {"model": "model.ort.onnx", "bytes_per_token": 10},
    }
    (tmp_path / "engine.json").write_text(json.dumps(meta))
    (tmp_path / "model.ort.onnx").write_bytes(b"x" * 1000)
    (tmp_path / "model.onnx.data").write_bytes(b"x" * 500)  # shared by both graphs: counted
    (tmp_path / "model.onnx").write_bytes(b"x" * 9999)  # the portable proto is not loaded
    (tmp_path / "tokenizer.json").write_bytes(b"x" * 7777)
    assert registry.memory_estimate(tmp_path, max_slots=2) == 1500 + 10 * 100 * 2
    assert registry.memory_estimate(tmp_path) == 1500 + 10 * 100 * 4
    # What the builder records wins over the files.
    meta.update(weight_bytes=123, kv_bytes_per_token=7)
    (tmp_path / "engine.json").write_text(json.dumps(meta))
    assert registry.memory_estimate(tmp_path, max_slots=3) == 123 + 7 * 100 * 3


@pytest.mark.parametrize("value", [-2, -0.5, float("inf")])
def test_keep_alive_is_minus_one_zero_or_seconds(value: float) -> None:
    from cachesvc.errors import ConfigError
    from cachesvc.settings.config import ServeConfig

    with pytest.raises(ConfigError, match="--keep-alive"):
        ServeConfig(keep_alive=value)
    assert ServeConfig(keep_alive=-1).serving.keep_alive == -1
    assert ServeConfig(memory_budget_gb=2).serving.memory_budget_bytes == 2 * 10**9
