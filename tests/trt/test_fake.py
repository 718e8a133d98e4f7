"""The fake TensorRT/pycuda pair is not a no-op: each rule it enforces refuses a wrong use."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper


def _tiny_onnx(path: Path, op: str = "Relu", domain: str = "") -> Path:
    """x [B,N] -> y = op(x): one dynamic input, one output."""
    node = helper.make_node(op, ["x"], ["y"], name="the_node", domain=domain)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.save_model(model, str(path))
    return path


class Parts:
    """One builder pipeline over the tiny graph, step by step."""

    def __init__(self, trt: ModuleType, path: Path) -> None:
        self.trt = trt
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.builder = trt.Builder(self.logger)
        self.network = self.builder.create_network(0)
        self.parser = trt.OnnxParser(self.network, self.logger)
        self.parsed = self.parser.parse_from_file(str(path))
        self.config = self.builder.create_builder_config()

    def profile(
        self, lo: tuple[int, ...] = (1, 4), opt: tuple[int, ...] = (2, 4), hi: tuple[int, ...] = (4, 4)
    ) -> int:
        prof = self.builder.create_optimization_profile()
        prof.set_shape("x", lo, opt, hi)
        return int(self.config.add_optimization_profile(prof))

    def plan(self) -> Any:
        return self.builder.build_serialized_network(self.network, self.config)


@pytest.fixture
def parts(fake_trt: ModuleType, tmp_path: Path) -> Callable[..., Parts]:
    def make(op: str = "Relu", domain: str = "") -> Parts:
        return Parts(fake_trt, _tiny_onnx(tmp_path / f"{op}.onnx", op, domain))

    return make


@pytest.fixture
def cuda(fake_trt: ModuleType) -> Any:
    import pycuda.driver as driver

    driver.init()
    ctx = driver.Device(0).retain_primary_context()
    ctx.push()
    yield driver
    driver.Context.pop()


def test_a_correct_sequence_runs_the_graph(parts: Callable[..., Parts], cuda: Any) -> None:
    p = parts()
    assert p.parsed and p.profile() == 0
    plan = p.plan()
    assert plan is not None and plan.nbytes > 0
    engine = p.trt.Runtime(p.logger).deserialize_cuda_engine(plan)
    ctx = engine.create_execution_context()
    stream = cuda.Stream()
    x = cuda.pagelocked_empty((3, 4), np.float32)
    x[:] = np.arange(-6, 6, dtype=np.float32).reshape(3, 4)
    y = cuda.pagelocked_empty((3, 4), np.float32)
    dx, dy = cuda.mem_alloc(x.nbytes), cuda.mem_alloc(y.nbytes)
    cuda.memcpy_htod_async(dx, x, stream)
    assert ctx.set_input_shape("x", (3, 4))
    assert ctx.set_tensor_address("x", int(dx)) and ctx.set_tensor_address("y", int(dy))
    assert ctx.execute_async_v3(stream.handle)
    y[:] = -1
    cuda.memcpy_dtoh_async(y, dy, stream)
    assert (y == -1).all(), "stream work must not complete before synchronize"
    stream.synchronize()
    np.testing.assert_array_equal(y, np.maximum(x, 0))
    assert not p.logger.errors()


def test_wrong_call_order_is_refused(parts: Callable[..., Parts], cuda: Any) -> None:
    p = parts()
    p.profile()
    engine = p.trt.Runtime(p.logger).deserialize_cuda_engine(p.plan())
    ctx = engine.create_execution_context()
    dx, dy = cuda.mem_alloc(64), cuda.mem_alloc(64)
    # An input's address before its shape:
    assert ctx.set_tensor_address("x", int(dx)) is False
    assert "before its address" in p.logger.errors()[-1]
    # A shape outside the profile (batch 5 > max 4), and a wrong static dim:
    assert ctx.set_input_shape("x", (5, 4)) is False
    assert ctx.set_input_shape("x", (2, 3)) is False
    # Executing with an unbound output:
    assert ctx.set_input_shape("x", (2, 4)) and ctx.set_tensor_address("x", int(dx))
    assert ctx.execute_async_v3(cuda.Stream().handle) is False
    assert "without an address" in p.logger.errors()[-1]
    # An output bound to too little memory is caught when the work runs.
    small = cuda.mem_alloc(8)
    assert ctx.set_tensor_address("y", int(small))
    stream = cuda.Stream()
    assert ctx.execute_async_v3(stream.handle)
    with pytest.raises(RuntimeError, match="past the end"):
        stream.synchronize()
    with pytest.raises(TypeError):
        ctx.set_input_shape("x", "2x4")
    del dy


def test_profiles_must_be_ordered_and_complete(parts: Callable[..., Parts]) -> None:
    p = parts()
    assert p.plan() is None, "a dynamic network without a profile must not build"
    assert "no optimization profile" in p.logger.errors()[-1]
    assert p.profile(lo=(2, 4), opt=(1, 4), hi=(4, 4)) == -1, "min > opt must be refused"
    assert p.profile(lo=(1, 4), opt=(2, 4), hi=(4, 5)) == 0
    assert p.plan() is None, "a profile contradicting a static dim must not build"


def test_network_flags_follow_tensorrt_10(fake_trt: ModuleType) -> None:
    trt = fake_trt
    logger = trt.Logger()
    builder = trt.Builder(logger)
    builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH))
    assert any("deprecated" in m for _, m in logger.messages)
    with pytest.raises(ValueError):
        builder.create_network(1 << 30)
    with pytest.raises(TypeError):
        trt.Builder("not a logger")


def test_strongly_typed_networks_refuse_precision_flags(fake_trt: ModuleType, tmp_path: Path) -> None:
    trt = fake_trt
    logger = trt.Logger()
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    assert trt.OnnxParser(network, logger).parse_from_file(str(_tiny_onnx(tmp_path / "m.onnx")))
    config = builder.create_builder_config()
    config.set_flag(trt.BuilderFlag.FP16)
    prof = builder.create_optimization_profile()
    prof.set_shape("x", (1, 4), (1, 4), (1, 4))
    config.add_optimization_profile(prof)
    assert builder.build_serialized_network(network, config) is None
    with pytest.raises(RuntimeError):
        network.get_layer(0).precision = trt.float32


def test_the_parser_knows_ops_by_version(
    parts: Callable[..., Parts], trt_version: Callable[[str], None]
) -> None:
    trt_version("10.13.0.1")
    p = parts("RMSNormalization")
    assert not p.parsed and "needs TensorRT 10.15" in p.parser.get_error(0).desc()
    assert not parts("GroupQueryAttention", "com.microsoft").parsed
    trt_version("10.15.1.0")
    assert parts("RMSNormalization").parsed


def test_plans_and_timing_caches_are_tied_to_version_and_gpu(
    parts: Callable[..., Parts], trt_version: Callable[[str], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    p = parts()
    p.profile()
    cache = p.config.create_timing_cache(b"")
    assert p.config.set_timing_cache(cache, False)
    plan = p.plan()
    blob = bytes(p.config.get_timing_cache().serialize())
    monkeypatch.setenv("FAKE_CUDA_CC", "8.9")
    assert p.trt.Runtime(p.logger).deserialize_cuda_engine(plan) is None
    assert "incompatible device" in p.logger.errors()[-1]
    assert p.config.set_timing_cache(p.config.create_timing_cache(blob), False) is False
    assert p.config.set_timing_cache(p.config.create_timing_cache(blob), True) is True
    monkeypatch.delenv("FAKE_CUDA_CC")
    trt_version("10.14.0.0")
    assert p.trt.Runtime(p.logger).deserialize_cuda_engine(plan) is None
    assert "not compatible with this version" in p.logger.errors()[-1]


def test_pycuda_needs_init_a_context_per_thread_and_pinned_memory(fake_trt: ModuleType) -> None:
    import pycuda.driver as driver

    driver.init()
    ctx = driver.Device(0).retain_primary_context()
    with pytest.raises(driver.Error, match="no currently active context"):
        driver.mem_alloc(16)
    ctx.push()
    try:
        buf = driver.mem_alloc(16)
        with pytest.raises(driver.LogicError, match="pageable"):
            driver.memcpy_htod_async(buf, np.zeros(4, np.float32), driver.Stream())
        with pytest.raises(RuntimeError, match="past the end"):
            driver.memcpy_htod(buf, np.zeros(8, np.float32))
        errors: list[BaseException] = []

        def other_thread() -> None:
            try:
                driver.mem_alloc(16)
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
        assert errors and "no currently active context" in str(errors[0])
    finally:
        driver.Context.pop()


def test_pycuda_autoinit_makes_a_context_current() -> None:
    import os
    import subprocess
    import sys

    from tests.trt.conftest import FAKE_DIR

    code = "import pycuda.autoinit, pycuda.driver as d; d.mem_alloc(4); print(d.Context.get_device().name())"
    # A separate process: autoinit leaves its context current for the life of the process.
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(FAKE_DIR)},
    )
    assert done.returncode == 0, done.stderr
    assert "Fake NVIDIA" in done.stdout
