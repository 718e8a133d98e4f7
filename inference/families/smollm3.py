"""SmolLM3 (SmolLM3ForCausalLM): the Llama layer with rope left out of every ``no_rope_layer_interval``-th
layer (NoPE layers, ``no_rope_layers[i] == 0``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.errors import BuildInputError
from inference.families import Family
from inference.families.llama import gguf_biases


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    layers = int(raw["num_hidden_layers"])
    use_rope = raw.get("no_rope_layers")
    if use_rope is None:  # transformers' default: every interval-th layer (1-based) has no rope
        interval = int(raw.get("no_rope_layer_interval", 4))
        use_rope = [int((i + 1) % interval != 0) for i in range(layers)]
    if not isinstance(use_rope, list) or len(use_rope) != layers:
        raise BuildInputError(
            f"config.json no_rope_layers must list one 0/1 per layer ({layers}), got {use_rope!r}")
    out: dict[str, Any] = {"nope_layers": tuple(i for i, r in enumerate(use_rope) if not r)}
    if not raw.get("use_sliding_window"):  # transformers slides only with use_sliding_window
        out.update(layer_types=(), sliding_window=None)
    return out


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    """llama.cpp fixes the interval at 4 (``n_no_rope_layer_step``) and writes no key for it."""
    return {**gguf_biases(meta, names), "no_rope_layer_interval": 4, "use_sliding_window": False}


FAMILY = Family(
    name="smollm3",
    architectures=("SmolLM3ForCausalLM",),
    model_types=("smollm3",),
    config_class="SmolLM3Config",
    # Four layers: the fourth has no rope (the default interval, the one llama.cpp assumes).
    # (initializer_range: the common 0.2 gave a near tie, 6e-6 apart, in a greedy reference.)
    tiny={"num_hidden_layers": 4, "pad_token_id": None, "bos_token_id": 1, "eos_token_id": 2,
          "initializer_range": 0.25},
    gguf_architectures=("smollm3",),
    features=features,
    gguf_config=gguf_config,
    gguf_permuted_qk=True,
    parsers=("qwen3", "hermes"),  # its template: <think> reasoning, <tool_call>{json}</tool_call>
    notes="NoPE layers from no_rope_layers / no_rope_layer_interval",
)
