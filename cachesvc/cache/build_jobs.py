"""Background builds: ``POST /admin/builds`` queues a prepare on a small thread pool.

A build joins a running one for the same model and profile. Its :class:`Build` record is
updated from the worker thread (stage, progress, bundle id once known, staging dir for the
bytes-written figure); readers take snapshots. Builds are kept in memory for this process.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from cachesvc.cache.builders import ProgressFn
from cachesvc.cache.catalog import Catalog, utcnow
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.cache.records import BuildStatus, PrepareResult
from cachesvc.cache.store import dir_size
from cachesvc.errors import NotFoundError

log = logging.getLogger("cachesvc.builds")

#: ``prepare(model, request, progress, build)``: the manager's prepare with build tracking.
PrepareFn = Callable[[str, ProfileRequest, ProgressFn, "Build"], PrepareResult]


@dataclass
class Build:
    """One background build; ``status`` is replaced (never mutated) as it advances."""

    status: BuildStatus
    key: tuple[str, ProfileRequest]
    staging: Path | None = None
    started: float | None = None
    #: A pull job's registry reference (None: the configured registry; builds have none).
    ref: str | None = None


class BuildJobs:
    """The background builds of one process."""

    def __init__(
        self, prepare: PrepareFn, catalog: Catalog, *, workers: int = 2, kind: str = "build"
    ) -> None:
        self._prepare = prepare
        self._kind = kind
        self._catalog = catalog
        self._workers = workers
        self._builds: dict[str, Build] = {}
        self._builds_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Wait for running builds; drop queued ones."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

    def start(self, model: str, request: ProfileRequest, *, ref: str | None = None) -> BuildStatus:
        """Queue a build in the background; the same model and profile join the running build
        (``ref``: a pull job's registry reference, part of what a job joins on)."""
        key = (model, request)
        with self._builds_lock:
            for build in self._builds.values():
                if build.key == key and build.ref == ref and build.status.state in ("queued", "running"):
                    return self._snapshot(build)
            build_id = f"{self._kind}-" + uuid.uuid4().hex[:16]
            build = Build(
                status=BuildStatus(
                    id=build_id,
                    bundle_id="",
                    model=model,
                    profile=request.to_dict(),
                    state="queued",
                    stage="queued",
                    progress=0.0,
                    started_at=None,
                    finished_at=None,
                    elapsed_seconds=0.0,
                    bytes_written=0,
                    error=None,
                ),
                key=key,
                ref=ref,
            )
            self._builds[build_id] = build
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self._workers, thread_name_prefix=f"cachesvc-{self._kind}"
                )
            self._executor.submit(self._run, build)
            return self._snapshot(build)

    def _run(self, build: Build) -> None:
        build.started = time.monotonic()
        build.status = replace(build.status, state="running", stage="resolve", started_at=utcnow())

        def progress(stage: str, fraction: float) -> None:
            build.status = replace(build.status, stage=stage, progress=max(0.0, min(1.0, fraction)))

        try:
            result = self._prepare(build.key[0], build.key[1], progress, build)
        except Exception as exc:
            build.status = replace(
                build.status,
                state="failed",
                stage="failed",
                error=str(exc) or type(exc).__name__,
                finished_at=utcnow(),
            )
            log.error("background %s %s failed: %s", self._kind, build.status.id, exc)
            return
        info = self._catalog.bundles.get(result.bundle_id)
        nbytes = info.size_bytes if info is not None else 0
        build.status = replace(
            build.status,
            bundle_id=result.bundle_id,
            state="done",
            stage="done",
            progress=1.0,
            finished_at=utcnow(),
            bytes_written=nbytes,
            built=result.built,
        )

    def _snapshot(self, build: Build) -> BuildStatus:
        status = build.status
        elapsed = 0.0
        if status.started_at is not None:
            end = status.finished_at or utcnow()
            elapsed = (end - status.started_at).total_seconds()
        written = status.bytes_written
        if status.state == "running" and build.staging is not None and build.staging.exists():
            written = dir_size(build.staging)
        return replace(status, elapsed_seconds=elapsed, bytes_written=written)

    def get(self, build_id: str) -> BuildStatus:
        """State of one background build (NotFoundError when unknown)."""
        with self._builds_lock:
            build = self._builds.get(build_id)
        if build is None:
            raise NotFoundError(f"no {self._kind} with id {build_id!r}")
        return self._snapshot(build)

    def all_builds(self) -> list[BuildStatus]:
        """Builds started by this process, newest first."""
        with self._builds_lock:
            builds = list(self._builds.values())
        # Insertion order is start order (dicts keep it): newest first.
        return [self._snapshot(b) for b in reversed(builds)]

    def wait(self, build_id: str, timeout: float = 600.0, poll: float = 0.05) -> BuildStatus:
        """Block until a background build finishes (tests and the CLI use this)."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.get(build_id)
            if status.state in ("done", "failed") or time.monotonic() > deadline:
                return status
            time.sleep(poll)
