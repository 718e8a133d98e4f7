"""Every request field a client may send, through a real ``cachesvc serve`` (real ONNX Runtime
engine on the tiny demo checkpoint) and the official ``openai`` and ``anthropic`` SDKs.

- Every keyword of the SDKs' ``create`` methods is accepted (implemented, or with no effect
  where it has no meaning here); the test lists the keywords from the installed SDK, so a new
  SDK parameter shows up here.
- A field outside the references and our extensions is a 400 naming it (a misspelled
  ``max_token`` never passes silently), on every surface.
- Every field the SDKs type ``Optional`` (and may be left out) takes null, meaning its default;
  the test walks the SDKs' param types, so a newly nullable field shows up here.
- The extensions are implemented: vLLM's ``guided_*`` and ``structured_outputs``, llama-server's
  ``grammar`` (GBNF) and ``json_schema``, ``min_p``, ``repetition_penalty``, ``ignore_eos``.
"""

from __future__ import annotations

import inspect
import json
import re
import types
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import anthropic.types.message_count_tokens_params as count_params
import anthropic.types.message_create_params as message_params
import httpx
import jsonschema
import openai
import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import openai.types.responses.response_create_params as response_params
import pytest
import typing_extensions
from anthropic.resources.messages import Messages
from openai.resources.chat.completions import Completions as ChatCompletions
from openai.resources.completions import Completions
from openai.resources.responses import Responses

from inference.serving.tokenizer import Tokenizer
from tests.service.conftest import API_KEY, MODEL, ServerProcess, running_server, serve_args

MESSAGES: list[Any] = [{"role": "user", "content": "Say something."}]
# Keyword arguments of the SDK methods that are transport options, not body fields.
_TRANSPORT = {"extra_headers", "extra_query", "extra_body", "timeout", "self"}
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(demo_dir: Path, cache_dir: Path, log_dir: Path) -> Iterator[ServerProcess]:
    # Room for tool definitions in the prompt (the profile test_api_surface builds too).
    args = serve_args(max_input_len=512, max_kv_cache_capacity=1024, max_batch_size=4)
    with running_server(demo_dir, cache_dir, log_dir, *args, api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return server.anthropic_client()


def _keywords(method: Callable[..., Any]) -> set[str]:
    return set(inspect.signature(method).parameters) - _TRANSPORT


def _error(exc: openai.APIStatusError | anthropic.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    error: dict[str, Any] = body["error"]
    return error


# -- every keyword of the SDKs -----------------------------------------------------------------


def test_every_chat_completions_keyword_is_accepted(client: openai.OpenAI) -> None:
    tools: Any = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    kwargs: dict[str, Any] = {
        "messages": MESSAGES,
        "model": MODEL,
        "audio": None,
        "frequency_penalty": 0.0,
        "function_call": None,
        "functions": None,
        "logit_bias": {"0": 0},
        "logprobs": True,
        "max_completion_tokens": 4,
        "max_tokens": 4,
        "metadata": {"team": "e2e"},
        "modalities": ["text"],
        "moderation": None,
        "n": 1,
        "parallel_tool_calls": True,
        "prediction": {"type": "content", "content": "Something."},
        "presence_penalty": 0.0,
        "prompt_cache_key": "e2e",
        "prompt_cache_options": {},
        "prompt_cache_retention": "in_memory",
        "reasoning_effort": "low",
        "response_format": {"type": "text"},
        "safety_identifier": "user-1",
        "seed": 7,
        "service_tier": "auto",
        "stop": ["\n\n\n"],
        "store": False,
        "stream": False,
        "stream_options": None,
        "temperature": 0.5,
        "tool_choice": "none",
        "tools": tools,
        "top_logprobs": 2,
        "top_p": 0.9,
        "user": "user-1",
        "verbosity": "low",
        "web_search_options": None,
    }
    # A new SDK keyword fails here: add it to the test and to the server's request type.
    assert set(kwargs) == _keywords(ChatCompletions.create)
    resp = client.chat.completions.create(**kwargs)
    assert resp.choices[0].finish_reason in ("length", "stop") and resp.usage is not None
    assert resp.choices[0].logprobs is not None
    # Asking for what a text-only, offline server cannot do is a 400 naming the field.
    refused: dict[str, Any] = {
        "audio": {"voice": "alloy", "format": "wav"},
        "modalities": ["text", "audio"],
        "web_search_options": {},
        "functions": [{"name": "f", "parameters": {"type": "object"}}],
        "function_call": "auto",
    }
    for name, value in refused.items():
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, **{name: value})
        assert _error(info.value)["param"] == name


def test_every_completions_keyword_is_accepted(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "prompt": "Once upon",
        "best_of": 1,
        "echo": True,
        "frequency_penalty": 0.1,
        "logit_bias": {"0": -1},
        "logprobs": 2,
        "max_tokens": 4,
        "n": 2,
        "presence_penalty": 0.1,
        "seed": 3,
        "stop": "zzz",
        "stream": False,
        "stream_options": None,
        "suffix": None,
        "temperature": 0.7,
        "top_p": 0.9,
        "user": "user-1",
    }
    assert set(kwargs) == _keywords(Completions.create)
    resp = client.completions.create(**kwargs)
    assert len(resp.choices) == 2 and all(c.text.startswith("Once upon") for c in resp.choices)


def test_every_responses_keyword_is_accepted(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "input": "Say something.",
        "access_programs": {},
        "background": False,
        "background_options": {},
        "context_management": None,
        "conversation": None,
        "image": {},
        "include": [],
        "instructions": "Be brief.",
        "max_output_tokens": 4,
        "max_tool_calls": 2,
        "metadata": {"team": "e2e"},
        "moderation": None,
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "prompt": None,
        "prompt_cache_key": "e2e",
        "prompt_cache_options": {},
        "prompt_cache_retention": "in_memory",
        "reasoning": {"effort": "low"},
        "safety_identifier": "user-1",
        "service_tier": "auto",
        "store": False,
        "stream": False,
        "stream_options": None,
        "temperature": 0.5,
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "tool_choice": "none",
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False}],
        "top_logprobs": 0,
        "top_p": 0.9,
        "truncation": "disabled",
        "user": "user-1",
    }
    assert set(kwargs) == _keywords(Responses.create)
    resp = client.responses.create(**kwargs)
    assert resp.status in ("completed", "incomplete")
    stateful: list[tuple[str, Any]] = [("background", True), ("conversation", "c1"), ("prompt", {"id": "p"})]
    for name, value in stateful:
        one: dict[str, Any] = {name: value}
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, input="x", max_output_tokens=2, **one)
        assert _error(info.value)["param"] == name
    # text.format json_schema is enforced like response_format.
    fmt: Any = {"format": {"type": "json_schema", "name": "s", "schema": SCHEMA, "strict": True}}
    out = client.responses.create(model=MODEL, input="JSON?", max_output_tokens=40, text=fmt)
    jsonschema.validate(json.loads(out.output_text), SCHEMA)


