"""config.json of a supported decoder family -> a validated, frozen ModelConfig."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inference.builder.errors import BuildInputError

# architecture class name -> config model_type
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, whichever config convention they came from."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies [head_dim/2] as transformers computes them (float32)."""
        exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        inv = (1.0 / (np.float32(self.theta) ** exponents)).astype(np.float32)
        if self.rope_type == "linear":
            return (inv / np.float32(self.factor)).astype(np.float32)
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

    def cos_sin(self, head_dim: int, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin tables [max_positions, head_dim/2] (float32, like transformers)."""
        positions = np.arange(max_positions, dtype=np.float32)
        freqs = np.outer(positions, self.inv_freq(head_dim)).astype(np.float32)
        return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


@dataclass(frozen=True)
class ModelConfig:
    """The facts of a checkpoint the graph builder needs."""

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
    qk_norm: bool
    sliding_window: int | None
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


def _rope_from(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes rope_parameters (theta inside); hub checkpoints carry top-level
    # rope_theta and an optional rope_scaling dict.
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params:
        scaling: dict[str, Any] = dict(params)
        theta = scaling.get("rope_theta", raw.get("rope_theta", 10000.0))
    else:
        scaling = dict(raw.get("rope_scaling") or {})
        theta = raw.get("rope_theta", 10000.0)
    rope_type = str(scaling.get("rope_type", scaling.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise BuildInputError(
            f"unsupported rope scaling type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    if rope_type == "linear":
        return RopeConfig(theta=float(theta), rope_type="linear", factor=float(scaling["factor"]))
    try:
        return RopeConfig(
            theta=float(theta),
            rope_type="llama3",
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise BuildInputError(f"llama3 rope scaling is missing the field {exc.args[0]!r}") from None


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _require_int(raw: dict[str, Any], key: str) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BuildInputError(f"config.json field {key!r} must be a positive integer, got {value!r}")
    return value


def load_model_config(checkpoint_dir: Path) -> ModelConfig:
    """Parse and validate ``checkpoint_dir/config.json`` (and generation_config.json for eos ids)."""
    path = checkpoint_dir / "config.json"
    if not path.is_file():
        raise BuildInputError(f"{checkpoint_dir} has no config.json; is it a Hugging Face checkpoint?")
    try:
        raw: dict[str, Any] = json.loads(path.read_text())
    except ValueError as exc:
        raise BuildInputError(f"config.json in {checkpoint_dir} is not valid JSON: {exc}") from exc
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch is None:
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        arch = by_type.get(str(raw.get("model_type")))
    if arch not in SUPPORTED_ARCHITECTURES:
        name = arch or raw.get("model_type")
        raise BuildInputError(f"unsupported architecture {name!r}; supported: {supported}")
    model_type = SUPPORTED_ARCHITECTURES[arch]

    if raw.get("quantization_config"):
        raise BuildInputError(
            "quantized checkpoints (quantization_config) are not supported; use fp32/fp16/bf16 weights"
        )
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise BuildInputError(f"unsupported hidden_act {act!r}; supported: 'silu'")
    if float(raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise BuildInputError(
            "unsupported partial_rotary_factor != 1.0; only full rotary embeddings are supported"
        )

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

    sliding: int | None = None
    if model_type == "mistral":
        sliding = raw.get("sliding_window")
    else:
        layer_types = raw.get("layer_types") or []
        if raw.get("use_sliding_window") or any(t != "full_attention" for t in layer_types):
            raise BuildInputError(
                f"sliding-window attention is not supported for {model_type}; "
                "set use_sliding_window to false (supported only as mistral's global sliding_window)"
            )

    gen_path = checkpoint_dir / "generation_config.json"
    eos = _eos_ids(raw.get("eos_token_id"))
    bos = raw.get("bos_token_id")
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        eos = _eos_ids(gen.get("eos_token_id")) or eos
        bos = gen.get("bos_token_id", bos)

    return ModelConfig(
        architecture=arch,
        model_type=model_type,
        vocab_size=_require_int(raw, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_require_int(raw, "intermediate_size"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope_from(raw),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
        o_bias=model_type != "qwen2" and bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        sliding_window=int(sliding) if sliding else None,
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        bos_token_id=int(bos) if isinstance(bos, int) else None,
        eos_token_ids=eos,
    )
