"""OpenAI-style serving: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses``, Anthropic's ``/v1/messages``, vLLM's ``/tokenize`` and ``/detokenize``.

Split as in vLLM: wire types (``protocol``, ``anthropic_protocol``, ``responses_protocol``;
requests check their own fields and convert themselves once into the generation spec the engine
runs), one model's handle (``handle``: its engine client from ``inference.serving.engine_client``,
options, parsers), one endpoint object per API surface (``models``, ``completions`` and
``chat`` hold the model pool; ``messages``, ``responses`` and ``tokenize`` hold the chat
endpoint), ``constraints`` (the output grammar a request asks for), ``routes`` (a table of thin
Litestar routes), ``errors`` (one mapping to the OpenAI and Anthropic error bodies),
``reasoning`` and ``tool_parsers``. Nothing below this package knows its types.

Use from the app::

    handle = ModelHandle(engine, load_tokenizer(bundle_dir), ServingOptions(...), observer=metrics)
    pool = ModelPool(source, factory, PoolLimits())  # inference.serving.model_pool
    pool.adopt(ref, handle, lease)
    app = Litestar([openai_router(pool, api_key=key), ...], on_startup=[pool.start])
    # shutdown: await pool.drain(grace); await pool.stop(); await pool.close()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inference.openai.errors import OpenAIError
    from inference.openai.handle import (
        AUTO_PARSERS,
        ModelHandle,
        ServingObserver,
        ServingOptions,
        resolve_parsers,
    )
    from inference.openai.routes import check_api_key, openai_router
    from inference.serving.tokenizer import Tokenizer, load_tokenizer

# Imported on first use (PEP 562), so that importing a light submodule such as
# ``inference.openai.reasoning`` (the launch flags read its parser names) does not pull in
# Litestar, the scheduler and the tokenizer.
_LAZY = {
    "OpenAIError": "inference.openai.errors",
    "check_api_key": "inference.openai.routes",
    "openai_router": "inference.openai.routes",
    "AUTO_PARSERS": "inference.openai.handle",
    "ModelHandle": "inference.openai.handle",
    "ServingObserver": "inference.openai.handle",
    "ServingOptions": "inference.openai.handle",
    "resolve_parsers": "inference.openai.handle",
    "Tokenizer": "inference.serving.tokenizer",
    "load_tokenizer": "inference.serving.tokenizer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'inference.openai' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "AUTO_PARSERS",
    "ModelHandle",
    "OpenAIError",
    "ServingObserver",
    "ServingOptions",
    "Tokenizer",
    "check_api_key",
    "load_tokenizer",
    "openai_router",
    "resolve_parsers",
]
