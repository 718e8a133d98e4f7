"""Sampling: greedy, seeded determinism, top-k/top-p masks, penalties, logit_bias, logprobs."""

from __future__ import annotations

import numpy as np
import pytest

from inference.serving.sampling import (
    Sampler,
    SamplingParams,
    apply_logit_bias,
    apply_penalties,
    apply_repetition_penalty,
    log_softmax,
    top_k_mask,
    top_p_mask,
)


def _logits(seed: int = 0, n: int = 50) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


def test_greedy_takes_argmax() -> None:
    x = _logits()
    s = Sampler(SamplingParams(temperature=0.0), x.shape[0])
    assert s.sample(x).token_id == int(np.argmax(x))


def test_same_seed_same_tokens_and_other_seed_differs() -> None:
    x = _logits(n=200) * 0.1  # flat: sampling really varies

    def run(seed: int) -> list[int]:
        s = Sampler(SamplingParams(temperature=1.0, seed=seed), x.shape[0])
        return [s.sample(x).token_id for _ in range(30)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_top_k_keeps_k_largest() -> None:
    x = np.array([1.0, 5.0, 3.0, 4.0, 2.0])
    masked = top_k_mask(x, 2)
    assert np.isfinite(masked).tolist() == [False, True, False, True, False]
    assert top_k_mask(x, 0) is x


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    x = np.log(probs)
    assert np.isfinite(top_p_mask(x, 0.7)).tolist() == [True, True, False, False]
    assert np.isfinite(top_p_mask(x, 0.5)).tolist() == [True, False, False, False]
    assert np.isfinite(top_p_mask(x, 0.81)).tolist() == [True, True, True, False]


def test_sampling_respects_masks() -> None:
    x = _logits(3, 100)
    allowed = set(np.argsort(-x)[:3].tolist())
    s = Sampler(SamplingParams(temperature=1.5, top_k=3, seed=1), 100)
    assert {s.sample(x).token_id for _ in range(200)} <= allowed


def test_penalties_follow_openai_formula() -> None:
    x = np.zeros(4)
    counts = np.array([0.0, 1.0, 3.0, 0.0])
    out = apply_penalties(x, counts, frequency_penalty=0.5, presence_penalty=1.0)
    assert out.tolist() == [0.0, -1.5, -2.5, 0.0]


def test_frequency_penalty_stops_repeats_under_greedy() -> None:
    x = np.array([3.0, 2.9, 0.0])
    plain = Sampler(SamplingParams(temperature=0.0), 3)
    assert [plain.sample(x).token_id for _ in range(3)] == [0, 0, 0]
    pen = Sampler(SamplingParams(temperature=0.0, frequency_penalty=1.0), 3)
    assert [pen.sample(x).token_id for _ in range(3)] == [0, 1, 0]


def test_logit_bias_forces_and_bans_tokens() -> None:
    x = _logits(5, 30)
    out = apply_logit_bias(x, {7: 100.0})
    assert int(np.argmax(out)) == 7
    banned = int(np.argmax(x))
    s = Sampler(SamplingParams(temperature=0.0, logit_bias={banned: -100.0}), 30)
    assert s.sample(x).token_id != banned


def test_logprobs_are_the_model_distribution() -> None:
    x = _logits(9, 40)
    s = Sampler(SamplingParams(temperature=0.0, top_logprobs=3), 40)
    r = s.sample(x)
    lp = log_softmax(x)
    assert r.logprob == pytest.approx(float(lp[r.token_id]))
    assert [t for t, _ in r.top] == np.argsort(-lp)[:3].tolist()
    assert np.exp(lp).sum() == pytest.approx(1.0)


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_fast_path_matches_full_sort(p: float) -> None:
    x = np.random.default_rng(4).standard_normal(20000) * 2.0
    probs = np.exp(log_softmax(x))
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order])
    expected = set(order[(cum - probs[order]) < p].tolist()) | {int(order[0])}
    assert set(np.flatnonzero(np.isfinite(top_p_mask(x, p))).tolist()) == expected


def test_padding_ids_beyond_the_tokenizer_are_never_sampled() -> None:
    x = np.zeros(2000)
    x[1500] = 50.0  # an undecodable padding row that would win
    s = Sampler(SamplingParams(temperature=1.0, seed=0, top_logprobs=3), 1000)
    assert all(s.sample(x).token_id < 1000 for _ in range(50))
    g = Sampler(SamplingParams(temperature=0.0), 1000)
    assert g.sample(x).token_id < 1000


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = np.array([2.0, -1.0, 3.0, 0.5], dtype=np.float32)
    seen = np.array([True, True, False, False])
    out = apply_repetition_penalty(logits, seen, 2.0)
    assert out.tolist() == [1.0, -2.0, 3.0, 0.5]
    assert apply_repetition_penalty(logits, seen, 1.0) is logits


def test_repetition_penalty_counts_the_prompt_and_the_output() -> None:
    # Token 0 leads; the prompt holds it, so a penalty of 4 hands the lead to token 1, and once
    # token 1 is generated it is penalised too and token 2 leads.
    logits = np.array([4.0, 3.0, 2.0, -5.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0, repetition_penalty=4.0), 4, prompt_ids=[0, 99])
    assert [sampler.sample(logits).token_id for _ in range(2)] == [1, 2]
    plain = Sampler(SamplingParams(temperature=0.0), 4, prompt_ids=[0])
    assert plain.sample(logits).token_id == 0


def test_min_p_drops_tokens_below_a_share_of_the_top_probability() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    dist = Sampler(SamplingParams(temperature=1.0, min_p=0.5), 4).distribution(logits)
    assert dist[2] == 0.0 and dist[3] == 0.0
    assert dist[0] == pytest.approx(0.5 / 0.8) and dist[1] == pytest.approx(0.3 / 0.8)
    only_top = Sampler(SamplingParams(temperature=1.0, min_p=1.0, seed=3), 4)
    assert {only_top.sample(logits).token_id for _ in range(30)} == {0}
