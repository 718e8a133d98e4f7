"""Rope scalings against transformers, from safetensors and from a GGUF written as llama.cpp's
converter writes it: YaRN (qwen2), LongRoPE (phi3) within and beyond its original context,
dynamic NTK within max_position_embeddings, llama3 through llama.cpp's ``rope_freqs``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inference.builder import BuildInputError, EngineBuildSpec, build_bundle
from inference.builder.gguf_convert import convert_gguf
from inference.builder.model_config import load_model_config
from inference.runtime import generate, load_engine
from tests.engine.conftest import hf_greedy, hf_step, load_reference
from tests.gguf.ggufs import write_pair

TOL = 1e-4
GREEDY = 12
#: LongRoPE with a short original context: a 40-token prompt is past it.
LONGROPE_32 = {"original_max_position_embeddings": 32}
YARN = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 32}}
YARN_ALL_KEYS = {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                     "original_max_position_embeddings": 64, "beta_fast": 16.0,
                                     "beta_slow": 2.0, "attention_factor": 1.25}}  # exact in float32


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 384, size=n)]


def _longrope_overrides() -> dict[str, Any]:
    from inference.families import family_by_name

    params = dict(family_by_name("phi3").tiny["rope_parameters"])
    return {**LONGROPE_32, "rope_parameters": {**params, "original_max_position_embeddings": 32}}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., tuple[Path, Path, Path]]:
    """Factory: (name, family, overrides) -> (reference checkpoint, converted GGUF dir, GGUF)."""
    cache: dict[str, tuple[Path, Path, Path]] = {}

    def make(name: str, family: str, overrides: dict[str, Any]) -> tuple[Path, Path, Path]:
        if name not in cache:
            root = tmp_path_factory.mktemp(name)
            gguf_file, reference = write_pair(family, "F32", root, **overrides)
            converted = root / "converted"
            converted.mkdir()
            convert_gguf(gguf_file, converted)
            cache[name] = (reference, converted, gguf_file)
        return cache[name]

    return make


def _bundle(ckpt: Path, out: Path, capacity: int = 256, max_input: int = 64) -> Path:
    out.mkdir(parents=True)
    build_bundle(ckpt, out, EngineBuildSpec(max_kv_cache_capacity=capacity, max_input_len=max_input))
    return out


def _check(bundle: Path, ref: Any, prompt: list[int], steps: int = 6) -> None:
    """Prefill and decode logits, then greedy tokens, of the bundle's engine against ``ref``."""
    engine = load_engine(bundle, max_slots=1, threads=1)
    try:
        want, cache = hf_step(ref, [prompt])
        logits = engine.prefill(0, prompt)
        np.testing.assert_allclose(logits, want[0, -1], atol=TOL, rtol=0)
        for i in range(steps):
            token = int(np.argmax(logits))
            want, cache = hf_step(ref, [[token]], cache)
            logits = engine.decode([0], [token])[0]
            np.testing.assert_allclose(logits, want[0, -1], atol=TOL, rtol=0, err_msg=f"decode step {i}")
        expected, _ = hf_greedy(ref, prompt, GREEDY)
        assert len(set(expected)) > 3, "degenerate reference output: the test would prove little"
        assert generate(engine, prompt, GREEDY, eos_ids=()) == [expected]
    finally:
        engine.close()


@pytest.mark.parametrize("name, overrides", [("yarn", YARN), ("yarn-all-keys", YARN_ALL_KEYS)])
def test_qwen2_yarn_from_safetensors_and_gguf(
    pairs: Callable[..., tuple[Path, Path, Path]], tmp_path: Path, name: str, overrides: dict[str, Any]
) -> None:
    reference, converted, _ = pairs(name, "qwen2", overrides)
    rope = load_model_config(reference).rope
    assert rope.rope_type == "yarn" and rope.attention_factor != 1.0
    assert load_model_config(converted).rope == rope  # the GGUF's keys say the same rope
    ref = load_reference(reference)
    prompt = _prompt(40, 1)
    _check(_bundle(reference, tmp_path / "st"), ref, prompt)
    _check(_bundle(converted, tmp_path / "gguf"), ref, prompt)


def test_phi3_longrope_within_and_beyond_the_original_context(
    pairs: Callable[..., tuple[Path, Path, Path]], tmp_path: Path
) -> None:
    """The factors follow the bundle's context (llama.cpp's choice): short within the original 32
    positions, long past them; transformers picks by the sequence it reached, so the two agree
    for a bundle within the original context and for sequences past it."""
    reference, converted, _ = pairs("longrope", "phi3", _longrope_overrides())
    cfg = load_model_config(reference)
    assert cfg.rope.rope_type == "longrope" and cfg.rotary == cfg.head_dim // 2
    gguf_rope = load_model_config(converted).rope  # float32 tensors in the file
    for ours, theirs in ((gguf_rope.long_factor, cfg.rope.long_factor),
                         (gguf_rope.short_factor, cfg.rope.short_factor)):
        np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(theirs, np.float32))
    ref = load_reference(reference)
    short_prompt, long_prompt = _prompt(16, 2), _prompt(40, 3)
    within = _bundle(reference, tmp_path / "within", capacity=32, max_input=16)
    _check(within, ref, short_prompt, steps=4)  # stays within 32 positions: short factors
    for ckpt, where in ((reference, "st"), (converted, "gguf")):
        beyond = _bundle(ckpt, tmp_path / where)  # 256 > 32: long factors
        _check(beyond, ref, long_prompt)
    # The documented difference: a short sequence in the long bundle is rotated with the long
    # factors, transformers uses the short ones for it.
    engine = load_engine(tmp_path / "st", max_slots=1, threads=1)
    try:
        got = engine.prefill(0, short_prompt)
    finally:
        engine.close()
    assert not np.allclose(got, hf_step(ref, [short_prompt])[0][0, -1], atol=1e-3)


def test_llama3_gguf_rope_freqs_is_greedy_equal_to_transformers(
    pairs: Callable[..., tuple[Path, Path, Path]], tmp_path: Path
) -> None:
    """llama.cpp writes a llama3 rope as the ``rope_freqs`` divisors: the GGUF's bundle uses them."""
    import gguf

    reference, converted, gguf_file = pairs("llama3", "llama", {})
    assert "rope_freqs.weight" in {t.name for t in gguf.GGUFReader(gguf_file).tensors}
    assert json.loads((converted / "config.json").read_text())["rope_scaling"]["rope_type"] == "factors"
    ref = load_reference(reference)
    assert ref.config.rope_parameters["rope_type"] == "llama3"
    _check(_bundle(converted, tmp_path / "gguf"), ref, _prompt(40, 4))


def test_dynamic_ntk_within_max_position_embeddings_and_refused_beyond(
    pairs: Callable[..., tuple[Path, Path, Path]], tmp_path: Path
) -> None:
    overrides = {"max_position_embeddings": 256,
                 "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}}
    reference, _, _ = pairs("dynamic", "qwen2", overrides)
    _check(_bundle(reference, tmp_path / "within"), load_reference(reference), _prompt(40, 5))
    out = tmp_path / "beyond"
    out.mkdir()
    with pytest.raises(BuildInputError, match=r"dynamic rope scaling .* max_kv_cache_capacity <= 256"):
        build_bundle(reference, out, EngineBuildSpec(max_kv_cache_capacity=512, max_input_len=64))
    assert not (out / "engine.json").exists()
