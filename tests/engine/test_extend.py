"""``extend`` (logits for every appended position) and ``truncate`` after it, on both CPU
engines: the rows are what token-by-token decoding gives, and a slot cut back to before a
rejected draft computes exactly what it would have without ever seeing it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from inference.runtime import VerifyingEngine, load_engine
from inference.runtime.protocol import Engine
from tests.support.reference_engine import load_portable_engine

PROMPT = [5, 17, 99, 3, 42, 7, 8, 9, 10, 11, 250, 31]
DRAFT = [12, 13, 14, 15, 16, 200, 201, 202, 203, 204]  # 10 > max_input_len 8: extend chunks too
LOADERS: dict[str, Callable[..., Engine]] = {"gqa": load_engine, "portable": load_portable_engine}


@pytest.fixture(scope="module")
def bundle(hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path]) -> Path:
    return built_bundle(hf_checkpoint("qwen2", "fp32", True), max_input_len=8, max_batch_size=2,
                        max_kv_cache_capacity=64)


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_extend_rows_are_the_decode_logits(bundle: Path, kind: str) -> None:
    engine = LOADERS[kind](bundle, max_slots=2, threads=1)
    assert isinstance(engine, VerifyingEngine)
    engine.prefill(0, PROMPT)
    rows = engine.extend(0, DRAFT)
    assert rows.shape == (len(DRAFT), engine.info.vocab_size) and rows.dtype == np.float32
    assert engine.slot_length(0) == len(PROMPT) + len(DRAFT)
    engine.prefill(1, PROMPT)
    stepped = np.stack([engine.decode([1], [t])[0] for t in DRAFT])
    np.testing.assert_allclose(rows, stepped, atol=1e-4, rtol=0)
    # The last row is what a prefill of the same tokens returns.
    engine.reset(1)
    engine.prefill(1, PROMPT)
    np.testing.assert_allclose(rows[-1], engine.prefill(1, DRAFT), atol=1e-4, rtol=0)
    engine.close()


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_truncate_after_a_rejected_draft_is_as_if_never_appended(bundle: Path, kind: str) -> None:
    engine = LOADERS[kind](bundle, max_slots=2, threads=1)
    assert isinstance(engine, VerifyingEngine)
    # Slot 0 never sees the draft; slot 1 appends it, keeps two tokens, then both go on alike.
    engine.prefill(0, PROMPT)
    clean = engine.extend(0, DRAFT[:2])
    engine.prefill(1, PROMPT)
    engine.extend(1, DRAFT[:6])
    engine.truncate(1, len(PROMPT) + 2)
    assert engine.slot_length(1) == len(PROMPT) + 2
    follow = [77, 78, 79]
    want = engine.extend(0, follow)
    got = engine.extend(1, follow)
    np.testing.assert_array_equal(got, want)
    assert clean.shape == (2, engine.info.vocab_size)
    # Decoding both together after the cut: the two rows hold the same sequence.
    both = engine.decode([0, 1], [5, 5])
    np.testing.assert_allclose(both[0], both[1], atol=1e-5, rtol=0)
    engine.close()


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_extend_refuses_what_it_cannot_do(bundle: Path, kind: str) -> None:
    engine = LOADERS[kind](bundle, max_slots=2, threads=1)
    assert isinstance(engine, VerifyingEngine)
    with pytest.raises(ValueError, match="empty"):
        engine.extend(0, [1, 2])
    engine.prefill(0, PROMPT)
    with pytest.raises(ValueError, match="at least one token"):
        engine.extend(0, [])
    with pytest.raises(ValueError, match="max_kv_capacity"):
        engine.extend(0, list(range(1, 64)))
    with pytest.raises(ValueError, match="truncate"):
        engine.truncate(0, len(PROMPT) + 1)
    engine.close()


def test_greedy_scheduler_output_is_unchanged_by_either_proposer(
    hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path]
) -> None:
    """Ten prompts on a tiny random checkpoint through the scheduler: the tokens are the
    ordinary greedy ones with ngram and with the model as its own draft (all guesses kept)."""
    from inference.serving.speculative import proposer_factory
    from tests.support.scheduling import SchedulerRunner

    bundle = built_bundle(hf_checkpoint("llama", "fp32", False), max_input_len=64, max_batch_size=2,
                          max_kv_cache_capacity=256)
    target = load_engine(bundle, max_slots=2, threads=1)
    draft = load_engine(bundle, max_slots=2, threads=1)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(0, 384, size=n)] for n in (1, 3, 7, 12, 20, 33, 48, 60, 90, 5)]
    with SchedulerRunner(target, batch=2) as r:
        plain = r.run(prompts, 20)
    factories = {
        "ngram": proposer_factory({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                                  num_speculative_tokens=3),
        "draft_model": proposer_factory({"method": "draft_model"}, num_speculative_tokens=4,
                                        draft_engine=draft),
    }
    for name, factory in factories.items():
        with SchedulerRunner(target, batch=2, proposer=factory) as r:
            assert r.run(prompts, 20) == plain, name
            assert r.sched.speculative_stats is not None
            stats = r.sched.speculative_stats.snapshot()
        # Random weights rarely repeat themselves: ngram's guesses are mostly refused, which
        # exercises the truncation path; the self-draft keeps everything.
        assert stats.steps > 0, name
        if name == "draft_model":
            assert stats.accepted == stats.proposed
