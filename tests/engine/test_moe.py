"""Mixture-of-experts bundles beyond the parity cases: quantized builds (int4 experts in QMoE, int8's
kept fp32), LoRA
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


def _dequantize_4bit(codes: np.ndarray, scales: np.ndarray, zps: np.ndarray) -> np.ndarray:
    """QMoE's 4-bit experts as float: ``codes`` [E, N, K/2] (low nibble first), ``scales`` [E, N,
    K/32], ``zps`` [E, N, ceil(K/64)] (two a byte) -> [E, N, K]."""
    e_count, n, half = codes.shape
    q = np.empty((e_count, n, half * 2), np.float32)
    q[..., 0::2], q[..., 1::2] = codes & 0x0F, codes >> 4
    kb = scales.shape[-1]
    z = np.empty((e_count, n, zps.shape[-1] * 2), np.float32)
    z[..., 0::2], z[..., 1::2] = zps & 0x0F, zps >> 4
    blocks = q.reshape(e_count, n, kb, 32) - z[..., :kb, None]
    return (blocks * scales[..., None]).reshape(e_count, n, kb * 32)


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("family", MOE)
def test_quantized_builds_hold_int4_experts_in_qmoe_and_int8_keeps_them_fp32(
    family: str, precision: str, hf_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    """The build does not crash on the experts (the gate may refuse random tiny weights, so one
    plan is forced); int4 experts are 4-bit ``QMoE`` (gate and up rows interleaved), whose
    dequantized weights are the checkpoint's within half a quantization step; int8 experts stay
    fp32 ``MoE`` (onnxruntime's 8-bit QMoE has no float path); engine.json says which."""
    checkpoint = hf_checkpoint(family)
    cfg = load_model_config(checkpoint)
    assert cfg.moe is not None
    plan = candidate_plans(precision, cpu_class())[-1]
    meta = build_bundle(checkpoint, tmp_path, EngineBuildSpec(precision=precision, max_kv_cache_capacity=128,
                                                              max_input_len=32), kernels_override=plan,
                       min_agreement=0.0)
    assert meta["moe"]["experts_precision"] == ("int4" if precision == "int4" else "fp32")
    assert meta["moe"]["sparse_layers"] == list(cfg.moe.sparse_layers)
    model = onnx.load(str(tmp_path / meta["optimized_model"]))
    op = "QMoE" if precision == "int4" else "MoE"
    moes = [n for n in model.graph.node if n.op_type == op]
    assert len(moes) == len(cfg.moe.sparse_layers)
    assert not [n for n in model.graph.node if n.op_type == ("MoE" if op == "QMoE" else "QMoE")]
    inits = {t.name: t for t in model.graph.initializer}
    assert any(n.op_type == "MatMulNBits" for n in model.graph.node)  # the rest is quantized
    if precision == "int8":
        assert all(inits[n.input[2]].data_type == onnx.TensorProto.FLOAT for n in moes)
    else:
        reference = make_hf_model(family, False)
        layer = cfg.moe.sparse_layers[0]
        node = next(n for n in moes if f"layers.{layer}." in n.input[2])
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["expert_weight_bits"], attrs["block_size"], attrs["swiglu_fusion"]) == (4, 32, 1)
        assert attrs["accuracy_level"] == 0  # the exact plan: float32 activations

        def array(name: str) -> np.ndarray:
            return onnx.numpy_helper.to_array(inits[name])

        fc1 = _dequantize_4bit(array(node.input[2]), array(node.input[3]), array(node.input[11]))
        fc2 = _dequantize_4bit(array(node.input[5]), array(node.input[6]), array(node.input[12]))
        state = {k: v.detach().float().numpy() for k, v in reference.state_dict().items()}
        experts = f"model.layers.{layer}.mlp.experts"
        if f"{experts}.gate_up_proj" in state:
            gate_up, down = state[f"{experts}.gate_up_proj"], state[f"{experts}.down_proj"]
            ff = cfg.moe.expert_size
            gate, up = gate_up[:, :ff], gate_up[:, ff:]
        else:
            raise AssertionError(f"transformers' experts are not fused here: {sorted(state)[:5]}")
        want_fc1 = np.stack([gate, up], axis=2).reshape(fc1.shape)
        for got, want, scales in ((fc1, want_fc1, array(node.input[3])), (fc2, down, array(node.input[6]))):
            step = np.repeat(scales, 32, axis=-1)
            assert np.all(np.abs(got - want) <= step / 2 + 1e-6)
    engine = load_engine(tmp_path, threads=1)
    try:
        assert np.isfinite(engine.prefill(0, PROMPT)).all()
    finally:
        engine.close()


