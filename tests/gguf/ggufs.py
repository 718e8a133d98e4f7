"""Small GGUF files written with the ``gguf`` package's own writer, and their reference checkpoints.

A random tiny model of each family is quantized with ``gguf.quants.quantize`` into the GGUF
(llama-family Q/K rows permuted the way llama.cpp's converter does). The reference checkpoint
is the same model with every weight replaced by ``dequantize(quantize(w))``, saved by
transformers: converting the GGUF must give exactly those weights, and the same logits.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers as tf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from inference.families import family_by_name, family_names
from tests.support.tiny_models import TINY_CONFIG, TINY_VOCAB, random_model

CORPUS = Path(__file__).resolve().parents[2] / "inference" / "data" / "corpus.txt"
#: Every registered family that llama.cpp converts: each has a GGUF parity case (the metadata
#: llama.cpp's converter writes for it is in GGUF_METADATA below).
FAMILIES = tuple(f for f in family_names() if family_by_name(f).gguf_architectures)
TYPES = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1")
VOCAB = TINY_VOCAB
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

COMMON: dict[str, Any] = {
    **TINY_CONFIG,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


#: Per family: (untied?) and the tiny config's overrides on top of the family's own ``tiny``.
_TIED = {"llama": True, "gemma": True, "gemma2": True, "gemma3_text": True,
         "cohere": True, "cohere2": True}  # llama.cpp's command-r and cohere2 have no output tensor
#: Features a test GGUF cannot carry yet, turned off for its reference.
_GGUF_OVERRIDES: dict[str, dict[str, Any]] = {
    # llama.cpp's qwen2moe/qwen3moe make every layer sparse (no mlp_only_layers).
    "qwen2_moe": {"mlp_only_layers": []},
    "qwen3_moe": {"mlp_only_layers": []},
    # llama.cpp's GGUF has no query_pre_attn_scalar: it takes the head size (hidden / heads for the
    # 27B shapes), which is what Gemma 2/3 checkpoints other than 27B have.
    "gemma2": {"query_pre_attn_scalar": 32},
    "gemma3_text": {"query_pre_attn_scalar": 32},
    "starcoder2": {"sliding_window": None},
}


def hf_config(family: str, **overrides: Any) -> tf.PretrainedConfig:
    fam = family_by_name(family)
    kwargs = {**COMMON, **copy.deepcopy(dict(fam.tiny)), **_GGUF_OVERRIDES.get(family, {}),
              "tie_word_embeddings": _TIED.get(family, False), **overrides}
    config: tf.PretrainedConfig = getattr(tf, fam.config_class)(**kwargs)
    return config


def _llama_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    writer.add_rope_dimension_count(cfg.head_dim)


def _mistral_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    _llama_metadata(writer, cfg)
    if cfg.sliding_window:
        writer.add_sliding_window(cfg.sliding_window)


def _qwen3_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)


def _experts(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """TextModel.set_gguf_parameters: the expert counts (num_local_experts or num_experts)."""
    writer.add_expert_count(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)


def _mixtral_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    _llama_metadata(writer, cfg)  # written as "llama" by LlamaModel
    _experts(writer, cfg)


def _qwen2_moe_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    _experts(writer, cfg)  # Qwen2MoeModel.set_gguf_parameters
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)


def _qwen3_moe_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    _qwen3_metadata(writer, cfg)  # head_dim in the hparams: key/value lengths
    _experts(writer, cfg)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def _rope_scaling_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """TextModel.set_gguf_parameters' rope scaling keys (linear, yarn; llama3 is a tensor), of the
    full-attention layers where a config has a rope per layer type (Gemma 3)."""
    params = cfg.rope_parameters or {}
    params = params.get("full_attention", params)
    if params.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(params["factor"])
    elif params.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(params["factor"])
        writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        for key, add in (("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            if params.get(key) is not None:
                add(params[key])


def _phi3_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """Phi3MiniModel.set_gguf_parameters (the rope factors are tensors: :func:`extra_tensors`)."""
    params = cfg.rope_parameters
    writer.add_rope_scaling_orig_ctx_len(params.get("original_max_position_embeddings",
                                                    cfg.max_position_embeddings))
    rot_pct = params.get("partial_rotary_factor", 1.0)
    writer.add_rope_dimension_count(int(rot_pct * cfg.hidden_size) // cfg.num_attention_heads)
    writer.add_sliding_window(cfg.sliding_window or 0)


def _granite_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    _llama_metadata(writer, cfg)
    writer.add_attention_scale(cfg.attention_multiplier)
    writer.add_embedding_scale(cfg.embedding_multiplier)
    writer.add_residual_scale(cfg.residual_multiplier)
    writer.add_logit_scale(cfg.logits_scaling)


def _stablelm_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    # conversion/stablelm.py: the rotated dims of hidden / heads, the parallel flag, the eps.
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(int(cfg.rope_parameters["partial_rotary_factor"] * head_dim))
    writer.add_parallel_residual(cfg.use_parallel_residual)
    writer.add_layer_norm_eps(cfg.layer_norm_eps)


def _phi_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    # conversion/phi.py Phi2Model: the eps, int(factor * hidden) // heads rotated dims. (It also
    # writes feed_forward_length as 4 x hidden, every released Phi's size; the tiny model's MLP is
    # narrower, so this writer keeps the real size.)
    writer.add_layer_norm_eps(cfg.layer_norm_eps)
    factor = cfg.rope_parameters["partial_rotary_factor"]
    writer.add_rope_dimension_count(int(factor * cfg.hidden_size) // cfg.num_attention_heads)


def _starcoder2_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    writer.add_layer_norm_eps(cfg.norm_epsilon)  # TextModel: norm_epsilon; no sliding window


def _nemotron_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    # conversion/nemotron.py: the eps, int(factor * hidden) // heads rotated dims, no rope scaling;
    # TextModel writes key/value lengths from head_dim.
    writer.add_layer_norm_eps(cfg.norm_eps)
    factor = cfg.rope_parameters["partial_rotary_factor"]
    writer.add_rope_dimension_count(int(factor * cfg.hidden_size) // cfg.num_attention_heads)
    writer.add_rope_scaling_type(gguf.RopeScalingType.NONE)


def _gemma_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """GemmaModel.set_gguf_parameters (and Gemma2Model's, Gemma3Model's beyond it)."""
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)


def _gemma2_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    _gemma_metadata(writer, cfg)
    writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)


def _gemma3_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    _gemma_metadata(writer, cfg)
    if cfg.final_logit_softcapping:
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)
    # TextModel.set_gguf_parameters: the sliding layers' rope base
    writer.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])


#: family -> what llama.cpp's converter writes for it beyond the keys every family has.
def _gemma4_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """Gemma3Model's and Gemma4Model's set_gguf_parameters: the window, the global head size as
    key/value length and the sliding one as *_swa, a flag a layer, K/V heads (and, double-wide, MLP
    widths) per layer, the shared layers, the per-layer input width, both rope dimension counts
    and the sliding layers' rope base (TextModel)."""
    types = list(cfg.layer_types)
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    full_dim = cfg.per_layer_config[full[0]].head_dim
    full_kv = cfg.per_layer_config[full[0]].num_key_value_heads
    if cfg.final_logit_softcapping:
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_shared_kv_layers(cfg.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(cfg.hidden_size_per_layer_input or 0)
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in types])
    writer.add_key_length(full_dim)
    writer.add_value_length(full_dim)
    writer.add_key_length_swa(cfg.head_dim)
    writer.add_value_length_swa(cfg.head_dim)
    first_shared = cfg.num_hidden_layers - cfg.num_kv_shared_layers
    if cfg.use_double_wide_mlp:
        ff = cfg.intermediate_size
        widths = [ff if i < first_shared else 2 * ff for i in range(cfg.num_hidden_layers)]
        writer.add_feed_forward_length(widths)
    kv = cfg.num_key_value_heads
    writer.add_head_count_kv([kv if t == "sliding_attention" else full_kv for t in types])
    writer.add_rope_dimension_count(full_dim)
    writer.add_rope_dimension_count_swa(cfg.head_dim)
    writer.add_rope_freq_base_swa(cfg.rope_parameters["sliding_attention"]["rope_theta"])


