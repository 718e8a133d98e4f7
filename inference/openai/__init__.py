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

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inference.openai.errors import OpenAIError
    from inference.openai.pool import ModelPool, ModelRef, ModelSource, PoolLimits
    from inference.openai.routes import ServingProvider, check_api_key, openai_router
    from inference.openai.serving import (
        AUTO_PARSERS,
        OpenAIServing,
        ServingObserver,
        ServingOptions,
        resolve_parsers,
    )
    from inference.tokenizer import Tokenizer, load_tokenizer

# Imported on first use (PEP 562), so that importing a light submodule such as
# ``inference.openai.reasoning`` (the launch flags read its parser names) does not pull in
# Litestar, the scheduler and the tokenizer.
_LAZY = {
    "OpenAIError": "inference.openai.errors",
    "ModelPool": "inference.openai.pool",
    "ModelRef": "inference.openai.pool",
    "ModelSource": "inference.openai.pool",
    "PoolLimits": "inference.openai.pool",
    "ServingProvider": "inference.openai.routes",
    "check_api_key": "inference.openai.routes",
    "openai_router": "inference.openai.routes",
    "AUTO_PARSERS": "inference.openai.serving",
    "OpenAIServing": "inference.openai.serving",
    "ServingObserver": "inference.openai.serving",
    "ServingOptions": "inference.openai.serving",
    "resolve_parsers": "inference.openai.serving",
    "Tokenizer": "inference.tokenizer",
    "load_tokenizer": "inference.tokenizer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'inference.openai' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "AUTO_PARSERS",
    "ModelPool",
    "ModelRef",
    "ModelSource",
    "OpenAIError",
    "OpenAIServing",
    "PoolLimits",
    "ServingObserver",
    "ServingOptions",
    "ServingProvider",
    "Tokenizer",
    "check_api_key",
    "load_tokenizer",
    "openai_router",
    "resolve_parsers",
]
