"""LLaVA (``LlavaForConditionalGeneration``): a CLIP vision tower, a two-layer MLP projector and the
language model of ``text_config`` (Llama in LLaVA 1.5; any registered text family is built)."""

from __future__ import annotations

from inference.families import VisionFamily

VISION_FAMILY = VisionFamily(
    name="llava",
    architectures=("LlavaForConditionalGeneration",),
    model_types=("llava",),
    # save_pretrained (transformers 4.x and 5.x) writes the legacy names; the hub's llava-hf
    # checkpoints too; the in-memory layout of transformers >= 4.52 names them model.language_model.
    text_prefixes=(("language_model.model.", "language_model.lm_head."),
                   ("model.language_model.", "lm_head.")),
    vision_prefixes=("vision_tower.vision_model.", "vision_tower.", "model.vision_tower.vision_model.",
                     "model.vision_tower."),
    projector_prefixes=("multi_modal_projector.", "model.multi_modal_projector."),
    vision_model_types=("clip_vision_model",),
    # LlamaConfig's defaults (transformers 4.x-5.x): llava-1.5-7b-hf's text_config names only
    # vocab_size, max_position_embeddings and rms_norm_eps; the rest is these.
    text_defaults={"llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
                             "num_hidden_layers": 32, "num_attention_heads": 32,
                             "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
                             "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
                             "hidden_act": "silu", "rope_theta": 10000.0}},
    notes="CLIP ViT (vision_feature_layer, one or several; vision_feature_select_strategy default/full) "
          "+ 2-layer MLP projector, one fp32 vision graph; one image = (image_size / patch_size)^2 "
          "tokens (+1 with full); CLIPImageProcessor preprocessing; no image tiling (LLaVA-NeXT) yet",
)
