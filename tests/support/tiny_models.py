"""Tiny model shapes and bundle building shared by the engine, GGUF and TensorRT tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

#: Vocabulary of the tiny checkpoints (the engine tests' fixed tokenizer-free ids stay below it).
TINY_VOCAB = 384
#: Small enough to run in milliseconds, large enough for grouped-query attention (4 q / 2 kv heads).
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": TINY_VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    # std 0.2 instead of 0.02: random models then have peaked logits, so greedy comparisons bite.
    "initializer_range": 0.2,
}


def random_model(config: Any, seed: int = 0) -> Any:
    """A seeded random transformers model of ``config``; norms and biases randomised too so that
    they matter."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
    return model.eval()


def bundle_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: (checkpoint dir, **EngineBuildSpec fields) -> CPU bundle dir, built once each.

    Small defaults (input 64, KV 256) keep builds fast; pass fields to override them.
    """
    from inference.builder import EngineBuildSpec, build_bundle

    cache: dict[tuple[Path, tuple[tuple[str, Any], ...]], Path] = {}

    def build(checkpoint: Path, **spec: Any) -> Path:
        spec.setdefault("max_kv_cache_capacity", 256)
        spec.setdefault("max_input_len", 64)
        key = (checkpoint, tuple(sorted(spec.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp("bundle")
            build_bundle(checkpoint, out, EngineBuildSpec(**spec))
            cache[key] = out
        return cache[key]

    return build
