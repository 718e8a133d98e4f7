"""Quantized graphs per CPU class: what the builder writes for each class, what this machine's
class answers, the quality gate, and refusal of a bundle built for another class."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

from inference.builder import EngineBuildSpec, build_bundle
from inference.builder.checkpoint_reader import open_checkpoint
from inference.builder.graph import build_decoder_graph
from inference.builder.kernel_plan import FAST_HEAD_CLASSES, PLANE_HEAD_CLASSES, kernel_plan
from inference.builder.model_config import load_model_config
from inference.builder.ort_backend import fused_ops_supported
from inference.builder.quality import MIN_AGREEMENT, QualityGateError
from inference.cpu_class import CPU_CLASSES, classify_flags, cpu_class
from inference.runtime import generate, load_engine
from inference.runtime.errors import EngineLoadError
from inference.runtime.ort_session import cpu_session

AVX2 = ["sse4_2", "avx", "avx2", "fma", "f16c"]
AVX512 = [*AVX2, "avx512f", "avx512bw", "avx512vl", "avx512dq"]


def test_this_machine_has_a_known_cpu_class() -> None:
    print(f"CPU class of this machine: {cpu_class()}")  # answers of quantized bundles depend on it
    assert cpu_class() in CPU_CLASSES


@pytest.mark.parametrize(
    ("flags", "machine", "expected"),
    [
        (["sse4_2", "avx"], "x86_64", "generic"),
        (AVX2, "x86_64", "avx2"),
        ([*AVX2, "avx_vnni"], "x86_64", "avx2-vnni"),
        (AVX512, "x86_64", "avx512"),
        ([*AVX512, "avx512_vnni"], "x86_64", "avx512-vnni"),
        ([*AVX512, "avx512_vnni", "amx_tile", "amx_int8", "amx_bf16"], "x86_64", "amx"),
        (["fp", "asimd", "asimddp"], "aarch64", "arm64"),
    ],
)
def test_cpu_classes_from_flags(flags: list[str], machine: str, expected: str) -> None:
    assert classify_flags(flags, machine) == expected


def _graph(bundle: Path) -> onnx.GraphProto:
    return onnx.load(str(bundle / "model.ort.onnx"), load_external_data=False).graph


def _attr(node: onnx.NodeProto, name: str) -> int:
    return next(a.i for a in node.attribute if a.name == name)


@pytest.mark.parametrize("precision", ["int4", "int8"])
@pytest.mark.parametrize("cls", CPU_CLASSES)
def test_the_graph_written_for_each_cpu_class(
    hf_checkpoint: Callable[..., Path], tmp_path: Path, precision: str, cls: str
) -> None:
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    # What is written, not how well random weights survive 4 bits: no gate threshold here, and the
    # exact plan (at auto the gate may publish twoterm where it measures it faster, tests/engine/
    # test_two_term.py).
    spec = EngineBuildSpec(precision=precision, cpu_class=cls, max_kv_cache_capacity=256, max_input_len=64,
                           kernels="exact")
    build_bundle(hf_checkpoint("llama", "fp32", True), bundle, spec, min_agreement=0.0)
    graph = _graph(bundle)
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    inits = {t.name for t in graph.initializer}
    # Every linear layer computes in float32 on every class (level 4 flips near-ties).
    layers = [n for n in nbits if "logits" not in n.output and n.input[0] != "model.norm"]
    assert layers and all(_attr(n, "accuracy_level") == 0 for n in layers if _attr(n, "N") != 384)
    # One 8-bit table serves the tied embedding and the lm_head: no float copy of either.
    assert "model.embed_tokens.weight" not in inits and "lm_head.weight" not in inits
    head = [n for n in nbits if _attr(n, "N") == 384]  # the vocabulary
    ops = {n.op_type for n in graph.node}
    planes = {"model.embed_tokens.hi.q4", "model.embed_tokens.lo.q4"}
    if cls in FAST_HEAD_CLASSES:  # int8 activations on 8-bit codes (VNNI/AMX), top-k recomputed
        assert [(_attr(n, "bits"), _attr(n, "accuracy_level")) for n in head] == [(8, 4)]
        assert head[0].input[1] == "model.embed_tokens.q8"
        assert {"TopK", "ScatterElements"} <= ops
    elif cls in PLANE_HEAD_CLASSES:  # int8 activations on 4-bit planes (AVX2), top-k recomputed
        assert sorted((_attr(n, "bits"), _attr(n, "accuracy_level")) for n in head) == [(4, 4), (4, 4)]
        assert {n.input[1] for n in head} == planes
        assert {"TopK", "ScatterElements"} <= ops
    else:  # exact: two 4-bit planes in float32
        assert sorted((_attr(n, "bits"), _attr(n, "accuracy_level")) for n in head) == [(4, 0), (4, 0)]
        assert {n.input[1] for n in head} == planes
        assert "TopK" not in ops
    meta = json.loads((bundle / "engine.json").read_text())
    assert meta["kernels"] == kernel_plan(precision, cls).record()
    assert meta["portable_model"] is None and not (bundle / "model.onnx").exists()
    if cls == cpu_class():
        engine = load_engine(bundle, threads=1)
        engine.close()
    else:  # built for another class: never run here
        with pytest.raises(EngineLoadError, match=f"built for CPU class {cls} but this CPU is {cpu_class()}"):
            load_engine(bundle, threads=1)


def test_this_machines_class_answers_like_fp32(
    hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path]
) -> None:
    # int8 of random weights (int4 of random weights fails the gate, as it should:
    # tests/gguf/test_written.py; 4-bit GGUF blocks are exact: tests/gguf/test_real_model.py).
    precision = "int8"
    checkpoint = hf_checkpoint("qwen2", "fp32", True)
    bundle = built_bundle(checkpoint, precision=precision)
    quality = json.loads((bundle / "engine.json").read_text())["quality"]
    print(f"{precision} on {cpu_class()}: {quality}")
    assert quality["cpu_class"] == cpu_class() and quality["reference"] == "fp32"
    assert quality["prompts"] == 8 and quality["tokens"] == 8 * 32
    assert quality["greedy_agreement"] >= MIN_AGREEMENT
    fp32 = load_engine(built_bundle(checkpoint), threads=1)
    quant = load_engine(bundle, threads=1)
    try:
        prompt = [int(t) for t in np.random.default_rng(7).integers(0, 384, size=20)]
        expected = generate(fp32, prompt, 12, eos_ids=())[0]
        # Teacher-forced: the quantized engine's choice at every step of fp32's greedy path.
        got = [int(quant.prefill(0, prompt).argmax())]
        got += [int(quant.decode([0], [t])[0].argmax()) for t in expected[:-1]]
        agree = sum(a == b for a, b in zip(got, expected, strict=True))
        assert agree >= 11, (got, expected)
    finally:
        fp32.close()
        quant.close()


def test_a_bad_kernel_choice_fails_the_gate_with_one_line(
    hf_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    # int8 activations in every layer (accuracy level 4) cannot reproduce fp32 exactly; asking
    # for exact agreement makes the gate refuse the build.
    out = tmp_path / "bundle"
    out.mkdir()
    forced = kernel_plan("int4", cpu_class(), accuracy_level=4)
    with pytest.raises(QualityGateError) as info:
        build_bundle(hf_checkpoint("llama", "fp32", True), out, EngineBuildSpec(precision="int4"),
                     kernels_override=forced, min_agreement=1.0)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"the int4 build failed the quality gate on this CPU ({cpu_class()}): ")
    assert "greedy agreement with fp32 0." in message and "build --precision int8 or fp32 instead" in message
    assert not (out / "engine.json").exists()


def test_the_gates_reference_reads_its_weights_from_memory(
    hf_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """The gate's fp32 reference is built with its weights kept in memory (no data file written):
    a session over them answers exactly as one over the same graph written to disk."""
    ckpt_dir = hf_checkpoint("llama", "fp32", False)
    cfg, ckpt = load_model_config(ckpt_dir), open_checkpoint(ckpt_dir)
    on_disk, in_memory = tmp_path / "disk.onnx", tmp_path / "memory.onnx"
    weights: dict[str, np.ndarray] = {}
    for path, sink in ((on_disk, None), (in_memory, weights)):
        build_decoder_graph(cfg, ckpt, path, max_positions=64, fused_ops=fused_ops_supported(),
                            kv_layout="gqa", weights_in=sink)
    assert weights and (tmp_path / "memory.onnx.data").stat().st_size == 0
    assert (tmp_path / "disk.onnx.data").stat().st_size >= sum(a.nbytes for a in weights.values())
    feeds: dict[str, np.ndarray] = {
        "input_ids": np.array([[5, 9, 13, 2]], np.int64), "seqlens_k": np.array([3], np.int32),
        "total_sequence_length": np.array(4, np.int32), "logits_to_keep": np.array([4], np.int64)}
    outputs = []
    for path, sink in ((on_disk, None), (in_memory, weights)):
        session = cpu_session(path, threads=1, optimized=False, initializers=sink)
        for arg in session.get_inputs():
            if arg.name.startswith("past_key_values"):
                feeds[arg.name] = np.zeros((1, cfg.num_kv_heads, 64, cfg.head_dim), np.float32)
        outputs.append(session.run(["logits"], feeds)[0])
    assert np.array_equal(outputs[0], outputs[1])
