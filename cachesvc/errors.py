"""One exception tree for the cache service.

HTTP mapping lives in the http layer (``cachesvc.http.errors``); the CLI prints ``str(exc)``.
Every message says what went wrong and what to do about it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class CacheError(Exception):
    """Base of every error the cache service raises on purpose."""


class ConfigError(CacheError, ValueError):
    """A launch option or request field is invalid. ``field`` names it (e.g. ``--port``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message


class CheckpointError(CacheError):
    """A checkpoint cannot be resolved or read (bad path, wrong kind of directory, hub failure)."""


class UnsupportedModelError(CheckpointError):
    """The checkpoint is of a model family cachesvc cannot build (bad input: 400, exit 2)."""


class HubUnreachableError(CheckpointError):
    """The Hugging Face hub could not be reached (or offline mode forbids it)."""


class NotFoundError(CacheError, LookupError):
    """A bundle, build, or checkpoint id does not exist."""


class ConflictError(CacheError):
    """The operation conflicts with the state of a bundle (leased, pinned, building)."""

    def __init__(self, message: str, *, reason: str, holders: list[dict[str, object]] | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.holders = holders or []


class LeasedError(ConflictError):
    """The bundle is leased by a serving process and cannot be removed."""

    def __init__(self, message: str, holders: list[dict[str, object]] | None = None) -> None:
        super().__init__(message, reason="leased", holders=holders)

    @classmethod
    def held_by(cls, subject: str, holders: Sequence[Any], then: str) -> LeasedError:
        """``"<subject> by <who>; <then>"``, naming each holder (a lease record: ``pid``,
        ``host``, ``since``) and listing them in the error body."""
        who = ", ".join(f"pid {h.pid} on {h.host}" for h in holders) or "another process"
        return cls(f"{subject} by {who}; {then}",
                   holders=[{"pid": h.pid, "host": h.host, "since": h.since} for h in holders])


class PinnedError(ConflictError):
    """The bundle is pinned and cannot be evicted until it is unpinned."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="pinned")


class LockTimeoutError(CacheError, TimeoutError):
    """A lock could not be taken within its timeout."""


class CorruptBundleError(CacheError):
    """A bundle's files do not match its manifest; it is marked corrupt and never served."""


class BuildError(CacheError):
    """The builder failed; nothing was published."""


class QualityGateError(BuildError):
    """A quantized build answered too differently from fp32 on this CPU; nothing was published."""


class InsufficientStorageError(CacheError):
    """A build cannot fit the cache's disk budget even after evicting everything idle, or the
    free space of its disk (refused before it starts)."""


class DiskFullError(InsufficientStorageError):
    """The disk filled up while a build stage was writing; the stage removed what it wrote."""


class CatalogError(CacheError):
    """The catalog database cannot be used (unreadable, corrupt, or its disk is full)."""


class CatalogUnavailableError(CatalogError):
    """The catalog database cannot be reached now (server down, connection lost, or a SQLite file
    locked past its busy timeout). Nothing was changed; retry after ``retry_after`` seconds.

    The message is one line, ``catalog unavailable: <reason>``, with a reason of our own (never
    the driver's text, which may carry host names, paths or SQL).
    """

    def __init__(self, reason: str, *, retry_after: int = 5) -> None:
        super().__init__(f"catalog unavailable: {reason}")
        self.reason = reason
        self.retry_after = retry_after


class RegistryError(CacheError):
    """An OCI registry refused a request, answered something we cannot use, or sent an artifact
    that does not match what it claims (nothing was published; 502 on the admin API)."""


class RegistryUnavailableError(RegistryError):
    """The registry cannot be reached now (connection refused, timeout, a 5xx answer)."""


class RegistryAuthError(RegistryError):
    """The registry wants credentials we do not have, or refused the ones we sent (401/403)."""


class RegistryNotFoundError(RegistryError, NotFoundError):
    """The registry holds no manifest under the tag asked for (404)."""


class UntrustedArtifactError(RegistryError):
    """What the registry sent fails a check (digest, size, path, artifact type, machine class);
    it is refused and nothing is published."""
