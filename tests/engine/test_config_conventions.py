"""Both config conventions seen in the wild give the same model; sharded checkpoints load."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inference.builder.model_config import load_model_config, model_config_from
from inference.runtime import load_engine


def test_top_level_rope_theta_and_scaling_match_rope_parameters(
    hf_checkpoint: Callable[..., Path],
    copy_dir: Callable[[Path], Path],
    built_bundle: Callable[..., Path],
    reference: Callable[[Path], Any],
    reference_step: Callable[..., Any],
) -> None:
    original = hf_checkpoint("llama", "fp32", True)
    ckpt = copy_dir(original)
    cfg = json.loads((ckpt / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    assert params["rope_type"] == "llama3"
    # The hub convention: rope_theta at the top level, scaling in rope_scaling with "rope_type".
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(ckpt).rope == load_model_config(original).rope
    # 40 tokens: past the 32 of the llama3 rope's original context
    _prefill_matches(ckpt, built_bundle, reference, reference_step, 11, size=40, reference_of=original)


def _prefill_matches(ckpt: Path, built_bundle: Callable[..., Path], reference: Callable[[Path], Any],
                     reference_step: Callable[..., Any], seed: int, *, size: int = 24,
                     reference_of: Path | None = None) -> None:
    """The bundle of ``ckpt`` prefills a random prompt to transformers' last logits (of
    ``reference_of``, by default ``ckpt`` itself)."""
    prompt = [int(t) for t in np.random.default_rng(seed).integers(0, 384, size=size)]
    engine = load_engine(built_bundle(ckpt), threads=1)
    want = reference_step(reference(reference_of or ckpt), [prompt])[0][0, -1]
    np.testing.assert_allclose(engine.prefill(0, prompt), want, atol=1e-4, rtol=0)


def test_gemma_hidden_act_gelu_is_the_tanh_approximation(
    hf_checkpoint: Callable[..., Path],
    copy_dir: Callable[[Path], Path],
    built_bundle: Callable[..., Path],
    reference: Callable[[Path], Any],
    reference_step: Callable[..., Any],
) -> None:
    """Gemma (1)'s released configs say ``hidden_act: "gelu"`` (and some a ``hidden_activation``
    transformers ignores): transformers runs the tanh approximation, so do we."""
    ckpt = copy_dir(hf_checkpoint("gemma", "fp32", True))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(hidden_act="gelu", hidden_activation="gelu")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(ckpt).act == "gelu_tanh"
    _prefill_matches(ckpt, built_bundle, reference, reference_step, 12)


def test_gemma3_hub_rope_fields_match_rope_parameters(
    hf_checkpoint: Callable[..., Path],
    copy_dir: Callable[[Path], Path],
    built_bundle: Callable[..., Path],
    reference: Callable[[Path], Any],
    reference_step: Callable[..., Any],
) -> None:
    """Gemma 3's hub convention: rope_theta and rope_scaling of the global layers at the top
    level, the local layers' base in rope_local_base_freq (transformers 5 writes rope_parameters
    per layer type)."""
    original = hf_checkpoint("gemma3_text", "fp32", True)
    ckpt = copy_dir(original)
    cfg = json.loads((ckpt / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    assert params["full_attention"]["rope_type"] == "linear"
    assert params["sliding_attention"]["rope_theta"] != params["full_attention"]["rope_theta"]
    cfg["rope_theta"] = params["full_attention"].pop("rope_theta")
    cfg["rope_scaling"] = params["full_attention"]
    cfg["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    ours, theirs = load_model_config(ckpt), load_model_config(original)
    assert (ours.rope, ours.rope_local) == (theirs.rope, theirs.rope_local)
    assert theirs.rope_local is not None and theirs.rope_local != theirs.rope
    _prefill_matches(ckpt, built_bundle, reference, reference_step, 13)


def test_sharded_checkpoint_with_index(
    tmp_path: Path,
    reference: Callable[[Path], Any],
    reference_step: Callable[..., Any],
    built_bundle: Callable[..., Path],
    hf_checkpoint: Callable[..., Path],
) -> None:
    source = hf_checkpoint("qwen2", "bf16", False)
    model = reference(source)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    engine = load_engine(built_bundle(sharded), threads=1)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    np.testing.assert_allclose(
        engine.prefill(0, prompt), reference_step(model, [prompt])[0][0, -1], atol=1e-4, rtol=0
    )


@pytest.mark.parametrize(("config_class", "extra"), [
    ("Gemma2Config", {}),
    ("Gemma3TextConfig", {}),
    ("Gemma3TextConfig", {"sliding_window_pattern": 3}),
])
def test_configs_without_layer_types_slide_as_transformers_derives(config_class: str,
                                                                   extra: dict[str, Any]) -> None:
    """Hub configs written before ``layer_types`` (Gemma 2, Gemma 3): the layers transformers
    makes sliding are ours too."""
    import transformers as tf

    raw = getattr(tf, config_class)(num_hidden_layers=7, sliding_window=8, head_dim=16, **extra).to_dict()
    expected = tuple("sliding" if t == "sliding_attention" else "full"
                     for t in getattr(tf, config_class)(**{k: v for k, v in raw.items() if k != "layer_types"}
                                                        ).layer_types)
    raw.pop("layer_types")
    arch = config_class.replace("TextConfig", "ForCausalLM").replace("Config", "ForCausalLM")
    raw["architectures"] = [arch]
    assert "full" in expected and "sliding" in expected
    assert model_config_from(raw).layer_types == expected
