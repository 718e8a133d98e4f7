"""The bundle watch: a loaded model whose bundle is found corrupt is taken out of service.

Started and stopped by the app's lifespan (:func:`cachesvc.serving.app.create_app`), so an in-process
app and ``cachesvc serve`` watch their bundles alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from cachesvc.cache.manager import CacheManager
from cachesvc.errors import CatalogUnavailableError
from inference.serving.model_pool import ModelPool

log = logging.getLogger("cachesvc.app")


class BundleWatch:
    """Takes a loaded model out of service when its bundle is found corrupt.

    This process learns it at once (a verify through the admin API calls the manager's
    listener); another process (``cachesvc bundles verify``) only through the catalog, which
    is polled every ``interval`` seconds for every loaded bundle. Either way ``/v1`` answers
    503 with the reason for that model, and once its running requests are done the engine is
    unloaded and the lease released, so the bundle can be rebuilt.
    """

    def __init__(self, manager: CacheManager, pool: ModelPool, interval: float = 5.0) -> None:
        self.manager = manager
        self.pool = pool
        self.interval = interval
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller: asyncio.Task[None] | None = None
        manager.verifier.add_corrupt_listener(self._on_corrupt)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._poller = asyncio.ensure_future(self._poll())

    async def stop(self) -> None:
        if self._poller is not None and not self._poller.done():
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        self._loop = None

    def _on_corrupt(self, bundle_id: str, detail: str) -> None:
        # Called from whichever thread verified the bundle.
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._take_down, bundle_id, detail)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            for status in self.pool.engines():
                bid = status.bundle_id
                try:
                    info = await asyncio.to_thread(self.manager.catalog.bundles.get, bid)
                except CatalogUnavailableError:
                    continue  # logged once per outage by the catalog's health tracker
                except Exception:  # a busy or broken catalog must not take the model down
                    log.warning("could not read the state of bundle %s", bid, exc_info=True)
                    continue
                if info is None or info.state != "ready":
                    self._take_down(
                        bid, (info.error if info is not None else None) or "no longer in the catalog"
                    )

    def _take_down(self, bundle_id: str, detail: str) -> None:
        if self.pool.find(bundle_id) is None:
            return
        reason = (
            f"the model's bundle {bundle_id} failed verification ({detail}); it is no longer served. "
            "Rebuild it (restart the server, or POST /admin/builds)"
        )
        log.error("%s", reason)
        self.pool.take_down(bundle_id, reason)


__all__ = ["BundleWatch"]
