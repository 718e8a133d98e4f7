"""The ``tensorrt`` builder backend: checkpoint dir -> TensorRT engine bundle (GPU).

The engine is built from the same portable ONNX graph the onnxruntime backend writes
(default-domain ops only; TensorRT cannot parse ``com.microsoft`` ops), in the form this
TensorRT parses: the opset-23 ``Attention``/``RotaryEmbedding``/``RMSNormalization`` ops from
TensorRT 10.15 on, the decomposed opset-18 graph before. Two edits make it a TensorRT graph:
``logits_to_keep`` becomes the constant 1 (the runtime only ever reads the last position, and a
data-dependent output shape would make it a host shape tensor), and for ``int8`` every MatMul
weight is stored as int8 with a per-output-channel scale behind a ``DequantizeLinear``
(weight-only quantization; activations stay fp16).

One optimization profile covers the bundle's shapes: batch 1..max_batch_size, new tokens
1..max_input_len, past 0..max_kv_cache_capacity-1 (a step always adds a token, so the total
stays within the capacity). A timing cache per GPU arch and TensorRT version lives in the
directory the caller passes (the cache root's ``trt-timing/``), read and merged under a file
lock, written atomically, so concurrent builds share it safely.

Only ``tensorrt`` and ``pycuda`` are imported here, and only inside :func:`build_trt_bundle`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import portalocker
from onnx import helper, numpy_helper

from inference.build_profile import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_INPUT_LEN,
    DEFAULT_MAX_KV_CACHE_CAPACITY,
    ProfileError,
    check_backend_precision,
    check_shapes,
)
from inference.builder.bundle_files import (
    ENGINE_FILE,
    ENGINE_FORMAT_VERSION,
    check_build_dirs,
    copy_tokenizer_files,
    file_sha256,
    memory_fields,
)
from inference.builder.checkpoint_reader import CheckpointReader, open_checkpoint
from inference.builder.errors import BuildInputError
from inference.builder.graph import Progress, build_decoder_graph
from inference.builder.model_config import ModelConfig, load_model_config
from inference.cuda_device import CudaDevice, cuda_device
from inference.families import VISION_FAMILIES
from inference.trt_logging import collecting_logger

log = logging.getLogger("inference.builder.trt")

# Bump whenever the files a build produces change (graph edits, plan inputs, engine.json fields).
TRT_BUILDER_VERSION = "trt-2"
ENGINE_PLAN = "engine.plan"
TIMING_CACHE_DIR = "trt-timing"
#: Precisions the TensorRT builder takes: fp16/bf16 compute (norms kept in fp32), fp32, int8 weight-only.
TIMING_LOCK_TIMEOUT = 600.0
_LOCK_LOG_INTERVAL = 5.0


#: Vision-language architectures: their vision graph and image inputs exist on the CPU backend only.
VISION_ARCHITECTURES = frozenset(a for f in VISION_FAMILIES for a in f.architectures)


def parses_fused_ops(trt_version: str) -> bool:
    """Whether this TensorRT parses Attention (10.14+) and RotaryEmbedding/RMSNormalization (10.15+)."""
    major, minor = (int(p) for p in trt_version.split(".")[:2])
    return (major, minor) >= (10, 15)


@dataclass(frozen=True)
class TrtBuildSpec:
    """What to build with TensorRT: precision, shape limits, where the shared timing cache lives."""

    precision: str = "fp16"
    max_input_len: int = DEFAULT_MAX_INPUT_LEN
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_kv_cache_capacity: int = DEFAULT_MAX_KV_CACHE_CAPACITY
    timing_cache_dir: Path | None = None
    workspace_bytes: int | None = None

    def __post_init__(self) -> None:
        try:
            check_backend_precision("tensorrt", self.precision)
            check_shapes(self.max_input_len, self.max_batch_size, self.max_kv_cache_capacity)
        except ProfileError as exc:
            raise BuildInputError(str(exc)) from None


# --- the graph TensorRT gets -------------------------------------------------------------------
def _fix_logits_to_keep(model: onnx.ModelProto) -> None:
    graph = model.graph
    keep = [i for i in graph.input if i.name == "logits_to_keep"]
    for value in keep:
        graph.input.remove(value)
    graph.initializer.append(numpy_helper.from_array(np.array([1], dtype=np.int64), "logits_to_keep"))


def _quantize_weights_int8(model: onnx.ModelProto) -> int:
    """Weight-only int8: each constant MatMul weight [in, out] -> int8, a per-column scale and a
    DequantizeLinear in front of the MatMul. Returns how many weights it quantized."""
    inits = {t.name: t for t in model.graph.initializer}
    new_nodes: list[onnx.NodeProto] = []
    count = 0
    for node in model.graph.node:
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is not None and len(weight.dims) == 2:
            w = numpy_helper.to_array(weight).astype(np.float32)
            scale = np.maximum(np.abs(w).max(axis=0), 1e-12) / 127.0
            q = np.clip(np.rint(w / scale), -127, 127).astype(np.int8)
            model.graph.initializer.remove(weight)
            qname, sname, dq = f"{weight.name}_int8", f"{weight.name}_scale", f"{weight.name}_dq"
            model.graph.initializer.extend(
                [numpy_helper.from_array(q, qname), numpy_helper.from_array(scale.astype(np.float32), sname)]
            )
            new_nodes.append(
                helper.make_node("DequantizeLinear", [qname, sname], [dq], name=f"{dq}_node", axis=1)
            )
            node.input[1] = dq
            count += 1
        new_nodes.append(node)
    del model.graph.node[:]
    model.graph.node.extend(new_nodes)
    return count


def write_trt_graph(
    cfg: ModelConfig,
    ckpt: CheckpointReader,
    work_dir: Path,
    *,
    fused_ops: bool,
    precision: str,
    max_positions: int,
    progress: Progress,
) -> Path:
    """Write the ONNX graph TensorRT will parse into ``work_dir``; return its path."""
    portable = work_dir / "model.onnx"
    build_decoder_graph(
        cfg,
        ckpt,
        portable,
        max_positions=max_positions,
        fused_ops=fused_ops,
        untie_lm_head=precision == "int8",
        progress=progress,
    )
    out = work_dir / "trt.onnx"
    if precision == "int8":
        model = onnx.load(str(portable), load_external_data=True)
        _fix_logits_to_keep(model)
        _quantize_weights_int8(model)
        onnx.save_model(
            model,
            str(out),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location="trt.onnx.data",
            size_threshold=1024,
        )
    else:
        # The weights stay in model.onnx.data; the edited graph beside it still points there.
        model = onnx.load(str(portable), load_external_data=False)
        _fix_logits_to_keep(model)
        onnx.save_model(model, str(out))
    return out


# --- timing cache ------------------------------------------------------------------------------
def timing_cache_path(cache_dir: Path, device: CudaDevice, trt_version: str) -> Path:
    """One timing cache per GPU arch and TensorRT version."""
    return cache_dir / f"{device.arch}-trt{trt_version}.cache"


@contextlib.contextmanager
def _locked(path: Path, timeout: float = TIMING_LOCK_TIMEOUT) -> Iterator[None]:
    """Exclusive flock on ``<path>.lock``; logs while it waits, gives up after ``timeout``."""
    lock_path = path.with_name(path.name + ".lock")
    started = last_log = time.monotonic()
    with lock_path.open("a") as fh:
        while True:
            try:
                portalocker.lock(fh, portalocker.LOCK_EX | portalocker.LOCK_NB)
                break
            except portalocker.exceptions.LockException:
                now = time.monotonic()
                if now - started > timeout:
                    raise TimeoutError(f"timing cache {path} stayed locked for {timeout:.0f} s") from None
                if now - last_log >= _LOCK_LOG_INTERVAL:
                    log.info("waiting for the timing cache lock %s (%.0f s)", lock_path, now - started)
                    last_log = now
                time.sleep(0.05)
        try:
            yield
        finally:
            portalocker.unlock(fh)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _load_timing_cache(trt: Any, config: Any, path: Path | None) -> None:
    blob = b""
    if path is not None and path.is_file():
        with _locked(path):
            blob = path.read_bytes()
    cache = config.create_timing_cache(blob)
    if not config.set_timing_cache(cache, False):
        # A cache from another TensorRT/GPU: start empty rather than mix tactics across devices.
        log.warning("timing cache %s does not match this TensorRT and GPU; starting an empty one", path)
        config.set_timing_cache(config.create_timing_cache(b""), False)


def _save_timing_cache(config: Any, path: Path) -> None:
    built = config.get_timing_cache()
    if built is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        # Another build may have written since we read it: merge into what is there now.
        merged = config.create_timing_cache(path.read_bytes() if path.is_file() else b"")
        if not merged.combine(built, False):
            merged = built
        _write_atomic(path, bytes(merged.serialize()))


# --- the TensorRT build ------------------------------------------------------------------------
def _norm_layers(network: Any, trt: Any) -> list[Any]:
    """Layers that compute RMS norms: the fused NORMALIZATION layers, or in the decomposed graph
    each mean-of-squares REDUCE with the square before it and the add/sqrt/div after it."""
    producers: dict[str, Any] = {}
    consumers: dict[str, list[Any]] = {}
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    for layer in layers:
        for i in range(layer.num_outputs):
            producers[layer.get_output(i).name] = layer
        for i in range(layer.num_inputs):
            tensor = layer.get_input(i)
            if tensor is not None:
                consumers.setdefault(tensor.name, []).append(layer)
    picked: dict[str, Any] = {}
    for layer in layers:
        if layer.type == trt.LayerType.NORMALIZATION:
            picked[layer.name] = layer
        elif layer.type == trt.LayerType.REDUCE:
            picked[layer.name] = layer
            square = producers.get(layer.get_input(0).name)
            if square is not None and square.type == trt.LayerType.ELEMENTWISE:
                picked[square.name] = square
            frontier = [layer]
            for _ in range(3):  # reduce -> +eps -> sqrt -> divide
                frontier = [
                    c
                    for f in frontier
                    for c in consumers.get(f.get_output(0).name, [])
                    if c.type in (trt.LayerType.ELEMENTWISE, trt.LayerType.UNARY)
                ]
                picked.update((c.name, c) for c in frontier)
    return list(picked.values())


def _profile_shapes(cfg: ModelConfig, spec: TrtBuildSpec) -> dict[str, tuple[tuple[int, ...], ...]]:
    b, s, cap = spec.max_batch_size, spec.max_input_len, spec.max_kv_cache_capacity
    kv, hd = cfg.num_kv_heads, cfg.head_dim
    past_opt = min(cap - 1, 512)
    # opt: decode (one new token per row, every slot busy) is what runs most.
    tokens = ((1, 1), (b, 1), (b, s))
    shapes: dict[str, tuple[tuple[int, ...], ...]] = {
        "input_ids": tokens,
        "position_ids": tokens,
        "attention_mask": ((1, 1), (b, past_opt + 1), (b, cap)),
    }
    for i in range(cfg.num_layers):
        for kind in ("key", "value"):
            shapes[f"past_key_values.{i}.{kind}"] = (
                (1, kv, 0, hd),
                (b, kv, past_opt, hd),
                (b, kv, cap - 1, hd),
            )
    return shapes


def _build_plan(
    trt: Any,
    onnx_path: Path,
    shapes: dict[str, tuple[tuple[int, ...], ...]],
    spec: TrtBuildSpec,
    cache_path: Path | None,
) -> tuple[bytes, list[str]]:
    logger = collecting_logger(trt)
    builder = trt.Builder(logger)
    # TensorRT 10: explicit batch is implicit (EXPLICIT_BATCH is deprecated); not strongly typed,
    # so the precision flags and per-layer precisions below apply.
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise BuildInputError(f"TensorRT {trt.__version__} cannot parse the graph: {'; '.join(errors)}")
    config = builder.create_builder_config()
    if spec.workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, spec.workspace_bytes)
    fp32_layers: list[str] = []
    if spec.precision == "fp32":
        # TF32 is on by default and rounds matmul inputs to 10 mantissa bits; fp32 means fp32.
        config.clear_flag(trt.BuilderFlag.TF32)
    if spec.precision in ("fp16", "bf16", "int8"):
        config.set_flag(trt.BuilderFlag.BF16 if spec.precision == "bf16" else trt.BuilderFlag.FP16)
        if spec.precision == "int8":
            config.set_flag(trt.BuilderFlag.INT8)
        # Norms in fp32: the square of a hidden state overflows fp16, and the reduction loses bits.
        config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        for layer in _norm_layers(network, trt):
            layer.precision = trt.float32
            for i in range(layer.num_outputs):
                layer.set_output_type(i, trt.float32)
            fp32_layers.append(layer.name)
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.items():
        profile.set_shape(name, lo, opt, hi)
    if config.add_optimization_profile(profile) < 0:
        raise BuildInputError(f"TensorRT rejected the optimization profile: {'; '.join(logger.errors)}")
    _load_timing_cache(trt, config, cache_path)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError(f"TensorRT failed to build the engine: {'; '.join(logger.errors) or 'no message'}")
    if cache_path is not None:
        _save_timing_cache(config, cache_path)
    return bytes(plan), fp32_layers


def build_trt_bundle(
    checkpoint_dir: Path, out_dir: Path, spec: TrtBuildSpec, progress: Progress | None = None
) -> dict[str, Any]:
    """Build a TensorRT bundle of ``checkpoint_dir`` into the existing, empty ``out_dir``.

    Writes ``engine.plan``, the tokenizer files and, last, ``engine.json`` (also returned), which
    records the TensorRT version, the GPU name and its compute capability: a plan runs only
    there. Raises ``BuildInputError`` for inputs it cannot build, ``RuntimeError`` when TensorRT
    fails; the caller discards ``out_dir`` on any error.
    """
    import tensorrt as trt

    started = time.monotonic()
    report = progress or (lambda stage, fraction: None)
    checkpoint_dir, out_dir = check_build_dirs(checkpoint_dir, out_dir)
    if not isinstance(spec, TrtBuildSpec):
        raise BuildInputError(f"spec must be a TrtBuildSpec, got {type(spec).__name__}")
    device = cuda_device(0)
    version = str(trt.__version__)
    report("read", 0.0)
    cfg = load_model_config(checkpoint_dir)
    if not cfg.uniform_kv:
        from inference.errors import UnsupportedFeatureError
        raise UnsupportedFeatureError(
            f"{cfg.family}: layers with their own K/V shapes or sharing another layer's K/V (Gemma 4) are "
            "built for the CPU engine only; the TensorRT engine holds one K/V shape for every layer")
    if cfg.architecture in VISION_ARCHITECTURES:
        raise BuildInputError(f"{cfg.architecture} (a vision-language model) is built by the onnxruntime "
                              "backend only; build it with backend onnxruntime")
    ckpt = open_checkpoint(checkpoint_dir)
    fused = parses_fused_ops(version)
    shapes = _profile_shapes(cfg, spec)
    cache_path = None
    if spec.timing_cache_dir is not None:
        Path(spec.timing_cache_dir).mkdir(parents=True, exist_ok=True)
        cache_path = timing_cache_path(Path(spec.timing_cache_dir), device, version)
    # The ONNX graph is an intermediate: the plan holds the weights, so it stays out of the bundle.
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".onnx-") as tmp:
        onnx_path = write_trt_graph(
            cfg,
            ckpt,
            Path(tmp),
            fused_ops=fused,
            precision=spec.precision,
            max_positions=spec.max_kv_cache_capacity,
            progress=report,
        )
        report("tensorrt", 0.0)
        plan, fp32_layers = _build_plan(trt, onnx_path, shapes, spec, cache_path)
    (out_dir / ENGINE_PLAN).write_bytes(plan)
    copied = copy_tokenizer_files(checkpoint_dir, out_dir)
    report("hash", 0.0)
    plan_path = out_dir / ENGINE_PLAN
    meta = {
        "format_version": ENGINE_FORMAT_VERSION,
        "builder_version": TRT_BUILDER_VERSION,
        "backend": "tensorrt",
        "tensorrt_version": version,
        "gpu_name": device.name,
        "compute_capability": device.compute_capability,
        "device_arch": device.arch,
        "architecture": cfg.architecture,
        "model_type": cfg.model_type,
        "graph_ops": "opset23-fused" if fused else "decomposed",
        "precision": spec.precision,
        "fp32_layers": len(fp32_layers),
        "engine_file": ENGINE_PLAN,
        "inputs": [n for n in shapes],
        "outputs": ["logits"] + [f"present.{i}.{k}" for i in range(cfg.num_layers) for k in ("key", "value")],
        "profile": {name: [list(d) for d in dims] for name, dims in shapes.items()},
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_ids": list(cfg.eos_token_ids),
        "max_input_len": spec.max_input_len,
        "max_batch_size": spec.max_batch_size,
        "max_kv_cache_capacity": spec.max_kv_cache_capacity,
        "source_dtypes": sorted(ckpt.source_dtypes()),
        "tokenizer_files": copied,
        "files": {ENGINE_PLAN: {"size": plan_path.stat().st_size, "sha256": file_sha256(plan_path)}},
        "build_seconds": round(time.monotonic() - started, 3),
    }
    # KV lives in device memory in the plan's activation type: fp32 only for fp32 plans.
    kv_item = 4 if spec.precision == "fp32" else 2
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_item
    meta.update(memory_fields(weight_bytes=plan_path.stat().st_size, kv_bytes_per_token=kv_per_token,
                              capacity=spec.max_kv_cache_capacity, slots=spec.max_batch_size))
    # engine.json last: its presence marks the bundle's files as complete.
    (out_dir / ENGINE_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    report("done", 1.0)
    return meta
