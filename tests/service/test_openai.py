"""The real server with the real ONNX Runtime engine, driven by the official ``openai`` client.

Greedy output is compared token for token with ``transformers``' greedy ``generate`` on the
same checkpoint and the same prompt (rendered by transformers' own chat template code): the
prompt token count, every generated token's bytes (from logprobs), the text and the completion
token count must all agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from tests.service.conftest import API_KEY, MODEL, REAL_MAX_INPUT_LEN, REAL_MAX_KV, ServerProcess

N_TOKENS = 24
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]


@dataclass(frozen=True)
class Reference:
    """transformers' greedy continuation of the chat prompt."""

    prompt: str
    prompt_ids: tuple[int, ...]
    generated_ids: tuple[int, ...]  # including a final EOS when generation stopped on one
    token_bytes: tuple[bytes, ...]  # one entry per generated non-EOS token
    text: str
    eos_ids: frozenset[int]

    @property
    def stopped_on_eos(self) -> bool:
        """True when greedy generation ended on EOS before ``N_TOKENS``."""
        return bool(self.generated_ids) and self.generated_ids[-1] in self.eos_ids


def _byte_level_decoder() -> dict[str, int]:
    # GPT-2's byte-level alphabet (as in transformers' bytes_to_unicode): printable bytes stand
    # for themselves, the others are shifted to code points from 256 up. Written out here so the
    # reference does not share the server tokenizer's own table.
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _bytes_of_token(tokenizer: Any, token_id: int) -> bytes:
    added = tokenizer.added_tokens_decoder
    if token_id in added:
        return str(added[token_id].content).encode("utf-8")
    table = _byte_level_decoder()
    return bytes(table[ch] for ch in tokenizer.convert_ids_to_tokens(token_id))


