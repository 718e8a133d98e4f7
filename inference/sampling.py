"""Logits processors and the per-request sampler.

Order per step: penalties (over the tokens generated so far) and ``logit_bias`` change the
logits; temperature 0 takes the argmax of those; otherwise temperature, top-k and top-p shape
the distribution and a per-request ``numpy.random.Generator`` (seeded from ``seed`` when given)
draws the token, so one seed gives one output. A structured-output constraint
(:class:`~inference.structured.TokenConstraint`) removes every token its grammar forbids (as if
its logit were -inf) before temperature, top-k and top-p, and learns the chosen token right after.
Reported logprobs are the model's own distribution (log-softmax of the raw logits), as OpenAI
and vLLM report them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from inference.structured import TokenConstraint

__all__ = [
    "SampleResult",
    "Sampler",
    "SamplingParams",
    "apply_logit_bias",
    "apply_penalties",
    "log_softmax",
    "nucleus_indices",
    "top_k_indices",
    "top_k_mask",
    "top_p_mask",
]


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks of the sampler. Validation of ranges happens at the HTTP edge."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or negative) = no top-k
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    top_logprobs: int | None = None  # None = no logprobs; 0 = only the chosen token's


@dataclass(frozen=True)
class SampleResult:
    """One sampled token with its logprob and the top alternatives (when asked)."""

    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()
    # The request's grammar is complete with this token: the sequence ends here.
    grammar_done: bool = False


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-softmax of a 1-D float array (float64)."""
    x = logits.astype(np.float64, copy=False)
    m = np.max(x[np.isfinite(x)]) if np.isfinite(x).any() else 0.0
    shifted = x - m
    return shifted - np.log(np.sum(np.exp(shifted)))


def apply_penalties(
    logits: np.ndarray, counts: np.ndarray, frequency_penalty: float, presence_penalty: float
) -> np.ndarray:
    """OpenAI penalties: ``logit - count * frequency - (count > 0) * presence`` (new array)."""
    if frequency_penalty == 0.0 and presence_penalty == 0.0:
        return logits
    out: np.ndarray = logits - counts * frequency_penalty - (counts > 0) * presence_penalty
    return out.astype(logits.dtype, copy=False)


def apply_logit_bias(logits: np.ndarray, bias: Mapping[int, float]) -> np.ndarray:
    """Add ``bias[token]`` to each named token's logit (new array when there is a bias)."""
    if not bias:
        return logits
    out = logits.copy()
    ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
    out[ids] += np.fromiter(bias.values(), dtype=out.dtype, count=len(bias))
    return out


def top_k_indices(logits: np.ndarray, k: int) -> np.ndarray | None:
    """Indices of the ``k`` largest logits (unordered); None when top-k is off or keeps all."""
    n = logits.shape[-1]
    if k <= 0 or k >= n:
        return None
    return np.argpartition(logits, n - k)[n - k :]


def nucleus_indices(logits: np.ndarray, p: float) -> np.ndarray | None:
    """Indices of the smallest set of most likely tokens whose probability sum reaches ``p``
    (None when ``p >= 1``: all tokens)."""
    if p >= 1.0:
        return None
    n = logits.shape[-1]
    probs_all = np.exp(logits - np.max(logits))
    probs_all /= probs_all.sum(dtype=np.float64)
    # Sorting a 150k vocabulary costs ~10 ms a step; the nucleus almost always lies within the
    # top few hundred tokens, so sort those first and fall back to a full sort only if needed.
    order: np.ndarray | None = None
    for k in (256, 4096, 32768):
        if k >= n:
            break
        cand = np.argpartition(probs_all, n - k)[n - k :]
        if probs_all[cand].sum(dtype=np.float64) >= p:
            order = cand[np.argsort(-probs_all[cand], kind="stable")]
            break
    if order is None:
        order = np.argsort(-probs_all, kind="stable")
    probs = probs_all[order].astype(np.float64)
    cum = np.cumsum(probs)
    # A token is kept when the mass before it is still below p; the top token always is.
    keep = (cum - probs) < p
    keep[0] = True
    return order[keep]


