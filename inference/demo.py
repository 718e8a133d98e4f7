"""Demo checkpoints: Hugging Face-format decoder models with RANDOM weights and a real tokenizer.

The weights are random, so anything these models generate is gibberish. They exist so that
the builder, runtime, server and benchmarks can be exercised end to end without downloading
anything: ``transformers`` loads them (``AutoModelForCausalLM`` / ``AutoTokenizer``), so the
engine's logits can be checked against the reference implementation of the very same
checkpoint, and the ``0.5b`` size has the exact tensor shapes of Qwen2.5-0.5B for realistic
memory and speed numbers.

The tokenizer is a genuine byte-level BPE trained with ``tokenizers`` on the bundled
``data/corpus.txt`` with Qwen2's normalizer (NFC) and split regex (deterministic: same corpus,
same files), with ChatML special tokens,
``<think>``/``<tool_call>`` markers and a Qwen2.5-style chat template, so chat templating,
reasoning parsers and tool-call parsers can be tested too.

Usage: ``python -m inference.demo OUT_DIR [--arch qwen2] [--size tiny] [--dtype fp32] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from inference.families import family_by_name, family_names

__all__ = [
    "ADDED_TOKENS",
    "ARCHS",
    "CHAT_TEMPLATE",
    "DTYPES",
    "SIZES",
    "SPECIAL_TOKENS",
    "TOKENIZER_VOCAB_SIZE",
    "demo_tokenizer",
    "main",
    "write_demo_checkpoint",
]

#: Every registered model family (:mod:`inference.families`) has a demo checkpoint.
ARCHS: tuple[str, ...] = family_names()
SIZES: tuple[str, ...] = ("tiny", "0.5b")
DTYPES: tuple[str, ...] = ("fp32", "bf16")

# Order fixes the ids: the trainer places special tokens first (0, 1, 2).
SPECIAL_TOKENS: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Not special (they survive ``skip_special_tokens``), like Qwen3's: parsers look for them in text.
ADDED_TOKENS: tuple[str, ...] = ("<think>", "</think>", "<tool_call>", "</tool_call>")
TOKENIZER_VOCAB_SIZE = 1024

_ENDOFTEXT, _IM_START, _IM_END = SPECIAL_TOKENS
_DEFAULT_SYSTEM = "You are a helpful assistant."

# ChatML in the style of Qwen2.5: tools go into the system prompt (hermes style), assistant
# tool calls become <tool_call>{json}</tool_call>, tool results are grouped into one user turn.
# OpenAI sends ``arguments`` as a JSON string: it is emitted as is, never double-encoded.
CHAT_TEMPLATE = (
    "{%- macro render_content(content) -%}"
    "{%- if content is none -%}"
    "{%- elif content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}{%- if part.type == 'text' -%}{{- part.text -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- render_content(messages[0].content) -}}"
    "{%- else -%}{{- '" + _DEFAULT_SYSTEM + "' -}}{%- endif -%}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' -}}{{- tool | tojson -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' -}}'
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + render_content(messages[0].content) + '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>system\\n" + _DEFAULT_SYSTEM + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + render_content(message.content) + '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant' -}}"
    "{%- if message.content -%}{{- '\\n' + render_content(message.content) -}}{%- endif -%}"
    "{%- if message.tool_calls -%}"
    "{%- for tool_call in message.tool_calls -%}"
    "{%- if tool_call.function is defined -%}{%- set tool_call = tool_call.function -%}{%- endif -%}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' -}}"
    "{%- if tool_call.arguments is string -%}{{- tool_call.arguments -}}"
    "{%- else -%}{{- tool_call.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- elif not message.content -%}{{- '\\n' -}}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif message.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + render_content(message.content) + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@dataclass(frozen=True)
class _Shape:
    """Model hyper-parameters of one (arch, size)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    rope_theta: float
    rms_norm_eps: float
    init_std: float


