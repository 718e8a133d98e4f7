"""Which runtime loads a bundle: the ``backend`` named in ``engine.json`` -> a lazily imported loader.

The loader is imported only when a bundle of its backend is loaded, so ``tensorrt`` and
``pycuda`` stay out of a process that serves onnxruntime bundles. onnxruntime bundles are
loaded by :mod:`inference.runtime.loader` itself. A loader is called as
``loader(bundle_dir, meta, *, max_slots=..., threads=...)`` and returns an ``Engine``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from inference.runtime.protocol import Engine

#: backend -> "module:function" of its loader.
ENGINE_LOADERS: dict[str, str] = {
    "tensorrt": "inference.runtime.trt_engine:load_trt_engine",
}


def loader_for(backend: str) -> Callable[..., Engine] | None:
    """The loader of ``backend``'s bundles, or None when no registered runtime loads them."""
    target = ENGINE_LOADERS.get(backend)
    if target is None:
        return None
    module, _, attr = target.partition(":")
    loader: Callable[..., Engine] = getattr(importlib.import_module(module), attr)
    return loader