def _exaone4_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """Exaone4Model.set_gguf_parameters: the window and one flag a layer (true: it slides)."""
    if cfg.sliding_window is not None:
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])


def _cohere_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """CommandR2Model.set_gguf_parameters (TextModel's LayerNorm epsilon, the logit scale)."""
    writer.add_layer_norm_eps(cfg.layer_norm_eps)
    writer.add_logit_scale(cfg.logit_scale)


def _cohere2_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """Cohere2Model.set_gguf_parameters: the window, no pattern (llama.cpp assumes every fourth
    layer global, as transformers' default)."""
    _cohere_metadata(writer, cfg)
    writer.add_sliding_window(cfg.sliding_window)


def _glm4_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """Glm4Model.set_gguf_parameters: the rotated dimensions (and TextModel's head size)."""
    _qwen3_metadata(writer, cfg)
    factor = getattr(cfg, "partial_rotary_factor", None) or (cfg.rope_parameters or {}).get(
        "partial_rotary_factor", 0.5)
    writer.add_rope_dimension_count(int(cfg.head_dim * factor))


def _olmo3_metadata(writer: gguf.GGUFWriter, cfg: Any) -> None:
    """Olmo2Model.set_gguf_parameters for an OLMo 3: the window and one flag a layer."""
    writer.add_sliding_window(cfg.sliding_window)
    writer.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])