def _mask_except(logits: np.ndarray, idx: np.ndarray | None) -> np.ndarray:
    if idx is None:
        return logits
    out = np.full_like(logits, -np.inf)
    out[idx] = logits[idx]
    return out


def top_k_mask(logits: np.ndarray, k: int) -> np.ndarray:
    """Logits with all but the ``k`` largest set to -inf."""
    return _mask_except(logits, top_k_indices(logits, k))


def top_p_mask(logits: np.ndarray, p: float) -> np.ndarray:
    """Logits with everything outside the top-``p`` nucleus set to -inf."""
    return _mask_except(logits, nucleus_indices(logits, p))


class Sampler:
    """Per-request sampling state: RNG and the counts of generated tokens (for penalties)."""

    def __init__(
        self, params: SamplingParams, vocab_size: int, constraint: TokenConstraint | None = None
    ) -> None:
        """Create the sampler for tokens ``[0, vocab_size)``.

        Wider logits are cut to ``vocab_size``: engines pad their embedding beyond what the
        tokenizer can decode, and those ids must never be sampled. ``constraint``: only tokens
        its grammar allows are sampled.
        """
        self.params = params
        self.vocab_size = vocab_size
        self.constraint = constraint
        self._rng = np.random.default_rng(params.seed)
        self._counts = np.zeros(vocab_size, dtype=np.float32)
        self._penalised = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0

    def _draw(self, x: np.ndarray) -> int:
        p = self.params
        x = x / np.float32(p.temperature)
        idx = top_k_indices(x, p.top_k)
        if idx is not None:
            x = x[idx]
        keep = nucleus_indices(x, p.top_p)
        if keep is not None:
            idx = keep if idx is None else idx[keep]
            x = x[keep]
        # Work on the surviving candidates only: exp over masked -inf entries is slow, and
        # float32 exp is several times faster than float64 on a 150k vocabulary.
        weights = np.exp(x - np.max(x))
        cum = np.cumsum(weights, dtype=np.float64)
        # Inverse-CDF draw with one uniform per step: reproducible for a given seed. With
        # u < cum[-1], the first index whose cum exceeds u has weight > 0.
        u = self._rng.random() * cum[-1]
        j = int(min(np.searchsorted(cum, u, side="right"), len(cum) - 1))
        return int(idx[j]) if idx is not None else j

    def sample(self, logits: np.ndarray) -> SampleResult:
        """Choose the next token from one row of logits ``[>= vocab_size]``."""
        p = self.params
        raw = np.asarray(logits, dtype=np.float32).reshape(-1)[: self.vocab_size]
        x = raw
        if self._penalised:
            x = apply_penalties(x, self._counts, p.frequency_penalty, p.presence_penalty)
        x = apply_logit_bias(x, p.logit_bias)
        done = False
        cand: np.ndarray | None = None
        if self.constraint is not None:
            # Sample among the allowed tokens only: the same distribution as setting the others
            # to -inf, without exp() over a vocabulary of -inf (slow, see _draw).
            cand = np.flatnonzero(self.constraint.allowed())
            if cand.size:
                x = x[cand]
                if not np.isfinite(x).any():  # logit_bias removed every allowed token: drop it
                    x = raw[cand]
            else:  # an errored matcher allows nothing; never stall the sequence on it
                cand = None
        token = int(np.argmax(x)) if p.temperature <= 0.0 else self._draw(x)
        if cand is not None:
            token = int(cand[token])
        if self.constraint is not None:
            self.constraint.commit(token)
            done = self.constraint.done
        self._counts[token] += 1
        if p.top_logprobs is None:
            return SampleResult(token, grammar_done=done)
        m = float(np.max(raw))
        lse = m + float(np.log(np.sum(np.exp(raw - m), dtype=np.float64)))
        top: tuple[tuple[int, float], ...] = ()
        if p.top_logprobs > 0:
            idx = top_k_indices(raw, p.top_logprobs)
            if idx is None:
                idx = np.arange(raw.shape[0])
            idx = idx[np.argsort(-raw[idx], kind="stable")]
            top = tuple((int(i), float(raw[i]) - lse) for i in idx)
        return SampleResult(token, float(raw[token]) - lse, top, grammar_done=done)
