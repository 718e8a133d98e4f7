"""Phi-1 / Phi-1.5 / Phi-2 (PhiForCausalLM): a parallel block (attention and MLP side by side on
one LayerNorm's output), LayerNorm with a bias, biases on every projection and on the lm_head, a
plain gelu MLP (fc1 -> fc2), a partial rotary embedding (half of each head in the released
models) and the final norm named ``final_layernorm``.

llama.cpp writes these as ``phi2`` files: a checkpoint in transformers' format converts to
separate ``attn_q/k/v`` tensors, the original Microsoft format (``Wqkv``) to one fused
``attn_qkv``; both are read. Its converter writes ``feed_forward_length`` as 4 x hidden (every
released Phi) and no ``head_count_kv`` of its own (Phi has no grouped-query attention).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.errors import UnsupportedFeatureError
from inference.families import DOCS_PAGE, Family
from inference.families.stablelm import gguf_rotary_factor

#: transformers' PhiConfig default when the config says nothing.
DEFAULT_PARTIAL_ROTARY = 0.5
#: config.json key a GGUF conversion sets where the file holds one fused ``attn_qkv`` tensor.
FUSED_QKV_KEY = "cachesvc_fused_qkv"


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    from inference.builder.model_config import activation, rotary_dims  # (the builder imports the registry)
    if raw.get("qk_layernorm"):
        raise UnsupportedFeatureError(
            "phi with qk_layernorm (a LayerNorm with its own weights per attention head) is not "
            f"supported yet (see {DOCS_PAGE})")
    # transformers' Phi takes head_dim where config.json has one, else hidden / heads.
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
    rotary = rotary_dims(raw, head_dim, DEFAULT_PARTIAL_ROTARY)
    return {
        "norm": "layer", "norm_bias": True, "rms_norm_eps": float(raw.get("layer_norm_eps", 1e-5)),
        "head_dim": head_dim, "rotary_dim": 0 if rotary == head_dim else rotary,
        "mlp": "plain", "act": activation(raw) if raw.get("hidden_act") else "gelu_tanh",
        "attention_bias": True, "o_bias": True, "mlp_bias": True, "lm_head_bias": True,
        "parallel_block": True, "pre_mlp_norm": False,
        "fused_qkv": bool(raw.get(FUSED_QKV_KEY, False)),
    }


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    return {
        "layer_norm_eps": float(meta("attention.layer_norm_epsilon", 1e-5)),
        "partial_rotary_factor": gguf_rotary_factor(meta),
        "hidden_act": "gelu_new",
        FUSED_QKV_KEY: "blk.0.attn_qkv.weight" in names,
    }


FAMILY = Family(
    name="phi",
    architectures=("PhiForCausalLM",),
    model_types=("phi",),
    config_class="PhiConfig",
    # head_dim 32 (hidden / heads) with half of it rotating (16 dims: GroupQueryAttention rotates a
    # partial span when half of it is a multiple of 8); an eps unlike the default; no GQA (Phi has
    # none); a gelu_new MLP; weights drawn wider than the common tiny shape's (with 0.2 the random
    # parallel blocks' greedy output is a token or two repeated).
    tiny={"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 32, "initializer_range": 0.3,
          "partial_rotary_factor": 0.5, "layer_norm_eps": 1e-3,
          "hidden_act": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0},
    gguf_architectures=("phi2",),
    features=features,
    gguf_config=gguf_config,
    hf_names={"o": "self_attn.dense", "up": "mlp.fc1", "down": "mlp.fc2"},
    hf_global_names={"final_norm": "model.final_layernorm"},
    lora_targets=("q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"),
    notes="parallel block; LayerNorm with bias; biases on every projection and the lm_head; plain "
          "gelu_new MLP (fc1, fc2); partial rotary; GGUF `phi2` with separate or fused q/k/v; "
          "qk_layernorm refused",
)