@pytest.mark.parametrize("normalize", [True, False])
def test_qmoe_at_level_0_computes_moe_of_the_dequantized_experts_exactly(
    tmp_path: Path, normalize: bool
) -> None:
    """What the emitter writes for int4 experts (interleaved gate/up rows, zero points two a
    byte; for un-normalised routing, onnxruntime's always-renormalised QMoE times the top-k's
    share of the softmax) gives the float32 ``MoE`` result over the same dequantized weights at
    accuracy level 0; level 4 (the fast plan's int8 activations) does not."""
    import onnxruntime as ort

    from inference.builder.emit import Emitter, ExternalWeights
    from inference.builder.kernel_plan import retarget
    from inference.builder.quantized import GgufBlocks, QuantizedEmitter, interleave_rows, quantize_4bit

    rng = np.random.default_rng(0)
    e_count, ff, h, tokens = 4, 64, 128, 5
    gate, up = (rng.normal(size=(e_count, ff, h)).astype(np.float32) * 0.1 for _ in range(2))
    down = rng.normal(size=(e_count, h, ff)).astype(np.float32) * 0.1
    fc1 = [interleave_rows(quantize_4bit(gate[e]), quantize_4bit(up[e])) for e in range(e_count)]
    fc2 = [quantize_4bit(down[e]) for e in range(e_count)]

    def dequantized(ws: list, n: int) -> np.ndarray:
        kb = ws[0].codes.shape[1]
        return _dequantize_4bit(np.stack([w.codes.reshape(n, -1) for w in ws]),
                                np.stack([w.scales.reshape(n, kb) for w in ws]),
                                np.stack([w.zero_points.reshape(n, -1) for w in ws]))

    d1, d2 = dequantized(fc1, 2 * ff), dequantized(fc2, h)
    assert np.abs(d1[:, 0::2] - gate).max() < 0.05 and np.abs(d1[:, 1::2] - up).max() < 0.05
    weights = ExternalWeights(tmp_path / "m.onnx.data")
    em = Emitter(weights)
    quant = QuantizedEmitter(em, candidate_plans("int4", cpu_class())[-1], GgufBlocks(None))
    y = quant.moe("x", "r", "experts", fc1, fc2, top_k=2, normalize=normalize)
    weights.close()
    em.nodes.append(onnx.helper.make_node(
        "MoE", ["x", "r", "d1", "", "d2"], ["ref"], domain="com.microsoft", k=2, activation_type="swiglu",
        swiglu_fusion=1, normalize_routing_weights=int(normalize)))
    graph = onnx.helper.make_graph(
        em.nodes, "qmoe",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, tokens, h]),
         onnx.helper.make_tensor_value_info("r", onnx.TensorProto.FLOAT, [tokens, e_count])],
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in (y, "ref")],
        [*em.initializers, onnx.numpy_helper.from_array(d1, "d1"), onnx.numpy_helper.from_array(d2, "d2")])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18),
                                                         onnx.helper.make_opsetid("com.microsoft", 1)])
    x = rng.normal(size=(1, tokens, h)).astype(np.float32)
    router = rng.normal(size=(tokens, e_count)).astype(np.float32)
    errors = {}
    for name, plan in (("exact", candidate_plans("int4", cpu_class())[-1]),
                       ("fast", candidate_plans("int4", cpu_class(), "fast")[0])):
        retarget(model, plan)
        onnx.save(model, str(tmp_path / "m.onnx"))
        session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
        got, ref = session.run(None, {"x": x, "r": router})
        assert got.shape == ref.shape == (1, tokens, h)
        errors[name] = float(np.abs(got - ref).max() / np.abs(ref).max())
    print(f"CPU class {cpu_class()}: QMoE relative error, exact plan {errors['exact']:.1e}, "
          f"fast plan {errors.get('fast', 0.0):.1e}")
    assert errors["exact"] < 1e-5
    if candidate_plans("int4", cpu_class(), "fast")[0].name == "fast":
        assert errors["fast"] > 1e-4  # level 4: int8 activations


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