@dataclass(frozen=True)
class _TensorSpec:
    """One weight tensor: its name, shape and how to initialise it."""

    name: str
    shape: tuple[int, ...]
    # "normal" (std = the model's init_std) or "ones" (norm weights).
    init: str
    # Rows at or beyond this index are zero (embedding rows the tokenizer never produces).
    live_rows: int | None = None

    @property
    def numel(self) -> int:
        """Number of elements."""
        return int(np.prod(self.shape, dtype=np.int64))


_BYTES_PER_ELEMENT = {"fp32": 4, "bf16": 2}
_SAFETENSORS_DTYPE = {"fp32": "F32", "bf16": "BF16"}
_TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16"}
# Shards close before they would pass this size, so the 0.5b fp32 model (~2 GB) gives 2 shards.
_MAX_SHARD_BYTES = 1_000_000_000
# Generating a large tensor in row blocks keeps memory near this many elements, not the tensor.
_CHUNK_ELEMENTS = 1 << 22


def _shape(arch: str, size: str) -> _Shape:
    if size == "0.5b":
        # Qwen2.5-0.5B; the other families reuse the same shape.
        return _Shape(
            hidden=896,
            layers=24,
            heads=14,
            kv_heads=2,
            head_dim=64,
            intermediate=4864,
            vocab=151936,
            max_positions=32768,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            init_std=0.02,
        )
    return _Shape(
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        # Qwen3 decouples head_dim from hidden/heads (4 * 32 != 64) so builders must read it.
        head_dim=int(family_by_name(arch).tiny.get("head_dim", 16)),
        intermediate=128,
        vocab=TOKENIZER_VOCAB_SIZE,
        max_positions=8192,
        # Different per family so that a builder that ignores rope_theta is caught.
        rope_theta=10_000.0 if arch == "llama" else 1_000_000.0,
        rms_norm_eps=1e-6 if arch.startswith("qwen") else 1e-5,
        # Larger than a real init so random logits are spread and greedy comparisons are telling.
        init_std=0.2,
    )


def _tensor_specs(config: dict[str, Any], *, live_vocab: int) -> list[_TensorSpec]:
    """Every weight the builder reads for ``config`` (:func:`inference.builder.layout.expected_tensors`):
    vectors of norms are ones, everything else random; embedding rows past ``live_vocab`` zero."""
    from inference.builder.layout import expected_tensors
    from inference.builder.model_config import model_config_from

    cfg = model_config_from(config)
    live = live_vocab if live_vocab < cfg.vocab_size else None
    specs = []
    for name, shape in expected_tensors(cfg).items():
        vocab_rows = name in ("model.embed_tokens.weight", "lm_head.weight")
        init = "ones" if len(shape) == 1 and "norm" in name and name.endswith(".weight") else "normal"
        specs.append(_TensorSpec(name, shape, init, live if vocab_rows else None))
    return specs


# ---------------------------------------------------------------------------------------------
# Tokenizer


# Qwen2's split: contractions, letter runs, single digits, punctuation runs, newlines, spaces.
_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_tokenizer_lock = threading.Lock()
_tokenizer_cache: dict[str, str] = {}


def _corpus_text() -> str:
    return resources.files("inference").joinpath("data/corpus.txt").read_text(encoding="utf-8")


def _train_tokenizer_json(corpus: str) -> str:
    tokenizer = Tokenizer(models.BPE())
    # Exactly Qwen2's pipeline: transformers' Qwen2Tokenizer rebuilds it from vocab and merges,
    # so any other normalizer or split would make its reference ids differ from tokenizer.json.
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(
        trim_offsets=False, add_prefix_space=False, use_regex=False
    )
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE - len(ADDED_TOKENS),
        min_frequency=2,
        special_tokens=[AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.splitlines(keepends=True), trainer)
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in ADDED_TOKENS])
    if tokenizer.get_vocab_size() != TOKENIZER_VOCAB_SIZE:
        raise RuntimeError(
            f"the demo tokenizer has {tokenizer.get_vocab_size()} tokens, expected {TOKENIZER_VOCAB_SIZE}: "
            "the corpus is too small for that many merges; add text to inference/data/corpus.txt"
        )
    return tokenizer.to_str()


