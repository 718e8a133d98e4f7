"""Mixture-of-experts bundles beyond the parity cases: quantized builds (experts kept fp32), LoRA
of the attention (and the experts' refused), refused variants, transformers' fused 3-D experts."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

from inference.builder import EngineBuildSpec, build_bundle
from inference.builder.errors import BuildInputError
from inference.builder.kernel_plan import candidate_plans
from inference.builder.lora import LoraAdapterError, convert_peft_adapter
from inference.builder.model_config import load_model_config, model_config_from
from inference.cpu_class import cpu_class
from inference.runtime import load_engine
from tests.engine.conftest import make_hf_model
from tests.engine.test_lora import assert_greedy_matches, engine_of, greedy
from tests.support.adapters import write_adapter

MOE = ["mixtral", "qwen2_moe", "qwen3_moe"]
PROMPT = [5, 17, 99, 3, 250, 42, 7, 8, 300, 11]


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("family", MOE)
def test_quantized_builds_run_with_fp32_experts(family: str, precision: str,
                                                hf_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    """The build does not crash on the experts (the gate may refuse random tiny weights, so one
    plan is forced); engine.json says the experts stay fp32, and the graph holds them so."""
    checkpoint = hf_checkpoint(family)
    cfg = load_model_config(checkpoint)
    assert cfg.moe is not None
    plan = candidate_plans(precision, cpu_class())[-1]
    meta = build_bundle(checkpoint, tmp_path, EngineBuildSpec(precision=precision, max_kv_cache_capacity=128,
                                                              max_input_len=32), kernels_override=plan,
                       min_agreement=0.0)
    assert meta["moe"]["experts_precision"] == "fp32"
    assert meta["moe"]["sparse_layers"] == list(cfg.moe.sparse_layers)
    model = onnx.load(str(tmp_path / meta["optimized_model"]), load_external_data=False)
    moes = [n for n in model.graph.node if n.op_type == "MoE"]
    assert len(moes) == len(cfg.moe.sparse_layers)
    types = {t.name: t.data_type for t in model.graph.initializer}
    assert all(types[n.input[2]] == onnx.TensorProto.FLOAT for n in moes)
    assert any(n.op_type == "MatMulNBits" for n in model.graph.node)  # the rest is quantized
    engine = load_engine(tmp_path, threads=1)
    try:
        assert np.isfinite(engine.prefill(0, PROMPT)).all()
    finally:
        engine.close()


def test_attention_lora_matches_peft_and_expert_lora_is_refused(
    hf_checkpoint: Callable[..., Path], built_bundle: Callable[..., Path], tmp_path: Path
) -> None:
    checkpoint = hf_checkpoint("qwen2_moe")
    cfg = load_model_config(checkpoint)
    adapter = write_adapter(checkpoint, tmp_path / "attn", seed=1, targets=["q_proj", "v_proj", "o_proj"])
    info = convert_peft_adapter(adapter, cfg, tmp_path / "a.onnx_adapter")
    assert info.targets == ("o_proj", "q_proj", "v_proj")
    engine = engine_of(built_bundle(checkpoint, lora=True))
    try:
        base = greedy(engine, 0, PROMPT, 12)
        engine.load_adapter("a", tmp_path / "a.onnx_adapter")
        engine.set_adapter(1, "a")
        tuned = greedy(engine, 1, PROMPT, 12)
    finally:
        engine.close()
    assert_greedy_matches(checkpoint, None, PROMPT, base)
    assert_greedy_matches(checkpoint, adapter, PROMPT, tuned)
    assert tuned != base
    # The shared expert's gate_proj (a module outside the layer's projections) is refused too.
    shared = write_adapter(checkpoint, tmp_path / "shared", seed=2, targets=["q_proj", "gate_proj"])
    with pytest.raises(LoraAdapterError, match=r"module mlp.shared_expert.gate_proj is not one of .*experts"):
        convert_peft_adapter(shared, cfg, tmp_path / "b.onnx_adapter")
    # qwen3_moe's dense layer 0 has an mlp.gate_proj: a projection, but not a target of the family
    # (peft refuses to make one on this model, so its tensors are added to an attention adapter).
    from safetensors.numpy import load_file, save_file

    dense = hf_checkpoint("qwen3_moe")
    mlp = write_adapter(dense, tmp_path / "mlp", seed=2, targets=["q_proj"])
    tensors = load_file(str(mlp / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.0.mlp.gate_proj"
    tensors[f"{prefix}.lora_A.weight"] = np.ones((4, 64), np.float32)
    tensors[f"{prefix}.lora_B.weight"] = np.ones((128, 4), np.float32)
    save_file(tensors, str(mlp / "adapter_model.safetensors"))
    with pytest.raises(LoraAdapterError, match=r"module mlp.gate_proj is not one of self_attn.q_proj, "
                                               r"self_attn.k_proj, self_attn.v_proj, self_attn.o_proj "
                                               r"\(the qwen3_moe family's LoRA targets; LoRA of the "
                                               r"experts is not supported\)"):
        convert_peft_adapter(mlp, load_model_config(dense), tmp_path / "c.onnx_adapter")


def _config(family: str, checkpoint: Callable[..., Path]) -> dict[str, object]:
    raw: dict[str, object] = json.loads((checkpoint(family) / "config.json").read_text())
    return raw


@pytest.mark.parametrize(("family", "change", "field"), [
    ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ("qwen2_moe", {"moe_intermediate_size": None}, "moe_intermediate_size"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts"),
    ("qwen2_moe", {"mlp_bias": True}, "mlp_bias"),
])
def test_unsupported_variants_are_refused_in_one_line(family: str, change: dict[str, object], field: str,
                                                      hf_checkpoint: Callable[..., Path]) -> None:
    raw = {**_config(family, hf_checkpoint), **change}
    with pytest.raises(BuildInputError, match=field) as info:
        model_config_from(raw)
    assert "\n" not in str(info.value)


def test_transformers_fused_experts_read_as_the_per_expert_ones(hf_checkpoint: Callable[..., Path],
                                                                built_bundle: Callable[..., Path],
                                                                tmp_path: Path) -> None:
    """A checkpoint of transformers' in-memory layout (3-D ``mlp.experts.gate_up_proj``) builds the
    same engine as save_pretrained's per-expert tensors."""
    from safetensors.torch import save_file

    checkpoint = hf_checkpoint("qwen3_moe")
    fused = tmp_path / "fused"
    fused.mkdir()
    for name in ("config.json", "generation_config.json"):
        if (checkpoint / name).is_file():
            shutil.copy(checkpoint / name, fused / name)
    state = {k: v.contiguous() for k, v in make_hf_model("qwen3_moe", False).state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(fused / "model.safetensors"))
    a, b = load_engine(built_bundle(fused), threads=1), load_engine(built_bundle(checkpoint), threads=1)
    try:
        np.testing.assert_allclose(a.prefill(0, PROMPT), b.prefill(0, PROMPT), atol=1e-5, rtol=0)
    finally:
        a.close()
        b.close()
