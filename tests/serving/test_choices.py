"""``n`` choices (one prefill, KV copied to the others; choice i seeded with seed + i), ``echo``
and ``suffix`` on the real /v1 stack with numpy engines."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from litestar.testing import AsyncTestClient

from inference.openai import ModelHandle
from inference.serving.context_cache import PrefixStore
from inference.serving.tokenizer import Tokenizer
from tests.serving.conftest import MODEL, TableEngine, make_app, make_options
from tests.support.engines import KVTableEngine

pytestmark = pytest.mark.anyio

PROMPT = "Once upon a time there was"


async def _client(engine: Any, tokenizer: Tokenizer) -> AsyncIterator[AsyncTestClient[Any]]:
    serving = ModelHandle(engine, tokenizer, make_options(max_batch_size=8, max_queued_requests=8))
    async with AsyncTestClient(app=make_app(serving)) as client:
        yield client


def _sse(body: str) -> list[Any]:
    out = []
    for block in body.replace("\r\n", "\n").split("\n\n"):
        if block.strip():
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def _greedy_choices(engine: Any, tokenizer: Tokenizer, max_tokens: int, n: int) -> dict[str, Any]:
    """The body of one greedy ``/v1/completions`` of PROMPT with ``n`` choices on ``engine``."""
    async for c in _client(engine, tokenizer):
        r = await c.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "n": n},
        )
        assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def test_n_choices_prefill_the_prompt_once(tokenizer: Tokenizer) -> None:
    engine = KVTableEngine(max_slots=4)
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    body = await _greedy_choices(engine, tokenizer, 5, 3)
    expected = tokenizer.decode(engine.greedy(ids, 5))
    assert [(ch["index"], ch["text"]) for ch in body["choices"]] == [(i, expected) for i in range(3)]
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": 15,
        "total_tokens": len(ids) + 15,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # The prompt ran once; the two other choices got its KV and prefilled only its last token.
    assert engine.prefill_chunks == [len(ids), 1, 1]
    assert [n for _, _, n in engine.copies] == [len(ids) - 1] * 2
    assert len({dst for _, dst, _ in engine.copies}) == 2


async def test_n_without_kv_operations_prefills_each_choice(tokenizer: Tokenizer) -> None:
    engine = TableEngine(max_slots=4)
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    body = await _greedy_choices(engine, tokenizer, 3, 2)
    assert engine.prefill_chunks == [len(ids), len(ids)]
    assert [ch["index"] for ch in body["choices"]] == [0, 1]


async def test_choice_i_is_seeded_with_seed_plus_i(tokenizer: Tokenizer) -> None:
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}
    async for c in _client(KVTableEngine(max_slots=4), tokenizer):
        r = await c.post("/v1/completions", json={**base, "n": 3, "seed": 41})
        assert r.status_code == 200, r.text
        texts = [ch["text"] for ch in r.json()["choices"]]
        singles = []
        for seed in (41, 42, 43):
            one = await c.post("/v1/completions", json={**base, "seed": seed})
            singles.append(one.json()["choices"][0]["text"])
        again = await c.post("/v1/completions", json={**base, "n": 3, "seed": 41})
    assert texts == singles
    assert len(set(texts)) == 3  # the seeds differ, so do the samples
    assert [ch["text"] for ch in again.json()["choices"]] == texts


async def test_n_streamed_chat_indexes_every_choice(tokenizer: Tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    base = {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0}
    async for c in _client(KVTableEngine(max_slots=4), tokenizer):
        r = await c.post(
            "/v1/chat/completions",
            json={**base, "n": 2, "stream": True, "stream_options": {"include_usage": True}},
        )
        assert r.status_code == 200, r.text
        events = _sse(r.text)
        full = await c.post("/v1/chat/completions", json=base)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    roles = [ch["choices"][0]["index"] for ch in chunks if ch["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    texts = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    for ch in chunks:
        choice = ch["choices"][0]
        texts[choice["index"]] += choice["delta"].get("content") or ""
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    expected = full.json()["choices"][0]["message"]["content"]
    assert texts == {0: expected, 1: expected}
    assert finishes == {0: "length", 1: "length"}
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 8 == 2 * full.json()["usage"]["completion_tokens"]


async def test_n_over_the_limit_names_it(tokenizer: Tokenizer) -> None:
    async for c in _client(TableEngine(), tokenizer):
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "x", "n": 9})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "n" and "between 1 and 8" in err["message"]


async def test_echo_prepends_the_prompt(tokenizer: Tokenizer) -> None:
    engine = TableEngine()
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True}
    async for c in _client(engine, tokenizer):
        plain = (await c.post("/v1/completions", json=body)).json()
        with_lps = (await c.post("/v1/completions", json={**body, "logprobs": 1})).json()
        streamed = _sse((await c.post("/v1/completions", json={**body, "stream": True})).text)
    generated = tokenizer.decode(engine.greedy(ids, 3))
    assert plain["choices"][0]["text"] == PROMPT + generated
    lps = with_lps["choices"][0]["logprobs"]
    assert with_lps["choices"][0]["text"] == PROMPT + generated
    assert lps["tokens"][: len(ids)] == [tokenizer.token_text(t) for t in ids]
    assert lps["token_logprobs"][: len(ids)] == [None] * len(ids)
    assert all(isinstance(x, float) for x in lps["token_logprobs"][len(ids) :])
    assert len(lps["tokens"]) == len(ids) + 3
    assert lps["text_offset"] == sorted(lps["text_offset"])
    assert streamed[0]["choices"][0]["text"] == PROMPT
    assert "".join(e["choices"][0]["text"] for e in streamed[:-1]) == PROMPT + generated


async def test_suffix_is_refused(tokenizer: Tokenizer) -> None:
    async for c in _client(TableEngine(), tokenizer):
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "def f(", "suffix": "return x"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "suffix" and "does not do insertion" in err["message"]


@pytest.mark.parametrize("reuse", [False, True])
async def test_n_choices_with_context_reuse_and_fewer_slots(tokenizer: Tokenizer, reuse: bool) -> None:
    # Two slots for four choices: the last two wait for a slot and prefill on their own (the
    # first choice is gone by then); every choice still decodes the same greedy tokens, with
    # the context cache's records in play or not.
    engine = KVTableEngine(max_slots=2, capacity=512)
    store = PrefixStore("test", max_records=64) if reuse else None
    options = make_options(max_batch_size=2, max_queued_requests=8)
    serving = ModelHandle(engine, tokenizer, options, context_cache=store)
    prompt = " ".join(f"word{i}" for i in range(40))
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    assert 64 < len(ids) < 128
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "n": 4}
    async with AsyncTestClient(app=make_app(serving)) as c:
        first = (await c.post("/v1/completions", json=body)).json()
        again = (await c.post("/v1/completions", json=body)).json()
    expected = tokenizer.decode(engine.greedy(ids, 4))
    assert [ch["text"] for ch in first["choices"]] == [expected] * 4
    assert [ch["text"] for ch in again["choices"]] == [expected] * 4
    assert engine.copies and all(n == len(ids) - 1 for _, _, n in engine.copies)


class _FailingCopies(KVTableEngine):
    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        self.tokens[dst] = [0] * n  # half done, then fails: the slot's content is garbage
        self.lengths[dst] = n
        raise RuntimeError("copy failed")


async def test_a_failed_copy_falls_back_to_a_full_prefill(tokenizer: Tokenizer) -> None:
    engine = _FailingCopies(max_slots=4)
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    async for c in _client(engine, tokenizer):
        r = await c.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "n": 2},
        )
        assert r.status_code == 200, r.text
    expected = tokenizer.decode(engine.greedy(ids, 4))
    assert [ch["text"] for ch in r.json()["choices"]] == [expected, expected]
    assert engine.prefill_chunks == [len(ids), len(ids)]


async def test_a_prompt_list_is_one_batch_indexed_prompt_major(tokenizer: Tokenizer) -> None:
    prompts = [PROMPT, "The cat sat", "A long way from home"]
    engine = KVTableEngine(max_slots=8)
    async for c in _client(engine, tokenizer):
        r = await c.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": prompts, "max_tokens": 12, "temperature": 0, "n": 2},
        )
        assert r.status_code == 200, r.text
        body = r.json()
    ids = [tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    want = [tokenizer.decode(engine.greedy(i, 12)) for i in ids]
    assert [(ch["index"], ch["text"]) for ch in body["choices"]] == [
        (p * 2 + j, want[p]) for p in range(3) for j in range(2)
    ]
    assert body["usage"] == {
        "prompt_tokens": sum(map(len, ids)),
        "completion_tokens": 72,
        "total_tokens": sum(map(len, ids)) + 72,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    # Submitted together: once prefilled (one chunk per step), the six sequences decode in one
    # batch; run one prompt after another, at most two (one prompt's choices) would.
    assert max(engine.decode_batches) == 6
    # Each prompt is prefilled once; its second choice gets the KV (one token of its own).
    assert sorted(engine.prefill_chunks) == sorted([*map(len, ids), 1, 1, 1])


async def test_the_prompt_list_token_budget_is_a_400_before_anything_runs(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("inference.openai.completions.MAX_PROMPT_LIST_TOKENS", 10)
    engine = KVTableEngine(max_slots=8)
    async for c in _client(engine, tokenizer):
        body = {"model": MODEL, "prompt": [[5] * 6, [7] * 5], "max_tokens": 2}
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "prompt" and "11 tokens" in error["message"] and "10" in error["message"]
        ok = await c.post("/v1/completions", json={**body, "prompt": [[5] * 5, [7] * 5]})
        assert ok.status_code == 200, ok.text
    assert sorted(engine.prefill_chunks) == [5, 5]  # the refused request prefilled nothing
