"""The rule of ``inference.openai.nullable``: on every route body, null for a field that may be
left out means its default; a required field is never null; nothing else changes (JSON names,
unknown fields refused, nested types strict)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from inference.openai.anthropic_protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from inference.openai.embeddings_protocol import EmbeddingRequest
from inference.openai.nullable import from_wire, wire_type
from inference.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from inference.openai.responses_protocol import ResponsesRequest

HI = [{"role": "user", "content": "hi"}]
# Every POST body of inference.openai.routes, with the least valid body of each.
BODIES: list[tuple[type[msgspec.Struct], dict[str, Any]]] = [
    (ChatCompletionRequest, {"model": "m", "messages": HI}),
    (CompletionRequest, {"model": "m", "prompt": "hi"}),
    (ResponsesRequest, {"model": "m", "input": "hi"}),
    (EmbeddingRequest, {"model": "m", "input": "hi"}),
    (AnthropicMessagesRequest, {"model": "m", "max_tokens": 2, "messages": HI}),
    (AnthropicCountTokensRequest, {"model": "m", "messages": HI}),
    (TokenizeRequest, {"prompt": "hi"}),
    (DetokenizeRequest, {"tokens": [1]}),
]


def _decode(request: type[msgspec.Struct], body: dict[str, Any]) -> msgspec.Struct:
    return from_wire(msgspec.json.decode(msgspec.json.encode(body), type=wire_type(request)), request)


@pytest.mark.parametrize(("request_type", "base"), BODIES, ids=[t.__name__ for t, _ in BODIES])
def test_null_means_the_default_for_every_optional_field(
    request_type: type[msgspec.Struct], base: dict[str, Any]
) -> None:
    plain = _decode(request_type, base)
    optional = [f for f in msgspec.structs.fields(request_type) if not f.required]
    assert optional
    for f in optional:
        if f.encode_name in base:
            continue
        assert _decode(request_type, {**base, f.encode_name: None}) == plain, f.name
    everything_null = {f.encode_name: None for f in optional if f.encode_name not in base}
    assert _decode(request_type, {**base, **everything_null}) == plain


@pytest.mark.parametrize(("request_type", "base"), BODIES, ids=[t.__name__ for t, _ in BODIES])
def test_a_required_field_is_never_null(request_type: type[msgspec.Struct], base: dict[str, Any]) -> None:
    for f in msgspec.structs.fields(request_type):
        if f.required:
            with pytest.raises(msgspec.ValidationError, match=rf"got `null` - at `\$\.{f.encode_name}`"):
                _decode(request_type, {**base, f.encode_name: None})


def test_values_json_names_and_unknown_fields_are_unchanged() -> None:
    req = _decode(
        ChatCompletionRequest,
        {"model": "m", "messages": [], "n": 3, "stream": True, "logprobs": None, "frequency_penalty": 0.5},
    )
    assert isinstance(req, ChatCompletionRequest)
    assert (req.n, req.stream, req.logprobs, req.frequency_penalty) == (3, True, False, 0.5)
    wire = wire_type(ChatCompletionRequest)
    assert wire.__name__ == "ChatCompletionRequest" and wire is wire_type(ChatCompletionRequest)
    with pytest.raises(msgspec.ValidationError, match="unknown field `max_token`"):
        msgspec.json.decode(b'{"model": "m", "messages": [], "max_token": 1}', type=wire)
    # Nested objects keep their own types: null inside one is checked by that type.
    with pytest.raises(msgspec.ValidationError, match=r"\$\.stream_options\.include_usage"):
        msgspec.json.decode(
            b'{"model": "m", "messages": [], "stream_options": {"include_usage": null}}', type=wire
        )
    names = [f.encode_name for f in msgspec.structs.fields(wire)]
    assert names == [f.encode_name for f in msgspec.structs.fields(ChatCompletionRequest)]
