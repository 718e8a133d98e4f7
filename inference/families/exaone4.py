"""EXAONE 4.0 (Exaone4ForCausalLM): OLMo 2's post-norms (after attention and after the MLP, none
before), RMSNorm q/k norms per head, and, in the hybrid models (a ``sliding_window``), sliding
layers with rope and global layers without (NoPE)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.errors import BuildInputError
from inference.families import Family, gguf_sliding, pattern_layer_types


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"pre_attn_norm": False, "pre_mlp_norm": False, "post_attn_norm": True,
                           "post_mlp_norm": True, "qk_norm": "head"}
    if raw.get("sliding_window") is None:  # one kind of layer, every one with rope
        return {**out, "layer_types": (), "sliding_window": None}
    pattern = raw.get("sliding_window_pattern", 4)
    if isinstance(pattern, str) and not raw.get("layer_types"):  # "LLLG": the layers, repeated
        if not pattern or not set(pattern) <= {"L", "G"}:
            raise BuildInputError(f"config.json sliding_window_pattern must be a positive integer or a "
                                  f"string of L and G, got {pattern!r}")
        raw = {**raw, "layer_types": ["sliding_attention" if pattern[i % len(pattern)] == "L" else
                                      "full_attention" for i in range(int(raw["num_hidden_layers"]))]}
    types = pattern_layer_types(raw, pattern)
    return {**out, "layer_types": types, "sliding_window": int(raw["sliding_window"]),
            # "We use global NoPE for hybrid attention model": only the sliding layers rotate.
            "nope_layers": tuple(i for i, t in enumerate(types) if t == "full")}


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    out = gguf_sliding(meta)  # llama.cpp's converter lists the layers whenever there is a window
    return out if "layer_types" in out else {"sliding_window": None}


FAMILY = Family(
    name="exaone4",
    architectures=("Exaone4ForCausalLM",),
    model_types=("exaone4",),
    config_class="Exaone4Config",
    # A hybrid model: three sliding layers with rope (a window shorter than the test prompts), then
    # a global NoPE layer.
    tiny={"num_hidden_layers": 4, "sliding_window": 8, "sliding_window_pattern": 4, "rms_norm_eps": 1e-3},
    gguf_architectures=("exaone4",),
    features=features,
    gguf_config=gguf_config,
    notes="post-norms only (after attention and MLP); RMSNorm q/k norms per head; hybrid models "
          "(sliding_window): sliding layers with rope, global layers NoPE",
)
