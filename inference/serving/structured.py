"""Structured output: JSON schemas, regexes, choices, grammars and forced tool calls compiled
into llguidance token masks.

A request's constraint (``response_format`` json_object / json_schema, a named ``tool_choice``
or ``tool_choice="required"``, vLLM's ``guided_*`` / ``structured_outputs``, llama-server's
``grammar`` in GBNF and ``json_schema``) becomes an llguidance grammar over the model's own
tokenizer. :class:`GrammarCompiler` validates it up front (:class:`StructuredOutputError` names
the request field and says what is wrong, in one line of ours: never the Rust side's backtrace
or paths) within :class:`GrammarLimits` (schema bytes, property count; integer bounds must fit
64 bits, since llguidance clamps wider ones) and makes one :class:`TokenConstraint` per request.

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
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

from inference.serving.tokenizer import Tokenizer

__all__ = [
    "CALL_FORMATS",
    "INT64_MAX",
    "ConstraintStats",
    "GrammarCompiler",
    "GrammarLimits",
    "StructuredOutputError",
    "TokenConstraint",
    "check_schema",
    "clean_error",
    "json_call_prefix",
]

#: Tool-call text formats a constraint can produce (the tool-call parser names).
CALL_FORMATS = ("hermes", "qwen3_xml", "generic")

# JSON is written as the models write it (one space after ':' and ','), but at most one space:
# free whitespace lets a small model at temperature 1 pad until it runs out of tokens.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_pattern": " ?"}

#: Validated grammars remembered per model.
_VALID_GRAMMARS = 256

#: The widest integer bound llguidance represents: beyond it a bound is silently clamped, and
#: output that obeys the clamped grammar breaks the client's schema.
INT64_MAX = (1 << 63) - 1
_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")

# Parser limits of every grammar we validate or run: terse errors (no parser state or grammar
# dump in a message a client reads), llguidance's own resource caps otherwise.
_PARSER_LIMITS = llguidance.LLParserLimits(verbose_errors=False)

# Mask fills run here, off the scheduler thread; llguidance releases the GIL while it works.
_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="grammar-mask")


class StructuredOutputError(ValueError):
    """A constraint that cannot be compiled: ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        """``message`` says what is wrong with ``param``."""
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's constraint may cost: schema size, property count, compile time.

    A 1.2 MB schema of 16,000 properties compiles for tens of seconds of CPU while every other
    request slows down; the size limits refuse it before any grammar work, the deadline is the
    backstop for what stays small but is still expensive (the handle enforces it).
    """

    #: Bytes of one schema, as compact JSON.
    max_schema_bytes: int = 256 * 1024
    #: Properties over all objects of one schema (nested ones included).
    max_schema_properties: int = 2048
    #: Seconds a grammar may take to compile and validate before the request gets a 400.
    compile_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.max_schema_bytes < 1 or self.max_schema_properties < 1:
            raise ValueError("schema limits must be at least 1")
        if not self.compile_timeout > 0:
            raise ValueError("compile_timeout must be positive")


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


_PATH = re.compile(r"(?:[A-Za-z]:)?(?:[/\\][\w.@+~-]+){2,}[/\\]?")


def clean_error(error: object, limit: int = 300) -> str:
    """llguidance's complaint in a form fit for a client: its first line (and the ``error:``
    line of a regex error), no backtrace, no file paths of the build, at most ``limit`` chars."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    kept: list[str] = []
    for i, line in enumerate(lines):
        if "backtrace" in line.lower() or "panicked at" in line.lower():
            break
        if i == 0 or line.startswith("error:"):
            kept.append(line)
    text = _PATH.sub("<path>", " ".join(kept)) or "the grammar engine refused it"
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _guarded(what: str, param: str, make: Any) -> Any:
    # A Rust panic surfaces as pyo3's PanicException, a BaseException; it must become a 400 with
    # our words, never a backtrace in the body nor a dead worker.
    try:
        return make()
    except (KeyboardInterrupt, SystemExit):
        raise
    except StructuredOutputError:
        raise
    except BaseException as exc:
        message = f"{param}: the {what} cannot be enforced: {clean_error(exc)}"
        raise StructuredOutputError(message, param) from None


