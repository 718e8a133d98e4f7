"""The vision-language family registry: the docs table, the language model's family, refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import transformers as tf

from cachesvc.cache.checkpoints import check_family
from cachesvc.errors import UnsupportedModelError
from inference.builder.model_config import model_config_from
from inference.errors import BuildInputError
from inference.families import VISION_FAMILIES, family_of_config, vision_support_table

DOCS = Path(__file__).resolve().parents[2] / "docs" / "model-families.md"
LLAVA: dict[str, Any] = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
         "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "num_attention_heads": 4},
         "text_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                         "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}}


def test_the_docs_table_is_the_registry() -> None:
    table = re.search(r"<!-- vision-families:start -->\n(.*)<!-- vision-families:end -->", DOCS.read_text(),
                      re.S)
    assert table is not None, "docs/model-families.md lost its vision table markers"
    assert table.group(1) == vision_support_table()


def test_every_vision_family_names_a_transformers_class() -> None:
    for family in VISION_FAMILIES:
        for arch in family.architectures:
            assert hasattr(tf, arch), arch


def test_the_language_model_is_its_text_family() -> None:
    assert family_of_config(LLAVA).name == "llama"
    cfg = model_config_from(LLAVA)
    assert (cfg.architecture, cfg.model_type) == ("LlavaForConditionalGeneration", "llama")
    assert cfg.hidden_size == 64
    qwen = {**LLAVA, "text_config": {**LLAVA["text_config"], "model_type": "qwen2"}}
    assert family_of_config(qwen).name == "qwen2"


def test_unknown_language_models_and_vision_families_are_refused(tmp_path: Path) -> None:
    bad = {**LLAVA, "text_config": {"model_type": "gpt2"}}
    with pytest.raises(BuildInputError, match=r"'gpt2' \(the language model of a llava checkpoint\)"):
        family_of_config(bad)
    (tmp_path / "config.json").write_text('{"architectures": ["PaliGemmaForConditionalGeneration"]}')
    refusal = (r"unsupported model family 'PaliGemmaForConditionalGeneration'.*"
               r"vision-language: llava\b.*\bsmolvlm")
    with pytest.raises(UnsupportedModelError, match=refusal):
        check_family(tmp_path)
    (tmp_path / "config.json").write_text(
        '{"architectures": ["LlavaForConditionalGeneration"], "vision_config": {"model_type": "siglip"}}')
    with pytest.raises(UnsupportedModelError, match=r"vision_config\.model_type 'siglip' is not supported"):
        check_family(tmp_path)


def test_a_hub_config_takes_transformers_defaults() -> None:
    """llava-1.5-7b-hf's config.json names only what differs from LlamaConfig's defaults in its
    text_config: the rest is transformers' default, as LlavaConfig reads it."""
    hub: dict[str, Any] = {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "image_token_index": 32000,
        "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                        "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                        "torch_dtype": "float16", "vocab_size": 32064},
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "model_type": "clip_vision_model", "num_attention_heads": 16,
                          "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768,
                          "vocab_size": 32000},
    }
    reference: Any = tf.LlavaConfig.from_dict(hub).text_config
    cfg = model_config_from(hub)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (
        reference.vocab_size, reference.hidden_size, reference.intermediate_size, reference.num_hidden_layers,
        reference.num_attention_heads, reference.num_key_value_heads, reference.max_position_embeddings,
        reference.rms_norm_eps, reference.tie_word_embeddings)
    assert cfg.vocab_size == 32064 and cfg.num_layers == 32


#: HuggingFaceTB/SmolVLM2-500M-Video-Instruct's config.json (as its model card has it).
SMOLVLM2_500M: dict[str, Any] = {
    "architectures": ["SmolVLMForConditionalGeneration"], "image_token_id": 49190, "model_type": "smolvlm",
    "pad_token_id": 128002, "scale_factor": 4,
    "text_config": {"architectures": ["VLlama3ForCausalLM"], "head_dim": 64, "hidden_size": 960,
                    "intermediate_size": 2560, "is_llama_config": True, "max_position_embeddings": 8192,
                    "model_type": "llama", "neftune_noise_alpha": 0.0, "num_attention_heads": 15,
                    "num_hidden_layers": 32, "num_key_value_heads": 5, "pad_token_id": 2,
                    "pixel_shuffle_factor": 4, "qk_layer_norms": False, "rms_norm_eps": 1e-05,
                    "rope_interleaved": False, "rope_theta": 100000, "torch_dtype": "bfloat16",
                    "use_resampler": False, "vocab_size": 49280},
    "tie_word_embeddings": False, "torch_dtype": "float32", "transformers_version": "4.47.1",
    "use_cache": False, "use_reentrant_checkpointing": False,
    "vision_config": {"hidden_size": 768, "image_size": 512, "max_image_size": {"longest_edge": 512},
                      "model_type": "smolvlm_vision", "num_attention_heads": 12, "patch_size": 16,
                      "size": {"longest_edge": 2048}, "tie_word_embeddings": False, "use_base_siglip": False},
    "vocab_size": 49280,
}


@pytest.mark.parametrize("hub", ["smolvlm2-500m", "smolvlm-256m-shaped", "tied-at-the-top"])
def test_idefics3_hub_configs_read_as_transformers_does(hub: str) -> None:
    """The language model of SmolVLM2-500M's config and of an Idefics3 config shaped like
    SmolVLM-256M-Instruct's (its vision_config's model_type siglip_vision_model, which
    transformers reads as its own vision config) is transformers'; the lm_head is tied by the
    top-level tie_word_embeddings, as transformers' Idefics3 models tie it."""
    from inference.builder.vision_idefics3 import tiled_config_from

    raw: dict[str, Any] = json.loads(json.dumps(SMOLVLM2_500M))
    config_class: Any = tf.SmolVLMConfig
    if hub != "smolvlm2-500m":
        config_class = tf.Idefics3Config
        raw.update(architectures=["Idefics3ForConditionalGeneration"], model_type="idefics3")
        raw["text_config"].update(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                  num_attention_heads=9, num_key_value_heads=3)
        raw["vision_config"]["model_type"] = "siglip_vision_model"
    if hub == "tied-at-the-top":
        raw["tie_word_embeddings"] = True
        raw["text_config"]["tie_word_embeddings"] = False
    reference = config_class.from_dict(raw)
    text = reference.text_config
    cfg = model_config_from(raw)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings, cfg.rms_norm_eps) == (
        text.vocab_size, text.hidden_size, text.intermediate_size, text.num_hidden_layers,
        text.num_attention_heads, text.num_key_value_heads, text.head_dim, text.max_position_embeddings,
        text.rms_norm_eps)
    assert cfg.tie_word_embeddings is reference.tie_word_embeddings is (hub == "tied-at-the-top")
    assert cfg.architecture == raw["architectures"][0] and cfg.model_type == "llama"
    vision = tiled_config_from(raw, cfg.hidden_size)
    ref_vision = reference.vision_config
    assert (vision.hidden_size, vision.intermediate_size, vision.num_layers, vision.num_heads,
            vision.image_size, vision.patch_size, vision.layer_norm_eps, vision.scale_factor,
            vision.image_token_id) == (
        ref_vision.hidden_size, ref_vision.intermediate_size, ref_vision.num_hidden_layers,
        ref_vision.num_attention_heads, ref_vision.image_size, ref_vision.patch_size,
        ref_vision.layer_norm_eps, reference.scale_factor, reference.image_token_id)
