"""The int4 precision through the launch options, the profile and the backend choice."""

from __future__ import annotations

import pytest

from cachesvc.builders import resolve_precision
from cachesvc.config import ServeConfig
from cachesvc.errors import ConfigError
from cachesvc.profiles import BuildOptions
from inference.builder import EngineBuildSpec


def test_int4_is_a_cpu_precision() -> None:
    assert ServeConfig(precision="int4").profile_request().precision == "int4"
    assert resolve_precision("int4", "onnxruntime") == "int4"
    with pytest.raises(ConfigError, match="'int4' is for the onnxruntime backend"):
        resolve_precision("int4", "tensorrt")
    assert EngineBuildSpec(precision="int4").precision == "int4"
    fp32 = BuildOptions(backend="onnxruntime", precision="fp32")
    int4 = BuildOptions(backend="onnxruntime", precision="int4")
    assert fp32.digest != int4.digest  # a separate bundle
