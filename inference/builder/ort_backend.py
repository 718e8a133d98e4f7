"""The ``onnxruntime`` builder backend: checkpoint dir -> self-contained bundle dir."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from inference.build_profile import (
    KV_CACHE_NUMPY_DTYPES,
    QUANTIZED_PRECISIONS,
    ProfileError,
    check_image_limits_fit,
    image_limits,
)
from inference.builder.bundle_files import (
    ENGINE_FILE,
    ENGINE_FORMAT_VERSION,
    check_build_dirs,
    copy_tokenizer_files,
    file_sha256,
    memory_fields,
    onnx_weight_bytes,
)
from inference.builder.checkpoint_reader import CheckpointReader, open_checkpoint
from inference.builder.decoder_layers import quantized_experts
from inference.builder.errors import BuildInputError
from inference.builder.external_data import share_external_data
from inference.builder.graph import GraphIO, Progress, build_decoder_graph, check_gqa_rotary
from inference.builder.kernel_plan import KernelPlan, candidate_plans, float_plan
from inference.builder.model_config import ModelConfig, load_model_config, load_raw_config
from inference.builder.quality import MIN_AGREEMENT, Quality, run_gate
from inference.builder.spec import EngineBuildSpec
from inference.builder.vision_config import (
    VisionConfig,
    VisionSide,
    load_preprocess,
    processor_chat_template,
    text_view,
    vision_config_from,
    vision_family,
    vision_side_from,
    vision_view,
)
from inference.builder.vision_graph import VISION_INPUTS, VISION_MODEL, VISION_OUTPUTS, build_vision_graph
from inference.cpu_class import cpu_class
from inference.images.preprocess import ClipPreprocess
from inference.runtime.embedding_batches import working_bytes
from inference.runtime.ort_session import available_cores

# Bump whenever the files a build produces change (graph layout, names, engine.json fields).
# ort-2 / format 2: the CPU graph uses GroupQueryAttention with in-place KV buffers and shares
# model.onnx.data with the portable graph (one weights file per bundle). ort-3: engine.json
# records the memory estimate (weight_bytes, kv_bytes_per_token, memory_bytes). ort-4: int8 and
# int4 are MatMulNBits written per CPU class (``kernels``), 8-bit embedding and lm_head with
# exact top-k rescoring, and a quality gate (``quality``); no portable graph for them. ort-5:
# the gate chooses the layers' kernel plan (``kernels.name``, ``quality.candidates``); int8
# layers are always two 4-bit planes. ort-6: a two-term plan among the candidates
# (``kernels.two_term``, ``quality.candidates[].slower_than_exact``). Figures added to
# ``quality`` (a two-term candidate's ``exact_decode_tok_s``, timed side by side) bump nothing:
# nothing reads them back, and a bundle without them is served the same way. ort-7: the CPU
# graph's residual add + RMS norm is one SkipSimplifiedLayerNormalization (``fusions.py``) and
# Q4_1 block sums at small K one MatMul (``quantized.py``): 150 of SmolLM2's 867 ops a step (int4).
BUILDER_VERSION = "ort-7"
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


def _kv_cache_meta(cfg: ModelConfig, cpu_io: GraphIO, spec: EngineBuildSpec) -> dict[str, Any]:
    """How the CPU engine holds KV: what ``engine.json`` records under ``kv_cache``."""
    itemsize = np.dtype(KV_CACHE_NUMPY_DTYPES[spec.kv_cache_dtype]).itemsize
    own = [i for i in range(cfg.num_layers) if cfg.kv_source(i) == i]
    meta: dict[str, Any] = {
        "layout": KV_LAYOUT,
        "model": OPTIMIZED_MODEL,
        "inputs": list(cpu_io.inputs),
        "outputs": list(cpu_io.outputs),
        # One buffer per layer for K and one for V, bound as both past input and present output.
        "buffer_shape": ["slots", cfg.num_kv_heads, spec.max_kv_cache_capacity, cfg.head_dim],
        "dtype": KV_CACHE_NUMPY_DTYPES[spec.kv_cache_dtype],
        "bytes_per_token": sum(2 * cfg.kv_heads_of(i) * cfg.head_dim_of(i) * itemsize for i in own),
        "sliding_window": cfg.sliding_window,
    }
    return meta


def kv_layers_meta(cfg: ModelConfig) -> dict[str, Any]:
    """``engine.json``'s ``kv_layers`` where layers differ (Gemma 4): per layer its K/V heads, head
    size and the layer whose K/V it attends over (itself, or the earlier layer it shares them with)."""
    if cfg.uniform_kv:
        return {}
    return {"kv_layers": [{"kv_heads": cfg.kv_heads_of(i), "head_dim": cfg.head_dim_of(i),
                           "source": cfg.kv_source(i)} for i in range(cfg.num_layers)]}


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
        "portable_model": None if spec.precision in QUANTIZED_PRECISIONS else PORTABLE_MODEL,
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
        **kv_layers_meta(cfg),
        "tokenizer_files": copied,
        "files": files,
        "build_seconds": round(seconds, 3),
        # Mixture of experts: onnxruntime's MoE op over fp32 experts, or QMoE over int4 ones.
        **({"moe": {"num_experts": cfg.moe.num_experts, "top_k": cfg.moe.top_k,
                    "experts_precision": "int4" if spec.precision == "int4" and quantized_experts(cfg, 4)
                    else "fp32",
                    "sparse_layers": list(cfg.moe.sparse_layers)}} if cfg.moe is not None else {}),
    }


def _build_embedding(cfg: ModelConfig, ckpt: CheckpointReader, checkpoint_dir: Path, out_dir: Path,
                     spec: EngineBuildSpec, report: Progress, started: float, fused: bool) -> dict[str, Any]:
    """An embedding bundle: the portable fp32 graph pooled by ``spec.pooling`` (``model.onnx``),
    the tokenizer files and ``engine.json`` (``task`` ``embed``; no KV cache)."""
    model_path = out_dir / PORTABLE_MODEL
    io = build_decoder_graph(cfg, ckpt, model_path, max_positions=spec.max_kv_cache_capacity,
                             fused_ops=fused, pooling=spec.pooling, progress=report)
    copied = copy_tokenizer_files(checkpoint_dir, out_dir)
    report("hash", 0.0)
    files = {path.name: {"size": path.stat().st_size, "sha256": file_sha256(path)}
             for path in sorted(out_dir.iterdir()) if path.is_file() and path.name.startswith("model.")}
    meta = _metadata(cfg, io, spec, ckpt.source_dtypes(), files, copied, time.monotonic() - started, {})
    del meta["kv_cache"]
    meta.update(
        optimized_model=None,
        task="embed",
        pooling=spec.pooling,
        embedding_dim=cfg.hidden_size,
        # Matryoshka-trained models embed well in their leading slices too: ``dimensions``
        # below the full size is allowed for them only (at the listed sizes where they list some).
        matryoshka=_matryoshka(checkpoint_dir, cfg.hidden_size),
        **memory_fields(weight_bytes=onnx_weight_bytes(model_path), kv_bytes_per_token=0,
                        capacity=spec.max_kv_cache_capacity, slots=spec.max_batch_size),
    )
    # No KV cache; what a run takes instead (the runtime's estimate counts the same).
    meta["memory_bytes"] += working_bytes(meta)
    (out_dir / ENGINE_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    report("done", 1.0)
    return meta


def _matryoshka(checkpoint_dir: Path, hidden: int) -> dict[str, Any] | None:
    """What the checkpoint's config says of truncation, as vLLM reads it: ``matryoshka_dimensions``
    (the sizes allowed) or ``is_matryoshka`` (any size); None when it says neither."""
    try:
        raw = json.loads((checkpoint_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dims = raw.get("matryoshka_dimensions")
    if isinstance(dims, list) and dims and all(isinstance(d, int) and 0 < d <= hidden for d in dims):
        return {"dimensions": sorted(set(dims))}
    if raw.get("is_matryoshka") is True:
        return {"dimensions": None}
    return None


def _check_vision_spec(vcfg: VisionConfig, cfg: ModelConfig, spec: EngineBuildSpec) -> None:
    """What a vision-language bundle cannot be built with (one line naming the field)."""
    if spec.task != "generate":
        raise BuildInputError(f"task {spec.task!r} is not supported for a vision-language checkpoint "
                              f"({vcfg.family}); build task 'generate'")
    if spec.lora:
        raise BuildInputError(f"lora is not supported for a vision-language checkpoint ({vcfg.family}) yet")
    if not 0 <= vcfg.image_token_id < cfg.vocab_size:
        raise BuildInputError(f"config.json image_token_index {vcfg.image_token_id} is outside the language "
                              f"model's vocabulary ({cfg.vocab_size})")
    if vcfg.tokens_per_image >= spec.max_input_len:
        raise BuildInputError(f"one image takes {vcfg.tokens_per_image} prompt tokens; max_input_len "
                              f"{spec.max_input_len} leaves no room for the text: raise max_input_len")
    _check_image_limits(vcfg.tokens_per_image, spec, f"a {vcfg.family} checkpoint")


def _check_image_limits(tokens_per_image: int | None, spec: EngineBuildSpec, model: str) -> None:
    """The profile's image-token limits fit the model (none for a text model)."""
    try:
        check_image_limits_fit(tokens_per_image, spec.max_image_tokens, spec.max_image_tokens_per_image,
                               model=model)
    except ProfileError as exc:
        raise BuildInputError(str(exc)) from None


