"""Where a layer's weights are: slots (what a weight does) -> names (what a checkpoint calls it).

The graph builder asks for weights by slot; a family's module renames the slots its
checkpoints name differently from Llama (``Family.hf_names``); llama.cpp's GGUF names are
semantic, so one table (:data:`GGUF_SLOTS`, plus ``Family.gguf_slots``) maps them onto the same
slots. :func:`expected_tensors` lists every tensor a configuration reads: the demo writer writes
exactly these, and a test holds the graph builder to them.
"""

from __future__ import annotations

from collections.abc import Mapping

from inference.builder.model_config import ModelConfig

#: slot -> Llama's Hugging Face name under ``model.layers.{i}.`` (weights add ``.weight``/``.bias``).
HF_LAYER_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "qkv": "self_attn.qkv_proj",
    "o": "self_attn.o_proj",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
    "attn_post_norm": "post_attention_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "mlp_post_norm": "post_feedforward_layernorm",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "gate_up": "mlp.gate_up_proj",
    "down": "mlp.down_proj",
    # The mixture-of-experts MLP: router, experts (``{e}``: the expert), shared expert and its gate.
    "router": "mlp.gate",
    "expert_gate": "mlp.experts.{e}.gate_proj",
    "expert_up": "mlp.experts.{e}.up_proj",
    "expert_down": "mlp.experts.{e}.down_proj",
    "shared_gate": "mlp.shared_expert.gate_proj",
    "shared_up": "mlp.shared_expert.up_proj",
    "shared_down": "mlp.shared_expert.down_proj",
    "shared_expert_gate": "mlp.shared_expert_gate",
    # Per-layer inputs (Gemma 4's PLE): the gate from the hidden state, the projection back, its norm;
    # and the layer's output scalar (a tensor of one value, no ``.weight``).
    "ple_gate": "per_layer_input_gate",
    "ple_proj": "per_layer_projection",
    "ple_norm": "post_per_layer_input_norm",
    "layer_scalar": "layer_scalar",
}
#: Slots of one tensor per expert (llama.cpp stores each as one 3-D tensor of every expert).
EXPERT_SLOTS = ("expert_gate", "expert_up", "expert_down")
#: slot -> Hugging Face name of the tensors outside the layers.
HF_GLOBAL_NAMES: dict[str, str] = {
    "embed": "model.embed_tokens",
    "final_norm": "model.norm",
    "lm_head": "lm_head",
    # Gemma 4's per-layer inputs: the token table of every layer's slice, the projection of the
    # embedding to them, its norm
    "ple_embed": "model.embed_tokens_per_layer",
    "ple_model_proj": "model.per_layer_model_projection",
    "ple_proj_norm": "model.per_layer_projection_norm",
}
#: Slots whose tensor is the module name itself (no ``.weight``).
BARE_SLOTS = ("layer_scalar",)
#: llama.cpp's layer tensor names (``blk.{i}.<name>.weight``) -> slot.
GGUF_SLOTS: dict[str, str] = {
    "attn_norm": "attn_norm",
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_qkv": "qkv",
    "attn_output": "o",
    "attn_q_norm": "q_norm",
    "attn_k_norm": "k_norm",
    "post_attention_norm": "attn_post_norm",
    "ffn_norm": "mlp_norm",
    "post_ffw_norm": "mlp_post_norm",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
    "ffn_gate_inp": "router",
    "ffn_gate_exps": "expert_gate",
    "ffn_up_exps": "expert_up",
    "ffn_down_exps": "expert_down",
    "ffn_gate_shexp": "shared_gate",
    "ffn_up_shexp": "shared_up",
    "ffn_down_shexp": "shared_down",
    "ffn_gate_inp_shexp": "shared_expert_gate",
}
#: llama.cpp's global tensor names -> slot.
GGUF_GLOBAL_SLOTS: dict[str, str] = {
    "token_embd": "embed",
    "output_norm": "final_norm",
    "output": "lm_head",
    "per_layer_token_embd": "ple_embed",
    "per_layer_model_proj": "ple_model_proj",
    "per_layer_proj_norm": "ple_proj_norm",
}
#: Norm slots (a family's norm offset applies to these; their weights are vectors).
NORM_SLOTS = ("attn_norm", "attn_post_norm", "mlp_norm", "mlp_post_norm", "q_norm", "k_norm", "final_norm",
              "ple_norm", "ple_proj_norm")


