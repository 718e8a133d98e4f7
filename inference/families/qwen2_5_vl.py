"""Qwen2.5-VL (``Qwen2_5_VLForConditionalGeneration``): a window-attention ViT with 2D rotary
positions and a 2x2 patch merger in front of a Qwen2 language model whose rotary positions are
three-dimensional (M-RoPE: temporal, height, width position ids over ``mrope_section`` of the
rotary frequencies).

The language model is built as the qwen2 family's decoder with the multimodal positions switched
on (``ModelConfig.mrope_section``); its config is either transformers 5's ``text_config``
(model_type ``qwen2_5_vl_text``) or the hub's flat layout (the text fields at the top level, as
Qwen/Qwen2.5-VL-*-Instruct ship it). The vision side is :mod:`inference.builder.vision_qwen2_5_vl`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inference.errors import BuildInputError
from inference.families import VisionFamily

#: transformers' ``Qwen2_5_VLTextConfig`` defaults: what a config leaves out is this.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_act": "silu",
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-05, "use_sliding_window": False,
    "sliding_window": 4096, "max_window_layers": 80, "bos_token_id": 151643, "eos_token_id": 151645,
    "rope_theta": 1000000.0,
}
#: transformers' default ``mrope_section`` where the config names none.
DEFAULT_MROPE_SECTION = (16, 24, 24)
#: Top-level keys of the whole model's config that are not the language model's (flat layout).
_MULTIMODAL_KEYS = frozenset({
    "architectures", "model_type", "vision_config", "text_config", "image_token_id", "video_token_id",
    "vision_start_token_id", "vision_end_token_id", "vision_token_id", "tie_word_embeddings",
    "transformers_version", "torch_dtype", "dtype", "_name_or_path"})


def _text_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    text = raw.get("text_config")
    if text is None:  # the hub's flat layout: the language model's fields at the top level
        return {k: v for k, v in raw.items() if k not in _MULTIMODAL_KEYS}
    if not isinstance(text, Mapping):
        raise BuildInputError(f"config.json text_config must be an object, got {type(text).__name__}")
    return dict(text)


def _rope(text: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the key the rope parameters came under, a copy of them): transformers 5's
    ``rope_parameters`` or the hub's ``rope_scaling`` ({"type": "mrope", "mrope_section": ...})."""
    for key in ("rope_parameters", "rope_scaling"):
        value = text.get(key)
        if isinstance(value, Mapping) and value:
            return key, dict(value)
    return "rope_parameters", {}


def text_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config.json as the qwen2 family reads it: the text fields over
    transformers' defaults, ``tie_word_embeddings`` of the top level (or, as transformers 5 reads
    older saves, of ``text_config``), the rope without its M-RoPE part (``mrope`` is transformers'
    alias of ``default``; the sections are :func:`text_features`')."""
    text = _text_fields(raw)
    tie = bool(raw.get("tie_word_embeddings", False)) or bool(text.get("tie_word_embeddings", False))
    key, rope = _rope(text)
    rope.pop("mrope_section", None)
    kind = rope.get("rope_type", rope.get("type"))
    if kind == "mrope":
        rope.pop("type", None)
        rope["rope_type"] = "default"
    out = {**TEXT_DEFAULTS, **text, "tie_word_embeddings": tie, "model_type": "qwen2"}
    out.pop("rope_scaling", None)
    out.pop("rope_parameters", None)
    if rope:
        out[key] = rope
    out.pop("architectures", None)
    return out


def mrope_section(raw: Mapping[str, Any]) -> tuple[int, ...]:
    """The rotary frequency pairs of the temporal, height and width position ids, checked against
    the head size (they split its half, as transformers' ``recomposition_frequencies`` does)."""
    text = _text_fields(raw)
    key, rope = _rope(text)
    value = rope.get("mrope_section", list(DEFAULT_MROPE_SECTION))
    if (not isinstance(value, list) or len(value) != 3
            or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value)):
        raise BuildInputError(f"config.json {key}.mrope_section must be three non-negative integers, got "
                              f"{value!r}")
    merged = {**TEXT_DEFAULTS, **text}
    head_dim = merged.get("head_dim") or int(merged["hidden_size"]) // int(merged["num_attention_heads"])
    if sum(value) != head_dim // 2:
        raise BuildInputError(f"config.json {key}.mrope_section {value} must add up to half the head size "
                              f"({head_dim // 2})")
    return tuple(value)


def text_features(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {"mrope_section": mrope_section(raw)}


VISION_FAMILY = VisionFamily(
    name="qwen2_5_vl",
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    model_types=("qwen2_5_vl",),
    # save_pretrained (transformers 4.x and 5.x) and the hub: model.* / lm_head / visual.*;
    # transformers >= 4.52 in memory: model.language_model.* / model.visual.*.
    text_prefixes=(("model.language_model.", "lm_head."), ("model.", "lm_head.")),
    vision_prefixes=("visual.", "model.visual."),
    projector_prefixes=("visual.merger.", "model.visual.merger."),
    # qwen2_5_vl: what older saves wrote as the vision config's model_type (transformers reads it)
    vision_model_types=("qwen2_5_vl_vision", "qwen2_5_vl"),
    text_model_type="qwen2",
    language_model="qwen2 with M-RoPE (text_config, or the hub's flat config)",
    notes="window-attention ViT (2D rope, fullatt_block_indexes) + 2x2 patch merger, one fp32 vision "
          "graph run per image; tokens per image follow its size (smart_resize between min_pixels and "
          "max_pixels, BICUBIC); M-RoPE positions in the language model; no video, no Qwen2-VL",
    text_config=text_config,
    text_features=text_features,
    builder="inference.builder.vision_qwen2_5_vl",
)