GGUF_METADATA: dict[str, Callable[[gguf.GGUFWriter, Any], None]] = {
    "llama": _llama_metadata,
    "mistral": _mistral_metadata,
    "qwen2": lambda writer, cfg: None,
    "qwen3": _qwen3_metadata,
    "mixtral": _mixtral_metadata,
    "qwen2_moe": _qwen2_moe_metadata,
    "qwen3_moe": _qwen3_moe_metadata,
    "phi3": _phi3_metadata,
    "phi": _phi_metadata,
    "granite": _granite_metadata,
    "smollm3": _llama_metadata,
    "gemma": _gemma_metadata,
    "gemma2": _gemma2_metadata,
    "gemma3_text": _gemma3_metadata,
    "gemma4_text": _gemma4_metadata,
    "stablelm": _stablelm_metadata,
    "starcoder2": _starcoder2_metadata,
    "nemotron": _nemotron_metadata,
    "olmo2": lambda writer, cfg: None,
    "seed_oss": lambda writer, cfg: None,
    "exaone4": _exaone4_metadata,
    "olmo3": _olmo3_metadata,
    "cohere": _cohere_metadata,
    "cohere2": _cohere2_metadata,
    "glm4": _glm4_metadata,
    "arcee": lambda writer, cfg: None,
}
#: Families whose Q/K rows llama.cpp's converter permutes (its LlamaModel.modify_tensors).
PERMUTED = frozenset({"llama", "mistral", "mixtral", "granite", "smollm3", "arcee"})
#: Tensors the converter keeps in F32 whatever the output type (FFN_GATE_INP, FFN_GATE_INP_SHEXP).
_ALWAYS_F32 = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")


