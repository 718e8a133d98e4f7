"""The graph writer's small tools, shared by the decoder graph (:mod:`.graph`), its quantized
layers (:mod:`.quantized`) and the vision graph (:mod:`.vision_graph`): an emitter of nodes and
initializers with unique names, the external-data file the large initializers stream into, and
the activations."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: onnxruntime's own op domain (GroupQueryAttention, MatMulNBits, SkipSimplifiedLayerNormalization, ...).
MS_DOMAIN = "com.microsoft"

_ALIGN = 4096  # page-aligned external data lets ONNX Runtime memory-map the weights
_INLINE_MAX_BYTES = 1024


class ExternalWeights:
    """Appends tensors to one external-data file and returns initializers that point into it.

    With ``memory`` (a dict), the large tensors go there by name instead and no data file is
    written: a session opened with them as its initializers (``cpu_session(initializers=...)``)
    never reads the file the graph names (the quality gate's throw-away fp32 reference)."""

    def __init__(self, path: Path, memory: dict[str, np.ndarray] | None = None) -> None:
        self.path = path
        self._memory = memory
        # In memory, the data file is still made, empty: onnxruntime checks that the file the
        # graph names exists before it takes the initializers from memory.
        self._fh = path.open("wb") if memory is None else None
        if memory is not None:
            path.touch()
        self._offset = 0

    def add(self, name: str, array: np.ndarray) -> TensorProto:
        array = np.ascontiguousarray(array)
        if array.nbytes <= _INLINE_MAX_BYTES:
            return numpy_helper.from_array(array, name)
        pad = (-self._offset) % _ALIGN
        if self._fh is None:
            assert self._memory is not None
            self._memory[name] = array
        else:
            if pad:
                self._fh.write(b"\0" * pad)
            self._fh.write(array.tobytes())
        self._offset += pad
        tensor = TensorProto()
        tensor.name = name
        tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
        tensor.dims.extend(array.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(self._offset)),
                           ("length", str(array.nbytes))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        self._offset += array.nbytes
        return tensor

    def close(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            self._fh.close()


class Emitter:
    """Collects nodes and initializers with unique names."""

    def __init__(self, weights: ExternalWeights) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[TensorProto] = []
        self._weights = weights
        self._count = 0

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, name: str | None = None,
           outputs: list[str] | None = None, **attrs: Any) -> list[str]:
        self._count += 1
        base = name or f"{op_type.lower()}_{self._count}"
        outs = outputs or [f"{base}_out{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=base, **attrs))
        return outs

    def op1(self, op_type: str, inputs: list[str], **attrs: Any) -> str:
        return self.op(op_type, inputs, **attrs)[0]

    def const(self, value: np.ndarray | np.generic, name: str | None = None) -> str:
        self._count += 1
        cname = name or f"const_{self._count}"
        self.initializers.append(numpy_helper.from_array(np.asarray(value), cname))
        return cname

    def weight(self, name: str, array: np.ndarray) -> str:
        self.initializers.append(self._weights.add(name, array))
        return name


def activation(em: Emitter, x: str, act: str) -> str:
    """``act`` of ``x`` from default-domain ops: silu, relu2, gelu (erf), gelu_tanh, and CLIP's
    quick_gelu (``x * sigmoid(1.702 x)``); every graph flavour runs them."""
    if act == "silu":
        return em.op1("Mul", [x, em.op1("Sigmoid", [x])])
    if act == "relu2":
        r = em.op1("Relu", [x])
        return em.op1("Mul", [r, r])
    if act == "quick_gelu":
        return em.op1("Mul", [x, em.op1("Sigmoid", [em.op1("Mul", [x, em.const(np.float32(1.702))])])])
    half = em.op1("Mul", [x, em.const(np.float32(0.5))])
    if act == "gelu":
        erf = em.op1("Erf", [em.op1("Mul", [x, em.const(np.float32(2 ** -0.5))])])
        return em.op1("Mul", [half, em.op1("Add", [erf, em.const(np.float32(1.0))])])
    if act != "gelu_tanh":
        raise ValueError(f"unknown activation {act!r}")
    # gelu_tanh: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    cube = em.op1("Mul", [em.op1("Mul", [x, x]), x])
    inner = em.op1("Add", [x, em.op1("Mul", [cube, em.const(np.float32(0.044715))])])
    t = em.op1("Tanh", [em.op1("Mul", [inner, em.const(np.float32(np.sqrt(2.0 / np.pi)))])])
    return em.op1("Mul", [half, em.op1("Add", [t, em.const(np.float32(1.0))])])
