"""Fixtures for the CPU engine tests: tiny checkpoints written by transformers, built bundles,
and a direct onnxruntime runner for graph-level checks against the transformers reference."""

from __future__ import annotations

import copy
import inspect
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers as tf

from inference.families import family_by_name, family_names
from tests.support.tiny_models import TINY_CONFIG, TINY_VOCAB, bundle_factory, random_model

#: Every registered model family (each declares its tiny test configuration).
FAMILIES = family_names()
VOCAB = TINY_VOCAB
COMMON: dict[str, Any] = TINY_CONFIG


def hf_config(family: str, tied: bool) -> tf.PretrainedConfig:
    """A tiny transformers config of ``family`` exercising its distinctive features (the family's
    ``tiny`` declaration, :mod:`inference.families`)."""
    fam = family_by_name(family)
    kwargs = {**COMMON, **copy.deepcopy(dict(fam.tiny)), "tie_word_embeddings": tied}
    config: tf.PretrainedConfig = getattr(tf, fam.config_class)(**kwargs)
    return config


def make_hf_model(family: str, tied: bool, seed: int = 0) -> tf.PreTrainedModel:
    """A seeded random model (:func:`tests.support.tiny_models.random_model`)."""
    model: tf.PreTrainedModel = random_model(hf_config(family, tied), seed)
    return model


def load_reference(checkpoint: Path) -> tf.PreTrainedModel:
    """transformers' own implementation of a checkpoint, in fp32 whatever the storage dtype."""
    return tf.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: (family, storage 'fp32'|'bf16', tied) -> checkpoint dir written by save_pretrained."""
    cache: dict[tuple[str, str, bool], Path] = {}

    def make(family: str, storage: str = "fp32", tied: bool = False) -> Path:
        key = (family, storage, tied)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-{family}-{storage}-{'tied' if tied else 'untied'}")
            model = make_hf_model(family, tied)
            if storage == "bf16":
                torch.nn.Module.to(model, torch.bfloat16)  # in place; the typed wrapper confuses mypy
            model.save_pretrained(out)
            cache[key] = out
        return cache[key]

    return make


@pytest.fixture(scope="session")
def built_bundle(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: (checkpoint dir, **spec fields) -> bundle dir, built once per session."""
    return bundle_factory(tmp_path_factory)


class GraphRunner:
    """Runs a decoder graph file with onnxruntime directly (batch, padding, KV by hand)."""

    def __init__(self, model_path: Path, num_layers: int, kv_heads: int, head_dim: int) -> None:
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
        self.layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim

    def empty_past(self, batch: int) -> list[np.ndarray]:
        """Empty past K/V per layer, each in its input's own heads and head size (Gemma 4's global
        layers differ from the others)."""
        shapes = {i.name: i.shape for i in self.session.get_inputs()}
        out = []
        for i in range(self.layers):
            for kind in ("key", "value"):
                shape = shapes[f"past_key_values.{i}.{kind}"]
                heads = shape[1] if isinstance(shape[1], int) else self.kv_heads
                dim = shape[3] if isinstance(shape[3], int) else self.head_dim
                out.append(np.zeros((batch, heads, 0, dim), np.float32))
        return out

    def run(
        self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: list[np.ndarray], keep: int = 0
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        feed: dict[str, np.ndarray] = {
            "input_ids": ids.astype(np.int64),
            "attention_mask": mask.astype(np.int64),
            "position_ids": positions.astype(np.int64),
            "logits_to_keep": np.array([keep], np.int64),
        }
        for i in range(self.layers):
            feed[f"past_key_values.{i}.key"] = past[2 * i]
            feed[f"past_key_values.{i}.value"] = past[2 * i + 1]
        outs = self.session.run(None, feed)
        return outs[0], list(outs[1:])


@pytest.fixture
def graph_runner() -> Callable[[Path, dict[str, Any]], GraphRunner]:
    """Factory: (model file, engine.json dict) -> GraphRunner."""

    def make(model_path: Path, meta: dict[str, Any]) -> GraphRunner:
        return GraphRunner(model_path, meta["num_layers"], meta["num_kv_heads"], meta["head_dim"])

    return make


def hf_step(model: tf.PreTrainedModel, ids: list[list[int]], cache: Any = None) -> tuple[np.ndarray, Any]:
    """One transformers forward with its KV cache: (logits [B,S,V], new cache)."""
    # transformers 5.2x renamed the cache argument and output from past_key_values to cache.
    new_api = "cache" in inspect.signature(model.forward).parameters
    kwargs = {("cache" if new_api else "past_key_values"): cache} if cache is not None else {}
    with torch.no_grad():
        out = model(torch.tensor(ids), use_cache=True, **kwargs)
    return out.logits.numpy(), (out.cache if new_api else out.past_key_values)


def hf_greedy(model: tf.PreTrainedModel, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens and per-step logits from transformers, using its own KV cache."""
    tokens: list[int] = []
    step_logits: list[np.ndarray] = []
    logits, cache = hf_step(model, [prompt])
    for _ in range(steps):
        step_logits.append(logits[0, -1])
        tokens.append(int(np.argmax(logits[0, -1])))
        logits, cache = hf_step(model, [[tokens[-1]]], cache)
    return tokens, step_logits


@pytest.fixture
def copy_dir(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    """Factory: copy a directory into tmp_path (to damage a checkpoint or bundle safely)."""
    counter = iter(range(1000))

    def copy(src: Path) -> Path:
        dst = tmp_path / f"copy{next(counter)}"
        shutil.copytree(src, dst)
        return dst

    yield copy


@pytest.fixture(scope="session")
def reference() -> Callable[[Path], tf.PreTrainedModel]:
    """Factory: checkpoint dir -> transformers fp32 model (cached per session)."""
    cache: dict[Path, tf.PreTrainedModel] = {}

    def load(checkpoint: Path) -> tf.PreTrainedModel:
        if checkpoint not in cache:
            cache[checkpoint] = load_reference(checkpoint)
        return cache[checkpoint]

    return load


@pytest.fixture(scope="session")
def greedy_reference() -> Callable[..., tuple[list[int], list[np.ndarray]]]:
    """The transformers greedy loop (``hf_greedy``) as a fixture."""
    return hf_greedy


@pytest.fixture(scope="session")
def reference_step() -> Callable[..., tuple[np.ndarray, Any]]:
    """One transformers forward with KV cache (``hf_step``) as a fixture."""
    return hf_step
