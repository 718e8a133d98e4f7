"""Items 6 and 10: nested JSON and reserved template kwargs are 400s; /v1 types are strict."""

from __future__ import annotations

import pytest

from tests.support.whole_app import MODEL, App

DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_deep_json_on_v1_is_a_400(app: App, path: str) -> None:
    with app.http() as h:
        r = h.post(path, content=DEEP, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert "nested" in r.json()["error"]["message"]
        shallow_but_over = b'{"model": "tiny", "prompt": ' + b"[" * 70 + b"]" * 70 + b"}"
        r = h.post(path, content=shallow_but_over, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text


@pytest.mark.parametrize("path", ["/admin/builds", "/admin/cache/prune"])
def test_deep_json_on_admin_is_a_400(app: App, path: str) -> None:
    with app.http() as h:
        r = h.post(path, content=DEEP, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.headers["content-type"].startswith("application/problem+json")
        assert "nested" in r.json()["detail"]


@pytest.mark.parametrize("key", ["messages", "tools", "add_generation_prompt"])
def test_reserved_chat_template_kwargs_are_a_400(app: App, key: str) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        "chat_template_kwargs": {key: []},
    }
    with app.http() as h:
        r = h.post("/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "chat_template_kwargs"
        assert key in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "max_tokens", "10"),
        ("/v1/completions", "stream", "true"),
        ("/v1/completions", "temperature", "0.5"),
        ("/v1/chat/completions", "max_tokens", "10"),
        ("/v1/chat/completions", "stream", "true"),
        ("/v1/chat/completions", "logprobs", 1),
    ],
)
def test_v1_types_are_strict(app: App, path: str, field: str, value: object) -> None:
    body: dict[str, object] = {"model": MODEL, "max_tokens": 2}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    body[field] = value
    with app.http() as h:
        r = h.post(path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field


def test_official_client_still_works(app: App) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{app.url}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert out.choices[0].text is not None
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
    )
    assert list(chat)
