"""Emit the portable ONNX decoder graph of a checkpoint, weights streamed to external data.

Default-domain ops only, so the same file feeds ONNX Runtime and TensorRT. Two flavours of
the same computation: ``fused_ops`` uses the opset-23 ``Attention`` / ``RotaryEmbedding`` /
``RMSNormalization`` ops; otherwise everything is decomposed into opset-18 primitives for
runtimes that do not know those ops yet.

A third flavour, ``kv_layout="gqa"``, is the ONNX Runtime-specific CPU variant of the same
decoder (same weights, same names): attention and rotary embedding run in
``com.microsoft.GroupQueryAttention``, whose past and present K/V are one preallocated buffer
``[B, kv_heads, max_T, head_dim]`` that the engine binds as both input and output, so a step
writes only the new positions in place. Its I/O:
  input_ids [B,S] int64, seqlens_k [B] int32 (past length + S - 1 per row), total_sequence_length
  [] int32, logits_to_keep [1] int64, past_key_values.{i}.key/value [B,kv_heads,max_T,head_dim]
  -> logits [B,K,vocab], present.{i}.key/value (the same buffers).
``kv_dtype="float16"`` (gqa only) holds those buffers in float16 (``--kv-cache-dtype fp16``): q/k/v
and the rope tables enter GroupQueryAttention in float16 and its output returns to float32, so
everything else computes as before; half the KV memory and half the bytes a stored prefix
copies.

Portable graph I/O (B = batch, S = new tokens, P = past length, T = P + S):
  input_ids [B,S] int64, attention_mask [B,T] int64 (0 = left padding), position_ids [B,S] int64,
  logits_to_keep [1] int64 (0 = all positions, k = the last k), past_key_values.{i}.key/value
  [B,kv_heads,P,head_dim] -> logits [B,K,vocab], present.{i}.key/value [B,kv_heads,T,head_dim].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from inference.build_profile import KV_CACHE_NUMPY_DTYPES, POOLING_METHODS
from inference.builder.checkpoint_reader import CheckpointReader
from inference.builder.decoder_layers import (
    _DecoderBuilder,
    past_names,
    present_names,
)
from inference.builder.emit import MS_DOMAIN, Emitter, ExternalWeights
from inference.builder.errors import BuildInputError
from inference.builder.fusions import fuse_skip_norms
from inference.builder.kernel_plan import KernelPlan
from inference.builder.layout import names_for
from inference.builder.model_config import ModelConfig
from inference.builder.quantized import (
    GgufBlocks,
    QuantizedEmitter,
)

FUSED_OPSET = 23
KV_LAYOUTS = ("portable", "gqa")
#: K/V buffer element types of the gqa graph -> their ONNX type (float16: ``--kv-cache-dtype fp16``).
KV_DTYPES: dict[str, int] = {name: helper.np_dtype_to_tensor_dtype(np.dtype(name))
                             for name in KV_CACHE_NUMPY_DTYPES.values()}
DECOMPOSED_OPSET = 18

Progress = Callable[[str, float], None]


@dataclass(frozen=True)
class GraphIO:
    """Names of the graph's inputs and outputs, in order."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    opset: int
    fused_ops: bool
    tied_lm_head: bool
    kv_layout: str = "portable"


