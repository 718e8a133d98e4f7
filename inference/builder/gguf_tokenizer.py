"""A GGUF file's ``tokenizer.*`` metadata -> ``tokenizer.json`` + ``tokenizer_config.json``.

GGUF stores no ``tokenizer.json``: it stores the vocabulary, merges (or SentencePiece scores),
token types, the pre-tokenizer's name and the special token ids under llama.cpp's key names.
Two tokenizer models cover the supported families:

* ``gpt2``: byte-level BPE (Qwen, SmolLM, Llama 3); the split regex is chosen by
  ``tokenizer.ggml.pre`` where it names one of the known pre-tokenizers, else GPT-2's;
* ``llama``: SentencePiece BPE with byte fallback (Llama 2, Mistral); merges come from the
  file, or are recovered from the token scores as SentencePiece would rank them.

The result follows what ``transformers`` builds from the same file (the tests compare ids),
so a model converted here tokenizes as it does there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from inference.builder.errors import BuildInputError
from inference.serving.tokenizer import _byte_decoder

CONTROL = 3
USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: ``tokenizer.ggml.pre`` -> split regex; any other name gets GPT-2's byte-level regex.
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "dbrx": _LLAMA3_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    return {b: c for c, b in _byte_decoder().items()}


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _byte_level(tokens: Sequence[str], merges: Sequence[str], pre: str | None) -> Tokenizer:
    alphabet = set(bytes_to_unicode().values())
    spelling = bytes_to_unicode()
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8")): i
        for i, tok in enumerate(tokens)
    }
    pairs = [_merge_pair(m) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    return tok


def _merge_pair(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep:
        raise BuildInputError(f"GGUF tokenizer merge {merge!r} is not two tokens separated by a space")
    return left, right


def spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Merges a SentencePiece vocabulary implies: every split of a token into two vocabulary
    tokens, best-scored merged token first (the recipe transformers uses)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for token, score in zip(tokens, scores, strict=True):
        local = [(token[:k], token[k:], float(score)) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _sentencepiece(tokens: Sequence[str], merges: Sequence[str] | None, scores: Sequence[float] | None,
                   unk: str | None, add_space_prefix: bool) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    if merges:
        pairs = [_merge_pair(m) for m in merges]
    elif scores is not None:
        pairs = spm_merges(tokens, scores)
    else:
        raise BuildInputError("the GGUF's SentencePiece tokenizer has neither merges nor scores")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, unk_token=unk, fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    # The space a prefix put in front comes off again; without one, a leading space is the text's.
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
        *([decoders.Strip(" ", 1, 0)] if add_space_prefix else []),
    ])
    return tok


def _add_special_tokens(
    tok: Tokenizer, tokens: Sequence[str], types: Sequence[int], byte_level: bool
) -> None:
    # Control tokens (<|im_end|>, <s>) must match whole, and as specials they are skipped when
    # decoding. In a byte-level vocabulary a "control" token spelled outside the byte alphabet
    # is a llama.cpp mislabel; adding it would grow the vocabulary past the model's.
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    control = [AddedToken(t, normalized=False, special=True) for t, kind in zip(tokens, types, strict=False)
               if kind == CONTROL and (alphabet is None or set(t) <= alphabet)]
    if control:
        tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    user = [AddedToken(t, normalized=False, special=False) for t, kind in zip(tokens, types, strict=False)
            if kind == USER_DEFINED and t in vocab]
    if user:
        tok.add_tokens(user)


def build_tokenizer(reader: Any) -> tuple[Tokenizer, dict[str, Any]]:
    """The ``tokenizers`` Tokenizer and the ``tokenizer_config.json`` contents of a GGUF file."""
    kind = _field(reader, "tokenizer.ggml.model")
    tokens: list[str] | None = _field(reader, "tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise BuildInputError(
            "the GGUF file has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens metadata); "
            "cachesvc needs the tokenizer inside the GGUF"
        )
    types: list[int] = list(_field(reader, "tokenizer.ggml.token_type") or [])
    merges: list[str] | None = _field(reader, "tokenizer.ggml.merges")

    def token(key: str) -> str | None:
        idx = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[idx] if isinstance(idx, int) and 0 <= idx < len(tokens) else None

    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    bos, eos = token("bos_token_id"), token("eos_token_id")
    if kind == "gpt2":
        tok = _byte_level(tokens, merges or [], _field(reader, "tokenizer.ggml.pre"))
        # transformers adds no BOS to byte-level vocabularies whatever the file says; chat
        # templates of these models write their own start tokens.
        add_bos = add_eos = False
    elif kind in ("llama", "gemma4"):
        # gemma4: SentencePiece-style BPE (spaces as U+2581, byte fallback) with merges, no space
        # prefix (llama.cpp's converter writes it so; llama.cpp splits on newlines only).
        scores = _field(reader, "tokenizer.ggml.scores")
        prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", kind == "llama"))
        tok = _sentencepiece(tokens, merges, scores, token("unknown_token_id"), prefix)
    else:
        raise BuildInputError(
            f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE), "
            "'llama' (SentencePiece BPE), 'gemma4' (SentencePiece-style BPE with merges)"
        )
    _add_special_tokens(tok, tokens, types, byte_level=kind == "gpt2")
    tok.post_processor = _post_processor(tok, bos if add_bos else None, eos if add_eos else None)

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 30,
    }
    template = _field(reader, "tokenizer.chat_template")
    if isinstance(template, str) and template:
        config["chat_template"] = template
    return tok, config


def _post_processor(tok: Tokenizer, bos: str | None, eos: str | None) -> processors.PostProcessor:
    single = ([f"{bos}:0"] if bos else []) + ["$A:0"] + ([f"{eos}:0"] if eos else [])
    pair = single + ([f"{bos}:1"] if bos else []) + ["$B:1"] + ([f"{eos}:1"] if eos else [])
    specials = [(t, tok.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def write_tokenizer_files(reader: Any, out_dir: Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``."""
    tok, config = build_tokenizer(reader)
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    specials: Mapping[str, Any] = {k: config[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                                   if config.get(k)}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, sort_keys=True) + "\n")