def _side_limits(side: VisionSide, spec: EngineBuildSpec) -> dict[str, int | None]:
    """The image-token limits a family with a vision builder of its own records: the profile's;
    unset, a request's images within ``max_input_len`` and no bound of its own on one image (its
    images' tokens vary with their size; the server refuses what does not fit)."""
    return {"max_image_tokens": spec.max_image_tokens or spec.max_input_len,
            "max_image_tokens_per_image": spec.max_image_tokens_per_image}


def _vision_record(vcfg: VisionConfig, preprocess: ClipPreprocess, spec: EngineBuildSpec) -> dict[str, Any]:
    """What ``engine.json`` records under ``vision``: the vision graph, how images become its
    input, how its output enters the prompt, and the image tokens a request and an image may
    take (the profile's limits, else the model's: what the server enforces)."""
    total, per = image_limits(vcfg.tokens_per_image, spec.max_image_tokens, spec.max_image_tokens_per_image,
                              spec.max_input_len)
    return {
        "family": vcfg.family,
        "model": VISION_MODEL,
        "inputs": list(VISION_INPUTS),
        "outputs": list(VISION_OUTPUTS),
        "precision": "fp32",
        "image_size": vcfg.image_size,
        "image_token_id": vcfg.image_token_id,
        "tokens_per_image": vcfg.tokens_per_image,
        "feature_size": vcfg.text_hidden_size,
        "preprocess": preprocess.record(),
        "max_image_tokens": total,
        "max_image_tokens_per_image": per,
    }


