"""StarCoder2 (Starcoder2ForCausalLM): LayerNorm with a bias, a plain gelu MLP (c_fc -> c_proj),
biases on every projection (use_bias) and a sliding window over every layer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.families import Family


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    from inference.builder.model_config import activation  # (the builder imports the registry)
    bias = bool(raw.get("use_bias", True))
    window = raw.get("sliding_window")
    out: dict[str, Any] = {
        "norm": "layer", "norm_bias": True, "rms_norm_eps": float(raw.get("norm_epsilon", 1e-5)),
        "mlp": "plain", "act": activation(raw) if raw.get("hidden_act") else "gelu_tanh",
        "attention_bias": bias, "o_bias": bias, "mlp_bias": bias,
    }
    if window:
        out.update(sliding_window=int(window), layer_types=("sliding",) * int(raw["num_hidden_layers"]))
    return out


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    # llama.cpp's converter keeps no sliding window for StarCoder2 (nor does llama.cpp use one).
    return {"norm_epsilon": float(meta("attention.layer_norm_epsilon", 1e-5)),
            "use_bias": "blk.0.attn_q.bias" in names, "hidden_act": "gelu_pytorch_tanh",
            "sliding_window": None}


FAMILY = Family(
    name="starcoder2",
    architectures=("Starcoder2ForCausalLM",),
    model_types=("starcoder2",),
    config_class="Starcoder2Config",
    # a window shorter than the test prompts; an eps unlike the default; a wider MLP than the common
    # tiny shape (with 128 the random model's greedy output is degenerate)
    tiny={"sliding_window": 8, "norm_epsilon": 1e-3, "hidden_act": "gelu_pytorch_tanh",
          "intermediate_size": 256},
    gguf_architectures=("starcoder2",),
    features=features,
    gguf_config=gguf_config,
    hf_names={"up": "mlp.c_fc", "down": "mlp.c_proj"},
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"),
    notes="LayerNorm with bias; plain gelu_tanh MLP (c_fc, c_proj); biases (use_bias); sliding_window "
          "(not in its GGUF: llama.cpp keeps none)",
)
