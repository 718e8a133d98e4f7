"""config.json of a supported decoder family -> a validated, frozen ModelConfig.

What is particular to a family lives in its module under :mod:`inference.families`;
this module reads what every family shares and lets the family set its layer features.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inference.builder.errors import BuildInputError
from inference.errors import UnsupportedFeatureError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "dynamic", "factors",
                        "proportional")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, whichever config convention they came from.

    ``rope_type``: transformers' names (``default``, ``linear``, ``llama3``, ``yarn``,
    ``longrope``, ``dynamic``) plus ``factors``: per-frequency divisors given as such (llama.cpp's
    ``rope_freqs`` tensor, what its converter writes for a llama3 rope). ``attention_factor``
    scales cos and sin (YaRN's mscale, LongRoPE's attention factor), as transformers does.
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    attention_factor: float = 1.0
    short_factor: tuple[float, ...] = ()  # longrope: divisors within the original context
    long_factor: tuple[float, ...] = ()  # longrope: divisors beyond it
    freq_factors: tuple[float, ...] = ()  # factors: the divisors of every frequency
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    truncate: bool = True
    #: proportional (Gemma 4's global layers): the share of each head's frequency pairs that
    #: rotate (``theta ** (2i / head_dim)`` for the first ``fraction * head_dim / 2``), the rest
    #: at frequency 0 (cos 1, sin 0): the whole head is "rotated", most of it not at all.
    fraction: float = 1.0

    def _base(self, head_dim: int) -> np.ndarray:
        """``theta ** (2i / head_dim)`` in float32, as transformers computes it."""
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        return (np.float32(self.theta) ** exponents).astype(np.float32)

    def uses_long_factors(self, max_positions: int) -> bool:
        """LongRoPE: the long factors for a context of ``max_positions`` (llama.cpp's choice by
        the context size: longer than the original context; transformers instead switches per
        forward call, by the sequence length it has reached)."""
        return max_positions > self.original_max_position_embeddings

    def inv_freq(self, head_dim: int, max_positions: int | None = None) -> np.ndarray:
        """Inverse frequencies [head_dim/2] as transformers computes them (float32) for a context
        of ``max_positions`` (only LongRoPE and dynamic NTK depend on it)."""
        base = self._base(head_dim)
        inv = (1.0 / base).astype(np.float32)
        if self.rope_type == "linear":
            return (inv / np.float32(self.factor)).astype(np.float32)
        if self.rope_type == "factors":
            return (inv / np.asarray(self.freq_factors, np.float32)).astype(np.float32)
        if self.rope_type == "longrope":
            long = max_positions is not None and self.uses_long_factors(max_positions)
            ext = np.asarray(self.long_factor if long else self.short_factor, np.float32)
            return (1.0 / (ext * base)).astype(np.float32)
        if self.rope_type == "dynamic":
            if max_positions is not None and max_positions > self.original_max_position_embeddings:
                raise BuildInputError(
                    f"dynamic rope scaling changes the frequencies with the sequence length past "
                    f"max_position_embeddings ({self.original_max_position_embeddings}); build with "
                    f"max_kv_cache_capacity <= {self.original_max_position_embeddings}")
            return inv
        if self.rope_type == "yarn":
            return self._yarn(head_dim, base)
        if self.rope_type == "proportional":
            angles = int(self.fraction * head_dim // 2)
            inv[angles:] = 0.0
            return inv
        if self.rope_type == "llama3":
            old = float(self.original_max_position_embeddings)
            low_wavelen = old / self.low_freq_factor
            high_wavelen = old / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = np.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return np.where(medium, smoothed, scaled).astype(np.float32)
        return inv

    def _yarn(self, dim: int, pos_freqs: np.ndarray) -> np.ndarray:
        """YaRN's blend of interpolated and extrapolated frequencies (transformers'
        ``_compute_yarn_parameters``)."""
        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
                2 * math.log(self.theta))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low),
                       0, 1)
        extrapolation = (1 - ramp.astype(np.float32)).astype(np.float32)
        inv_extra = (1.0 / pos_freqs).astype(np.float32)
        inv_inter = (1.0 / (np.float32(self.factor) * pos_freqs)).astype(np.float32)
        return (inv_inter * (1 - extrapolation) + inv_extra * extrapolation).astype(np.float32)

    def cos_sin(self, head_dim: int, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin tables [max_positions, head_dim/2] (float32, like transformers), times the
        attention factor."""
        positions = np.arange(max_positions, dtype=np.float32)
        freqs = np.outer(positions, self.inv_freq(head_dim, max_positions)).astype(np.float32)
        cos, sin = np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)
        if self.attention_factor != 1.0:
            scale = np.float32(self.attention_factor)
            cos, sin = (cos * scale).astype(np.float32), (sin * scale).astype(np.float32)
        return cos, sin


