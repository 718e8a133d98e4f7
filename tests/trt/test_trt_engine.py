"""The TensorRT builder and runtime, run on the CPU through the fake: greedy parity with the CPU
engine on the same checkpoint, slot semantics, version/GPU refusals, the timing cache."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from inference.runtime import Engine, EngineLoadError, KVEngine, load_engine

SHAPES = {"max_input_len": 8, "max_batch_size": 2, "max_kv_cache_capacity": 64}
PROMPTS = ([5, 17, 99, 3, 42, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [31, 4, 250])
STEPS = 6


def _greedy(
    engine: Engine, prompts: tuple[list[int], ...], steps: int
) -> tuple[list[list[int]], list[np.ndarray]]:
    """Prefill each prompt into its own slot (chunked: prompt 0 is longer than max_input_len), then
    decode all slots together greedily; returns tokens per slot and every step's logits."""
    logits = [engine.prefill(slot, p) for slot, p in enumerate(prompts)]
    seen = [np.stack(logits)]
    tokens = [[int(np.argmax(row))] for row in logits]
    slots = list(range(len(prompts)))
    for _ in range(steps):
        out = engine.decode(slots, [t[-1] for t in tokens])
        seen.append(out)
        for row, t in zip(out, tokens, strict=True):
            t.append(int(np.argmax(row)))
    return tokens, seen


