"""Arcee (ArceeForCausalLM, AFM-4.5B): the Llama layer with a plain MLP, ``down(relu²(up(x)))``
(no gate projection)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.families import Family
from inference.families.llama import gguf_biases


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    from inference.builder.model_config import activation  # (the builder imports the registry)
    return {"mlp": "plain", "act": activation(raw) if raw.get("hidden_act") else "relu2"}


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    return {**gguf_biases(meta, names), "hidden_act": "relu2"}


FAMILY = Family(
    name="arcee",
    architectures=("ArceeForCausalLM",),
    model_types=("arcee",),
    config_class="ArceeConfig",
    tiny={"hidden_act": "relu2", "intermediate_size": 256},
    gguf_architectures=("arcee",),
    features=features,
    gguf_config=gguf_config,
    gguf_permuted_qk=True,
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"),
    notes="plain MLP (up -> relu² -> down, no gate); otherwise Llama's layer (rope scaling included)",
)
