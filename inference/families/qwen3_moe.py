"""Qwen3-MoE: the Qwen3 layer (per-head q/k norms) with a mixture of experts."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.families import ATTENTION_LORA_TARGETS, Family
from inference.families.qwen2 import sliding_layers
from inference.families.qwen2_moe import gguf_moe, qwen_moe


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {"qk_norm": "head", **sliding_layers(raw), **qwen_moe(raw, shared=False)}


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    # llama.cpp's qwen3moe always renormalises the top-k weights.
    return {**gguf_moe(meta), "norm_topk_prob": True}


FAMILY = Family(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    config_class="Qwen3MoeConfig",
    tiny={"head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "norm_topk_prob": True, "mlp_only_layers": [0]},
    gguf_architectures=("qwen3moe",),
    features=features,
    gguf_config=gguf_config,
    parsers=("qwen3", "hermes"),
    lora_targets=ATTENTION_LORA_TARGETS,
    notes="q/k norms per head; mixture of experts, norm_topk_prob (experts 4-bit in int4, fp32 in int8 "
          "builds); dense layers from mlp_only_layers / decoder_sparse_step",
)
