"""TensorRT's log, as the builder and the engine both read it: errors kept for the one line that
reports a refusal, warnings and errors to our log."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("inference.tensorrt")


def collecting_logger(trt: Any) -> Any:
    """A ``trt.ILogger`` that keeps the error messages (``.errors``) and logs errors and warnings."""
    class CollectingLogger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            # Membership, not <=: the severity is a pybind11 enum, not guaranteed to be ordered.
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.errors.append(msg)
                log.error("tensorrt: %s", msg)
            elif severity == trt.ILogger.Severity.WARNING:
                log.warning("tensorrt: %s", msg)

    return CollectingLogger()