def test_every_messages_keyword_is_accepted(claude: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {
        "max_tokens": 4,
        "messages": MESSAGES,
        "model": MODEL,
        "cache_control": {"type": "ephemeral"},
        "container": None,
        "diagnostics": None,
        "inference_geo": "us",
        "metadata": {"user_id": "u1"},
        "output_config": {"effort": "low"},
        "service_tier": "auto",
        "speed": "standard",
        "stop_sequences": ["\n\n\n"],
        "stream": False,
        "system": "Be brief.",
        "thinking": {"type": "disabled"},
        "tool_choice": {"type": "none"},
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "user_profile_id": "up_1",
        "workspace_id": "ws_1",
    }
    assert set(kwargs) == _keywords(Messages.create)
    extra = {"temperature": 0.5, "top_p": 0.9, "top_k": 20}  # in Anthropic's reference
    msg = claude.messages.create(**kwargs, extra_body=extra)
    assert msg.stop_reason in ("max_tokens", "end_turn")
    # output_config.format is enforced like response_format.
    fmt: Any = {"format": {"type": "json_schema", "schema": SCHEMA}}
    msg = claude.messages.create(model=MODEL, max_tokens=40, messages=MESSAGES, output_config=fmt)
    block = msg.content[0]
    assert block.type == "text"
    jsonschema.validate(json.loads(block.text), SCHEMA)
    count = claude.messages.count_tokens(
        model=MODEL, messages=MESSAGES, output_config={"effort": "low"}, thinking={"type": "disabled"}
    )
    assert count.input_tokens > 0


# -- unknown fields ----------------------------------------------------------------------------


def test_unknown_fields_are_400_naming_them(client: openai.OpenAI, claude: anthropic.Anthropic) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body={"max_token": 5})
    err = _error(info.value)
    assert err["param"] == "max_token" and "max_token" in err["message"], err
    assert err["code"] == "unknown_parameter"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"guided_decoding": "x"})
    assert _error(info.value)["param"] == "guided_decoding"
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="x", extra_body={"max_tokens": 5})
    assert _error(info.value)["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, extra_body={"structured_outputs": {"structural_tag": "x"}}
        )
    assert _error(info.value)["param"] == "structured_outputs.structural_tag"
    with pytest.raises(anthropic.BadRequestError) as ainfo:
        claude.messages.create(model=MODEL, max_tokens=2, messages=MESSAGES, extra_body={"max_token": 5})
    body = ainfo.value.response.json()
    assert body["type"] == "error" and "max_token" in body["error"]["message"]


