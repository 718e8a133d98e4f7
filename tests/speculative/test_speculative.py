"""Speculative decoding on fake engines: n-gram lookup, the verification rule (greedy output
unchanged; sampling keeps the target distribution, checked by a chi-square test that a wrong
residual step fails), the scheduler's speculative path and the proposer factory."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest

import inference.serving.speculative as spec
from inference.serving.sampling import Sampler, SamplingParams
from inference.serving.speculative import (
    DraftModelProposer,
    NgramProposer,
    Proposer,
    ngram_lookup,
    proposer_factory,
    verify,
)
from tests.support.engines import TableEngine, TokenScriptEngine
from tests.support.scheduling import SchedulerRunner


@pytest.mark.parametrize(
    ("tokens", "k", "n_min", "n_max", "want"),
    [
        ([1, 2, 3, 4, 1, 2], 2, 1, 3, [3, 4]),  # "1 2" found at 0: what followed it
        ([1, 2, 3, 4, 1, 2], 5, 1, 3, [3, 4, 1, 2]),  # at most up to the end of the sequence
        ([9, 2, 7, 1, 2, 5, 1, 2], 3, 1, 2, [5, 1, 2]),  # longest n wins: "1 2" before "2"
        ([9, 2, 7, 1, 2, 5, 3, 2], 2, 1, 2, [7, 1]),  # n=2 misses; n=1: first "2" at 1
        ([1, 2, 3, 4, 5], 2, 1, 3, []),  # nothing repeats
        ([1, 2, 3, 1, 2], 2, 3, 3, []),  # below prompt_lookup_min
        ([7], 2, 1, 1, []),
        ([7, 7, 7, 7], 3, 1, 2, [7, 7]),
    ],
)
def test_ngram_lookup(tokens: list[int], k: int, n_min: int, n_max: int, want: list[int]) -> None:
    assert ngram_lookup(tokens, k, n_min, n_max) == want


# --- the distribution test -------------------------------------------------------------------------

VOCAB = 10  # TableEngine holds ids 0..2 at -30: seven live tokens
PARAMS = SamplingParams(temperature=1.3, top_k=5, top_p=0.9, seed=0)
HISTORY = [7, 3, 4, 9]
PENDING = 7  # sampled, not yet in the KV: the scheduler's state between steps
TRIALS = 20_000


def _two_tokens(
    engine: TableEngine, proposer: Proposer, sampler: Sampler, stats: Counter[str]
) -> tuple[int, int]:
    """Emit two tokens after HISTORY + [PENDING] the way the scheduler does."""
    engine.truncate(0, len(HISTORY))
    tokens, pending, out = list(HISTORY), PENDING, list[int]()
    while len(out) < 2:
        proposal = proposer.propose(0, [*tokens, pending], sampler, 2)
        if proposal.tokens:
            rows = engine.extend(0, [pending, *proposal.tokens])
            results = verify(sampler, rows, proposal)
            engine.truncate(0, len(tokens) + len(results))
            stats["proposed"] += len(proposal.tokens)
            stats["accepted"] += len(results) - 1
        else:
            results = [sampler.sample(engine.extend(0, [pending])[0])]
        tokens += [pending, *(r.token_id for r in results[:-1])]
        pending = results[-1].token_id
        out += [r.token_id for r in results]
    return out[0], out[1]


def _chi_square(engine: TableEngine, proposer: Proposer) -> tuple[float, float, float]:
    """(statistic, 0.999 quantile of its chi-square law, acceptance rate) over TRIALS pairs."""
    sampler = Sampler(PARAMS, VOCAB)
    engine.reset(0)
    engine.prefill(0, HISTORY)
    stats: Counter[str] = Counter()
    seen = Counter(_two_tokens(engine, proposer, sampler, stats) for _ in range(TRIALS))
    exact = Sampler(PARAMS, VOCAB)
    first = exact.distribution(engine.table[PENDING])
    expected = {(a, b): first[a] * exact.distribution(engine.table[a])[b]
                for a in range(VOCAB) for b in range(VOCAB)}
    assert all(expected[cell] > 0 for cell in seen), "a token outside the target's support"
    cells = [c for c, e in expected.items() if e > 0]
    stat = sum((seen[c] - TRIALS * expected[c]) ** 2 / (TRIALS * expected[c]) for c in cells)
    df = len(cells) - 1
    z = 3.09  # Wilson-Hilferty: the 0.999 quantile of chi-square(df)
    quantile = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, quantile, stats["accepted"] / max(1, stats["proposed"])


def _proposers(engine: TableEngine) -> dict[str, Proposer]:
    return {
        # HISTORY + [7] ends in 7, found at 0: the guesses are 3, 4 (one-hot q).
        "ngram": NgramProposer(2, 1, 1),
        # Another table: a draft that disagrees with the target often (a real q).
        "draft_model": DraftModelProposer(TableEngine(VOCAB, max_slots=1, seed=99), 2),
    }


@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_rejection_sampling_keeps_the_target_distribution(kind: str) -> None:
    engine = TableEngine(VOCAB, max_slots=1)
    stat, quantile, rate = _chi_square(engine, _proposers(engine)[kind])
    assert 0.05 < rate < 0.95, f"both branches must be exercised, acceptance {rate:.2f}"
    assert stat < quantile, f"chi-square {stat:.1f} >= {quantile:.1f}: not the target distribution"


@pytest.mark.parametrize("kind", ["ngram", "draft_model"])
def test_a_wrong_residual_step_is_caught(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above has teeth: redrawing from p itself after a refusal skews the output."""
    monkeypatch.setattr(spec, "_residual", lambda p, q, guess: p)
    engine = TableEngine(VOCAB, max_slots=1)
    stat, quantile, _ = _chi_square(engine, _proposers(engine)[kind])
    assert stat > quantile


