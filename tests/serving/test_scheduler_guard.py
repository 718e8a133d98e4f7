"""A request whose sampler raises (a grammar's matcher, say) fails alone: the scheduler thread,
its slots and every other request go on."""

from __future__ import annotations

import numpy as np
import pytest

from inference.serving.generation import GenerationState
from inference.serving.sampling import Sampler, SampleResult, SamplingParams
from inference.serving.scheduler import EngineFailure, GenerationRequest
from tests.support.engines import TableEngine
from tests.support.scheduling import CollectingSink, IdTokens, SchedulerRunner


class BrokenSampler(Sampler):
    """Raises on its ``after``-th draw."""

    def __init__(self, vocab: int, after: int) -> None:
        super().__init__(SamplingParams(temperature=0.0), vocab)
        self.calls, self.after = 0, after

    def sample(self, logits: np.ndarray) -> SampleResult:
        self.calls += 1
        if self.calls >= self.after:
            raise RuntimeError("matcher in an impossible state")
        return super().sample(logits)


@pytest.mark.parametrize("after", [1, 3])  # 1: at the first token (prefill), 3: while decoding
def test_a_raising_sampler_fails_only_its_request(after: int) -> None:
    engine = TableEngine(64, max_slots=2)
    with SchedulerRunner(engine, batch=2) as runner:
        good = runner.submit([1, 2, 3], 8)
        bad = CollectingSink()
        state = GenerationState(IdTokens(), prompt_ids=[4, 5], max_new_tokens=8)  # type: ignore[arg-type]
        runner.sched.submit(GenerationRequest([4, 5], BrokenSampler(64, after), state, bad))
        with pytest.raises(EngineFailure, match="sampling failed: matcher in an impossible state"):
            bad.tokens(timeout=30)
        assert good.tokens(timeout=30) == engine.greedy([1, 2, 3], 8)
        # The thread is alive and the broken request's slot is free again.
        again = [runner.submit([7, 8], 5), runner.submit([9], 5)]
        assert [s.tokens(timeout=30) for s in again] == [engine.greedy([7, 8], 5), engine.greedy([9], 5)]
