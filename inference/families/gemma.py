"""Gemma (1), Gemma 2 and Gemma 3 (text): RMSNorm times ``(1 + w)``, the embedding scaled by
sqrt(hidden), GELU-tanh; Gemma 2/3 add sandwich norms, the query scale of
``query_pre_attn_scalar``, sliding and full layers; Gemma 2 soft-caps attention scores and logits;
Gemma 3 adds per-head q/k norms (also ``1 + w``) and its sliding layers' own rope.

llama.cpp's converter stores every norm weight as ``w + 1`` and does not permute Q/K; it does not
write the query scale: llama.cpp takes the head size, or hidden / heads for the 27B shapes
(Gemma 2 27B: 46 layers, Gemma 3 27B: 62), and so does :func:`gguf_query_scalar`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.families import Family

#: Gemma 2/3's four norms per layer, by slot.
SANDWICH_NAMES = {
    "attn_post_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm",
    "mlp_post_norm": "post_feedforward_layernorm",
}
#: Sliding-window layers' rope base of Gemma 3 where a config does not say it (llama.cpp's too).
GEMMA3_LOCAL_THETA = 10000.0


def _common(raw: Mapping[str, Any]) -> dict[str, Any]:
    from inference.builder.model_config import activation

    bias = bool(raw.get("attention_bias", False))
    return {"norm_offset": 1.0, "embed_scale": float(raw["hidden_size"]) ** 0.5,
            "act": activation(raw, "hidden_activation"), "attention_bias": bias, "o_bias": bias}


def gemma_features(raw: Mapping[str, Any]) -> dict[str, Any]:
    return _common(raw)


def _sandwich(raw: Mapping[str, Any]) -> dict[str, Any]:
    out = {**_common(raw), "post_attn_norm": True, "post_mlp_norm": True}
    scalar = raw.get("query_pre_attn_scalar")
    if scalar:
        out["attn_scale"] = float(scalar) ** -0.5
    if raw.get("final_logit_softcapping"):
        out["final_softcap"] = float(raw["final_logit_softcapping"])
    return out


def _default_layers(raw: Mapping[str, Any], pattern: int) -> dict[str, Any]:
    """transformers' layer_types where config.json has none (hub configs written before it):
    every ``pattern``-th layer global, the others sliding (Gemma 2: 2, Gemma 3:
    ``sliding_window_pattern``, 6)."""
    if raw.get("layer_types") or not raw.get("sliding_window"):
        return {}
    layers = int(raw["num_hidden_layers"])
    types = tuple("sliding" if (i + 1) % pattern else "full" for i in range(layers))
    return {"layer_types": types, "sliding_window": int(raw["sliding_window"])}


def gemma2_features(raw: Mapping[str, Any]) -> dict[str, Any]:
    out = {**_sandwich(raw), **_default_layers(raw, 2)}
    if raw.get("attn_logit_softcapping"):
        out["attn_softcap"] = float(raw["attn_logit_softcapping"])
    return out


def gemma3_features(raw: Mapping[str, Any]) -> dict[str, Any]:
    from inference.builder.model_config import RopeConfig, rope_from
    from inference.errors import BuildInputError

    if raw.get("attn_logit_softcapping"):
        raise BuildInputError("gemma3 with attn_logit_softcapping is not a Gemma 3 checkpoint cachesvc "
                              "knows; remove the field (Gemma 3 has no attention soft-capping)")
    if raw.get("use_bidirectional_attention"):
        raise BuildInputError("use_bidirectional_attention (an encoder) is not supported; only causal "
                              "decoders are")
    out = {**_sandwich(raw), **_default_layers(raw, int(raw.get("sliding_window_pattern") or 6)),
           "qk_norm": "head"}
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        out["rope"] = rope_from(raw, "full_attention")
        out["rope_local"] = rope_from(raw, "sliding_attention")
    else:  # the hub's convention: rope_theta (+ rope_scaling) global, rope_local_base_freq local
        out["rope_local"] = RopeConfig(theta=float(raw.get("rope_local_base_freq") or GEMMA3_LOCAL_THETA))
    return out


def gguf_query_scalar(meta: Callable[[str, Any], Any], layers_27b: int) -> dict[str, Any]:
    heads, hidden = meta("attention.head_count", 1), meta("embedding_length", 1)
    head_dim = meta("attention.key_length", None) or hidden // heads
    return {"query_pre_attn_scalar": hidden // heads if meta("block_count", 0) == layers_27b else head_dim}


def gemma_gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    return {"hidden_act": "gelu_pytorch_tanh"}


def gemma2_gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    layers = int(meta("block_count", 0))
    return {"hidden_activation": "gelu_pytorch_tanh", **gguf_query_scalar(meta, 46),
            "attn_logit_softcapping": meta("attn_logit_softcapping", None),
            "final_logit_softcapping": meta("final_logit_softcapping", None),
            "sliding_window": meta("attention.sliding_window", None),
            # llama.cpp's pattern: even layers slide (transformers' default layer_types too)
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]}


def gemma3_gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    layers = int(meta("block_count", 0))
    window = meta("attention.sliding_window", None)
    return {"hidden_activation": "gelu_pytorch_tanh", **gguf_query_scalar(meta, 62),
            "final_logit_softcapping": meta("final_logit_softcapping", None),
            "sliding_window": window, "rope_local_base_freq": GEMMA3_LOCAL_THETA,
            # llama.cpp's (and transformers' default) pattern: every sixth layer is global
            "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
            if window else None}


GEMMA = Family(
    name="gemma",
    architectures=("GemmaForCausalLM",),
    model_types=("gemma",),
    config_class="GemmaConfig",
    tiny={"head_dim": 16},
    gguf_architectures=("gemma",),
    features=gemma_features,
    gguf_config=gemma_gguf_config,
    gguf_norm_offset=1.0,
    tokenizer="sentencepiece",
    notes="RMSNorm (1 + w); embedding x sqrt(hidden); GELU-tanh",
)
GEMMA2 = Family(
    name="gemma2",
    architectures=("Gemma2ForCausalLM",),
    model_types=("gemma2",),
    config_class="Gemma2Config",
    # a window shorter than the test prompts, a query scale apart from head_dim, caps that bite
    tiny={"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 8,
          "attn_logit_softcapping": 20.0, "final_logit_softcapping": 10.0, "initializer_range": 0.1},
    gguf_architectures=("gemma2",),
    features=gemma2_features,
    gguf_config=gemma2_gguf_config,
    gguf_norm_offset=1.0,
    hf_names=SANDWICH_NAMES,
    tokenizer="sentencepiece",
    notes="Gemma + sandwich norms, query_pre_attn_scalar, attention and logit soft-capping, "
          "sliding/full layers",
)
GEMMA3 = Family(
    name="gemma3_text",
    architectures=("Gemma3ForCausalLM",),
    model_types=("gemma3_text",),
    config_class="Gemma3TextConfig",
    # six layers: transformers' and llama.cpp's pattern gives five sliding and one global
    tiny={"head_dim": 32, "num_hidden_layers": 6, "query_pre_attn_scalar": 24, "sliding_window": 8},
    gguf_architectures=("gemma3",),
    features=gemma3_features,
    gguf_config=gemma3_gguf_config,
    gguf_norm_offset=1.0,
    hf_names=SANDWICH_NAMES,
    tokenizer="sentencepiece",
    notes="Gemma 2's layer without soft-capping, per-head q/k norms (1 + w), the sliding layers' own "
          "rope (rope_local_base_freq)",
)