def _vision_parts(raw: dict[str, Any], checkpoint_dir: Path, cfg: ModelConfig, ckpt: CheckpointReader,
                  spec: EngineBuildSpec,
                  ) -> tuple[VisionConfig | None, VisionSide | None, ClipPreprocess | None, CheckpointReader,
                             CheckpointReader | None]:
    """The checkpoint's vision side, checked against ``spec``: (the CLIP-style vision config, the
    family's own vision builder, the CLIP preprocessing, the text view of ``ckpt``, the vision
    view of it); the vision parts are None for a text checkpoint."""
    vcfg = vision_config_from(raw, cfg.hidden_size)
    side = vision_side_from(raw, cfg.hidden_size)  # a family with a vision builder of its own
    vision_ckpt: CheckpointReader | None = None
    preprocess: ClipPreprocess | None = None
    if vcfg is not None:
        _check_vision_spec(vcfg, cfg, spec)
        preprocess = load_preprocess(checkpoint_dir, vcfg)
        family = vision_family(raw)
        vision_ckpt = vision_view(ckpt, family)
        ckpt = text_view(ckpt, family)
    if side is not None:
        side.check(checkpoint_dir, cfg, spec)
        _check_image_limits(side.min_image_tokens, spec, f"{checkpoint_dir.name} ({cfg.architecture})")
        vision_ckpt = ckpt
        ckpt = side.text_view(ckpt)
    elif vcfg is None:
        _check_image_limits(None, spec, f"{checkpoint_dir.name} ({cfg.architecture})")
    return vcfg, side, preprocess, ckpt, vision_ckpt


