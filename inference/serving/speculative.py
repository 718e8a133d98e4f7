"""Speculative decoding: cheap proposals of the next ``k`` tokens, checked by the target model
in one run.

A :class:`Proposer` guesses up to ``k`` tokens that follow a sequence. The scheduler appends the
sequence's pending token and the guesses to the target's slot with one
:meth:`~inference.runtime.protocol.VerifyingEngine.extend` call, which returns ``k + 1`` rows of
logits; :func:`verify` decides how many guesses to keep, picks one more token from the row after
the last kept one (a correction, or the bonus token when all were kept), and the slot is
truncated to the kept positions.

Verification keeps the output exactly what ordinary decoding gives:

- Greedy (temperature 0): a guess is kept while it equals the target's argmax (after the
  request's penalties and ``logit_bias``), so the tokens are the non-speculative ones.
- Sampling: standard speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023).
  Guess ``x`` drawn from the proposal ``q`` is kept with probability ``min(1, p(x) / q(x))``;
  the first refused position draws from ``max(0, p - q)`` normalised. ``p`` is the target's
  distribution after the request's own penalties, ``logit_bias``, temperature, top-k and top-p
  (:meth:`inference.serving.sampling.Sampler.distribution`), so every emitted token is distributed
  exactly as ordinary sampling's. A proposer that guesses deterministically (n-gram lookup)
  has a one-hot ``q``: keep with probability ``p(x)``, else draw from ``p`` with ``x`` removed.

Two proposers, as vLLM's methods of the same names:

- :class:`NgramProposer` (``ngram``, prompt lookup decoding): find the last ``n`` tokens
  (``prompt_lookup_max`` down to ``prompt_lookup_min``) earlier in the sequence and propose
  the ``k`` tokens that followed their first occurrence. No second model.
- :class:`DraftModelProposer` (``draft_model``): a second, smaller engine with the same
  tokenizer runs ahead ``k`` steps. Each target slot has a draft slot of the same number whose
  KV follows the target's sequence; rejected guesses are truncated away at the next proposal.

:func:`proposer_factory` turns a bundle's recorded ``speculative`` config into a proposer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from inference.runtime.protocol import Engine, VerifyingEngine
from inference.serving.sampling import Sampler, SampleResult

__all__ = [
    "DEFAULT_NUM_SPECULATIVE_TOKENS",
    "DEFAULT_PROMPT_LOOKUP",
    "DraftModelProposer",
    "NgramProposer",
    "Proposal",
    "Proposer",
    "ProposerFactory",
    "SpeculativeStats",
    "SpeculativeStatsSnapshot",
    "proposer_factory",
    "verify",
]

#: ``k`` when neither ``num_speculative_tokens`` nor ``--draft-step`` says.
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
#: vLLM's default n-gram window when neither ``prompt_lookup_min`` nor ``_max`` is given.
DEFAULT_PROMPT_LOOKUP = 5


@dataclass(frozen=True)
class Proposal:
    """Guessed tokens; ``probs[i]`` is the distribution ``tokens[i]`` was drawn from
    (``[len(tokens), vocab]``), or None when the guesses are deterministic (one-hot)."""

    tokens: tuple[int, ...]
    probs: np.ndarray | None = None


class Proposer(Protocol):
    """Guesses the tokens that follow a sequence; driven by the scheduler thread only."""

    @property
    def num_speculative_tokens(self) -> int:
        """``k``: the most tokens one proposal holds."""
        ...

    def propose(self, slot: int, tokens: Sequence[int], sampler: Sampler, k: int) -> Proposal:
        """Up to ``k`` tokens to follow ``tokens`` (the whole sequence: prompt + output so far)
        of the request running in target ``slot``; an empty proposal when there is no guess."""
        ...

    def release(self, slot: int) -> None:
        """The request in ``slot`` ended: drop what the proposer keeps for it."""
        ...


#: Builds the proposer for one loaded target engine (the scheduler calls it once).
ProposerFactory = Callable[[Engine], Proposer]


# --- verification -----------------------------------------------------------------------------


def verify(sampler: Sampler, logits: np.ndarray, proposal: Proposal) -> list[SampleResult]:
    """Check ``proposal`` against the target's ``logits`` ``[len(tokens) + 1, vocab]`` (row ``i``
    is the distribution after the sequence plus the first ``i`` guesses).

    Returns the kept guesses followed by exactly one token chosen by the target: the correction
    at the first refused position, or the bonus token from the last row when all were kept. The
    results are counted by ``sampler`` (penalties) as ordinary sampling would.
    """
    out: list[SampleResult] = []
    for i, guess in enumerate(proposal.tokens):
        row = logits[i]
        if sampler.greedy:
            # The same call ordinary greedy decoding makes: the same token, by construction.
            chosen = sampler.sample(row)
            out.append(chosen)
            if chosen.token_id != guess:
                return out
            continue
        p = sampler.distribution(row)
        q = None if proposal.probs is None else _fit(proposal.probs[i], p.shape[0])
        q_guess = 1.0 if q is None else float(q[guess])
        p_guess = float(p[guess]) if guess < p.shape[0] else 0.0
        # Keep with probability min(1, p/q): u * q < p for one uniform u of the request's generator.
        if q_guess > 0.0 and sampler.rng.random() * q_guess < p_guess:
            out.append(sampler.accept(row, guess))
            continue
        out.append(sampler.accept(row, sampler.draw(_residual(p, q, guess))))
        return out
    out.append(sampler.sample(logits[len(proposal.tokens)]))
    return out


def _residual(p: np.ndarray, q: np.ndarray | None, guess: int) -> np.ndarray:
    """Where a refused position draws from: ``max(0, p - q)`` (unnormalised); with a one-hot
    ``q`` on ``guess`` that is ``p`` without ``guess``."""
    if q is None:
        residual = p.copy()
        if guess < residual.shape[0]:
            residual[guess] = 0.0
    else:
        residual = np.maximum(p - q, 0.0)
    if residual.sum() <= 0.0:  # p == q: a refusal had probability 0; p itself is right
        return p
    return residual


def _fit(probs: np.ndarray, vocab: int) -> np.ndarray:
    """A draft distribution over the target's ``vocab`` ids (engines pad their vocabularies)."""
    probs = np.asarray(probs, dtype=np.float64).reshape(-1)
    if probs.shape[0] >= vocab:
        return probs[:vocab]
    return np.concatenate([probs, np.zeros(vocab - probs.shape[0])])


