"""Phi-3 / Phi-3.5 / Phi-4-mini (Phi3ForCausalLM): the Llama layer with one fused ``qkv_proj`` and
one fused ``gate_up_proj``, partial rotary (Phi-4-mini) and LongRoPE.

LongRoPE: transformers switches between the short and the long factors per forward call, by
the sequence length reached (``> original_max_position_embeddings``: long). A bundle's rope
tables are fixed, so the factors are chosen by the bundle's maximum context as llama.cpp does
(``max_kv_cache_capacity > original_max_position_embeddings``: long, for every position). The two
agree for every sequence when the context stays within the original one, and for sequences past
it otherwise; a shorter sequence in a longer bundle is rotated with the long factors where
transformers would use the short ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.families import Family


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"fused_qkv": True, "fused_gate_up": True}
    window = raw.get("sliding_window")
    if window:  # transformers' Phi-3 slides every layer (llama.cpp ignores the window)
        out.update(sliding_window=int(window), layer_types=("sliding",) * int(raw["num_hidden_layers"]))
    return out


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    """llama.cpp writes ``sliding_window`` 0 for none, and the pretraining context under the rope
    scaling keys (the long/short factors are tensors, read by the GGUF reader)."""
    config: dict[str, Any] = {"sliding_window": meta("attention.sliding_window", 0) or None}
    original = meta("rope.scaling.original_context_length", None)
    if original:
        config["original_max_position_embeddings"] = int(original)
    return config


FAMILY = Family(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    model_types=("phi3",),
    config_class="Phi3Config",
    # head_dim 32 (= hidden / heads, as llama.cpp assumes) with half of it rotating; LongRoPE
    # whose original context covers the test bundles (256): the short factors and the attention
    # factor of max_position_embeddings 512 (tests/engine/test_rope_scaling.py: the long ones).
    tiny={"pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2,  # Phi3Config's ids: past the vocabulary
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "partial_rotary_factor": 0.5,
          "original_max_position_embeddings": 256,
          "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                              "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                              "long_factor": [1.0, 1.5, 2.2, 3.4, 5.0, 7.5, 11.0, 16.0]}},
    gguf_architectures=("phi3",),
    features=features,
    gguf_config=gguf_config,
    gguf_slots={"ffn_up": "gate_up"},
    tokenizer="sentencepiece",
    parsers=("none", "none"),
    lora_targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
    notes="fused qkv_proj and gate_up_proj; partial rotary; LongRoPE factors chosen by the bundle's "
          "context (as llama.cpp); sliding_window on every layer; Phi-4-mini's tokenizer is bpe",
)
