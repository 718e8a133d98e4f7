"""The in-place KV engine: one weights file, batch 1 vs 8 mixed lengths, chunked vs whole
prefill, and the KV operations context reuse builds on, every family against transformers."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from inference.runtime import KVEngine, generate, load_engine
from tests.engine.conftest import FAMILIES
from tests.support.reference_engine import load_portable_engine

STEPS = 12


def _prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 384, size=n)]


def _checkpoint(hf_checkpoint: Callable[..., Path], family: str) -> Path:
    return hf_checkpoint(family, "fp32", FAMILIES.index(family) % 2 == 0)


@pytest.fixture(scope="module")
def bundle8(hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path]) -> Callable[[str], Path]:
    def make(family: str) -> Path:
        return built_bundle(_checkpoint(hf_checkpoint, family), max_batch_size=8)

    return make


@dataclass(frozen=True)
class Family:
    """One of FAMILIES: its batch-8 bundle and the transformers greedy tokens (STEPS) of a prompt."""

    bundle: Path
    greedy: Callable[[list[int]], list[int]]


@pytest.fixture(params=FAMILIES)
def family(
    request: pytest.FixtureRequest,
    bundle8: Callable[[str], Path],
    hf_checkpoint: Callable[..., Path],
    reference: Callable[[Path], Any],
    greedy_reference: Callable[..., tuple[list[int], list[np.ndarray]]],
) -> Family:
    ckpt = _checkpoint(hf_checkpoint, request.param)

    def greedy(prompt: list[int]) -> list[int]:
        return greedy_reference(reference(ckpt), prompt, STEPS)[0]

    return Family(bundle8(request.param), greedy)


def test_bundle_keeps_one_weights_file(
    hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path]
) -> None:
    bundle = built_bundle(hf_checkpoint("llama", "fp32", False))
    meta = json.loads((bundle / "engine.json").read_text())
    models = {p.name for p in bundle.iterdir() if p.name.startswith("model.")}
    assert models == {"model.onnx", "model.onnx.data", "model.ort.onnx"}
    cpu = onnx.load(str(bundle / "model.ort.onnx"), load_external_data=False)
    locations = {e.value for t in cpu.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"model.onnx.data"}
    assert any(n.op_type == "GroupQueryAttention" for n in cpu.graph.node)
    kv = meta["kv_cache"]
    assert kv["layout"] == "gqa-inplace" and kv["model"] == "model.ort.onnx"
    assert kv["buffer_shape"] == ["slots", 2, 256, 16]
    assert kv["bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    # The weights are stored once: the data file is about the size of the fp32 parameters.
    params = 384 * 64 * 2 + 2 * (4 * 64 * 16 * 2 + 2 * 64 * 16 * 2 + 3 * 64 * 128)
    assert (bundle / "model.onnx.data").stat().st_size < 1.3 * params * 4 + 64 * 4096


def test_batch_of_8_mixed_lengths_matches_batch_1_and_transformers(family: Family) -> None:
    engine = load_engine(family.bundle, threads=1)
    prompts = [_prompt(n, 10 + i) for i, n in enumerate((3, 40, 17, 1, 64, 9, 33, 120))]
    alone = [generate(engine, p, STEPS, eos_ids=())[0] for p in prompts]
    together = generate(engine, prompts, STEPS, eos_ids=())
    assert together == alone
    assert alone == [family.greedy(p) for p in prompts]


def test_chunked_prefill_matches_whole_prefill(family: Family) -> None:
    engine = load_engine(family.bundle, max_slots=4, threads=1)
    prompt = _prompt(150, 7)  # > max_input_len 64: the whole prefill is chunked by the engine too
    whole = engine.prefill(0, prompt)
    for slot, size in ((1, 1), (2, 13), (3, 64)):
        for start in range(0, len(prompt), size):
            logits = engine.prefill(slot, prompt[start : start + size])
        # Not bitwise: a 1-row chunk runs other MatMul kernels than a 150-row one.
        np.testing.assert_allclose(logits, whole, atol=1e-4, rtol=0, err_msg=f"chunks of {size}")
    tokens: list[list[int]] = [[int(np.argmax(whole))] for _ in range(4)]
    for _ in range(STEPS - 1):
        rows = engine.decode([0, 1, 2, 3], [t[-1] for t in tokens])
        for t, row in zip(tokens, rows, strict=True):
            t.append(int(np.argmax(row)))
    assert tokens == [family.greedy(prompt)] * 4


def test_kv_operations_resume_exactly(bundle8: Callable[[str], Path]) -> None:
    engine = load_engine(bundle8("qwen3"), threads=1)
    assert isinstance(engine, KVEngine)
    prompt = _prompt(90, 3)
    want = generate(engine, prompt, STEPS, eos_ids=())[0]

    def finish(slot: int, logits: np.ndarray) -> list[int]:
        tokens = [int(np.argmax(logits))]
        while len(tokens) < STEPS:
            tokens.append(int(np.argmax(engine.decode([slot], [tokens[-1]])[0])))
        return tokens

    # truncate: drop a wrong continuation, prefill the real one.
    engine.reset(1)
    engine.prefill(1, [*prompt[:50], 1, 2, 3])
    engine.truncate(1, 50)
    assert finish(1, engine.prefill(1, prompt[50:])) == want
    # copy_prefix: another slot starts from slot 1's first 64 positions.
    engine.reset(5)
    engine.copy_prefix(1, 5, 64)
    assert engine.slot_length(5) == 64
    assert finish(5, engine.prefill(5, prompt[64:])) == want
    # export / import: the prefix outlives the slot that computed it.
    saved = engine.export_kv(1, 0, 64)
    engine.reset(1)
    engine.reset(6)
    engine.import_kv(6, 0, saved[:, :, :32])
    engine.import_kv(6, 32, saved[:, :, 32:])
    assert finish(6, engine.prefill(6, prompt[64:])) == want
    with pytest.raises(ValueError):
        engine.truncate(6, engine.slot_length(6) + 1)
    with pytest.raises(ValueError):
        engine.export_kv(6, 0, engine.slot_length(6) + 1)
    engine.reset(0)
    with pytest.raises(ValueError):
        engine.import_kv(0, 5, saved)  # would leave a hole


def test_idle_slots_between_decoded_ones_keep_their_kv(bundle8: Callable[[str], Path]) -> None:
    """Decoding slots 0 and 3 runs 1 and 2 as passengers; what they hold must survive."""
    engine = load_engine(bundle8("llama"), threads=1)
    prompts = [_prompt(20 + i, 30 + i) for i in range(4)]
    want = generate(engine, prompts, STEPS, eos_ids=())
    for slot, p in enumerate(prompts):
        engine.reset(slot)
        engine.prefill(slot, p[:-1])
    engine.prefill(0, prompts[0][-1:])
    engine.prefill(3, prompts[3][-1:])
    tokens = {0: [want[0][0]], 3: [want[3][0]]}
    for _ in range(STEPS - 1):
        rows = engine.decode([0, 3], [tokens[0][-1], tokens[3][-1]])
        tokens[0].append(int(np.argmax(rows[0])))
        tokens[3].append(int(np.argmax(rows[1])))
    assert [tokens[0], tokens[3]] == [want[0], want[3]]
    assert (engine.slot_length(1), engine.slot_length(2)) == (20, 21)
    for slot in (1, 2):
        logits = engine.prefill(slot, prompts[slot][-1:])
        out = [int(np.argmax(logits))]
        while len(out) < STEPS:
            out.append(int(np.argmax(engine.decode([slot], [out[-1]])[0])))
        assert out == want[slot]


def test_inplace_engine_agrees_with_the_portable_graph(bundle8: Callable[[str], Path]) -> None:
    bundle = bundle8("mistral")
    prompt = _prompt(40, 5)
    inplace = generate(load_engine(bundle, max_slots=1, threads=1), prompt, STEPS, eos_ids=())
    assert generate(load_portable_engine(bundle, threads=1), prompt, STEPS, eos_ids=()) == inplace
