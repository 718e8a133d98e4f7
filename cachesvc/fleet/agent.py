"""A node's agent: a heartbeat thread and a desired-state thread.

The heartbeat thread upserts this node's ``nodes`` row every ``interval`` seconds (cap, loaded
models and the converger's latest status); the converger runs in its own thread because a
build can take minutes and must not stop the heartbeat (else the node would look down).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachesvc.cache.catalog import utcnow
from cachesvc.cache.manager import CacheManager
from cachesvc.errors import CatalogUnavailableError
from cachesvc.fleet.converge import Converger

log = logging.getLogger("cachesvc.fleet")

#: The audit log's retention runs on the heartbeat thread at start and every this many beats
#: (about a minute at the default 5 s): a model-swap storm writes rows fast, a DELETE each
#: beat would be wasted work.
RETENTION_BEATS = 12


class NodeAgent:
    """Heartbeat + convergence for one node; ``start()`` / ``stop()`` from the app lifespan."""

    def __init__(
        self,
        manager: CacheManager,
        *,
        interval: float,
        loaded_models: Callable[[], list[str]] = list,
        allowed_roots: tuple[Path, ...] | None = None,
        load_model: Callable[[str], None] | None = None,
        event_retention: tuple[float, int] | None = None,
    ) -> None:
        """``event_retention``: (max age in days, max rows) of this node's events; None keeps all."""
        self.manager = manager
        self._retention = event_retention
        self._beats = 0
        self.interval = interval
        self._loaded_models = loaded_models
        self._started_at = utcnow()
        self._stop = threading.Event()
        self._status: dict[str, Any] | None = None
        self._status_lock = threading.Lock()
        self.converger = Converger(
            manager, on_status=self._set_status, allowed_roots=allowed_roots, load_model=load_model
        )
        self._threads: list[threading.Thread] = []

    def _set_status(self, status: dict[str, Any] | None) -> None:
        with self._status_lock:
            self._status = status
        self.beat()  # progress shows up at once, not one interval later

    def beat(self) -> None:
        """Write this node's heartbeat row now (errors are logged, the next beat retries)."""
        with self._status_lock:
            status = self._status
        try:
            self.manager.fleet.heartbeat(
                pid=os.getpid(),
                max_size_bytes=self.manager.max_size_bytes,
                heartbeat_seconds=self.interval,
                loaded_models=self._loaded_models(),
                started_at=self._started_at,
                desired_status=status,
                report_status=True,
            )
        except CatalogUnavailableError:
            pass  # logged once per outage by the catalog's health tracker; the next beat retries
        except Exception:
            log.warning("heartbeat of node %s failed", self.manager.node, exc_info=True)

    def start(self) -> None:
        """Beat once now, then start both threads."""
        self.beat()
        for target, name in ((self._beat_loop, "heartbeat"), (self._converge_loop, "converge")):
            thread = threading.Thread(target=target, name=f"cachesvc-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the threads (a build in progress finishes in the background; it is a daemon)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)

    def _beat_loop(self) -> None:
        self.apply_retention()
        while not self._stop.wait(self.interval):
            self.beat()
            self._beats += 1
            if self._beats % RETENTION_BEATS == 0:
                self.apply_retention()

    def apply_retention(self) -> None:
        """Drop this node's events past the retention (errors are logged; the next run retries)."""
        if self._retention is None:
            return
        days, rows = self._retention
        try:
            self.manager.apply_event_retention(max_age_days=days, max_rows=rows)
        except CatalogUnavailableError:
            pass  # logged once per outage by the catalog's health tracker
        except Exception:
            log.warning("event retention on node %s failed", self.manager.node, exc_info=True)

    def _converge_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.converger.run_once()
            except CatalogUnavailableError:
                pass  # logged once per outage by the catalog's health tracker
            except Exception:
                log.warning("desired-state pass on node %s failed", self.manager.node, exc_info=True)
            if self._stop.wait(self.interval):
                return
