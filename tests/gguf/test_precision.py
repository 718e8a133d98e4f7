"""The int4 precision through the launch options, the profile and the backend choice."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from cachesvc.cache.builders import resolve_precision
from cachesvc.cache.profiles import BuildOptions
from cachesvc.errors import ConfigError
from cachesvc.settings.config import ServeConfig
from inference.builder import EngineBuildSpec


def test_int4_is_a_cpu_precision() -> None:
    assert ServeConfig(precision="int4").profile_request().precision == "int4"
    assert resolve_precision("int4", "onnxruntime") == "int4"
    with pytest.raises(ConfigError, match="'int4' is for the onnxruntime backend"):
        resolve_precision("int4", "tensorrt")
    assert EngineBuildSpec(precision="int4").precision == "int4"
    fp32 = BuildOptions(backend="onnxruntime", precision="fp32")
    int4 = BuildOptions(backend="onnxruntime", precision="int4", cpu_class="avx2")
    assert fp32.digest != int4.digest  # a separate bundle


def test_quantized_profiles_are_keyed_by_the_cpu_class() -> None:
    avx2 = BuildOptions(backend="onnxruntime", precision="int4", cpu_class="avx2")
    amx = BuildOptions(backend="onnxruntime", precision="int4", cpu_class="amx")
    assert avx2.digest != amx.digest and avx2.name.endswith(f"-avx2-int4-{avx2.digest[:12]}")
    with pytest.raises(ConfigError, match="cpu_class: is required for int8"):
        BuildOptions(backend="onnxruntime", precision="int8")
    with pytest.raises(ConfigError, match="cpu_class: applies only to int8/int4"):
        BuildOptions(backend="onnxruntime", precision="fp32", cpu_class="avx2")
    with pytest.raises(ConfigError, match="cpu_class"):
        BuildOptions(backend="onnxruntime", precision="int8", cpu_class="pentium")


@pytest.mark.parametrize(("gguf_type", "expected"), [("Q4_0", "int4"), ("Q8_0", "int8"), ("F16", "fp32")])
def test_auto_precision_keeps_the_gguf_type(
    small_gguf: Callable[[str, str], tuple[Path, Path]], tmp_path: Path, gguf_type: str, expected: str
) -> None:
    gguf, _ = small_gguf("llama", gguf_type)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.gguf").symlink_to(gguf)
    assert resolve_precision("auto", "onnxruntime", checkpoint) == expected
    assert resolve_precision("fp32", "onnxruntime", checkpoint) == "fp32"  # --precision overrides
    assert resolve_precision("auto", "tensorrt", checkpoint) == "fp16"


def test_auto_precision_of_a_safetensors_checkpoint_is_fp32(tmp_path: Path) -> None:
    assert resolve_precision("auto", "onnxruntime", tmp_path) == "fp32"
