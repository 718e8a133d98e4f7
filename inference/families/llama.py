"""Llama (1, 2, 3.x) and the checkpoints that reuse its class (SmolLM2, TinyLlama, DeepSeek-R1 distills)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from inference.families import Family


def gguf_biases(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    """Llama-layout GGUF: the optional biases, as config.json says them."""
    return {"attention_bias": "blk.0.attn_q.bias" in names, "mlp_bias": "blk.0.ffn_up.bias" in names}


FAMILY = Family(
    name="llama",
    architectures=("LlamaForCausalLM",),
    model_types=("llama",),
    config_class="LlamaConfig",
    # llama3 rope with a short original context, so the scaling shows within a test's positions.
    tiny={"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 32}},
    gguf_architectures=("llama",),
    gguf_config=gguf_biases,
    gguf_permuted_qk=True,
    parsers=("none", "generic"),
    notes="rope default/linear/llama3 (from a GGUF: its rope_freqs divisors); optional attention and MLP "
          "biases",
)
