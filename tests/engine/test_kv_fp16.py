"""float16 KV buffers (``--kv-cache-dtype fp16``, issue 35): half the KV memory, under the gate.

The CPU graph casts q/k/v and the rope tables to float16 for GroupQueryAttention and its output
back to float32; the engine holds its buffers in float16, hands float16 blocks to the context
cache and refuses blocks of another dtype. The quality gate judges the build against fp32 with
float32 KV: an fp32 build must give fp32's first tokens on every gate prompt (strict), and a
K/V that leaves float16's range fails it with one line naming the way out.
"""

from __future__ import annotations

import json
import platform
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from inference.build_profile import ProfileError, check_kv_cache_dtype
from inference.builder import EngineBuildSpec, build_bundle
from inference.builder.errors import BuildInputError
from inference.builder.quality import QualityGateError
from inference.cpu_class import cpu_class
from inference.runtime.onnxruntime_engine import GqaEngine
from inference.runtime.onnxruntime_loader import load_ort_engine


def _engine(bundle: Path, slots: int = 2) -> GqaEngine:
    engine = load_ort_engine(bundle, max_slots=slots)
    assert isinstance(engine, GqaEngine)
    return engine


def _greedy(engine: GqaEngine, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    engine.reset(0)
    logits = engine.prefill(0, prompt)
    first = np.asarray(logits).reshape(-1).copy()
    tokens = [int(first.argmax())]
    for _ in range(steps - 1):
        tokens.append(int(engine.decode([0], [tokens[-1]])[0].argmax()))
    return tokens, first


def test_the_profile_vocabulary_refuses_fp16_kv_where_it_cannot_apply() -> None:
    check_kv_cache_dtype("fp16", "onnxruntime", "generate")
    with pytest.raises(ProfileError, match=r"kv_cache_dtype.*tensorrt"):
        check_kv_cache_dtype("fp16", "tensorrt", "generate")
    with pytest.raises(ProfileError, match="embed"):
        check_kv_cache_dtype("fp16", "onnxruntime", "embed")
    with pytest.raises(ProfileError, match=r"must be one of fp32, fp16"):
        check_kv_cache_dtype("bf16", "onnxruntime", "generate")
    with pytest.raises(BuildInputError, match="kv_cache_dtype"):
        EngineBuildSpec(kv_cache_dtype="int8")


def test_fp32_weights_with_fp16_kv_answer_like_fp32_in_half_the_kv_memory(
    hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path]
) -> None:
    print(f"CPU class {cpu_class()} ({platform.machine()})")
    checkpoint = hf_checkpoint("llama")
    full = built_bundle(checkpoint, precision="fp32")
    half = built_bundle(checkpoint, precision="fp32", kv_cache_dtype="fp16")
    meta32 = json.loads((full / "engine.json").read_text())
    meta16 = json.loads((half / "engine.json").read_text())
    assert meta32["kv_cache"]["dtype"] == "float32" and "quality" not in meta32
    assert meta16["kv_cache"]["dtype"] == "float16"
    assert meta16["kv_cache"]["bytes_per_token"] * 2 == meta32["kv_cache"]["bytes_per_token"]
    assert meta16["kv_bytes_per_token"] * 2 == meta32["kv_bytes_per_token"]
    assert meta16["memory_bytes"] < meta32["memory_bytes"]
    quality = meta16["quality"]
    assert quality["kv_cache_dtype"] == "float16" and "kernels" not in meta16
    assert quality["identical"] == quality["prompts"] and quality["greedy_agreement"] >= 0.99

    prompt = [3, 17, 42, 5, 99, 23, 7, 64, 11, 2]
    a, b = _engine(full), _engine(half)
    try:
        tokens32, logits32 = _greedy(a, prompt, 12)
        tokens16, logits16 = _greedy(b, prompt, 12)
        assert tokens16 == tokens32
        # float16 rounding of K/V only: close, not bit-identical.
        assert np.abs(logits16 - logits32).max() < 1e-2 * max(1.0, np.abs(logits32).max())
        assert b.kv_bytes_per_token * 2 == a.kv_bytes_per_token
        block = b.export_kv(0, 0, 8)
        assert block.dtype == np.float16
        b.reset(1)
        b.import_kv(1, 0, block)
        assert b.slot_length(1) == 8
        with pytest.raises(ValueError, match="dtype float32"):
            b.import_kv(1, 0, block.astype(np.float32))
        # The same sequence continued from an imported prefix decodes as the original slot did.
        cont = int(np.asarray(b.extend(1, prompt[8:10])).reshape(len(prompt[8:10]), -1)[-1].argmax())
        assert cont == tokens16[0]
    finally:
        a.close()
        b.close()


def test_quantized_builds_take_fp16_kv_under_their_gate(
    hf_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    out = tmp_path / "b"
    out.mkdir()
    meta = build_bundle(hf_checkpoint("qwen2", "fp32", True), out,
                        EngineBuildSpec(precision="int8", kernels="exact", kv_cache_dtype="fp16"))
    assert meta["kv_cache"]["dtype"] == "float16"
    assert meta["quality"]["kv_cache_dtype"] == "float16" and meta["kernels"]["name"] == "exact"
    engine = _engine(out)
    try:
        tokens, _ = _greedy(engine, [5, 6, 7, 8], 4)
        assert len(tokens) == 4
    finally:
        engine.close()


def test_kv_beyond_float16_range_fails_the_gate_with_the_way_out(
    hf_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """Keys scaled past 65504 become inf in float16: the fp32 build's strict gate refuses it."""
    source = hf_checkpoint("llama")
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(source, checkpoint)
    weights_file = next(checkpoint.glob("*.safetensors"))
    weights = load_file(str(weights_file))
    for name in list(weights):
        if name.endswith("k_proj.weight"):
            weights[name] = weights[name] * np.float32(1e6)
    save_file(weights, str(weights_file), metadata={"format": "pt"})
    out = tmp_path / "b"
    out.mkdir()
    with pytest.raises(QualityGateError, match=r"float16 KV .*--kv-cache-dtype fp32 instead"):
        build_bundle(checkpoint, out, EngineBuildSpec(precision="fp32", kv_cache_dtype="fp16"))
    assert not (out / "engine.json").exists()
    # The same weights with float32 KV build (fp32 builds have no gate).
    ok = tmp_path / "ok"
    ok.mkdir()
    assert build_bundle(checkpoint, ok, EngineBuildSpec(precision="fp32"))["kv_cache"]["dtype"] == "float32"
