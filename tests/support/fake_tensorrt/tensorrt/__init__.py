"""Fake ``tensorrt`` (tests only): the TensorRT 10 Python API, executing the ONNX graph it was given.

It follows the documented API (names, signatures, return conventions: most calls log an error
through the ``ILogger`` and return ``False``/``None``/``-1`` rather than raise; wrong argument
types raise ``TypeError`` as pybind11 does) and enforces its rules:

* ``Builder(logger)``; ``create_network(flags)`` takes a bitmask of
  ``NetworkDefinitionCreationFlag``; ``EXPLICIT_BATCH`` is deprecated and ignored in TensorRT 10
  (explicit batch is implicit) and logs a warning; ``STRONGLY_TYPED`` forbids the FP16/BF16/INT8
  builder flags and per-layer precisions.
* ``OnnxParser(network, logger)``; ``parse``/``parse_from_file`` accept only default-domain ops
  this version parses: ``Attention`` needs 10.14+, ``RotaryEmbedding``/``RMSNormalization``
  10.15+; ``com.microsoft`` ops never parse. Errors land in ``num_errors``/``get_error``.
* an optimization profile sets every dynamic input with ``min <= opt <= max`` elementwise, the
  right rank and the static dims; ``add_optimization_profile`` returns -1 for an invalid one.
* ``build_serialized_network(network, config)`` returns ``IHostMemory`` or ``None`` (no profile
  for a dynamic network, a network from another builder, an empty network).
* the plan records the TensorRT version and the device's compute capability; another version
  or another GPU cannot deserialize it (``None`` and an error), as with real plans.
* timing caches carry version and compute capability; ``set_timing_cache`` refuses a mismatch
  unless ``ignore_mismatch``; ``combine`` merges.
* ``IExecutionContext``: ``set_input_shape`` within the profile (else ``False``), an input's
  shape before its address, every I/O tensor bound and every input shape set before
  ``execute_async_v3(stream_handle)``; outputs must fit the memory bound to them.

The engine runs the parsed ONNX graph with onnxruntime (fp32, on the CPU) in stream order, so a
consumer's greedy tokens are real. Precision flags and layer precisions are recorded, not applied.

Stricter than TensorRT, on purpose: "an input's shape before its address" (TensorRT accepts
either order; setting shapes first is the documented pattern and lets output shapes be known
when outputs are bound). Not modelled: shape tensors (host-memory inputs), tactics and timing,
numerics of reduced precisions, plugin layers, multiple profiles per context.
"""

from __future__ import annotations

import enum
import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _fake_gpu as gpu
import numpy as np

__version__ = "10.13.3.9"
FAKE = True  # lets tests tell the fake from a real install

_MAGIC = b"FAKETRT-PLAN\x00"
_CACHE_MAGIC = b"FAKETRT-TIMING\x00"


def _version_tuple() -> tuple[int, int]:
    major, minor = __version__.split(".")[:2]
    return int(major), int(minor)


def _cc() -> str:
    major, minor = gpu.compute_capability()
    return f"{major}.{minor}"