# -- extensions --------------------------------------------------------------------------------


def _chat(client: openai.OpenAI, max_tokens: int = 24, **extra: Any) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=max_tokens, seed=5, extra_body=extra
    )


def test_guided_fields_constrain_the_output(client: openai.OpenAI) -> None:
    choices = ["alpha", "beta", "gamma delta"]
    extra: dict[str, Any]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        for seed in range(3):
            resp = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=8, seed=seed, extra_body=extra
            )
            assert resp.choices[0].message.content in choices, extra
            assert resp.choices[0].finish_reason == "stop"
    regex = r"[0-9]{3}-[a-z]{2}"
    for extra in ({"guided_regex": regex}, {"structured_outputs": {"regex": regex}}):
        text = _chat(client, **extra).choices[0].message.content
        assert text is not None and re.fullmatch(regex, text), (extra, text)
    for extra in (
        {"guided_json": SCHEMA},
        {"guided_json": json.dumps(SCHEMA)},
        {"json_schema": SCHEMA},
        {"structured_outputs": {"json": SCHEMA}},
    ):
        text = _chat(client, max_tokens=40, **extra).choices[0].message.content
        assert text is not None
        jsonschema.validate(json.loads(text), SCHEMA)
    json_object: dict[str, Any] = {"structured_outputs": {"json_object": True}}
    text = _chat(client, max_tokens=6, **json_object).choices[0].message.content
    assert text is not None and text.lstrip().startswith("{")
    gbnf = 'root ::= "yes" | "no" | "maybe " digit\ndigit ::= [0-9]'
    lark = 'start: "yes" | "no" | "maybe " /[0-9]/'
    for extra in (
        {"grammar": gbnf},
        {"guided_grammar": gbnf},
        {"guided_grammar": lark},
        {"structured_outputs": {"grammar": gbnf}},
    ):
        text = _chat(client, **extra).choices[0].message.content
        assert text is not None and re.fullmatch(r"yes|no|maybe [0-9]", text), (extra, text)
    # Completions take them too.
    completion = client.completions.create(
        model=MODEL, prompt="Pick:", max_tokens=8, extra_body={"guided_choice": choices, "seed": 1}
    )
    assert completion.choices[0].text in choices


def test_one_constraint_per_request(client: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}, "grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                "tool_choice": "required",
                "guided_json": SCHEMA,
            },
            "guided_json",
        ),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)
        assert _error(info.value)["param"] == param, (extra, _error(info.value))
    bad: list[tuple[dict[str, Any], str]] = [
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"grammar": "root ::= missing"}, "grammar"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=extra)
        err = _error(info.value)
        assert err["param"] == param and "\n" not in err["message"], (extra, err)


def test_ignore_eos(client: openai.OpenAI, tok: Tokenizer) -> None:
    # A bias makes the end-of-sequence token the first choice: the answer ends at once...
    eos = tok.eos_token_ids[0]
    forced = {str(eos): 100}
    resp = client.completions.create(model=MODEL, prompt="Hi", max_tokens=6, temperature=0, logit_bias=forced)
    assert resp.choices[0].finish_reason == "stop" and resp.usage is not None
    assert resp.usage.completion_tokens <= 1
    # ...unless ignore_eos, which runs to max_tokens.
    resp = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=6, temperature=0, logit_bias=forced,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].finish_reason == "length" and resp.usage is not None
    assert resp.usage.completion_tokens == 6


def test_min_p_and_repetition_penalty_take_effect(client: openai.OpenAI) -> None:
    greedy = client.completions.create(model=MODEL, prompt="Once", max_tokens=16, temperature=0)
    # min_p = 1 keeps only the most likely token: sampling at temperature 1 is greedy then.
    for seed in range(3):
        sampled = client.completions.create(
            model=MODEL, prompt="Once", max_tokens=16, temperature=1.0, seed=seed, extra_body={"min_p": 1.0}
        )
        assert sampled.choices[0].text == greedy.choices[0].text
    plain = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=16, temperature=0, extra_body={"repetition_penalty": 1.0}
    )
    assert plain.choices[0].text == greedy.choices[0].text
    # A prompt that holds the model's own greedy text: continuing it greedily reuses its tokens
    # (random weights loop); a strong penalty on every seen token changes what greedy picks.
    changed = []
    for start in ("Once", "The cat", "1 2 3"):
        seed_text = client.completions.create(model=MODEL, prompt=start, max_tokens=24, temperature=0)
        prompt = start + seed_text.choices[0].text
        texts = [
            client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=32, temperature=0,
                extra_body={"repetition_penalty": rp},
            )
            .choices[0]
            .text
            for rp in (1.0, 5.0)
        ]
        changed.append(texts[0] != texts[1])
    assert any(changed)


