"""Whether the catalog database answers: one tracker per catalog, fed by the engine's events.

The engine's ``handle_error`` hook (``cachesvc.cache.catalog.session``) turns a connection failure, a
lost connection or a SQLite file locked past its busy timeout into
:class:`~cachesvc.errors.CatalogUnavailableError` and tells the tracker; the next statement that
succeeds tells it the catalog is back. A SQLite catalog also has a local check (its file is still
the one opened, and writable: ``session.SqliteFile``) that the tracker runs for every snapshot,
so ``/health`` and ``/metrics`` see a deleted or read-only file even when nothing writes. The
tracker logs an outage once when it starts, then reminders with a doubling interval (never once
per request or per heartbeat), and once when it ends.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

from cachesvc.cache.records import CatalogState

log = logging.getLogger("cachesvc.catalog")

#: First reminder while an outage lasts; each later one waits twice as long, up to the cap.
FIRST_REMINDER_SECONDS = 30.0
MAX_REMINDER_SECONDS = 600.0


class CatalogHealth:
    """Up/down state of one catalog, updated from any thread."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._down_at: datetime | None = None
        self._reason: str | None = None
        self._failures = 0
        self._next_reminder = 0.0
        self._reminder = FIRST_REMINDER_SECONDS
        self._probe: Callable[[], str | None] | None = None

    def watch(self, probe: Callable[[], str | None]) -> None:
        """A cheap local check (no database round trip) run for every snapshot: a reason when
        the catalog cannot be used, else None."""
        self._probe = probe

    @property
    def available(self) -> bool:
        """False from the first failure of an outage until a statement succeeds again."""
        return self._down_since is None

    def failed(self, reason: str, *, operation: bool = True) -> None:
        """One operation failed because the catalog cannot be reached (``operation=False``: the
        local check found it, no operation was attempted)."""
        now = time.monotonic()
        with self._lock:
            self._failures += int(operation)
            self._reason = reason
            if self._down_since is None:
                self._down_since = now
                self._down_at = datetime.now(UTC)
                self._reminder = FIRST_REMINDER_SECONDS
                self._next_reminder = now + self._reminder
                log.warning(
                    "catalog unavailable: %s; loaded models keep serving, catalog-backed requests "
                    "answer 503 until it is back",
                    reason,
                )
                return
            if now < self._next_reminder:
                return
            self._reminder = min(self._reminder * 2, MAX_REMINDER_SECONDS)
            self._next_reminder = now + self._reminder
            log.warning(
                "catalog still unavailable after %.0f s (%d failed operations): %s",
                now - self._down_since,
                self._failures,
                reason,
            )

    def succeeded(self) -> None:
        """A statement went through: the outage (if any) is over."""
        if self._down_since is None:  # the common case: no lock, no work
            return
        with self._lock:
            if self._down_since is None:
                return
            log.warning(
                "catalog available again after %.0f s (%d operations failed meanwhile)",
                time.monotonic() - self._down_since,
                self._failures,
            )
            self._down_since = None
            self._down_at = None
            self._reason = None
            self._failures = 0

    def state(self) -> CatalogState:
        """A snapshot for ``/health`` (after the local check, if any)."""
        reason = self._probe() if self._probe is not None else None
        if reason is not None:
            self.failed(reason, operation=False)
        with self._lock:
            return CatalogState(
                available=self._down_since is None,
                backend=self.backend,
                reason=self._reason,
                since=self._down_at,
                failures=self._failures,
            )
