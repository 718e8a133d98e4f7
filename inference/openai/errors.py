"""The ``/v1`` exception tree and the one function that maps any exception to the OpenAI body.

Body: ``{"error": {"message", "type", "param", "code"}}``. Bad input is always a 4xx that names
the field in ``param``; only our own bugs become a 500.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from inference.scheduler import (
    AdapterUnloadedError,
    EngineFailure,
    QueueFullError,
    QueueTimeoutError,
    SchedulerStoppedError,
)
from inference.tokenizer import ChatTemplateError

__all__ = [
    "AuthenticationError",
    "ClientDisconnectedError",
    "ContextLengthExceededError",
    "InternalServerError",
    "InvalidRequestError",
    "ModelNotFoundError",
    "OpenAIError",
    "ServerOverloadedError",
    "ServerUnavailableError",
    "UnsupportedMediaTypeError",
    "anthropic_error_body",
    "anthropic_exception_handler",
    "error_body",
    "openai_exception_handler",
    "public_message",
    "renamed_params",
    "to_openai_error",
]

log = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1


class OpenAIError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

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


class InvalidRequestError(OpenAIError):
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


class AuthenticationError(OpenAIError):
    """401: missing or wrong API key."""

    status_code = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class ModelNotFoundError(OpenAIError):
    """404: the request names a model this server does not serve."""

    status_code = 404
    type = "invalid_request_error"
    code = "model_not_found"


class ServerOverloadedError(OpenAIError):
    """429: no slot and no room in the queue (or the queue wait timed out)."""

    status_code = 429
    type = "server_error"
    code = "server_overloaded"

    def __init__(self, message: str, *, retry_after: int = RETRY_AFTER_SECONDS) -> None:
        """Sets ``Retry-After``."""
        super().__init__(message, headers={"Retry-After": str(retry_after)})


class ServerUnavailableError(OpenAIError):
    """503: draining, stopped or not loaded yet."""

    status_code = 503
    type = "server_error"
    code = "server_unavailable"


class ClientDisconnectedError(OpenAIError):
    """The client hung up before a non-streamed answer was ready; its generation was cancelled."""

    status_code = 499
    type = "client_closed_request"
    code = "client_closed_request"


class InternalServerError(OpenAIError):
    """500: the engine or the server failed."""

    status_code = 500
    type = "server_error"
    code = "internal_error"


@contextlib.contextmanager
def renamed_params(names: Mapping[str, str]) -> Iterator[None]:
    """Errors raised inside name the fields as ``names`` maps them (a surface that translates its
    request into a chat request reports its own field names: ``max_output_tokens``, not
    ``max_completion_tokens``)."""
    try:
        yield
    except OpenAIError as exc:
        param = exc.param
        if param is not None:
            # The longest name that heads the param (``a.b`` heads ``a.b.c`` and ``a.b[0]``).
            for key in sorted(names, key=len, reverse=True):
                if param == key or param.startswith((key + ".", key + "[")):
                    exc.message = exc.message.replace(key, names[key])
                    exc.param = names[key] + param[len(key) :]
                    break
        raise


# An absolute path in a message: up to whitespace, a quote or punctuation that ends a phrase.
_ABS_PATH = re.compile(r"(?<![\w.:/~])/[^\s'\"`,;()\[\]{}<>]+")


def _on_this_machine(candidate: str) -> bool:
    # A path of two or more parts whose top directory exists here (/tmp/..., /home/...);
    # route names (/v1/models, /admin/builds) have no such directory.
    parts = Path(candidate.rstrip(".:")).parts
    try:
        return len(parts) > 2 and Path(parts[0], parts[1]).is_dir()
    except (OSError, ValueError):
        return False


def public_message(message: str) -> str:
    """``message`` without this machine's paths: an absolute path under a directory that exists
    here becomes ``<server path>``. Route names such as ``/v1/models`` stay."""
    return _ABS_PATH.sub(lambda m: "<server path>" if _on_this_machine(m.group(0)) else m.group(0), message)


def error_body(exc: OpenAIError) -> dict[str, Any]:
    """The OpenAI error object for ``exc`` (no server path in its message)."""
    message = public_message(exc.message)
    return {"error": {"message": message, "type": exc.type, "param": exc.param, "code": exc.code}}


#: HTTP status -> Anthropic error ``type`` (anything else: ``api_error``).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(exc: OpenAIError) -> dict[str, Any]:
    """The Anthropic error object for ``exc``: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ANTHROPIC_TYPES.get(exc.status_code, "api_error")
    return {"type": "error", "error": {"type": kind, "message": public_message(exc.message)}}


