"""Gemma 4 (text; Gemma4ForCausalLM): Gemma 3's sandwich layer with plain ``w`` norms and a query
scale of 1, plus what no other family has:

* **per-layer attention shapes**: the global (full-attention) layers have their own head size and
  K/V head count (``per_layer_config``, or the hub's ``global_head_dim`` /
  ``num_global_key_value_heads``), so each layer's K/V buffer has its own shape;
* **KV shared across layers**: the last ``num_kv_shared_layers`` layers compute no K/V of their own
  and attend over the last earlier layer of their type (which the engines bind them to);
* **keys as values** in the global layers (``attention_k_eq_v``), a weightless RMSNorm on the values;
* **per-layer input embeddings** (PLE): a second token table of ``hidden_size_per_layer_input`` per
  layer, mixed with a projection of the embedding and fed through a gate into every layer;
* a scalar per layer output (``layer_scalar``), **proportional rope** in the global layers (a
  quarter of the head's frequency pairs rotating, over the whole head), twice as wide MLPs in the
  shared layers (``use_double_wide_mlp``).

The mixture-of-experts variant (``enable_moe_block``: 26B-A4B's dense MLP plus a routed one with
per-expert scales) is refused in one line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.errors import UnsupportedFeatureError
from inference.families import Family, gguf_swa_layers
from inference.families.gemma import SANDWICH_NAMES, _sandwich

#: transformers' Gemma4TextConfig defaults where config.json is silent.
DEFAULT_GLOBAL_HEAD_DIM = 512
DEFAULT_SLIDING_WINDOW = 512
DEFAULT_PATTERN = 6  # five sliding layers, one global
DEFAULT_PER_LAYER_INPUT = 256
DEFAULT_PER_LAYER_VOCAB = 262_144
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}


def _layer_types(raw: Mapping[str, Any], layers: int) -> list[str]:
    """transformers' layer types: config.json's, else five sliding to one global; the last layer
    is always global (transformers forces it)."""
    types = list(raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % DEFAULT_PATTERN else "full_attention" for i in range(layers)])
    if len(types) != layers:
        from inference.builder.errors import BuildInputError
        raise BuildInputError(
            f"config.json layer_types must list one type per layer ({layers}), got {types!r}")
    types[-1] = "full_attention"
    return types


def _attention_shapes(raw: Mapping[str, Any], types: list[str]) -> tuple[tuple[int, int], ...]:
    """(K/V heads, head size) per layer: ``per_layer_config`` where config.json has it (what
    transformers writes), else the global layers' ``global_head_dim`` (default 512) and, with
    ``attention_k_eq_v``, ``num_global_key_value_heads``."""
    kv = int(raw.get("num_key_value_heads") or raw["num_attention_heads"])
    hd = int(raw.get("head_dim") or 256)
    per_layer = raw.get("per_layer_config")
    shapes = []
    for i, kind in enumerate(types):
        if isinstance(per_layer, Mapping):
            own = per_layer.get(str(i)) or per_layer.get(i) or {}
            shapes.append((int(own.get("num_key_value_heads", kv)), int(own.get("head_dim", hd))))
        elif kind == "full_attention":
            global_kv = raw.get("num_global_key_value_heads") if raw.get("attention_k_eq_v") else None
            shapes.append((int(global_kv or kv), int(raw.get("global_head_dim") or DEFAULT_GLOBAL_HEAD_DIM)))
        else:
            shapes.append((kv, hd))
    return tuple(shapes)


def _kv_sources(raw: Mapping[str, Any], types: list[str]) -> tuple[int, ...]:
    """transformers' ``kv_sharing_modes``: the last ``num_kv_shared_layers`` layers read the K/V of
    the last earlier layer of their type."""
    layers, shared = len(types), int(raw.get("num_kv_shared_layers") or 0)
    if not shared:
        return ()
    first = layers - shared
    if first <= 0:
        raise UnsupportedFeatureError(
            f"num_kv_shared_layers {shared} shares every layer's K/V; at least one layer must compute "
            "its own")
    sources = list(range(layers))
    for i in range(first, layers):
        earlier = [j for j in range(first) if types[j] == types[i]]
        if not earlier:
            raise UnsupportedFeatureError(
                f"layer {i} ({types[i]}) shares K/V, but no earlier layer of its type computes any")
        sources[i] = earlier[-1]
    return tuple(sources)


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    from inference.builder.model_config import RopeConfig, rope_from

    if raw.get("enable_moe_block"):
        raise UnsupportedFeatureError(
            "gemma4_text with enable_moe_block (Gemma 4 26B-A4B: a routed expert block beside the "
            "dense MLP, with per-expert scales) is not supported yet")
    layers = int(raw["num_hidden_layers"])
    types = _layer_types(raw, layers)
    shapes = _attention_shapes(raw, types)
    sources = _kv_sources(raw, types)
    ff = int(raw["intermediate_size"])
    wide = bool(raw.get("use_double_wide_mlp")) and bool(sources)
    params = raw.get("rope_parameters")
    if isinstance(params, Mapping) and params:
        rope_raw = dict(raw)
        rope, rope_local = rope_from(rope_raw, "full_attention"), rope_from(rope_raw, "sliding_attention")
    elif raw.get("rope_scaling") or "rope_local_base_freq" in raw:
        # a GGUF's: the global layers' rope as llama.cpp writes it (rope_freqs: a divisor of 1e30 for
        # each pair that does not rotate, frequency ~0 as the proportional rope's 0), the sliding
        # layers' base apart
        rope = rope_from(raw)
        rope_local = RopeConfig(theta=float(raw.get("rope_local_base_freq") or 10_000.0))
    else:
        rope_raw = {**raw, "rope_parameters": DEFAULT_ROPE}
        rope, rope_local = rope_from(rope_raw, "full_attention"), rope_from(rope_raw, "sliding_attention")
    per_layer = raw.get("hidden_size_per_layer_input", DEFAULT_PER_LAYER_INPUT)
    vocab = int(raw["vocab_size"])
    if per_layer and int(raw.get("vocab_size_per_layer_input") or DEFAULT_PER_LAYER_VOCAB) < vocab:
        from inference.builder.errors import BuildInputError
        raise BuildInputError(
            f"vocab_size_per_layer_input {raw.get('vocab_size_per_layer_input')} is smaller than vocab_size "
            f"{vocab}: every token needs its row of the per-layer input table")
    out = {
        **_sandwich(raw),
        "norm_offset": 0.0,  # Gemma 4's RMSNorm multiplies by w, not 1 + w
        "attn_scale": 1.0,  # q and k are normed per head; no query scale
        "qk_norm": "head", "v_norm": True,
        "head_dim": int(raw.get("head_dim") or 256),
        "rotary_dim": 0,  # both ropes span the whole head (proportional zeroes most of the global one)
        "layer_types": tuple("sliding" if t == "sliding_attention" else "full" for t in types),
        "sliding_window": int(raw.get("sliding_window") or DEFAULT_SLIDING_WINDOW),
        "rope": rope, "rope_local": rope_local,
        "layer_attention": shapes if len(set(shapes)) > 1 else (),
        "kv_sources": sources,
        "keys_as_values": tuple(i for i, t in enumerate(types) if t == "full_attention")
        if raw.get("attention_k_eq_v") else (),
        "per_layer_input": int(per_layer or 0),
        "per_layer_vocab": int(raw.get("vocab_size_per_layer_input") or DEFAULT_PER_LAYER_VOCAB),
        "layer_scalar": True,
        "layer_intermediate": tuple(2 * ff if wide and sources[i] != i else ff for i in range(layers))
        if wide else (),
    }
    if len(set(shapes)) == 1:
        out["num_kv_heads"] = shapes[0][0]
    return out


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    """config.json from llama.cpp's ``gemma4`` metadata (Gemma4Model.set_gguf_parameters): the
    layer types as one flag a layer, K/V heads and MLP widths per layer (arrays), the global and
    sliding head sizes (``key_length`` / ``key_length_swa``), the shared layers, the per-layer
    input width; keys as values where a global layer has no ``attn_v``."""
    layers = int(meta("block_count", 0))
    types = gguf_swa_layers(meta) or _layer_types({}, layers)
    kv = meta("attention.head_count_kv", None)
    kv_list = list(kv) if isinstance(kv, tuple) else [kv] * layers
    ff = meta("feed_forward_length", None)
    ff_list = list(ff) if isinstance(ff, tuple) else [ff] * layers
    shared = int(meta("attention.shared_kv_layers", 0) or 0)
    full_dim = meta("attention.key_length", None)
    swa_dim = meta("attention.key_length_swa", None) or full_dim
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    own_full = [i for i, t in enumerate(types) if t == "full_attention" and i < layers - shared]
    return {
        "hidden_activation": "gelu_pytorch_tanh",
        "head_dim": swa_dim,
        "num_key_value_heads": kv_list[sliding[0]] if sliding else kv_list[0],
        "intermediate_size": ff_list[0],
        "use_double_wide_mlp": bool(shared) and ff_list[-1] == 2 * ff_list[0],
        "layer_types": types,
        "sliding_window": meta("attention.sliding_window", None),
        "per_layer_config": {str(i): {"head_dim": full_dim, "num_key_value_heads": kv_list[i]}
                             for i, t in enumerate(types) if t == "full_attention"},
        "attention_k_eq_v": bool(own_full) and all(f"blk.{i}.attn_v.weight" not in names for i in own_full),
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": int(meta("embedding_length_per_layer_input", 0) or 0),
        "final_logit_softcapping": meta("final_logit_softcapping", None),
        "rope_local_base_freq": float(meta("rope.freq_base_swa", None) or 10_000.0),
    }


#: Gemma 4's weights beyond Gemma 3's: the per-layer input's gate, projection and norm, the scalar.
GEMMA4_NAMES = {
    **SANDWICH_NAMES,
    "ple_gate": "per_layer_input_gate",
    "ple_proj": "per_layer_projection",
    "ple_norm": "post_per_layer_input_norm",
}

GEMMA4 = Family(
    name="gemma4_text",
    architectures=("Gemma4ForCausalLM",),
    model_types=("gemma4_text",),
    config_class="Gemma4TextConfig",
    # six layers (two global), the last two sharing the K/V of earlier ones (a sliding and a global
    # producer), global layers with twice the head size, one K/V head and keys as values, PLE of
    # 16 per layer, double-wide shared MLPs, a sliding window shorter than the test prompts, a
    # sliding rope base apart from the default and a final soft-cap that bites (logits up to 3 move
    # by 0.7); weights drawn narrower and a wider MLP than the common tiny shape (with them the
    # random model's tied greedy output is a token or two repeated).
    tiny={"head_dim": 16, "initializer_range": 0.1, "intermediate_size": 256, "global_head_dim": 32,
          "num_global_key_value_heads": 1, "attention_k_eq_v": True,
          "num_hidden_layers": 6, "sliding_window": 8, "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
          "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 384,
          "final_logit_softcapping": 3.0,
          "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                          "sliding_attention", "sliding_attention", "full_attention"],
          "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                              "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                 "rope_theta": 1e6}}},
    gguf_architectures=("gemma4",),
    features=features,
    gguf_config=gguf_config,
    # llama.cpp's names of the per-layer input's gate, projection and norm, and of the scalar
    gguf_slots={"inp_gate": "ple_gate", "proj": "ple_proj", "post_norm": "ple_norm",
                "layer_output_scale": "layer_scalar"},
    hf_names=GEMMA4_NAMES,
    tokenizer="sentencepiece",
    notes="per-layer attention shapes (global head size and K/V heads), K/V shared across the last "
          "layers, keys as values, value norm, per-layer input embeddings, layer scalars, proportional "
          "rope, double-wide shared MLPs; plain w norms, query scale 1; enable_moe_block refused",
)
