"""Every registered model family from a GGUF in llama.cpp's layout: greedy-equal to transformers
at fp32, and its int4 / int8 bundles (from the file's own Q4_0 / Q8_0 blocks) pass the quality
gate on this CPU (issue 31). The families come from the registry: a new one is tested here by
itself once tests/gguf/ggufs.py knows what llama.cpp writes for it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from inference.builder.gguf_convert import convert_gguf
from inference.cpu_class import cpu_class
from inference.runtime import generate, load_engine
from tests.engine.conftest import hf_greedy, load_reference
from tests.gguf.ggufs import FAMILIES

SmallGguf = Callable[[str, str], tuple[Path, Path]]
GREEDY = 16


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [[int(t) for t in rng.integers(0, 384, size=n)] for n in (16, 9)]


def _converted(small_gguf: SmallGguf, family: str, qtype: str,
               factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    path, reference = small_gguf(family, qtype)
    converted = factory.mktemp(f"converted-{family}-{qtype}")
    convert_gguf(path, converted)
    return converted, reference


@pytest.mark.parametrize("family", FAMILIES)
def test_a_gguf_answers_like_transformers(small_gguf: SmallGguf, bundle_of: Callable[..., Path], family: str,
                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    converted, reference = _converted(small_gguf, family, "F32", tmp_path_factory)
    model = load_reference(reference)
    engine = load_engine(bundle_of(converted), threads=1)
    try:
        seen: set[int] = set()
        for prompt in _prompts():
            want, want_logits = hf_greedy(model, prompt, GREEDY)
            seen.update(want)
            assert generate(engine, prompt, GREEDY, eos_ids=()) == [want]
            engine.reset(0)
            np.testing.assert_allclose(engine.prefill(0, prompt), want_logits[0], atol=1e-4, rtol=0)
            engine.reset(0)
        assert len(seen) > 3, "the reference outputs are degenerate; the test would prove little"
    finally:
        engine.close()


@pytest.mark.parametrize(("qtype", "precision"), [("Q4_0", "int4"), ("Q8_0", "int8")])
@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_bundles_pass_the_gate(small_gguf: SmallGguf, bundle_of: Callable[..., Path], family: str,
                                         qtype: str, precision: str,
                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    converted, _ = _converted(small_gguf, family, qtype, tmp_path_factory)
    bundle = bundle_of(converted, precision=precision)  # a gate failure raises QualityGateError
    meta = json.loads((bundle / "engine.json").read_text())
    quality = meta["quality"]
    print(f"{family} {precision} from {qtype} on {cpu_class()}: plan {meta['kernels']['name']}, "
          f"agreement {quality['greedy_agreement']}")
    assert meta["precision"] == precision and quality["greedy_agreement"] >= 0.9


def test_a_phi2_file_with_one_fused_qkv_answers_like_transformers(
        bundle_of: Callable[..., Path], tmp_path: Path) -> None:
    """llama.cpp writes Phi-2's original checkpoints (``Wqkv``) with one ``attn_qkv`` tensor
    (weight and bias) a layer: read as the fused projection, the answers are transformers'."""
    from inference.builder.gguf_reader import read_gguf_header
    from tests.gguf.ggufs import write_pair

    path, reference = write_pair("phi", "F32", tmp_path / "fused", fuse_qkv=True)
    names = {t.name for t in read_gguf_header(path).tensors}
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_qkv.bias"} <= names and "blk.0.attn_q.weight" not in names
    converted = tmp_path / "converted"
    converted.mkdir()
    convert_gguf(path, converted)
    assert json.loads((converted / "config.json").read_text())["cachesvc_fused_qkv"] is True
    model = load_reference(reference)
    engine = load_engine(bundle_of(converted), threads=1)
    try:
        for prompt in _prompts():
            want, _ = hf_greedy(model, prompt, GREEDY)
            assert generate(engine, prompt, GREEDY, eos_ids=()) == [want]
            engine.reset(0)
    finally:
        engine.close()


def test_gemma_gguf_window_rules_are_llama_cpps() -> None:
    """What llama.cpp assumes where a Gemma 2/3 GGUF is silent: Gemma 2's window 4096, every
    second layer sliding; Gemma 3 without a window attends fully, with one slides five of six
    layers; an integer ``attention.sliding_window_pattern`` (n: layers i % n < n - 1 slide, 0:
    all) overrides both; Gemma 3's local rope base is rope.freq_base_swa, 10000 without it."""
    from inference.families.gemma import gemma2_gguf_config, gemma3_gguf_config

    def meta_of(**values: object) -> Callable[[str, object], object]:
        return lambda key, default: values.get(key.replace(".", "_"), default)

    s, f = "sliding_attention", "full_attention"
    g2 = gemma2_gguf_config(meta_of(block_count=4), frozenset())
    assert (g2["sliding_window"], g2["layer_types"]) == (4096, [s, f, s, f])
    g2 = gemma2_gguf_config(meta_of(block_count=4, attention_sliding_window_pattern=3), frozenset())
    assert g2["layer_types"] == [s, s, f, s]
    g3 = gemma3_gguf_config(meta_of(block_count=7), frozenset())
    assert (g3["sliding_window"], g3["layer_types"], g3["rope_local_base_freq"]) == (None, None, 10000.0)
    g3 = gemma3_gguf_config(meta_of(block_count=7, attention_sliding_window=512, rope_freq_base_swa=500.0),
                            frozenset())
    assert (g3["layer_types"], g3["rope_local_base_freq"]) == ([s] * 5 + [f, s], 500.0)
    g3 = gemma3_gguf_config(meta_of(block_count=3, attention_sliding_window=512,
                                    attention_sliding_window_pattern=0), frozenset())
    assert g3["layer_types"] == [s, s, s]