_MSGSPEC_PATH = re.compile(r" - at `\$\.?(?P<path>[^`]*)`$")
_MSGSPEC_MISSING = re.compile(r"(?:missing required|contains unknown) field `(?P<field>[^`]+)`")
_MSGSPEC_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>[^`]+)`")


def _param_from_msgspec(message: str) -> tuple[str, str | None]:
    # msgspec messages end with " - at `$.messages[0].role`"; a missing field is named in the
    # text instead ("Object missing required field `prompt` - at `$.messages[0]`").
    m = _MSGSPEC_PATH.search(message)
    path = (m.group("path") or None) if m else None
    missing = _MSGSPEC_MISSING.search(message)
    if missing is not None:
        path = f"{path}.{missing.group('field')}" if path else missing.group("field")
    return message, path


def to_openai_error(exc: BaseException) -> OpenAIError:
    """Map any exception raised under ``/v1`` to an :class:`OpenAIError`."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, msgspec.ValidationError | msgspec.DecodeError):
        message, param = _param_from_msgspec(str(exc))
        if _MSGSPEC_UNKNOWN.search(message) and param is not None:
            # As OpenAI answers an unknown argument: name it, say it is not recognised.
            return InvalidRequestError(
                f"Unrecognized request argument supplied: {param} (this server accepts the fields of "
                "the API reference and its documented extensions)",
                param=param,
                code="unknown_parameter",
            )
        return InvalidRequestError(f"invalid request body: {message}", param=param)
    if isinstance(exc, ValidationException):
        return _from_litestar_validation(exc)
    if isinstance(exc, ChatTemplateError):
        return InvalidRequestError(str(exc), param="messages")
    if isinstance(exc, QueueFullError):
        return ServerOverloadedError(f"server overloaded, retry later: {exc}")
    if isinstance(exc, QueueTimeoutError):
        return ServerOverloadedError(f"server overloaded, retry later: {exc}")
    if isinstance(exc, SchedulerStoppedError):
        return ServerUnavailableError(f"server unavailable: {exc}")
    if isinstance(exc, EngineFailure):
        return InternalServerError(str(exc))
    if isinstance(exc, AdapterUnloadedError):
        return ModelNotFoundError(str(exc), param="model")
    if isinstance(exc, HTTPException):
        status = exc.status_code
        err: OpenAIError
        if status == 401:
            err = AuthenticationError(exc.detail)
        elif status == 404:
            err = OpenAIError(exc.detail, code="not_found")
        elif status == 503:
            err = ServerUnavailableError(exc.detail)
        elif 400 <= status < 500:
            err = InvalidRequestError(exc.detail)
        else:
            err = InternalServerError(exc.detail)
        err.status_code = status
        if status < 500:
            err.type = "invalid_request_error"
        err.headers.update(exc.headers or {})
        return err
    log.exception("unhandled error under /v1", exc_info=exc)
    return InternalServerError(f"internal server error: {type(exc).__name__}")


def _from_litestar_validation(exc: ValidationException) -> InvalidRequestError:
    extra = exc.extra if isinstance(exc.extra, list) else []
    for item in extra:
        if isinstance(item, dict):
            key = item.get("key")
            text = str(item.get("message", exc.detail))
            message, param = _param_from_msgspec(text)
            # Litestar names the whole body "data"; that tells a client nothing.
            if param is None and key and key != "data":
                param = str(key)
            where = f" (field {param!r})" if param else ""
            return InvalidRequestError(f"invalid request body{where}: {message}", param=param)
    return InvalidRequestError(f"invalid request: {exc.detail}")


def openai_exception_handler(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """Litestar exception handler for everything under ``/v1``."""
    err = to_openai_error(exc)
    return Response(content=error_body(err), status_code=err.status_code, headers=err.headers)


def anthropic_exception_handler(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    """Litestar exception handler for the Anthropic routes (``/v1/messages``): same statuses as
    ``/v1``, Anthropic's error body."""
    err = to_openai_error(exc)
    return Response(content=anthropic_error_body(err), status_code=err.status_code, headers=err.headers)
