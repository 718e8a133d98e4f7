"""Qwen2-MoE (Qwen1.5-MoE): the Qwen2 layer with a mixture of experts and a sigmoid-gated shared
expert; ``mlp_only_layers`` / ``decoder_sparse_step`` keep some layers dense."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.families import ATTENTION_LORA_TARGETS, Family, moe_size
from inference.families.qwen2 import sliding_layers


def qwen_moe(raw: Mapping[str, Any], *, shared: bool) -> dict[str, Any]:
    """The ``moe`` feature of a Qwen MoE config (None when it has no experts)."""
    experts = raw.get("num_experts", raw.get("num_local_experts"))
    if not experts:
        return {"moe": None}
    layers = int(raw["num_hidden_layers"])
    dense = set(raw.get("mlp_only_layers") or ())
    step = moe_size(raw, "decoder_sparse_step", 1)
    sparse = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    shared_size = int(raw.get("shared_expert_intermediate_size") or 0) if shared else 0
    return {"moe": dict(
        num_experts=moe_size({"num_experts": experts}, "num_experts"),
        top_k=moe_size(raw, "num_experts_per_tok"), expert_size=moe_size(raw, "moe_intermediate_size"),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)), shared_size=shared_size,
        shared_gate=shared_size > 0, sparse_layers=sparse)}


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {"attention_bias": bool(raw.get("qkv_bias", True)), "o_bias": False, **sliding_layers(raw),
            **qwen_moe(raw, shared=True)}


def gguf_moe(meta: Callable[[str, Any], Any]) -> dict[str, Any]:
    """The expert keys llama.cpp's converter writes for the Qwen MoE families (every layer sparse)."""
    return {"use_sliding_window": False, "num_experts": meta("expert_count", None),
            "num_experts_per_tok": meta("expert_used_count", None),
            "moe_intermediate_size": meta("expert_feed_forward_length", None),
            "mlp_only_layers": [], "decoder_sparse_step": 1}


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    # llama.cpp's qwen2moe: no renormalisation of the top-k weights; the shared expert is the
    # feed-forward length wide when its own length is not written.
    shared = "blk.0.ffn_gate_inp_shexp.weight" in names
    size = meta("expert_shared_feed_forward_length", None) or meta("feed_forward_length", None)
    return {**gguf_moe(meta), "qkv_bias": "blk.0.attn_q.bias" in names, "norm_topk_prob": False,
            "shared_expert_intermediate_size": size if shared else 0}


FAMILY = Family(
    name="qwen2_moe",
    architectures=("Qwen2MoeForCausalLM",),
    model_types=("qwen2_moe",),
    config_class="Qwen2MoeConfig",
    tiny={"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
          "shared_expert_intermediate_size": 64, "mlp_only_layers": [1]},
    gguf_architectures=("qwen2moe",),
    features=features,
    gguf_config=gguf_config,
    parsers=("none", "hermes"),
    lora_targets=ATTENTION_LORA_TARGETS,
    notes="q/k/v biases; mixture of experts with a sigmoid-gated shared expert (experts 4-bit in int4, "
          "fp32 in int8 builds); dense layers from mlp_only_layers / decoder_sparse_step",
)
