"""Structured output: JSON schemas and forced tool calls compiled into llguidance token masks.

A request's constraint (``response_format`` json_object / json_schema, a named ``tool_choice``
or ``tool_choice="required"``) becomes an llguidance grammar over the model's own tokenizer.
:class:`GrammarCompiler` validates it up front (:class:`StructuredOutputError` names the
request field and says what is wrong) and makes one :class:`TokenConstraint` per request.

The sampler asks the constraint for the mask of the next token, commits the chosen token, and
ends the sequence once the grammar is complete. The next mask is filled in a worker thread right
after each commit (llguidance releases the GIL), so it is computed while the engine runs the
next decode step and sampling rarely waits for it.

Forced tool calls are written in the exact text format of the model's tool-call parser
(``inference.openai.tool_parsers``): ``hermes`` ``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``, ``qwen3_xml`` ``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nV\\n
</parameter>\\n</function>\\n</tool_call>``, ``generic`` a bare JSON object (or a list of them),
with arguments valid per each tool's ``parameters`` schema.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np

from inference.tokenizer import Tokenizer

__all__ = [
    "CALL_FORMATS",
    "ConstraintStats",
    "GrammarCompiler",
    "StructuredOutputError",
    "TokenConstraint",
    "json_call_prefix",
]

#: Tool-call text formats a constraint can produce (the tool-call parser names).
CALL_FORMATS = ("hermes", "qwen3_xml", "generic")

# JSON is written as the models write it (one space after ':' and ','), but at most one space:
# free whitespace lets a small model at temperature 1 pad until it runs out of tokens.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_pattern": " ?"}

#: Validated grammars remembered per model.
_VALID_GRAMMARS = 256

# Mask fills run here, off the scheduler thread; llguidance releases the GIL while it works.
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="grammar-mask")


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled: ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        """``message`` says what is wrong with ``param``."""
        super().__init__(message)
        self.param = param


@dataclass
class ConstraintStats:
    """Time spent on masks for one request (seconds), for benchmarks and logs."""

    tokens: int = 0
    fill_seconds: float = 0.0  # computing masks (in the worker thread)
    wait_seconds: float = 0.0  # the sampler blocked on a mask not ready yet
    apply_seconds: float = 0.0  # unpacking and applying masks to the logits


def json_call_prefix(name: str) -> str:
    """The text of a JSON tool call up to its arguments (``generic`` and ``hermes``)."""
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


def _lark_string(text: str) -> str:
    # Lark string literals take JSON's escapes.
    return json.dumps(text, ensure_ascii=False)


def _json_rule(schema: Mapping[str, Any]) -> str:
    # Each embedded schema carries its own $defs (refs resolve against it) and JSON options.
    return "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS}, ensure_ascii=False)


class TokenConstraint:
    """One request's grammar state: the mask of the next token, commits, completion.

    Not thread-safe for callers (one sampler owns it); internally a mask fill may be in flight
    in a worker thread between :meth:`commit` and the next :meth:`allowed`, and nothing else
    touches the matcher meanwhile (llguidance refuses concurrent use).
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, words: int) -> None:
        """Own ``matcher``; masks cover tokens ``[0, vocab_size)``; start the first fill."""
        self._matcher = matcher
        self._vocab = vocab_size
        self._bits = np.zeros((1, words), dtype=np.int32)
        self._pending: Future[float] | None = None
        self._done = False
        self._error: str | None = None
        self.stats = ConstraintStats()
        self._start_fill()

    def _fill(self) -> float:
        t0 = time.perf_counter()
        row = self._bits[0]
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return time.perf_counter() - t0

    def _start_fill(self) -> None:
        self._pending = _POOL.submit(self._fill)

    @property
    def done(self) -> bool:
        """True once the grammar is complete: nothing but the end of the sequence may follow."""
        return self._done

    @property
    def error(self) -> str | None:
        """The matcher's error (a token outside the grammar was committed), else None."""
        return self._error

    def allowed(self) -> np.ndarray:
        """Boolean array ``[vocab_size]``: which tokens may come next."""
        t0 = time.perf_counter()
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.stats.fill_seconds += pending.result()
        t1 = time.perf_counter()
        self.stats.wait_seconds += t1 - t0
        bits = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")[: self._vocab]
        self.stats.apply_seconds += time.perf_counter() - t1
        return bits.astype(bool, copy=False)

    def commit(self, token_id: int) -> None:
        """Advance over the sampled token and start filling the next mask in the background."""
        if self._pending is not None:  # commit without a preceding allowed(): keep order
            self.stats.fill_seconds += self._pending.result()
            self._pending = None
        self.stats.tokens += 1
        matcher = self._matcher
        matcher.consume_token(token_id)
        # Read the state now: once the next fill runs, the matcher is busy in the worker.
        self._done = bool(matcher.is_stopped())
        self._error = str(matcher.get_error()) if matcher.is_error() else None
        if not self._done and self._error is None:
            self._start_fill()

    def close(self) -> None:
        """Wait for a fill still running (its buffer must outlive it)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None


class GrammarCompiler:
    """Builds constraints over one model's tokenizer (the llguidance tokenizer is built once)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        """``vocab_size``: the ids the sampler may choose; ``eos_token_ids`` end a sequence."""
        self._tokenizer = tokenizer
        self._vocab = vocab_size
        self._eos = list(dict.fromkeys(eos_token_ids))
        self._lock = threading.Lock()
        self._ll: llguidance.LLTokenizer | None = None
        self._valid: OrderedDict[str, None] = OrderedDict()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance view of the tokenizer (built on first use, ~0.3 s for 50k tokens)."""
        with self._lock:
            if self._ll is None:
                self._ll = llguidance.LLTokenizer(
                    self._tokenizer.backend_json(),
                    n_vocab=self._tokenizer.vocab_size,
                    eos_token=self._eos or None,
                )
            return self._ll

    # -- grammars ------------------------------------------------------------------------------

    def json_schema_grammar(self, schema: object, *, param: str) -> str:
        """Grammar for JSON valid per ``schema`` (a JSON Schema object)."""
        if not isinstance(schema, Mapping):
            raise StructuredOutputError(f"{param} must be a JSON Schema object", param)
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                json.dumps(schema), overrides=_JSON_OPTIONS  # type: ignore[arg-type]
            )
        except (ValueError, TypeError) as exc:
            raise StructuredOutputError(f"{param} is not a usable JSON Schema: {exc}", param) from exc
        self._validate(grammar, param, what="JSON Schema")
        return grammar

    def json_object_grammar(self) -> str:
        """Grammar for any JSON object (``response_format`` ``json_object``)."""
        return self.json_schema_grammar({"type": "object"}, param="response_format")

    def tool_call_grammar(
        self,
        tools: Sequence[Mapping[str, Any]],
        *,
        call_format: str,
        name: str | None,
        parallel: bool,
        param: str = "tool_choice",
    ) -> str:
        """Grammar for tool calls in ``call_format``: of ``name`` only, or any of ``tools``.

        ``parallel``: one or more calls (``generic`` writes a list then); else exactly one.
        """
        if call_format not in CALL_FORMATS:
            raise StructuredOutputError(
                f"tool calls cannot be forced in the {call_format!r} format", param
            )
        params: dict[str, Mapping[str, Any]] = {}
        for i, tool in enumerate(tools):
            fn = tool.get("function") or {}
            fname = fn.get("name")
            if not isinstance(fname, str) or not fname:
                where = f"tools[{i}].function.name"
                raise StructuredOutputError(f"{where} is missing", where)
            schema = fn.get("parameters")
            if schema is None:
                schema = {"type": "object", "properties": {}}
            if not isinstance(schema, Mapping):
                raise StructuredOutputError(
                    f"tools[{i}].function.parameters must be a JSON Schema object",
                    f"tools[{i}].function.parameters",
                )
            params.setdefault(fname, schema)
        if name is not None:
            if name not in params:
                raise StructuredOutputError(
                    f"tool_choice names the function {name!r}, which is not among the request's tools "
                    f"({', '.join(sorted(params)) or 'none'})",
                    "tool_choice.function.name",
                )
            params = {name: params[name]}
        if not params:
            raise StructuredOutputError("forcing a tool call needs tools", param)
        # Validate each tool's schema on its own, so the error names the tool.
        index = {fn.get("function", {}).get("name"): i for i, fn in reversed(list(enumerate(tools)))}
        for fname, schema in params.items():
            self.json_schema_grammar(schema, param=f"tools[{index.get(fname, 0)}].function.parameters")
        rules: list[str] = []
        alternatives: list[str] = []
        for i, (fname, schema) in enumerate(params.items()):
            if call_format == "qwen3_xml":
                rules += _xml_call_rules(i, fname, schema)
            else:
                rules.append(f"args_{i}: {_json_rule(schema)}")
                rules.append(f"call_{i}: {_lark_string(json_call_prefix(fname))} args_{i} \"}}\"")
            alternatives.append(f"call_{i}")
        rules.append("call: " + " | ".join(alternatives))
        if call_format == "generic":
            top = 'start: "[" call (", " call)* "]"' if parallel else "start: call"
        else:
            before = '"\\n"' if call_format == "hermes" else ""
            rules.append(
                f'tagged: {self._literal("<tool_call>")} "\\n" call {before} {self._literal("</tool_call>")}'
            )
            top = 'start: tagged ("\\n" tagged)*' if parallel else "start: tagged"
        lark = "\n".join([top, *rules]) + "\n"
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        self._validate(grammar, param, what="tool-call grammar")
        return grammar

    def _literal(self, text: str) -> str:
        """A Lark term for markup text: the added token that spells it, when there is one.

        llguidance treats every added token as special (its bytes are not its text), so markup
        such as ``<tool_call>`` must be named as the token, which is also what the model emits.
        """
        token_id = self._tokenizer.token_to_id(text)
        if token_id is not None and self.ll_tokenizer.is_special_token(token_id):
            return f"<[{token_id}]>"
        return _lark_string(text)

    def _validate(self, grammar: str, param: str, *, what: str) -> None:
        # Clients repeat their schemas: remember the grammars that passed (bounded, LRU).
        with self._lock:
            if grammar in self._valid:
                self._valid.move_to_end(grammar)
                return
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            raise StructuredOutputError(f"{param}: the {what} cannot be enforced: {error}", param)
        with self._lock:
            self._valid[grammar] = None
            while len(self._valid) > _VALID_GRAMMARS:
                self._valid.popitem(last=False)

    # -- per request -----------------------------------------------------------------------------

    def constraint(self, grammar: str) -> TokenConstraint:
        """A fresh constraint for one request (its first mask starts filling at once)."""
        tok = self.ll_tokenizer
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        if matcher.is_error():
            error = matcher.get_error()
            raise StructuredOutputError(f"the grammar cannot be enforced: {error}", "response_format")
        words = (tok.vocab_size + 31) // 32
        return TokenConstraint(matcher, self._vocab, words)


def _xml_value_rule(rule: str, schema: Mapping[str, Any], defs: Mapping[str, Any] | None) -> str:
    # The XML format writes strings raw and everything else as JSON (tool_parsers._typed_value).
    if schema.get("type") == "string":
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(e, str) and "<" not in e for e in enum):
            return f"{rule}: " + " | ".join(_lark_string(e) for e in enum)
        limit = schema.get("maxLength")
        reps = f"{{0,{int(limit)}}}" if isinstance(limit, int) and limit >= 0 else "*"
        return f"{rule}: /[^<\\n]{reps}/"
    sub = dict(schema)
    if defs:
        sub.setdefault("$defs", defs)
    return f"{rule}: {_json_rule(sub)}"


def _xml_call_rules(i: int, name: str, schema: Mapping[str, Any]) -> list[str]:
    props = schema.get("properties")
    props = props if isinstance(props, Mapping) else {}
    required = set(schema.get("required") or ())
    defs = schema.get("$defs")
    rules: list[str] = []
    parts: list[str] = []
    for j, (pname, pschema) in enumerate(props.items()):
        value = f"v_{i}_{j}"
        rules.append(_xml_value_rule(value, pschema if isinstance(pschema, Mapping) else {}, defs))
        opening = _lark_string(f"<parameter={pname}>\n")
        piece = f'{opening} {value} "\\n</parameter>\\n"'
        parts.append(piece if pname in required else f"({piece})?")
    head = _lark_string(f"<function={name}>\n")
    rules.append(f"call_{i}: {head} {' '.join(parts)} \"</function>\\n\"")
    return rules
