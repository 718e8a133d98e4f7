"""Nemotron (NemotronForCausalLM): LayerNorm1p ((1 + w), with a bias), a plain ReLU² MLP and a
partial rotary embedding (half of each head by default)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.families import Family
from inference.families.stablelm import gguf_rotary_factor

#: transformers' NemotronConfig default when the config says nothing.
DEFAULT_PARTIAL_ROTARY = 0.5


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    from inference.builder.model_config import activation, rotary_dims  # (the builder imports the registry)
    head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // int(raw["num_attention_heads"]))
    rotary = rotary_dims(raw, head_dim, DEFAULT_PARTIAL_ROTARY)
    return {
        "norm": "layer", "norm_offset": 1.0, "norm_bias": True,
        "rms_norm_eps": float(raw.get("norm_eps", 1e-5)),
        "mlp": "plain", "act": activation(raw) if raw.get("hidden_act") else "relu2",
        "rotary_dim": 0 if rotary == head_dim else rotary,
    }


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    return {"norm_eps": float(meta("attention.layer_norm_epsilon", 1e-5)), "hidden_act": "relu2",
            "partial_rotary_factor": gguf_rotary_factor(meta),
            "attention_bias": "blk.0.attn_q.bias" in names, "mlp_bias": "blk.0.ffn_up.bias" in names}


FAMILY = Family(
    name="nemotron",
    architectures=("NemotronForCausalLM",),
    model_types=("nemotron",),
    config_class="NemotronConfig",
    # head_dim 32 = hidden / heads (llama.cpp's converter derives the rotary size from hidden / heads):
    # half rotates, 16 dimensions; an eps unlike the default.
    tiny={"hidden_size": 128, "head_dim": 32, "norm_eps": 1e-3, "hidden_act": "relu2",
          "partial_rotary_factor": 0.5},
    gguf_architectures=("nemotron",),
    features=features,
    gguf_config=gguf_config,
    gguf_norm_offset=1.0,
    tokenizer="sentencepiece",
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"),
    notes="LayerNorm1p (1 + w, with bias); plain relu2 MLP; partial rotary (partial_rotary_factor)",
)