@pytest.fixture
def pair(
    hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path], trt_bundle: Callable[..., Path]
) -> Iterator[Callable[..., tuple[Engine, Engine, Path]]]:
    """Factory: (family, **trt spec) -> (CPU engine, TensorRT engine, TensorRT bundle dir)."""
    opened: list[Engine] = []

    def make(family: str, **spec: object) -> tuple[Engine, Engine, Path]:
        ckpt = hf_checkpoint(family)
        cpu = load_engine(built_bundle(ckpt, **SHAPES), threads=1)
        trt_dir = trt_bundle(ckpt, **{**SHAPES, "precision": "fp32", **spec})
        gpu = load_engine(trt_dir)
        opened.extend([cpu, gpu])
        return cpu, gpu, trt_dir

    yield make
    for engine in opened:
        engine.close()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_parity_with_the_cpu_engine(
    pair: Callable[..., tuple[Engine, Engine, Path]], family: str
) -> None:
    cpu, gpu, trt_dir = pair(family)
    meta = json.loads((trt_dir / "engine.json").read_text())
    assert meta["backend"] == "tensorrt" and meta["graph_ops"] == "decomposed"  # fake reports 10.13
    assert gpu.info.backend == "tensorrt" and gpu.info.max_slots == 2
    want_tokens, want_logits = _greedy(cpu, PROMPTS, STEPS)
    got_tokens, got_logits = _greedy(gpu, PROMPTS, STEPS)
    assert got_tokens == want_tokens
    for want, got in zip(want_logits, got_logits, strict=True):
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    assert [gpu.slot_length(s) for s in (0, 1)] == [len(p) + STEPS for p in PROMPTS]
    # A reset slot starts over; the other slot keeps its sequence.
    gpu.reset(1)
    cpu.reset(1)
    np.testing.assert_allclose(gpu.prefill(1, [9, 8, 7]), cpu.prefill(1, [9, 8, 7]), atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(gpu.decode([1, 0], [3, 4]), cpu.decode([1, 0], [3, 4]), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_builds_keep_norms_in_fp32_and_run(
    pair: Callable[..., tuple[Engine, Engine, Path]], precision: str
) -> None:
    cpu, gpu, trt_dir = pair("llama", precision=precision)
    meta = json.loads((trt_dir / "engine.json").read_text())
    # 2 layers x 2 norms + the final norm, 5 layers each in the decomposed graph.
    assert meta["precision"] == precision and meta["fp32_layers"] == 25
    header = _plan_header(trt_dir / "engine.plan")
    assert header["precision"] == [precision.upper()]
    assert set(header["constrained_layers"].values()) == {"FLOAT"} and len(header["constrained_layers"]) == 25
    assert gpu.info.precision == precision
    # The fake computes in fp32, so the tokens must agree exactly here (not so on a GPU).
    assert _greedy(gpu, PROMPTS, 3)[0] == _greedy(cpu, PROMPTS, 3)[0]


def test_fused_graph_from_tensorrt_10_15(
    hf_checkpoint: Callable[..., Path],
    built_bundle: Callable[..., Path],
    trt_bundle: Callable[..., Path],
    trt_version: Callable[[str], None],
) -> None:
    trt_version("10.15.1.29")
    ckpt = hf_checkpoint("qwen2")
    trt_dir = trt_bundle(ckpt, **SHAPES, precision="fp32")
    assert json.loads((trt_dir / "engine.json").read_text())["graph_ops"] == "opset23-fused"
    cpu, gpu = load_engine(built_bundle(ckpt, **SHAPES), threads=1), load_engine(trt_dir)
    try:
        assert _greedy(gpu, PROMPTS, STEPS)[0] == _greedy(cpu, PROMPTS, STEPS)[0]
    finally:
        cpu.close()
        gpu.close()


def test_int8_weight_only(pair: Callable[..., tuple[Engine, Engine, Path]]) -> None:
    cpu, gpu, trt_dir = pair("llama", precision="int8")
    header = _plan_header(trt_dir / "engine.plan")
    assert "INT8" in header["precision"] and "FP16" in header["precision"]
    want, got = cpu.prefill(0, PROMPTS[0]), gpu.prefill(0, PROMPTS[0])
    cosine = float(want @ got / np.linalg.norm(want) / np.linalg.norm(got))
    assert cosine > 0.99 and not np.allclose(want, got, atol=1e-5)  # quantized: close, not equal


def test_bundles_for_another_tensorrt_or_gpu_are_refused(
    hf_checkpoint: Callable[..., Path],
    trt_bundle: Callable[..., Path],
    trt_version: Callable[[str], None],
    monkeypatch: pytest.MonkeyPatch,
    fake_trt: ModuleType,
) -> None:
    trt_dir = trt_bundle(hf_checkpoint("llama"), **SHAPES, precision="fp32")
    monkeypatch.setenv("FAKE_CUDA_CC", "8.9")
    with pytest.raises(EngineLoadError, match=r"compute capability 9\.0"):
        load_engine(trt_dir)
    monkeypatch.delenv("FAKE_CUDA_CC")
    trt_version("10.14.1.0")
    with pytest.raises(EngineLoadError, match=r"built with TensorRT 10\.13"):
        load_engine(trt_dir)
    monkeypatch.setattr(
        fake_trt, "__version__", json.loads((trt_dir / "engine.json").read_text())["tensorrt_version"]
    )
    with pytest.raises(EngineLoadError, match="max_batch_size"):
        load_engine(trt_dir, max_slots=3)


def test_runs_from_another_thread_and_frees_its_memory(
    hf_checkpoint: Callable[..., Path], trt_bundle: Callable[..., Path]
) -> None:
    import _fake_gpu

    trt_dir = trt_bundle(hf_checkpoint("llama"), **SHAPES, precision="fp32")
    before = _fake_gpu.live_bytes()
    engine = load_engine(trt_dir)
    plan_size = (trt_dir / "engine.plan").stat().st_size
    memory = engine.info.memory_bytes
    assert isinstance(memory, int) and memory > plan_size + _fake_gpu.live_bytes() - before - 1
    results: list[object] = []
    # The scheduler thread drives the engine; it is not the thread that loaded it.
    t = threading.Thread(target=lambda: results.append(engine.prefill(0, [1, 2, 3])))
    t.start()
    t.join()
    assert len(results) == 1 and isinstance(results[0], np.ndarray)
    with pytest.raises(ValueError, match="exceed"):
        engine.prefill(0, list(range(70)))
    with pytest.raises(ValueError, match="empty"):
        engine.decode([1], [3])
    engine.close()
    assert _fake_gpu.live_bytes() == before
    with pytest.raises(RuntimeError, match="closed"):
        engine.prefill(0, [1])


def test_a_refused_tensorrt_call_raises(
    hf_checkpoint: Callable[..., Path], trt_bundle: Callable[..., Path]
) -> None:
    from inference.runtime.trt_engine import EngineRunError

    engine = load_engine(trt_bundle(hf_checkpoint("llama"), **SHAPES, precision="fp32"))
    try:
        with pytest.raises(EngineRunError, match="outside the optimization profile"):
            engine._run(3, 1, 0, int(engine._spare), int(engine._spare))  # type: ignore[attr-defined]
    finally:
        engine.close()


def test_timing_cache_is_shared_per_arch_and_version(
    hf_checkpoint: Callable[..., Path], tmp_path: Path, fake_trt: ModuleType
) -> None:
    from inference.builder.trt_backend import TrtBuildSpec, build_trt_bundle

    timing = tmp_path / "trt-timing"
    for i, precision in enumerate(("fp32", "fp16")):
        out = tmp_path / f"b{i}"
        out.mkdir()
        build_trt_bundle(
            hf_checkpoint("llama"), out, TrtBuildSpec(precision=precision, timing_cache_dir=timing, **SHAPES)
        )
    cache = timing / f"sm90-trt{fake_trt.__version__}.cache"
    entries = json.loads(cache.read_bytes().split(b"\x00", 1)[1])["entries"]
    # Both builds' tactics are in the one file: the second merged into the first.
    assert any(e.endswith(":FLOAT") for e in entries) and any(e.endswith(":FP16") for e in entries)
    assert sorted(p.name for p in timing.iterdir()) == [cache.name, cache.name + ".lock"]


def _plan_header(path: Path) -> dict[str, Any]:
    import struct

    data = path.read_bytes()
    start = data.index(b"\x00") + 1
    (size,) = struct.unpack("<Q", data[start : start + 8])
    header: dict[str, Any] = json.loads(data[start + 8 : start + 8 + size])
    return header


def test_a_damaged_plan_is_refused_and_leaves_nothing_behind(
    hf_checkpoint: Callable[..., Path], trt_bundle: Callable[..., Path], copy_dir: Callable[[Path], Path]
) -> None:
    import _fake_gpu

    bundle = copy_dir(trt_bundle(hf_checkpoint("llama"), **SHAPES, precision="fp32"))
    (bundle / "engine.plan").write_bytes(b"not a plan")
    before = _fake_gpu.live_bytes()
    with pytest.raises(EngineLoadError, match="cannot deserialize"):
        load_engine(bundle)
    assert _fake_gpu.live_bytes() == before


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_extend_and_truncate_match_the_cpu_engine(
    family: str, pair: Callable[..., tuple[Engine, Engine, Path]]
) -> None:
    """Speculative verification on TensorRT: every appended position's logits, and a slot cut
    back after a rejected draft (heads repacked) goes on exactly as the CPU engine's."""
    cpu, gpu, _ = pair(family)
    for engine in (cpu, gpu):
        engine.prefill(0, PROMPTS[0])
        engine.prefill(1, PROMPTS[0])
    draft = [12, 13, 14, 15, 16]
    want, got = cpu.extend(0, draft), gpu.extend(0, draft)  # type: ignore[attr-defined]
    assert got.shape == (len(draft), gpu.info.vocab_size)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    for engine in (cpu, gpu):
        engine.truncate(0, len(PROMPTS[0]) + 2)  # type: ignore[attr-defined]
        engine.truncate(1, len(PROMPTS[0]))  # type: ignore[attr-defined]
        engine.extend(1, draft[:2])  # type: ignore[attr-defined]
    assert gpu.slot_length(0) == gpu.slot_length(1) == len(PROMPTS[0]) + 2
    rows = gpu.decode([0, 1], [40, 40])
    np.testing.assert_allclose(rows[0], rows[1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(rows, cpu.decode([0, 1], [40, 40]), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_context_reuse_operations_match_the_cpu_engine(
    family: str, pair: Callable[..., tuple[Engine, Engine, Path]]
) -> None:
    """copy_prefix, export_kv and import_kv (what context reuse and n choices use) on device
    memory: slots rebuilt from shared or saved KV decode exactly like the slot they came from."""
    cpu, gpu, _ = pair(family)
    assert isinstance(gpu, KVEngine) and isinstance(cpu, KVEngine)
    assert gpu.kv_bytes_per_token == cpu.kv_bytes_per_token  # an fp32 plan keeps fp32 KV
    n = len(PROMPTS[0])
    for engine in (cpu, gpu):
        engine.prefill(0, PROMPTS[0])
        engine.copy_prefix(0, 1, n - 4)  # share all but the last 4 prompt tokens
        engine.prefill(1, PROMPTS[0][n - 4 :])
    assert gpu.slot_length(1) == n
    rows = gpu.decode([0, 1], [40, 40])
    np.testing.assert_allclose(rows[0], rows[1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(rows, cpu.decode([0, 1], [40, 40]), atol=2e-4, rtol=1e-4)
    for engine in (cpu, gpu):
        saved = engine.export_kv(0, 5, 10)  # positions 5..14 of slot 0
        assert saved.shape[2] == 10
        engine.truncate(1, 5)
        engine.import_kv(1, 5, saved)  # slot 1 = positions 0..14 of slot 0
        engine.truncate(0, 15)
    assert gpu.slot_length(1) == 15
    rows = gpu.decode([0, 1], [41, 41])
    np.testing.assert_allclose(rows[0], rows[1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(rows, cpu.decode([0, 1], [41, 41]), atol=2e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="cannot export"):
        gpu.export_kv(0, 10, 99)
    with pytest.raises(ValueError, match="does not fit"):
        gpu.import_kv(1, 0, np.zeros((1, 2, 3, 4), dtype=np.float32))
    with pytest.raises(ValueError, match="cannot import"):
        gpu.import_kv(1, gpu.slot_length(1) + 1, gpu.export_kv(0, 0, 2))


def test_a_model_with_per_layer_kv_is_refused_in_one_line(
    hf_checkpoint: Callable[..., Path], tmp_path: Path, fake_trt: ModuleType
) -> None:
    """Gemma 4's layers of their own K/V shapes and shared K/V: the CPU engine's, not TensorRT's."""
    from inference.builder.trt_backend import TrtBuildSpec, build_trt_bundle
    from inference.errors import UnsupportedFeatureError

    out = tmp_path / "bundle"
    out.mkdir()
    with pytest.raises(UnsupportedFeatureError, match="CPU engine only") as err:
        build_trt_bundle(hf_checkpoint("gemma4_text"), out,
                         TrtBuildSpec(max_kv_cache_capacity=256, max_input_len=64))
    assert "\n" not in str(err.value) and not any(out.iterdir())
