"""The same parity as ``test_trt_engine`` against real TensorRT on a GPU (``-m gpu``,
``scripts/gpu-check.sh``). Skipped, with the reason, where tensorrt/pycuda/a device is missing."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from inference.builder.trt_backend import TrtBuildSpec, build_trt_bundle
from inference.cuda_device import tensorrt_missing
from inference.runtime import load_engine
from tests.trt.test_trt_engine import PROMPTS, SHAPES, STEPS, _greedy

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def real_trt() -> None:
    if getattr(sys.modules.get("tensorrt"), "FAKE", False):
        pytest.skip(
            "real TensorRT is not in use: this session put the CPU fake on sys.path "
            "(run `pytest -m gpu tests/trt/test_gpu.py` alone, as scripts/gpu-check.sh does)"
        )
    missing = tensorrt_missing()
    if missing is not None:
        pytest.skip(f"real TensorRT is not usable here: {missing}")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gpu_fp32_greedy_parity(
    real_trt: None,
    family: str,
    hf_checkpoint: Callable[..., Path],
    built_bundle: Callable[..., Path],
    tmp_path: Path,
) -> None:
    ckpt = hf_checkpoint(family)
    out = tmp_path / "trt"
    out.mkdir()
    build_trt_bundle(
        ckpt, out, TrtBuildSpec(precision="fp32", timing_cache_dir=tmp_path / "timing", **SHAPES)
    )
    cpu, gpu = load_engine(built_bundle(ckpt, **SHAPES), threads=1), load_engine(out)
    try:
        want_tokens, want_logits = _greedy(cpu, PROMPTS, STEPS)
        got_tokens, got_logits = _greedy(gpu, PROMPTS, STEPS)
        assert got_tokens == want_tokens
        for want, got in zip(want_logits, got_logits, strict=True):
            np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-3)
    finally:
        cpu.close()
        gpu.close()


@pytest.mark.parametrize("precision", ["fp16", "bf16", "int8"])
def test_gpu_reduced_precision_stays_close(
    real_trt: None,
    precision: str,
    hf_checkpoint: Callable[..., Path],
    built_bundle: Callable[..., Path],
    tmp_path: Path,
) -> None:
    ckpt = hf_checkpoint("llama")
    out = tmp_path / "trt"
    out.mkdir()
    build_trt_bundle(
        ckpt, out, TrtBuildSpec(precision=precision, timing_cache_dir=tmp_path / "timing", **SHAPES)
    )
    cpu, gpu = load_engine(built_bundle(ckpt, **SHAPES), threads=1), load_engine(out)
    try:
        want, got = cpu.prefill(0, PROMPTS[0]), gpu.prefill(0, PROMPTS[0])
        cosine = float(want @ got / np.linalg.norm(want) / np.linalg.norm(got))
        assert cosine > 0.99, f"{precision}: cosine {cosine:.4f} to the fp32 CPU logits"
        assert int(np.argmax(got)) == int(np.argmax(want))
    finally:
        cpu.close()
        gpu.close()
