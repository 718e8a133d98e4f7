"""Gemma 3 (``Gemma3ForConditionalGeneration``): a SigLIP vision tower, Gemma 3's multi-modal
projector (the patch grid average-pooled to ``mm_tokens_per_image`` rows, a Gemma RMSNorm, one
matmul) and the Gemma 3 language model of ``text_config`` (``gemma3_text``).

Its images attend to themselves both ways in the language model (transformers' Gemma 3 mask:
causal, or the same image), so the bundle's decoder honours the image runs of a prefill chunk and
the engine keeps each image whole in one chunk; its builder is :mod:`inference.builder.vision_gemma3`.
"""

from __future__ import annotations

from inference.families import VisionFamily

VISION_FAMILY = VisionFamily(
    name="gemma3",
    architectures=("Gemma3ForConditionalGeneration",),
    model_types=("gemma3",),
    # save_pretrained (transformers 5) and the hub's google/gemma-3-*-it write the legacy names; the
    # in-memory layout names them model.language_model / model.vision_tower.
    text_prefixes=(("language_model.model.", "language_model.lm_head."),
                   ("model.language_model.", "lm_head.")),
    vision_prefixes=("vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.",
                     "model.vision_tower."),
    projector_prefixes=("multi_modal_projector.", "model.multi_modal_projector."),
    vision_model_types=("siglip_vision_model",),
    text_model_type="gemma3_text",
    # Gemma3TextConfig's defaults (transformers 5): the hub's gemma-3-4b-it text_config names only
    # hidden/intermediate size, layers, rope_scaling and sliding_window; the rest is these.
    text_defaults={"gemma3_text": {
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
        "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256,
        "sliding_window": 4096, "sliding_window_pattern": 6}},
    notes="SigLIP ViT + Gemma 3 projector (average pool to mm_tokens_per_image, RMSNorm, matmul), one "
          "fp32 vision graph; one image = `<start_of_image>`, mm_tokens_per_image image tokens, "
          "`<end_of_image>` (`\\n\\n` around, as Gemma3Processor writes), its rows attending to each "
          "other both ways; Gemma3ImageProcessor preprocessing; no pan-and-scan",
    builder="inference.builder.vision_gemma3",
)
