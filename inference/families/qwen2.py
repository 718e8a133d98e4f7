"""Qwen2 / Qwen2.5: the Llama layer with q/k/v biases (and optional sliding layers)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.families import Family


def sliding_layers(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen's ``use_sliding_window`` + ``max_window_layers`` when the config has no layer_types
    (transformers derives the same list: layers from ``max_window_layers`` on slide)."""
    if raw.get("layer_types") or not raw.get("use_sliding_window") or not raw.get("sliding_window"):
        return {}
    layers = int(raw["num_hidden_layers"])
    first = int(raw.get("max_window_layers", layers))
    types = tuple("sliding" if i >= first else "full" for i in range(layers))
    return {"layer_types": types if "sliding" in types else (), "sliding_window": int(raw["sliding_window"])}


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {"attention_bias": True, "o_bias": False, **sliding_layers(raw)}


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    return {"use_sliding_window": False}


FAMILY = Family(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    config_class="Qwen2Config",
    gguf_architectures=("qwen2",),
    features=features,
    gguf_config=gguf_config,
    parsers=("none", "hermes"),
    notes="q/k/v biases; sliding layers from use_sliding_window; YaRN rope",
)
