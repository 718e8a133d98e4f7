"""Incremental detokenization and stop strings, through the real demo tokenizer."""

from __future__ import annotations

import pytest

from inference.serving.generation import GenerationState, IncrementalDetokenizer, StopStringMatcher
from inference.serving.sampling import SampleResult
from inference.serving.tokenizer import Tokenizer

TEXT = "héllo 世界 naïve café 🙂 done"


def test_multibyte_split_across_tokens_never_emits_replacement_char(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(TEXT)
    # The byte-level tokenizer really splits some characters over several tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt:"))
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT


def test_hidden_special_tokens_are_not_emitted(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    im_end = tokenizer.token_to_id("<|im_end|>")
    assert im_end is not None
    out = "".join(detok.push(i) for i in [*tokenizer.encode("ok"), im_end]) + detok.flush()
    assert out == "ok"


@pytest.mark.parametrize(
    ("chunks", "stops", "expected", "stopped"),
    [
        (["Hello ", "wor", "ld! END", " more"], ["END"], "Hello world! ", True),
        (["ab", "c<", "/s", "> tail"], ["</s>"], "abc", True),
        (["x <", "y"], ["<stop>"], "x <y", False),
        (["one two", " three"], ["two", "one"], "", True),
    ],
)
def test_stop_strings_split_and_excluded(
    chunks: list[str], stops: list[str], expected: str, stopped: bool
) -> None:
    m = StopStringMatcher(stops)
    out, hit = "", False
    for c in chunks:
        text, hit = m.feed(c)
        out += text
        if hit:
            break
    if not hit:
        out += m.flush()
    assert (out, hit) == (expected, stopped)


def _run(tokenizer: Tokenizer, text: str, **kw: object) -> tuple[str, str | None, int]:
    ids = tokenizer.encode(text)
    state = GenerationState(tokenizer, prompt_ids=[5], **kw)  # type: ignore[arg-type]
    out = ""
    for i in ids:
        step = state.push(SampleResult(i))
        out += step.text
        if step.finished:
            break
    return out, state.finish_reason, state.completion_tokens


def test_generation_stops_at_stop_string_split_across_tokens(tokenizer: Tokenizer) -> None:
    text = "alpha beta gamma delta"
    ids = tokenizer.encode(text)
    # "ta ga" straddles token boundaries in this vocabulary
    assert not any(tokenizer.decode([i]) == "ta ga" for i in ids)
    out, reason, _ = _run(tokenizer, text, max_new_tokens=100, stop=["ta ga"])
    assert (out, reason) == ("alpha be", "stop")


def test_generation_length_and_eos(tokenizer: Tokenizer) -> None:
    out, reason, n = _run(tokenizer, "alpha beta gamma delta", max_new_tokens=2)
    assert reason == "length" and n == 2
    assert out == tokenizer.decode(tokenizer.encode("alpha beta gamma delta")[:2])
    state = GenerationState(tokenizer, prompt_ids=[5], max_new_tokens=10, eos_token_ids=[2])
    assert state.push(SampleResult(tokenizer.encode("hi")[0])).finish_reason is None
    last = state.push(SampleResult(2))
    assert (last.finish_reason, last.text, last.completion_tokens) == ("stop", "", 2)


def test_held_stop_prefix_is_released_at_length(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("abc EN")
    state = GenerationState(tokenizer, prompt_ids=[5], max_new_tokens=len(ids), stop=["END"])
    out = "".join(state.push(SampleResult(i)).text for i in ids)
    assert out == "abc EN" and state.finish_reason == "length"
