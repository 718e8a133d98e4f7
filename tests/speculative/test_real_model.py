"""Speculative decoding on the real model (SmolLM2-135M-Instruct from its GGUF, fp32 bundle):
greedy output is token for token the ordinary output with either proposer, and the model as its
own draft has (almost) every guess kept."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from inference.runtime import Engine, load_engine
from inference.serving.speculative import SpeculativeStatsSnapshot, proposer_factory
from inference.serving.tokenizer import load_tokenizer
from tests.support.scheduling import SchedulerRunner

STEPS = 24
QUESTIONS = [
    "What is the capital of France?",
    "Repeat the following list exactly: apple, banana, cherry, grape, lemon, mango.",
    "Write a haiku about autumn.",
    "Name three primary colors.",
    "Copy this sentence: The quick brown fox jumps over the lazy dog.",
    "What is 12 plus 7?",
    "List the days of the week.",
    "Translate 'good morning' into French.",
    "Spell the word 'necessary' letter by letter.",
    "Repeat after me: one two three four five six seven eight.",
]


@pytest.fixture(scope="module")
def bundle(smollm2_bundle: Callable[[str], Path]) -> Path:
    return smollm2_bundle("fp32")


@pytest.fixture(scope="module")
def engines(bundle: Path) -> Iterator[tuple[Engine, Engine]]:
    target = load_engine(bundle, max_slots=2, threads=2)
    draft = load_engine(bundle, max_slots=2, threads=2)  # the model as its own draft
    yield target, draft
    target.close()
    draft.close()


@pytest.fixture(scope="module")
def prompts(bundle: Path) -> list[list[int]]:
    tok = load_tokenizer(bundle)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
            for q in QUESTIONS]


def _run(engine: Engine, prompts: list[list[int]], factory: object = None
         ) -> tuple[list[list[int]], SpeculativeStatsSnapshot | None]:
    with SchedulerRunner(engine, batch=2, proposer=factory, eos_ids=engine.info.eos_token_ids) as r:  # type: ignore[arg-type]
        out = r.run(prompts, STEPS)
        stats = r.sched.speculative_stats
        return out, None if stats is None else stats.snapshot()


@pytest.fixture(scope="module")
def plain(engines: tuple[Engine, Engine], prompts: list[list[int]]) -> list[list[int]]:
    return _run(engines[0], prompts)[0]


def test_ngram_greedy_output_is_unchanged(
    engines: tuple[Engine, Engine], prompts: list[list[int]], plain: list[list[int]]
) -> None:
    factory = proposer_factory({"method": "ngram", "prompt_lookup_min": 2, "prompt_lookup_max": 4},
                               num_speculative_tokens=4)
    got, stats = _run(engines[0], prompts, factory)
    assert got == plain
    assert stats is not None and stats.steps > 0 and stats.accepted > 0


def test_the_model_as_its_own_draft_keeps_every_guess(
    engines: tuple[Engine, Engine], prompts: list[list[int]], plain: list[list[int]]
) -> None:
    target, draft = engines
    factory = proposer_factory({"method": "draft_model"}, num_speculative_tokens=4, draft_engine=draft)
    got, stats = _run(target, prompts, factory)
    assert got == plain
    assert stats is not None and stats.proposed > 0
    # Not exactly 1: one run of 5 positions and five single steps may round a near-tie apart.
    assert stats.acceptance_rate >= 0.97, stats
    assert stats.tokens_per_step > 3.5, stats
