"""Tokenizers and chat templates: a bundle's or checkpoint's ``tokenizer.json`` plus its metadata.

The chat template is rendered the way ``transformers`` renders it (same jinja2 environment
options, filters and globals) but always inside an ``ImmutableSandboxedEnvironment``, because a
template is code that came with a downloaded model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = [
    "MARKUP_TOKENS",
    "ChatTemplateError",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
]

# Added tokens that carry meaning for the reasoning and tool-call parsers: they stay in the
# decoded text even when the tokenizer marks them special, so the parsers can see them.
MARKUP_TOKENS = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>"})


class TokenizerError(ValueError):
    """The tokenizer files are missing or unreadable."""


class ChatTemplateError(ValueError):
    """The model has no chat template, or rendering it failed (a bad request, usually)."""


def _token_content(value: object) -> str | None:
    # tokenizer_config.json writes special tokens either as a plain string or as an
    # AddedToken dict ({"content": ..., "lstrip": ...}).
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a JSON object")
    return data


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # The GPT-2 byte-to-unicode table that ByteLevel tokenizers use for their vocabulary.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class _GenerationBlock(jinja2.ext.Extension):
    """Accept ``{% generation %}…{% endgeneration %}`` (used by some templates); render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Same as transformers' filter: jinja2's own tojson HTML-escapes, which templates don't want.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@dataclass(frozen=True)
class _Templates:
    default: str | None
    named: Mapping[str, str]


class Tokenizer:
    """A ``tokenizers.Tokenizer`` with the model's special tokens, EOS ids and chat template."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        chat_template: str | None = None,
        named_templates: Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        """Wrap ``backend``; prefer :func:`load_tokenizer` to build one from files."""
        self._tok = backend
        self._templates = _Templates(chat_template, dict(named_templates or {}))
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        added = backend.get_added_tokens_decoder()
        # Special added tokens are hidden from output text, except the markup the parsers read.
        self.hidden_token_ids: frozenset[int] = frozenset(
            i for i, t in added.items() if t.special and t.content not in MARKUP_TOKENS
        ) | frozenset(self.eos_token_ids)
        self._byte_level = type(backend.decoder).__name__ == "ByteLevel"
        self._compiled: dict[str, jinja2.Template] = {}

    @cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry: one token covers at most this much text.

        Vocabulary strings are at least as long as the text they match (byte-level entries
        hold one character per byte), so ``len(text) / max_token_chars`` bounds a text's
        token count from below without tokenizing it.
        """
        vocab = self._tok.get_vocab(with_added_tokens=True)
        return max((len(piece) for piece in vocab), default=1) or 1

    def backend_json(self) -> str:
        """The ``tokenizer.json`` text of the backend (for libraries that build their own view)."""
        return str(self._tok.to_str())

    # -- text <-> ids ------------------------------------------------------------------------

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``.

        ``add_special_tokens`` runs the tokenizer's post-processor (e.g. Llama's BOS) as for a
        plain completion prompt; rendered chat prompts already hold their special tokens as text.
        """
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without hidden special tokens (EOS, padding, …)."""
        kept = [i for i in ids if i not in self.hidden_token_ids]
        return str(self._tok.decode(kept, skip_special_tokens=False))

    def token_to_id(self, token: str) -> int | None:
        """The id of one vocabulary entry, or None."""
        return self._tok.token_to_id(token)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes one token stands for (a byte-level token may be part of a character)."""
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            table = _byte_decoder()
            if all(ch in table for ch in piece):
                return bytes(table[ch] for ch in piece)
        return str(self._tok.decode([token_id], skip_special_tokens=False)).encode("utf-8")

    def token_text(self, token_id: int) -> str:
        """A printable form of one token (invalid UTF-8 shown as U+FFFD)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    # -- chat --------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        """True when the model ships at least one chat template."""
        return self._templates.default is not None or bool(self._templates.named)

    def _template_source(self, name: str | None, has_tools: bool) -> tuple[str, str]:
        named = self._templates.named
        if name is not None:
            if name in named:
                return name, named[name]
            raise ChatTemplateError(f"the model has no chat template named {name!r}; known: {sorted(named)}")
        if has_tools and "tool_use" in named:
            return "tool_use", named["tool_use"]
        if self._templates.default is not None:
            return "default", self._templates.default
        if "default" in named:
            return "default", named["default"]
        raise ChatTemplateError(
            "this model has no chat template (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja); use /v1/completions with a plain prompt instead"
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_name: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the chat template in a jinja2 sandbox; raise :class:`ChatTemplateError` on failure."""
        key, source = self._template_source(template_name, bool(tools))
        template = self._compiled.get(key)
        if template is None:
            try:
                template = _environment().from_string(source)
            except jinja2.TemplateError as exc:
                raise ChatTemplateError(f"the model's chat template does not compile: {exc}") from exc
            self._compiled[key] = template
        context: dict[str, Any] = dict(self.special_tokens)
        context.update(kwargs)
        context.update(
            messages=[dict(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
        )
        try:
            return template.render(**context)
        except jinja2.TemplateError as exc:
            # Includes raise_exception() from the template (e.g. "roles must alternate") and
            # sandbox SecurityError for unsafe attribute access.
            raise ChatTemplateError(f"chat template error: {exc}") from exc
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed on these messages: {exc}") from exc


def _chat_templates(root: Path, config: Mapping[str, Any]) -> tuple[str | None, dict[str, str]]:
    jinja_file = root / "chat_template.jinja"
    # transformers 5 writes the template to its own file; it takes precedence, as in transformers.
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8"), {}
    raw = config.get("chat_template")
    if raw is None:
        return None, {}
    if isinstance(raw, str):
        return raw, {}
    if isinstance(raw, list):
        named: dict[str, str] = {}
        for entry in raw:
            if not (
                isinstance(entry, Mapping)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise TokenizerError(
                    "tokenizer_config.json chat_template list entries need 'name' and 'template'"
                )
            named[entry["name"]] = entry["template"]
        return None, named
    raise TokenizerError(
        "tokenizer_config.json 'chat_template' must be a string or a list of named templates"
    )


def _id_list(value: object) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def load_tokenizer(bundle_or_checkpoint_dir: Path) -> Tokenizer:
    """Load ``tokenizer.json`` with ``tokenizer_config.json``, ``chat_template.jinja`` and
    ``generation_config.json`` (EOS ids) from a bundle or checkpoint directory."""
    root = Path(bundle_or_checkpoint_dir)
    tok_file = root / "tokenizer.json"
    if not tok_file.is_file():
        raise TokenizerError(f"{root} has no tokenizer.json (a fast tokenizer file is required)")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tok_file))
    except Exception as exc:  # tokenizers raises its own Exception subclass
        raise TokenizerError(f"cannot load {tok_file}: {exc}") from exc

    cfg_file = root / "tokenizer_config.json"
    config = _read_json(cfg_file) if cfg_file.is_file() else {}
    special: dict[str, str] = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        content = _token_content(config.get(name))
        if content is not None:
            special[name] = content
    template, named = _chat_templates(root, config)

    eos_ids: list[int] = []
    gen_file = root / "generation_config.json"
    if gen_file.is_file():
        eos_ids.extend(_id_list(_read_json(gen_file).get("eos_token_id")))
    if "eos_token" in special:
        eos_id = backend.token_to_id(special["eos_token"])
        if eos_id is not None:
            eos_ids.append(eos_id)
    return Tokenizer(
        backend,
        chat_template=template,
        named_templates=named,
        special_tokens=special,
        eos_token_ids=eos_ids,
    )