# --- enums ----------------------------------------------------------------------------------
class DataType(enum.IntEnum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8
    INT4 = 9


float32, float16, bfloat16 = DataType.FLOAT, DataType.HALF, DataType.BF16
int8, int32, int64, bool_ = DataType.INT8, DataType.INT32, DataType.INT64, DataType.BOOL

_NP = {
    DataType.FLOAT: np.float32,
    DataType.HALF: np.float16,
    DataType.INT8: np.int8,
    DataType.INT32: np.int32,
    DataType.BOOL: np.bool_,
    DataType.UINT8: np.uint8,
    DataType.INT64: np.int64,
}
_FROM_ONNX = {
    1: DataType.FLOAT,
    10: DataType.HALF,
    16: DataType.BF16,
    3: DataType.INT8,
    6: DataType.INT32,
    7: DataType.INT64,
    9: DataType.BOOL,
    2: DataType.UINT8,
}


def nptype(trt_type: DataType) -> type:
    """The numpy type of a TensorRT data type."""
    if trt_type not in _NP:
        raise TypeError(f"Could not resolve TensorRT datatype {trt_type!r} to an equivalent numpy datatype.")
    return _NP[trt_type]


class NetworkDefinitionCreationFlag(enum.IntEnum):
    EXPLICIT_BATCH = 0  # deprecated in TensorRT 10: ignored, explicit batch is always on
    STRONGLY_TYPED = 1
    PREFER_AOT_PYTHON_PLUGINS = 2
    PREFER_JIT_PYTHON_PLUGINS = 3


class BuilderFlag(enum.IntEnum):
    FP16 = 0
    INT8 = 1
    DEBUG = 2
    GPU_FALLBACK = 3
    REFIT = 4
    DISABLE_TIMING_CACHE = 5
    TF32 = 6
    SPARSE_WEIGHTS = 7
    SAFETY_SCOPE = 8
    OBEY_PRECISION_CONSTRAINTS = 9
    PREFER_PRECISION_CONSTRAINTS = 10
    DIRECT_IO = 11
    REJECT_EMPTY_ALGORITHMS = 12
    VERSION_COMPATIBLE = 13
    EXCLUDE_LEAN_RUNTIME = 14
    FP8 = 15
    ERROR_ON_TIMING_CACHE_MISS = 16
    BF16 = 17
    WEIGHT_STREAMING = 21
    INT4 = 22


class MemoryPoolType(enum.IntEnum):
    WORKSPACE = 0
    DLA_MANAGED_SRAM = 1
    DLA_LOCAL_DRAM = 2
    DLA_GLOBAL_DRAM = 3
    TACTIC_DRAM = 4
    TACTIC_SHARED_MEMORY = 5


class TensorIOMode(enum.IntEnum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class LayerType(enum.IntEnum):
    CONVOLUTION = 0
    CAST = 1
    ACTIVATION = 2
    POOLING = 3
    SCALE = 5
    SOFTMAX = 6
    CONCATENATION = 8
    ELEMENTWISE = 9
    UNARY = 11
    SHUFFLE = 13
    REDUCE = 14
    CONSTANT = 15
    GATHER = 16
    MATRIX_MULTIPLY = 17
    SLICE = 18
    SHAPE = 19
    SELECT = 22
    FILL = 23
    QUANTIZE = 24
    DEQUANTIZE = 25
    CONDITION = 26
    SCATTER = 31
    EINSUM = 32
    NORMALIZATION = 35
    ATTENTION = 40
    ROTARY_EMBEDDING = 41
    PLUGIN_V3 = 99


_LAYER_OF_OP = {
    "MatMul": LayerType.MATRIX_MULTIPLY,
    "Gemm": LayerType.MATRIX_MULTIPLY,
    "Add": LayerType.ELEMENTWISE,
    "Sub": LayerType.ELEMENTWISE,
    "Mul": LayerType.ELEMENTWISE,
    "Div": LayerType.ELEMENTWISE,
    "Pow": LayerType.ELEMENTWISE,
    "Max": LayerType.ELEMENTWISE,
    "Min": LayerType.ELEMENTWISE,
    "Equal": LayerType.ELEMENTWISE,
    "Less": LayerType.ELEMENTWISE,
    "Sqrt": LayerType.UNARY,
    "Neg": LayerType.UNARY,
    "Exp": LayerType.UNARY,
    "Reciprocal": LayerType.UNARY,
    "Cos": LayerType.UNARY,
    "Sin": LayerType.UNARY,
    "Not": LayerType.UNARY,
    "Sigmoid": LayerType.ACTIVATION,
    "Relu": LayerType.ACTIVATION,
    "Tanh": LayerType.ACTIVATION,
    "ReduceMean": LayerType.REDUCE,
    "ReduceSum": LayerType.REDUCE,
    "ReduceMax": LayerType.REDUCE,
    "Softmax": LayerType.SOFTMAX,
    "Gather": LayerType.GATHER,
    "GatherElements": LayerType.GATHER,
    "Reshape": LayerType.SHUFFLE,
    "Transpose": LayerType.SHUFFLE,
    "Unsqueeze": LayerType.SHUFFLE,
    "Squeeze": LayerType.SHUFFLE,
    "Flatten": LayerType.SHUFFLE,
    "Slice": LayerType.SLICE,
    "Concat": LayerType.CONCATENATION,
    "Shape": LayerType.SHAPE,
    "Where": LayerType.SELECT,
    "Cast": LayerType.CAST,
    "Constant": LayerType.CONSTANT,
    "Expand": LayerType.SLICE,
    "Range": LayerType.FILL,
    "ConstantOfShape": LayerType.FILL,
    "Trilu": LayerType.ELEMENTWISE,
    "QuantizeLinear": LayerType.QUANTIZE,
    "DequantizeLinear": LayerType.DEQUANTIZE,
    "RMSNormalization": LayerType.NORMALIZATION,
    "LayerNormalization": LayerType.NORMALIZATION,
    "Attention": LayerType.ATTENTION,
    "RotaryEmbedding": LayerType.ROTARY_EMBEDDING,
    "ScatterND": LayerType.SCATTER,
    "CumSum": LayerType.REDUCE,
}
#: Ops this fake's parser knows only from a given TensorRT version on (engine-facts.md).
_OP_SINCE = {"Attention": (10, 14), "RotaryEmbedding": (10, 15), "RMSNormalization": (10, 15)}


def _check_type(value: Any, types: Any, what: str) -> None:
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise TypeError(f"{what}: incompatible function arguments, got {value!r}")
    if not isinstance(value, types):
        raise TypeError(f"{what}: incompatible function arguments, got {type(value).__name__}")


class Dims(tuple[int, ...]):
    """TensorRT's Dims: a tuple of ints, -1 for a dynamic dimension."""

    def __new__(cls, dims: Sequence[int] = ()) -> Dims:
        return super().__new__(cls, (int(d) for d in dims))


def _dims(value: Any, what: str) -> Dims:
    if not isinstance(value, tuple | list | Dims) or not all(
        isinstance(d, int | np.integer) and not isinstance(d, bool) for d in value
    ):
        raise TypeError(
            f"{what}: incompatible function arguments: expected Dims (a sequence of ints), got {value!r}"
        )
    return Dims(value)


# --- logging --------------------------------------------------------------------------------
class ILogger:
    """Base of loggers."""

    class Severity(enum.IntEnum):
        INTERNAL_ERROR = 0
        ERROR = 1
        WARNING = 2
        INFO = 3
        VERBOSE = 4

    INTERNAL_ERROR = Severity.INTERNAL_ERROR
    ERROR = Severity.ERROR
    WARNING = Severity.WARNING
    INFO = Severity.INFO
    VERBOSE = Severity.VERBOSE

    def log(self, severity: ILogger.Severity, msg: str) -> None:
        raise NotImplementedError


class Logger(ILogger):
    """The stock logger: keeps every message (tests read ``messages``)."""

    def __init__(self, min_severity: ILogger.Severity = ILogger.Severity.WARNING) -> None:
        self.min_severity = min_severity
        self.messages: list[tuple[ILogger.Severity, str]] = []

    def log(self, severity: ILogger.Severity, msg: str) -> None:
        self.messages.append((severity, msg))

    def errors(self) -> list[str]:
        return [m for s, m in self.messages if s <= ILogger.Severity.ERROR]


def _error(logger: ILogger, msg: str) -> None:
    logger.log(ILogger.Severity.ERROR, msg)


def _warn(logger: ILogger, msg: str) -> None:
    logger.log(ILogger.Severity.WARNING, msg)


class IHostMemory(bytes):
    """Serialized data owned by TensorRT; supports the buffer protocol."""

    @property
    def nbytes(self) -> int:
        return len(self)

    @property
    def dtype(self) -> DataType:
        return DataType.UINT8


# --- network --------------------------------------------------------------------------------
class ITensor:
    def __init__(self, name: str, shape: Dims, dtype: DataType) -> None:
        self.name = name
        self.shape = shape
        self.dtype = dtype
        self.is_network_input = False
        self.is_network_output = False


class _TensorIO:
    """``num_inputs``/``num_outputs``/``get_input``/``get_output`` over ``_inputs``/``_outputs``:
    the I/O accessors TensorRT's ``ILayer`` and ``INetworkDefinition`` share."""

    _inputs: list[ITensor]
    _outputs: list[ITensor]

    @property
    def num_inputs(self) -> int:
        return len(self._inputs)

    @property
    def num_outputs(self) -> int:
        return len(self._outputs)

    def get_input(self, index: int) -> ITensor | None:
        return self._inputs[index] if 0 <= index < len(self._inputs) else None

    def get_output(self, index: int) -> ITensor | None:
        return self._outputs[index] if 0 <= index < len(self._outputs) else None


class ILayer(_TensorIO):
    def __init__(self, name: str, op_type: str, inputs: list[ITensor], outputs: list[ITensor]) -> None:
        self.name = name
        self.type = _LAYER_OF_OP.get(op_type, LayerType.PLUGIN_V3)
        self.op_type = op_type
        self._inputs = inputs
        self._outputs = outputs
        self._precision: DataType | None = None
        self._output_types: dict[int, DataType] = {}
        self._network: INetworkDefinition | None = None

    @property
    def precision(self) -> DataType:
        return DataType.FLOAT if self._precision is None else self._precision

    @precision.setter
    def precision(self, value: DataType) -> None:
        _check_type(value, DataType, "ILayer.precision")
        if self._network is not None and self._network.strongly_typed:
            raise RuntimeError("ILayer::setPrecision is not allowed on a strongly typed network")
        self._precision = value

    @property
    def precision_is_set(self) -> bool:
        return self._precision is not None

    def set_output_type(self, index: int, dtype: DataType) -> None:
        _check_type(index, int, "ILayer.set_output_type")
        _check_type(dtype, DataType, "ILayer.set_output_type")
        if self._network is not None and self._network.strongly_typed:
            raise RuntimeError("ILayer::setOutputType is not allowed on a strongly typed network")
        if not 0 <= index < len(self._outputs):
            raise IndexError(f"output index {index} out of range")
        self._output_types[index] = dtype


class INetworkDefinition(_TensorIO):
    def __init__(self, builder: Builder, flags: int) -> None:
        self._builder = builder
        self.flags = flags
        self.strongly_typed = bool(flags & (1 << NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        self._inputs: list[ITensor] = []
        self._outputs: list[ITensor] = []
        self._layers: list[ILayer] = []
        self._onnx: bytes | None = None
        self.name = "Unnamed Network 0"

    @property
    def num_layers(self) -> int:
        return len(self._layers)

    def get_layer(self, index: int) -> ILayer | None:
        return self._layers[index] if 0 <= index < len(self._layers) else None

    def get_flag(self, flag: NetworkDefinitionCreationFlag) -> bool:
        return bool(self.flags & (1 << flag))


# --- ONNX parser ----------------------------------------------------------------------------
class ParserError:
    def __init__(self, desc: str, node: int = -1, node_name: str = "", node_operator: str = "") -> None:
        self._desc, self._node, self._name, self._op = desc, node, node_name, node_operator

    def desc(self) -> str:
        return self._desc

    def node(self) -> int:
        return self._node

    def node_name(self) -> str:
        return self._name

    def node_operator(self) -> str:
        return self._op

    def __str__(self) -> str:
        return f"In node {self._node} with name: {self._name} and operator: {self._op} ({self._desc})"


class OnnxParser:
    def __init__(self, network: INetworkDefinition, logger: ILogger) -> None:
        _check_type(network, INetworkDefinition, "OnnxParser.__init__")
        _check_type(logger, ILogger, "OnnxParser.__init__")
        self._network = network
        self._logger = logger
        self._errors: list[ParserError] = []

    @property
    def num_errors(self) -> int:
        return len(self._errors)

    def get_error(self, index: int) -> ParserError | None:
        return self._errors[index] if 0 <= index < len(self._errors) else None

    def clear_errors(self) -> None:
        self._errors.clear()

    def parse_from_file(self, model: str) -> bool:
        """Parse an ONNX file (external data beside it); populate the network."""
        _check_type(model, str, "OnnxParser.parse_from_file")
        import onnx

        if not os.path.isfile(model):
            self._errors.append(ParserError(f"Failed to open file: {model}"))
            return False
        proto = onnx.load(model, load_external_data=True)
        return self._populate(proto)

    def parse(self, model: bytes, path: str | None = None) -> bool:
        """Parse serialized ONNX bytes; ``path`` locates external weights."""
        _check_type(model, bytes | bytearray | memoryview, "OnnxParser.parse")
        import onnx
        from onnx.external_data_helper import load_external_data_for_model

        proto = onnx.load_from_string(bytes(model))
        if any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer):
            if path is None:
                self._errors.append(ParserError("model has external weights; pass path= to parse()"))
                return False
            load_external_data_for_model(proto, str(Path(path).parent))
        return self._populate(proto)

    def _populate(self, proto: Any) -> bool:
        net = self._network
        if net._onnx is not None:
            self._errors.append(ParserError("the network was already populated by a parse call"))
            return False
        version = _version_tuple()
        for opset in proto.opset_import:
            if opset.domain not in ("", "ai.onnx"):
                self._errors.append(ParserError(f"unsupported opset domain {opset.domain!r}"))
        for i, node in enumerate(proto.graph.node):
            if node.domain not in ("", "ai.onnx"):
                self._errors.append(
                    ParserError(
                        f"No importer registered for op: {node.op_type} (domain {node.domain})",
                        i,
                        node.name,
                        node.op_type,
                    )
                )
            elif node.op_type in _OP_SINCE and version < _OP_SINCE[node.op_type]:
                need = ".".join(map(str, _OP_SINCE[node.op_type]))
                self._errors.append(
                    ParserError(
                        f"No importer registered for op: {node.op_type} (needs TensorRT {need}+)",
                        i,
                        node.name,
                        node.op_type,
                    )
                )
        if self._errors:
            return False
        init_names = {t.name for t in proto.graph.initializer}
        tensors: dict[str, ITensor] = {}

        def io_tensor(value_info: Any) -> ITensor:
            ttype = value_info.type.tensor_type
            shape = Dims([d.dim_value if d.HasField("dim_value") else -1 for d in ttype.shape.dim])
            dtype = _FROM_ONNX.get(ttype.elem_type)
            if dtype is None:
                raise ValueError(f"unsupported ONNX type {ttype.elem_type}")
            return ITensor(value_info.name, shape, dtype)

        for vi in proto.graph.input:
            if vi.name in init_names:
                continue
            t = io_tensor(vi)
            t.is_network_input = True
            tensors[t.name] = t
            net._inputs.append(t)
        for node in proto.graph.node:
            ins = [tensors.setdefault(n, ITensor(n, Dims(), DataType.FLOAT)) for n in node.input if n]
            outs = [tensors.setdefault(n, ITensor(n, Dims(), DataType.FLOAT)) for n in node.output if n]
            layer = ILayer(node.name or f"node_of_{node.output[0]}", node.op_type, ins, outs)
            layer._network = net
            net._layers.append(layer)
        for vi in proto.graph.output:
            t = io_tensor(vi)
            t.is_network_output = True
            net._outputs.append(t)
        net._onnx = proto.SerializeToString()
        return True


# --- builder config, profiles, timing cache -----------------------------------------------------
class IOptimizationProfile:
    def __init__(self, builder: Builder) -> None:
        self._builder = builder
        self.shapes: dict[str, tuple[Dims, Dims, Dims]] = {}
        self.valid = True

    def set_shape(self, input: str, min: Any, opt: Any, max: Any) -> None:
        _check_type(input, str, "IOptimizationProfile.set_shape")
        lo, mid, hi = (_dims(d, "IOptimizationProfile.set_shape") for d in (min, opt, max))
        if not len(lo) == len(mid) == len(hi):
            _error(self._builder.logger, f"{input}: min/opt/max dims must have the same rank")
            self.valid = False
            return
        if any(d < 0 for d in lo) or any(not a <= b <= c for a, b, c in zip(lo, mid, hi, strict=True)):
            _error(
                self._builder.logger,
                f"{input}: optimization profile needs 0 <= min <= opt <= max "
                f"elementwise, got min={lo} opt={mid} max={hi}",
            )
            self.valid = False
            return
        self.shapes[input] = (lo, mid, hi)

    def get_shape(self, input: str) -> list[Dims]:
        return list(self.shapes.get(input, ()))


class ITimingCache:
    def __init__(self, version: str, cc: str, entries: set[str]) -> None:
        self.version, self.cc, self.entries = version, cc, set(entries)

    def serialize(self) -> IHostMemory:
        body = json.dumps({"version": self.version, "cc": self.cc, "entries": sorted(self.entries)}).encode()
        return IHostMemory(_CACHE_MAGIC + body)

    def combine(self, input_cache: ITimingCache, ignore_mismatch: bool) -> bool:
        _check_type(input_cache, ITimingCache, "ITimingCache.combine")
        if (input_cache.version, input_cache.cc) != (self.version, self.cc) and not ignore_mismatch:
            return False
        self.entries |= input_cache.entries
        return True

    def reset(self) -> bool:
        self.entries.clear()
        return True


class IBuilderConfig:
    def __init__(self, builder: Builder) -> None:
        self._builder = builder
        self.flags = 0
        self.profiles: list[IOptimizationProfile] = []
        self.pool_limits: dict[MemoryPoolType, int] = {}
        self._timing_cache: ITimingCache | None = None

    def set_flag(self, flag: BuilderFlag) -> None:
        _check_type(flag, BuilderFlag, "IBuilderConfig.set_flag")
        self.flags |= 1 << flag

    def clear_flag(self, flag: BuilderFlag) -> None:
        _check_type(flag, BuilderFlag, "IBuilderConfig.clear_flag")
        self.flags &= ~(1 << flag)

    def get_flag(self, flag: BuilderFlag) -> bool:
        return bool(self.flags & (1 << flag))

    def set_memory_pool_limit(self, pool: MemoryPoolType, pool_size: int) -> None:
        _check_type(pool, MemoryPoolType, "IBuilderConfig.set_memory_pool_limit")
        _check_type(pool_size, int, "IBuilderConfig.set_memory_pool_limit")
        if pool_size < 0:
            raise ValueError("pool size must not be negative")
        self.pool_limits[pool] = pool_size

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        _check_type(profile, IOptimizationProfile, "IBuilderConfig.add_optimization_profile")
        if not profile.valid or not profile.shapes:
            _error(self._builder.logger, "optimization profile is invalid or empty")
            return -1
        self.profiles.append(profile)
        return len(self.profiles) - 1

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def create_timing_cache(self, serialized_timing_cache: bytes) -> ITimingCache:
        _check_type(
            serialized_timing_cache, bytes | bytearray | memoryview, "IBuilderConfig.create_timing_cache"
        )
        data = bytes(serialized_timing_cache)
        if not data:
            return ITimingCache(__version__, _cc(), set())
        if not data.startswith(_CACHE_MAGIC):
            _warn(self._builder.logger, "timing cache blob is not a timing cache; starting an empty one")
            return ITimingCache(__version__, _cc(), set())
        meta = json.loads(data[len(_CACHE_MAGIC) :])
        return ITimingCache(meta["version"], meta["cc"], set(meta["entries"]))

    def set_timing_cache(self, cache: ITimingCache, ignore_mismatch: bool) -> bool:
        _check_type(cache, ITimingCache, "IBuilderConfig.set_timing_cache")
        _check_type(ignore_mismatch, bool, "IBuilderConfig.set_timing_cache")
        if (cache.version, cache.cc) != (__version__, _cc()) and not ignore_mismatch:
            _error(
                self._builder.logger,
                f"timing cache was made by TensorRT {cache.version} on compute "
                f"capability {cache.cc}; this is {__version__} on {_cc()}",
            )
            return False
        self._timing_cache = cache
        return True

    def get_timing_cache(self) -> ITimingCache | None:
        return self._timing_cache


# --- builder --------------------------------------------------------------------------------
class Builder:
    def __init__(self, logger: ILogger) -> None:
        _check_type(logger, ILogger, "Builder.__init__")
        self.logger = logger
        self.builds = 0

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        _check_type(flags, int, "Builder.create_network")
        known = sum(1 << f for f in NetworkDefinitionCreationFlag)
        if flags & ~known:
            raise ValueError(f"unknown NetworkDefinitionCreationFlag bits in {flags:#x}")
        if flags & (1 << NetworkDefinitionCreationFlag.EXPLICIT_BATCH):
            _warn(
                self.logger,
                "NetworkDefinitionCreationFlag::kEXPLICIT_BATCH is deprecated and has no "
                "effect: explicit batch is always on in TensorRT 10",
            )
        return INetworkDefinition(self, flags)

    def create_builder_config(self) -> IBuilderConfig:
        return IBuilderConfig(self)

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile(self)

    @property
    def platform_has_fast_fp16(self) -> bool:
        return True

    def build_serialized_network(
        self, network: INetworkDefinition, config: IBuilderConfig
    ) -> IHostMemory | None:
        _check_type(network, INetworkDefinition, "Builder.build_serialized_network")
        _check_type(config, IBuilderConfig, "Builder.build_serialized_network")
        log = self.logger
        if network._builder is not self or config._builder is not self:
            _error(log, "network and config must come from this builder")
            return None
        if network._onnx is None or not network._outputs:
            _error(log, "network has no layers or outputs (did the parser succeed?)")
            return None
        typed = (BuilderFlag.FP16, BuilderFlag.BF16, BuilderFlag.INT8)
        if network.strongly_typed and any(config.get_flag(f) for f in typed):
            _error(log, "precision flags FP16/BF16/INT8 are not allowed with a strongly typed network")
            return None
        dynamic = [t for t in network._inputs if any(d < 0 for d in t.shape)]
        if dynamic and not config.profiles:
            _error(log, "Network has dynamic or shape inputs, but no optimization profile has been defined.")
            return None
        for index, prof in enumerate(config.profiles):
            for t in network._inputs:
                if t.name not in prof.shapes:
                    if t in dynamic:
                        _error(log, f"optimization profile {index} does not set dynamic input {t.name}")
                        return None
                    continue
                for dims in prof.shapes[t.name]:
                    if len(dims) != len(t.shape) or any(
                        s >= 0 and s != d for s, d in zip(t.shape, dims, strict=True)
                    ):
                        _error(log, f"profile {index} gives {t.name} dims {dims}; the network has {t.shape}")
                        return None
            unknown = set(prof.shapes) - {t.name for t in network._inputs}
            if unknown:
                _error(log, f"profile {index} names tensors that are not network inputs: {sorted(unknown)}")
                return None
        constrained = {}
        obey = config.get_flag(BuilderFlag.OBEY_PRECISION_CONSTRAINTS) or config.get_flag(
            BuilderFlag.PREFER_PRECISION_CONSTRAINTS
        )
        for layer in network._layers:
            if layer.precision_is_set:
                if not obey:
                    _warn(
                        log, f"layer {layer.name}: precision set but no precision-constraints flag; ignored"
                    )
                else:
                    constrained[layer.name] = layer.precision.name
        precision = [f.name for f in typed if config.get_flag(f)] or ["FLOAT"]
        cache = config._timing_cache
        if cache is not None:
            cache.entries |= {f"{layer.op_type}:{'+'.join(precision)}" for layer in network._layers}
        self.builds += 1
        header = {
            "version": __version__,
            "cc": _cc(),
            "device": gpu.device_name(),
            "flags": config.flags,
            "precision": precision,
            "constrained_layers": constrained,
            "profiles": [{k: [list(d) for d in v] for k, v in p.shapes.items()} for p in config.profiles],
            "inputs": [[t.name, list(t.shape), t.dtype.name] for t in network._inputs],
            "outputs": [[t.name, list(t.shape), t.dtype.name] for t in network._outputs],
            "workspace": config.pool_limits.get(MemoryPoolType.WORKSPACE),
        }
        blob = json.dumps(header).encode()
        return IHostMemory(_MAGIC + struct.pack("<Q", len(blob)) + blob + network._onnx)


# --- runtime, engine, execution context ---------------------------------------------------------
class Runtime:
    def __init__(self, logger: ILogger) -> None:
        _check_type(logger, ILogger, "Runtime.__init__")
        self.logger = logger

    def deserialize_cuda_engine(self, serialized_engine: Any) -> ICudaEngine | None:
        _check_type(serialized_engine, bytes | bytearray | memoryview, "Runtime.deserialize_cuda_engine")
        data = bytes(serialized_engine)
        if not data.startswith(_MAGIC):
            _error(
                self.logger,
                "Error Code 1: Serialization (Serialization assertion magicTagRead == kMAGIC_TAG "
                "failed.Magic tag does not match)",
            )
            return None
        (size,) = struct.unpack("<Q", data[len(_MAGIC) : len(_MAGIC) + 8])
        start = len(_MAGIC) + 8
        header = json.loads(data[start : start + size])
        if header["version"] != __version__:
            _error(
                self.logger,
                "Error Code 6: API Usage Error (The engine plan file is not compatible with this "
                f"version of TensorRT, expecting library version {__version__} got "
                f"{header['version']}, please rebuild.)",
            )
            return None
        if header["cc"] != _cc():
            _error(
                self.logger,
                "Error Code 6: API Usage Error (The engine plan file is generated on an "
                f"incompatible device, expecting compute {_cc()} got compute {header['cc']}, "
                "please rebuild.)",
            )
            return None
        return ICudaEngine(self, header, data[start + size :])


class ICudaEngine:
    def __init__(self, runtime: Runtime, header: dict[str, Any], onnx_bytes: bytes) -> None:
        self._runtime = runtime
        self.header = header
        self._onnx = onnx_bytes
        self._io: list[tuple[str, Dims, DataType, TensorIOMode]] = [
            (n, Dims(s), DataType[d], TensorIOMode.INPUT) for n, s, d in header["inputs"]
        ] + [(n, Dims(s), DataType[d], TensorIOMode.OUTPUT) for n, s, d in header["outputs"]]
        self._by_name = {io[0]: io for io in self._io}
        self._session: Any = None

    @property
    def num_io_tensors(self) -> int:
        return len(self._io)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.header["profiles"])

    @property
    def device_memory_size_v2(self) -> int:
        return int(self.header.get("workspace") or 0) // 8

    def get_tensor_name(self, index: int) -> str:
        _check_type(index, int, "ICudaEngine.get_tensor_name")
        return self._io[index][0]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        io = self._by_name.get(name)
        return TensorIOMode.NONE if io is None else io[3]

    def get_tensor_dtype(self, name: str) -> DataType:
        return self._by_name[name][2]

    def get_tensor_shape(self, name: str) -> Dims:
        return self._by_name[name][1]

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[Dims]:
        shapes = self.header["profiles"][profile_index].get(name)
        return [Dims(d) for d in shapes] if shapes else []

    def create_execution_context(self) -> IExecutionContext:
        return IExecutionContext(self)

    def session(self) -> Any:
        if self._session is None:
            import onnxruntime as ort

            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            opts.intra_op_num_threads = 1
            self._session = ort.InferenceSession(self._onnx, opts, providers=["CPUExecutionProvider"])
        return self._session


class IExecutionContext:
    def __init__(self, engine: ICudaEngine) -> None:
        self.engine = engine
        self._shapes: dict[str, Dims] = {}
        self._addresses: dict[str, int] = {}
        self.executions = 0

    @property
    def _log(self) -> ILogger:
        return self.engine._runtime.logger

    def set_input_shape(self, name: str, shape: Any) -> bool:
        _check_type(name, str, "IExecutionContext.set_input_shape")
        dims = _dims(shape, "IExecutionContext.set_input_shape")
        if self.engine.get_tensor_mode(name) != TensorIOMode.INPUT:
            _error(self._log, f"setInputShape: {name} is not an input tensor of the engine")
            return False
        declared = self.engine.get_tensor_shape(name)
        if len(dims) != len(declared) or any(s >= 0 and s != d for s, d in zip(declared, dims, strict=True)):
            _error(self._log, f"setInputShape: {name} dims {dims} do not match the engine's {declared}")
            return False
        prof = self.engine.get_tensor_profile_shape(name, 0)
        if prof and any(not lo <= d <= hi for lo, d, hi in zip(prof[0], dims, prof[2], strict=True)):
            _error(
                self._log,
                f"setInputShape: {name} dims {dims} are outside the optimization profile "
                f"[{prof[0]}, {prof[2]}]",
            )
            return False
        self._shapes[name] = dims
        return True

    def get_tensor_shape(self, name: str) -> Dims:
        if name in self._shapes:
            return self._shapes[name]
        declared = self.engine.get_tensor_shape(name)
        if self.engine.get_tensor_mode(name) != TensorIOMode.OUTPUT:
            return declared
        return Dims(self._resolve_output_dims(name))

    def _resolve_output_dims(self, name: str) -> list[int]:
        # Symbolic output dims resolve through the input dims that share their ONNX dim name.
        symbols: dict[str, int] = {}
        sess = self.engine.session()
        for node in sess.get_inputs():
            if node.name in self._shapes:
                for sym, d in zip(node.shape, self._shapes[node.name], strict=False):
                    if isinstance(sym, str):
                        symbols[sym] = d
        out = next(o for o in sess.get_outputs() if o.name == name)
        return [d if isinstance(d, int) else symbols.get(d, -1) for d in out.shape]

    def set_tensor_address(self, name: str, memory: int) -> bool:
        _check_type(name, str, "IExecutionContext.set_tensor_address")
        _check_type(memory, int, "IExecutionContext.set_tensor_address")
        mode = self.engine.get_tensor_mode(name)
        if mode == TensorIOMode.NONE:
            _error(self._log, f"setTensorAddress: {name} is not an I/O tensor of the engine")
            return False
        if mode == TensorIOMode.INPUT and name not in self._shapes:
            _error(
                self._log,
                f"setTensorAddress: set the shape of input {name} (set_input_shape) before its address",
            )
            return False
        if memory == 0:
            _error(self._log, f"setTensorAddress: null address for {name}")
            return False
        self._addresses[name] = memory
        return True

    def get_tensor_address(self, name: str) -> int:
        return self._addresses.get(name, 0)

    def infer_shapes(self) -> list[str]:
        return [n for n, _, _, m in self.engine._io if m == TensorIOMode.INPUT and n not in self._shapes]

    @property
    def all_binding_shapes_specified(self) -> bool:
        return not self.infer_shapes()

    def execute_async_v3(self, stream_handle: int) -> bool:
        _check_type(stream_handle, int, "IExecutionContext.execute_async_v3")
        missing_shapes = self.infer_shapes()
        if missing_shapes:
            _error(self._log, f"enqueueV3: input shapes not set for {missing_shapes}")
            return False
        unbound = [n for n, _, _, _ in self.engine._io if n not in self._addresses]
        if unbound:
            _error(self._log, f"enqueueV3: tensors without an address: {unbound}")
            return False
        if stream_handle == 0:
            _warn(
                self._log,
                "Using default stream in enqueueV3() may lead to performance issues due to "
                "additional calls to cudaStreamSynchronize()",
            )
        # Bindings and shapes are captured now; memory is read when the stream reaches the work.
        shapes = dict(self._shapes)
        addresses = dict(self._addresses)
        inputs = [(n, d) for n, _, d, m in self.engine._io if m == TensorIOMode.INPUT]
        outputs = [(n, d) for n, _, d, m in self.engine._io if m == TensorIOMode.OUTPUT]
        engine = self.engine

        def work() -> None:
            feed = {}
            for name, dtype in inputs:
                dims = shapes[name]
                np_type = np.dtype(nptype(dtype))
                count = int(np.prod(dims)) if dims else 1
                raw = gpu.view(addresses[name], count * np_type.itemsize)
                feed[name] = raw.view(np_type).reshape(tuple(dims)).copy()
            results = engine.session().run([n for n, _ in outputs], feed)
            for (name, dtype), value in zip(outputs, results, strict=True):
                arr: np.ndarray = np.ascontiguousarray(value, dtype=nptype(dtype))
                gpu.view(addresses[name], arr.nbytes)[:] = arr.reshape(-1).view(np.uint8)

        gpu.enqueue(stream_handle, work)
        self.executions += 1
        return True
