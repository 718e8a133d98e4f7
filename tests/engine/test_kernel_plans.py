"""The quality gate chooses the quantized layers' kernel plan (docs/quantization.md, issue 35).

Plans go from fastest (int8 activations in every projection) to exact (float32 compute); the
builder writes the graph once and the gate retargets its ``MatMulNBits`` accuracy levels per plan,
measures each against fp32 and publishes the first that passes: ``auto`` asks a faster plan for
fp32's free-running answers as well as the agreement floor, ``fast`` the floor alone, ``exact``
tries the exact plan only. fp32's answers are kept per checkpoint for the next build.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

from inference.builder import EngineBuildSpec, build_bundle
from inference.builder.errors import BuildInputError
from inference.builder.kernel_plan import (
    INT8_ACTIVATION_CLASSES,
    PLAN_GROUPS,
    PROJECTION_GROUPS,
    candidate_plans,
    kernel_plan,
    retarget,
)
from inference.cpu_class import CPU_CLASSES, cpu_class
from tests.support.gate_rule import check_gate_choice


def _layer_levels(model: onnx.ModelProto) -> dict[str, set[int]]:
    """Accuracy levels of the layers' MatMulNBits, by projection group."""
    levels: dict[str, set[int]] = {group: set() for group in PROJECTION_GROUPS}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or ".layers." not in node.input[1]:
            continue
        group = next(g for g, part in PROJECTION_GROUPS.items() if f".{part}" in node.input[1])
        levels[group].add(next(a.i for a in node.attribute if a.name == "accuracy_level"))
    return levels


def _build(checkpoint: Path, out: Path, precision: str, kernels: str = "auto",
           reference_file: Path | None = None) -> dict:
    out.mkdir(parents=True)
    return build_bundle(checkpoint, out, EngineBuildSpec(precision=precision, kernels=kernels),
                        reference_file=reference_file)


@pytest.mark.parametrize("cls", CPU_CLASSES)
def test_candidate_plans_go_from_fastest_to_exact(cls: str) -> None:
    plans = candidate_plans("int4", cls)
    assert plans[-1] == kernel_plan("int4", cls) and plans[-1].name == "exact"
    if cls in INT8_ACTIVATION_CLASSES:
        assert [p.name for p in plans] == list(PLAN_GROUPS)
        sizes = [len(p.int8_groups) for p in plans if not p.two_term]
        assert sizes == sorted(sizes, reverse=True) and sizes[-1] == 0
        # the two-term plan: every group at level 4, the activations' rounding taken back
        (two,) = [p for p in plans if p.two_term]
        assert two.name == "twoterm" and two.int8_groups == tuple(PROJECTION_GROUPS)
    else:  # no int8 kernels that cannot saturate: float32 only
        assert [p.name for p in plans] == ["exact"]
    assert [p.name for p in candidate_plans("int8", cls, "exact")] == ["exact"]
    with pytest.raises(ValueError, match="kernels must be one of auto, exact, fast"):
        candidate_plans("int4", cls, "fastest")


def test_a_bad_kernels_mode_is_refused_in_the_spec() -> None:
    with pytest.raises(BuildInputError, match="kernels must be one of auto, exact, fast, got 'turbo'"):
        EngineBuildSpec(precision="int4", kernels="turbo")


