"""Read a GGUF file as a Hugging Face checkpoint: HF tensor names, float32 on request, raw blocks.

llama.cpp's GGUF holds the model config as ``<arch>.*`` metadata, the tokenizer as
``tokenizer.*`` metadata, and the weights in its own tensor names and block-quantized types.
This module says what such a file means in Hugging Face terms (the config of
:func:`gguf_config`, the tensor names of :func:`hf_tensor_name`) and reads its tensors:
:class:`GgufCheckpoint` parses the header (:func:`read_gguf_header`), then memory-maps and
dequantizes one tensor per ``get_f32`` call with the ``gguf`` package (numpy only), so a
build never holds more than one float32 tensor of it at a time, and the file on disk stays as
compact as llama.cpp made it. The tokenizer (``gguf_tokenizer``) reads the vocabulary arrays
through ``gguf.GGUFReader`` (:func:`open_gguf`).

llama.cpp's converter permutes the Q/K rows of llama-family attention (its RoPE pairs
neighbouring features; transformers rotates halves): every read here undoes that, so values
and raw block rows come out in Hugging Face order.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from inference.builder.errors import BuildInputError
from inference.builder.layout import (
    BARE_SLOTS,
    EXPERT_SLOTS,
    GGUF_GLOBAL_SLOTS,
    GGUF_SLOTS,
    NORM_SLOTS,
    Names,
)
from inference.families import DOCS_PAGE, Family, family_of_gguf

#: The GGUF file inside a converted checkpoint directory (see ``gguf_convert``).
GGUF_FILE = "model.gguf"
#: Tensor types the reader reads (all have a numpy dequantizer in the ``gguf`` package).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
#: 4-bit block types whose codes an ``int4`` build keeps as they are (see ``inference.builder.int4``).
Q4_TYPES = ("Q4_0", "Q4_1")
#: Block types :meth:`GgufCheckpoint.blocks` hands out raw: one scale (and minimum) per 32 codes.
RAW_BLOCK_TYPES = (*Q4_TYPES, "Q8_0")



def hf_tensor_name(gguf_name: str, family: Family) -> tuple[str, str | None]:
    """(Hugging Face name, layout slot) of a GGUF tensor name of ``family``
    (``BuildInputError`` for a name of no slot)."""
    parts = gguf_name.split(".")
    names = Names(family.hf_names, family.hf_global_names)
    if len(parts) == 2 and parts[0] in GGUF_GLOBAL_SLOTS:
        slot = GGUF_GLOBAL_SLOTS[parts[0]]
        return f"{names.top(slot)}.{parts[1]}", slot
    slots = {**GGUF_SLOTS, **family.gguf_slots}
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in slots:
        slot = slots[parts[2]]
        if slot in BARE_SLOTS:  # a tensor named by its module alone (Gemma 4's layer_scalar)
            return names.layer(int(parts[1]), slot), slot
        return f"{names.layer(int(parts[1]), slot)}.{parts[3]}", slot
    raise BuildInputError(
        f"GGUF tensor {gguf_name!r} has no counterpart in cachesvc's {family.name} layer; this file is "
        f"of a variant cachesvc cannot convert (see {DOCS_PAGE})"
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
    """Open ``path`` with ``gguf.GGUFReader`` (every field, arrays too: what the tokenizer needs).

    A truncated or foreign file -> ``BuildInputError``. The weights are read through the much
    cheaper :func:`read_gguf_header` instead: ``GGUFReader`` decodes every vocabulary entry and
    merge (seconds for a 49k-token vocabulary), which a build has no use for.
    """
    from gguf import GGUFReader

    path = Path(path)
    try:
        reader = GGUFReader(path)  # read-only memory map: tensors are paged in when read
    except Exception as exc:  # the reader raises ValueError, IndexError, struct errors...
        raise BuildInputError(
            f"{path.name} is not a readable GGUF file ({type(exc).__name__}: {exc}); the file is truncated "
            "or corrupt, download it again"
        ) from exc
    return reader


# GGUF metadata value types: fixed-size scalars by struct format; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: GGML tensors have at most four dimensions; more means a corrupt tensor table.
_MAX_DIMS = 4
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GgufTensorInfo:
    """One entry of a GGUF's tensor table."""

    name: str  # GGUF name
    dims: tuple[int, ...]  # GGML order: the row (innermost) dimension first
    type_id: int  # GGMLQuantizationType value
    start: int  # absolute byte offset of the data in the file


