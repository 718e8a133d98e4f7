"""Per-request generation state: incremental detokenization, stop strings, EOS, length, logprobs.

The scheduler owns the engine and the sampler; for every sampled token it calls
:meth:`GenerationState.push`, which returns the text that may be shown now and whether the
sequence is finished. Text is held back while it (a) would end in a broken UTF-8 character or
(b) could still be the start of a stop string, so a client never sees either.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from inference.serving.sampling import SampleResult
from inference.serving.tokenizer import Tokenizer

__all__ = [
    "GenerationState",
    "IncrementalDetokenizer",
    "StepOutput",
    "StopStringMatcher",
    "TokenLogprob",
    "TopLogprob",
    "held_suffix_length",
]

# Prompt tokens kept as decoding context: enough for tokenizers whose decoders treat the first
# token of a sequence specially (SentencePiece drops its leading space).
_PROMPT_CONTEXT_TOKENS = 6


def held_suffix_length(text: str, patterns: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of one of ``patterns``.

    Streaming code holds that tail back: the next piece of text may complete the pattern.
    """
    longest = max((len(p) for p in patterns), default=0)
    for n in range(min(len(text), longest - 1), 0, -1):
        tail = text[-n:]
        if any(p.startswith(tail) for p in patterns):
            return n
    return 0


class IncrementalDetokenizer:
    """Turn a growing list of token ids into text deltas, never splitting a UTF-8 character.

    Uses the prefix-offset technique: decode a short window of already emitted tokens together
    with the new ones and emit the difference, but only once it no longer ends in U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = ()) -> None:
        """Start after ``prompt_ids`` (their tail only serves as context, it is not emitted)."""
        self._tok = tokenizer
        hidden = tokenizer.hidden_token_ids
        context = [i for i in prompt_ids if i not in hidden][-_PROMPT_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._prefix = 0
        self._read = len(context)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (maybe empty)."""
        if token_id in self._tok.hidden_token_ids:
            return ""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """Return whatever is still held (at the end of generation), even if incomplete."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        new_text = self._tok.decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self._ids)
        return delta


class StopStringMatcher:
    """Cut text at the first stop string, holding back any tail that may begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        """``stops``: non-empty strings; the output ends before the first one found."""
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        #: The stop string that ended the text, once one did.
        self.matched: str | None = None

    def feed(self, text: str) -> tuple[str, bool]:
        """Return ``(text safe to emit, stopped)``."""
        if not self._stops:
            return text, False
        buf = self._held + text
        # Earliest occurrence wins, so overlapping stop strings cut at the first possible point.
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            at, self.matched = min(hits, key=lambda hit: hit[0])
            return buf[:at], True
        hold = held_suffix_length(buf, self._stops)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Release the held tail (generation ended without completing a stop string)."""
        held, self._held = self._held, ""
        return held


@dataclass(frozen=True)
class TopLogprob:
    """One alternative token at a position."""

    token: str
    bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The chosen token at a position, with its alternatives."""

    token_id: int
    token: str
    bytes: bytes
    logprob: float
    top: tuple[TopLogprob, ...]


@dataclass(frozen=True)
class StepOutput:
    """What one step produced for one request."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None  # "stop" | "length" | None while running
    prompt_tokens: int
    completion_tokens: int
    #: On the last output of a request cut by a stop string: that string (Anthropic's stop_sequence).
    stop_string: str | None = None
    #: Prompt tokens whose KV came from the context cache instead of a prefill.
    cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        """True for the last output of a request."""
        return self.finish_reason is not None


class GenerationState:
    """Everything one request needs between sampled tokens (not thread-safe; one owner)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        eos_token_ids: Sequence[int] = (),
        want_logprobs: bool = False,
    ) -> None:
        """Prepare for ``max_new_tokens`` tokens after ``prompt_ids``."""
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1")
        self._tok = tokenizer
        self.prompt_tokens = len(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self._end_ids = frozenset(eos_token_ids) | frozenset(stop_token_ids)
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stops = StopStringMatcher(stop)
        self._want_logprobs = want_logprobs
        self.completion_tokens = 0
        #: Prompt tokens the scheduler took from the context cache (set when the slot is prepared).
        self.cached_tokens = 0
        self.finish_reason: str | None = None

    def _logprob(self, sample: SampleResult) -> TokenLogprob:
        tok = self._tok
        return TokenLogprob(
            token_id=sample.token_id,
            token=tok.token_text(sample.token_id),
            bytes=tok.token_bytes(sample.token_id),
            logprob=sample.logprob if sample.logprob is not None else 0.0,
            top=tuple(TopLogprob(tok.token_text(i), tok.token_bytes(i), lp) for i, lp in sample.top),
        )

    def _out(self, text: str, ids: tuple[int, ...], lps: tuple[TokenLogprob, ...]) -> StepOutput:
        return StepOutput(
            text,
            ids,
            lps,
            self.finish_reason,
            self.prompt_tokens,
            self.completion_tokens,
            stop_string=self._stops.matched if self.finish_reason is not None else None,
            cached_tokens=self.cached_tokens,
        )

    def push(self, sample: SampleResult) -> StepOutput:
        """Account for one sampled token; return the visible text and whether we are done."""
        if self.finish_reason is not None:
            raise RuntimeError("push() after the sequence finished")
        self.completion_tokens += 1
        token = sample.token_id
        if token in self._end_ids:
            # EOS is counted as generated but never shown; held text was not a stop string.
            text, stopped = self._stops.feed(self._detok.flush())
            if not stopped:
                text += self._stops.flush()
            self.finish_reason = "stop"
            return self._out(text, (token,), ())
        lps = (self._logprob(sample),) if self._want_logprobs else ()
        text, stopped = self._stops.feed(self._detok.push(token))
        if stopped:
            self.finish_reason = "stop"
        elif sample.grammar_done or self.completion_tokens >= self.max_new_tokens:
            more, stopped = self._stops.feed(self._detok.flush())
            text += more
            if not stopped:
                text += self._stops.flush()
            self.finish_reason = "stop" if stopped or sample.grammar_done else "length"
        return self._out(text, (token,), lps)

    def finish_length(self) -> StepOutput:
        """End early for lack of room (the engine's KV capacity): flush and report ``length``."""
        text, stopped = self._stops.feed(self._detok.flush())
        if not stopped:
            text += self._stops.flush()
        self.finish_reason = "stop" if stopped else "length"
        return self._out(text, (), ())
