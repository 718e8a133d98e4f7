"""The serving errors: what went wrong with a request, its HTTP status and the field it names.

One exception tree for everything that answers a request: the model pool, the engine client and
the serving surfaces raise these; the surfaces write them as their own error bodies
(``inference.openai.errors``: OpenAI's and Anthropic's). Bad input is a 4xx naming the field in
``param``; only our own bugs become a 500. :func:`serving_error` maps the scheduler's errors (and
anything unexpected) into the tree.
"""

from __future__ import annotations

import logging

from inference.serving.scheduler import (
    AdapterUnloadedError,
    EngineFailure,
    QueueFullError,
    QueueTimeoutError,
    SchedulerStoppedError,
)

__all__ = [
    "AuthenticationError",
    "ClientDisconnectedError",
    "ContextLengthExceededError",
    "InternalServerError",
    "InvalidRequestError",
    "ModelNotFoundError",
    "ServerOverloadedError",
    "ServerUnavailableError",
    "ServingError",
    "UnsupportedMediaTypeError",
    "serving_error",
]

log = logging.getLogger("inference.serving_errors")

RETRY_AFTER_SECONDS = 1


class ServingError(Exception):
    """An error of a request with its HTTP status and error fields (``type``, ``code``,
    ``param``: the vocabulary of OpenAI's error body, which every surface maps from)."""

    status_code = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """``message`` says what went wrong and how to fix it; ``param`` names the field."""
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = dict(headers or {})


class InvalidRequestError(ServingError):
    """400: the request is malformed or asks for something unsupported."""

    status_code = 400
    type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    """400: the prompt (plus max_tokens) does not fit."""

    code = "context_length_exceeded"


class UnsupportedMediaTypeError(InvalidRequestError):
    """415: the body is not declared ``application/json``."""

    status_code = 415
    code = "unsupported_media_type"


class AuthenticationError(ServingError):
    """401: missing or wrong API key."""

    status_code = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotFoundError(ServingError):
    """404: the request names a model this server does not serve."""

    status_code = 404
    type = "invalid_request_error"
    code = "model_not_found"


class ServerOverloadedError(ServingError):
    """429: no slot and no room in the queue (or the queue wait timed out)."""

    status_code = 429
    type = "server_error"
    code = "server_overloaded"

    def __init__(self, message: str, *, retry_after: int = RETRY_AFTER_SECONDS) -> None:
        """Sets ``Retry-After``."""
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class ServerUnavailableError(ServingError):
    """503: draining, stopped or not loaded yet."""

    status_code = 503
    type = "server_error"
    code = "server_unavailable"


class ClientDisconnectedError(ServingError):
    """The client hung up before a non-streamed answer was ready; its generation was cancelled."""

    status_code = 499
    type = "client_closed_request"
    code = "client_closed_request"


class InternalServerError(ServingError):
    """500: the engine or the server failed."""

    status_code = 500
    type = "server_error"
    code = "internal_error"


def serving_error(exc: BaseException) -> ServingError:
    """``exc`` as a serving error: itself, the status of a scheduler error (429 for a full queue
    or a queue wait past its timeout, 503 for a stopped scheduler, 500 for an engine failure, 404
    for an adapter unloaded while the request waited), else a logged 500."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, QueueFullError | QueueTimeoutError):
        return ServerOverloadedError(f"server overloaded, retry later: {exc}")
    if isinstance(exc, SchedulerStoppedError):
        return ServerUnavailableError(f"server unavailable: {exc}")
    if isinstance(exc, EngineFailure):
        return InternalServerError(str(exc))
    if isinstance(exc, AdapterUnloadedError):
        return ModelNotFoundError(str(exc), param="model")
    log.exception("unhandled error under /v1", exc_info=exc)
    return InternalServerError(f"internal server error: {type(exc).__name__}")