@dataclass(frozen=True)
class MoeConfig:
    """A sparse mixture-of-experts MLP: a softmax router picks ``top_k`` of ``num_experts`` gated
    experts per token (Mixtral, Qwen2-MoE, Qwen3-MoE), plus an optional shared expert."""

    num_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate size
    norm_topk_prob: bool  # the top-k weights renormalised to sum to 1 (else the softmax's own)
    shared_size: int = 0  # the shared expert's intermediate size (0: none)
    shared_gate: bool = False  # the shared expert's output times sigmoid(x @ shared_expert_gate)
    #: layers whose MLP is sparse (the others are the plain gated MLP of ``intermediate_size``)
    sparse_layers: tuple[int, ...] = ()


NORMS = ("rms", "layer")
QK_NORMS = ("none", "head", "full")
MLPS = ("gated", "plain")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu", "relu2")
LAYER_TYPES = ("full", "sliding")
#: config.json ``hidden_act`` / ``hidden_activation`` -> our activation name.
_ACTIVATION_NAMES = {
    "silu": "silu", "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh",
    "gelu": "gelu", "relu2": "relu2",
}


@dataclass(frozen=True)
class ModelConfig:
    """The facts of a checkpoint the graph builder needs: one layer description for every family.

    The first block is the shape; the rest are the layer features (switches of the one graph
    builder), each with the Llama value as its default, set by the family's module
    (:mod:`inference.families`) from its config.json.
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases
    o_bias: bool
    mlp_bias: bool
    qk_norm: str  # "none", "head" (per head, Qwen3), "full" (over the projection's width, OLMo 2)
    sliding_window: int | None
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    family: str = "llama"
    norm: str = "rms"  # "rms" or "layer" (LayerNorm)
    norm_offset: float = 0.0  # the norm multiplies by (offset + w): Gemma's (1 + w), LayerNorm1p
    norm_bias: bool = False  # LayerNorm with a bias
    pre_attn_norm: bool = True
    post_attn_norm: bool = False  # a norm on the attention output before the residual add
    pre_mlp_norm: bool = True
    post_mlp_norm: bool = False
    mlp: str = "gated"  # "gated" (act(gate) * up) or "plain" (act(up))
    act: str = "silu"
    fused_qkv: bool = False  # one qkv_proj weight (Phi-3)
    fused_gate_up: bool = False  # one gate_up_proj weight (Phi-3)
    rotary_dim: int = 0  # dimensions of each head that rotate (0: all of head_dim)
    #: rotary pairs are neighbours (x0, x1), (x2, x3) ... (GPT-J style: Cohere, GLM-4), not the
    #: two halves of the rotated dimensions (rotate_half: Llama and most others)
    rope_interleaved: bool = False
    layer_types: tuple[str, ...] = ()  # per layer "full" or "sliding" (empty: all full)
    rope_local: RopeConfig | None = None  # the sliding layers' rope, where it differs
    nope_layers: tuple[int, ...] = ()  # layers whose attention has no rotary embedding
    attn_scale: float = 0.0  # query scale (0: head_dim ** -0.5)
    attn_softcap: float = 0.0  # tanh soft-capping of attention scores (0: none)
    final_softcap: float = 0.0  # tanh soft-capping of the logits (0: none)
    embed_scale: float = 1.0  # the embedding output is multiplied by this
    residual_scale: float = 1.0  # each block's output is multiplied by this before the add
    logits_scale: float = 1.0  # the logits are multiplied by this
    moe: MoeConfig | None = None  # a mixture-of-experts MLP in ``moe.sparse_layers``
    #: attention and MLP side by side on the attention norm's output, one residual add
    #: (x + attn(n(x)) + mlp(n(x)): StableLM's use_parallel_residual, Phi-1/2, Cohere)
    parallel_block: bool = False
    lm_head_bias: bool = False  # an untied lm_head with a bias (Phi-1/2)
    #: Per-layer attention shapes where layers differ (Gemma 4's global layers): one (kv heads,
    #: head dim) per layer; empty: every layer has (num_kv_heads, head_dim).
    layer_attention: tuple[tuple[int, int], ...] = ()
    #: KV shared across layers (Gemma 4): per layer, the layer whose K/V it attends over (its own
    #: index where it computes its own); empty: none shared.
    kv_sources: tuple[int, ...] = ()
    #: layers whose values are their key projection's output (Gemma 4's ``attention_k_eq_v``)
    keys_as_values: tuple[int, ...] = ()
    v_norm: bool = False  # a weightless RMSNorm per head on the values (Gemma 4)
    #: Per-layer input embeddings (Gemma 4's PLE): the width per layer (0: none) and its vocabulary
    per_layer_input: int = 0
    per_layer_vocab: int = 0
    layer_scalar: bool = False  # each layer's output times its own scalar (``layer_scalar``)
    #: per layer MLP width where layers differ (Gemma 4's double-wide shared layers); empty: all
    #: ``intermediate_size``
    layer_intermediate: tuple[int, ...] = ()
    #: Multimodal rotary positions (Qwen2.5-VL's M-RoPE): the graph takes temporal, height and
    #: width position ids ``[3, B, S]`` and rotates frequency pair ``j`` by the ids of the section
    #: it falls in (these are the sections' sizes, summing to ``rotary / 2``); empty: 1D positions.
    mrope_section: tuple[int, ...] = ()

    def sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is the mixture of experts."""
        return self.moe is not None and layer in self.moe.sparse_layers

    @property
    def rotary(self) -> int:
        """Rotated dimensions per head."""
        return self.rotary_dim or self.head_dim

    def head_dim_of(self, layer: int) -> int:
        """The head size of ``layer``."""
        return self.layer_attention[layer][1] if self.layer_attention else self.head_dim

    def kv_heads_of(self, layer: int) -> int:
        """The K/V heads of ``layer``."""
        return self.layer_attention[layer][0] if self.layer_attention else self.num_kv_heads

    def rotary_of(self, layer: int) -> int:
        """Rotated dimensions per head of ``layer``."""
        return self.rotary_dim or self.head_dim_of(layer)

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V ``layer`` attends over (itself unless KV is shared)."""
        return self.kv_sources[layer] if self.kv_sources else layer

    def intermediate_of(self, layer: int) -> int:
        """The MLP width of ``layer``."""
        return self.layer_intermediate[layer] if self.layer_intermediate else self.intermediate_size

    @property
    def uniform_kv(self) -> bool:
        """Every layer holds its own K/V of one shape (the engines' plain layout)."""
        return not self.layer_attention and not self.kv_sources

    @property
    def query_scale(self) -> float:
        """The attention's query scale."""
        return self.attn_scale or self.head_dim ** -0.5

    def query_scale_of(self, layer: int) -> float:
        """The query scale of ``layer`` (its own head size where layers differ)."""
        return self.attn_scale or self.head_dim_of(layer) ** -0.5

    def layer_type(self, layer: int) -> str:
        """"full" or "sliding" for ``layer``."""
        return self.layer_types[layer] if self.layer_types else "full"

    def window(self, layer: int) -> int | None:
        """The sliding window of ``layer`` (None: full attention)."""
        return self.sliding_window if self.layer_type(layer) == "sliding" else None

    def rope_of(self, layer: int) -> RopeConfig | None:
        """The rope of ``layer`` (None: no rotary embedding, a NoPE layer)."""
        if layer in self.nope_layers:
            return None
        if self.layer_type(layer) == "sliding" and self.rope_local is not None:
            return self.rope_local
        return self.rope


def _rope_params(raw: Mapping[str, Any], layer_type: str = "full_attention") -> tuple[dict[str, Any], Any]:
    """(scaling dict, theta) of one layer type, whichever config convention they came in."""
    # transformers 5 writes rope_parameters (theta inside; per layer type where the family has
    # several, e.g. Gemma 3); hub checkpoints carry top-level rope_theta and rope_scaling.
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get(layer_type) or params.get("full_attention") or next(iter(params.values()))
    if isinstance(params, dict) and params:
        scaling: dict[str, Any] = dict(params)
        return scaling, scaling.get("rope_theta", raw.get("rope_theta", 10000.0))
    return dict(raw.get("rope_scaling") or {}), raw.get("rope_theta", 10000.0)


def rope_from(raw: Mapping[str, Any], layer_type: str = "full_attention",
              theta: float | None = None) -> RopeConfig:
    """The rotary embedding of ``raw``'s layers of ``layer_type`` (``theta`` overrides the base)."""
    scaling, base = _rope_params(raw, layer_type)
    base = float(base if theta is None else theta)
    rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedFeatureError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeConfig(theta=base)
    if rope_type == "linear":
        return RopeConfig(theta=base, rope_type="linear", factor=float(scaling["factor"]))
    if rope_type == "proportional":
        if float(scaling.get("factor", 1.0)) != 1.0:
            raise UnsupportedFeatureError("proportional rope with a scaling factor is not supported")
        return RopeConfig(theta=base, rope_type="proportional",
                          fraction=float(scaling.get("partial_rotary_factor", 1.0)))
    max_positions = int(raw.get("max_position_embeddings", 4096))
    if rope_type == "dynamic":
        # transformers computes the default frequencies up to max_position_embeddings and new ones
        # past it, per sequence length: the same rope while a bundle's context stays within it.
        return RopeConfig(theta=base, rope_type="dynamic", original_max_position_embeddings=max_positions)
    # Phi-3 keeps the pretraining context at the top level (transformers prefers it there).
    original = raw.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
    try:
        if rope_type == "factors":
            return RopeConfig(theta=base, rope_type="factors",
                              freq_factors=tuple(float(f) for f in scaling["factors"]))
        if rope_type == "longrope":
            return _longrope(scaling, base, int(original or max_positions), max_positions)
        if rope_type == "yarn":
            return _yarn(scaling, base, int(original or max_positions), max_positions)
        return RopeConfig(
            theta=base,
            rope_type="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise BuildInputError(f"{rope_type} rope scaling is missing the field {exc.args[0]!r}") from None


def _longrope(scaling: Mapping[str, Any], base: float, original: int, max_positions: int) -> RopeConfig:
    """transformers' ``_compute_longrope_parameters``: short/long factors, and an attention
    factor from ``factor`` (default: max_position_embeddings / the original context)."""
    factor = float(scaling.get("factor") or max_positions / original)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short, long = scaling["short_factor"], scaling["long_factor"]
    return RopeConfig(theta=base, rope_type="longrope", factor=factor,
                      original_max_position_embeddings=original, attention_factor=float(attention),
                      short_factor=tuple(float(f) for f in short),
                      long_factor=tuple(float(f) for f in long))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(scaling: Mapping[str, Any], base: float, original: int, max_positions: int) -> RopeConfig:
    """transformers' ``_compute_yarn_parameters``: factor, correction range, attention factor."""
    factor = float(scaling["factor"] if scaling["factor"] is not None else max_positions / original)
    attention = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention is None:
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)
    return RopeConfig(theta=base, rope_type="yarn", factor=factor, original_max_position_embeddings=original,
                      attention_factor=float(attention), beta_fast=float(scaling.get("beta_fast") or 32),
                      beta_slow=float(scaling.get("beta_slow") or 1),
                      truncate=bool(scaling.get("truncate", True)))


def check_rope_size(rope: RopeConfig, rotary: int) -> None:
    """Per-frequency factors must give one value per rotated pair (``rotary / 2``)."""
    values = {"short_factor": rope.short_factor, "long_factor": rope.long_factor,
              "factors": rope.freq_factors}
    needed = {"longrope": ("short_factor", "long_factor"), "factors": ("factors",)}.get(rope.rope_type, ())
    for name in needed:
        if len(values[name]) != rotary // 2:
            raise BuildInputError(
                f"{rope.rope_type} rope scaling field {name!r} has {len(values[name])} values; the "
                f"{rotary} rotary dimensions need {rotary // 2}")


def partial_rotary_factor(raw: Mapping[str, Any], default: float = 1.0) -> float:
    """The config's ``partial_rotary_factor``: top level (hub checkpoints) or inside
    ``rope_parameters`` (what transformers 5 writes); ``default`` where neither says."""
    value = raw.get("partial_rotary_factor")
    if value is None:
        value = _rope_params(raw)[0].get("partial_rotary_factor")
    try:
        return float(default if value is None else value)
    except (TypeError, ValueError):
        raise BuildInputError(f"config.json partial_rotary_factor must be a number, got {value!r}") from None


def rotary_dims(raw: Mapping[str, Any], head_dim: int, default_factor: float = 1.0) -> int:
    """Rotated dimensions per head (``head_dim * partial_rotary_factor``), checked."""
    partial = partial_rotary_factor(raw, default_factor)
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise BuildInputError(
            f"partial_rotary_factor {partial} gives {rotary_dim} rotary dimensions of head_dim {head_dim}; "
            "it must be an even number between 2 and head_dim"
        )
    return rotary_dim


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _require_int(raw: Mapping[str, Any], key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BuildInputError(f"config.json field {key!r} must be a positive integer, got {value!r}")
    return value


def activation(raw: Mapping[str, Any], *keys: str) -> str:
    """Our name of the config's activation (the first of ``keys`` present; default silu)."""
    name = next((raw[k] for k in (*keys, "hidden_act") if raw.get(k) is not None), "silu")
    if name not in _ACTIVATION_NAMES:
        raise UnsupportedFeatureError(
            f"unsupported hidden_act {name!r}; supported: {', '.join(sorted(_ACTIVATION_NAMES))}"
        )
    return _ACTIVATION_NAMES[name]


def layer_types_of(raw: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """``layer_types`` ("full_attention"/"sliding_attention" per layer) as "full"/"sliding"."""
    types = raw.get("layer_types")
    if not types:
        return ()
    if not isinstance(types, list) or len(types) != layers:
        raise BuildInputError(
            f"config.json layer_types must list one type per layer ({layers}), got {types!r}")
    names = {"full_attention": "full", "sliding_attention": "sliding"}
    if any(t not in names for t in types):
        raise UnsupportedFeatureError(
            f"unsupported layer type in layer_types {sorted(set(types))}; supported: {', '.join(names)}"
        )
    return tuple(names[t] for t in types)


def load_raw_config(checkpoint_dir: Path) -> dict[str, Any]:
    """``checkpoint_dir/config.json`` as a dict (``BuildInputError`` when missing or not JSON)."""
    path = checkpoint_dir / "config.json"
    if not path.is_file():
        raise BuildInputError(f"{checkpoint_dir} has no config.json; is it a Hugging Face checkpoint?")
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise BuildInputError(f"config.json in {checkpoint_dir} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise BuildInputError(f"config.json in {checkpoint_dir} is not a JSON object")
    return raw


def load_model_config(checkpoint_dir: Path) -> ModelConfig:
    """Parse and validate ``checkpoint_dir/config.json`` (and generation_config.json for eos ids)."""
    raw = load_raw_config(checkpoint_dir)
    gen_path = checkpoint_dir / "generation_config.json"
    return model_config_from(raw, json.loads(gen_path.read_text()) if gen_path.is_file() else None)


def model_config_from(raw: Mapping[str, Any], generation: Mapping[str, Any] | None = None) -> ModelConfig:
    """The ModelConfig of a config.json's contents (and generation_config.json's, for eos ids)."""
    from inference.families import family_of_config, text_config_of, vision_family_of

    if raw.get("quantization_config"):
        raise UnsupportedFeatureError(
            "quantized checkpoints (quantization_config) are not supported; use fp32/fp16/bf16 weights"
        )
    vision = vision_family_of(raw)
    if vision is not None:
        from inference.builder.vision_config import check_vision_config

        # The vision side's refusals first (a vision tower of no kind: bad input, one line).
        check_vision_config(raw)
        # The language model is its text family's decoder; the bundle names the whole model.
        text = model_config_from(text_config_of(raw), generation)
        return dataclasses.replace(text, architecture=vision.architectures[0], **vision.text_features(raw))
    family = family_of_config(raw)

    hidden = _require_int(raw, "hidden_size")
    heads = _require_int(raw, "num_attention_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or hidden // heads
    if heads % kv_heads:
        raise BuildInputError(
            f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
        )
    if head_dim % 2:
        raise BuildInputError(f"head_dim must be even for rotary embeddings, got {head_dim}")
    layers = _require_int(raw, "num_hidden_layers")
    rotary_dim = rotary_dims(raw, int(head_dim))

    layer_types = layer_types_of(raw, layers)
    sliding = raw.get("sliding_window") if "sliding" in layer_types else None

    eos = _eos_ids(raw.get("eos_token_id"))
    bos = raw.get("bos_token_id")
    if generation is not None:
        eos = _eos_ids(generation.get("eos_token_id")) or eos
        bos = generation.get("bos_token_id", bos)

    fields: dict[str, Any] = {
        "architecture": family.architecture if not raw.get("architectures") else str(raw["architectures"][0]),
        "model_type": str(raw.get("model_type") or family.name),
        "family": family.name,
        "vocab_size": _require_int(raw, "vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": _require_int(raw, "intermediate_size"),
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(raw.get("rms_norm_eps", raw.get("layer_norm_eps", 1e-6))),
        "rope": rope_from(raw),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "attention_bias": bool(raw.get("attention_bias", False)),
        "o_bias": bool(raw.get("attention_bias", False)),
        "mlp_bias": bool(raw.get("mlp_bias", False)),
        "qk_norm": "none",
        "act": activation(raw),
        "rotary_dim": 0 if rotary_dim == head_dim else rotary_dim,
        "layer_types": layer_types if "sliding" in layer_types else (),
        "sliding_window": int(sliding) if sliding else None,
        "max_position_embeddings": int(raw.get("max_position_embeddings", 4096)),
        "bos_token_id": int(bos) if isinstance(bos, int) else None,
        "eos_token_ids": eos,
    }
    fields.update(family.features(raw))
    if isinstance(fields.get("moe"), Mapping):  # families give MoeConfig's fields
        fields["moe"] = MoeConfig(**fields["moe"])
    if fields["layer_types"] and fields["sliding_window"] is None:
        fields["layer_types"] = ()  # sliding layers without a window attend to everything
    cfg = ModelConfig(**fields)
    for rope, rotary in {(cfg.rope_of(i), cfg.rotary_of(i)) for i in range(cfg.num_layers)}:
        if rope is not None:
            check_rope_size(rope, rotary)
    _check(cfg)
    return cfg


def _check(cfg: ModelConfig) -> None:
    for name, value, allowed in (("norm", cfg.norm, NORMS), ("qk_norm", cfg.qk_norm, QK_NORMS),
                                 ("mlp", cfg.mlp, MLPS), ("act", cfg.act, ACTIVATIONS)):
        if value not in allowed:  # a family module's mistake, not the user's
            raise ValueError(f"{cfg.family}: layer feature {name}={value!r} is not one of {allowed}")
    if cfg.moe is not None:
        _check_moe(cfg, cfg.moe)
    if cfg.parallel_block and cfg.pre_mlp_norm:
        raise ValueError(f"{cfg.family}: parallel_block reads the attention norm's output; "
                         "pre_mlp_norm must be False")
    for name, per_layer in (("layer_attention", cfg.layer_attention), ("kv_sources", cfg.kv_sources),
                            ("layer_intermediate", cfg.layer_intermediate)):
        if per_layer and len(per_layer) != cfg.num_layers:
            raise ValueError(f"{cfg.family}: {name} lists {len(per_layer)} layers, not {cfg.num_layers}")
    for i in range(cfg.num_layers):
        src = cfg.kv_source(i)
        if not 0 <= src <= i or cfg.kv_source(src) != src or (
                cfg.kv_heads_of(src), cfg.head_dim_of(src)) != (cfg.kv_heads_of(i), cfg.head_dim_of(i)):
            raise BuildInputError(
                f"layer {i} shares the K/V of layer {src}, which is not an earlier layer computing its own "
                "K/V of the same shape")
        if cfg.num_heads % cfg.kv_heads_of(i):
            raise BuildInputError(f"layer {i}: num_attention_heads ({cfg.num_heads}) must be a multiple of "
                                  f"its K/V heads ({cfg.kv_heads_of(i)})")
    if cfg.layer_types and (len(cfg.layer_types) != cfg.num_layers
                            or any(t not in LAYER_TYPES for t in cfg.layer_types)):
        raise ValueError(
            f"{cfg.family}: layer_types {cfg.layer_types!r} do not describe {cfg.num_layers} layers")


def _check_moe(cfg: ModelConfig, moe: MoeConfig) -> None:
    """The refusals of the mixture-of-experts MLP (user input: one line naming the field)."""
    if not 1 <= moe.top_k <= moe.num_experts:
        raise BuildInputError(f"num_experts_per_tok {moe.top_k} must be between 1 and the number of experts "
                              f"({moe.num_experts})")
    if moe.expert_size < 1:
        raise BuildInputError(f"the experts' intermediate size must be positive, got {moe.expert_size}")
    if cfg.act != "silu":
        raise UnsupportedFeatureError(
            f"hidden_act {cfg.act!r} in a mixture-of-experts model is not supported: experts run "
            "onnxruntime's MoE op, whose gated activation is SwiGLU (silu)")
    if cfg.mlp_bias or cfg.mlp != "gated" or cfg.fused_gate_up:
        raise UnsupportedFeatureError(
            "mixture-of-experts models with MLP biases (mlp_bias) or ungated experts are not supported")
    if any(not 0 <= i < cfg.num_layers for i in moe.sparse_layers):
        raise ValueError(f"{cfg.family}: sparse layers {moe.sparse_layers} outside {cfg.num_layers} layers")
