"""Tiny random LLaVA checkpoints written by transformers with their processor (the demo BPE
tokenizer plus an ``<image>`` token, CLIP's image processor, LLaVA 1.5's chat template)."""

from __future__ import annotations

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
