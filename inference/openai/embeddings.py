"""``POST /v1/embeddings`` over the model pool: inputs checked and tokenized, embedded in a
worker thread by the model's :class:`~inference.runtime.protocol.Embedder`, cut to
``dimensions`` where the model allows it, returned as float lists or base64."""

from __future__ import annotations

import asyncio
from typing import Any

from inference.openai.embeddings_protocol import (
    MAX_TOTAL_TOKENS,
    EmbeddingRequest,
    check_dimensions,
    embedding_response,
    request_inputs,
)
from inference.openai.errors import ContextLengthExceededError, InvalidRequestError
from inference.openai.handle import ModelHandle
from inference.runtime.embedding_vectors import truncate
from inference.serving.model_pool import ModelPool


class EmbeddingsEndpoint:
    """``POST /v1/embeddings``: holds the model pool."""

    def __init__(self, pool: ModelPool[ModelHandle]) -> None:
        self.pool = pool

    async def create_embedding(self, req: EmbeddingRequest) -> dict[str, Any]:
        """OpenAI's embeddings response for every input of ``req``, in order."""
        inputs = request_inputs(req)
        async with self.pool.hold(req.model) as held:
            handle = held.handle
            embedder = handle.embedder
            if embedder is None:
                raise InvalidRequestError(
                    f"model {req.model!r} generates text and has no embeddings: build an embedding "
                    "model with --task embed (or \"task\": \"embed\" in POST /admin/builds)", param="model")
            dimensions = check_dimensions(req.dimensions, embedder.dimensions, embedder.truncations)
            texts = [x for x in inputs if isinstance(x, str)]
            encoded = iter(await asyncio.gather(*(
                asyncio.to_thread(handle.tokenizer.encode, text, add_special_tokens=True) for text in texts)))
            token_lists = [next(encoded) if isinstance(x, str) else x for x in inputs]
            for i, ids in enumerate(token_lists):
                where = f"input[{i}]" if len(token_lists) > 1 else "input"
                if len(ids) > embedder.max_input_len:
                    raise ContextLengthExceededError(
                        f"{where} has {len(ids)} tokens; this model embeds at most {embedder.max_input_len}",
                        param="input")
            total = sum(len(ids) for ids in token_lists)
            if total > MAX_TOTAL_TOKENS:
                raise InvalidRequestError(
                    f"input holds {total} tokens over {len(token_lists)} inputs; at most {MAX_TOTAL_TOKENS} "
                    "are allowed per request", param="input")
            try:
                embedder.check(token_lists)
            except ValueError as exc:
                raise InvalidRequestError(str(exc), param="input") from None
            vectors = await asyncio.to_thread(embedder.embed, token_lists)
        if dimensions < vectors.shape[1]:
            vectors = truncate(vectors, dimensions)
        return embedding_response(vectors, model=req.model, encoding_format=req.encoding_format,
                                  prompt_tokens=total)
