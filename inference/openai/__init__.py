"""OpenAI-style serving: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

Split as in vLLM: ``protocol`` (msgspec wire types), ``serving`` (request -> engine ->
response/SSE, through the ``Engine`` protocol only), ``routes`` (thin Litestar handlers),
``errors`` (one mapping to the OpenAI error body), ``reasoning`` and ``tool_parsers``.

Use from the app::

    serving = OpenAIServing(engine, load_tokenizer(bundle_dir), ServingOptions(...), observer=metrics)
    await serving.start()
    app = Litestar([openai_router(lambda: serving), ...])
    # shutdown: serving.begin_drain(); await serving.drain(grace); await serving.stop()
"""

from __future__ import annotations

from inference.openai.errors import OpenAIError
from inference.openai.routes import ServingProvider, check_api_key, openai_router
from inference.openai.serving import (
    AUTO_PARSERS,
    OpenAIServing,
    ServingObserver,
    ServingOptions,
    resolve_parsers,
)
from inference.tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "AUTO_PARSERS",
    "OpenAIError",
    "OpenAIServing",
    "ServingObserver",
    "ServingOptions",
    "ServingProvider",
    "Tokenizer",
    "check_api_key",
    "load_tokenizer",
    "openai_router",
    "resolve_parsers",
]
