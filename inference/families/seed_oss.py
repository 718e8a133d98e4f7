"""Seed-OSS (SeedOssForCausalLM, ByteDance Seed-OSS-36B): the Llama layer with its own switch for
the output projection's bias (``attention_out_bias``) apart from q/k/v's (``attention_bias``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.families import Family


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {"o_bias": bool(raw.get("attention_out_bias", False))}


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    return {"attention_bias": "blk.0.attn_q.bias" in names,
            "attention_out_bias": "blk.0.attn_output.bias" in names,
            "mlp_bias": "blk.0.ffn_up.bias" in names}


FAMILY = Family(
    name="seed_oss",
    architectures=("SeedOssForCausalLM",),
    model_types=("seed_oss",),
    config_class="SeedOssConfig",
    # q/k/v biases without the output's (the released checkpoints' combination)
    tiny={"attention_bias": True, "attention_out_bias": False, "head_dim": 16},
    gguf_architectures=("seed_oss",),
    features=features,
    gguf_config=gguf_config,
    notes="q/k/v biases (attention_bias) apart from the output projection's (attention_out_bias); GGUF: "
          "its pre-MLP norm is llama.cpp's post_attention_norm, Q/K not permuted",
)