@pytest.fixture(scope="module")
def reference(demo_dir: Path) -> Reference:
    """Greedy ``generate`` of the demo checkpoint in transformers (fp32, CPU)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32)
    model.eval()
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = tok(prompt, add_special_tokens=False, return_tensors="pt").input_ids
    eos = model.generation_config.eos_token_id
    eos_ids = frozenset([eos] if isinstance(eos, int) else eos)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=N_TOKENS,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    generated = tuple(int(t) for t in out[0, ids.shape[1] :])
    visible = [t for t in generated if t not in eos_ids]
    return Reference(
        prompt=prompt,
        prompt_ids=tuple(int(t) for t in ids[0]),
        generated_ids=generated,
        token_bytes=tuple(_bytes_of_token(tok, t) for t in visible),
        text=tok.decode(visible, skip_special_tokens=True),
        eos_ids=eos_ids,
    )


@pytest.fixture(scope="module")
def client(real_server: ServerProcess) -> openai.OpenAI:
    return real_server.client()


def _context(server: ServerProcess) -> str:
    return f"\n--- server log ---\n{server.log_tail()}"


# -- models and basic completions -------------------------------------------------------------------


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    # One entry per model: the startup name; its checkpoint path and bundle id answer too but
    # are not listed.
    assert models.data[0].id == MODEL
    card = models.data[0].model_dump()
    assert card["max_model_len"] == REAL_MAX_KV
    assert card["object"] == "model"
    assert card["loaded"] is True and card["backend"] == "onnxruntime"
    assert card["bundle_id"] not in {m.id for m in models.data}
    assert not any(m.id.startswith("/") for m in models.data)


def test_chat_completion(client: openai.OpenAI, reference: Reference) -> None:
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    choice = resp.choices[0]
    assert resp.id.startswith("chatcmpl-") and resp.created > 0 and resp.model == MODEL
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(reference.prompt_ids)
    assert resp.usage.completion_tokens == 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8


def test_chat_completion_streamed(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    ids = {c.id for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    finishes = [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason]
    assert text == full.choices[0].message.content
    assert finishes == ["length"]
    # include_usage: one final chunk with usage and no choices.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert full.usage is not None and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_text_completion(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert resp.choices[0].text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 6
    stream = client.completions.create(
        model=MODEL, prompt=["Once upon a time"], max_tokens=6, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == resp.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]


# -- parity with transformers ----------------------------------------------------------------------


def test_greedy_chat_matches_transformers(
    client: openai.OpenAI, reference: Reference, real_server: ServerProcess
) -> None:
    # A telling comparison needs several generated tokens before any EOS.
    assert len(reference.token_bytes) >= 8, reference
    resp = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=N_TOKENS,
        temperature=0,
        logprobs=True,
    )
    choice = resp.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    got_bytes = tuple(bytes(lp.bytes or []) for lp in choice.logprobs.content)
    assert got_bytes == reference.token_bytes, _context(real_server)
    assert choice.message.content == reference.text
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(reference.prompt_ids)
    assert resp.usage.completion_tokens == len(reference.generated_ids)
    assert choice.finish_reason == ("stop" if reference.stopped_on_eos else "length")


def test_greedy_completion_of_rendered_prompt_matches_transformers(
    client: openai.OpenAI, reference: Reference
) -> None:
    # The same prompt as raw text through /v1/completions: the server's tokenizer must produce
    # transformers' prompt ids (same count) and the engine the same continuation.
    resp = client.completions.create(
        model=MODEL, prompt=reference.prompt, max_tokens=N_TOKENS, temperature=0, logprobs=1
    )
    choice = resp.choices[0]
    assert resp.usage is not None and resp.usage.prompt_tokens == len(reference.prompt_ids)
    assert choice.text == reference.text
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert "".join(choice.logprobs.tokens) == reference.text
    assert resp.usage.completion_tokens == len(reference.generated_ids)
    # The same prompt as token ids gives the same text.
    by_ids = client.completions.create(
        model=MODEL, prompt=list(reference.prompt_ids), max_tokens=N_TOKENS, temperature=0
    )
    assert by_ids.choices[0].text == reference.text


# -- sampling controls -----------------------------------------------------------------------------


def _sampled(client: openai.OpenAI, seed: int) -> str:
    resp = client.completions.create(
        model=MODEL, prompt="The weather today", max_tokens=N_TOKENS, temperature=1.0, seed=seed
    )
    return resp.choices[0].text


def test_same_seed_same_text(client: openai.OpenAI) -> None:
    first, again = _sampled(client, 1234), _sampled(client, 1234)
    assert first == again
    # Not a constant: other seeds give other text (24 tokens at temperature 1 on random weights).
    others = {_sampled(client, s) for s in (1, 2, 3)}
    assert others - {first}, "the seed does not change the sampled text"


def _split_stop(token_bytes: Sequence[bytes], text: str) -> tuple[str, str]:
    """A two-character stop string whose first occurrence spans a token boundary, and the text
    before it: the last character of token k and the first of token k+1."""
    for k in range(2, len(token_bytes) - 1):
        a, b = token_bytes[k], token_bytes[k + 1]
        if not (a.isascii() and b.isascii() and a.strip() and b.strip()):
            continue
        before = b"".join(token_bytes[: k + 1]).decode("utf-8", errors="replace")[:-1]
        stop = a.decode()[-1] + b.decode()[0]
        if text.startswith(before) and text.find(stop) == len(before):
            return stop, before
    pytest.fail(f"no ASCII token boundary to split a stop string across in {text!r}")


def test_stop_sequences(client: openai.OpenAI, reference: Reference) -> None:
    text = reference.text
    # A stop string that lies within one token's text, found in the known greedy output.
    stop_inside = text[len(text) // 2 : len(text) // 2 + 2]
    stop_split, before_split = _split_stop(reference.token_bytes, text)
    for stop, expected in ((stop_inside, text[: text.find(stop_inside)]), (stop_split, before_split)):
        resp = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=N_TOKENS,
            temperature=0,
            stop=[stop, "\x00never"],
        )
        assert resp.choices[0].message.content == expected, stop
        assert resp.choices[0].finish_reason == "stop"
        stream = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=N_TOKENS,
            temperature=0,
            stop=stop,
            stream=True,
        )
        chunks = [c for c in stream if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected, stop
        assert chunks[-1].choices[0].finish_reason == "stop"


def test_max_tokens_one_is_length(client: openai.OpenAI, reference: Reference) -> None:
    assert reference.generated_ids[0] not in reference.eos_ids
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 1
    assert resp.choices[0].message.content == reference.token_bytes[0].decode("utf-8", errors="replace")
    resp2 = client.completions.create(model=MODEL, prompt="abc", max_tokens=1)
    assert resp2.choices[0].finish_reason == "length"


# -- errors ----------------------------------------------------------------------------------------


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"}, body
    err: dict[str, Any] = body["error"]
    assert err["message"], body
    return err


def test_missing_or_wrong_api_key_is_401(real_server: ServerProcess) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        real_server.client(api_key="wrong-key").models.list()
    assert info.value.status_code == 401
    assert _error(info.value)["code"] == "invalid_api_key"
    # The openai client refuses to send no key at all, so that case goes over plain HTTP.
    with real_server.http() as h:
        missing = h.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert missing.status_code == 401
        assert "missing API key" in missing.json()["error"]["message"]
        ok = h.get("/v1/models", headers={"x-api-key": API_KEY})
        assert ok.status_code == 200
        # Health stays open without a key.
        assert h.get("/health").status_code == 200
        assert h.get("/health/ready").status_code == 200


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    err = _error(info.value)
    assert err["code"] == "model_not_found" and err["param"] == "model"
    assert "no-such-model" in err["message"] and MODEL in err["message"]


def test_prompt_longer_than_max_input_len_is_400(client: openai.OpenAI) -> None:
    long_prompt = "one two three four five six seven eight nine ten " * 10
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
    err = _error(info.value)
    assert err["code"] == "context_length_exceeded"
    assert str(REAL_MAX_INPUT_LEN) in err["message"]


def test_prompt_plus_max_tokens_beyond_kv_capacity_is_400(client: openai.OpenAI) -> None:
    prompt = "one two three four five six seven eight nine ten " * 3
    ok = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert ok.usage is not None
    n = ok.usage.prompt_tokens
    assert n <= REAL_MAX_INPUT_LEN
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=REAL_MAX_KV - n + 1)
    err = _error(info.value)
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    # Exactly the room left is accepted.
    fits = client.completions.create(model=MODEL, prompt=prompt, max_tokens=REAL_MAX_KV - n, temperature=0)
    assert fits.choices[0].finish_reason in ("stop", "length")


def test_n_over_8_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, n=9)
    err = _error(info.value)
    assert err["param"] == "n" and "n=9" in err["message"] and "between 1 and 8" in err["message"]


def test_server_still_healthy(real_server: ServerProcess) -> None:
    # After every error above the server is up with nothing left running or queued.
    health = real_server.health()
    assert health["status"] == "ok"
    assert health["active_requests"] == 0 and health["queued_requests"] == 0
    assert health["model"] == MODEL
    with httpx.Client() as h:
        assert h.get(f"{real_server.base_url}/health/ready").status_code == 200


def test_auto_tool_choice_without_the_flag_is_400(client: openai.OpenAI) -> None:
    tools: list[ChatCompletionToolParam] = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    ]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=tools, tool_choice="auto", max_tokens=2
        )
    err = _error(info.value)
    assert err["param"] == "tool_choice" and "--enable-auto-tool-choice" in err["message"]


def test_validation_errors_name_the_field(client: openai.OpenAI, real_server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, temperature=3)
    assert _error(info.value)["param"] == "temperature"
    # A body the schema rejects: the error body is still OpenAI's and names the field.
    with real_server.http() as h:
        r = h.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": "not a list"},
            headers={"Authorization": f"Bearer {API_KEY}"},
        )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "messages" in (err.get("param") or "") + err["message"], err