def check_schema(schema: Mapping[str, Any], param: str, limits: GrammarLimits) -> str:
    """The schema as compact JSON, after the checks llguidance does not make: its size, its
    property count and integer bounds it can represent (each error names the field)."""
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    size = len(text.encode("utf-8"))
    if size > limits.max_schema_bytes:
        raise StructuredOutputError(
            f"{param} is {size} bytes; this server compiles schemas of at most "
            f"{limits.max_schema_bytes} bytes",
            param,
        )
    properties = 0
    # Iterative walk: a schema may nest as deep as the body allows.
    stack: list[tuple[object, str]] = [(schema, param)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(node))
            continue
        if not isinstance(node, Mapping):
            continue
        props = node.get("properties")
        if isinstance(props, Mapping):
            properties += len(props)
            if properties > limits.max_schema_properties:
                raise StructuredOutputError(
                    f"{param} has more than {limits.max_schema_properties} properties; this server "
                    "compiles schemas with at most that many",
                    param,
                )
        kind = node.get("type")
        if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
            for key in _BOUND_KEYS:
                bound = node.get(key)
                if isinstance(bound, bool) or not isinstance(bound, int | float):
                    continue
                if not math.isfinite(bound) or abs(bound) > INT64_MAX:
                    raise StructuredOutputError(
                        f"{where}.{key} is {bound!r}; integer bounds must lie within "
                        f"\u00b1{INT64_MAX} (64-bit)",
                        f"{where}.{key}",
                    )
        for key, value in node.items():
            if isinstance(value, Mapping | list) and key != "enum" and key != "const":
                stack.append((value, f"{where}.{key}"))
    return text


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

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        limits: GrammarLimits | None = None,
    ) -> None:
        """``vocab_size``: the ids the sampler may choose; ``eos_token_ids`` end a sequence;
        ``limits``: what one request's schema may cost (defaults: :class:`GrammarLimits`)."""
        self.limits = limits or GrammarLimits()
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
        text = check_schema(schema, param, self.limits)
        try:
            grammar: str = llguidance.LLMatcher.grammar_from_json_schema(
                text, overrides=_JSON_OPTIONS  # type: ignore[arg-type]
            )
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # a Rust panic is a BaseException
            message = f"{param} is not a usable JSON Schema: {clean_error(exc)}"
            raise StructuredOutputError(message, param) from None
        self._validate(grammar, param, what="JSON Schema")
        return grammar

    def regex_grammar(self, pattern: object, *, param: str) -> str:
        """Grammar for text matching ``pattern`` (a Rust ``regex`` pattern, as vLLM's ``guided_regex``)."""
        if not isinstance(pattern, str) or not pattern:
            raise StructuredOutputError(f"{param} must be a non-empty regular expression", param)
        self._check_text_size(pattern, param)
        grammar: str = _guarded(
            "regular expression", param, lambda: llguidance.LLMatcher.grammar_from_regex(pattern)
        )
        self._validate(grammar, param, what="regular expression")
        return grammar

    def choice_grammar(self, choices: object, *, param: str) -> str:
        """Grammar for exactly one of ``choices`` (strings; vLLM's ``guided_choice``)."""
        if (
            not isinstance(choices, list)
            or not choices
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise StructuredOutputError(f"{param} must be a non-empty list of non-empty strings", param)
        self._check_text_size(json.dumps(choices), param)
        lark = "start: " + " | ".join(_lark_string(c) for c in dict.fromkeys(choices)) + "\n"
        grammar: str = _guarded("choice", param, lambda: llguidance.LLMatcher.grammar_from_lark(lark))
        self._validate(grammar, param, what="choice")
        return grammar

    def lark_grammar(self, text: object, *, param: str) -> str:
        """Grammar from a context-free grammar: llguidance's Lark dialect, or llama.cpp's GBNF
        (``root ::= ...``), which llguidance translates to Lark."""
        if not isinstance(text, str) or not text.strip():
            raise StructuredOutputError(f"{param} must be a non-empty grammar", param)
        self._check_text_size(text, param)

        def make() -> str:
            lark = text if is_lark_syntax(text) else gbnf_to_lark(text)
            return str(llguidance.LLMatcher.grammar_from_lark(lark))

        grammar: str = _guarded("grammar", param, make)
        self._validate(grammar, param, what="grammar")
        return grammar

    def _check_text_size(self, text: str, param: str) -> None:
        size = len(text.encode("utf-8"))
        if size > self.limits.max_schema_bytes:
            raise StructuredOutputError(
                f"{param} is {size} bytes; this server compiles at most {self.limits.max_schema_bytes}",
                param,
            )

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
        tok = self.ll_tokenizer
        error = _guarded(
            what, param, lambda: llguidance.LLMatcher.validate_grammar(grammar, tok, limits=_PARSER_LIMITS)
        )
        if error:
            message = f"{param}: the {what} cannot be enforced: {clean_error(error)}"
            raise StructuredOutputError(message, param)
        with self._lock:
            self._valid[grammar] = None
            while len(self._valid) > _VALID_GRAMMARS:
                self._valid.popitem(last=False)

    # -- per request -----------------------------------------------------------------------------

    def constraint(self, grammar: str) -> TokenConstraint:
        """A fresh constraint for one request (its first mask starts filling at once)."""
        tok = self.ll_tokenizer
        matcher = _guarded(
            "grammar",
            "response_format",
            lambda: llguidance.LLMatcher(tok, grammar, log_level=0, limits=_PARSER_LIMITS),
        )
        if matcher.is_error():
            error = clean_error(matcher.get_error())
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
