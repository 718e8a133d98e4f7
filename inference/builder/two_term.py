"""Int8 activations in two terms: level-4 ``MatMulNBits`` products within float32's rounding.

At ``accuracy_level`` 4 onnxruntime quantizes the activations per block of ``block_size`` along K
to int8 (``q = rint(x * 127 / max|x|)``, as MLAS's ``QuantizeARow_CompInt8`` does) and runs
integer dot products: the only error is ``x - q * max|x| / 127``, up to half a step of 127 a
block, and it is what flips near-ties (docs/quantization.md). The two-term form removes it: the
graph computes that residual itself, ``r = x - deq(q(x))``, and feeds ``x`` and ``r`` as two rows
of the same op, ``y = W x + W r`` (the second product quantizes ``r`` to int8 in turn, so what is
left is ``r``'s own rounding: 127 times smaller, about 4e-5 of a product's size against 1e-2 for
one term, measured against float64). It costs a second row through the op (4 of a 1B Llama's
layers at one row: 4.2 ms against 3.7 for one term and 6.0 at level 0; ``bench/ort_ops.py``), twelve
small ops per distinct input and, for a prefill, twice the rows (128 tokens: 246 against 146 ms
at level 0), so the gate keeps it only where it pays against the exact plan (:mod:`.quality`).

The rows ride in one ``MatMulNBits`` (``Concat`` on the first axis, ``Split`` and ``Add`` after)
rather than two nodes, because every node prepacks its own copy of the weights.

:func:`set_two_term` is reversible: every node it adds is named ``two-term/...`` and the product
it rewires keeps its own tensors' names behind a prefix, so the gate can try the plan on the
written graph and put it back (:func:`.kernel_plan.retarget`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

PREFIX = "two-term/"
_PAIR = PREFIX + "pair/"
_ROWS = PREFIX + "rows/"
#: The smallest block maximum the residual divides by (a block of zeros stays zeros).
_TINY = np.array(1e-30, np.float32)


def _attr(node: onnx.NodeProto, name: str) -> int:
    return next(a.i for a in node.attribute if a.name == name)


def strip_two_term(graph: onnx.GraphProto) -> None:
    """Put back every product :func:`set_two_term` rewired and drop the nodes it added."""
    kept = [n for n in graph.node if not n.name.startswith(PREFIX)]
    for node in kept:
        if node.op_type == "MatMulNBits" and node.input[0].startswith(_PAIR):
            node.input[0] = node.input[0].split("/", 3)[3]
            node.output[0] = node.output[0].removeprefix(_ROWS)
    del graph.node[:]
    graph.node.extend(kept)


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=name, value=numpy_helper.from_array(value, name))


def _residual_pair(x: str, block: int) -> tuple[str, list[onnx.NodeProto]]:
    """Nodes that make ``Concat(x, x - deq(q(x)))`` on the first axis; returns its name."""
    base = f"{PREFIX}{block}/{x}/"
    pair = f"{_PAIR}{block}/{x}"
    nodes = [_const(base + "blocks", np.array([-1, block], np.int64)),
             _const(base + "axis", np.array([1], np.int64)),
             _const(base + "tiny", _TINY), _const(base + "127", np.array(127.0, np.float32))]

    def op(kind: str, inputs: list[str], out: str, keepdims: int | None = None) -> str:
        node = helper.make_node(kind, inputs, [base + out], name=base + out)
        if keepdims is not None:
            node.attribute.append(helper.make_attribute("keepdims", keepdims))
        nodes.append(node)
        return base + out

    shape = op("Shape", [x], "shape")
    xb = op("Reshape", [x, base + "blocks"], "xb")
    amax = op("Max", [op("ReduceMax", [op("Abs", [xb], "abs"), base + "axis"], "amax", keepdims=1),
                      base + "tiny"], "amax1")
    inv = op("Div", [base + "127", amax], "inv")
    q = op("Round", [op("Mul", [xb, inv], "scaled")], "q")
    residual = op("Sub", [xb, op("Div", [q, inv], "deq")], "rb")
    r = op("Reshape", [residual, shape], "r")
    nodes.append(helper.make_node("Concat", [x, r], [pair], name=base + "pair", axis=0))
    return pair, nodes


def set_two_term(graph: onnx.GraphProto, wanted: Callable[[onnx.NodeProto], bool]) -> int:
    """Rewire every ``MatMulNBits`` for which ``wanted(node)`` holds (level 4) into the two-term
    form; returns how many. Run on a graph :func:`strip_two_term` left plain. A product with a
    bias input (onnxruntime fuses q/k/v biases into it) adds the bias to both rows, so the sum
    takes it off once."""
    out: list[onnx.NodeProto] = []
    pairs: dict[tuple[str, int], str] = {}
    count = 0
    for node in graph.node:
        if not (node.op_type == "MatMulNBits" and wanted(node)):
            out.append(node)
            continue
        x, y, block = node.input[0], node.output[0], _attr(node, "block_size")
        if (x, block) not in pairs:
            pairs[(x, block)], made = _residual_pair(x, block)
            out += made
        node.input[0] = pairs[(x, block)]
        node.output[0] = _ROWS + y
        halves = [f"{PREFIX}{y}/x", f"{PREFIX}{y}/r"]
        bias = node.input[5] if len(node.input) > 5 else ""
        out += [node,
                helper.make_node("Split", [node.output[0]], halves, name=f"{PREFIX}{y}/split", axis=0,
                                 num_outputs=2),
                helper.make_node("Add", halves, [f"{PREFIX}{y}/sum" if bias else y], name=f"{PREFIX}{y}/add")]
        if bias:
            out.append(helper.make_node("Sub", [f"{PREFIX}{y}/sum", bias], [y], name=f"{PREFIX}{y}/bias"))
        count += 1
    del graph.node[:]
    graph.node.extend(out)
    return count
