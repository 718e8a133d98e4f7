"""Read a GGUF file as a Hugging Face checkpoint: HF tensor names, float32 on request, raw blocks.

llama.cpp's GGUF holds the model config as ``<arch>.*`` metadata, the tokenizer as
``tokenizer.*`` metadata, and the weights in its own tensor names and block-quantized types.
This module says what such a file means in Hugging Face terms (the config of
:func:`gguf_config`, the tensor names of :func:`hf_tensor_name`) and reads its tensors:
:class:`GgufCheckpoint` memory-maps the file and dequantizes one tensor per ``get_f32`` call
with the ``gguf`` package (numpy only), so a build never holds more than one float32 tensor
of it at a time, and the file on disk stays as compact as llama.cpp made it.

llama.cpp's converter permutes the Q/K rows of llama-family attention (its RoPE pairs
neighbouring features; transformers rotates halves): every read here undoes that, so values
and raw block rows come out in Hugging Face order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inference.builder.errors import BuildInputError

#: The GGUF file inside a converted checkpoint directory (see ``gguf_convert``).
GGUF_FILE = "model.gguf"
#: Tensor types the reader reads (all have a numpy dequantizer in the ``gguf`` package).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
#: 4-bit block types whose codes an ``int4`` build keeps as they are (see ``inference.builder.int4``).
Q4_TYPES = ("Q4_0", "Q4_1")
#: Block types :meth:`GgufCheckpoint.blocks` hands out raw: one scale (and minimum) per 32 codes.
RAW_BLOCK_TYPES = (*Q4_TYPES, "Q8_0")

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


def open_gguf(path: Path) -> Any:
    """Open ``path`` with ``gguf.GGUFReader``; a truncated or foreign file -> ``BuildInputError``."""
    from gguf import GGUFReader

    path = Path(path)
    try:
        reader = GGUFReader(path)  # read-only memory map: tensors are paged in when read
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


def gguf_architecture(reader: Any) -> tuple[str, str, str, bool]:
    """(GGUF architecture, transformers class, model_type, Q/K rows permuted); unknown -> error."""
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
    arch, cls, model_type, _ = gguf_architecture(reader)
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


@dataclass(frozen=True)
class GgufTensor:
    """One GGUF tensor as a Hugging Face tensor."""

    gguf: Any  # gguf.ReaderTensor (its data is a view into the read-only memory map)
    name: str  # Hugging Face name
    shape: tuple[int, ...]  # Hugging Face order
    type_name: str  # GGML type: F32, Q4_1, ...
    permute_heads: int | None  # llama.cpp permuted these rows in groups of this many heads


def tensor_plan(reader: Any, config: dict[str, Any]) -> list[GgufTensor]:
    """Every tensor of ``reader`` under its Hugging Face name, shape and row permutation.

    Raises ``BuildInputError`` for a tensor name of no supported architecture or a tensor type
    not in ``SUPPORTED_TYPES``, before any tensor data is read.
    """
    from gguf import GGMLQuantizationType

    _, _, _, permuted = gguf_architecture(reader)
    plan: list[GgufTensor] = []
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        type_name = GGMLQuantizationType(t.tensor_type).name
        if type_name not in SUPPORTED_TYPES:
            raise BuildInputError(
                f"GGUF tensor {t.name!r} has type {type_name}, which is not supported; "
                f"supported types: {', '.join(SUPPORTED_TYPES)}"
            )
        shape = tuple(int(d) for d in reversed([int(x) for x in t.shape]))
        heads: int | None = None
        if permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            heads = config["num_attention_heads"]
        elif permuted and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            heads = config["num_key_value_heads"]
        plan.append(GgufTensor(t, name, shape, type_name, heads))
    return plan


def tensor_f32(t: GgufTensor) -> np.ndarray:
    """Dequantize one tensor to a new float32 array in Hugging Face shape and row order."""
    from gguf.quants import dequantize

    raw = np.asarray(t.gguf.data)
    if t.type_name == "F32":
        arr = np.array(raw, dtype=np.float32)  # a copy: never hand out the read-only map
    elif t.type_name == "F16":
        arr = raw.view("<f2").astype(np.float32)
    elif t.type_name == "BF16":
        # bf16 is the top half of an fp32: shifting the 16-bit pattern up is exact.
        arr = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        arr = dequantize(raw, t.gguf.tensor_type).astype(np.float32, copy=False)
    arr = arr.reshape(t.shape)
    if t.permute_heads is not None:
        arr = unpermute_rows(arr, t.permute_heads)
    return arr


@dataclass(frozen=True)
class RawBlocks:
    """A tensor's quantized blocks as the GGUF stores them.

    ``rows`` is uint8 ``[N, row_bytes]``: one row per output feature in Hugging Face order
    (the Q/K permutation undone on whole rows); the blocks inside a row are untouched.
    """

    type_name: str  # Q4_0, Q4_1 or Q8_0
    rows: np.ndarray


class GgufCheckpoint:
    """The tensors of a GGUF file under Hugging Face names, dequantized one at a time on request.

    Same reading surface as ``SafetensorsCheckpoint``; ``checkpoint_dir`` holds ``model.gguf``
    (a converted checkpoint, see ``gguf_convert``). Opening reads the header only: refuses a
    truncated file, an unknown architecture or tensor name, or an unsupported tensor type.
    """

    def __init__(self, checkpoint_dir: Path) -> None:
        self.dir = Path(checkpoint_dir)
        path = self.dir / GGUF_FILE
        if not path.is_file():
            raise BuildInputError(f"no {GGUF_FILE} in {self.dir}; it is not a converted GGUF checkpoint")
        reader = open_gguf(path)
        self.files = (path,)
        self._tensors = {t.name: t for t in tensor_plan(reader, gguf_config(reader))}

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        """Every tensor name (Hugging Face names; no ``lm_head.weight`` when it is tied)."""
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of ``name`` in Hugging Face order."""
        return self._tensor(name).shape

    def source_dtypes(self) -> set[str]:
        """The GGML tensor types present (F32, F16, Q4_1, Q6_K, ...)."""
        return {t.type_name for t in self._tensors.values()}

    def _tensor(self, name: str) -> GgufTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise BuildInputError(
                f"missing weight {name!r} in {self.dir / GGUF_FILE}; the GGUF is incomplete or not of the "
                "architecture its metadata names"
            ) from None

    def get_f32(self, name: str, expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Dequantize ``name`` to a new float32 array, checking its shape first."""
        t = self._tensor(name)
        if expected_shape is not None and t.shape != tuple(expected_shape):
            raise BuildInputError(
                f"weight {name!r} has shape {list(t.shape)}, expected {list(expected_shape)} "
                "from config.json; the config and the weights do not match"
            )
        return tensor_f32(t)

    def blocks(self, name: str) -> RawBlocks | None:
        """The raw blocks of ``name`` when it is stored as Q4_0, Q4_1 or Q8_0, else None."""
        t = self._tensor(name)
        if t.type_name not in RAW_BLOCK_TYPES:
            return None
        raw = np.asarray(t.gguf.data)
        rows = raw.reshape(-1, raw.shape[-1]).view(np.uint8)
        if t.permute_heads is not None:
            rows = unpermute_rows(rows, t.permute_heads)
        return RawBlocks(t.type_name, rows)
