"""Granite 3.x (GraniteForCausalLM): the Llama layer with four multipliers: the embedding output,
each block's output before the residual add, the query scale, and the logits (divided)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.families import Family
from inference.families.llama import gguf_biases


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "embed_scale": float(raw.get("embedding_multiplier", 1.0)),
        "residual_scale": float(raw.get("residual_multiplier", 1.0)),
        "attn_scale": float(raw.get("attention_multiplier", 1.0)),
        "logits_scale": 1.0 / float(raw.get("logits_scaling", 1.0)),
    }


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    """llama.cpp's ``*_scale`` keys are transformers' multipliers (``logit_scale``: the divisor)."""
    return {
        **gguf_biases(meta, names),
        "embedding_multiplier": float(meta("embedding_scale", 1.0)),
        "residual_multiplier": float(meta("residual_scale", 1.0)),
        "attention_multiplier": float(meta("attention.scale", 1.0)),
        "logits_scaling": float(meta("logit_scale", 1.0)),
    }


FAMILY = Family(
    name="granite",
    architectures=("GraniteForCausalLM",),
    model_types=("granite",),
    config_class="GraniteConfig",
    # Powers of two where Granite's own are (logits_scaling 8, 16), other values elsewhere.
    tiny={"embedding_multiplier": 3.0, "residual_multiplier": 0.5, "attention_multiplier": 0.1,
          "logits_scaling": 2.0},
    gguf_architectures=("granite",),
    features=features,
    gguf_config=gguf_config,
    gguf_permuted_qk=True,
    parsers=("none", "none"),  # its tool calls are <|tool_call|>[...]: no parser here
    notes="embedding, residual, attention (query scale) and logits multipliers",
)
