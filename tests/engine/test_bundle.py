"""Bundle contents, the portable graph's op domains, loading in a fresh process, runtime limits."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from inference.builder import BUILDER_VERSION, EngineBuildSpec, build_bundle
from inference.runtime import Engine, EngineLoadError, generate, load_engine
from inference.runtime.registry import memory_estimate

REPO = Path(__file__).resolve().parents[2]


def _meta(bundle: Path) -> dict[str, Any]:
    meta: dict[str, Any] = json.loads((bundle / "engine.json").read_text())
    return meta


def test_bundle_has_manifest_files_and_tokenizer(
    hf_checkpoint: Callable[..., Path], copy_dir: Callable[[Path], Path], tmp_path: Path
) -> None:
    ckpt = copy_dir(hf_checkpoint("qwen2", "fp32", True))
    (ckpt / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    (ckpt / "chat_template.jinja").write_text("{{ messages }}")
    out = tmp_path / "bundle"
    out.mkdir()
    stages: list[str] = []
    meta = build_bundle(
        ckpt,
        out,
        EngineBuildSpec(max_kv_cache_capacity=128, max_input_len=32),
        progress=lambda stage, fraction: stages.append(stage),
    )
    assert meta == _meta(out)
    assert stages[-1] == "done" and "optimize" in stages
    assert meta["builder_version"] == BUILDER_VERSION
    assert meta["onnxruntime_version"] == ort.__version__
    assert (meta["model_type"], meta["vocab_size"], meta["num_layers"]) == ("qwen2", 384, 2)
    assert (meta["num_kv_heads"], meta["head_dim"]) == (2, 16)
    assert meta["inputs"][:4] == ["input_ids", "attention_mask", "position_ids", "logits_to_keep"]
    assert meta["outputs"][0] == "logits" and "present.1.value" in meta["outputs"]
    for name in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (out / name).read_bytes() == (ckpt / name).read_bytes()
    assert {"model.onnx", "model.onnx.data", "model.ort.onnx"} <= set(meta["files"])
    for name, entry in meta["files"].items():
        data = (out / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    # The pool's memory estimate: the serving graph and the data file it shares with the portable
    # graph (not the portable proto), plus KV at full capacity for every slot.
    sizes = {name: entry["size"] for name, entry in meta["files"].items()}
    assert meta["weight_bytes"] == sizes["model.ort.onnx"] + sizes["model.onnx.data"]
    assert meta["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 kv heads, dim 16, fp32
    kv_bytes = meta["kv_bytes_per_token"] * 128 * meta["max_batch_size"]
    assert meta["memory_bytes"] == meta["weight_bytes"] + kv_bytes
    assert memory_estimate(out) == meta["memory_bytes"]


def test_portable_graph_uses_only_default_domain_ops(
    hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path]
) -> None:
    bundle = built_bundle(hf_checkpoint("qwen3", "fp32", False))
    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    domains = {(node.op_type, node.domain) for node in model.graph.node}
    assert domains, "empty graph"
    assert {d for _, d in domains} <= {"", "ai.onnx"}, sorted(domains)
    assert {imp.domain for imp in model.opset_import} <= {"", "ai.onnx"}


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_quantized_bundles_hold_the_cpu_graph_only(
    precision: str, hf_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    # MatMulNBits is an onnxruntime (com.microsoft) op: no portable graph a TensorRT could read.
    spec = EngineBuildSpec(precision=precision, max_kv_cache_capacity=256, max_input_len=64)
    meta = build_bundle(hf_checkpoint("qwen3", "fp32", False), tmp_path, spec, min_agreement=0.0)
    assert meta["portable_model"] is None and not (tmp_path / "model.onnx").exists()
    graph = onnx.load(str(tmp_path / "model.ort.onnx"), load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    assert "MatMulNBits" in ops and "MatMulInteger" not in ops


def test_bundle_runs_the_same_in_a_fresh_process(
    hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path]
) -> None:
    bundle = built_bundle(hf_checkpoint("llama", "bf16", False))
    prompt = [5, 17, 300, 42, 7, 99, 250, 3]
    here = generate(load_engine(bundle, threads=1), prompt, 24, eos_ids=())[0]
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from inference.runtime import generate, load_engine\n"
        "engine = load_engine(Path(sys.argv[1]))\n"
        "print(json.dumps(generate(engine, json.loads(sys.argv[2]), 24, eos_ids=())[0]))\n"
    )
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(bundle), json.dumps(prompt)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == here
    assert len(set(here)) > 3


def test_engine_protocol_slots_and_capacity(
    hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path]
) -> None:
    bundle = built_bundle(
        hf_checkpoint("mistral", "fp32", False), max_kv_cache_capacity=40, max_input_len=16, max_batch_size=2
    )
    engine = load_engine(bundle, threads=1)
    assert isinstance(engine, Engine)
    info = engine.info
    assert (info.max_slots, info.max_kv_capacity, info.max_input_len, info.vocab_size) == (2, 40, 16, 384)
    prompt = list(range(1, 31))
    # 30 tokens with max_input_len 16: prefilled in two chunks, same result as position-by-position.
    chunked = engine.prefill(0, prompt)
    assert engine.slot_length(0) == 30
    engine.prefill(1, prompt[:10])
    for tok in prompt[10:29]:
        engine.decode([1], [tok])
    stepwise = engine.decode([1], [prompt[29]])[0]
    np.testing.assert_allclose(chunked, stepwise, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="max_kv_capacity 40"):
        engine.prefill(0, list(range(11)))
    assert engine.slot_length(0) == 30  # a refused prefill leaves the slot as it was
    for _ in range(10):
        engine.decode([0], [1])
    with pytest.raises(ValueError, match="full"):
        engine.decode([0], [1])
    with pytest.raises(ValueError, match="out of range"):
        engine.prefill(2, [1])
    with pytest.raises(ValueError, match=r"\[0, 384\)"):
        engine.prefill(1, [384])
    engine.reset(0)
    assert engine.slot_length(0) == 0
    with pytest.raises(ValueError, match="empty"):
        engine.decode([0], [1])
    engine.close()


def test_sampling_is_seeded(hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path]) -> None:
    engine = load_engine(built_bundle(hf_checkpoint("qwen2", "fp32", True)), threads=1)
    kwargs: dict[str, Any] = {"temperature": 1.0, "top_k": 50, "top_p": 0.9, "eos_ids": ()}
    first = generate(engine, [1, 2, 3], 16, seed=7, **kwargs)
    assert generate(engine, [1, 2, 3], 16, seed=7, **kwargs) == first
    assert generate(engine, [1, 2, 3], 16, seed=8, **kwargs) != first


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("onnxruntime_version", "0.9.0", "built with onnxruntime 0.9.0"),
        ("format_version", 99, "format_version 99"),
    ],
)
def test_load_refuses_foreign_bundles(
    field: str,
    value: object,
    message: str,
    hf_checkpoint: Callable[..., Path],
    built_bundle: Callable[..., Path],
    copy_dir: Callable[[Path], Path],
) -> None:
    bundle = copy_dir(built_bundle(hf_checkpoint("qwen2", "fp32", True)))
    meta = _meta(bundle)
    meta[field] = value
    (bundle / "engine.json").write_text(json.dumps(meta))
    with pytest.raises(EngineLoadError, match=message):
        load_engine(bundle)


def test_load_refuses_a_directory_without_engine_json(tmp_path: Path) -> None:
    with pytest.raises(EngineLoadError, match=r"engine\.json is missing"):
        load_engine(tmp_path)


def test_generate_draws_like_the_server(
    hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path]
) -> None:
    """``generate(seed=…)`` and a server request with the same seed draw the same tokens: the
    server's scheduler feeds each step's logits to one ``Sampler`` per request."""
    from inference.serving.sampling import Sampler, SamplingParams

    engine = load_engine(built_bundle(hf_checkpoint("qwen2", "fp32", True)), threads=1)
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=11)
    sampler = Sampler(params, engine.info.vocab_size)
    engine.reset(0)
    served = [sampler.sample(engine.prefill(0, [1, 2, 3])).token_id]
    while len(served) < 16:
        served.append(sampler.sample(engine.decode([0], [served[-1]])[0]).token_id)
    got = generate(engine, [1, 2, 3], 16, temperature=1.0, top_k=50, top_p=0.9, seed=11, eos_ids=())
    assert got == [served]
