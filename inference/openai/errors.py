"""The ``/v1`` error bodies and the one function that maps any exception to them.

The exception tree is :mod:`inference.serving.errors` (re-exported here; ``OpenAIError`` is its
base class): the pool and the engine client raise it too. Body: ``{"error": {"message",
"type", "param", "code"}}`` (OpenAI's) or ``{"type": "error", "error": {...}}`` (Anthropic's).
Bad input is always a 4xx that names the field in ``param``; only our own bugs become a 500.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from inference.serving.errors import (
    AuthenticationError,
    ClientDisconnectedError,
    ContextLengthExceededError,
    InternalServerError,
    InvalidRequestError,
    ModelNotFoundError,
    ServerOverloadedError,
    ServerUnavailableError,
    ServingError,
    UnsupportedMediaTypeError,
    serving_error,
)
from inference.serving.tokenizer import ChatTemplateError

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
    "ServingError",
    "UnsupportedMediaTypeError",
    "anthropic_error_body",
    "anthropic_exception_handler",
    "error_body",
    "openai_exception_handler",
    "public_message",
    "renamed_params",
    "to_openai_error",
]

#: The ``/v1`` name of the serving errors' base class.
OpenAIError = ServingError


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
    return serving_error(exc)


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
