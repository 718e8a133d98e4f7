"""Structured output: grammar compilation errors, masks, the sampler, forced tool calls over HTTP.

Masks are checked by random walks: at every step a token is drawn uniformly from what the mask
allows, so any hole in a grammar shows up as output that does not parse or validate.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import numpy as np
import pytest
from litestar.testing import AsyncTestClient

from inference.openai import ModelHandle
from inference.openai.tool_parsers import TOOL_PARSERS, forced_call_stream
from inference.serving.generation import GenerationState
from inference.serving.sampling import MIN_TEMPERATURE, Sampler, SamplingParams
from inference.serving.structured import (
    GrammarCompiler,
    GrammarLimits,
    StructuredOutputError,
    TokenConstraint,
    clean_error,
)
from inference.serving.tokenizer import Tokenizer
from tests.serving.conftest import MODEL, TableEngine, make_app, make_options

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "set_alarm",
            "parameters": {
                "type": "object",
                "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
                "required": ["hour"],
                "additionalProperties": False,
            },
        },
    },
]
ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "maxItems": 3,
            "items": {"$ref": "#/$defs/item"},
        },
        "paid": {"type": "boolean"},
        "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 8}]},
    },
    "required": ["items", "paid", "note"],
    "additionalProperties": False,
    "$defs": {
        "item": {
            "type": "object",
            "properties": {
                "sku": {"enum": ["a1", "b2"]},
                "qty": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["sku", "qty"],
            "additionalProperties": False,
        }
    },
}


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)


def _walk(tokenizer: Tokenizer, constraint: TokenConstraint, seed: int, limit: int = 400) -> str:
    rng = np.random.default_rng(seed)
    ids: list[int] = []
    for _ in range(limit):
        allowed = np.flatnonzero(constraint.allowed())
        assert allowed.size, "a grammar that is not complete must allow some token"
        token = int(rng.choice(allowed))
        ends = np.intersect1d(allowed, tokenizer.eos_token_ids)
        if ends.size and rng.random() < 0.5:  # complete: end half of the time
            token = int(ends[0])
        if token in tokenizer.eos_token_ids:
            assert ends.size, "EOS only where the grammar is complete"
            break
        ids.append(token)
        constraint.commit(token)
        assert constraint.error is None
        if constraint.done:
            break
    else:
        pytest.fail(f"no end after {limit} tokens: {tokenizer.decode(ids)!r}")
    return tokenizer.decode(ids)


@pytest.mark.parametrize(
    ("schema", "fragment"),
    [
        ({"type": "object", "properties": {"a": {"type": "strnig"}}}, "strnig"),
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "missing"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, ""),
        ([1, 2], "JSON Schema object"),
        ("not a schema", "JSON Schema object"),
    ],
)
def test_bad_schemas_name_the_field(compiler: GrammarCompiler, schema: Any, fragment: str) -> None:
    with pytest.raises(StructuredOutputError) as info:
        compiler.json_schema_grammar(schema, param="response_format.json_schema.schema")
    assert info.value.param == "response_format.json_schema.schema"
    assert fragment in str(info.value)


def test_bad_tool_choices(compiler: GrammarCompiler) -> None:
    with pytest.raises(StructuredOutputError) as info:
        compiler.tool_call_grammar(TOOLS, call_format="hermes", name="nope", parallel=False)
    assert info.value.param == "tool_choice.function.name" and "get_weather" in str(info.value)
    broken = [TOOLS[0], {"type": "function", "function": {"name": "x", "parameters": {"type": "nope"}}}]
    with pytest.raises(StructuredOutputError) as info:
        compiler.tool_call_grammar(broken, call_format="generic", name=None, parallel=False)
    assert info.value.param == "tools[1].function.parameters"


@pytest.mark.parametrize("schema", [WEATHER, ORDER], ids=["weather", "order"])
def test_random_walks_through_the_mask_give_valid_json(
    tokenizer: Tokenizer, compiler: GrammarCompiler, schema: dict[str, Any]
) -> None:
    grammar = compiler.json_schema_grammar(schema, param="response_format")
    for seed in range(20):
        text = _walk(tokenizer, compiler.constraint(grammar), seed)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_mask(tokenizer: Tokenizer, compiler: GrammarCompiler) -> None:
    constraint = compiler.constraint(compiler.json_object_grammar())
    allowed = np.flatnonzero(constraint.allowed())
    # Only tokens that can start a JSON object: "{" possibly followed by more, or whitespace.
    assert allowed.size
    texts = [tokenizer.decode([int(t)]) for t in allowed]
    assert all(t.lstrip(" ").startswith("{") or not t.strip() for t in texts), texts


@pytest.mark.parametrize("call_format", ["hermes", "qwen3_xml", "generic"])
@pytest.mark.parametrize("name", [None, "set_alarm"])
def test_forced_tool_calls_parse_with_the_models_parser(
    tokenizer: Tokenizer, compiler: GrammarCompiler, call_format: str, name: str | None
) -> None:
    grammar = compiler.tool_call_grammar(TOOLS, call_format=call_format, name=name, parallel=name is None)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    parser = TOOL_PARSERS[call_format]
    for seed in range(12):
        text = _walk(tokenizer, compiler.constraint(grammar), seed)
        content, calls = parser.extract(text, TOOLS)
        assert calls and content is None, text
        for call in calls:
            assert name is None or call.name == name
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        if call_format != "qwen3_xml":
            # The streaming splitter finds the same calls, fed a character at a time.
            stream = forced_call_stream(parser, TOOLS)
            pieces: dict[int, list[str]] = {}
            for ch in text:
                out, events = stream.feed(ch)
                assert out == ""
                for ev in events:
                    if ev.arguments is not None:
                        pieces.setdefault(ev.index, []).append(ev.arguments)
            assert [c.name for c in stream.calls] == [c.name for c in calls]
            for i, call in enumerate(calls):
                assert json.loads("".join(pieces[i])) == json.loads(call.arguments)


def test_sampler_masks_before_sampling_and_ends_with_the_grammar(
    tokenizer: Tokenizer, compiler: GrammarCompiler
) -> None:
    schema = {"enum": ["yes", "no"]}
    constraint = compiler.constraint(compiler.json_schema_grammar(schema, param="response_format"))
    sampler = Sampler(SamplingParams(temperature=0.0), tokenizer.vocab_size, constraint)
    eos = tokenizer.eos_token_ids
    state = GenerationState(tokenizer, prompt_ids=[1], max_new_tokens=50, eos_token_ids=eos)
    favourite = tokenizer.encode("maybe")[0]
    text = ""
    for _ in range(50):
        logits = np.zeros(tokenizer.vocab_size, dtype=np.float32)
        logits[favourite] = 100.0  # the model wants a token the grammar forbids
        sample = sampler.sample(logits)
        assert sample.token_id != favourite
        out = state.push(sample)
        text += out.text
        if out.finished:
            break
    assert json.loads(text) in ("yes", "no")
    assert out.finish_reason == "stop" and sample.grammar_done
    assert constraint.stats.tokens == out.completion_tokens


# -- over HTTP ---------------------------------------------------------------------------------


def _serving(tokenizer: Tokenizer, **opts: Any) -> ModelHandle:
    options = make_options(max_model_len=1400, max_input_len=1000, **opts)
    return ModelHandle(TableEngine(capacity=2048), tokenizer, options)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_http_response_format_and_errors(tokenizer: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "Order?"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER, "strict": True}}
    async with AsyncTestClient(app=make_app(_serving(tokenizer))) as c:
        for seed in range(4):
            r = await c.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": msgs, "response_format": fmt, "seed": seed,
                      "max_tokens": 300},
            )
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            jsonschema.validate(json.loads(choice["message"]["content"]), ORDER)
            assert choice["finish_reason"] == "stop"
        weather = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
        r = await c.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x", "response_format": weather, "max_tokens": 300},
        )
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), WEATHER)
        # Any object: unbounded, so this random engine may run out of tokens; it starts as one.
        r = await c.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "x", "response_format": {"type": "json_object"}, "max_tokens": 5},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"].lstrip().startswith("{")
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}
        cases: list[tuple[dict[str, Any], str, str]] = [
            ({"response_format": bad}, "response_format.json_schema.schema", "objekt"),
            ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "json_schema"),
            ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
            (
                {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                "tool_choice.function.name",
                "nope",
            ),
            ({"tool_choice": {"type": "function", "function": {"name": "x"}}}, "tool_choice", "tools"),
            ({"tools": TOOLS, "tool_choice": "required", "response_format": fmt}, "response_format", "tool"),
        ]
        for extra, param, fragment in cases:
            r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, **extra})
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert err["param"] == param and fragment in err["message"], err


@pytest.mark.anyio
async def test_http_forced_tool_calls_stream_arguments_in_pieces(tokenizer: Tokenizer) -> None:
    # No --enable-auto-tool-choice needed; the engine says qwen2, so calls come in hermes tags.
    msgs = [{"role": "user", "content": "Weather?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with AsyncTestClient(app=make_app(_serving(tokenizer))) as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": msgs, "tools": TOOLS, "tool_choice": named, "max_tokens": 300},
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        [call] = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
        jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)

        body = {"model": MODEL, "messages": msgs, "tools": TOOLS, "tool_choice": "required", "stream": True,
                "max_tokens": 300, "seed": 3, "parallel_tool_calls": False}
        r = await c.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        blocks = r.text.replace("\r\n", "\n").split("\n\n")
        events = [json.loads(b[6:]) for b in blocks if b.startswith("data: {")]
        deltas = [d for e in events for ch in e["choices"] for d in ch["delta"].get("tool_calls") or []]
        finishes = [ch["finish_reason"] for e in events for ch in e["choices"] if ch["finish_reason"]]
        assert finishes == ["tool_calls"]
        by_index: dict[int, list[dict[str, Any]]] = {}
        for d in deltas:
            by_index.setdefault(d["index"], []).append(d)
        assert by_index
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for parts in by_index.values():
            assert parts[0]["id"] and parts[0]["function"]["name"] in schemas
            assert all("id" not in p for p in parts[1:])
            args = "".join(p["function"].get("arguments", "") for p in parts)
            assert len(parts) > 2, "arguments come piece by piece"
            jsonschema.validate(json.loads(args), schemas[parts[0]["function"]["name"]])


@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (5, 1.0), (0, 0.5)])
def test_sampled_tokens_stay_in_the_grammar(
    tokenizer: Tokenizer, compiler: GrammarCompiler, top_k: int, top_p: float
) -> None:
    grammar = compiler.json_schema_grammar(ORDER, param="response_format")
    rng = np.random.default_rng(0)
    for seed in range(8):
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=seed)
        sampler = Sampler(params, tokenizer.vocab_size, compiler.constraint(grammar))
        eos = tokenizer.eos_token_ids
        state = GenerationState(tokenizer, prompt_ids=[1], max_new_tokens=400, eos_token_ids=eos)
        text = ""
        while True:
            logits = (rng.standard_normal(tokenizer.vocab_size) * 4).astype(np.float32)
            out = state.push(sampler.sample(logits))
            text += out.text
            if out.finished:
                break
        assert out.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), ORDER)


# -- limits and our own error messages -----------------------------------------------------------


def test_schema_limits_refuse_before_compiling(tokenizer: Tokenizer) -> None:
    limits = GrammarLimits(max_schema_bytes=2000, max_schema_properties=10)
    small = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, limits)
    nested = {"type": "object", "properties": {"a": {"type": "object", "properties": {
        f"p{i}": {"type": "string"} for i in range(10)}}}}
    with pytest.raises(StructuredOutputError, match="more than 10 properties") as info:
        small.json_schema_grammar(nested, param="s")
    assert info.value.param == "s"
    with pytest.raises(StructuredOutputError, match="at most 2000 bytes"):
        small.json_schema_grammar({"type": "string", "description": "x" * 2000}, param="s")
    with pytest.raises(StructuredOutputError, match="at most 2000"):
        small.regex_grammar("a" * 2001, param="guided_regex")


@pytest.mark.parametrize(
    ("node", "where"),
    [
        ({"type": "integer", "minimum": 2**63}, "s.minimum"),
        ({"type": ["integer", "null"], "exclusiveMaximum": -(2**64)}, "s.exclusiveMaximum"),
        ({"type": "array", "items": [{"type": "integer", "maximum": 1e19}]}, "s.items[0].maximum"),
        ({"anyOf": [{"type": "integer", "minimum": 1e30}]}, "s.anyOf[0].minimum"),
    ],
)
def test_integer_bounds_past_int64_name_the_bound(compiler: GrammarCompiler, node: Any, where: str) -> None:
    with pytest.raises(StructuredOutputError, match="64-bit") as info:
        compiler.json_schema_grammar(node, param="s")
    assert info.value.param == where


def test_integer_bounds_within_int64_and_number_bounds_pass(compiler: GrammarCompiler) -> None:
    compiler.json_schema_grammar({"type": "integer", "minimum": -(10**18), "maximum": 10**18}, param="s")
    compiler.json_schema_grammar({"type": "number", "maximum": 1e6}, param="s")


def test_clean_error_keeps_one_line_without_paths() -> None:
    panic = (
        "thread '<unnamed>' panicked at /home/runner/.cargo/registry/src/derivre-0.3/src/ast.rs:12:5\n"
        "stack backtrace:\n   0: rust_begin_unwind\n      at /rustc/abc/library/std/src/panicking.rs:665"
    )
    assert clean_error(panic) == "the grammar engine refused it"
    regex = 'at 1(8): invalid regex "[a-": regex parse error:\n    [a-\n    ^\nerror: unclosed class\n'
    assert clean_error(regex) == 'at 1(8): invalid regex "[a-": regex parse error: error: unclosed class'
    assert "<path>" in clean_error("failed reading /usr/lib/x/y.json here")
    assert len(clean_error("x" * 1000)) == 300


@pytest.mark.anyio
async def test_http_compile_deadline_is_a_400(tokenizer: Tokenizer) -> None:
    # 2,000 optional properties compile in a fraction of a second: past a 1 ms deadline.
    limits = GrammarLimits(compile_timeout=0.001)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": wide}}
    async with AsyncTestClient(app=make_app(_serving(tokenizer, grammar_limits=limits))) as c:
        r = await c.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "response_format": fmt},
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "response_format.json_schema.schema" and "longer than" in err["message"]


def test_temperature_below_the_floor_samples_greedily() -> None:
    logits = np.array([0.0, 3.0, 2.9, -1.0], dtype=np.float32)
    for temperature in (1e-38, 1e-6, 0.0):
        sampler = Sampler(SamplingParams(temperature=temperature, seed=0), 4)
        assert sampler.greedy
        assert [sampler.sample(logits).token_id for _ in range(20)] == [1] * 20
        assert sampler.distribution(logits).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert not Sampler(SamplingParams(temperature=MIN_TEMPERATURE), 4).greedy
