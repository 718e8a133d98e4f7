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

from inference.families import Family, gguf_swa_layers, pattern_layer_types

#: Gemma 2/3's four norms per layer, by slot.
SANDWICH_NAMES = {
    "attn_post_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm",
    "mlp_post_norm": "post_feedforward_layernorm",
}
#: Sliding-window layers' rope base of Gemma 3 where a config does not say it (llama.cpp's too).
GEMMA3_LOCAL_THETA = 10000.0


def _common(raw: Mapping[str, Any], key: str, act: str) -> dict[str, Any]:
    """The features of every Gemma; ``act``: the activation as transformers reads it (from ``key``)."""
    from inference.builder.model_config import _ACTIVATION_NAMES
    from inference.errors import UnsupportedFeatureError

    if raw.get("use_bidirectional_attention"):
        raise UnsupportedFeatureError(
            "use_bidirectional_attention (an encoder) is not supported; only causal decoders are")
    if act not in _ACTIVATION_NAMES:
        raise UnsupportedFeatureError(
            f"unsupported {key} {act!r}; supported: {', '.join(sorted(_ACTIVATION_NAMES))}")
    bias = bool(raw.get("attention_bias", False))
    # The embedding scale is float32 sqrt(hidden), as transformers' fp32 run and llama.cpp take it
    # (transformers casts it to the weights' dtype: a bf16 run uses bf16(sqrt(hidden)), 55.5 for 3072).
    return {"norm_offset": 1.0, "embed_scale": float(raw["hidden_size"]) ** 0.5,
            "act": _ACTIVATION_NAMES[act], "attention_bias": bias, "o_bias": bias}


def gemma_features(raw: Mapping[str, Any]) -> dict[str, Any]:
    # transformers' GemmaConfig reads hidden_act only (hidden_activation is ignored) and takes the
    # released checkpoints' "gelu" for the tanh approximation it was meant as.
    act = raw.get("hidden_act") or "gelu_pytorch_tanh"
    return _common(raw, "hidden_act", "gelu_pytorch_tanh" if act == "gelu" else act)


def _sandwich(raw: Mapping[str, Any]) -> dict[str, Any]:
    # Gemma2Config/Gemma3TextConfig read hidden_activation only (hidden_act is ignored).
    act = raw.get("hidden_activation") or "gelu_pytorch_tanh"
    out = {**_common(raw, "hidden_activation", act), "post_attn_norm": True, "post_mlp_norm": True}
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
    return {"layer_types": pattern_layer_types(raw, pattern), "sliding_window": int(raw["sliding_window"])}


def gemma2_features(raw: Mapping[str, Any]) -> dict[str, Any]:
    out = {**_sandwich(raw), **_default_layers(raw, 2)}
    if raw.get("attn_logit_softcapping"):
        out["attn_softcap"] = float(raw["attn_logit_softcapping"])
    return out


def gemma3_features(raw: Mapping[str, Any]) -> dict[str, Any]:
    from inference.builder.model_config import RopeConfig, rope_from
    from inference.errors import UnsupportedFeatureError

    if raw.get("attn_logit_softcapping"):
        raise UnsupportedFeatureError(
            "gemma3 with attn_logit_softcapping is not a Gemma 3 checkpoint cachesvc knows; remove the "
            "field (Gemma 3 has no attention soft-capping)")
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


def gguf_layer_types(meta: Callable[[str, Any], Any], pattern: int) -> list[str]:
    """llama.cpp's sliding layers (``set_swa_pattern``, not dense-first): an integer
    ``attention.sliding_window_pattern`` where the file has one, else the architecture's ``pattern``;
    layer ``i`` slides when ``i % n < n - 1`` (n = 0: every layer); the array form of that key (a
    flag a layer) where the file has it."""
    listed = gguf_swa_layers(meta)  # newer converters write one flag a layer
    if listed is not None:
        return listed
    n = meta("attention.sliding_window_pattern", pattern)
    if not isinstance(n, int) or isinstance(n, bool):
        n = pattern
    return ["sliding_attention" if n == 0 or i % n < n - 1 else "full_attention"
            for i in range(int(meta("block_count", 0)))]


def gemma2_gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    return {"hidden_activation": "gelu_pytorch_tanh", **gguf_query_scalar(meta, 46),
            "attn_logit_softcapping": meta("attn_logit_softcapping", None),
            "final_logit_softcapping": meta("final_logit_softcapping", None),
            # llama.cpp's default window of Gemma 2 where the file has none
            "sliding_window": meta("attention.sliding_window", None) or 4096,
            # llama.cpp's pattern: even layers slide (transformers' default layer_types too)
            "layer_types": gguf_layer_types(meta, 2)}


def gemma3_gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    window = meta("attention.sliding_window", None)
    return {"hidden_activation": "gelu_pytorch_tanh", **gguf_query_scalar(meta, 62),
            "final_logit_softcapping": meta("final_logit_softcapping", None),
            # no window: llama.cpp attends fully in every layer
            "sliding_window": window, "layer_types": gguf_layer_types(meta, 6) if window else None,
            # the sliding layers' rope base (the converter writes rope.freq_base_swa), unscaled
            "rope_local_base_freq": float(meta("rope.freq_base_swa", None) or GEMMA3_LOCAL_THETA)}


GEMMA = Family(
    name="gemma",
    architectures=("GemmaForCausalLM",),
    model_types=("gemma",),
    config_class="GemmaConfig",
    tiny={"head_dim": 32},  # heads x head_dim (128) apart from hidden (64), as Gemma 7B's
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
    # sliding and full layers with a window shorter than the test prompts, a query scale apart from
    # head_dim, heads x head_dim apart from hidden, caps that bite (without them the
    # tiny logits move by 0.7 (attention cap) and 2.2 (final cap))
    tiny={"head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 8,
          "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, "initializer_range": 0.08},
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
    # six layers: transformers' and llama.cpp's pattern gives five sliding and one global; the
    # global rope linearly scaled (Gemma 3 4B-27B), the local one of another base than the default
    tiny={"head_dim": 32, "num_hidden_layers": 6, "query_pre_attn_scalar": 24, "sliding_window": 8,
          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}},
    gguf_architectures=("gemma3",),
    features=gemma3_features,
    gguf_config=gemma3_gguf_config,
    gguf_norm_offset=1.0,
    hf_names=SANDWICH_NAMES,
    tokenizer="sentencepiece",
    notes="Gemma 2's layer without attention soft-capping, per-head q/k norms (1 + w), the sliding "
          "layers' own rope (rope_parameters per layer type, or rope_local_base_freq; GGUF: "
          "rope.freq_base_swa)",
)