def test_retarget_sets_each_groups_level_and_leaves_the_head(
    hf_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    meta = _build(hf_checkpoint("qwen2", "fp32", True), tmp_path / "b", "int8", kernels="exact")
    model = onnx.load(str(tmp_path / "b" / meta["optimized_model"]), load_external_data=False)
    assert _layer_levels(model) == {group: {0} for group in PROJECTION_GROUPS}
    head = [n for n in model.graph.node if n.op_type == "MatMulNBits" and ".layers." not in n.input[1]]
    head_levels = [next(a.i for a in n.attribute if a.name == "accuracy_level") for n in head]
    layers = [n for n in model.graph.node if n.op_type == "MatMulNBits" and ".layers." in n.input[1]]
    for plan in candidate_plans("int8", "avx2"):
        groups = [f".{PROJECTION_GROUPS[g]}" for g in plan.int8_groups]
        assert retarget(model, plan) == sum(any(g in n.input[1] for g in groups) for n in layers)
        assert _layer_levels(model) == {g: {4 if g in plan.int8_groups else 0} for g in PROJECTION_GROUPS}
        assert [next(a.i for a in n.attribute if a.name == "accuracy_level") for n in head] == head_levels


@pytest.mark.parametrize("mode", ["auto", "fast"])
def test_the_gate_publishes_the_first_plan_that_passes(
    hf_checkpoint: Callable[..., Path], tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    # int8 of random weights passes the floor (int4 of random weights does not, as it should)
    caplog.set_level(logging.INFO, logger="inference.builder.quality")
    meta = _build(hf_checkpoint("qwen2", "fp32", True), tmp_path / "b", "int8", kernels=mode)
    chosen = check_gate_choice(meta)
    print(f"int8 --kernels {mode} on {cpu_class()}: {json.dumps(meta['quality']['candidates'])}")
    assert meta["quality"]["kernels_mode"] == mode
    # The published graph runs the chosen plan.
    model = onnx.load(str(tmp_path / "b" / meta["optimized_model"]), load_external_data=False)
    assert _layer_levels(model) == {g: {4 if g in chosen["int8_groups"] else 0} for g in PROJECTION_GROUPS}
    bits = {next(a.i for a in n.attribute if a.name == "bits") for n in model.graph.node
            if n.op_type == "MatMulNBits" and ".layers." in n.input[1]}
    # int8 layers at level 4 are published as 8-bit codes, the rest as two 4-bit planes
    assert bits == {8 if g in chosen["int8_groups"] else 4 for g in PROJECTION_GROUPS}
    said = [r.getMessage() for r in caplog.records if "--kernels fast" in r.getMessage()]
    if mode == "fast" and chosen["plan"] != "exact":
        assert len(said) == 1 and f"plan '{chosen['plan']}'" in said[0]
    else:
        assert said == []
    if mode == "fast":  # the floor alone: the first candidate above it
        first = next(c for c in meta["quality"]["candidates"] if c["greedy_agreement"] >= 0.9)
        assert first["plan"] == chosen["plan"]


def test_exact_tries_the_exact_plan_only(hf_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    meta = _build(hf_checkpoint("qwen2", "fp32", True), tmp_path / "b", "int8", kernels="exact")
    assert [c["plan"] for c in meta["quality"]["candidates"]] == ["exact"]
    assert meta["kernels"] == kernel_plan("int8", cpu_class()).record()
    check_gate_choice(meta)


def test_fp32_answers_are_kept_per_checkpoint_and_a_damaged_file_is_recomputed(
    hf_checkpoint: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    checkpoint, kept = hf_checkpoint("qwen2", "fp32", True), tmp_path / "refs" / "ckpt.npz"
    first = _build(checkpoint, tmp_path / "a", "int8", kernels="exact", reference_file=kept)
    assert kept.is_file() and first["quality"]["reference_cached"] is False
    second = _build(checkpoint, tmp_path / "b", "int8", kernels="exact", reference_file=kept)
    assert second["quality"]["reference_cached"] is True
    for key in ("greedy_agreement", "min_logit_cosine", "identical"):
        assert second["quality"][key] == first["quality"][key]
    with np.load(kept) as data:
        assert data["logits"].dtype == np.float16 and data["tokens"].shape == (8, 32)
    kept.write_bytes(b"not an npz")
    caplog.set_level(logging.WARNING, logger="inference.builder.quality")
    third = _build(checkpoint, tmp_path / "c", "int8", kernels="exact", reference_file=kept)
    assert third["quality"]["reference_cached"] is False
    assert third["quality"]["greedy_agreement"] == first["quality"]["greedy_agreement"]
    assert any("ignoring the gate's fp32 reference" in r.getMessage() for r in caplog.records)
    with np.load(kept) as data:  # written again
        assert data["tokens"].shape == (8, 32)
