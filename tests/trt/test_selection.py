"""Backend selection: ``tensorrt``/``pycuda`` stay unimported unless that backend is used,
``--backend tensorrt`` without them exits 2 with one line saying what is missing, and with the
fake pair (a GPU that answers) ``auto`` builds a TensorRT bundle keyed by the GPU's arch through
the cache manager, which a bundle for another arch never matches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from cachesvc.cache.builders import default_builders, resolve_backend
from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.errors import ConfigError
from cachesvc.settings.config import ServeConfig
from inference.runtime import load_engine
from tests.trt.conftest import FAKE_DIR

REPO = Path(__file__).resolve().parents[2]
SHAPES: dict[str, Any] = {"max_input_len": 8, "max_kv_cache_capacity": 64, "max_batch_size": 1}

_NOT_IMPORTED = """
import sys
from pathlib import Path
import cachesvc.serving.app, cachesvc.cli, cachesvc.serving.server
from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
m = CacheManager.open(Path(sys.argv[1]), max_size_bytes=10**9)
assert sorted(m.builders) == ["onnxruntime", "tensorrt"], sorted(m.builders)
assert m.build_options(ProfileRequest(backend="onnxruntime")).backend == "onnxruntime"
loaded = sorted(n for n in sys.modules if n.split(".")[0] in ("tensorrt", "pycuda"))
assert not loaded, loaded
"""


def _python(args: list[str], *, fake: bool) -> subprocess.CompletedProcess[str]:
    path = [str(REPO)] + ([str(FAKE_DIR)] if fake else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    env.pop("CACHESVC_DISABLE_GPU", None)
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=120, cwd=REPO
    )


def test_nothing_imports_tensorrt_unless_that_backend_is_used(tmp_path: Path) -> None:
    # Installed (the fake is importable), yet an onnxruntime process never loads it.
    done = _python(["-c", _NOT_IMPORTED, str(tmp_path / "cache")], fake=True)
    assert done.returncode == 0, done.stderr


def test_backend_tensorrt_without_it_exits_2_saying_what_is_missing(
    hf_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    done = _python(
        [
            "-m",
            "cachesvc.cli",
            "prepare",
            str(hf_checkpoint("llama")),
            "--backend",
            "tensorrt",
            "--cache-dir",
            str(tmp_path / "cache"),
        ],
        fake=False,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("cachesvc: error: --backend")
    assert "'tensorrt' is not installed" in lines[0] and "'pycuda' is not installed" in lines[0]


@pytest.fixture
def manager(fake_trt: ModuleType, tmp_path: Path) -> Iterator[CacheManager]:
    m = CacheManager.open(tmp_path / "cache", max_size_bytes=10**9)
    yield m
    m.close()


def test_no_device_is_named_as_what_is_missing(fake_trt: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    builders = default_builders()
    assert "tensorrt" in builders
    monkeypatch.setenv("FAKE_CUDA_DEVICES", "0")
    with pytest.raises(ConfigError, match="no CUDA device answers") as err:
        resolve_backend("tensorrt", builders)
    assert err.value.field == "backend"
    assert resolve_backend("auto", builders) == "onnxruntime"
    # CACHESVC_DISABLE_GPU is read by the launch config and passed down (never read here).
    monkeypatch.setenv("CACHESVC_DISABLE_GPU", "1")
    assert "tensorrt" in default_builders()
    assert "tensorrt" not in default_builders(gpu_disabled=ServeConfig().build.gpu_disabled)


def test_auto_builds_a_tensorrt_bundle_keyed_by_arch(
    manager: CacheManager, hf_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = str(hf_checkpoint("llama"))
    first = manager.prepare(ckpt, ProfileRequest(**SHAPES))
    assert "-tensorrt-sm90-fp16-" in first.bundle_dir.name and first.built
    meta = json.loads((first.bundle_dir / "engine.json").read_text())
    assert (meta["backend"], meta["device_arch"], meta["compute_capability"]) == ("tensorrt", "sm90", "9.0")
    manifest = json.loads((first.bundle_dir / "manifest.json").read_text())
    assert manifest["versions"]["compute_capability"] == "9.0" and "tensorrt" in manifest["versions"]
    assert list((manager.layout.root / "trt-timing").glob("sm90-trt*.cache"))
    engine = load_engine(first.bundle_dir)
    try:
        assert engine.info.backend == "tensorrt" and engine.prefill(0, [1, 2, 3]).shape == (384,)
    finally:
        engine.close()
    again = manager.prepare(ckpt, ProfileRequest(**SHAPES))
    assert (again.bundle_id, again.built) == (first.bundle_id, False)
    # Another GPU arch: another key, another bundle; the sm90 one is never matched.
    monkeypatch.setenv("FAKE_CUDA_CC", "8.9")
    other = manager.prepare(ckpt, ProfileRequest(backend="tensorrt", **SHAPES))
    assert "-tensorrt-sm89-" in other.bundle_dir.name and other.bundle_id != first.bundle_id
