"""The CPU graph's residual add + RMS norm as one op (inference.builder.fusions)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from inference.builder.emit import MS_DOMAIN
from inference.builder.fusions import fuse_skip_norms

H = 64


def _graph(nodes: list[onnx.NodeProto], inits: list[onnx.TensorProto]) -> onnx.ModelProto:
    """x, r [2, 3, H] in; the norms' outputs and the residual stream out."""
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3, H]) for n in ("x", "r")]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3, H]) for n in ("n1", "n2", "n3", "s2")]
    graph = helper.make_graph(nodes, "g", io, outs, inits)
    opsets = [helper.make_opsetid("", 23), helper.make_opsetid(MS_DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_a_residual_add_and_its_norm_become_one_op_with_the_same_outputs() -> None:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.normal(1.0, 0.2, H).astype(np.float32), "w")
    bias = numpy_helper.from_array(rng.normal(0.0, 1.0, H).astype(np.float32), "bias")
    norm: dict[str, Any] = {"axis": -1, "epsilon": 1e-5, "stash_type": 1}
    nodes = [
        helper.make_node("Add", ["x", "r"], ["s1"]),                      # residual: fused
        helper.make_node("RMSNormalization", ["s1", "w"], ["n1"], **norm),
        helper.make_node("Add", ["s1", "n1"], ["s2"]),                    # sum read later: kept by name
        helper.make_node("RMSNormalization", ["s2", "w"], ["n2"], **norm),
        helper.make_node("Add", ["s2", "bias"], ["s3"]),                  # a bias, not a residual: left
        helper.make_node("RMSNormalization", ["s3", "w"], ["n3"], **norm),
    ]
    plain = _graph(nodes, [w, bias])
    fused = _graph(fuse_skip_norms(list(nodes), {"w", "bias"}), [w, bias])
    onnx.checker.check_model(fused)
    kinds = [n.op_type for n in fused.graph.node]
    assert kinds == ["SkipSimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "Add",
                     "RMSNormalization"], kinds
    feeds = {name: rng.normal(size=(2, 3, H)).astype(np.float32) for name in ("x", "r")}
    for a, b in zip(_run(plain, feeds), _run(fused, feeds), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_norm_of_another_axis_type_or_a_computed_weight_is_left() -> None:
    nodes = [
        helper.make_node("Add", ["x", "r"], ["s1"]),
        helper.make_node("RMSNormalization", ["s1", "w"], ["n1"], axis=1, epsilon=1e-5),
        helper.make_node("Add", ["x", "r"], ["s2"]),
        helper.make_node("RMSNormalization", ["s2", "w"], ["n2"], axis=-1, epsilon=1e-5, stash_type=0),
        helper.make_node("Add", ["x", "r"], ["s3"]),
        helper.make_node("RMSNormalization", ["s3", "computed"], ["n3"], axis=-1, epsilon=1e-5),
    ]
    assert fuse_skip_norms(list(nodes), {"w"}) == nodes
