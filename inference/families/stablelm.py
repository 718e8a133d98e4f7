"""StableLM 2 (StableLmForCausalLM): LayerNorm with a bias, a partial rotary embedding (a quarter of
each head by default), optional q/k/v biases and an optional parallel residual block."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.errors import UnsupportedFeatureError
from inference.families import DOCS_PAGE, Family

#: transformers' StableLmConfig default when the config says nothing.
DEFAULT_PARTIAL_ROTARY = 0.25


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    from inference.builder.model_config import rotary_dims  # (the builder imports the registry)
    if raw.get("qk_layernorm"):
        raise UnsupportedFeatureError(
            "stablelm with qk_layernorm (a LayerNorm with its own weights per attention head) is not "
            f"supported yet (see {DOCS_PAGE})")
    # transformers' StableLM ignores head_dim: every head is hidden_size / num_attention_heads wide.
    head_dim = int(raw["hidden_size"]) // int(raw["num_attention_heads"])
    rotary = rotary_dims(raw, head_dim, DEFAULT_PARTIAL_ROTARY)
    parallel = bool(raw.get("use_parallel_residual", False))
    return {
        "norm": "layer", "norm_bias": True, "rms_norm_eps": float(raw.get("layer_norm_eps", 1e-5)),
        "head_dim": head_dim, "rotary_dim": 0 if rotary == head_dim else rotary,
        "attention_bias": bool(raw.get("use_qkv_bias", False)), "o_bias": False, "mlp_bias": False,
        "parallel_block": parallel, "pre_mlp_norm": not parallel,
    }


def gguf_rotary_factor(meta: Callable[[str, Any], Any]) -> float:
    """``rope.dimension_count`` as a fraction of the head (llama.cpp stores the rotated dims)."""
    head_dim = meta("attention.key_length", None) or (
        meta("embedding_length", 1) // meta("attention.head_count", 1))
    dims = meta("rope.dimension_count", None)
    return 1.0 if not dims else float(dims) / float(head_dim)


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    return {
        "layer_norm_eps": float(meta("attention.layer_norm_epsilon", 1e-5)),
        "partial_rotary_factor": gguf_rotary_factor(meta),
        "use_qkv_bias": "blk.0.attn_q.bias" in names,
        # llama.cpp's StableLM has no ffn_norm in a parallel block (its use_parallel_residual key).
        "use_parallel_residual": "blk.0.ffn_norm.weight" not in names,
        "qk_layernorm": "blk.0.attn_q_norm.weight" in names,
    }


FAMILY = Family(
    name="stablelm",
    architectures=("StableLmForCausalLM",),
    model_types=("stablelm",),
    config_class="StableLmConfig",
    # head_dim 64 (hidden / heads): a quarter rotates, 16 dimensions (GroupQueryAttention rotates a
    # partial span when half of it is a multiple of 8); q/k/v biases; an eps unlike the default;
    # a wider MLP than the common tiny shape (with 128 the random model's greedy output is degenerate).
    tiny={"hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
          "intermediate_size": 256,
          "use_qkv_bias": True, "layer_norm_eps": 1e-3},
    gguf_architectures=("stablelm",),
    features=features,
    gguf_config=gguf_config,
    notes="LayerNorm with bias; partial rotary (partial_rotary_factor); optional q/k/v biases and "
          "use_parallel_residual; qk_layernorm refused",
)
