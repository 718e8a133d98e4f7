"""Qwen3: the Llama layer with a per-head RMSNorm on queries and keys and a free head_dim."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inference.families import Family
from inference.families.qwen2 import gguf_config, sliding_layers


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {"qk_norm": "head", **sliding_layers(raw)}


FAMILY = Family(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    config_class="Qwen3Config",
    tiny={"head_dim": 32},  # head_dim != hidden / heads
    gguf_architectures=("qwen3",),
    features=features,
    gguf_config=gguf_config,
    parsers=("qwen3", "hermes"),
    notes="q/k norms per head; head_dim independent of the width",
)
