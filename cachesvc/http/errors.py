"""The one mapper from cache errors (and Litestar's own HTTP errors) to problem-style JSON.

Mounted on the admin router only (and on ``/metrics``), so ``/v1`` keeps the OpenAI error body.
Bad input is always a 4xx that names the field; a 500 means a bug or a failed build, never a
malformed request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, SerializationException, ValidationException
from litestar.openapi.datastructures import ResponseSpec

from cachesvc.errors import (
    BuildError,
    CacheError,
    CatalogError,
    CatalogUnavailableError,
    CheckpointError,
    ConfigError,
    ConflictError,
    CorruptBundleError,
    HubUnreachableError,
    InsufficientStorageError,
    LeasedError,
    LockTimeoutError,
    NotFoundError,
    PinnedError,
    RegistryAuthError,
    RegistryError,
    RegistryNotFoundError,
    UntrustedArtifactError,
)
from cachesvc.http.schemas import LeaseHolderOut, Problem

PROBLEM_MEDIA_TYPE = "application/problem+json"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProblemKind:
    """How one exception class is presented: status, a stable ``type`` slug and a title."""

    status: int
    slug: str
    title: str

    @property
    def type(self) -> str:
        """The problem ``type`` URI (a URN: stable, never fetched)."""
        return f"urn:cachesvc:problem:{self.slug}"


# Looked up along the exception's MRO, so subclasses listed here win over their bases
# (HubUnreachableError over CheckpointError, LeasedError over ConflictError).
_KINDS: Mapping[type[BaseException], ProblemKind] = {
    ConfigError: ProblemKind(400, "invalid-request", "Invalid request"),
    HubUnreachableError: ProblemKind(502, "hub-unreachable", "Hugging Face hub unreachable"),
    CheckpointError: ProblemKind(400, "checkpoint", "Checkpoint cannot be used"),
    RegistryNotFoundError: ProblemKind(404, "registry-not-found", "Not in the OCI registry"),
    RegistryAuthError: ProblemKind(502, "registry-auth", "OCI registry refused our credentials"),
    UntrustedArtifactError: ProblemKind(502, "registry-untrusted", "OCI artifact refused"),
    RegistryError: ProblemKind(502, "registry", "OCI registry error"),
    NotFoundError: ProblemKind(404, "not-found", "Not found"),
    LeasedError: ProblemKind(409, "bundle-leased", "Bundle is in use"),
    PinnedError: ProblemKind(409, "bundle-pinned", "Bundle is pinned"),
    ConflictError: ProblemKind(409, "conflict", "Conflict"),
    LockTimeoutError: ProblemKind(409, "lock-timeout", "Bundle is locked by another operation"),
    CorruptBundleError: ProblemKind(409, "corrupt-bundle", "Bundle is corrupt"),
    InsufficientStorageError: ProblemKind(507, "insufficient-storage", "Not enough disk for the build"),
    BuildError: ProblemKind(500, "build-failed", "Build failed"),
    CatalogUnavailableError: ProblemKind(503, "catalog-unavailable", "Catalog unavailable"),
    CatalogError: ProblemKind(503, "catalog-error", "Catalog cannot be read"),
    CacheError: ProblemKind(500, "cache-error", "Cache error"),
}

_INTERNAL = ProblemKind(500, "internal", "Internal server error")


def _kind_for(exc: BaseException) -> ProblemKind | None:
    for cls in type(exc).__mro__:
        kind = _KINDS.get(cls)
        if kind is not None:
            return kind
    return None


def _http_kind(status: int) -> ProblemKind:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    slug = {401: "unauthorized", 403: "forbidden", 400: "invalid-request"}.get(
        status, phrase.lower().replace(" ", "-")
    )
    return ProblemKind(status, slug, phrase)


def _holders(exc: ConflictError) -> list[LeaseHolderOut]:
    holders = []
    for raw in exc.holders:
        pid = raw.get("pid")
        holders.append(
            LeaseHolderOut(
                pid=pid if isinstance(pid, int) else -1,
                host=str(raw.get("host", raw.get("node", ""))),
                since=str(raw.get("since", "")),
            )
        )
    return holders


def _validation_problem(exc: ValidationException, wire_names: Mapping[str, str]) -> Problem:
    # Litestar puts one {"message", "key", "source"} dict per failing parameter into ``extra``;
    # ``key`` is the Python name, ``wire_names`` maps it to the name the client sent.
    issues = exc.extra if isinstance(exc.extra, list) else []
    parts: list[str] = []
    field: str | None = None
    for issue in issues:
        if not isinstance(issue, dict):
            continue
        key = issue.get("key")
        key = wire_names.get(key, key) if isinstance(key, str) else key
        message = str(issue.get("message", "")).strip()
        if key == "data" and issue.get("source") == "body":
            # Litestar names the whole body "data"; callers know it as the request body, and
            # an unknown or missing field is the field to fix.
            key = _named_body_field(message) or "body"
            if message == "'data'":
                message = "a JSON object is required (send {} for the defaults)"
        if field is None and key:
            field = str(key)
        parts.append(f"{key}: {message}" if key else message)
    detail = "; ".join(p for p in parts if p) or str(exc.detail)
    if field is None:
        field = _field_from_message(detail)
    kind = _http_kind(400)
    return Problem(type=kind.type, title="Invalid request", status=400, detail=detail, field=field)


def _named_body_field(message: str) -> str | None:
    # msgspec names the field in "Object contains unknown field `x`" and
    # "Object missing required field `x`".
    for marker in ("unknown field `", "required field `"):
        start = message.find(marker)
        if start >= 0:
            name = message[start + len(marker) :].split("`", 1)[0]
            return name or None
    return None


def _field_from_message(message: str) -> str | None:
    # msgspec body errors end with "- at `$.field`" (or "$.a[0].b"); name the top-level field.
    marker = "at `$."
    start = message.find(marker)
    if start < 0:
        return None
    rest = message[start + len(marker) :]
    end = min((i for i in (rest.find("`"), rest.find("."), rest.find("[")) if i >= 0), default=len(rest))
    return rest[:end] or None


def problem_for(exc: BaseException, wire_names: Mapping[str, str] | None = None) -> Problem:
    """Map any exception raised in an admin route to a problem body with the right status.

    ``wire_names`` maps handler parameter names to their query names where they differ.
    """
    if isinstance(exc, ValidationException):
        return _validation_problem(exc, wire_names or {})
    if isinstance(exc, HTTPException) and isinstance(exc.__cause__, SerializationException):
        kind = _http_kind(400)
        return Problem(
            type=kind.type,
            title="Invalid request",
            status=400,
            detail=f"request body is not valid JSON ({exc.__cause__}); send a JSON object",
            field="body",
        )
    if isinstance(exc, HTTPException):
        kind = _http_kind(exc.status_code)
        return Problem(type=kind.type, title=kind.title, status=kind.status, detail=str(exc.detail))
    found = _kind_for(exc)
    if found is None:
        return Problem(
            type=_INTERNAL.type,
            title=_INTERNAL.title,
            status=_INTERNAL.status,
            detail=f"unexpected {type(exc).__name__}: {exc}; see the server log",
        )
    kind = found
    if isinstance(exc, ConfigError):
        return Problem(type=kind.type, title=kind.title, status=kind.status, detail=str(exc), field=exc.field)
    if isinstance(exc, ConflictError):
        return Problem(
            type=kind.type,
            title=kind.title,
            status=kind.status,
            detail=str(exc),
            reason=exc.reason,
            holders=_holders(exc),
        )
    return Problem(type=kind.type, title=kind.title, status=kind.status, detail=str(exc))


def problem_response(problem: Problem, headers: Mapping[str, str] | None = None) -> Response[Problem]:
    """A ``Response`` carrying ``problem`` as ``application/problem+json``."""
    return Response(
        content=problem,
        status_code=problem.status,
        media_type=PROBLEM_MEDIA_TYPE,
        headers=dict(headers or {}),
    )


def handle_admin_exception(request: Request[Any, Any, Any], exc: Exception) -> Response[Problem]:
    """Litestar exception handler: every admin error becomes a problem response."""
    problem = problem_for(exc, _wire_names(request))
    headers = exc.headers if isinstance(exc, HTTPException) and exc.headers else None
    if isinstance(exc, CatalogUnavailableError):
        # An outage is logged once by the catalog's health tracker, not once per request.
        return problem_response(problem, {"Retry-After": str(exc.retry_after)})
    if problem.status >= 500:
        log.error("admin %s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
    return problem_response(problem, headers)


#: What each documented error status means on the admin surface (OpenAPI descriptions).
_STATUS_DESCRIPTIONS: Mapping[int, str] = {
    400: "Bad input; `field` names the parameter or body field to fix",
    401: "Admin key missing or wrong (send `Authorization: Bearer <key>` or `x-api-key`)",
    403: "Not a loopback client and the server has no --admin-api-key, or a foreign Origin (a web page)",
    404: "No such bundle, build or checkpoint",
    415: "The body is not declared `application/json`",
    429: "Every loaded model is busy and the model cannot be loaded yet (`Retry-After`)",
    503: (
        "The model could not be loaded, does not fit the memory budget, the server is draining, "
        "or the catalog database is unavailable (`Retry-After`)"
    ),
    409: "The bundle is leased, pinned, locked or corrupt; `reason` and `holders` say which",
    500: "Build failed or server bug (never bad input)",
    502: (
        "The Hugging Face hub or the OCI registry could not be reached or refused us, or the "
        "registry sent an artifact that failed its checks (nothing was published)"
    ),
    507: "The build cannot fit the cache's cap or the free space of its disk",
}


def problem_responses(*statuses: int) -> dict[int, ResponseSpec]:
    """OpenAPI response specs for the given error statuses, plus the guard's 401 and 403 and the
    503 of a catalog outage (every admin route reads the catalog)."""
    return {
        status: ResponseSpec(
            data_container=Problem,
            media_type=PROBLEM_MEDIA_TYPE,
            description=_STATUS_DESCRIPTIONS[status],
            generate_examples=False,
        )
        for status in sorted({401, 403, 500, 503, *statuses})
    }


def _wire_names(request: Request[Any, Any, Any]) -> dict[str, str]:
    """Handler parameters declared under another name (``bundle_state`` is ``?state=``)."""
    try:
        parameters = request.route_handler.parsed_fn_signature.parameters
    except (KeyError, AttributeError):  # no handler resolved (routing failed)
        return {}
    names: dict[str, str] = {}
    for name, field in parameters.items():
        wire = getattr(field.kwarg_definition, "name", None)
        if isinstance(wire, str) and wire and wire != name:
            names[name] = wire
    return names


def admin_exception_handlers() -> dict[type[Exception] | int, Callable[..., Response[Any]]]:
    """Exception handlers for the admin router (and ``/metrics``)."""
    return {
        HTTPException: handle_admin_exception,
        CacheError: handle_admin_exception,
        Exception: handle_admin_exception,
    }
