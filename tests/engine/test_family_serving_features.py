"""Every registered family through the scheduler's features (issue 31, item 4): context reuse
(records and a slot's kept prefix) and both speculative proposers (n-gram lookup, and the model as
its own draft) give exactly the plain greedy tokens, batched, on each family's own layer (sliding
windows, NoPE layers, soft-capping, mixture of experts ...). Structured output is a mask on the
logits, the same for every family; the served test runs one request of it per family."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from inference.families import family_names
from inference.runtime import load_engine
from inference.serving.context_cache import PrefixStore
from inference.serving.speculative import proposer_factory
from tests.support.scheduling import SchedulerRunner

STEPS = 10


def _rand(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 384, size=n)]


def _prompts() -> list[list[int]]:
    """Prompts sharing a prefix longer than a record block (64), one repeating itself (what the
    n-gram proposer feeds on), one short."""
    system = _rand(90, 1)
    loop = _rand(6, 2) * 5
    return [[*system, *_rand(12, 3)], [*system, *_rand(30, 4)], loop, _rand(7, 5), [*system, *_rand(12, 3)]]


@pytest.mark.parametrize("family", family_names())
def test_reuse_and_speculation_keep_the_greedy_tokens(
    family: str, hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path]
) -> None:
    bundle = built_bundle(hf_checkpoint(family), max_batch_size=2, max_kv_cache_capacity=256)
    prompts = _prompts()
    target = load_engine(bundle, threads=1)
    draft = load_engine(bundle, threads=1)
    try:
        with SchedulerRunner(target, batch=1) as plain:
            want = [plain.run([p], STEPS)[0] for p in prompts]
        store = PrefixStore("test", max_records=64)
        with SchedulerRunner(target, batch=2, context_cache=store) as warm:
            assert [warm.run([p], STEPS)[0] for p in prompts] == want, "context reuse, one at a time"
            assert warm.run(prompts, STEPS) == want, "context reuse, batched"
        assert store.stats().hits >= 3 and store.stats().tokens_reused >= 180
        # n-grams of one token too: every step proposes (random weights rarely repeat longer runs),
        # so verification rejects and rolls the KV back often: the path where bugs would show.
        ngram = proposer_factory({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                                 num_speculative_tokens=3)
        with SchedulerRunner(target, batch=2, proposer=ngram) as spec:
            assert spec.run(prompts, STEPS) == want, "n-gram speculation"
            stats = spec.sched.speculative_stats
            assert stats is not None and stats.snapshot().steps >= len(prompts)
        own = proposer_factory({"method": "draft_model"}, num_speculative_tokens=3, draft_engine=draft)
        with SchedulerRunner(target, batch=2, proposer=own) as spec:
            assert spec.run(prompts, STEPS) == want, "the model as its own draft"
            stats = spec.sched.speculative_stats
            assert stats is not None and stats.snapshot().acceptance_rate >= 0.9
    finally:
        target.close()
        draft.close()
