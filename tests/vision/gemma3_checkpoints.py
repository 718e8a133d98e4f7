"""Tiny random Gemma 3 (vision-language) checkpoints written by transformers with their processor:
the demo BPE tokenizer plus Gemma 3's image and turn tokens, Gemma3ImageProcessor, and Gemma 3's
own chat template (google/gemma-3-4b-it's)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: google/gemma-3-4b-it's chat template (images as <start_of_image>, text parts trimmed).
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)
IMAGE_SIZE, PATCH, TOKENS = 32, 4, 16
#: SigLIP: an 8x8 patch grid pooled 2x2 to 16 rows.
VISION: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "image_size": IMAGE_SIZE, "patch_size": PATCH,
                          "vision_use_head": False}
#: Gemma 3's language model as the text family's tiny case has it (five sliding layers and one
#: full, a window (8) shorter than an image's rows (16), the two ropes apart) with a query scale
#: (4**-0.5) that lets the tiny attention pick: greedy tokens that vary and follow the images.
TEXT: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                        "query_pre_attn_scalar": 4, "sliding_window": 8, "max_position_embeddings": 512,
                        "rope_parameters": {
                            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0}}}


def write_tiny_gemma3(out: Path, *, seed: int = 0, vision: dict[str, Any] | None = None,
                      text: dict[str, Any] | None = None, tokens: int = TOKENS) -> Path:
    """A seeded random Gemma3ForConditionalGeneration and its processor, saved into ``out``;
    ``vision`` / ``text`` replace the tiny shapes, ``tokens`` is mm_tokens_per_image."""
    vision = {**VISION, **(vision or {})}
    text = {**TEXT, **(text or {})}
    import torch
    import transformers as tf

    from inference.demo import demo_tokenizer

    tok = tf.PreTrainedTokenizerFast(
        tokenizer_object=demo_tokenizer(), bos_token="<bos>", eos_token="<end_of_turn>",
        pad_token="<|endoftext|>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>"]})
    ids = {name: int(tok.convert_tokens_to_ids(name))  # type: ignore[arg-type]
           for name in ("<start_of_image>", "<end_of_image>", "<image_soft_token>")}
    config = tf.Gemma3Config(
        vision_config=tf.SiglipVisionConfig(**vision),
        text_config=tf.Gemma3TextConfig(**text, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                                        bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id),
        mm_tokens_per_image=tokens, boi_token_index=ids["<start_of_image>"],
        eoi_token_index=ids["<end_of_image>"], image_token_index=ids["<image_soft_token>"])
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # visible norms and biases, peaked logits: greedy comparisons bite
        for name, param in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                gemma_norm = "vision_tower" not in name  # Gemma's RMSNorms multiply by 1 + w
                param.copy_((0.0 if gemma_norm else 1.0) + 0.2 * torch.randn_like(param))
            elif "language_model" in name:  # smaller: the tokens' own embeddings do not drown the rest
                param.copy_(0.08 * torch.randn_like(param))
            elif name.endswith("bias") or "projector" in name:
                param.copy_(0.2 * torch.randn_like(param))
    model.save_pretrained(out)
    size = int(vision["image_size"])
    processor = tf.Gemma3Processor(
        image_processor=tf.Gemma3ImageProcessorPil(size={"height": size, "width": size}),
        tokenizer=tok, image_seq_length=tokens, chat_template=GEMMA3_TEMPLATE)
    processor.save_pretrained(out)
    return out
