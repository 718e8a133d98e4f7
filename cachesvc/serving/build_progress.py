"""A build's progress for the person who started it: one bar on a terminal, a few lines elsewhere.

``cachesvc prepare`` and a ``serve`` that builds its startup model report through
:class:`BuildProgress`, a ``progress(stage, fraction)`` callback (the manager's ``ProgressFn``):

* **On a terminal** (the stream is a TTY): one ``tqdm`` bar, redrawn in place, its label the
  current stage (``prepare: graph``); log lines printed meanwhile go above it
  (``tqdm.contrib.logging``), as pip, ``ollama pull`` and ``huggingface-cli download`` do.
* **Elsewhere** (a pipe, a log file, a service manager): INFO log lines, one when a stage
  starts and one each time it passes another quarter (25, 50, 75, 100 %): a build of a
  30-layer model logs about a dozen lines instead of one per layer.

The ``resolve`` stage is not shown: it is quick, and a bad model argument must stay a one-line
error.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from types import TracebackType
from typing import Any, TextIO

log = logging.getLogger("cachesvc.progress")

#: The quarters a stage's plain lines mark.
STEPS = 4
_HIDDEN = frozenset({"resolve"})


class BuildProgress:
    """``with BuildProgress() as progress: manager.prepare(model, progress=progress)``."""

    def __init__(self, label: str = "prepare", *, stream: TextIO | None = None,
                 tty: bool | None = None) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.tty = _is_tty(self.stream) if tty is None else tty
        self._bar: Any = None
        self._redirect: contextlib.ExitStack | None = None
        self._stage: str | None = None
        self._step = 0

    def __enter__(self) -> BuildProgress:
        if self.tty:
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._redirect = contextlib.ExitStack()
            self._redirect.enter_context(logging_redirect_tqdm())
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __call__(self, stage: str, fraction: float) -> None:
        if stage in _HIDDEN:
            return
        fraction = max(0.0, min(1.0, fraction))
        if self.tty:
            self._draw(stage, fraction)
        else:
            self._line(stage, fraction)

    def close(self) -> None:
        """Finish the bar (left on screen at its last state) and stop redirecting log lines."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = None

    def _draw(self, stage: str, fraction: float) -> None:
        if self._bar is None:
            from tqdm import tqdm

            self._stage = stage
            self._bar = tqdm(total=100, file=self.stream, dynamic_ncols=True, leave=True,
                             desc=f"{self.label}: {stage}",
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {elapsed}")
        if stage != self._stage:
            self._stage = stage
            self._bar.set_description_str(f"{self.label}: {stage}", refresh=False)
        self._bar.n = round(fraction * 100)
        self._bar.refresh()

    def _line(self, stage: str, fraction: float) -> None:
        step = int(fraction * STEPS)
        if stage != self._stage:
            self._stage, self._step = stage, step
            log.info("%s: %s %3.0f%%", self.label, stage, fraction * 100)
        elif step > self._step:
            self._step = step
            log.info("%s: %s %3.0f%%", self.label, stage, step * 100 / STEPS)


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
