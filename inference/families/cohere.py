"""Command R (CohereForCausalLM) and Command R7B (Cohere2ForCausalLM): a parallel block (attention
and MLP side by side on one LayerNorm without a bias), rotary pairs of neighbouring dimensions,
logits scaled by ``logit_scale``; Command R7B adds sliding layers (three of four by default) with
rope and global layers without (NoPE)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.errors import UnsupportedFeatureError
from inference.families import Family, gguf_sliding, pattern_layer_types


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    if raw.get("use_qk_norm"):
        raise UnsupportedFeatureError(
            "cohere with use_qk_norm (Command R+: a LayerNorm with its own weights per attention head) is "
            "not supported yet")
    return {"norm": "layer", "norm_bias": False, "rms_norm_eps": float(raw.get("layer_norm_eps", 1e-5)),
            "parallel_block": True, "pre_mlp_norm": False, "rope_interleaved": True,
            "logits_scale": float(raw.get("logit_scale") or 1.0),
            "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True))}


def cohere2_features(raw: Mapping[str, Any]) -> dict[str, Any]:
    types = pattern_layer_types(raw, raw.get("sliding_window_pattern", 4))
    window = raw.get("sliding_window")
    return {**features(raw), "layer_types": types, "sliding_window": int(window) if window else None,
            # transformers rotates in the sliding layers only: the global ones are NoPE
            "nope_layers": tuple(i for i, t in enumerate(types) if t == "full")}


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    return {"layer_norm_eps": float(meta("attention.layer_norm_epsilon", 1e-5)),
            "logit_scale": float(meta("logit_scale", 1.0)),
            "attention_bias": "blk.0.attn_q.bias" in names}


def cohere2_gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    return {**gguf_config(meta, names), **gguf_sliding(meta)}


COHERE = Family(
    name="cohere",
    architectures=("CohereForCausalLM",),
    model_types=("cohere",),
    config_class="CohereConfig",
    tiny={"logit_scale": 0.5, "layer_norm_eps": 1e-3, "bos_token_id": 1, "eos_token_id": 2},
    gguf_architectures=("command-r",),
    features=features,
    gguf_config=gguf_config,
    notes="parallel block on one LayerNorm without bias; interleaved rotary pairs; logit_scale; "
          "use_qk_norm (Command R+) refused",
)
COHERE2 = Family(
    name="cohere2",
    architectures=("Cohere2ForCausalLM",),
    model_types=("cohere2",),
    config_class="Cohere2Config",
    # three sliding layers with rope (a window shorter than the test prompts), a global NoPE one
    tiny={"logit_scale": 0.5, "layer_norm_eps": 1e-3, "bos_token_id": 1, "eos_token_id": 2,
          "num_hidden_layers": 4, "sliding_window": 8, "sliding_window_pattern": 4},
    gguf_architectures=("cohere2",),
    features=cohere2_features,
    gguf_config=cohere2_gguf_config,
    notes="Command R's layer with sliding layers (rope) and global NoPE layers",
)
