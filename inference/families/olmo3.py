"""OLMo 3 (Olmo3ForCausalLM): OLMo 2's layer (post-norms, q/k norms over the full projection) with
sliding-window layers, three of every four by default, whose rope is never scaled: a YaRN or other
scaling applies to the full-attention layers only."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.families import Family, gguf_sliding, pattern_layer_types
from inference.families.olmo2 import features as olmo2_features
from inference.families.olmo2 import gguf_config as olmo2_gguf_config


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    from inference.builder.model_config import RopeConfig, rope_from  # (the builder imports the registry)

    out: dict[str, Any] = {**olmo2_features(raw), "layer_types": pattern_layer_types(raw, 4)}
    window = raw.get("sliding_window")
    out["sliding_window"] = int(window) if window else None
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        out["rope"] = rope_from(raw, "full_attention")
        out["rope_local"] = rope_from(raw, "sliding_attention")
    else:
        # The hub's convention: rope_theta and rope_scaling are the full layers'. transformers'
        # Olmo3Config gives the sliding layers its default base then (rope_theta is taken by the
        # full layers first): 500000, what the released checkpoints' rope_theta is anyway. A
        # GGUF's sliding base is llama.cpp's (rope_local_base_freq, from gguf_config).
        out["rope_local"] = RopeConfig(theta=float(raw.get("rope_local_base_freq") or OLMO3_DEFAULT_THETA))
    return out


#: transformers' Olmo3Config.default_theta.
OLMO3_DEFAULT_THETA = 500000.0


def is_olmo3_gguf(meta: Callable[[str, Any], Any]) -> bool:
    """llama.cpp writes OLMo 3 as an "olmo2" file with a sliding window."""
    return bool(meta("attention.sliding_window", None))


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    # Without a list of flags: llama.cpp's default, as transformers', every fourth layer full.
    # llama.cpp rotates the sliding layers with rope.freq_base_swa where the file has it, else
    # with rope.freq_base.
    base = meta("rope.freq_base_swa", None) or meta("rope.freq_base", None) or OLMO3_DEFAULT_THETA
    return {**olmo2_gguf_config(meta, names), **gguf_sliding(meta), "rope_local_base_freq": float(base)}


FAMILY = Family(
    name="olmo3",
    architectures=("Olmo3ForCausalLM",),
    model_types=("olmo3",),
    config_class="Olmo3Config",
    # A window shorter than the test prompts; the full layers' rope yarn-scaled, the sliding
    # layers' not (transformers' per-layer-type rope_parameters).
    tiny={"num_hidden_layers": 4, "sliding_window": 8, "rms_norm_eps": 1e-3,
          "rope_parameters": {
              "full_attention": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 32},
              "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    gguf_architectures=("olmo2",),
    gguf_match=is_olmo3_gguf,
    features=features,
    gguf_config=gguf_config,
    notes="OLMo 2's layer with sliding layers (layer_types; three of four by default) whose rope is "
          "never scaled; GGUF: llama.cpp's olmo2 with a sliding window",
)
