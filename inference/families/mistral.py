"""Mistral: the Llama layer with one sliding window over every layer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.families import Family
from inference.families.llama import gguf_biases


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    window = raw.get("sliding_window")
    if not window:
        return {}
    return {"sliding_window": int(window), "layer_types": ("sliding",) * int(raw["num_hidden_layers"])}


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    return {**gguf_biases(meta, names), "sliding_window": meta("attention.sliding_window", None)}


FAMILY = Family(
    name="mistral",
    architectures=("MistralForCausalLM",),
    model_types=("mistral",),
    config_class="MistralConfig",
    tiny={"sliding_window": 8},  # a window shorter than the test prompts
    gguf_architectures=("mistral",),
    features=features,
    gguf_config=gguf_config,
    gguf_permuted_qk=True,
    parsers=("none", "generic"),
    notes="sliding_window over every layer",
)
