"""The model pool: which engines are loaded, who is using them, and when they go.

Modelled on Ollama's scheduler (``server/sched.go``): every request ``acquire``s a hold on a
loaded model (an in-process reference count) and ``release``s it when its answer is written; a
model is unloaded only at zero holds. A name that is not loaded is loaded once, however
many requests ask for it at the same time (they all wait on the same load). A load that would
pass ``max_loaded`` models or the memory budget first unloads the least recently used idle
models; when every loaded model is busy the request waits (up to ``queue_timeout``) for one to
become idle, then gets 429 with ``Retry-After``. Idle models stay for their keep-alive
(``-1`` forever, ``0`` unloaded at once when idle).

The pool is the inference side: it knows the cache only through :class:`ModelSource` (name ->
bundle, the bundle's cross-process lease, audit events) and builds per-model handles with an
injected :data:`HandleFactory`. It is generic over the handle's type and needs of a handle only
:class:`PooledModel`: its engine client (:class:`~inference.serving.engine_client.EngineClient`, whose
lifecycle the pool drives) and its ``/health`` view; it knows no request format (the model cards
of ``/v1/models`` are written in ``inference.openai.models``). Every method runs on the event
loop; blocking work (catalog reads, engine loads) goes to threads.

"Lease" means the cache's cross-process lease of a bundle (held while its engine is loaded); a
request's in-process reference to a loaded model is a *hold*.

It is the only model source of every serving surface (OpenAI, Anthropic, Responses, tokenize):
an endpoint holds the pool and answers inside ``async with pool.hold(name) as held``; a
streamed answer takes the hold over (:meth:`ModelHold.held_by`) and releases it when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from inference.serving.errors import (
    InvalidRequestError,
    ModelNotFoundError,
    ServerOverloadedError,
    ServerUnavailableError,
    ServingError,
)
from inference.serving.model_source import (
    ModelRef,
    ModelSource,
    PooledModel,
    PoolLimits,
    PoolObserver,
    Releasable,
)

log = logging.getLogger("inference.pool")

_Item = TypeVar("_Item")

#: Why a model left memory (the ``reason`` of unload events and metrics).
UNLOAD_REASONS = ("idle", "memory", "admin", "evict", "shutdown")


_Handle = TypeVar("_Handle", bound=PooledModel)

#: Builds the handle of a model (loads its engine); runs in a worker thread.
HandleFactory = Callable[[ModelRef], _Handle]


@dataclass
class _Entry(Generic[_Handle]):
    ref: ModelRef
    handle: _Handle
    #: The bundle's cross-process lease, held while the engine is loaded.
    lease: Releasable
    keep_alive: float
    loaded_at: float = field(default_factory=time.time)
    last_used: float = field(default_factory=time.time)
    #: Requests holding the model (in process).
    holds: int = 0
    queued: int = 0
    unloading: bool = False
    timer: asyncio.TimerHandle | None = None
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    names: set[str] = field(default_factory=set)

    @property
    def expires_at(self) -> float | None:
        if self.holds > 0 or self.keep_alive < 0:
            return None
        return self.last_used + self.keep_alive


@dataclass(frozen=True)
class EngineStatus:
    """One loaded engine, for ``GET /admin/engines``."""

    bundle_id: str
    names: tuple[str, ...]
    backend: str
    precision: str
    device: str
    memory_bytes: int
    loaded_at: float
    last_used: float
    expires_at: float | None
    keep_alive: float
    active_requests: int
    queued_requests: int
    references: int


class ModelHold(Generic[_Handle]):
    """One request's hold on a loaded model; :meth:`release` exactly once (idempotent)."""

    def __init__(self, pool: ModelPool[_Handle], entry: _Entry[_Handle]) -> None:
        self._pool = pool
        self._entry = entry
        self._released = False
        self._handed_over = False

    @property
    def handle(self) -> _Handle:
        """The model's handle."""
        return self._entry.handle

    @property
    def bundle_id(self) -> str:
        """The bundle the request runs on."""
        return self._entry.ref.bundle_id

    def release(self) -> None:
        """Drop the hold; the model may unload when it was the last one."""
        if self._released:
            return
        self._released = True
        self._pool._release(self._entry)

    def held_by(self, stream: AsyncIterator[_Item]) -> AsyncIterator[_Item]:
        """``stream``, keeping this hold until it ends (or is dropped unstarted): a streamed
        answer outlives the ``async with pool.hold(...)`` block that made it."""
        self._handed_over = True

        async def holding() -> AsyncIterator[_Item]:
            try:
                async for item in stream:
                    yield item
            finally:
                self.release()

        held = holding()
        # A stream dropped before its first iteration never runs its ``finally``.
        weakref.finalize(held, self.release)
        return held