# -- null for a field left unset ---------------------------------------------------------------

# The SDKs' request types are the API references: a field typed ``Optional[...]`` there may be
# sent as null (clients that send None for what they leave unset), and null means its default.
# (route, the SDK's param type, a body without the field: the least each route needs, two tokens)
_SDK_PARAMS: list[tuple[str, Any, dict[str, Any]]] = [
    ("/v1/chat/completions", chat_params.CompletionCreateParamsNonStreaming,
     {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}),
    ("/v1/completions", completion_params.CompletionCreateParamsNonStreaming,
     {"model": MODEL, "prompt": "Once", "max_tokens": 2}),
    ("/v1/responses", response_params.ResponseCreateParamsNonStreaming,
     {"model": MODEL, "input": "Say something.", "max_output_tokens": 2}),
    ("/v1/messages", message_params.MessageCreateParamsNonStreaming,
     {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}),
    ("/v1/messages/count_tokens", count_params.MessageCountTokensParams,
     {"model": MODEL, "messages": MESSAGES}),
]


def _admits_null(hint: Any) -> bool:
    if hint is type(None):
        return True
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and any(
        _admits_null(arg) for arg in typing.get_args(hint)
    )


def sdk_nullable_fields(params: Any) -> list[str]:
    """The fields a client may leave out and that the SDK types ``Optional``: null is allowed.

    (A required field that admits None, like completions' ``prompt``, is not "unset" by null.)
    """
    out = []
    for name, hint in typing.get_type_hints(params, include_extras=True).items():
        required = typing.get_origin(hint) is typing_extensions.Required
        while typing.get_origin(hint) in (typing_extensions.Required, typing_extensions.NotRequired,
                                          typing.Annotated):
            hint = typing.get_args(hint)[0]
        if not required and _admits_null(hint):
            out.append(name)
    return sorted(out)


def test_the_sdk_walk_finds_the_fields_clients_send_as_none() -> None:
    chat = sdk_nullable_fields(chat_params.CompletionCreateParamsNonStreaming)
    assert {"n", "presence_penalty", "frequency_penalty", "stream", "logprobs", "max_tokens"} <= set(chat)
    completions = sdk_nullable_fields(completion_params.CompletionCreateParamsNonStreaming)
    assert {"echo", "best_of"} <= set(completions)
    assert "messages" not in chat and "model" not in chat


@pytest.mark.parametrize(("path", "params", "base"), _SDK_PARAMS, ids=[p for p, _, _ in _SDK_PARAMS])
def test_null_for_every_nullable_sdk_field_is_accepted(
    server: ServerProcess, path: str, params: Any, base: dict[str, Any]
) -> None:
    fields = sdk_nullable_fields(params)
    refused = {}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=120) as h:
        for name in fields:
            body = {**base, name: None}
            if name == "max_tokens" and path == "/v1/chat/completions":
                body["max_completion_tokens"] = 2  # still two tokens
            r = h.post(path, json=body)
            if r.status_code != 200:
                refused[name] = r.text
    assert not refused, f"{path}: null refused for {sorted(refused)}: {refused}"


def test_the_sdk_sending_none_gets_the_defaults(client: openai.OpenAI) -> None:
    # The case: a client that sends None for every field it leaves unset.
    want = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    got = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, n=None, presence_penalty=None,
        frequency_penalty=None, stream=None, logprobs=None, top_logprobs=None, seed=None, stop=None,
        logit_bias=None, stream_options=None, top_p=None, max_completion_tokens=None,
    )
    assert [c.message.content for c in got.choices] == [want.choices[0].message.content]
    assert got.choices[0].logprobs is None
    want_text = client.completions.create(model=MODEL, prompt="Once", max_tokens=6, temperature=0)
    got_text = client.completions.create(
        model=MODEL, prompt="Once", max_tokens=6, temperature=0, echo=None, best_of=None, n=None,
        presence_penalty=None, frequency_penalty=None, stream=None, logprobs=None, suffix=None, seed=None,
    )
    assert [c.text for c in got_text.choices] == [want_text.choices[0].text]  # no echo, one choice
    assert got_text.choices[0].logprobs is None


def test_null_for_a_required_field_is_a_400_naming_it(server: ServerProcess) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as h:
        for path, body, field in [
            ("/v1/chat/completions", {"model": MODEL, "messages": None}, "messages"),
            ("/v1/completions", {"model": None, "prompt": "x"}, "model"),
            ("/v1/messages", {"model": MODEL, "messages": MESSAGES, "max_tokens": None}, "max_tokens"),
        ]:
            r = h.post(path, json=body)
            assert r.status_code == 400, r.text
            assert field in r.text and "null" in r.text, r.text