# --- proposers --------------------------------------------------------------------------------


class NgramProposer:
    """Prompt lookup decoding: the ``k`` tokens that followed the first earlier occurrence of the
    sequence's last ``n`` tokens, trying ``n = prompt_lookup_max`` down to ``prompt_lookup_min``."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        """Check ``1 <= prompt_lookup_min <= prompt_lookup_max`` and ``k >= 1``."""
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {prompt_lookup_min} and {prompt_lookup_max}"
            )
        self._k = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    @property
    def num_speculative_tokens(self) -> int:
        """``k``."""
        return self._k

    def propose(self, slot: int, tokens: Sequence[int], sampler: Sampler, k: int) -> Proposal:
        """Up to ``k`` tokens copied from after the first earlier match of the longest suffix."""
        return Proposal(tuple(ngram_lookup(tokens, k, self.prompt_lookup_min, self.prompt_lookup_max)))

    def release(self, slot: int) -> None:
        """Nothing is kept per slot."""


def ngram_lookup(tokens: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The (at most ``k``) tokens that followed the first earlier occurrence of the last ``n``
    tokens of ``tokens``, for the largest ``n`` in ``[n_min, n_max]`` that occurs; else []."""
    seq = np.asarray(tokens, dtype=np.int64)
    total = seq.shape[0]
    if k < 1:
        return []
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        # Windows that start at 0..total-n-1: each has at least one token after it, and the
        # suffix itself (starting at total-n) is not among them.
        windows = np.lib.stride_tricks.sliding_window_view(seq[: total - 1], n)
        hits = np.flatnonzero((windows == seq[total - n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return [int(t) for t in seq[start:start + k]]
    return []


class DraftModelProposer:
    """A second engine (same tokenizer) drafts ``k`` tokens, one decode step each.

    Draft slot ``s`` shadows target slot ``s``; :attr:`_held` records the tokens whose KV it
    holds. A proposal first cuts the draft slot back to the longest prefix it shares with the
    sequence (which drops the guesses the target refused), prefills the rest, then decodes.
    With a greedy request the guesses are the draft's argmax (one-hot ``q``); a sampling
    request draws them from the draft's distribution under the request's own settings, which is
    the ``q`` verification divides by.
    """

    def __init__(self, draft: VerifyingEngine, num_speculative_tokens: int) -> None:
        """``draft`` must be able to truncate its slots (all our engines can)."""
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        self._draft = draft
        self._k = num_speculative_tokens
        self._held: list[list[int]] = [[] for _ in range(draft.info.max_slots)]

    @property
    def num_speculative_tokens(self) -> int:
        """``k``."""
        return self._k

    @property
    def engine(self) -> VerifyingEngine:
        """The draft engine."""
        return self._draft

    def _sync(self, slot: int, tokens: Sequence[int]) -> np.ndarray:
        """Make the draft slot hold ``tokens``; the logits after the last one."""
        held = self._held[slot][: self._draft.slot_length(slot)]
        same = 0
        limit = min(len(held), len(tokens) - 1)  # the last token is always run: its logits
        while same < limit and held[same] == tokens[same]:
            same += 1
        if same == 0:
            self._draft.reset(slot)
            logits = self._draft.prefill(slot, list(tokens))
        else:
            self._draft.truncate(slot, same)
            logits = self._draft.prefill(slot, list(tokens[same:]))
        self._held[slot] = list(tokens)
        return np.asarray(logits).reshape(-1)

    def propose(self, slot: int, tokens: Sequence[int], sampler: Sampler, k: int) -> Proposal:
        """``k`` tokens decoded by the draft after ``tokens`` (fewer near its capacity)."""
        if slot >= len(self._held):
            return Proposal(())
        room = self._draft.info.max_kv_capacity - len(tokens)
        k = min(k, room)
        if k < 1 or not tokens:
            return Proposal(())
        try:
            return self._draft_tokens(slot, tokens, sampler, k)
        except BaseException:
            # The draft slot's content is unknown now: start it afresh next time.
            self.release(slot)
            raise

    def _draft_tokens(self, slot: int, tokens: Sequence[int], sampler: Sampler, k: int) -> Proposal:
        logits = self._sync(slot, tokens)
        guesses: list[int] = []
        probs: list[np.ndarray] = []
        for i in range(k):
            if sampler.greedy:
                guess = int(np.argmax(logits[: sampler.vocab_size]))
            else:
                q = sampler.distribution(_fit(logits, sampler.vocab_size))
                guess = sampler.draw(q)
                probs.append(q)
            guesses.append(guess)
            if i + 1 < k:  # the last guess's logits are not needed
                logits = np.asarray(self._draft.decode([slot], [guess])).reshape(-1)
                self._held[slot].append(guess)
        return Proposal(tuple(guesses), None if sampler.greedy else np.stack(probs))

    def release(self, slot: int) -> None:
        """Forget the draft slot's content (the next request there starts it afresh)."""
        if slot < len(self._held):
            self._held[slot] = []
            self._draft.reset(slot)


# --- configuration ------------------------------------------------------------------------------


def proposer_factory(
    speculative: Mapping[str, Any],
    *,
    num_speculative_tokens: int | None = None,
    draft_engine: Engine | None = None,
) -> ProposerFactory:
    """The proposer factory for a bundle's ``engine.json`` ``speculative`` record.

    ``speculative`` holds ``method`` (``ngram`` or ``draft_model``) and, for ngram, optional
    ``prompt_lookup_min``/``prompt_lookup_max`` (vLLM's defaults: one given sets the other;
    neither gives 5 and 5) and optional ``num_speculative_tokens``. ``num_speculative_tokens``
    here (the serve-time ``--draft-step`` / config value) wins over the record; without either
    ``k`` is :data:`DEFAULT_NUM_SPECULATIVE_TOKENS`. ``draft_model`` needs ``draft_engine``: the
    loaded draft bundle, with at least as many slots as the target. Raises ``ValueError`` for a
    method this runtime does not propose itself or a missing/unsuitable draft engine.
    """
    method = speculative.get("method")
    k = num_speculative_tokens or speculative.get("num_speculative_tokens") or DEFAULT_NUM_SPECULATIVE_TOKENS
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"num_speculative_tokens must be a positive integer, got {k!r}")
    if method == "ngram":
        lo, hi = speculative.get("prompt_lookup_min"), speculative.get("prompt_lookup_max")
        lo = lo if lo is not None else (hi if hi is not None else DEFAULT_PROMPT_LOOKUP)
        hi = hi if hi is not None else lo
        proposer = NgramProposer(k, int(lo), int(hi))
        return lambda target: proposer
    if method == "draft_model":
        if draft_engine is None:
            raise ValueError("speculative method 'draft_model' needs the draft bundle's engine loaded")
        if not isinstance(draft_engine, VerifyingEngine):
            raise ValueError(f"the draft engine ({type(draft_engine).__name__}) cannot truncate its slots")
        draft = draft_engine

        def make(target: Engine) -> Proposer:
            if draft.info.max_slots < target.info.max_slots:
                raise ValueError(
                    f"the draft engine has {draft.info.max_slots} slots; the target needs "
                    f"{target.info.max_slots} (one draft slot per target slot)"
                )
            return DraftModelProposer(draft, k)

        return make
    raise ValueError(
        f"speculative method {method!r} has no proposer in this runtime (ngram and draft_model have)"
    )


# --- counters -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeculativeStatsSnapshot:
    """Counters since start: verification steps, guessed tokens, kept guesses, emitted tokens."""

    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Kept guesses / guessed tokens (0 before any guess)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens emitted per verification step (kept guesses plus the target's own token)."""
        return self.emitted / self.steps if self.steps else 0.0


@dataclass
class SpeculativeStats:
    """Thread-safe counters the scheduler thread adds to and any thread reads."""

    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _snap: SpeculativeStatsSnapshot = field(default_factory=SpeculativeStatsSnapshot)

    def add(self, proposed: int, accepted: int, emitted: int) -> None:
        """One verification step."""
        with self._lock:
            s = self._snap
            self._snap = SpeculativeStatsSnapshot(
                s.steps + 1, s.proposed + proposed, s.accepted + accepted, s.emitted + emitted
            )

    def snapshot(self) -> SpeculativeStatsSnapshot:
        """The counters now."""
        with self._lock:
            return self._snap