class ModelPool(Generic[_Handle]):
    """Loaded engines by bundle, shared by all requests (see the module docstring)."""

    def __init__(
        self,
        source: ModelSource,
        factory: HandleFactory[_Handle],
        limits: PoolLimits,
        *,
        observer: PoolObserver | None = None,
    ) -> None:
        self.source = source
        self.factory = factory
        self.limits = limits
        self.observer = observer
        self._loaded: dict[str, _Entry[_Handle]] = {}
        self._loading: dict[str, asyncio.Future[_Entry[_Handle]]] = {}
        self._loading_bytes: dict[str, int] = {}
        self._changed = asyncio.Event()
        self._draining = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._adopted: list[_Entry[_Handle]] = []
        #: name -> why it is out of service (its bundle failed verification while loaded); /v1
        #: answers 503 with the reason until a load of that name succeeds again.
        self._down: dict[str, str] = {}
        self.loads = 0  # loads started by this pool (tests and /admin/engines read it)
        #: The name ``/health`` reports first (the startup model), when there is one.
        self.primary: str | None = None

    # -- start ---------------------------------------------------------------------------------

    def adopt(
        self,
        ref: ModelRef,
        handle: _Handle,
        lease: Releasable,
        *,
        keep_alive: float = -1,
        names: Sequence[str] = (),
        load_seconds: float = 0.0,
    ) -> None:
        """Add a model loaded before the pool (``serve MODEL``, in ``load_seconds``); :meth:`start`
        starts it. It counts as a load (the observer's loaded models and loads)."""
        entry = _Entry(ref=ref, handle=handle, lease=lease, keep_alive=keep_alive, names={ref.name, *names})
        entry.idle.set()
        self._loaded[ref.bundle_id] = entry
        self._adopted.append(entry)
        if self.observer is not None:
            self.observer.model_loaded(ref.name, load_seconds, len(self._loaded))

    async def start(self) -> None:
        """Start the schedulers of adopted models (in the server's event loop)."""
        for entry in self._adopted:
            await entry.handle.client.start()
        self._adopted.clear()

    def forget_name(self, name: str) -> None:
        """Stop answering ``name`` from a loaded model without a catalog lookup (alias removed)."""
        for entry in self._loaded.values():
            entry.names.discard(name)

    # -- requests ------------------------------------------------------------------------------

    def check_admitting(self) -> None:
        """Raise 503 while the server drains."""
        if self._draining:
            raise ServerUnavailableError("the server is shutting down and admits no new requests")

    @contextlib.asynccontextmanager
    async def hold(self, name: str, *, keep_alive: float | None = None) -> AsyncIterator[ModelHold[_Handle]]:
        """:meth:`acquire` for an ``async with`` block: the hold is released when the block
        ends, unless a stream took it over (:meth:`ModelHold.held_by`)."""
        held = await self.acquire(name, keep_alive=keep_alive)
        try:
            yield held
        finally:
            if not held._handed_over:
                held.release()

    def default_model(self) -> str:
        """The model a request that leaves ``model`` out means (``/tokenize``, as vLLM): the
        server's startup model; 400 when it has none."""
        if self.primary is None:
            raise InvalidRequestError("model is required: this server has no default model", param="model")
        return self.primary

    async def acquire(self, name: str, *, keep_alive: float | None = None) -> ModelHold[_Handle]:
        """A hold on the model ``name`` means, loading it first when needed.

        Raises 404 for unknown or unbuilt names, 429 when no model can be unloaded to make
        room within the queue timeout, 503 when the load fails or the server drains."""
        self.check_admitting()
        # Warm path: a loaded model answers the names that reached it without a catalog read.
        for warm in self._loaded.values():
            if name in warm.names and not warm.unloading:
                return self._take(warm, name, keep_alive)
        try:
            ref = await asyncio.to_thread(self.source.resolve, name)
        except ModelNotFoundError:
            if name in self._down:
                raise ServerUnavailableError(self._down[name]) from None
            raise
        deadline = time.monotonic() + self.limits.queue_timeout
        while True:
            self.check_admitting()
            changed = self._changed
            entry = self._loaded.get(ref.bundle_id)
            if entry is not None and not entry.unloading:
                return self._take(entry, name, keep_alive)
            pending = self._loading.get(ref.bundle_id)
            if pending is None and entry is None:
                if not await self._make_room(ref):
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise ServerOverloadedError(
                            f"every loaded model is busy and loading {name!r} needs room "
                            f"(--max-loaded-models {self.limits.max_loaded}); retry shortly"
                        )
                    await self._wait(changed, remaining)
                    continue
                # This request has the loaded model's first hold (taken inside the load, so a
                # keep-alive of 0 cannot unload it before the request runs).
                future = self._start_load(ref, keep_alive, name)
                try:
                    loaded = await asyncio.wait_for(
                        asyncio.shield(future), timeout=max(deadline - time.monotonic(), 0.001)
                    )
                except BaseException as exc:
                    future.add_done_callback(self._drop_hold)
                    if isinstance(exc, TimeoutError):
                        raise ServerOverloadedError(
                            f"the model {name!r} is still loading; retry shortly"
                        ) from None
                    raise
                try:
                    self._check_queue()
                except ServerOverloadedError:
                    self._release(loaded)
                    raise
                return ModelHold(self, loaded)
            remaining = deadline - time.monotonic()
            if pending is not None:
                try:
                    # shield: a caller that gives up must not cancel the load the others wait on.
                    await asyncio.wait_for(asyncio.shield(pending), timeout=max(remaining, 0.001))
                except TimeoutError:
                    raise ServerOverloadedError(
                        f"the model {name!r} is still loading; retry shortly"
                    ) from None
                continue
            # An entry being unloaded: wait until it is gone, then load it again.
            if remaining <= 0:
                raise ServerOverloadedError(f"the model {name!r} is being unloaded; retry shortly")
            await self._wait(changed, remaining)

    def _check_queue(self) -> None:
        limit = self.limits.max_queued
        if limit is None:
            return
        queued = sum(e.handle.client.queued for e in self._loaded.values())
        # Each model's scheduler still decides whether this request gets a slot at once; the
        # pool only refuses when the server-wide queue is already full.
        if queued and queued >= limit:
            raise ServerOverloadedError(
                f"server overloaded, retry later: {queued} requests waiting over all models "
                f"(limit {limit}, --max-queued-requests)"
            )

    def _take(self, entry: _Entry[_Handle], name: str, keep_alive: float | None) -> ModelHold[_Handle]:
        self._check_queue()
        entry.holds += 1
        entry.idle.clear()
        entry.names.add(name)
        if keep_alive is not None:
            entry.keep_alive = keep_alive
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        entry.last_used = time.time()
        return ModelHold(self, entry)

    def _drop_hold(self, future: asyncio.Future[_Entry[_Handle]]) -> None:
        # The request that started a load gave up before it finished: give its hold back.
        if not future.cancelled() and future.exception() is None:
            self._release(future.result())

    def _release(self, entry: _Entry[_Handle]) -> None:
        entry.holds -= 1
        entry.last_used = time.time()
        if entry.holds == 0:
            entry.idle.set()
            self._schedule_expiry(entry)
        self._notify()

    def _schedule_expiry(self, entry: _Entry[_Handle]) -> None:
        if entry.unloading or entry.keep_alive < 0:
            return
        if entry.timer is not None:
            entry.timer.cancel()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # released by a garbage-collected stream outside the loop
            return
        entry.timer = loop.call_later(max(entry.keep_alive, 0.0), self._expire, entry)

    def _expire(self, entry: _Entry[_Handle]) -> None:
        entry.timer = None
        if entry.holds == 0 and not entry.unloading and self._loaded.get(entry.ref.bundle_id) is entry:
            self._spawn(self._unload(entry, "idle", grace=0.0, force=False))

    def _notify(self) -> None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait(self, changed: asyncio.Event, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout=timeout)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- loading -------------------------------------------------------------------------------

    def _used_bytes(self) -> int:
        return sum(e.ref.memory_bytes for e in self._loaded.values()) + sum(self._loading_bytes.values())

    def _fits(self, ref: ModelRef) -> bool:
        count = len(self._loaded) + len(self._loading)
        if count >= self.limits.max_loaded:
            return False
        budget = self.limits.memory_budget
        return not budget or self._used_bytes() + ref.memory_bytes <= budget

    async def _make_room(self, ref: ModelRef) -> bool:
        """Unload least recently used idle models until ``ref`` fits; False when it cannot yet."""
        budget = self.limits.memory_budget
        if budget and ref.memory_bytes > budget:
            raise ServerUnavailableError(
                f"the model {ref.name!r} needs about {ref.memory_bytes / 1e9:.2f} GB"
                + (f" (of which {ref.context_bytes / 1e9:.2f} GB its context-reuse record pool, "
                   "--context-cache-partial-kv-snapshot-pool-bytes)" if ref.context_bytes else "")
                + f", more than the whole --memory-budget-gb ({budget / 1e9:.2f} GB)"
            )
        while not self._fits(ref):
            idle = [e for e in self._loaded.values() if e.holds == 0 and not e.unloading]
            if not idle:
                return False
            victim = min(idle, key=lambda e: e.last_used)
            log.info("unloading %s (least recently used) to load %s", victim.ref.bundle_id, ref.bundle_id)
            await self._unload(victim, "memory", grace=0.0, force=False)
        return True

    def _start_load(
        self, ref: ModelRef, keep_alive: float | None, name: str
    ) -> asyncio.Future[_Entry[_Handle]]:
        future: asyncio.Future[_Entry[_Handle]] = asyncio.get_running_loop().create_future()
        self._loading[ref.bundle_id] = future
        self._loading_bytes[ref.bundle_id] = ref.memory_bytes
        self.loads += 1
        self._spawn(self._load(ref, keep_alive, name, future))
        return future

    async def _load(
        self, ref: ModelRef, keep_alive: float | None, name: str, future: asyncio.Future[_Entry[_Handle]]
    ) -> None:
        started = time.monotonic()
        lease: Releasable | None = None
        try:
            lease = await asyncio.to_thread(self.source.lease, ref.bundle_id)
            handle = await asyncio.to_thread(self.factory, ref)
            try:
                await handle.client.start()
            except BaseException:
                await asyncio.to_thread(handle.client.close_engine)
                raise
        except BaseException as exc:
            if lease is not None:
                lease.release()
            self._loading.pop(ref.bundle_id, None)
            self._loading_bytes.pop(ref.bundle_id, None)
            log.error("could not load %s (%s): %s", ref.name, ref.bundle_id, exc)
            error: ServingError = (
                exc
                if isinstance(exc, ServingError)
                else ServerUnavailableError(f"could not load the model {ref.name!r}: {exc}")
            )
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: no "never retrieved" warning without waiters
            self._notify()
            return
        seconds = time.monotonic() - started
        memory = handle.client.memory_bytes or ref.memory_bytes
        ref = ModelRef(**{**ref.__dict__, "memory_bytes": memory})
        entry = _Entry(
            ref=ref,
            handle=handle,
            lease=lease,
            keep_alive=self.limits.keep_alive if keep_alive is None else keep_alive,
            names={ref.name, name},
            holds=1,  # the requesting caller's
        )
        self._loaded[ref.bundle_id] = entry
        self._loading.pop(ref.bundle_id, None)
        self._loading_bytes.pop(ref.bundle_id, None)
        self._down.pop(ref.name, None)
        log.info("loaded %s (%s) in %.2f s", ref.name, ref.bundle_id, seconds)
        self._record("load", ref, {"model": ref.name, "seconds": round(seconds, 3), "memory_bytes": memory})
        if self.observer is not None:
            self.observer.model_loaded(ref.name, seconds, len(self._loaded))
        future.set_result(entry)
        self._notify()

    def _record(self, kind: str, ref: ModelRef, detail: dict[str, Any]) -> None:
        try:
            self.source.record(kind, ref.bundle_id, detail)
        except Exception:  # the audit log must not take serving down
            log.warning("could not record the %s event of %s", kind, ref.bundle_id, exc_info=True)

    # -- operators -----------------------------------------------------------------------------

    async def preload(self, name: str, *, keep_alive: float | None = None) -> EngineStatus:
        """Load ``name`` (if needed) without running a request; the keep-alive starts now."""
        held = await self.acquire(name, keep_alive=keep_alive)
        entry = held._entry
        held.release()
        return self._status(entry)

    def find(self, bundle_id: str) -> _Entry[_Handle] | None:
        """The loaded entry of a bundle, if any."""
        return self._loaded.get(bundle_id)

    async def unload(
        self, bundle_id: str, *, reason: str = "admin", grace: float | None = None, force: bool = False
    ) -> bool:
        """Unload a bundle's engine once its requests finish (up to ``grace`` seconds; ``force``
        then cancels them). False when it was not loaded or requests were still running."""
        entry = self._loaded.get(bundle_id)
        if entry is None or entry.unloading:
            return False
        return await self._unload(
            entry, reason, grace=self.limits.unload_grace if grace is None else grace, force=force
        )

    async def _unload(self, entry: _Entry[_Handle], reason: str, *, grace: float, force: bool) -> bool:
        if entry.unloading:
            return False
        entry.unloading = True
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        try:
            # Checked first: wait_for with a zero timeout times out even on a set event.
            if not entry.idle.is_set():
                await asyncio.wait_for(entry.idle.wait(), timeout=max(grace, 0.001))
        except TimeoutError:
            if not force:
                entry.unloading = False
                self._schedule_expiry(entry)
                self._notify()
                return False
            # Cut what is left: queued requests get 503, running streams an error chunk.
            await entry.handle.client.stop()
            try:
                await asyncio.wait_for(entry.idle.wait(), timeout=10.0)
            except TimeoutError:
                log.warning("requests on %s did not end after a forced unload", entry.ref.bundle_id)
        await self._close(entry, reason)
        return True

    async def _close(self, entry: _Entry[_Handle], reason: str) -> None:
        try:
            await entry.handle.client.stop()
            await asyncio.to_thread(entry.handle.client.close_engine)
        finally:
            entry.lease.release()
            self._loaded.pop(entry.ref.bundle_id, None)
            log.info(
                "unloaded %s (%s): %s; released the lease on %s",
                entry.ref.name,
                entry.ref.bundle_id,
                reason,
                entry.ref.bundle_id,
            )
            self._record("unload", entry.ref, {"model": entry.ref.name, "reason": reason})
            if self.observer is not None:
                self.observer.model_unloaded(entry.ref.name, reason, len(self._loaded))
            self._notify()

    def take_down(self, bundle_id: str, reason: str) -> None:
        """Refuse new requests for a bundle (503 with ``reason``) and unload it once idle."""
        entry = self._loaded.get(bundle_id)
        if entry is None or entry.unloading:
            return
        entry.handle.client.mark_unavailable(reason)
        for name in entry.names:
            self._down[name] = reason
        self._spawn(self._unload(entry, "evict", grace=self.limits.unload_grace, force=True))

    # -- shutdown ------------------------------------------------------------------------------

    def begin_drain(self) -> None:
        """Stop admitting (a plain flag: safe from a signal handler)."""
        self._draining = True
        for entry in list(self._loaded.values()):
            entry.handle.client.begin_drain()

    async def drain(self, grace_seconds: float) -> bool:
        """Wait up to ``grace_seconds`` for every loaded model's requests; True when all ended."""
        self.begin_drain()
        waits = [e.handle.client.drain(grace_seconds) for e in list(self._loaded.values())]
        results = await asyncio.gather(*waits)
        return all(results)

    async def stop(self) -> None:
        """Fail what is left on every model (queued: 503, streams: an error chunk)."""
        self._draining = True
        await asyncio.gather(*(e.handle.client.stop() for e in list(self._loaded.values())))

    async def close(self) -> None:
        """Unload every model (reason ``shutdown``) and release every lease."""
        self._draining = True
        for future in list(self._loading.values()):
            with contextlib.suppress(Exception):  # a failed load has nothing to close
                await asyncio.wait_for(asyncio.shield(future), timeout=60.0)
        for entry in list(self._loaded.values()):
            if entry.timer is not None:
                entry.timer.cancel()
            entry.unloading = True
            await self._close(entry, "shutdown")

    # -- views ---------------------------------------------------------------------------------

    def _status(self, entry: _Entry[_Handle]) -> EngineStatus:
        info = entry.handle.client.engine.info
        health = entry.handle.health()
        return EngineStatus(
            bundle_id=entry.ref.bundle_id,
            names=tuple(sorted(entry.names)),
            backend=info.backend,
            precision=info.precision,
            device=info.device,
            memory_bytes=entry.ref.memory_bytes,
            loaded_at=entry.loaded_at,
            last_used=entry.last_used,
            expires_at=entry.expires_at,
            keep_alive=entry.keep_alive,
            active_requests=int(health["active_requests"]),
            queued_requests=int(health["queued_requests"]),
            references=entry.holds,
        )

    def engines(self) -> list[EngineStatus]:
        """Every loaded engine, most recently used first."""
        entries = sorted(self._loaded.values(), key=lambda e: e.last_used, reverse=True)
        return [self._status(e) for e in entries]

    def loaded_names(self) -> list[str]:
        """The served names of every loaded engine (safe to call from another thread)."""
        entries = list(self._loaded.values())  # one C-level copy: no iteration over a changing dict
        return sorted({name for entry in entries for name in tuple(entry.names)})

    async def servable(self) -> list[ModelRef]:
        """Every servable name (``GET /v1/models``); 503 while the server drains or its primary
        model is out of service."""
        self.check_admitting()
        if self.primary is not None and self.primary in self._down:
            raise ServerUnavailableError(self._down[self.primary])
        return await asyncio.to_thread(self.source.servable)

    async def resolve(self, name: str) -> ModelRef:
        """The model ``name`` means (``GET /v1/models/{name}``; 404 ``model_not_found``)."""
        self.check_admitting()
        return await asyncio.to_thread(self.source.resolve, name)

    def health(self) -> dict[str, Any]:
        """``/health``: the primary model's view (when loaded) plus every loaded model."""
        primary = None
        if self.primary is not None:
            primary = next((e for e in self._loaded.values() if self.primary in e.names), None)
        models: list[dict[str, Any]] = []
        for e in self._loaded.values():
            own = e.handle.health()
            entry: dict[str, Any] = {
                "bundle_id": e.ref.bundle_id,
                "names": sorted({self.source.public_name(n) for n in e.names}),
                "status": own["status"],
                "active_requests": own["active_requests"],
                "queued_requests": own["queued_requests"],
            }
            # Each model's own prefix store, loaded at start or on demand alike.
            for cache in ("context_cache", "image_cache"):
                if cache in own:
                    entry[cache] = own[cache]
            models.append(entry)
        shown = None if self.primary is None else self.source.public_name(self.primary)
        if primary is not None:
            body = primary.handle.health()
            body["model"] = shown
        else:
            body = {
                "status": "draining" if self._draining else "ok",
                "model": shown,
                "capabilities": {},
            }
        body["active_requests"] = sum(
            int(e.handle.health()["active_requests"]) for e in self._loaded.values()
        )
        body["queued_requests"] = sum(
            int(e.handle.health()["queued_requests"]) for e in self._loaded.values()
        )
        body["models"] = models
        if self._draining and body["status"] == "ok":
            body["status"] = "draining"
        if primary is None and self.primary is not None and self.primary in self._down:
            body["status"] = "unavailable"
            body["reason"] = self._down[self.primary]
        return body

    @property
    def ready(self) -> bool:
        """True while requests are admitted (and the primary model, if any, is loaded)."""
        if self._draining:
            return False
        if self.primary is None:
            return True
        return any(self.primary in e.names and e.handle.client.ready for e in self._loaded.values())


def close_names(name: str, candidates: Sequence[str], n: int = 5) -> list[str]:
    """Up to ``n`` of ``candidates`` that look like ``name`` (for 404 messages)."""
    import difflib

    close = difflib.get_close_matches(name, list(candidates), n=n, cutoff=0.4)
    lowered = name.lower()
    extra = [c for c in candidates if lowered and lowered in c.lower() and c not in close]
    return (close + extra)[:n]


def not_found(name: str, candidates: Sequence[str]) -> ModelNotFoundError:
    """404 ``model_not_found`` naming up to five close names."""
    close = close_names(name, candidates)
    if close:
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?"
    elif candidates:
        hint = f"; this server serves {', '.join(repr(c) for c in list(candidates)[:5])}"
    else:
        hint = "; no model is built yet (POST /admin/builds)"
    return ModelNotFoundError(
        f"the model {name!r} does not exist{hint} (GET /v1/models lists the served names)", param="model"
    )


__all__ = [
    "UNLOAD_REASONS",
    "EngineStatus",
    "HandleFactory",
    "ModelHold",
    "ModelPool",
    "ModelRef",
    "ModelSource",
    "PoolLimits",
    "PoolObserver",
    "PooledModel",
    "Releasable",
    "close_names",
    "not_found",
]