class Names:
    """The Hugging Face names of one family's weights."""

    def __init__(self, overrides: Mapping[str, str] | None = None,
                 global_overrides: Mapping[str, str] | None = None) -> None:
        self.layer_names = {**HF_LAYER_NAMES, **(overrides or {})}
        self.global_names = {**HF_GLOBAL_NAMES, **(global_overrides or {})}

    def layer(self, i: int, slot: str) -> str:
        """The module name (no ``.weight``) of ``slot`` in layer ``i``."""
        return f"model.layers.{i}.{self.layer_names[slot]}"

    def expert(self, i: int, slot: str, e: int) -> str:
        """The module name of expert ``e``'s ``slot`` (one of :data:`EXPERT_SLOTS`) in layer ``i``."""
        return f"model.layers.{i}.{self.layer_names[slot].format(e=e)}"

    def top(self, slot: str) -> str:
        """The module name of a tensor outside the layers."""
        return self.global_names[slot]

    def as_llama(self, name: str) -> str:
        """``name`` (a layer weight of this family, or fused names joined by ``+``) under Llama's
        name for its slot (``qkv`` -> ``q_proj``, ``gate_up`` -> ``gate_proj``): what the kernel
        plans' projection groups are written against. Other names come back unchanged."""
        parts = name.split(".", 3)
        if len(parts) < 4 or parts[:2] != ["model", "layers"]:
            return name
        path = parts[3].split("+")[0].removesuffix(".weight")
        slot = self.slot_of(path)
        if slot is None:
            return name
        slot = {"qkv": "q", "gate_up": "gate", "up": "gate", "k": "q", "v": "q"}.get(slot, slot)
        return f"model.layers.{parts[2]}.{HF_LAYER_NAMES[slot]}"

    def slot_of(self, suffix: str) -> str | None:
        """The slot of a layer module name (``self_attn.q_proj``), None if no slot has it; where
        two slots share a name (Llama's ``post_attention_layernorm``), the MLP norm."""
        matches = [s for s, n in self.layer_names.items() if n == suffix]
        if "mlp_norm" in matches:
            return "mlp_norm"
        return matches[0] if matches else None


def names_for(cfg: ModelConfig) -> Names:
    """The names of ``cfg``'s family."""
    from inference.families import family_by_name

    family = family_by_name(cfg.family)
    return Names(family.hf_names, family.hf_global_names)


