"""Tiny base checkpoints and PEFT LoRA adapters for the LoRA tests (written by transformers and
peft themselves)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.support.tiny_models import TINY_CONFIG

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_base(out: Path, *, seed: int = 0, **config: Any) -> Path:
    """A tiny random Llama checkpoint (``save_pretrained``); ``config`` overrides TINY_CONFIG."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**{**TINY_CONFIG, **config}))
    model.save_pretrained(out)
    return out


def write_adapter(base: Path, out: Path, *, seed: int, rank: int = 4, targets: list[str] = TARGETS,
                  rslora: bool = False) -> Path:
    """A random PEFT LoRA adapter of ``base`` (A and B both random, so it changes the output)
    saved with ``save_pretrained``."""
    import peft
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False,
                             use_rslora=rslora)
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(0.3 * torch.randn_like(param))
    peft_model.save_pretrained(str(out))
    return out
