"""The ``onnxruntime`` builder backend: checkpoint dir -> self-contained bundle dir."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

import onnxruntime as ort
from onnx import TensorProto

from inference.builder.bundle_files import (
    ENGINE_FILE,
    ENGINE_FORMAT_VERSION,
    check_build_dirs,
    copy_tokenizer_files,
    file_sha256,
    memory_fields,
    onnx_weight_bytes,
)
from inference.builder.checkpoint_reader import open_checkpoint
from inference.builder.errors import BuildInputError
from inference.builder.external_data import share_external_data
from inference.builder.graph import GraphIO, Progress, build_decoder_graph
from inference.builder.int4 import quantize_int4
from inference.builder.model_config import ModelConfig, load_model_config
from inference.builder.spec import EngineBuildSpec

# Bump whenever the files a build produces change (graph layout, names, engine.json fields).
# ort-2 / format 2: the CPU graph uses GroupQueryAttention with in-place KV buffers and shares
# model.onnx.data with the portable graph (one weights file per bundle). ort-3: engine.json
# records the memory estimate (weight_bytes, kv_bytes_per_token, memory_bytes).
BUILDER_VERSION = "ort-3"
PORTABLE_MODEL = "model.onnx"
OPTIMIZED_MODEL = "model.ort.onnx"
KV_LAYOUT = "gqa-inplace"


def fused_ops_supported(version: str = ort.__version__) -> bool:
    """Whether this onnxruntime runs the opset-23 Attention/RotaryEmbedding/RMSNormalization on CPU."""
    major, minor = (int(p) for p in version.split(".")[:2])
    return (major, minor) >= (1, 23)


def _optimize(model_path: Path, out_path: Path) -> None:
    """Let onnxruntime optimise the graph once and store the result, so loading skips that work."""
    opts = ort.SessionOptions()
    # EXTENDED, not ALL: ALL adds layout transforms tied to this CPU, and measured no faster.
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    opts.optimized_model_filepath = str(out_path)
    opts.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                  out_path.name + ".data")
    opts.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    opts.log_severity_level = 3
    try:
        ort.InferenceSession(str(model_path), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own untyped errors
        raise RuntimeError(f"onnxruntime could not load the generated graph: {exc}") from exc


def _quantize_int8(fp32_model: Path, out_model: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        fp32_model,
        out_model,
        op_types_to_quantize=["MatMul"],
        weight_type=QuantType.QInt8,
        use_external_data_format=True,
        # DefaultTensorType: shape inference knows no types past com.microsoft ops (the CPU graph).
        extra_options={"MatMulConstBOnly": True, "DefaultTensorType": TensorProto.FLOAT},
    )


def _kv_cache_meta(cfg: ModelConfig, cpu_io: GraphIO, spec: EngineBuildSpec) -> dict[str, Any]:
    """How the CPU engine holds KV: what ``engine.json`` records under ``kv_cache``."""
    return {
        "layout": KV_LAYOUT,
        "model": OPTIMIZED_MODEL,
        "inputs": list(cpu_io.inputs),
        "outputs": list(cpu_io.outputs),
        # One buffer per layer for K and one for V, bound as both past input and present output.
        "buffer_shape": ["slots", cfg.num_kv_heads, spec.max_kv_cache_capacity, cfg.head_dim],
        "dtype": "float32",
        "bytes_per_token": 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4,
        "sliding_window": cfg.sliding_window,
    }


def _metadata(cfg: ModelConfig, io: GraphIO, spec: EngineBuildSpec, source_dtypes: set[str],
              files: dict[str, dict[str, Any]], copied: list[str], seconds: float,
              kv_cache: dict[str, Any]) -> dict[str, Any]:
    return {
        "format_version": ENGINE_FORMAT_VERSION,
        "builder_version": BUILDER_VERSION,
        "backend": "onnxruntime",
        "onnxruntime_version": ort.__version__,
        "architecture": cfg.architecture,
        "model_type": cfg.model_type,
        "opset": io.opset,
        "graph_ops": "opset23-fused" if io.fused_ops else "decomposed",
        "precision": spec.precision,
        "dtype": "float32",
        "source_dtypes": sorted(source_dtypes),
        "portable_model": PORTABLE_MODEL if spec.precision != "int4" else None,
        "optimized_model": OPTIMIZED_MODEL,
        "inputs": list(io.inputs),
        "outputs": list(io.outputs),
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "tied_lm_head": io.tied_lm_head,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_ids": list(cfg.eos_token_ids),
        "max_input_len": spec.max_input_len,
        "max_batch_size": spec.max_batch_size,
        "max_kv_cache_capacity": spec.max_kv_cache_capacity,
        "kv_cache": kv_cache,
        "tokenizer_files": copied,
        "files": files,
        "build_seconds": round(seconds, 3),
    }


def build_bundle(checkpoint_dir: Path, out_dir: Path, spec: EngineBuildSpec,
                 progress: Progress | None = None) -> dict[str, Any]:
    """Build an onnxruntime bundle of ``checkpoint_dir`` into the existing, empty ``out_dir``.

    Writes the portable graph (``model.onnx`` + ``model.onnx.data``), the onnxruntime-optimised
    CPU graph (``model.ort.onnx``: GroupQueryAttention with in-place KV, reading its weights from
    the same ``model.onnx.data``), the tokenizer files and, last, ``engine.json`` (also
    returned). Raises ``BuildInputError`` for checkpoints or specs it cannot build; the caller
    discards ``out_dir`` on any error.
    """
    started = time.monotonic()
    report = progress or (lambda stage, fraction: None)
    checkpoint_dir, out_dir = check_build_dirs(checkpoint_dir, out_dir)
    if not isinstance(spec, EngineBuildSpec):
        raise BuildInputError(f"spec must be an EngineBuildSpec, got {type(spec).__name__}")

    report("read", 0.0)
    cfg = load_model_config(checkpoint_dir)
    ckpt = open_checkpoint(checkpoint_dir)
    fused = fused_ops_supported()
    model_path = out_dir / PORTABLE_MODEL
    optimized_path = out_dir / OPTIMIZED_MODEL
    untie = spec.precision == "int8"
    # Two graphs of the same weights: the portable one (standard ops) and the CPU one
    # (GroupQueryAttention, in-place KV). fp32 intermediates live in a scratch folder.
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".work-") as tmp:
        work = Path(tmp)
        cpu_src = work / "cpu.onnx"
        if spec.precision == "int8":
            fp32_path = work / PORTABLE_MODEL
            io = build_decoder_graph(cfg, ckpt, fp32_path, max_positions=spec.max_kv_cache_capacity,
                                     fused_ops=fused, untie_lm_head=untie, progress=report)
            report("quantize", 0.0)
            _quantize_int8(fp32_path, model_path)
            gqa_fp32 = work / "cpu-fp32.onnx"
            cpu_io = build_decoder_graph(cfg, ckpt, gqa_fp32, max_positions=spec.max_kv_cache_capacity,
                                         fused_ops=fused, untie_lm_head=untie, kv_layout="gqa")
            _quantize_int8(gqa_fp32, cpu_src)
        elif spec.precision == "int4":
            # MatMulNBits is an onnxruntime (com.microsoft) CPU op, allowed in the CPU graph only,
            # and standard ops cannot hold 4-bit weights: an int4 bundle has no portable graph
            # (TensorRT builds its own bundles from the checkpoint). Weights come from the GGUF's
            # own Q4 blocks where the checkpoint has them.
            gqa_fp32 = work / "cpu-fp32.onnx"
            cpu_io = build_decoder_graph(cfg, ckpt, gqa_fp32, max_positions=spec.max_kv_cache_capacity,
                                         fused_ops=fused, kv_layout="gqa", progress=report)
            io = cpu_io
            report("quantize", 0.0)
            quantize_int4(gqa_fp32, cpu_src, checkpoint_dir)
        else:
            io = build_decoder_graph(cfg, ckpt, model_path, max_positions=spec.max_kv_cache_capacity,
                                     fused_ops=fused, progress=report)
            cpu_io = build_decoder_graph(cfg, ckpt, cpu_src, max_positions=spec.max_kv_cache_capacity,
                                         fused_ops=fused, kv_layout="gqa")
        report("optimize", 0.0)
        _optimize(cpu_src, optimized_path)
    if model_path.exists():
        report("share", 0.0)
        share_external_data(model_path, optimized_path)

    copied = copy_tokenizer_files(checkpoint_dir, out_dir)
    report("hash", 0.0)
    files = {
        path.name: {"size": path.stat().st_size, "sha256": file_sha256(path)}
        for path in sorted(out_dir.iterdir())
        if path.is_file() and path.name.startswith("model.")
    }
    kv_cache = _kv_cache_meta(cfg, cpu_io, spec)
    meta = _metadata(cfg, io, spec, ckpt.source_dtypes(), files, copied, time.monotonic() - started,
                     kv_cache)
    meta.update(memory_fields(weight_bytes=onnx_weight_bytes(optimized_path),
                              kv_bytes_per_token=int(kv_cache["bytes_per_token"]),
                              capacity=spec.max_kv_cache_capacity, slots=spec.max_batch_size))
    speculative = spec.speculative_record()
    if speculative is not None:  # absent otherwise: bundles without speculation stay as they were
        meta["speculative"] = speculative
    # engine.json last: its presence marks the bundle's files as complete.
    (out_dir / ENGINE_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    report("done", 1.0)
    return meta
