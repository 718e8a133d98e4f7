"""Logits and greedy tokens of our graph and engine against transformers, every family."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inference.builder.graph import build_decoder_graph
from inference.builder.model_config import load_model_config
from inference.builder.safetensors_reader import SafetensorsCheckpoint
from inference.runtime import generate, load_engine
from tests.engine.conftest import FAMILIES

TOL = 1e-4
# Every registered family appears with fp32 and bf16 storage and with tied and untied
# embeddings (a family added to the registry gets its parity cases here by itself).
CASES = [(family, storage, (i + j) % 2 == 0)
         for i, family in enumerate(FAMILIES) for j, storage in enumerate(("fp32", "bf16"))]
IDS = [f"{f}-{s}-{'tied' if t else 'untied'}" for f, s, t in CASES]
PROMPT_LEN, DECODE_STEPS, GREEDY = 16, 8, 32


@dataclass(frozen=True)
class Case:
    """One of CASES: the CPU bundle built from its checkpoint and the transformers model."""

    bundle: Path
    ref: Any
    tied: bool


@pytest.fixture(params=CASES, ids=IDS)
def case(
    request: pytest.FixtureRequest,
    hf_checkpoint: Callable[..., Path],
    built_bundle: Callable[..., Path],
    reference: Callable[[Path], Any],
) -> Case:
    family, storage, tied = request.param
    ckpt = hf_checkpoint(family, storage, tied)
    return Case(built_bundle(ckpt), reference(ckpt), tied)


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 384, size=n)]


def _meta(bundle: Path) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((bundle / "engine.json").read_text())
    return meta


def _check_single(runner: Any, ref: Any, step: Callable[..., Any], prompt: list[int]) -> None:
    """Prefill of the prompt (all positions) + KV-cache decode steps vs transformers."""
    want, cache = step(ref, [prompt])
    n = len(prompt)
    logits, past = runner.run(np.array([prompt]), np.ones((1, n)), np.arange(n)[None], runner.empty_past(1))
    np.testing.assert_allclose(logits[0], want[0], atol=TOL, rtol=0)
    token = int(np.argmax(logits[0, -1]))
    for i in range(DECODE_STEPS):
        pos = n + i
        logits, past = runner.run(np.array([[token]]), np.ones((1, pos + 1)), np.array([[pos]]), past, keep=1)
        want, cache = step(ref, [[token]], cache)
        np.testing.assert_allclose(logits[0, -1], want[0, -1], atol=TOL, rtol=0, err_msg=f"decode step {i}")
        token = int(np.argmax(logits[0, -1]))


def test_graph_prefill_and_decode_logits_match_transformers(
    case: Case, graph_runner: Any, reference_step: Callable[..., Any]
) -> None:
    meta = _meta(case.bundle)
    assert meta["tied_lm_head"] is case.tied
    runner = graph_runner(case.bundle / "model.onnx", meta)
    _check_single(runner, case.ref, reference_step, _prompt(PROMPT_LEN, 1))


def test_inplace_engine_logits_match_transformers(case: Case, reference_step: Callable[..., Any]) -> None:
    """The CPU graph (GroupQueryAttention, KV written in place): prefill in two chunks, then decode."""
    engine = load_engine(case.bundle, max_slots=3, threads=1)
    prompt = _prompt(PROMPT_LEN + 5, 1)
    want, cache = reference_step(case.ref, [prompt])
    engine.prefill(2, prompt[:7])
    logits = engine.prefill(2, prompt[7:])
    np.testing.assert_allclose(logits, want[0, -1], atol=TOL, rtol=0)
    for i in range(DECODE_STEPS):
        token = int(np.argmax(logits))
        want, cache = reference_step(case.ref, [[token]], cache)
        logits = engine.decode([2], [token])[0]
        np.testing.assert_allclose(logits, want[0, -1], atol=TOL, rtol=0, err_msg=f"decode step {i}")
    assert engine.slot_length(2) == len(prompt) + DECODE_STEPS


def test_engine_greedy_tokens_match_transformers(
    case: Case, greedy_reference: Callable[..., tuple[list[int], list[np.ndarray]]]
) -> None:
    engine = load_engine(case.bundle, max_slots=2, threads=1)
    prompts = [_prompt(PROMPT_LEN, 2), _prompt(9, 3)]
    expected = [greedy_reference(case.ref, p, GREEDY)[0] for p in prompts]
    assert len(set(expected[0])) > 3, "reference output is degenerate; the test would prove little"
    # Alone, then both prompts together: slots of different lengths decode as one batch.
    assert generate(engine, prompts[0], GREEDY, eos_ids=()) == [expected[0]]
    assert generate(engine, prompts, GREEDY, eos_ids=()) == expected


def test_left_padded_batch_matches_transformers(
    case: Case,
    graph_runner: Any,
    greedy_reference: Callable[..., tuple[list[int], list[np.ndarray]]],
    reference_step: Callable[..., Any],
) -> None:
    runner = graph_runner(case.bundle / "model.onnx", _meta(case.bundle))
    ref = case.ref
    prompts = [_prompt(PROMPT_LEN, 4), _prompt(11, 5)]
    width = max(len(p) for p in prompts)
    ids = np.zeros((2, width), np.int64)
    mask = np.zeros((2, width), np.int64)
    for b, p in enumerate(prompts):
        ids[b, width - len(p) :] = p
        mask[b, width - len(p) :] = 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    logits, past = runner.run(ids, mask, positions, runner.empty_past(2))
    for b, p in enumerate(prompts):
        want = reference_step(ref, [p])[0][0]
        np.testing.assert_allclose(logits[b, width - len(p) :], want, atol=TOL, rtol=0)
    expected = [greedy_reference(ref, p, GREEDY) for p in prompts]
    tokens = np.argmax(logits[:, -1], axis=-1)
    got: list[list[int]] = [[int(tokens[0])], [int(tokens[1])]]
    lengths = [len(p) for p in prompts]
    for step in range(1, GREEDY):
        mask = np.concatenate([mask, np.ones((2, 1), np.int64)], axis=1)
        positions = np.array([[lengths[0] + step - 1], [lengths[1] + step - 1]])
        logits, past = runner.run(tokens[:, None], mask, positions, past, keep=1)
        for b in range(2):
            if step <= DECODE_STEPS:
                np.testing.assert_allclose(logits[b, -1], expected[b][1][step], atol=TOL, rtol=0)
        tokens = np.argmax(logits[:, -1], axis=-1)
        for b in range(2):
            got[b].append(int(tokens[b]))
    assert got == [expected[0][0], expected[1][0]]


@pytest.mark.parametrize("family", ["llama", "qwen3", "stablelm", "starcoder2", "nemotron", "olmo2"])
def test_decomposed_opset18_graph_matches_transformers(
    family: str,
    tmp_path: Path,
    hf_checkpoint: Callable[..., Path],
    reference: Callable[[Path], Any],
    graph_runner: Any,
    reference_step: Callable[..., Any],
) -> None:
    """The fallback graph for runtimes without the opset-23 ops computes the same thing."""
    ckpt = hf_checkpoint(family, "fp32", False)
    cfg = load_model_config(ckpt)
    io = build_decoder_graph(
        cfg, SafetensorsCheckpoint(ckpt), tmp_path / "model.onnx", max_positions=128, fused_ops=False
    )
    assert io.opset == 18
    meta = {"num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}
    runner = graph_runner(tmp_path / "model.onnx", meta)
    _check_single(runner, reference(ckpt), reference_step, _prompt(PROMPT_LEN, 6))
