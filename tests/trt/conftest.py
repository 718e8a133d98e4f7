"""Fixtures for the TensorRT backend checked on the CPU: the fake ``tensorrt``/``pycuda`` pair
(``tests/support/fake_tensorrt``, put first on ``sys.path``, never installed) and bundles built
with it from the tiny checkpoints of the engine tests."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.engine.conftest import built_bundle, copy_dir, hf_checkpoint  # noqa: F401 - fixtures re-exported

FAKE_DIR = Path(__file__).resolve().parents[1] / "support" / "fake_tensorrt"
_FAKE_MODULES = ("tensorrt", "pycuda", "_fake_gpu")


def _drop_modules() -> None:
    for name in list(sys.modules):
        if name.split(".")[0] in _FAKE_MODULES:
            del sys.modules[name]


@pytest.fixture(scope="session")
def fake_trt() -> Iterator[ModuleType]:
    """The fake ``tensorrt`` module, importable as ``tensorrt`` (with ``pycuda``) for the session."""
    _drop_modules()
    sys.path.insert(0, str(FAKE_DIR))
    import tensorrt

    assert getattr(tensorrt, "FAKE", False), f"expected the fake tensorrt, imported {tensorrt.__file__}"
    try:
        yield tensorrt
    finally:
        sys.path.remove(str(FAKE_DIR))
        _drop_modules()


@pytest.fixture
def trt_version(fake_trt: ModuleType, monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Setter: make the fake report another TensorRT version for one test."""

    def set_version(version: str) -> None:
        monkeypatch.setattr(fake_trt, "__version__", version)

    return set_version


@pytest.fixture(scope="session")
def trt_bundle(fake_trt: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: (checkpoint dir, **TrtBuildSpec fields) -> TensorRT bundle dir, built once per session."""
    from inference.builder.trt_backend import TrtBuildSpec, build_trt_bundle

    cache: dict[tuple[Any, ...], Path] = {}
    timing = tmp_path_factory.mktemp("trt-timing")

    def build(checkpoint: Path, **spec: Any) -> Path:
        spec.setdefault("max_kv_cache_capacity", 256)
        spec.setdefault("max_input_len", 64)
        spec.setdefault("timing_cache_dir", timing)
        key = (checkpoint, fake_trt.__version__, tuple(sorted((k, str(v)) for k, v in spec.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp("trt-bundle")
            build_trt_bundle(checkpoint, out, TrtBuildSpec(**spec))
            cache[key] = out
        return cache[key]

    return build