#: Numeric metadata arrays up to this length are kept (one value per layer, per head); longer
#: ones (the vocabulary's scores and types) are skipped over.
MAX_KEPT_ARRAY = 4096


@dataclass(frozen=True)
class GgufHeader:
    """What a GGUF's header says: scalar metadata and the tensor table (no tensor data read)."""

    path: Path
    size: int  # bytes in the file
    #: numbers, bools and strings; short numeric arrays (per-layer values) as tuples; the
    #: vocabulary's arrays are skipped, not kept
    metadata: dict[str, Any]
    tensors: tuple[GgufTensorInfo, ...]


class _Cursor:
    """Bounds-checked little-endian reads from the header bytes."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def take(self, n: int) -> int:
        if n < 0 or self.pos + n > len(self.buf):
            raise BuildInputError(
                f"{self.path.name} is not a readable GGUF file: its header is cut short (needs byte "
                f"{self.pos + n}, the file has {len(self.buf)}); the file is truncated or corrupt, "
                "download it again"
            )
        start, self.pos = self.pos, self.pos + n
        return start

    def unpack(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        start = self.take(n)
        return bytes(self.buf[start:start + n]).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        """Read one value of type ``kind``: numeric arrays of up to :data:`MAX_KEPT_ARRAY` values
        as tuples; longer ones, and arrays of strings, are skipped over (None)."""
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = self.unpack("<I"), self.unpack("<Q")
            if elem in _SCALARS:
                size = struct.calcsize(_SCALARS[elem])
                start = self.pos
                self.take(size * count)
                if count <= MAX_KEPT_ARRAY:  # per-layer values (a sliding-window pattern ...)
                    return struct.unpack_from(f"<{count}{_SCALARS[elem][1:]}", self.buf, start)
            else:  # strings (vocabularies, merges) or nested arrays: each has its own length
                for _ in range(count):
                    self.value(elem)
            return None
        raise BuildInputError(
            f"{self.path.name} has an unknown GGUF metadata type {kind}; the file is corrupt"
        )


def read_gguf_header(path: Path) -> GgufHeader:
    """Parse the header (metadata scalars and tensor table) of the GGUF file ``path``.

    Raises ``BuildInputError`` for a file that is not GGUF (or is big-endian, or of version 1)
    or whose header is cut short.
    """
    path = Path(path)
    size = path.stat().st_size
    if size < 24:
        raise BuildInputError(f"{path.name} is not a readable GGUF file ({size} bytes); it is truncated")
    with path.open("rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        cur = _Cursor(buf, path)
        if bytes(buf[:4]) != b"GGUF":
            raise BuildInputError(f"{path.name} is not a GGUF file (no GGUF magic)")
        cur.take(4)
        version = cur.unpack("<I")
        if version not in (2, 3):
            endian = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise BuildInputError(f"{path.name} is GGUF version {version}{endian}; little-endian versions 2 "
                                  "and 3 are supported")
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            value = cur.value(cur.unpack("<I"))
            if value is not None:
                metadata[key] = value
        table: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("<I")
            if n_dims > _MAX_DIMS:
                raise BuildInputError(
                    f"{path.name}: tensor {name!r} has {n_dims} dimensions; the file is corrupt"
                )
            dims = tuple(cur.unpack("<Q") for _ in range(n_dims))
            table.append((name, dims, cur.unpack("<I"), cur.unpack("<Q")))
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1:
        raise BuildInputError(f"{path.name}: general.alignment {alignment!r} is invalid; the file is corrupt")
    data_start = cur.pos + (-cur.pos) % alignment
    tensors = tuple(GgufTensorInfo(name, dims, type_id, data_start + offset)
                    for name, dims, type_id, offset in table)
    return GgufHeader(path, size, metadata, tensors)


def gguf_metadata(header: GgufHeader, key: str, default: Any = None) -> Any:
    """The value of one metadata key: a scalar, a string or a short numeric array's tuple
    (``default`` when absent or a skipped array)."""
    return header.metadata.get(key, default)


def gguf_family(header: GgufHeader) -> Family:
    """The family of the file's ``general.architecture`` (and its metadata, where families share
    an architecture); unknown -> ``BuildInputError``."""
    arch = gguf_metadata(header, "general.architecture")
    return family_of_gguf(arch, lambda key, default: gguf_metadata(header, f"{arch}.{key}", default))


def _first(value: Any) -> Any:
    """A per-layer metadata array's first value (Gemma 4 writes K/V heads and MLP widths per layer;
    its family reads the whole array), else the value itself."""
    return value[0] if isinstance(value, tuple) and value else value


def _required(header: GgufHeader, key: str, *, per_layer: bool = False) -> int:
    """A positive integer of the metadata; ``per_layer``: or an array of one a layer (its first
    value: Gemma 4's MLP widths, which its family reads whole)."""
    value = gguf_metadata(header, key)
    if per_layer:
        value = _first(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise BuildInputError(f"GGUF metadata {key!r} is missing or not a positive integer (got {value!r})")
    return value


#: llama.cpp's rope tensors (outside the layers): the per-frequency divisors of a llama3 rope
#: (``rope_freqs``), LongRoPE's short and long factors. They become config.json's rope scaling.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _vector(header: GgufHeader, name: str) -> list[float]:
    """The values of a small F32/F16 vector tensor (the rope factors)."""
    t = next(t for t in header.tensors if t.name == name)
    kinds = {0: "<f4", 1: "<f2"}
    if t.type_id not in kinds or len(t.dims) != 1:
        raise BuildInputError(f"GGUF tensor {name!r} is not a float32/float16 vector; the file is corrupt")
    count = int(t.dims[0])
    end = t.start + count * np.dtype(kinds[t.type_id]).itemsize
    if end > header.size:
        raise BuildInputError(
            f"{header.path.name} is truncated: tensor {name!r} ends past the file; download it again")
    values = np.fromfile(header.path, dtype=kinds[t.type_id], count=count, offset=t.start)
    return [float(v) for v in values.astype(np.float32)]


def _rope_scaling(header: GgufHeader, arch: str, names: frozenset[str]) -> dict[str, Any]:
    """config.json's rope scaling of the file: its ``rope.scaling.*`` keys and rope tensors."""
    def meta(key: str, default: Any = None) -> Any:
        return gguf_metadata(header, f"{arch}.rope.{key}", default)

    original = meta("scaling.original_context_length")
    if "rope_factors_long.weight" in names or "rope_factors_short.weight" in names:
        if not {"rope_factors_long.weight", "rope_factors_short.weight"} <= names:
            raise BuildInputError(
                "the GGUF has only one of rope_factors_long/rope_factors_short; the file is incomplete")
        scaling: dict[str, Any] = {
            "rope_type": "longrope",
            "long_factor": _vector(header, "rope_factors_long.weight"),
            "short_factor": _vector(header, "rope_factors_short.weight"),
        }
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        if meta("scaling.attn_factor") is not None:
            scaling["attention_factor"] = float(meta("scaling.attn_factor"))
        return scaling
    if "rope_freqs.weight" in names:
        # llama.cpp's converter writes a llama3 rope as these divisors instead of its parameters.
        return {"rope_type": "factors", "factors": _vector(header, "rope_freqs.weight")}
    kind = meta("scaling.type")
    if kind in (None, "none"):
        return {}
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta("scaling.factor", 1.0))}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": float(meta("scaling.factor", 1.0))}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        for key, name in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"),
                          ("attention_factor", "yarn_attn_factor")):
            if meta(f"scaling.{name}") is not None:
                scaling[key] = float(meta(f"scaling.{name}"))
        return scaling
    raise BuildInputError(f"unsupported GGUF rope scaling {kind!r}; supported: linear, yarn, longrope")