def _split_experts(state: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    """transformers' fused 3-D experts as the converter's merged per-projection tensors
    (Qwen2MoeModel.modify_tensors: gate_up_proj split into gate_proj and up_proj)."""
    items: list[tuple[str, torch.Tensor]] = []
    for name, param in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, ff = name.removesuffix(".gate_up_proj"), param.shape[1] // 2
            items += [(f"{base}.gate_proj.weight", param[:, :ff]), (f"{base}.up_proj.weight", param[:, ff:])]
        elif name.endswith("mlp.experts.down_proj"):
            items.append((f"{name}.weight", param))
        else:
            items.append((name, param))
    return items


def _join_experts(reference: dict[str, torch.Tensor]) -> None:
    """The reference's merged expert tensors back into transformers' fused parameters."""
    for name in [n for n in reference if n.endswith("mlp.experts.gate_proj.weight")]:
        base = name.removesuffix(".gate_proj.weight")
        reference[f"{base}.gate_up_proj"] = torch.cat(
            [reference.pop(name), reference.pop(f"{base}.up_proj.weight")], dim=1)
        reference[f"{base}.down_proj"] = reference.pop(f"{base}.down_proj.weight")


def extra_tensors(cfg: Any) -> dict[str, np.ndarray]:
    """The tensors llama.cpp's converter generates (``generate_extra_tensors``): LlamaModel's
    ``rope_freqs`` of a llama3 rope, Phi3MiniModel's LongRoPE factors (and its attention factor,
    written as metadata by the caller)."""
    params = cfg.rope_parameters or {}
    if params.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors, as it is written
        base = params.get("rope_theta", 10000.0)
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        factor = params.get("factor", 8.0)
        low_freq_factor = params.get("low_freq_factor", 1.0)
        high_freq_factor = params.get("high_freq_factor", 4.0)
        old_context_len = params.get("original_max_position_embeddings", 8192)
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        rope_factors: list[Any] = []
        for freq in freqs:
            wavelen = 2 * math.pi / freq
            if wavelen < high_freq_wavelen:
                rope_factors.append(1)
            elif wavelen > low_freq_wavelen:
                rope_factors.append(factor)
            else:
                smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
                rope_factors.append(1 / ((1 - smooth) / factor + smooth))
        return {"rope_freqs.weight": torch.tensor(rope_factors, dtype=torch.float32).numpy()}
    full = params.get("full_attention")
    if isinstance(full, dict) and full.get("rope_type") == "proportional":
        # Gemma4Model.generate_extra_tensors: the global layers' pairs that do not rotate get 1e30
        head_full = cfg.per_layer_config[list(cfg.layer_types).index("full_attention")].head_dim
        n_rot = int(head_full * full["partial_rotary_factor"] / 2)
        values = [1.0] * n_rot + [1e30] * (head_full // 2 - n_rot)
        return {"rope_freqs.weight": np.asarray(values, np.float32)}
    if params.get("rope_type") == "longrope" and params.get("long_factor"):
        return {"rope_factors_long.weight": np.asarray(params["long_factor"], np.float32),
                "rope_factors_short.weight": np.asarray(params["short_factor"], np.float32)}
    return {}


def _longrope_attn_factor(cfg: Any) -> float:
    """Phi3MiniModel's attention factor of LongRoPE (max_position_embeddings / the original)."""
    orig = cfg.rope_parameters["original_max_position_embeddings"]
    scale = cfg.max_position_embeddings / orig
    return math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0


#: Families whose converter writes no rope.freq_base (GemmaModel, Gemma2Model: llama.cpp takes 10000).
NO_ROPE_BASE = frozenset({"gemma", "gemma2"})
#: Families whose norm weights (not biases) llama.cpp's converter stores as ``w + 1`` (Gemma,
#: Nemotron's LayerNorm1p).
NORM_PLUS_ONE: frozenset[str] = frozenset({"gemma", "gemma2", "gemma3_text", "nemotron"})


def byte_level_tokenizer() -> Tokenizer:
    """A byte-level BPE of exactly VOCAB tokens trained on the repo's corpus (specials first)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train([str(CORPUS)], trainer)
    assert tok.get_vocab_size() == VOCAB
    return tok


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``permute`` of Q/K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str, arch: str, blocks: int) -> str:
    """llama.cpp's name of a Hugging Face tensor, from the ``gguf`` package's own name map (the
    one llama.cpp's converter uses)."""
    by_name = {v: k for k, v in gguf.MODEL_ARCH_NAMES.items()}
    # llama.cpp's converter writes Mistral checkpoints as "llama" (its own "mistral" is older).
    names = gguf.get_tensor_name_map(by_name.get(arch, gguf.MODEL_ARCH.LLAMA), blocks)
    name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
    assert name is not None, f"gguf has no name for {hf} in {arch}"
    return name


def make_model(family: str, seed: int = 0, **overrides: Any) -> tf.PreTrainedModel:
    model: tf.PreTrainedModel = random_model(hf_config(family, **overrides), seed)
    return model


def write_pair(family: str, qtype: str, out: Path, *, arch: str | None = None,
               with_tokenizer: bool = True, fuse_qkv: bool = False, **overrides: Any) -> tuple[Path, Path]:
    """Write ``out/model.gguf`` and the reference checkpoint ``out/reference``; return both.
    ``overrides``: config fields on top of the family's tiny configuration. ``fuse_qkv`` (F32
    only): each layer's q/k/v weights and biases as one ``attn_qkv`` tensor, as llama.cpp writes
    a checkpoint that has one (Phi-2's original ``Wqkv``)."""
    assert not fuse_qkv or qtype == "F32"
    model = make_model(family, **overrides)
    cfg = model.config
    qt = gguf.GGMLQuantizationType[qtype]
    arch = arch or family_by_name(family).gguf_architectures[0]
    out.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(out / "model.gguf", arch)
    if getattr(cfg, "per_layer_config", None) is not None:
        # Gemma 4: the global values (the sliding layers') where a layer's own differ
        cfg.allow_global_per_layer_attribute_access = True
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if family not in NO_ROPE_BASE:
        writer.add_rope_freq_base(float(params.get("full_attention", params).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(getattr(cfg, "rms_norm_eps", 1e-5))  # as the config says (TextModel)
    writer.add_vocab_size(VOCAB)
    if not getattr(cfg, "head_dim", None):
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    GGUF_METADATA[family](writer, cfg)
    if family != "phi3":  # Phi3MiniModel writes its own rope keys, not TextModel's
        _rope_scaling_metadata(writer, cfg)
    extra = extra_tensors(cfg)
    if "rope_factors_long.weight" in extra:
        writer.add_rope_scaling_attn_factors(_longrope_attn_factor(cfg))
    if with_tokenizer:
        tok = byte_level_tokenizer()
        vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
        state = json.loads(tok.to_str())
        merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list([t for t, _ in vocab])
        writer.add_token_types([3 if t in SPECIALS else 1 for t, _ in vocab])
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_chat_template(CHATML)

    reference: dict[str, torch.Tensor] = {}
    permuted = family in PERMUTED
    name_arch = family_by_name(family).gguf_architectures[0]
    blocks = cfg.num_hidden_layers
    fused: dict[str, list[np.ndarray]] = {}
    for name, param in _split_experts(model.state_dict()):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        # Gemma4Model.filter_tensors names the layer scalar as a weight
        source = f"{name}.weight" if name.endswith("layer_scalar") else name
        if fuse_qkv and ".self_attn." in name and name.rsplit(".", 2)[-2] in ("q_proj", "k_proj", "v_proj"):
            layer, kind = int(name.split(".")[2]), name.rsplit(".", 1)[-1]
            fused.setdefault(f"blk.{layer}.attn_qkv.{kind}", []).append(param.detach().numpy())
            continue
        w = param.detach().numpy().astype(np.float32)
        stored = w
        if permuted and name.endswith("q_proj.weight"):
            stored = permute(w, cfg.num_attention_heads)
        elif permuted and name.endswith("k_proj.weight"):
            stored = permute(w, cfg.num_key_value_heads)
        # rows of no whole block stay F32, as llama.cpp's converter falls back for them (Gemma 4's
        # per-layer projection of 16 inputs)
        if w.ndim >= 2 and qtype != "F32" and not name.endswith(_ALWAYS_F32) \
                and w.shape[-1] % gguf.GGML_QUANT_SIZES[qt][0] == 0:
            data = gguf.quants.quantize(stored, qt)
            writer.add_tensor(_gguf_name(source, name_arch, blocks), data, raw_dtype=qt)
            back = gguf.quants.dequantize(data, qt).astype(np.float32).reshape(w.shape)
            if permuted and name.endswith("q_proj.weight"):
                back = _unpermute(back, cfg.num_attention_heads)
            elif permuted and name.endswith("k_proj.weight"):
                back = _unpermute(back, cfg.num_key_value_heads)
            reference[name] = torch.from_numpy(np.ascontiguousarray(back))
        else:
            plus_one = family in NORM_PLUS_ONE and name.endswith("norm.weight")
            if plus_one:
                stored = stored + np.float32(1.0)
            writer.add_tensor(_gguf_name(source, name_arch, blocks), np.ascontiguousarray(stored))
            # The file holds w + 1 rounded to float32: what it means is that value less 1.
            reference[name] = (torch.from_numpy(stored - np.float32(1.0)) if plus_one
                               else param.detach().clone())
    for name, parts in fused.items():  # q, k, v in the state dict's order
        writer.add_tensor(name, np.ascontiguousarray(np.concatenate(parts).astype(np.float32)))
    for name, values in extra.items():  # float32 vectors, whatever the weights' type
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    _join_experts(reference)
    model.load_state_dict(reference, strict=False)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    ref_dir = out / "reference"
    model.save_pretrained(ref_dir)
    return out / "model.gguf", ref_dir


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


RawTensors = dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType | None]]


def write_raw_gguf(
    path: Path, arch: str, tensors: RawTensors, *, metadata: dict[str, Any] | None = None
) -> Path:
    """A GGUF with chosen architecture, tensors (raw bytes + type) and extra metadata."""
    writer = gguf.GGUFWriter(path, arch)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
    for name, (array, raw) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
