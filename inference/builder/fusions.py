"""Fewer ops a step in the onnxruntime CPU graph: a residual add and the RMS norm that reads it
become one ``SkipSimplifiedLayerNormalization``.

A decode step of a small model is bound by dispatch, not arithmetic (SmolLM2-135M at 4 bits: 867
ops, ~6 microseconds each beyond their work). Every decoder layer adds a branch's output to the
residual stream and normalises the sum; onnxruntime's ``SkipSimplifiedLayerNormalization``
(``com.microsoft``) does both in one op and returns the sum as well (its output 3), which the
next residual add reads. Its sum is float32's ``a + b`` and its norm the same ``x / rms(x) * w``
in float32 (logits within 3e-5 of the two ops' on SmolLM2). onnxruntime's own optimiser fuses
only the older ``SimplifiedLayerNormalization`` pattern, not the opset-23 ``RMSNormalization``
this builder writes, so the builder fuses it.

Only the CPU graph gets it (``com.microsoft`` ops are onnxruntime's; the portable graph that
TensorRT reads keeps the standard ops).
"""

from __future__ import annotations

import onnx
from onnx import helper

from inference.builder.emit import MS_DOMAIN


def fuse_skip_norms(nodes: list[onnx.NodeProto], constants: set[str]) -> list[onnx.NodeProto]:
    """``nodes`` with each ``Add(a, b)`` whose output an ``RMSNormalization`` over the last axis
    reads as its input replaced by one ``SkipSimplifiedLayerNormalization`` at the add's place
    (outputs: the norm's, then the sum under the add's name), the norm dropped.

    An add with a constant input (a bias: a broadcast, not a residual) is left, as is a norm
    whose weight is computed (the fused op sits where the add was, before that computation may
    run) or that computes in another type than float32. Both outputs keep their names, so graph
    outputs and later readers are unchanged.
    """
    producer = {out: i for i, node in enumerate(nodes) for out in node.output}
    fused: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    for i, norm in enumerate(nodes):
        if (norm.op_type != "RMSNormalization" or norm.domain not in ("", "ai.onnx")
                or len(norm.input) != 2 or norm.input[1] not in constants):
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in norm.attribute}
        if attrs.get("axis", -1) != -1 or attrs.get("stash_type", 1) != 1:
            continue
        j = producer.get(norm.input[0])
        if j is None or j in fused:  # an add another norm took already
            continue
        add = nodes[j]
        if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or set(add.input) & constants:
            continue
        eps = float(attrs.get("epsilon", 1e-5))
        fused[j] = helper.make_node(
            "SkipSimplifiedLayerNormalization", [add.input[1], add.input[0], norm.input[1]],
            [norm.output[0], "", "", add.output[0]], name=f"{norm.name or norm.output[0]}/skip",
            domain=MS_DOMAIN, epsilon=eps)
        dropped.add(i)
    return [fused.get(i, node) for i, node in enumerate(nodes) if i not in dropped]