def test_distribution_is_what_sample_draws_from() -> None:
    logits = TableEngine(VOCAB, max_slots=1).table[PENDING]
    sampler = Sampler(PARAMS, VOCAB)
    probs = sampler.distribution(logits)
    assert probs.sum() == pytest.approx(1.0) and (probs > 0).sum() <= PARAMS.top_k
    seen = Counter(sampler.sample(logits).token_id for _ in range(TRIALS))
    assert max(abs(seen[i] / TRIALS - probs[i]) for i in range(VOCAB)) < 0.015
    greedy = Sampler(SamplingParams(temperature=0.0), VOCAB).distribution(logits)
    assert greedy[int(np.argmax(logits))] == 1.0 and greedy.sum() == 1.0


# --- the scheduler ---------------------------------------------------------------------------------


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [[int(t) for t in rng.integers(3, 256, size=n)] for n in (1, 5, 17, 40, 3)]


Stats = spec.SpeculativeStatsSnapshot


def _run(engine: TableEngine, prompts: Sequence[Sequence[int]], steps: int, batch: int,
         factory: spec.ProposerFactory | None) -> tuple[list[list[int]], Stats | None]:
    with SchedulerRunner(engine, batch=batch, proposer=factory) as runner:
        out = runner.run(prompts, steps)
        stats = runner.sched.speculative_stats
        return out, None if stats is None else stats.snapshot()


