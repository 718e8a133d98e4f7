"""Idefics3 (``Idefics3ForConditionalGeneration``) and SmolVLM (``SmolVLMForConditionalGeneration``):
a SigLIP vision tower, a pixel-shuffle connector and the language model of ``text_config`` (Llama
in both). The hub's SmolVLM-256M/500M-Instruct are Idefics3 checkpoints; SmolVLM2's are SmolVLM
ones. Their vision side is built by :mod:`inference.builder.vision_idefics3`."""

from __future__ import annotations

from inference.families import VisionFamily
from inference.families.llava import VISION_FAMILY as LLAVA

BUILDER = "inference.builder.vision_idefics3"
#: transformers reads a nested vision config of any model_type as its own vision config; the hub's
#: write their own (SmolVLM-256M-Instruct: siglip_vision_model).
VISION_TYPES = ("idefics3_vision", "smolvlm_vision", "siglip_vision_model", "idefics3", "smolvlm")
NOTES = ("SigLIP (learned positions bucketed as transformers does) + pixel-shuffle connector (scale_factor, "
         "one Linear), one fp32 vision graph run per tile; image splitting into tiles of max_image_size plus "
         "the global image, the processor's prompt with tile markers: tokens per image vary with its size; "
         "{processor} preprocessing (PIL backend)")


def _family(name: str, architecture: str, processor: str) -> VisionFamily:
    return VisionFamily(
        name=name,
        architectures=(architecture,),
        model_types=(name,),
        text_prefixes=(("model.text_model.", "lm_head."),),
        vision_prefixes=("model.vision_model.",),
        projector_prefixes=("model.connector.",),
        vision_model_types=VISION_TYPES,
        # Idefics3Config's default language model is LlamaConfig's (the same defaults as LLaVA's).
        text_defaults=LLAMA_DEFAULTS,
        builder=BUILDER,
        tie_from_top=True,
        notes=NOTES.format(processor=processor),
    )


LLAMA_DEFAULTS = LLAVA.text_defaults
IDEFICS3 = _family("idefics3", "Idefics3ForConditionalGeneration", "Idefics3ImageProcessor")
SMOLVLM = _family("smolvlm", "SmolVLMForConditionalGeneration", "SmolVLMImageProcessor")
