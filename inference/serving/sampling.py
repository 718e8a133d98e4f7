"""Logits processors and the per-request sampler.

Order per step: penalties (``repetition_penalty`` over the prompt and the tokens generated so
far, the OpenAI penalties over the generated ones) and ``logit_bias`` change the logits;
temperature 0 (or below :data:`MIN_TEMPERATURE`) takes the argmax of those; otherwise
temperature, top-k, top-p and min-p shape the distribution and a per-request
``numpy.random.Generator`` (seeded from ``seed`` when given) draws the token, so one seed gives
one output. A structured-output constraint (:class:`~inference.serving.structured.TokenConstraint`)
removes every token its grammar forbids (as if its logit were -inf) before temperature, top-k,
top-p and min-p, and learns the chosen token right after. Reported logprobs are the model's own
distribution (log-softmax of the raw logits), as OpenAI and vLLM report them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from inference.serving.structured import TokenConstraint

__all__ = [
    "MIN_TEMPERATURE",
    "SampleResult",
    "Sampler",
    "SamplingParams",
    "apply_logit_bias",
    "apply_penalties",
    "apply_repetition_penalty",
    "log_softmax",
    "nucleus_indices",
    "top_k_indices",
    "top_k_mask",
    "top_p_mask",
]


#: Temperatures below this are greedy (as vLLM's ``_SAMPLING_EPS``): dividing logits by 1e-38
#: overflows float32 to inf, and the draw over inf - inf = nan picks garbage.
MIN_TEMPERATURE = 1e-5


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
    # vLLM's extensions: tokens less likely than min_p x the top token's probability are dropped;
    # logits of tokens seen in the prompt or the output are divided (positive) or multiplied
    # (negative) by repetition_penalty (1 = off), as vLLM and transformers do.
    min_p: float = 0.0
    repetition_penalty: float = 1.0


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


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """Divide the positive and multiply the negative logits of the ``seen`` tokens (a boolean
    mask) by ``penalty`` (new array); > 1 makes repeating less likely."""
    if penalty == 1.0 or not seen.any():
        return logits
    out = logits.copy()
    sel = out[seen]
    out[seen] = np.where(sel > 0, sel / np.float32(penalty), sel * np.float32(penalty))
    return out


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
        self,
        params: SamplingParams,
        vocab_size: int,
        constraint: TokenConstraint | None = None,
        prompt_ids: Sequence[int] = (),
    ) -> None:
        """Create the sampler for tokens ``[0, vocab_size)``.

        Wider logits are cut to ``vocab_size``: engines pad their embedding beyond what the
        tokenizer can decode, and those ids must never be sampled. ``constraint``: only tokens
        its grammar allows are sampled. ``prompt_ids``: what ``repetition_penalty`` counts as
        seen before the first sample (vLLM penalises prompt tokens too).
        """
        self.params = params
        self.vocab_size = vocab_size
        self.constraint = constraint
        self._rng = np.random.default_rng(params.seed)
        self._counts = np.zeros(vocab_size, dtype=np.float32)
        self._penalised = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        self._seen: np.ndarray | None = None
        if params.repetition_penalty != 1.0:
            ids = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
            self._seen = np.zeros(vocab_size, dtype=bool)
            self._seen[ids[(ids >= 0) & (ids < vocab_size)]] = True

    def _candidates(self, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray]:
        """Temperature, top-k and top-p over processed logits ``x``: the surviving ids (None =
        all) and their unnormalised weights."""
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
        if p.min_p > 0.0:
            # The top weight is 1, so a weight is the ratio to the top token's probability.
            keep = np.flatnonzero(weights >= np.float32(p.min_p))
            idx = keep if idx is None else idx[keep]
            weights = weights[keep]
        return idx, weights

    def _draw(self, x: np.ndarray) -> int:
        idx, weights = self._candidates(x)
        j = self.draw(weights)
        return int(idx[j]) if idx is not None else j

    def _processed(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(raw logits cut to the vocabulary, logits after penalties and logit_bias)."""
        p = self.params
        raw = np.asarray(logits, dtype=np.float32).reshape(-1)[: self.vocab_size]
        x = raw
        if self._penalised:
            x = apply_penalties(x, self._counts, p.frequency_penalty, p.presence_penalty)
        if self._seen is not None:
            x = apply_repetition_penalty(x, self._seen, p.repetition_penalty)
        return raw, apply_logit_bias(x, p.logit_bias)

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax (temperature 0 or below :data:`MIN_TEMPERATURE`)."""
        return self.params.temperature < MIN_TEMPERATURE

    @property
    def rng(self) -> np.random.Generator:
        """The request's random generator (seeded from ``seed``); speculative verification
        draws its acceptance uniforms from it, so one seed still gives one output."""
        return self._rng

    def distribution(self, logits: np.ndarray) -> np.ndarray:
        """The probabilities :meth:`sample` would draw the next token from, float64
        ``[vocab_size]``: penalties (with the counts so far), ``logit_bias``, then temperature,
        top-k and top-p; one-hot on the argmax at temperature 0. Counts nothing."""
        _, x = self._processed(logits)
        out = np.zeros(self.vocab_size, dtype=np.float64)
        if self.greedy:
            out[int(np.argmax(x))] = 1.0
            return out
        idx, weights = self._candidates(x)
        probs = weights.astype(np.float64) / weights.sum(dtype=np.float64)
        if idx is None:
            return probs
        out[idx] = probs
        return out

    def draw(self, probs: np.ndarray) -> int:
        """Draw a token id from a probability vector (need not be normalised) with the
        request's generator, the same inverse-CDF draw :meth:`sample` makes."""
        # One uniform per draw: reproducible for a given seed. With u < cum[-1], the first
        # index whose cum exceeds u has weight > 0.
        cum = np.cumsum(probs, dtype=np.float64)
        u = self._rng.random() * cum[-1]
        return int(min(np.searchsorted(cum, u, side="right"), len(cum) - 1))

    def sample(self, logits: np.ndarray) -> SampleResult:
        """Choose the next token from one row of logits ``[>= vocab_size]``."""
        raw, x = self._processed(logits)
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
        token = int(np.argmax(x)) if self.greedy else self._draw(x)
        if cand is not None:
            token = int(cand[token])
        return self._result(raw, token)

    def accept(self, logits: np.ndarray, token_id: int) -> SampleResult:
        """Take ``token_id`` as the token chosen from ``logits`` (a speculative token the
        verification kept): count it for penalties and report its logprobs like :meth:`sample`."""
        raw = np.asarray(logits, dtype=np.float32).reshape(-1)[: self.vocab_size]
        return self._result(raw, int(token_id))

    def _result(self, raw: np.ndarray, token: int) -> SampleResult:
        p = self.params
        done = False
        if self.constraint is not None:
            self.constraint.commit(token)
            done = self.constraint.done
        self._counts[token] += 1
        if self._seen is not None:
            self._seen[token] = True
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