def check_gqa_rotary(cfg: ModelConfig) -> None:
    """Refuse a head or rotary size GroupQueryAttention cannot run (one line, naming the fields).

    Measured on onnxruntime's CPU GroupQueryAttention: head_size must be a multiple of 8, and of
    16 where it rotates; a rotary span (the cos/sin tables' width, rotary_dim / 2) must be a
    multiple of 8."""
    for layer in range(cfg.num_layers):
        hd, rot = cfg.head_dim_of(layer), cfg.rotary_of(layer)
        rotates = cfg.rope_of(layer) is not None
        if hd % 8 or (rotates and hd % 16):
            raise BuildInputError(
                f"head_dim {hd} is not supported by the CPU engine (onnxruntime GroupQueryAttention needs a "
                f"multiple of {16 if rotates else 8}{' with rotary embeddings' if rotates else ''})")
        if rotates and rot != hd and (rot // 2) % 8:
            raise BuildInputError(
                f"partial_rotary_factor {rot / hd:g} of head_dim {hd} rotates {rot} dimensions per head; "
                "the CPU engine (onnxruntime GroupQueryAttention) needs rotary dimensions / 2 to be a "
                "multiple of 8")


def _finish_logits(em: Emitter, cfg: ModelConfig) -> None:
    """The family's logit scale and soft-capping after the lm_head (which writes ``logits``)."""
    if cfg.logits_scale == 1.0 and not cfg.final_softcap:
        return
    for node in em.nodes:
        for j, out in enumerate(node.output):
            if out == "logits":
                node.output[j] = "logits_raw"
    y = "logits_raw"
    if cfg.logits_scale != 1.0:
        y = em.op1("Mul", [y, em.const(np.float32(cfg.logits_scale))])
    if cfg.final_softcap:
        cap = em.const(np.float32(cfg.final_softcap))
        y = em.op1("Mul", [em.op1("Tanh", [em.op1("Div", [y, cap])]), cap])
    em.op("Identity", [y], outputs=["logits"])


def _check_options(cfg: ModelConfig, *, kv_layout: str, kernels: KernelPlan | None, lora: bool,
                   kv_dtype: str, image_inputs: bool, image_attention: str, pooling: str | None) -> None:
    """Refuse a combination of :func:`build_decoder_graph`'s options the graphs cannot hold."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
    gqa = kv_layout == "gqa"
    if gqa:
        check_gqa_rotary(cfg)
    if kernels is not None and not gqa:
        raise ValueError("quantized weights are onnxruntime ops: only the gqa graph can hold them")
    if lora and not gqa:
        raise ValueError("LoRA inputs are written into the gqa graph only")
    if kv_dtype not in KV_DTYPES or (kv_dtype != "float32" and not gqa):
        raise ValueError(f"kv_dtype must be one of {tuple(KV_DTYPES)} (float16: gqa only), got {kv_dtype!r}")
    if image_attention not in ("causal", "bidirectional") or (image_attention != "causal"
                                                               and not image_inputs):
        raise ValueError(f"image_attention must be 'causal' or, with image_inputs, 'bidirectional'; got "
                         f"{image_attention!r}")
    if pooling is not None and (gqa or pooling not in POOLING_METHODS):
        raise ValueError(f"pooling must be one of {POOLING_METHODS} on the portable graph, got {pooling!r}")


def _emit_decoder(b: _DecoderBuilder, cfg: ModelConfig, weights: ExternalWeights, *,
                  progress: Progress | None, pooling: str | None, untie_lm_head: bool,
                  image_inputs: bool) -> bool:
    """Emit the decoder's nodes (embedding, layers, final norm, then pooling or the lm_head);
    return whether the lm_head is tied to the embedding. Closes ``weights``."""
    em = b.em
    try:
        b.build_rope_tables()
        x, embed = b.embedding()
        x = b.scaled(x, cfg.embed_scale)
        if image_inputs:
            x = em.op1("ScatterND", [x, "image_rows", "image_features"])
        if cfg.per_layer_input:
            b.per_layer_inputs_of("input_ids", x)
        for i in range(cfg.num_layers):
            x = b.layer(x, i)
            if progress is not None:
                progress("graph", (i + 1) / (cfg.num_layers + 1))
        x = b.norm(x, b.names.top("final_norm"), cfg.hidden_size)
        if pooling is not None:
            b.pool(x, pooling)
            tied = False
        else:
            starts = em.op1("Neg", ["logits_to_keep"])
            x = em.op1("Slice", [x, starts, em.const(np.array([np.iinfo(np.int64).max])),
                                 em.const(np.array([1]))])
            _, tied = b.lm_head(x, embed, untie_lm_head)
            _finish_logits(em, cfg)
    finally:
        weights.close()

    return tied


def _graph_values(cfg: ModelConfig, em: Emitter, b: _DecoderBuilder, *, gqa: bool, pooling: str | None,
                 kv_dtype: str, image_inputs: bool,
                 ) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    """The graph's inputs and outputs, in order (the image inputs' empty defaults join ``em``)."""
    def kv_shapes(i: int) -> tuple[list[str | int | None], list[str | int | None]]:
        kvh, hd = cfg.kv_heads_of(i), cfg.head_dim_of(i)
        if gqa:
            return ["batch", kvh, "max_sequence_length", hd], ["batch", kvh, "max_sequence_length", hd]
        return ["batch", kvh, "past_sequence_length", hd], ["batch", kvh, "total_sequence_length", hd]

    total: list[str | int | None] = ["batch", "total_sequence_length"]
    positions: list[str | int | None] = ["batch", "sequence_length"]
    if cfg.mrope_section:  # temporal, height, width ids per token
        positions = [3, *positions]
    if gqa:
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence_length"]),
            helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
            helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
            helper.make_tensor_value_info("logits_to_keep", TensorProto.INT64, [1]),
        ]
        if cfg.mrope_section:
            inputs.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, positions))
    else:
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence_length"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, total),
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, positions),
            helper.make_tensor_value_info("logits_to_keep", TensorProto.INT64, [1]),
        ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "logits_length",
                                                                           cfg.vocab_size])]
    if pooling is not None:
        inputs.pop()  # logits_to_keep
        outputs = [helper.make_tensor_value_info("embeddings", TensorProto.FLOAT, ["batch", cfg.hidden_size])]
    kv_elem = KV_DTYPES[kv_dtype]
    for i in range(cfg.num_layers):
        kv_shape_in, kv_shape_out = kv_shapes(i)
        for name in past_names(i):
            inputs.append(helper.make_tensor_value_info(name, kv_elem, kv_shape_in))
        if pooling is None:
            for name in present_names(i):
                outputs.append(helper.make_tensor_value_info(name, kv_elem, kv_shape_out))
    inputs.extend(b.lora_inputs)
    if image_inputs:
        image_defaults: dict[str, np.ndarray] = {
            "image_features": np.zeros((0, cfg.hidden_size), np.float32),
            "image_rows": np.zeros((0, 2), np.int64)}
        for name, default in image_defaults.items():
            em.initializers.append(numpy_helper.from_array(default, name))
            shape: list[str | int | None] = ["image_rows", int(default.shape[1])]
            inputs.append(helper.make_tensor_value_info(
                name, helper.np_dtype_to_tensor_dtype(default.dtype), shape))
    return inputs, outputs


def build_decoder_graph(cfg: ModelConfig, ckpt: CheckpointReader, model_path: Path, *,
                        max_positions: int, fused_ops: bool, untie_lm_head: bool = False,
                        progress: Progress | None = None, kv_layout: str = "portable",
                        kernels: KernelPlan | None = None, pooling: str | None = None,
                        lora: bool = False, weights_in: dict[str, np.ndarray] | None = None,
                        kv_dtype: str = "float32", image_inputs: bool = False,
                        image_attention: str = "causal") -> GraphIO:
    """Write ``model_path`` (+ ``<name>.data``) for ``cfg``; return the graph's I/O names.

    ``kv_layout`` "portable" writes the standard-op graph; "gqa" the ONNX Runtime CPU variant
    with in-place KV buffers (see the module docstring). ``kernels`` (gqa only) writes the
    quantized weights it names (:mod:`inference.builder.quantized`), taking the GGUF's own
    blocks where the checkpoint has them.

    ``pooling`` (portable only) writes an embedding graph instead: the final hidden states are
    pooled over the sequence ("last": the last position, real for every row since padding is on
    the left; "mean": the mean over ``attention_mask``), L2-normalised and returned as
    ``embeddings [B, hidden]``; no ``logits_to_keep`` input, no lm_head, no present outputs.

    ``lora`` (gqa only) adds a LoRA input pair to every projection of every layer (q/k/v/o,
    gate/up/down: ``model.layers.{i}.self_attn.q_proj.lora_A`` ...), overridable initializers
    of rank 0 that an onnxruntime adapter (:mod:`inference.builder.lora`) replaces per run.

    ``kv_dtype`` (gqa only) is the K/V buffers' element type: ``float32`` or ``float16``.

    ``image_inputs`` (a vision-language bundle's language model) adds two inputs that replace
    rows of the token embeddings: ``image_features [n, hidden]`` float32 and ``image_rows [n, 2]``
    int64 (batch row, position in the chunk), applied by one ``ScatterND`` after the embedding
    (after its scale: transformers swaps the scaled rows). Both default to empty (n = 0), so a
    run that binds neither (decode, the quality gate) computes the text graph's values; without
    ``image_inputs`` the graph is the text graph, byte for byte.

    ``image_attention`` "bidirectional" (Gemma 3) lets the image rows of a chunk attend to one
    another both ways, each run of consecutive rows one image (:mod:`.image_attention`); "causal"
    (the default) leaves the graph as it was.

    ``weights_in`` (a dict) receives the large weights by name instead of ``<name>.data``, which
    is then not written: open the graph with ``cpu_session(..., initializers=weights_in)``.
    """
    _check_options(cfg, kv_layout=kv_layout, kernels=kernels, lora=lora, kv_dtype=kv_dtype,
                   image_inputs=image_inputs, image_attention=image_attention, pooling=pooling)
    gqa = kv_layout == "gqa"
    weights = ExternalWeights(model_path.with_name(model_path.name + ".data"), weights_in)
    em = Emitter(weights)
    quant = None if kernels is None else QuantizedEmitter(em, kernels, GgufBlocks(ckpt))
    if quant is not None and kernels is not None:
        # The plan's projection groups are by Llama's names: find a family's by slot.
        names, level_of = names_for(cfg), kernels.level_of
        quant.level_of = lambda weight: level_of(names.as_llama(weight))
    b = _DecoderBuilder(cfg, ckpt, em, max_positions=max_positions, fused_ops=fused_ops, kv_layout=kv_layout,
                        quant=quant, lora=lora, kv_fp16=kv_dtype == "float16",
                        image_attention=image_attention)
    tied = _emit_decoder(b, cfg, weights, progress=progress, pooling=pooling, untie_lm_head=untie_lm_head,
                         image_inputs=image_inputs)
    inputs, outputs = _graph_values(cfg, em, b, gqa=gqa, pooling=pooling, kv_dtype=kv_dtype,
                                    image_inputs=image_inputs)
    opset = FUSED_OPSET if fused_ops else DECOMPOSED_OPSET
    if gqa and fused_ops:  # the CPU graph: onnxruntime's one-op residual add + RMS norm
        em.nodes = fuse_skip_norms(em.nodes, {t.name for t in em.initializers})
    graph = helper.make_graph(em.nodes, f"{cfg.model_type}_decoder", inputs, outputs, em.initializers)
    opsets = [helper.make_opsetid("", opset)]
    if gqa:
        opsets.append(helper.make_opsetid(MS_DOMAIN, 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="cachesvc-inference")
    model.ir_version = 10 if fused_ops else 8
    onnx.save_model(model, str(model_path))
    return GraphIO(
        inputs=tuple(i.name for i in inputs),
        outputs=tuple(o.name for o in outputs),
        opset=opset,
        fused_ops=fused_ops,
        tied_lm_head=tied,
        kv_layout=kv_layout,
    )