def gguf_config(header: GgufHeader) -> dict[str, Any]:
    """``config.json`` contents from the GGUF metadata and tensor list."""
    family = gguf_family(header)
    arch = str(gguf_metadata(header, "general.architecture"))
    names = frozenset(t.name for t in header.tensors)
    heads = _required(header, f"{arch}.attention.head_count")
    kv_heads = _first(gguf_metadata(header, f"{arch}.attention.head_count_kv")) or heads
    hidden = _required(header, f"{arch}.embedding_length")
    head_dim = gguf_metadata(header, f"{arch}.attention.key_length") or hidden // heads
    embd = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise BuildInputError("the GGUF has no token_embd.weight tensor; it is not a complete model")
    vocab = gguf_metadata(header, f"{arch}.vocab_size") or int(embd.dims[-1])
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": family.model_types[0],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": _required(header, f"{arch}.feed_forward_length", per_layer=True),
        "num_hidden_layers": _required(header, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "hidden_act": "silu",
        "rms_norm_eps": float(gguf_metadata(header, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(gguf_metadata(header, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(gguf_metadata(header, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
    }
    ple = next((t for t in header.tensors if t.name == "per_layer_token_embd.weight"), None)
    if ple is not None:  # Gemma 4's per-layer input table: its rows are that vocabulary
        config["vocab_size_per_layer_input"] = int(ple.dims[-1])
    rot = gguf_metadata(header, f"{arch}.rope.dimension_count")
    if isinstance(rot, int) and 0 < rot < int(head_dim):
        config["partial_rotary_factor"] = rot / int(head_dim)
    scaling = _rope_scaling(header, arch, names)
    if scaling:
        config["rope_scaling"] = scaling
    config.update(family.gguf_config(lambda key, default: gguf_metadata(header, f"{arch}.{key}", default),
                                     names))
    for key, meta in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("pad_token_id", "padding_token_id")):
        value = gguf_metadata(header, f"tokenizer.ggml.{meta}")
        if isinstance(value, int):
            config[key] = value
    return config


@dataclass(frozen=True)
class GgufTensor:
    """One GGUF tensor as a Hugging Face tensor, and where its bytes are."""

    name: str  # Hugging Face name
    shape: tuple[int, ...]  # Hugging Face order
    type_name: str  # GGML type: F32, Q4_1, ...
    permute_heads: int | None  # llama.cpp permuted these rows in groups of this many heads
    start: int  # absolute byte offset in the file
    rows: int  # rows as stored: every dimension but the innermost
    row_bytes: int
    offset: float = 0.0  # llama.cpp stored the values plus this (Gemma's norms: 1)
    source: str = ""  # the GGUF tensor it is (one expert's slice of a 3-D expert tensor, or all of it)


def tensor_plan(header: GgufHeader, config: dict[str, Any]) -> list[GgufTensor]:
    """Every tensor of ``header`` under its Hugging Face name, shape and row permutation.

    Raises ``BuildInputError`` for a tensor name of no supported architecture, a tensor type
    not in ``SUPPORTED_TYPES`` or a tensor whose data lies past the end of the file, before
    any tensor data is read.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    family = gguf_family(header)
    permuted = family.gguf_permuted_qk
    plan: list[GgufTensor] = []
    for t in header.tensors:
        if t.name in ROPE_TENSORS:
            continue  # config.json's rope scaling holds them (gguf_config)
        name, slot = hf_tensor_name(t.name, family)
        try:
            qtype = GGMLQuantizationType(t.type_id)
        except ValueError:  # a type number newer than this gguf package
            qtype = None
        type_name = qtype.name if qtype is not None else f"#{t.type_id}"
        if qtype is None or type_name not in SUPPORTED_TYPES:
            raise BuildInputError(
                f"GGUF tensor {t.name!r} has type {type_name}, which is not supported; "
                f"supported types: {', '.join(SUPPORTED_TYPES)}"
            )
        block, block_bytes = GGML_QUANT_SIZES[qtype]
        if not t.dims or t.dims[0] % block:
            raise BuildInputError(
                f"GGUF tensor {t.name!r} has shape {list(t.dims)}, not whole {type_name} blocks of {block}; "
                "the file is corrupt"
            )
        row_bytes = t.dims[0] // block * block_bytes
        rows = int(np.prod(t.dims[1:], dtype=np.int64))
        end = t.start + rows * row_bytes
        if end > header.size:
            raise BuildInputError(
                f"{header.path.name} is truncated: tensor {t.name!r} ends at byte {end} "
                f"but the file has {header.size} bytes; download it again"
            )
        heads: int | None = None
        if permuted and slot == "q":
            heads = config["num_attention_heads"]
        elif permuted and slot == "k":
            heads = config["num_key_value_heads"]
        offset = family.gguf_norm_offset if slot in NORM_SLOTS and name.endswith(".weight") else 0.0
        if slot in EXPERT_SLOTS:
            # llama.cpp's one 3-D tensor of every expert -> each expert's 2-D weight, by its rows.
            if len(t.dims) != 3:
                raise BuildInputError(f"GGUF tensor {t.name!r} has shape {list(t.dims)}, expected 3 "
                                      "dimensions (one matrix per expert); the file is corrupt")
            per_expert = t.dims[1]
            for e in range(t.dims[2]):
                start = t.start + e * per_expert * row_bytes
                plan.append(GgufTensor(name.format(e=e), (t.dims[1], t.dims[0]), type_name, None, start,
                                       per_expert, row_bytes, 0.0, t.name))
            continue
        plan.append(GgufTensor(name, tuple(reversed(t.dims)), type_name, heads, t.start, rows, row_bytes,
                               offset, t.name))
    return plan


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
    (a converted checkpoint, see ``gguf_convert``). Opening reads the header only (metadata
    scalars and the tensor table; the vocabulary is skipped over); each read memory-maps one
    tensor. Refuses a truncated file, an unknown architecture or tensor name, or an unsupported
    type.
    """

    def __init__(self, checkpoint_dir: Path) -> None:
        self.dir = Path(checkpoint_dir)
        path = self.dir / GGUF_FILE
        if not path.is_file():
            raise BuildInputError(f"no {GGUF_FILE} in {self.dir}; it is not a converted GGUF checkpoint")
        header = read_gguf_header(path)
        self.files = (path,)
        self._tensors = {t.name: t for t in tensor_plan(header, gguf_config(header))}

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

    def _rows(self, t: GgufTensor) -> np.ndarray:
        """The stored bytes of ``t`` as ``[rows, row_bytes]`` (read-only, in the file's row order)."""
        # One map per tensor, as SafetensorsCheckpoint does: its pages leave the process's
        # memory with the last array using them (a map of the whole file kept every page read
        # resident: +160 MB peak RSS on a SmolLM2 int4 build). A plain ndarray view, because
        # np.memmap slices pay a Python hook per view and the gguf dequantizers make one per 16 rows.
        raw = np.memmap(self.files[0], dtype=np.uint8, mode="r", offset=t.start, shape=(t.rows, t.row_bytes))
        return raw.view(np.ndarray)

    def get_f32(self, name: str, expected_shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Dequantize ``name`` to a new float32 array, checking its shape first."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self._tensor(name)
        if expected_shape is not None and t.shape != tuple(expected_shape):
            raise BuildInputError(
                f"weight {name!r} has shape {list(t.shape)}, expected {list(expected_shape)} "
                "from config.json; the config and the weights do not match"
            )
        raw = self._rows(t)
        if t.type_name == "F32":
            arr = raw.view("<f4").astype(np.float32)  # a copy: never hand out the read-only map
        elif t.type_name == "F16":
            arr = raw.view("<f2").astype(np.float32)
        elif t.type_name == "BF16":
            # bf16 is the top half of an fp32: shifting the 16-bit pattern up is exact.
            arr = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = dequantize(raw, GGMLQuantizationType[t.type_name]).astype(np.float32, copy=False)
        arr = arr.reshape(t.shape)
        if t.offset:
            arr -= np.float32(t.offset)
        if t.permute_heads is not None:
            arr = unpermute_rows(arr, t.permute_heads)
        return arr

    def blocks(self, name: str) -> RawBlocks | None:
        """The raw blocks of ``name`` when it is stored as Q4_0, Q4_1 or Q8_0, else None."""
        t = self._tensor(name)
        if t.type_name not in RAW_BLOCK_TYPES or t.offset:
            return None
        rows = self._rows(t)
        if t.permute_heads is not None:
            rows = unpermute_rows(rows, t.permute_heads)
        return RawBlocks(t.type_name, rows)