def _write_decoder_graphs(cfg: ModelConfig, ckpt: CheckpointReader, checkpoint_dir: Path, out_dir: Path,
                          spec: EngineBuildSpec, report: Progress, *, fused: bool, images: bool,
                          attention: str, kernels_override: KernelPlan | None, min_agreement: float,
                          reference_file: Path | None,
                          ) -> tuple[GraphIO, GraphIO, KernelPlan | None, Quality | None]:
    """:func:`build_bundle`'s decoder graphs: the portable and CPU graphs (fp32) or the quantized CPU
    graph, optimised, through the quality gate when it applies. Returns the portable graph's I/O
    (the CPU graph's when there is no portable one), the CPU graph's, the kernels kept and the
    gate's figures."""
    model_path = out_dir / PORTABLE_MODEL
    optimized_path = out_dir / OPTIMIZED_MODEL
    kernels: KernelPlan | None = None
    plans: list[KernelPlan] = []
    quality: Quality | None = None
    kv_dtype = KV_CACHE_NUMPY_DTYPES[spec.kv_cache_dtype]
    if spec.precision in QUANTIZED_PRECISIONS:
        plans = ([kernels_override] if kernels_override is not None
                 else candidate_plans(spec.precision, spec.cpu_class or cpu_class(), spec.kernels))
        # The graph is written once, with the exact plan's levels; the gate retargets them.
        kernels = plans[-1]
    # fp32 weights with float16 KV: the gate judges the KV dtype alone (one float plan, strict).
    gated = kernels is not None or kv_dtype != "float32"
    # fp32: two graphs of the same weights, the portable one (standard ops) and the CPU one
    # (GroupQueryAttention, in-place KV). Quantized: the CPU graph only, since MatMulNBits and
    # GatherBlockQuantized are onnxruntime (com.microsoft) ops that TensorRT cannot run, plus
    # an fp32 reference of it in a scratch folder for the quality gate.
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".work-") as tmp:
        work = Path(tmp)
        cpu_src = work / "cpu.onnx"
        if kernels is None:
            io = build_decoder_graph(cfg, ckpt, model_path, max_positions=spec.max_kv_cache_capacity,
                                     fused_ops=fused, progress=report, image_inputs=images,
                                     image_attention=attention)
            cpu_io = build_decoder_graph(cfg, ckpt, cpu_src, max_positions=spec.max_kv_cache_capacity,
                                         fused_ops=fused, kv_layout="gqa", lora=spec.lora, kv_dtype=kv_dtype,
                                         image_inputs=images, image_attention=attention)
        else:
            report("quantize", 0.0)
            cpu_io = io = build_decoder_graph(
                cfg, ckpt, cpu_src, max_positions=spec.max_kv_cache_capacity, fused_ops=fused,
                kv_layout="gqa", kernels=kernels, progress=report, lora=spec.lora, kv_dtype=kv_dtype,
                image_inputs=images, image_attention=attention)
        report("optimize", 0.0)
        _optimize(cpu_src, optimized_path)
        if gated:
            report("quality", 0.0)
            def fp32_reference() -> tuple[Path, dict[str, np.ndarray]]:
                # Its weights stay in memory: only its graph is written (on this machine's disk,
                # writing SmolLM2's 540 MB took 2.5 s, a third of the gate). Built only when
                # fp32's answers are not in ``reference_file`` already.
                reference = work / "reference.onnx"
                weights: dict[str, np.ndarray] = {}
                build_decoder_graph(cfg, ckpt, reference, max_positions=spec.max_kv_cache_capacity,
                                    fused_ops=fused, kv_layout="gqa", weights_in=weights, image_inputs=images,
                                    image_attention=attention)
                return reference, weights

            gate_meta = {
                **_metadata(cfg, io, spec, set(), {}, [], 0.0, _kv_cache_meta(cfg, cpu_io, spec)),
                "optimized_model": OPTIMIZED_MODEL,
            }
            measured = [work / "measured.onnx", work / "measured.onnx.data"]

            def relayout(plan: KernelPlan | None) -> KernelPlan | None:
                """int8 layers at level 4 as 8-bit codes (see KernelPlan.int8_layout): the
                chosen plan's graph written again; None puts back the graph the gate measured."""
                written = [optimized_path, optimized_path.with_name(optimized_path.name + ".data")]
                if plan is None:
                    for kept, path in zip(measured, written, strict=True):
                        os.replace(kept, path)
                    return None
                if plan.weight_bits != 8 or not plan.int8_groups or plan.int8_layout == "codes":
                    return None
                for path, kept in zip(written, measured, strict=True):
                    os.replace(path, kept)
                codes = replace(plan, int8_layout="codes")
                build_decoder_graph(cfg, ckpt, work / "codes.onnx", max_positions=spec.max_kv_cache_capacity,
                                    fused_ops=fused, kv_layout="gqa", kernels=codes, lora=spec.lora,
                                    kv_dtype=kv_dtype, image_inputs=images, image_attention=attention)
                _optimize(work / "codes.onnx", optimized_path)
                return codes

            chosen, quality = run_gate(
                fp32_reference, optimized_path, gate_meta, checkpoint_dir, cpu_class=cpu_class(),
                threads=available_cores(), plans=plans or [float_plan(spec.precision, cpu_class())],
                threshold=min_agreement, mode="forced" if kernels_override is not None else spec.kernels,
                reference_file=reference_file, strict=kernels is None,
                relayout=None if kernels_override is not None or kernels is None else relayout)
            kernels = chosen if kernels is not None else None
    return io, cpu_io, kernels, quality


