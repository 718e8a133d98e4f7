"""Reasoning parsers: split ``<think>…</think>`` off the output into ``reasoning_content``.

Every parser works as a stream (text deltas in, reasoning and content deltas out); the
non-streamed result is the same stream run over the whole text, so both always agree.

- ``qwen3`` (alias ``nemotron``): reasoning only when the output starts with ``<think>`` (or the
  rendered prompt already ends with it, as thinking-mode templates do); otherwise all content.
- ``deepseek_r1``: the output is reasoning until ``</think>``, with or without the opening tag.
- ``none``: text is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from inference.serving.generation import held_suffix_length

__all__ = [
    "REASONING_PARSERS",
    "REASONING_PARSER_CHOICES",
    "ReasoningParser",
    "ReasoningStream",
    "get_reasoning_parser",
]

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningStream:
    """Stateful splitter for one response."""

    def __init__(self, *, implicit_start: bool, starts_in_reasoning: bool) -> None:
        """``implicit_start``: reasoning even without ``<think>``; ``starts_in_reasoning``:
        the prompt already opened the block."""
        self._implicit = implicit_start
        self._state = "reasoning" if starts_in_reasoning else "start"
        self._held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Return ``(reasoning delta, content delta)`` for one text delta."""
        reasoning: list[str] = []
        content: list[str] = []
        buf = self._held + text
        self._held = ""
        while buf:
            if self._state == "start":
                stripped = buf.lstrip()
                if stripped.startswith(THINK_START):
                    self._state = "reasoning"
                    buf = stripped[len(THINK_START) :]
                elif THINK_START.startswith(stripped):
                    self._held = buf  # whitespace or a partial "<think"
                    break
                else:
                    self._state = "reasoning" if self._implicit else "content"
            elif self._state == "reasoning":
                idx = buf.find(THINK_END)
                if idx >= 0:
                    reasoning.append(buf[:idx])
                    buf = buf[idx + len(THINK_END) :]
                    self._state = "after"
                else:
                    hold = held_suffix_length(buf, (THINK_END,))
                    reasoning.append(buf[: len(buf) - hold])
                    self._held = buf[len(buf) - hold :]
                    break
            elif self._state == "after":
                # Drop the blank lines between the reasoning block and the answer.
                buf = buf.lstrip()
                if buf:
                    self._state = "content"
            else:
                content.append(buf)
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Flush held text at the end of the output."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        if self._state == "start" and self._implicit:
            return held, ""
        if self._state == "after":
            return "", ""
        return "", held


@dataclass(frozen=True)
class ReasoningParser:
    """A named reasoning format."""

    name: str
    implicit_start: bool

    def stream(self, prompt: str = "") -> ReasoningStream:
        """A splitter for one response to ``prompt`` (the rendered prompt text)."""
        opened = prompt.rstrip().endswith(THINK_START)
        return ReasoningStream(implicit_start=self.implicit_start, starts_in_reasoning=opened)

    def extract(self, text: str, prompt: str = "") -> tuple[str | None, str | None]:
        """Return ``(reasoning_content, content)``, None where empty."""
        s = self.stream(prompt)
        r1, c1 = s.feed(text)
        r2, c2 = s.finish()
        reasoning, content = r1 + r2, c1 + c2
        return (reasoning or None), (content or None)


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3", implicit_start=False),
    "nemotron": ReasoningParser("nemotron", implicit_start=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", implicit_start=True),
}


#: Every value ``--reasoning-parser`` accepts: ``auto`` picks by model type, ``none`` parses nothing.
REASONING_PARSER_CHOICES: tuple[str, ...] = ("auto", "none", *REASONING_PARSERS)


def get_reasoning_parser(name: str) -> ReasoningParser | None:
    """The parser called ``name``; None for ``none``. Raise ValueError for unknown names."""
    if name == "none":
        return None
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        known = ", ".join(["none", *sorted(REASONING_PARSERS)])
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of: {known}, auto") from None
