"""The vision-language family registry: the docs table, the language model's family, refusals."""

from __future__ import annotations

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
    (tmp_path / "config.json").write_text('{"architectures": ["Idefics3ForConditionalGeneration"]}')
    refusal = r"unsupported model family 'Idefics3ForConditionalGeneration'.*vision-language: llava"
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
