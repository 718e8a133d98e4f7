"""Lists of prompts on ``/v1/completions`` through a real ``cachesvc serve`` (real ONNX Runtime
engine) and the official ``openai`` SDK: every form OpenAI accepts, choices indexed
prompt-major (``index = prompt_i * n + j``), usage summed, streaming with the same indices, and
the limits (400 naming ``prompt``) refused before anything runs."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from inference.openai.handle import MAX_PROMPTS
from tests.service.conftest import API_KEY, MODEL, REAL_MAX_INPUT_LEN, ServerProcess

PROMPTS = ["Once upon a time", "The capital of France is", "Hello"]


@pytest.fixture(scope="module")
def client(real_server: ServerProcess) -> openai.OpenAI:
    return real_server.client()


def _single(client: openai.OpenAI, prompt: str | list[int]) -> tuple[str, int, int]:
    """Greedy text and usage of one prompt sent on its own."""
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert resp.usage is not None
    return resp.choices[0].text, resp.usage.prompt_tokens, resp.usage.completion_tokens


def test_a_list_of_strings_is_indexed_prompt_major_with_usage_summed(client: openai.OpenAI) -> None:
    singles = [_single(client, p) for p in PROMPTS]
    resp = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=5, temperature=0, n=2)
    assert [c.index for c in resp.choices] == list(range(6))
    # Greedy: both choices of prompt i answer as prompt i does alone.
    assert [c.text for c in resp.choices] == [singles[i][0] for i in range(3) for _ in range(2)]
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == sum(s[1] for s in singles)  # each prompt counted once
    assert resp.usage.completion_tokens == 2 * sum(s[2] for s in singles)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_token_id_forms(client: openai.OpenAI, real_server: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with real_server.http() as h:
        ids = [h.post("/tokenize", json={"prompt": p}, headers=auth).json()["tokens"] for p in PROMPTS[:2]]
    singles = [_single(client, i) for i in ids]
    # A list of token ids is one prompt; a list of lists is several.
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=5, temperature=0)
    assert [(c.index, c.text) for c in one.choices] == [(0, singles[0][0])]
    many = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0, echo=True)
    texts = [c.text for c in many.choices]
    assert [c.index for c in many.choices] == [0, 1]
    for text, single, prompt in zip(texts, singles, PROMPTS[:2], strict=True):
        assert text.endswith(single[0]) and prompt in text  # echo: each choice's own prompt first
    assert many.usage is not None and many.usage.prompt_tokens == sum(len(i) for i in ids)


def test_streaming_keeps_the_indices(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, n=2)
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, n=2, stream=True,
        stream_options={"include_usage": True},
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    chunks = list(stream)
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in full.choices}
    assert finishes == dict.fromkeys(range(6), "length")
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert full.usage is not None and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == 36


def _error(client: openai.OpenAI, **body: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, max_tokens=2, **body)
    assert info.value.status_code == 400
    error: dict[str, Any] = info.value.body  # type: ignore[assignment]
    return error


@pytest.mark.parametrize(
    ("prompt", "extra", "words"),
    [
        ([], {}, "empty list"),
        (["a", [1, 2]], {}, "may not mix"),
        ([[1, 2], []], {}, "prompt[1] is empty"),
        (["a", ""], {}, "prompt[1] is empty"),
        (["", "a"], {}, "prompt[0] is empty"),
        ("", {}, "prompt is empty"),
        ([[1, 2], [1, 10**6]], {}, "outside the vocabulary"),
        (["a"] * (MAX_PROMPTS + 1), {}, f"at most {MAX_PROMPTS}"),
        (["a"] * 11, {"n": 2}, "22 sequences"),  # 4 slots + 16 queued = 20
        ([[1] * (REAL_MAX_INPUT_LEN + 1), [1]], {}, "prompt[0] has"),
    ],
)
def test_bad_lists_are_400s_naming_prompt_and_run_nothing(
    client: openai.OpenAI, real_server: ServerProcess, prompt: Any, extra: dict[str, Any], words: str
) -> None:
    before = real_server.health()["context_cache"]["lookups"]
    error = _error(client, prompt=prompt, **extra)
    assert error["param"] == "prompt" and words in error["message"], error
    assert real_server.health()["context_cache"]["lookups"] == before  # nothing was submitted
    assert real_server.health()["active_requests"] == 0


def test_raw_http_forms(real_server: ServerProcess) -> None:
    # The SDK's types allow these too; raw JSON proves the wire shapes, incl. a bool in a list.
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=real_server.base_url, headers=headers, timeout=60) as h:
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": [True, 1], "max_tokens": 2})
        assert r.status_code == 400 and "prompt" in r.text, r.text
        r = h.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"], "max_tokens": 2})
        assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1], r.text
