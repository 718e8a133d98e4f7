"""Sharp edges of structured output and sampling, through a real ``cachesvc serve`` (real ONNX
Runtime engine on the tiny demo checkpoint) and the official ``openai`` SDK.

Each case here was once a 200 with wrong output or a 400 carrying a Rust backtrace (issue 22):
integer bounds llguidance cannot represent, a schema of 16,000 properties, a temperature so
small that dividing by it overflows.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.service.conftest import API_KEY, MODEL, ServerProcess

MESSAGES: list[Any] = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def client(real_server: ServerProcess) -> openai.OpenAI:
    return real_server.client()


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    error: dict[str, Any] = body["error"]
    return error


def _schema_format(schema: dict[str, Any]) -> Any:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def test_integer_bound_beyond_int64_is_400_naming_the_field(client: openai.OpenAI) -> None:
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 10**30, "maximum": 10**31}},
        "required": ["n"],
    }
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, response_format=_schema_format(schema)
        )
    err = _error(info.value)
    assert err["param"] == "response_format.json_schema.schema.properties.n.minimum", err
    assert "64-bit" in err["message"]
    # A float bound beyond the range is refused the same way; bounds within it still work.
    schema["properties"]["n"] = {"type": "integer", "maximum": -1e300}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=8, extra_body={"response_format": _schema_format(schema)}
        )
    assert _error(info.value)["param"].endswith("properties.n.maximum")
    schema["properties"]["n"] = {"type": "integer", "minimum": 1, "maximum": 9}
    schema["additionalProperties"] = False
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=16, seed=1, response_format=_schema_format(schema)
    )
    content = resp.choices[0].message.content
    assert content is not None and 1 <= json.loads(content)["n"] <= 9


def test_huge_schema_is_a_short_400_at_once(client: openai.OpenAI) -> None:
    # 16,000 properties, about 0.5 MB: it used to compile for tens of seconds and end in a
    # Rust panic's backtrace with the build's paths.
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(16_000)}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, response_format=_schema_format(schema)
        )
    err = _error(info.value)
    # Refused by its size ("... bytes"), before the grammar compiler saw it.
    assert err["param"] == "response_format.json_schema.schema", err
    assert len(err["message"]) < 300 and "bytes" in err["message"]
    # Under the byte limit but past the property limit.
    many = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2_100)}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, response_format=_schema_format(many)
        )
    assert "2048 properties" in _error(info.value)["message"]


def test_grammar_errors_are_ours(client: openai.OpenAI) -> None:
    # A grammar error from llguidance: one line, no parser dump, no file path.
    cases: list[dict[str, Any]] = [
        {"response_format": _schema_format({"type": "objekt"})},
        {"guided_regex": "[a-"},
        {"guided_grammar": "root ::= missing_rule"},
        {"grammar": "start: /(?<=a)b/"},
        {"response_format": _schema_format({"type": "string", "pattern": "(?<=a)b"})},
    ]
    for extra in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, extra_body=extra)
        err = _error(info.value)
        message = err["message"]
        assert err["param"], (extra, err)
        assert "\n" not in message and len(message) < 400, message
        assert not re.search(r"(/[\w.-]+){2,}\.rs|backtrace|panicked", message), message


def test_temperature_below_the_floor_is_greedy(client: openai.OpenAI) -> None:
    greedy = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    for temperature in (1e-38, 1e-6):
        tiny = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, temperature=temperature
        )
        assert tiny.choices[0].message.content == greedy.choices[0].message.content, temperature
    text = client.completions.create(model=MODEL, prompt="Once", max_tokens=12, temperature=0)
    tiny_text = client.completions.create(model=MODEL, prompt="Once", max_tokens=12, temperature=1e-38)
    assert tiny_text.choices[0].text == text.choices[0].text


# -- what leaks ------------------------------------------------------------------------------------


def test_models_list_one_entry_per_model_and_no_paths(
    client: openai.OpenAI, real_server: ServerProcess, demo_dir: Path
) -> None:
    ids = [m.id for m in client.models.list().data]
    bundle_id = real_server.bundle_id()
    assert ids.count(MODEL) == 1 and ids[0] == MODEL, ids
    assert bundle_id not in ids and not any(i.startswith("/") for i in ids), ids
    # The checkpoint path and the bundle id still name the model.
    for name in (str(demo_dir), bundle_id):
        resp = client.completions.create(model=name, prompt="Hi", max_tokens=2, temperature=0)
        assert resp.choices[0].text is not None
        assert client.models.retrieve(name).bundle_id == bundle_id  # type: ignore[attr-defined]


def test_no_server_path_in_v1_bodies(real_server: ServerProcess, demo_dir: Path) -> None:
    root = str(demo_dir.parent)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    missing = [str(demo_dir / "model.safetensors"), str(demo_dir) + "-gone", str(demo_dir / "x" / "y.gguf")]
    with real_server.http() as h:
        bodies = [h.get("/v1/models", headers=headers).text]
        for name in missing:
            request = {"model": name, "prompt": "x", "max_tokens": 1}
            r = h.post("/v1/completions", json=request, headers=headers)
            assert r.status_code == 404, r.text
            bodies.append(r.text)
            r = h.get(f"/v1/models/{name}", headers=headers)
            assert r.status_code == 404, r.text
            bodies.append(r.text)
            r = h.post(
                "/v1/messages",
                json={"model": name, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]},
                headers=headers,
            )
            assert r.status_code == 404, r.text
            bodies.append(r.text)
    for text in bodies:
        assert root not in text and "/tmp/" not in text, text
    assert "<server path>" in bodies[1]


def test_an_unpaired_surrogate_is_a_400_on_every_json_route(real_server: ServerProcess) -> None:
    # The body decoder is one for every route: chat, completions and the admin API say the same.
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    cases = [
        ("/v1/chat/completions",
         rb'{"model": "demo-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \ud800"}]}',
         "messages[0].content"),
        ("/v1/completions", rb'{"model": "demo-tiny", "max_tokens": 2, "prompt": ["a", "\udfff"]}',
         "prompt[1]"),
    ]
    with real_server.http() as h:
        for path, body, param in cases:
            r = h.post(path, content=body, headers=headers)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param and "unpaired UTF-16 surrogate" in error["message"], error
        r = h.post("/admin/builds", content=rb'{"model": "x\ud800"}', headers=headers)
        assert r.status_code == 400, r.text
        assert "model, character 1" in r.json()["detail"] and "unpaired" in r.json()["detail"], r.text