def build_bundle(checkpoint_dir: Path, out_dir: Path, spec: EngineBuildSpec,
                 progress: Progress | None = None, *, kernels_override: KernelPlan | None = None,
                 min_agreement: float = MIN_AGREEMENT, reference_file: Path | None = None) -> dict[str, Any]:
    """Build an onnxruntime bundle of ``checkpoint_dir`` into the existing, empty ``out_dir``.

    Writes the portable graph (``model.onnx`` + ``model.onnx.data``), the onnxruntime-optimised
    CPU graph (``model.ort.onnx``: GroupQueryAttention with in-place KV, reading its weights from
    the same ``model.onnx.data``), the tokenizer files and, last, ``engine.json`` (also
    returned). int4 and int8 bundles hold the CPU graph only, with the quantized kernels of
    ``spec.cpu_class`` (default: this machine's): the quality gate (:mod:`.quality`;
    ``min_agreement``) measures the class's kernel plans on this machine as ``spec.kernels`` says
    and keeps the fastest that passes (``kernels_override`` forces one plan instead, for tests
    and benches). ``reference_file`` keeps fp32's answers for the next build of these weights.
    Raises ``BuildInputError`` (``QualityGateError`` for the gate) for checkpoints or specs it
    cannot build; the caller discards ``out_dir`` on any error.
    """
    started = time.monotonic()
    report = progress or (lambda stage, fraction: None)
    checkpoint_dir, out_dir = check_build_dirs(checkpoint_dir, out_dir)
    if not isinstance(spec, EngineBuildSpec):
        raise BuildInputError(f"spec must be an EngineBuildSpec, got {type(spec).__name__}")

    report("read", 0.0)
    cfg = load_model_config(checkpoint_dir)
    ckpt: CheckpointReader = open_checkpoint(checkpoint_dir)
    fused = fused_ops_supported()
    raw = load_raw_config(checkpoint_dir)
    vcfg, side, preprocess, ckpt, vision_ckpt = _vision_parts(raw, checkpoint_dir, cfg, ckpt, spec)
    images = vcfg is not None or side is not None
    # How the image rows attend in the language model (Gemma 3: both ways within an image).
    attention = side.image_attention if side is not None else "causal"
    if spec.task == "embed":
        return _build_embedding(cfg, ckpt, checkpoint_dir, out_dir, spec, report, started, fused)
    check_gqa_rotary(cfg)  # the CPU graph's head and rotary sizes, before any graph is written
    model_path = out_dir / PORTABLE_MODEL
    optimized_path = out_dir / OPTIMIZED_MODEL
    io, cpu_io, kernels, quality = _write_decoder_graphs(
        cfg, ckpt, checkpoint_dir, out_dir, spec, report, fused=fused, images=images, attention=attention,
        kernels_override=kernels_override, min_agreement=min_agreement, reference_file=reference_file)
    if model_path.exists():
        report("share", 0.0)
        share_external_data(model_path, optimized_path)

    if vcfg is not None:
        assert vision_ckpt is not None
        report("vision", 0.0)
        build_vision_graph(vcfg, vision_ckpt, out_dir / VISION_MODEL)
    if side is not None:
        assert vision_ckpt is not None
        report("vision", 0.0)
        side.build_graph(vision_ckpt, out_dir / VISION_MODEL)
    copied = copy_tokenizer_files(checkpoint_dir, out_dir)
    template = processor_chat_template(checkpoint_dir) if images else None
    if template is not None and "chat_template.jinja" not in copied:
        # The processor's template (it places the images) as the file the tokenizer loader reads first.
        (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
        copied.append("chat_template.jinja")
    report("hash", 0.0)
    files = {
        path.name: {"size": path.stat().st_size, "sha256": file_sha256(path)}
        for path in sorted(out_dir.iterdir())
        if path.is_file() and path.name.startswith("model.")
    }
    kv_cache = _kv_cache_meta(cfg, cpu_io, spec)
    meta = _metadata(cfg, io, spec, ckpt.source_dtypes(), files, copied, time.monotonic() - started,
                     kv_cache)
    vision_bytes = onnx_weight_bytes(out_dir / VISION_MODEL) if images else 0
    meta.update(memory_fields(weight_bytes=onnx_weight_bytes(optimized_path) + vision_bytes,
                              kv_bytes_per_token=int(kv_cache["bytes_per_token"]),
                              capacity=spec.max_kv_cache_capacity, slots=spec.max_batch_size))
    if kernels is not None:
        meta["kernels"] = kernels.record()
    if quality is not None:
        meta["quality"] = quality.record()
    if spec.lora:  # absent otherwise, as speculative below
        meta["lora"] = True
    if vcfg is not None and preprocess is not None:  # absent otherwise: text bundles stay as they were
        meta["vision"] = _vision_record(vcfg, preprocess, spec)
    if side is not None:
        meta["vision"] = {**side.record(), **_side_limits(side, spec)}
    speculative = spec.speculative_record()
    if speculative is not None:  # absent otherwise: bundles without speculation stay as they were
        meta["speculative"] = speculative
    # engine.json last: its presence marks the bundle's files as complete.
    (out_dir / ENGINE_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    report("done", 1.0)
    return meta
