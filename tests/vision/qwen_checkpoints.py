"""Tiny random Qwen2.5-VL checkpoints written by transformers with their processor's settings (the
demo BPE tokenizer plus Qwen's vision tokens, Qwen2-VL's image processor, Qwen2.5-VL's chat
template), and transformers' processor of one.

Without torchvision, transformers 5 cannot make a ``Qwen2_5_VLProcessor`` (its video processor
class is unavailable), so :func:`qwen_processor` assembles one around the PIL image processor and
the tokenizer, with no video processor: its ``__call__`` and ``apply_chat_template`` are
transformers' own, which is what the tests compare against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Qwen2.5-VL-Instruct's chat template (Qwen/Qwen2.5-VL-3B-Instruct chat_template.json).
QWEN_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = "
    "video_count.value + 1 %}{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
PATCH, MERGE = 4, 2
#: A vision tower whose windows (window_size 16: 2x2 merged patches) are smaller than the test
#: images, blocks 1 and 3 attending over the whole image, the others within windows.
VISION: dict[str, Any] = {"depth": 4, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                          "out_hidden_size": 64, "patch_size": PATCH, "spatial_merge_size": MERGE,
                          "temporal_patch_size": 2, "window_size": 16, "fullatt_block_indexes": [1, 3]}
TEXT: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
                        "rms_norm_eps": 1e-6,
                        "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3],
                                            "rope_theta": 10000.0}}
#: 8x8 merged patches at most (256 patches), at least 2x2: a few to a few dozen tokens an image.
IMAGE_PROCESSOR: dict[str, Any] = {"min_pixels": 16 * 16, "max_pixels": 64 * 64, "patch_size": PATCH,
                                   "merge_size": MERGE, "temporal_patch_size": 2}


def _tokenizer() -> Any:
    import transformers as tf

    from inference.demo import demo_tokenizer

    tok = tf.PreTrainedTokenizerFast(tokenizer_object=demo_tokenizer(), eos_token="<|im_end|>",
                                     pad_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tok.chat_template = QWEN_VL_TEMPLATE
    return tok


def write_tiny_qwen2_5_vl(out: Path, *, seed: int = 0, vision: dict[str, Any] | None = None,
                          text: dict[str, Any] | None = None, image_processor: dict[str, Any] | None = None,
                          tie: bool = False) -> Path:
    """A seeded random Qwen2_5_VLForConditionalGeneration saved into ``out`` with its tokenizer
    (the chat template in it) and ``preprocessor_config.json``."""
    import torch
    import transformers as tf

    tok = _tokenizer()
    ids = {t: int(tok.convert_tokens_to_ids(t)) for t in VISION_TOKENS}
    config = tf.Qwen2_5_VLConfig(
        vision_config={**VISION, **(vision or {})},
        text_config={**TEXT, **(text or {}), "vocab_size": len(tok), "eos_token_id": tok.eos_token_id,
                     "bos_token_id": None},
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = tf.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # visible norms and biases, peaked logits: greedy comparisons bite
        for name, param in model.named_parameters():
            if "norm" in name or "ln_q" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias") or "language_model" in name or "lm_head" in name:
                param.copy_(0.2 * torch.randn_like(param))
            elif "visual" in name:
                param.copy_(0.1 * torch.randn_like(param))
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(out)
    tok.save_pretrained(out)
    tf.Qwen2VLImageProcessorPil(**{**IMAGE_PROCESSOR, **(image_processor or {})}).save_pretrained(out)
    return out


def qwen_processor(checkpoint: Path) -> Any:
    """transformers' ``Qwen2_5_VLProcessor`` of a checkpoint :func:`write_tiny_qwen2_5_vl` wrote
    (its image processor and tokenizer as saved there; no video processor)."""
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(checkpoint)
    processor = tf.Qwen2_5_VLProcessor.__new__(tf.Qwen2_5_VLProcessor)
    processor.image_processor = tf.Qwen2VLImageProcessorPil.from_pretrained(checkpoint)
    processor.tokenizer, processor.video_processor = tok, None
    processor.chat_template = tok.chat_template
    processor.image_token, processor.video_token = "<|image_pad|>", "<|video_pad|>"
    processor.image_token_id = tok.convert_tokens_to_ids("<|image_pad|>")
    processor.video_token_id = tok.convert_tokens_to_ids("<|video_pad|>")
    return processor