@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_output_is_unchanged_by_speculation(batch: int) -> None:
    prompts, steps = _prompts(), 40
    # A 256-token table: greedy chains fall into cycles quickly, so n-gram lookup finds matches.
    plain, none = _run(TableEngine(256, max_slots=3), prompts, steps, batch, None)
    assert none is None
    assert plain == [TableEngine(256, max_slots=3).greedy(p, steps) for p in prompts]
    ngram, stats = _run(TableEngine(256, max_slots=3), prompts, steps, batch,
                        proposer_factory({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                                         num_speculative_tokens=3))
    assert ngram == plain
    assert stats is not None and stats.steps > 0 and stats.accepted > 0
    assert stats.tokens_per_step > 1
    # The same table as its own draft: every guess is kept.
    draft = TableEngine(256, max_slots=3)
    factory = proposer_factory({"method": "draft_model"}, num_speculative_tokens=4, draft_engine=draft)
    same, stats = _run(TableEngine(256, max_slots=3), prompts, steps, batch, factory)
    assert same == plain
    assert stats is not None and stats.proposed > 0 and stats.accepted == stats.proposed
    assert stats.emitted == stats.accepted + stats.steps


def test_a_wrong_draft_changes_nothing_but_the_acceptance() -> None:
    prompts, steps = _prompts(), 30
    plain, _ = _run(TableEngine(256, max_slots=3), prompts, steps, 2, None)
    factory = proposer_factory({"method": "draft_model"}, num_speculative_tokens=3,
                               draft_engine=TableEngine(256, max_slots=3, seed=7))
    got, stats = _run(TableEngine(256, max_slots=3), prompts, steps, 2, factory)
    assert got == plain
    assert stats is not None and stats.accepted < stats.proposed


def test_sampling_through_the_scheduler_is_reproducible_by_seed() -> None:
    factory = proposer_factory({"method": "draft_model"}, num_speculative_tokens=3,
                               draft_engine=TableEngine(256, max_slots=2, seed=7))
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    runs = []
    for _ in range(2):
        with SchedulerRunner(TableEngine(256, max_slots=2), batch=2, proposer=factory) as runner:
            runs.append(runner.run(_prompts()[:2], 25, params))
    assert runs[0] == runs[1] and all(len(t) == 25 for t in runs[0])


def test_speculation_stops_at_eos_max_tokens_and_capacity() -> None:
    # The script repeats "10 11 12": ngram guesses well; the output must stop exactly.
    script = [10, 11, 12] * 6
    engine = TokenScriptEngine(script, vocab_size=64, capacity=30, max_slots=1)
    factory = proposer_factory({"method": "ngram", "prompt_lookup_min": 1}, num_speculative_tokens=4)
    long_prompt = list(range(3, 20))
    with SchedulerRunner(engine, eos_ids=(2,)) as plain:
        want = plain.run([long_prompt], 100)[0]
    assert 5 < len(want) < len(script)  # cut by the KV capacity, not by the script
    with SchedulerRunner(engine, proposer=factory, eos_ids=(2,)) as runner:
        assert runner.run([[5, 6]], 7) == [script[:7]]  # max_tokens inside a verified run
        assert runner.run([[5, 6]], 100) == [[*script, 2]]  # EOS
        assert runner.run([long_prompt], 100) == [want]  # KV capacity 30
        assert engine.extend_calls


def test_requests_can_opt_out_and_engines_without_extend_decode_normally() -> None:
    engine = TableEngine(256, max_slots=1)
    factory = proposer_factory({"method": "ngram", "prompt_lookup_min": 1}, num_speculative_tokens=3)
    with SchedulerRunner(engine, proposer=factory) as runner:
        want = engine.greedy(_prompts()[0], 30)
        assert runner.run([_prompts()[0]], 30, speculative=False) == [want]
        assert engine.extend_calls == []
        assert runner.sched.speculative_stats is not None
        assert runner.sched.speculative_stats.snapshot().steps == 0


def test_proposer_factory_reads_the_record() -> None:
    target = TableEngine(64, max_slots=2)
    ngram = proposer_factory({"method": "ngram"})(target)
    assert isinstance(ngram, NgramProposer)
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    assert ngram.num_speculative_tokens == spec.DEFAULT_NUM_SPECULATIVE_TOKENS
    one = proposer_factory({"method": "ngram", "prompt_lookup_max": 3, "num_speculative_tokens": 2})(target)
    assert isinstance(one, NgramProposer)
    assert (one.prompt_lookup_min, one.prompt_lookup_max, one.num_speculative_tokens) == (3, 3, 2)
    over = proposer_factory({"method": "ngram", "num_speculative_tokens": 2}, num_speculative_tokens=6)
    assert over(target).num_speculative_tokens == 6
    with pytest.raises(ValueError, match="draft bundle"):
        proposer_factory({"method": "draft_model"})
    with pytest.raises(ValueError, match="slots"):
        proposer_factory({"method": "draft_model"}, draft_engine=TableEngine(64, max_slots=1))(target)
    with pytest.raises(ValueError, match="eagle3"):
        proposer_factory({"method": "eagle3"})
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        proposer_factory({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2})


def test_counters_reach_prometheus() -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from cachesvc.http.metrics import ServingMetrics

    registry = CollectorRegistry()
    factory = proposer_factory({"method": "ngram", "prompt_lookup_min": 1}, num_speculative_tokens=3)
    engine = TableEngine(256, max_slots=1)
    with SchedulerRunner(engine, proposer=factory, observer=ServingMetrics(registry).for_model("m")) as r:
        r.run(_prompts()[:2], 30)
        assert r.sched.speculative_stats is not None
        stats = r.sched.speculative_stats.snapshot()
    text = generate_latest(registry).decode()
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
              if s.name.startswith("cachesvc_spec_decode_") and s.name.endswith("_total")}
    assert values == {
        "cachesvc_spec_decode_drafts_total": stats.steps,
        "cachesvc_spec_decode_draft_tokens_total": stats.proposed,
        "cachesvc_spec_decode_accepted_tokens_total": stats.accepted,
        "cachesvc_spec_decode_emitted_tokens_total": stats.emitted,
    }
    assert stats.steps > 0


def test_a_failing_draft_falls_back_to_normal_decode() -> None:
    class Flaky(TableEngine):
        calls = 0

        def decode(self, slots: Sequence[int], token_ids: Sequence[int]) -> np.ndarray:
            Flaky.calls += 1
            if Flaky.calls % 3 == 0:
                raise RuntimeError("draft broke")
            return super().decode(slots, token_ids)

    prompts = _prompts()
    plain, _ = _run(TableEngine(256, max_slots=3), prompts, 30, 2, None)
    factory = proposer_factory({"method": "draft_model"}, num_speculative_tokens=3,
                               draft_engine=Flaky(256, max_slots=3))
    got, stats = _run(TableEngine(256, max_slots=3), prompts, 30, 2, factory)
    assert got == plain
    assert stats is not None and stats.steps > 0 and Flaky.calls > 3