def _tokenizer_json() -> str:
    # BPE training is deterministic for a given corpus; caching only saves repeated work.
    corpus = _corpus_text()
    key = hashlib.sha256(corpus.encode("utf-8")).hexdigest()
    with _tokenizer_lock:
        cached = _tokenizer_cache.get(key)
        if cached is None:
            cached = _train_tokenizer_json(corpus)
            _tokenizer_cache[key] = cached
        return cached


def _token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    ids: dict[str, int] = {}
    for token in (*SPECIAL_TOKENS, *ADDED_TOKENS):
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise RuntimeError(f"the demo tokenizer lacks {token!r}; this is a bug in inference/demo.py")
        ids[token] = token_id
    return ids


def demo_tokenizer() -> Tokenizer:
    """Return (a fresh copy of) the demo byte-level BPE tokenizer, trained once per process."""
    return Tokenizer.from_str(_tokenizer_json())


# ---------------------------------------------------------------------------------------------
# Weights


def _to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """Round float32 to bfloat16 (round to nearest, ties to even); return the raw uint16 bits."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    # uint32 wraps only for bit patterns >= 0xFFFF8000, which are NaNs and fixed below.
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
    nan = np.isnan(values)
    if nan.any():
        # Rounding could carry a NaN's payload into the exponent (inf); keep it a quiet NaN.
        rounded[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
    return rounded


def _tensor_chunks(spec: _TensorSpec, std: float, seed: int) -> Iterator[np.ndarray]:
    """Yield the tensor's float32 values in row blocks, in order (flattened)."""
    rows = spec.shape[0]
    row_len = spec.numel // rows if rows else 0
    if spec.init == "ones":
        yield np.ones(spec.numel, dtype=np.float32)
        return
    # One stream per tensor, keyed by name: a tensor does not depend on which others exist.
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(spec.name.encode())])))
    block = max(1, _CHUNK_ELEMENTS // max(1, row_len))
    for start in range(0, rows, block):
        stop = min(rows, start + block)
        chunk = rng.standard_normal((stop - start) * row_len, dtype=np.float32)
        chunk *= np.float32(std)
        if spec.live_rows is not None and stop > spec.live_rows:
            chunk[max(0, spec.live_rows - start) * row_len :] = 0.0
        yield chunk


def _plan_shards(specs: Sequence[_TensorSpec], itemsize: int) -> list[list[_TensorSpec]]:
    shards: list[list[_TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.numel * itemsize
        if shards[-1] and size + nbytes > _MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def _safetensors_header(specs: Sequence[_TensorSpec], dtype: str) -> bytes:
    itemsize = _BYTES_PER_ELEMENT[dtype]
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        nbytes = spec.numel * itemsize
        header[spec.name] = {
            "dtype": _SAFETENSORS_DTYPE[dtype],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # The payload must start 8-byte aligned; the format allows trailing spaces in the header.
    raw += b" " * (-(8 + len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw


def _temp_path(path: Path) -> Path:
    # Write beside the target and rename, so a reader never sees a half-written file.
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def _write_safetensors(path: Path, specs: Sequence[_TensorSpec], dtype: str, std: float, seed: int) -> int:
    """Write one safetensors file tensor by tensor (memory stays near one chunk); return payload bytes."""
    payload = 0
    tmp = _temp_path(path)
    try:
        with open(tmp, "wb") as f:
            f.write(_safetensors_header(specs, dtype))
            for spec in specs:
                for chunk in _tensor_chunks(spec, std, seed):
                    data = _to_bf16_bits(chunk) if dtype == "bf16" else chunk
                    f.write(data.astype(data.dtype.newbyteorder("<"), copy=False).tobytes())
                    payload += data.nbytes
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return payload


# ---------------------------------------------------------------------------------------------
# Metadata files


def _config(arch: str, shape: _Shape, *, dtype: str, tied: bool, ids: dict[str, int],
            size: str) -> dict[str, Any]:
    family = family_by_name(arch)
    config: dict[str, Any] = {
        "architectures": [family.architecture],
        "model_type": arch,
        "attention_dropout": 0.0,
        "bos_token_id": ids[_ENDOFTEXT],
        "eos_token_id": ids[_IM_END],
        "pad_token_id": ids[_ENDOFTEXT],
        "hidden_act": "silu",
        "hidden_size": shape.hidden,
        "initializer_range": shape.init_std,
        "intermediate_size": shape.intermediate,
        "max_position_embeddings": shape.max_positions,
        "num_attention_heads": shape.heads,
        "num_hidden_layers": shape.layers,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": tied,
        "torch_dtype": _TORCH_DTYPE[dtype],
        "dtype": _TORCH_DTYPE[dtype],
        "use_cache": True,
        "vocab_size": shape.vocab,
    }
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = False
    if arch == "llama":
        config["mlp_bias"] = False
        config["pretraining_tp"] = 1
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
        config["sliding_window"] = None
        config["max_window_layers"] = shape.layers
    # The family's distinctive features (the tiny shape's head_dim is already in ``shape``).
    config.update({k: v for k, v in family.tiny.items() if k not in ("head_dim", "rope_parameters")})
    if "vocab_size_per_layer_input" in config:  # Gemma 4's per-layer table covers the vocabulary
        config["vocab_size_per_layer_input"] = shape.vocab
    params = family.tiny.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) and v.get("rope_type") == "proportional"
                                        for v in params.values()):
        # per layer type, as transformers 5 writes it: Gemma 4's proportional rope has no hub form
        config["rope_parameters"] = params
        del config["rope_theta"], config["rope_scaling"]
    elif "rope_parameters" in family.tiny:  # written in the hub's convention: rope_theta + rope_scaling
        scaling = dict(family.tiny["rope_parameters"])
        config["rope_theta"] = float(scaling.pop("rope_theta", shape.rope_theta))
        config["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
    return config


def _tokenizer_config(ids: dict[str, int], max_length: int) -> dict[str, Any]:
    added = {
        str(ids[token]): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token in SPECIAL_TOKENS,
        }
        for token in (*SPECIAL_TOKENS, *ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [_IM_START, _IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": _IM_END,
        "errors": "replace",
        "model_max_length": max_length,
        "pad_token": _ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def _write_text(path: Path, text: str) -> None:
    tmp = _temp_path(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_json(path: Path, obj: Any) -> None:
    _write_text(path, json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n")


# ---------------------------------------------------------------------------------------------
# Public API


def _check_choice(option: str, value: object, choices: Sequence[str]) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{option} must be one of {', '.join(choices)}; got {value!r}")


def write_demo_checkpoint(
    out_dir: Path,
    *,
    arch: str = "qwen2",
    size: str = "tiny",
    dtype: str = "fp32",
    seed: int = 0,
    tied: bool | None = None,
) -> Path:
    """Write a random-weight Hugging Face checkpoint (weights, config, tokenizer) into ``out_dir``.

    The weights are random: generated text is gibberish. ``arch`` picks the family
    (llama, mistral, qwen2 with q/k/v biases, qwen3 with q/k norms and an explicit head_dim).
    ``size="tiny"``: hidden 64, 2 layers, 4 heads, 2 KV heads, intermediate 128, vocab = the
    tokenizer's 1024 tokens, init std 0.2. ``size="0.5b"``: the Qwen2.5-0.5B shape (hidden 896,
    24 layers, 14/2 heads, intermediate 4864, vocab 151936, rope_theta 1e6, ~2 GB in fp32 as two
    shards with an index, ~1 GB in bf16); its vocabulary is larger than the tokenizer's, so the
    embedding rows (tied with the LM head) from 1024 up are zero: their logits are exactly 0 and
    greedy decoding never picks them. ``dtype`` is fp32 or bf16 (bf16 = fp32 rounded to nearest
    even, so both dtypes of a seed hold the same weights up to rounding). ``tied`` overrides
    ``tie_word_embeddings`` (default: tied). Same arguments, byte-identical files. Norm weights
    are 1.0. Memory stays near one block of one tensor, so the 0.5b model fits anywhere.

    Existing files of the same names in ``out_dir`` are replaced, and stale weight files from an
    earlier call (``model*.safetensors``, the index) are removed. Returns ``out_dir``.
    Raises ``ValueError`` naming the option when ``arch``, ``size``, ``dtype``, ``seed`` or
    ``tied`` is invalid.
    """
    _check_choice("arch", arch, ARCHS)
    _check_choice("size", size, SIZES)
    _check_choice("dtype", dtype, DTYPES)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer; got {seed!r}")
    if tied is not None and not isinstance(tied, bool):
        raise ValueError(f"tied must be True, False or None; got {tied!r}")
    tie = True if tied is None else tied

    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out_dir {str(out_dir)!r} exists and is not a directory; pass a directory path")
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer_json = _tokenizer_json()
    tokenizer = Tokenizer.from_str(tokenizer_json)
    ids = _token_ids(tokenizer)
    shape = _shape(arch, size)
    config = _config(arch, shape, dtype=dtype, tied=tie, ids=ids, size=size)
    specs = _tensor_specs(config, live_vocab=tokenizer.get_vocab_size())

    for stale in [*out_dir.glob("model*.safetensors"), out_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    shards = _plan_shards(specs, _BYTES_PER_ELEMENT[dtype])
    if len(shards) == 1:
        _write_safetensors(out_dir / "model.safetensors", specs, dtype, shape.init_std, seed)
    else:
        weight_map: dict[str, str] = {}
        total = 0
        for n, shard in enumerate(shards, start=1):
            name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
            total += _write_safetensors(out_dir / name, shard, dtype, shape.init_std, seed)
            weight_map.update({spec.name: name for spec in shard})
        _write_json(
            out_dir / "model.safetensors.index.json",
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )

    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": ids[_ENDOFTEXT],
            "eos_token_id": [ids[_IM_END], ids[_ENDOFTEXT]],
            "pad_token_id": ids[_ENDOFTEXT],
            "do_sample": False,
        },
    )
    _write_text(out_dir / "tokenizer.json", tokenizer_json)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(ids, shape.max_positions))
    _write_json(
        out_dir / "special_tokens_map.json",
        {
            "additional_special_tokens": [_IM_START, _IM_END],
            "eos_token": _IM_END,
            "pad_token": _ENDOFTEXT,
        },
    )
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry: ``python -m inference.demo OUT_DIR [--arch] [--size] [--dtype] [--seed]``."""
    parser = argparse.ArgumentParser(
        prog="python -m inference.demo",
        description="Write a random-weight demo checkpoint (outputs are gibberish) with a real tokenizer.",
    )
    parser.add_argument("out_dir", type=Path, help="directory to write the checkpoint into")
    parser.add_argument("--arch", choices=ARCHS, default="qwen2", help="model family (default: qwen2)")
    parser.add_argument("--size", choices=SIZES, default="tiny", help="model size (default: tiny)")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="weight dtype (default: fp32)")
    parser.add_argument("--seed", type=_seed_arg, default=0, help="weight seed, a non-negative integer")
    tie = parser.add_mutually_exclusive_group()
    tie.add_argument(
        "--tied", dest="tied", action="store_true", default=None, help="tie embeddings (the default)"
    )
    tie.add_argument("--untied", dest="tied", action="store_false", help="write a separate lm_head")
    args = parser.parse_args(argv)
    try:
        out = write_demo_checkpoint(
            args.out_dir, arch=args.arch, size=args.size, dtype=args.dtype, seed=args.seed, tied=args.tied
        )
    except ValueError as exc:
        parser.error(str(exc))
    size_bytes = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {args.arch} {args.size} {args.dtype} seed={args.seed} to {out} ({size_bytes:,} bytes)")
    return 0


def _seed_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text!r}")
    return value


if __name__ == "__main__":
    sys.exit(main())
