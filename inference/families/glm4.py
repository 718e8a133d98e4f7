"""GLM-4 (Glm4ForCausalLM, GLM-4-9B-0414 and its Z1 siblings): sandwich norms (RMSNorm before and
after both the attention and the MLP), q/k/v biases, one fused ``gate_up_proj``, and a partial
rotary of neighbouring pairs over half of each head."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.families import Family


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {"post_attn_norm": True, "post_mlp_norm": True, "fused_gate_up": True, "rope_interleaved": True,
            "o_bias": False}


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    return {"attention_bias": "blk.0.attn_q.bias" in names}


FAMILY = Family(
    name="glm4",
    architectures=("Glm4ForCausalLM",),
    model_types=("glm4",),
    config_class="Glm4Config",
    tiny={"attention_bias": True, "partial_rotary_factor": 0.5, "head_dim": 32, "pad_token_id": None,
          "eos_token_id": 2, "bos_token_id": 1},
    gguf_architectures=("glm4",),
    features=features,
    gguf_config=gguf_config,
    hf_names={"attn_post_norm": "post_self_attn_layernorm", "mlp_post_norm": "post_mlp_layernorm"},
    gguf_slots={"ffn_up": "gate_up"},
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"),
    notes="sandwich RMSNorms; q/k/v biases; fused gate_up_proj; partial rotary (partial_rotary_factor) "
          "of interleaved pairs",
)
