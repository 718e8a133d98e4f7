"""Logits processors and the per-request sampler.

Order per step: penalties (over the tokens generated so far) and ``logit_bias`` change the
logits; temperature 0 takes the argmax of those; otherwise temperature, top-k and top-p shape
the distribution and a per-request ``numpy.random.Generator`` (seeded from ``seed`` when given)
draws the token, so one seed gives one output. Reported logprobs are the model's own
distribution (log-softmax of the raw logits), as OpenAI and vLLM report them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "SampleResult",
    "Sampler",
    "SamplingParams",
    "apply_logit_bias",
    "apply_penalties",
    "log_softmax",
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
    return logits - counts * frequency_penalty - (counts > 0) * presence_penalty


def apply_logit_bias(logits: np.ndarray, bias: Mapping[int, float]) -> np.ndarray:
    """Add ``bias[token]`` to each named token's logit (new array when there is a bias)."""
    if not bias:
        return logits
    out = logits.copy()
    ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
    out[ids] += np.fromiter(bias.values(), dtype=np.float64, count=len(bias))
    return out


def top_k_mask(logits: np.ndarray, k: int) -> np.ndarray:
    """Logits with everything below the k-th largest set to -inf (ties at the edge are kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = np.partition(logits, -k)[-k]
    return np.where(logits < kth, -np.inf, logits)


def top_p_mask(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability sum reaches ``p``."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, kind="stable")
    probs = np.exp(log_softmax(logits[order]))
    cum = np.cumsum(probs)
    # A token is kept when the mass before it is still below p; the top token always is.
    keep_sorted = (cum - probs) < p
    keep_sorted[0] = True
    keep = np.zeros(logits.shape[-1], dtype=bool)
    keep[order[keep_sorted]] = True
    return np.where(keep, logits, -np.inf)


class Sampler:
    """Per-request sampling state: RNG and the counts of generated tokens (for penalties)."""

    def __init__(self, params: SamplingParams, vocab_size: int) -> None:
        """Create the sampler; ``vocab_size`` is the width of the engine's logits."""
        self.params = params
        self._rng = np.random.default_rng(params.seed)
        self._counts = np.zeros(vocab_size, dtype=np.float64)
        self._penalised = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0

    def sample(self, logits: np.ndarray) -> SampleResult:
        """Choose the next token from one row of logits ``[vocab]``."""
        p = self.params
        raw = np.asarray(logits, dtype=np.float64).reshape(-1)
        x = raw
        if self._penalised:
            x = apply_penalties(x, self._counts, p.frequency_penalty, p.presence_penalty)
        x = apply_logit_bias(x, p.logit_bias)
        if p.temperature <= 0.0:
            token = int(np.argmax(x))
        else:
            x = x / p.temperature
            x = top_k_mask(x, p.top_k)
            x = top_p_mask(x, p.top_p)
            probs = np.exp(log_softmax(x))
            cum = np.cumsum(probs)
            # Inverse-CDF draw with one uniform per step: reproducible for a given seed. With
            # u < cum[-1], the first index whose cum exceeds u has probability > 0 (unmasked).
            u = self._rng.random() * cum[-1]
            token = int(min(np.searchsorted(cum, u, side="right"), len(cum) - 1))
        self._counts[token] += 1
        if p.top_logprobs is None:
            return SampleResult(token)
        lp = log_softmax(raw)
        top: tuple[tuple[int, float], ...] = ()
        if p.top_logprobs > 0:
            k = min(p.top_logprobs, lp.shape[0])
            idx = np.argpartition(-lp, k - 1)[:k]
            idx = idx[np.argsort(-lp[idx], kind="stable")]
            top = tuple((int(i), float(lp[i])) for i in idx)
        return SampleResult(token, float(lp[token]), top)
