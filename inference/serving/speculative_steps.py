"""The scheduler's speculative step: a draft's guesses for a run's next tokens, verified in one
``extend`` of the target engine (:class:`inference.serving.scheduler.Scheduler` mixes this in)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from inference.runtime.protocol import Engine, VerifyingEngine
from inference.serving.context_cache import PrefixStore
from inference.serving.speculative import Proposal, Proposer, SpeculativeStats, verify

if TYPE_CHECKING:
    from inference.serving.generation import StepOutput
    from inference.serving.scheduler import EngineFailure, SchedulerObserver, _Running

log = logging.getLogger("inference.scheduler")


class SpeculativeSteps:
    """Speculative decoding for :class:`~inference.serving.scheduler.Scheduler` (its attributes,
    set there)."""

    _engine: Engine
    _proposer: Proposer | None
    _capacity: int
    _store: PrefixStore | None
    _slot_tokens: list[list[int]]
    _observer: SchedulerObserver | None
    speculative_stats: SpeculativeStats | None

    if TYPE_CHECKING:
        def _fail(self, run: _Running, exc: EngineFailure) -> None: ...

        def _emit(self, run: _Running, out: StepOutput) -> bool: ...

    def _release_proposal(self, slot: int) -> None:
        assert self._proposer is not None
        try:
            self._proposer.release(slot)
        except Exception:  # the draft is an optimisation: never fail a request for it
            log.exception("releasing the proposer's slot %d failed", slot)

    def _speculate(self, runs: list[_Running]) -> list[_Running]:
        """Verify guesses for the runs that get some; return the runs left to decode normally."""
        rest: list[_Running] = []
        for run in runs:
            proposal = self._propose(run)
            if proposal is None:
                rest.append(run)
            else:
                self._verify(run, proposal)
        return rest

    def _propose(self, run: _Running) -> Proposal | None:
        """Guesses for ``run``'s next tokens, or None to decode it normally."""
        assert self._proposer is not None
        req = run.req
        state = req.state
        if not req.speculative or run.last_token is None:
            return None
        held = len(req.prompt_ids) + state.completion_tokens  # positions after the pending token
        # Room in the KV for the guesses, and no more of them than tokens still wanted.
        k = min(self._proposer.num_speculative_tokens, self._capacity - held,
                state.max_new_tokens - state.completion_tokens - 1)
        if k < 1:
            return None
        try:
            proposal = self._proposer.propose(run.slot, [*req.prompt_ids, *run.output_ids], req.sampler, k)
        except Exception:  # a failing draft must not fail the request: decode it normally
            log.exception("speculative proposal failed")
            return None
        if not proposal.tokens:
            return None
        return Proposal(proposal.tokens[:k], None if proposal.probs is None else proposal.probs[:k])

    def _verify(self, run: _Running, proposal: Proposal) -> None:
        """One ``extend`` of the pending token and the guesses; keep what verification keeps."""
        engine = self._engine
        assert isinstance(engine, VerifyingEngine) and run.last_token is not None
        req = run.req
        try:
            before = engine.slot_length(run.slot)
            logits = engine.extend(run.slot, [run.last_token, *proposal.tokens])
            results = verify(req.sampler, np.asarray(logits), proposal)
            kept = len(results) - 1
            engine.truncate(run.slot, before + 1 + kept)
        except Exception as exc:
            from inference.serving.scheduler import EngineFailure

            log.exception("speculative verification failed")
            self._fail(run, EngineFailure(f"decode failed: {exc}"))
            return
        if self._store is not None:
            self._slot_tokens[run.slot].extend([run.last_token, *proposal.tokens[:kept]])
        if self.speculative_stats is not None:
            self.speculative_stats.add(len(proposal.tokens), kept, len(results))
        hook = getattr(self._observer, "speculative_step", None)
        if hook is not None:
            hook(len(proposal.tokens), kept, len(results))
        emitted = 0
        for sample in results:
            out = req.state.push(sample)
            emitted += 1
            if not self._emit(run, out):
                break
            run.last_token = sample.token_id
        if self._observer is not None:
            self._observer.tokens_generated(emitted)
