"""Variants of a family beyond its tiny case: switches its tiny checkpoint leaves off, checked
against transformers, and the variants the builder refuses with one line."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import transformers as tf

from inference.builder import EngineBuildSpec, build_bundle
from inference.errors import BuildInputError
from inference.families import family_by_name
from inference.runtime import load_engine
from tests.engine.conftest import COMMON, load_reference
from tests.engine.test_parity import PROMPT_LEN, _check_single, _meta, _prompt
from tests.support.tiny_models import random_model

TOL = 1e-4


def _checkpoint(family: str, out: Path, **overrides: Any) -> Path:
    """The family's tiny random checkpoint with ``overrides`` on its config, saved by transformers."""
    fam = family_by_name(family)
    kwargs = {**COMMON, **copy.deepcopy(dict(fam.tiny)), "tie_word_embeddings": False, **overrides}
    random_model(getattr(tf, fam.config_class)(**kwargs)).save_pretrained(out)
    return out


def _build(ckpt: Path, out: Path) -> Path:
    out.mkdir()
    build_bundle(ckpt, out, EngineBuildSpec(max_kv_cache_capacity=128, max_input_len=64))
    return out


#: (family, config overrides): switches that the family's tiny case leaves off.
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("stablelm", {"use_parallel_residual": True}),  # parallel_block
    ("stablelm", {"use_qkv_bias": False, "partial_rotary_factor": 0.5}),
    ("starcoder2", {"use_bias": False, "sliding_window": None}),
    ("nemotron", {"attention_bias": True, "mlp_bias": True}),
    # Gemma 4 without K/V sharing (every layer its own buffers, one MLP width), and without per-layer
    # inputs and keys-as-values (the global layers' own v_proj)
    ("gemma4_text", {"num_kv_shared_layers": 0, "use_double_wide_mlp": False}),
    ("gemma4_text", {"attention_k_eq_v": False, "hidden_size_per_layer_input": 0}),
]


@pytest.mark.parametrize(("family", "overrides"), VARIANTS, ids=[f"{f}-{'-'.join(o)}" for f, o in VARIANTS])
def test_variant_matches_transformers(family: str, overrides: dict[str, Any], tmp_path: Path,
                                      graph_runner: Any, reference_step: Callable[..., Any]) -> None:
    ckpt = _checkpoint(family, tmp_path / "ckpt", **overrides)
    bundle = _build(ckpt, tmp_path / "bundle")
    ref = load_reference(ckpt)
    runner = graph_runner(bundle / "model.onnx", _meta(bundle))
    _check_single(runner, ref, reference_step, _prompt(PROMPT_LEN, 7))
    engine = load_engine(bundle, max_slots=1, threads=1)
    try:
        prompt = _prompt(PROMPT_LEN, 8)
        want, _ = reference_step(ref, [prompt])
        np.testing.assert_allclose(engine.prefill(0, prompt), want[0, -1], atol=TOL, rtol=0)
    finally:
        engine.close()


#: (family, config overrides, the refusal's words): variants refused before any graph is written.
REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("stablelm", {"qk_layernorm": True}, "qk_layernorm"),
    # rotary 8 of head_dim 16: GroupQueryAttention's rotary span (4) is no multiple of 8
    ("nemotron", {"hidden_size": 64, "head_dim": 16}, "partial_rotary_factor 0.5 of head_dim 16"),
    ("nemotron", {"hidden_size": 160, "head_dim": 40, "partial_rotary_factor": 0.4}, "head_dim 40"),
    # an encoder (EmbeddingGemma-style): every Gemma config class has the switch
    ("gemma", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma2", {"hidden_activation": "relu"}, "hidden_activation 'relu'"),
    ("gemma4_text", {"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ("gemma4_text", {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                     "moe_intermediate_size": 32}, "enable_moe_block"),
    ("phi", {"qk_layernorm": True}, "qk_layernorm"),
]


@pytest.mark.parametrize(("family", "overrides", "words"), REFUSED, ids=[f"{f}-{w}" for f, _, w in REFUSED])
def test_unsupported_variant_is_refused_in_one_line(family: str, overrides: dict[str, Any], words: str,
                                                    tmp_path: Path) -> None:
    ckpt = _checkpoint(family, tmp_path / "ckpt", **overrides)
    with pytest.raises(BuildInputError, match=re.escape(words)) as err:
        _build(ckpt, tmp_path / "bundle")
    assert "\n" not in str(err.value)
    assert not any((tmp_path / "bundle").iterdir())


def test_olmo3_in_the_hub_convention_slides_at_transformers_default_base(
        tmp_path: Path, reference_step: Callable[..., Any]) -> None:
    """config.json with a top-level rope_theta (here 1e6, the hub's form): transformers' Olmo3Config
    gives it to the full layers and its default base (500000) to the sliding ones; so does the
    builder (before, the sliding layers took rope_theta too: logits off by 0.06-0.16)."""
    import json

    from inference.demo import write_demo_checkpoint

    ckpt = write_demo_checkpoint(tmp_path / "olmo3", arch="olmo3")
    config = json.loads((ckpt / "config.json").read_text())
    assert config["rope_theta"] == 1e6 and not config.get("rope_parameters")
    bundle = _build(ckpt, tmp_path / "bundle")
    engine = load_engine(bundle, max_slots=1, threads=1)
    try:
        prompt = _prompt(PROMPT_LEN, 9)
        want, _ = reference_step(load_reference(ckpt), [prompt])
        np.testing.assert_allclose(engine.prefill(0, prompt), want[0, -1], atol=TOL, rtol=0)
    finally:
        engine.close()