def layer_slots(cfg: ModelConfig, layer: int = 0) -> list[tuple[str, tuple[int, ...], bool]]:
    """(slot, weight shape, has a bias) of every weight of layer ``layer`` of ``cfg`` (an expert
    slot stands for each expert's tensor of that shape)."""
    h, hd = cfg.hidden_size, cfg.head_dim_of(layer)
    q_out, kv_out, ff = cfg.num_heads * hd, cfg.kv_heads_of(layer) * hd, cfg.intermediate_of(layer)
    nb = cfg.norm_bias
    own_kv = cfg.kv_source(layer) == layer  # a layer sharing another's K/V has no k/v weights
    slots: list[tuple[str, tuple[int, ...], bool]] = []
    if cfg.pre_attn_norm:
        slots.append(("attn_norm", (h,), nb))
    if cfg.fused_qkv:
        slots.append(("qkv", (q_out + 2 * kv_out, h), cfg.attention_bias))
    else:
        slots.append(("q", (q_out, h), cfg.attention_bias))
        if own_kv:
            slots.append(("k", (kv_out, h), cfg.attention_bias))
            if layer not in cfg.keys_as_values:
                slots.append(("v", (kv_out, h), cfg.attention_bias))
    if cfg.qk_norm == "head":
        slots += [("q_norm", (hd,), False)] + ([("k_norm", (hd,), False)] if own_kv else [])
    elif cfg.qk_norm == "full":
        slots += [("q_norm", (q_out,), False), ("k_norm", (kv_out,), False)]
    slots.append(("o", (h, q_out), cfg.o_bias))
    if cfg.post_attn_norm:
        slots.append(("attn_post_norm", (h,), nb))
    if cfg.pre_mlp_norm:
        slots.append(("mlp_norm", (h,), nb))
    if cfg.moe is not None and cfg.sparse(layer):
        moe = cfg.moe
        slots += [("router", (moe.num_experts, h), False), ("expert_gate", (moe.expert_size, h), False),
                  ("expert_up", (moe.expert_size, h), False), ("expert_down", (h, moe.expert_size), False)]
        if moe.shared_size:
            ss = moe.shared_size
            slots += [("shared_gate", (ss, h), False), ("shared_up", (ss, h), False),
                      ("shared_down", (h, ss), False)]
        if moe.shared_gate:
            slots.append(("shared_expert_gate", (1, h), False))
    elif cfg.mlp == "gated" and cfg.fused_gate_up:
        slots.append(("gate_up", (2 * ff, h), cfg.mlp_bias))
    elif cfg.mlp == "gated":
        slots += [("gate", (ff, h), cfg.mlp_bias), ("up", (ff, h), cfg.mlp_bias)]
    else:
        slots.append(("up", (ff, h), cfg.mlp_bias))
    if not cfg.sparse(layer):
        slots.append(("down", (h, ff), cfg.mlp_bias))
    if cfg.post_mlp_norm:
        slots.append(("mlp_post_norm", (h,), nb))
    if cfg.per_layer_input:
        p = cfg.per_layer_input
        slots += [("ple_gate", (p, h), False), ("ple_proj", (h, p), False), ("ple_norm", (h,), False)]
    if cfg.layer_scalar:
        slots.append(("layer_scalar", (1,), False))
    return slots


def expected_tensors(cfg: ModelConfig, *, tied: bool | None = None) -> dict[str, tuple[int, ...]]:
    """Every tensor ``cfg`` reads, Hugging Face name -> shape (``lm_head`` unless tied)."""
    names = names_for(cfg)
    out: dict[str, tuple[int, ...]] = {f"{names.top('embed')}.weight": (cfg.vocab_size, cfg.hidden_size)}
    for i in range(cfg.num_layers):
        for slot, shape, bias in layer_slots(cfg, i):
            if slot in EXPERT_SLOTS:
                assert cfg.moe is not None
                for e in range(cfg.moe.num_experts):
                    out[f"{names.expert(i, slot, e)}.weight"] = shape
                continue
            out[names.layer(i, slot) if slot in BARE_SLOTS else f"{names.layer(i, slot)}.weight"] = shape
            if bias:
                out[f"{names.layer(i, slot)}.bias"] = shape[:1]
    if cfg.per_layer_input:
        width = cfg.num_layers * cfg.per_layer_input
        out[f"{names.top('ple_embed')}.weight"] = (cfg.per_layer_vocab, width)
        out[f"{names.top('ple_model_proj')}.weight"] = (width, cfg.hidden_size)
        out[f"{names.top('ple_proj_norm')}.weight"] = (cfg.per_layer_input,)
    out[f"{names.top('final_norm')}.weight"] = (cfg.hidden_size,)
    if cfg.norm_bias:
        out[f"{names.top('final_norm')}.bias"] = (cfg.hidden_size,)
    if not (cfg.tie_word_embeddings if tied is None else tied):
        out[f"{names.top('lm_head')}.weight"] = (cfg.vocab_size, cfg.hidden_size)
    if cfg.lm_head_bias:  # tied or not (transformers' Phi keeps its own bias)
        out[f"{names.top('lm_head')}.bias"] = (cfg.vocab_size,)
    return out
