"""``GET /v1/models`` and ``GET /v1/models/{id}`` over the model pool: the model cards."""

from __future__ import annotations

import time

from inference.openai.handle import ModelHandle
from inference.openai.protocol import ModelCard, ModelList
from inference.serving.model_pool import ModelPool, ModelRef

__all__ = ["ModelsEndpoint"]


class ModelsEndpoint:
    """The served models as OpenAI's model cards (with our extensions: bundle, backend,
    precision, whether it is loaded, an adapter's parent, input modalities)."""

    def __init__(self, pool: ModelPool[ModelHandle]) -> None:
        self.pool = pool

    async def list_models(self) -> ModelList:
        """``GET /v1/models``: every servable name, with whether its bundle is loaded."""
        refs = await self.pool.servable()
        return ModelList(data=[self._card(r.name, r) for r in refs])

    async def model_card(self, name: str) -> ModelCard:
        """``GET /v1/models/{name}``: the model ``name`` means (404 ``model_not_found``)."""
        return self._card(name, await self.pool.resolve(name))

    def _card(self, name: str, r: ModelRef) -> ModelCard:
        loaded = self.pool.find(r.bundle_id)
        return ModelCard(
            id=name,
            created=int(time.time()),
            owned_by="cachesvc",
            max_model_len=loaded.handle.options.max_model_len if loaded is not None else r.max_model_len,
            root=r.bundle_id,
            backend=r.backend,
            precision=r.precision,
            bundle_id=r.bundle_id,
            loaded=loaded is not None,
            parent=r.parent,
            input_modalities=["text", "image"] if r.images else ["text"],
        )
