"""GGUF file -> Hugging Face checkpoint directory (config, safetensors, tokenizer).

llama.cpp's GGUF holds the model config as ``<arch>.*`` metadata, the tokenizer as
``tokenizer.*`` metadata, and the weights in its own tensor names and block-quantized types.
``convert_gguf`` writes what the rest of the builder reads from any checkpoint:

* ``config.json`` / ``generation_config.json`` from the metadata (llama, mistral, qwen2, qwen3);
* ``model.safetensors``: every tensor under its Hugging Face name, quantized types dequantized
  to float32 (F16/BF16 kept as they are), and the Q/K row permutation that llama.cpp's
  converter applies to llama-family attention undone;
* ``gguf_q4_blocks.safetensors`` when the file has Q4_0/Q4_1 linear weights: their raw blocks
  (rows in Hugging Face order), so an ``int4`` build uses the file's own 4-bit codes with no
  requantization (see ``inference.builder.quantized``);
* ``tokenizer.json`` / ``tokenizer_config.json`` / ``special_tokens_map.json`` (see
  ``gguf_tokenizer``).

Anything it cannot convert faithfully raises ``BuildInputError`` naming the problem.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inference.builder.errors import BuildInputError
from inference.builder.gguf_tokenizer import write_tokenizer_files
from inference.builder.safetensors_writer import PlannedTensor, SafetensorsWriter

#: Bump whenever the converted files change for the same GGUF.
CONVERTER_VERSION = "gguf-1"
WEIGHTS_FILE = "model.safetensors"
Q4_BLOCKS_FILE = "gguf_q4_blocks.safetensors"
#: Q4 block types kept raw; their names in the blocks file end with ``.<type>``.
Q4_TYPES = ("Q4_0", "Q4_1")
#: Tensor types the converter reads (all have a numpy dequantizer in the ``gguf`` package).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

#: GGUF ``general.architecture`` -> (transformers class, model_type, Q/K rows permuted by llama.cpp).
ARCHITECTURES: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "mistral": ("MistralForCausalLM", "mistral", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
    "qwen3": ("Qwen3ForCausalLM", "qwen3", False),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

Progress = Callable[[str, float], None]


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor name (``BuildInputError`` for an unknown one)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise BuildInputError(
        f"GGUF tensor {gguf_name!r} has no counterpart in the supported architectures "
        f"({', '.join(ARCHITECTURES)}); this file is of a variant cachesvc cannot convert"
    )


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of Q/K rows (rows may be values or raw quant blocks).

    llama.cpp interleaves the two rotary halves of every head (its RoPE is GPT-J style);
    transformers keeps them as halves (``rotate_half``). Rows are the output features.
    """
    head_rows = rows.shape[0] // n_head
    out = rows.reshape(n_head, head_rows // 2, 2, *rows.shape[1:]).swapaxes(1, 2)
    return np.ascontiguousarray(out.reshape(rows.shape))


@dataclass(frozen=True)
class _Tensor:
    gguf: Any  # gguf.ReaderTensor
    name: str  # Hugging Face name
    shape: tuple[int, ...]  # Hugging Face order
    type_name: str
    out_dtype: str  # safetensors code in model.safetensors
    permute_heads: int | None


def open_gguf(path: Path) -> Any:
    """Open ``path`` with ``gguf.GGUFReader``; a truncated or foreign file -> ``BuildInputError``."""
    from gguf import GGUFReader

    path = Path(path)
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors...
        raise BuildInputError(
            f"{path.name} is not a readable GGUF file ({type(exc).__name__}: {exc}); the file is truncated "
            "or corrupt, download it again"
        ) from exc
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise BuildInputError(
                f"{path.name} is truncated: tensor {t.name!r} ends at byte {end} "
                f"but the file has {size} bytes; download it again"
            )
    return reader


def gguf_metadata(reader: Any, key: str, default: Any = None) -> Any:
    """The value of one metadata key (strings decoded, arrays as lists)."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _architecture(reader: Any) -> tuple[str, str, str, bool]:
    arch = gguf_metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise BuildInputError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}"
        )
    cls, model_type, permuted = ARCHITECTURES[arch]
    return arch, cls, model_type, permuted


def _required(reader: Any, key: str) -> int:
    value = gguf_metadata(reader, key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BuildInputError(f"GGUF metadata {key!r} is missing or not a positive integer (got {value!r})")
    return value


def gguf_config(reader: Any) -> dict[str, Any]:
    """``config.json`` contents from the GGUF metadata and tensor list."""
    arch, cls, model_type, _ = _architecture(reader)
    names = {t.name for t in reader.tensors}
    heads = _required(reader, f"{arch}.attention.head_count")
    kv_heads = gguf_metadata(reader, f"{arch}.attention.head_count_kv") or heads
    hidden = _required(reader, f"{arch}.embedding_length")
    head_dim = gguf_metadata(reader, f"{arch}.attention.key_length") or hidden // heads
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise BuildInputError("the GGUF has no token_embd.weight tensor; it is not a complete model")
    vocab = gguf_metadata(reader, f"{arch}.vocab_size") or int(embd.shape[1])
    if "rope_freqs.weight" in names:
        raise BuildInputError(
            "this GGUF carries rope_freqs (llama3-style rope scaling), which the converter does not "
            "support yet; use the original safetensors checkpoint"
        )
    config: dict[str, Any] = {
        "architectures": [cls],
        "model_type": model_type,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": _required(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": _required(reader, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": float(gguf_metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(gguf_metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(gguf_metadata(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
    }
    scaling = gguf_metadata(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise BuildInputError(f"unsupported GGUF rope scaling {scaling!r}; supported: linear")
        config["rope_scaling"] = {
            "rope_type": "linear",
            "factor": float(gguf_metadata(reader, f"{arch}.rope.scaling.factor", 1.0)),
        }
    if model_type in ("llama", "mistral"):
        config["attention_bias"] = "blk.0.attn_q.bias" in names
        config["mlp_bias"] = "blk.0.ffn_up.bias" in names
    if model_type == "mistral":
        config["sliding_window"] = gguf_metadata(reader, f"{arch}.attention.sliding_window")
    if model_type in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    for key, meta in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        value = gguf_metadata(reader, f"tokenizer.ggml.{meta}")
        if isinstance(value, int):
            config[key] = value
    return config


def _plan(reader: Any, config: dict[str, Any], permuted: bool) -> list[_Tensor]:
    from gguf import GGMLQuantizationType

    plan: list[_Tensor] = []
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        type_name = GGMLQuantizationType(t.tensor_type).name
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        out_dtype = type_name if type_name in ("F16", "BF16") else "F32"
        heads: int | None = None
        if permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            heads = config["num_attention_heads"]
        elif permuted and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            heads = config["num_key_value_heads"]
        plan.append(_Tensor(t, name, shape, type_name, out_dtype, heads))
    return plan


def _values(t: _Tensor) -> np.ndarray:
    from gguf.quants import dequantize

    raw = t.gguf.data
    if t.type_name == "F16":
        arr = np.asarray(raw, dtype="<f2")
    elif t.type_name == "BF16":
        arr = np.asarray(raw).view("<u2")
    else:
        arr = dequantize(np.asarray(raw), t.gguf.tensor_type).astype(np.float32, copy=False)
    arr = arr.reshape(t.shape)
    if t.permute_heads is not None:
        arr = unpermute_rows(arr, t.permute_heads)
    return arr


def _check_types(plan: list[_Tensor]) -> None:
    """Refuse an unsupported tensor type before any tensor is read."""
    for t in plan:
        if t.type_name not in SUPPORTED_TYPES:
            raise BuildInputError(
                f"GGUF tensor {t.gguf.name!r} has type {t.type_name}, which is not supported; "
                f"supported types: {', '.join(SUPPORTED_TYPES)}"
            )


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress | None = None) -> dict[str, Any]:
    """Convert ``gguf_path`` into the existing, empty directory ``out_dir``; return the config.

    Raises ``BuildInputError`` for a truncated file, an unsupported architecture or tensor
    type, or a file without a tokenizer; the caller discards ``out_dir`` on any error.
    """
    report = progress or (lambda stage, fraction: None)
    out_dir = Path(out_dir)
    reader = open_gguf(gguf_path)
    config = gguf_config(reader)
    _, _, _, permuted = _architecture(reader)
    plan = _plan(reader, config, permuted)
    _check_types(plan)
    # The tokenizer first: it is cheap, and a file without one fails before any tensor is read.
    write_tokenizer_files(reader, out_dir)

    q4 = [t for t in plan if t.type_name in Q4_TYPES and t.name.endswith(".weight") and len(t.shape) == 2]
    weights_plan = [PlannedTensor(t.name, t.out_dtype, t.shape) for t in plan]
    meta = {"format": "pt", "converted_from": "gguf", "converter": CONVERTER_VERSION}
    with SafetensorsWriter(out_dir / WEIGHTS_FILE, weights_plan, metadata=meta) as w:
        for i, t in enumerate(plan):
            w.write(t.name, _values(t))
            report("convert", (i + 1) / len(plan))
    if q4:
        blocks_plan = [PlannedTensor(f"{t.name}.{t.type_name}", "U8", tuple(t.gguf.data.shape)) for t in q4]
        with SafetensorsWriter(out_dir / Q4_BLOCKS_FILE, blocks_plan,
                               metadata={"format": "gguf-q4-blocks", "converter": CONVERTER_VERSION}) as w:
            for t, planned in zip(q4, blocks_plan, strict=True):
                rows = np.asarray(t.gguf.data, dtype=np.uint8)
                if t.permute_heads is not None:
                    rows = unpermute_rows(rows, t.permute_heads)
                w.write(planned.name, rows)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation: dict[str, Any] = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                                  if k in config}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
    return config
