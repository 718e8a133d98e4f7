"""Gemma 4's K/V layout in the CPU engine: layers of their own shapes and layers that share an
earlier layer's K/V (issue 31, "per-layer KV shapes"), through the quantized builder and the
engine's KV operations. Greedy parity with transformers is the registry's parity tests' job
(``tests/engine/test_parity.py`` picks the family up); these check what is particular to it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from inference.builder import EngineBuildSpec, build_bundle
from inference.cpu_class import cpu_class
from inference.runtime import generate, load_engine
from tests.engine.conftest import make_hf_model

FAMILY = "gemma4_text"


@pytest.fixture
def bundle_of_family(hf_checkpoint: Callable[..., Path],
                     built_bundle: Callable[..., Path]) -> Callable[..., Path]:
    """Factory: family -> its tiny untied fp32 bundle (built once per session)."""
    return lambda family: built_bundle(hf_checkpoint(family), max_batch_size=2, max_kv_cache_capacity=128)


@pytest.fixture(scope="module")
def on_q8_grid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Gemma 4 with every matrix on llama.cpp's Q8_0 grid (blocks of 32, as the int8 build
    quantizes them): the int8 build's products are then fp32's of the same weights."""
    model = make_hf_model(FAMILY, False)
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.ndim == 2 and param.shape[1] % 32 == 0:
                w = param.numpy().astype(np.float32)
                back = gguf.quants.dequantize(gguf.quants.quantize(w, q8), q8).reshape(w.shape)
                param.copy_(torch.from_numpy(back.astype(np.float32)))
    out = tmp_path_factory.mktemp("gemma4-q8")
    model.save_pretrained(out)
    return out


def test_engine_json_records_each_layers_kv_and_the_engine_holds_the_producers_only(
        bundle_of_family: Callable[..., Path]) -> None:
    bundle = bundle_of_family(FAMILY)
    meta = json.loads((bundle / "engine.json").read_text())
    layers = meta["kv_layers"]
    # the tiny case: sliding layers 2 x 16, global ones 1 x 32; layers 4 and 5 share 3's and 2's
    assert [(x["kv_heads"], x["head_dim"], x["source"]) for x in layers] == [
        (2, 16, 0), (2, 16, 1), (1, 32, 2), (2, 16, 3), (2, 16, 3), (1, 32, 2)]
    own = [x for i, x in enumerate(layers) if x["source"] == i]
    assert meta["kv_cache"]["bytes_per_token"] == sum(2 * x["kv_heads"] * x["head_dim"] * 4 for x in own)
    engine = load_engine(bundle, max_slots=2, threads=1)
    try:
        assert engine.kv_bytes_per_token == meta["kv_cache"]["bytes_per_token"]  # type: ignore[attr-defined]
        assert len(engine._kv) == 2 * len(own)  # type: ignore[attr-defined]
    finally:
        engine.close()


def test_a_prefix_exported_and_imported_continues_like_the_original(
        bundle_of_family: Callable[..., Path]) -> None:
    """KV blocks of layers of different shapes travel as one array ([rows, 1, n, unit]): moved out
    of a slot and into another, the continuation is the original's, token for token."""
    engine = load_engine(bundle_of_family(FAMILY), max_slots=2, threads=1)
    try:
        prompt = [int(t) for t in np.random.default_rng(5).integers(0, 384, size=20)]
        want = generate(engine, prompt, 12, eos_ids=())[0]
        engine.reset(0)
        engine.prefill(0, prompt[:-1])
        block = engine.export_kv(0, 0, 19)  # type: ignore[attr-defined]
        # 16 is the head sizes' common divisor: 2 x 2x16/16 (sliding K, V) x 4 layers + 2 x 1x32/16 x 1
        assert block.shape == (2 * (2 * 2 + 2) + 2 * 2, 1, 19, 16)
        engine.import_kv(1, 0, block)  # type: ignore[attr-defined]
        assert engine.slot_length(1) == 19
        first = int(np.argmax(engine.prefill(1, prompt[-1:])))
        got = [first]
        for _ in range(11):
            got.append(int(np.argmax(engine.decode([1], [got[-1]])[0])))
        assert got == want
        with pytest.raises(ValueError, match="does not fit"):
            engine.import_kv(1, 0, block[:, :, :, :8])  # type: ignore[attr-defined]
    finally:
        engine.close()


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16"])
def test_int8_on_the_grid_answers_like_fp32(on_q8_grid: Path, tmp_path: Path, kv_dtype: str) -> None:
    """The quantized graph (8-bit linears, embedding, per-layer input table and lm_head) over the
    per-layer K/V, float32 or float16: on weights of the Q8_0 grid the gate measures fp32's answers."""
    out = tmp_path / "bundle"
    out.mkdir()
    build_bundle(on_q8_grid, out, EngineBuildSpec(precision="int8", kv_cache_dtype=kv_dtype,
                                                  max_kv_cache_capacity=128, max_input_len=64))
    meta = json.loads((out / "engine.json").read_text())
    quality = meta["quality"]
    print(f"gemma4_text int8 ({kv_dtype} KV) on {cpu_class()}: plan {quality['plan']}, "
          f"agreement {quality['greedy_agreement']}, identical {quality['identical']}")
    assert meta["kv_cache"]["dtype"] == ("float16" if kv_dtype == "fp16" else "float32")
    assert quality["greedy_agreement"] >= 0.97 and quality["identical"] >= 7
