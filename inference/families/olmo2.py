"""OLMo 2 (Olmo2ForCausalLM): no pre-norms, RMSNorm after the attention and after the MLP, and an
RMSNorm over the full q and k projections."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from inference.families import Family


def features(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {"pre_attn_norm": False, "pre_mlp_norm": False, "post_attn_norm": True, "post_mlp_norm": True,
            "qk_norm": "full"}


def gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    return {"attention_bias": "blk.0.attn_q.bias" in names}


FAMILY = Family(
    name="olmo2",
    architectures=("Olmo2ForCausalLM",),
    model_types=("olmo2",),
    config_class="Olmo2Config",
    tiny={"rms_norm_eps": 1e-3},  # an eps unlike the default
    gguf_architectures=("olmo2",),
    features=features,
    gguf_config=gguf_config,
    notes="post-norms only (after attention and MLP); RMSNorm q/k norms over the full projection width",
)
