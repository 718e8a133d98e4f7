"""Ministral (MinistralForCausalLM, Ministral-8B-2410): the Mistral layer with sliding and full
layers interleaved (``layer_types``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.families import Family
from inference.families.llama import gguf_biases


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    window = raw.get("sliding_window")
    if raw.get("layer_types") or not window:
        return {}  # layer_types are read for every family
    # transformers' default without layer_types: every layer slides.
    return {"sliding_window": int(window), "layer_types": ("sliding",) * int(raw["num_hidden_layers"])}


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    return gguf_biases(meta, names)


FAMILY = Family(
    name="ministral",
    architectures=("MinistralForCausalLM",),
    model_types=("ministral",),
    config_class="MinistralConfig",
    # One sliding and one full layer, the window shorter than the test prompts (MinistralConfig has
    # no head_dim default).
    tiny={"head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    gguf_architectures=(),
    features=features,
    gguf_config=gguf_config,
    gguf_permuted_qk=True,
    parsers=("none", "generic"),  # its template: [TOOL_CALLS][{...}]
    notes="layer_types sliding/full; no GGUF (llama.cpp's converter has no MinistralForCausalLM: its "
          "Ministral GGUFs are 'llama' files, full attention everywhere)",
)
