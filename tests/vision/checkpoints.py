"""Tiny random LLaVA checkpoints written by transformers with their processor (the demo BPE
tokenizer plus an ``<image>`` token, CLIP's image processor, LLaVA 1.5's chat template)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

#: LLaVA 1.5's chat template (llava-hf/llava-1.5-7b-hf): images first, then the text of each turn.
LLAVA_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}"
    "{% endif %}{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ content['text'] + ' '}}{% endfor %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH = 32, 8
VISION: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
                          "num_attention_heads": 4, "image_size": IMAGE_SIZE, "patch_size": PATCH,
                          "projection_dim": 32}
#: The language model (its vocabulary: the tokenizer's, so every id the model can pick decodes).
TEXT: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "max_position_embeddings": 512, "initializer_range": 0.2}
#: LLaVA 1.5's vision tower (CLIP ViT-L/14 at 336 pixels) and a language model as wide as its
#: 7B's (one thin layer: only the projector's width matters to the vision graph).
LLAVA_15_VISION: dict[str, Any] = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                                   "num_attention_heads": 16, "image_size": 336, "patch_size": 14,
                                   "projection_dim": 768}
LLAVA_15_TEXT: dict[str, Any] = {"hidden_size": 4096, "intermediate_size": 256, "num_hidden_layers": 1,
                                 "num_attention_heads": 32, "num_key_value_heads": 8}


def write_tiny_llava(out: Path, *, seed: int = 0, strategy: Literal["default", "full"] = "default",
                     feature_layer: int | list[int] = -2, vision: dict[str, Any] | None = None,
                     text: dict[str, Any] | None = None) -> Path:
    """A seeded random LlavaForConditionalGeneration and its processor, saved into ``out``;
    ``vision`` / ``text`` replace the tiny shapes (a real-size tower for the bench)."""
    vision = {**VISION, **(vision or {})}
    text = {**TEXT, **(text or {})}
    size, patch = int(vision["image_size"]), int(vision["patch_size"])
    import torch
    import transformers as tf

    from inference.demo import demo_tokenizer

    tok = tf.PreTrainedTokenizerFast(tokenizer_object=demo_tokenizer(), eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token = int(tok.convert_tokens_to_ids(IMAGE_TOKEN))  # type: ignore[arg-type]
    config = tf.LlavaConfig(
        vision_config=tf.CLIPVisionConfig(**vision), text_config=tf.LlamaConfig(
            **text, vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=None),
        image_token_index=image_token, vision_feature_select_strategy=strategy,
        vision_feature_layer=feature_layer,
        image_seq_length=(size // patch) ** 2 + (strategy == "full"))
    torch.manual_seed(seed)
    model = tf.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # visible norms and biases, peaked logits: greedy comparisons bite
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias") or "language_model" in name or "projector" in name:
                param.copy_(0.2 * torch.randn_like(param))
    model.save_pretrained(out)
    processor = tf.LlavaProcessor(
        image_processor=tf.CLIPImageProcessor(size={"shortest_edge": size},
                                              crop_size={"height": size, "width": size}),
        tokenizer=tok, patch_size=patch,
        vision_feature_select_strategy=strategy, num_additional_image_tokens=1,
        chat_template=LLAVA_TEMPLATE)
    processor.save_pretrained(out)
    return out


#: SmolVLM's chat template (HuggingFaceTB/SmolVLM-256M-Instruct; SmolVLMProcessor's default
#: without its video branch): images in place among the text parts.
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
#: The tokens the hub's SmolVLM tokenizers add (the processors add the first three themselves).
IDEFICS3_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>",
                   *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7))]
#: A tiny SigLIP tower: 32-pixel tiles of 8-pixel patches, 4x4 patches, 4 tokens a tile at scale 2.
TILED_VISION: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "image_size": 32, "patch_size": 8}
#: SmolVLM2-500M-Video-Instruct's vision config (SigLIP base patch16 at 512: width 768, 12 layers,
#: 12 heads) and scale_factor 4 (64 tokens a tile), with a one-layer language model as wide as its
#: (960; only the connector's width matters to the vision graph).
SMOLVLM_500M_VISION: dict[str, Any] = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                                       "num_attention_heads": 12, "image_size": 512, "patch_size": 16}
SMOLVLM_500M_TEXT: dict[str, Any] = {"hidden_size": 960, "intermediate_size": 256, "num_hidden_layers": 1,
                                     "num_attention_heads": 15, "num_key_value_heads": 5, "head_dim": 64}


def write_tiny_idefics3(out: Path, *, family: Literal["idefics3", "smolvlm"] = "idefics3", seed: int = 0,
                        vision: dict[str, Any] | None = None, text: dict[str, Any] | None = None,
                        scale_factor: int = 2, tile: int | None = None, longest_edge: int = 96,
                        tied: bool = False, image_processor: dict[str, Any] | None = None) -> Path:
    """A seeded random Idefics3ForConditionalGeneration (or SmolVLMForConditionalGeneration) and
    its processor's files, saved into ``out``: tiles of ``tile`` pixels (default: the tower's
    image_size), images resized to ``longest_edge`` first. Idefics3 as transformers 5 saves its
    processor (``processor_config.json`` with the image processor inside); SmolVLM as the hub keeps
    it (``preprocessor_config.json``, ``processor_config.json`` with ``image_seq_len`` only, the
    marker tokens in the tokenizer's ``extra_special_tokens``), since SmolVLMProcessor itself needs
    num2words and torchvision (its video processor). ``tied``: the top-level
    ``tie_word_embeddings`` (the text_config's stays False, as transformers writes it)."""
    vision = {**TILED_VISION, **(vision or {})}
    text = {**TEXT, **(text or {})}
    tile = tile or int(vision["image_size"])
    import torch
    import transformers as tf

    from inference.demo import demo_tokenizer

    tok = tf.PreTrainedTokenizerFast(tokenizer_object=demo_tokenizer(), eos_token="<end_of_utterance>",
                                     pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": IDEFICS3_TOKENS})
    image_token = int(tok.convert_tokens_to_ids("<image>"))  # type: ignore[arg-type]
    config_class: Any = tf.Idefics3Config if family == "idefics3" else tf.SmolVLMConfig
    model_class: Any = (tf.Idefics3ForConditionalGeneration if family == "idefics3"
                        else tf.SmolVLMForConditionalGeneration)
    config = config_class(
        vision_config={**vision, "model_type": f"{family}_vision"},
        text_config={"model_type": "llama", **text, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                     "bos_token_id": None, "pad_token_id": tok.pad_token_id},
        image_token_id=image_token, scale_factor=scale_factor, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():  # visible norms and biases, peaked logits: greedy comparisons bite
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias") or "text_model" in name or "connector" in name or "lm_head" in name:
                param.copy_(0.2 * torch.randn_like(param))
            elif "position_embedding" in name:
                param.copy_(torch.randn_like(param))  # positions that move the features
    model.save_pretrained(out)
    grid = tile // int(vision["patch_size"]) // scale_factor
    settings = {"size": {"longest_edge": longest_edge}, "max_image_size": {"longest_edge": tile},
                **(image_processor or {})}
    if family == "idefics3":
        processor = tf.Idefics3Processor(image_processor=tf.Idefics3ImageProcessorPil(**settings),
                                         tokenizer=tok, image_seq_len=grid * grid,
                                         chat_template=SMOLVLM_TEMPLATE)
        processor.save_pretrained(out)
        return out
    tok.save_pretrained(out)
    config_file = out / "tokenizer_config.json"
    tokenizer_config = json.loads(config_file.read_text())
    tokenizer_config["extra_special_tokens"] = {
        "fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
        "global_image_token": "<global-img>", "end_of_utterance_token": "<end_of_utterance>"}
    config_file.write_text(json.dumps(tokenizer_config, indent=2))
    tf.SmolVLMImageProcessorPil(**settings).save_pretrained(out)
    (out / "processor_config.json").write_text(json.dumps(
        {"image_seq_len": grid * grid, "processor_class": "SmolVLMProcessor"}))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": SMOLVLM_TEMPLATE}))
    return out
