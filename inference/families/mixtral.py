"""Mixtral: the Mistral layer with a sparse mixture of experts for every MLP (softmax top-k routing,
the chosen experts' weights renormalised)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.families import ATTENTION_LORA_TARGETS, Family, mistral, moe_size


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    moe = dict(num_experts=moe_size(raw, "num_local_experts"), top_k=moe_size(raw, "num_experts_per_tok"),
                    expert_size=moe_size(raw, "intermediate_size"), norm_topk_prob=True,
                    sparse_layers=tuple(range(layers)))
    return {**mistral.features(raw), "moe": moe}


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    # llama.cpp's converter writes Mixtral as "llama" with the expert counts; its experts are
    # the feed-forward length wide.
    return {**mistral.gguf_config(meta, names), "num_local_experts": meta("expert_count", None),
            "num_experts_per_tok": meta("expert_used_count", None)}


def is_mixtral_gguf(meta: Callable[[str, Any], Any]) -> bool:
    """A "llama" GGUF with experts is Mixtral."""
    return bool(meta("expert_count", 0))


FAMILY = Family(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    config_class="MixtralConfig",
    tiny={"num_local_experts": 4, "num_experts_per_tok": 2},
    gguf_architectures=("llama",),
    gguf_match=is_mixtral_gguf,
    features=features,
    gguf_config=gguf_config,
    gguf_permuted_qk=True,
    hf_names={"router": "block_sparse_moe.gate", "expert_gate": "block_sparse_moe.experts.{e}.w1",
              "expert_up": "block_sparse_moe.experts.{e}.w3",
              "expert_down": "block_sparse_moe.experts.{e}.w2"},
    parsers=("none", "generic"),
    lora_targets=ATTENTION_LORA_TARGETS,
    notes="mixture of experts in every layer (onnxruntime's MoE op; experts 4-bit QMoE in int4 builds, "
          "fp32 in int8); GGUF: a \"llama\" file with expert_count",
)
