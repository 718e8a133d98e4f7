"""Emit the vision graph of a vision-language bundle: CLIP vision tower + projector, float32.

I/O: ``pixel_values [images, 3, image_size, image_size]`` float32 (what
:class:`inference.images.preprocess.ClipPreprocess` makes) -> ``image_features [images,
tokens_per_image, text_hidden]`` float32, the rows that replace the image tokens' embeddings in
the language model (its graph's ``image_features`` input).

Float32 whatever the bundle's precision: the tower and projector are small next to the language
model (CLIP ViT-L/14-336 + projector: ~0.3 B parameters, ~1.2 GB; one image's encode a fraction
of a long prompt's prefill), they run once per image, not once per token, and their output is
compared to transformers' to 1e-4, which a quantized tower would not meet. Default-domain ops
only (opset 18), the same emitter as the decoder graph.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from inference.builder.checkpoint_reader import CheckpointReader
from inference.builder.emit import Emitter, ExternalWeights, activation
from inference.builder.vision_config import VisionConfig

VISION_MODEL = "model.vision.onnx"
VISION_OPSET = 18
VISION_INPUTS = ("pixel_values",)
VISION_OUTPUTS = ("image_features",)


class VitLayers:
    """The pre-norm ViT encoder layer every vision tower here shares (CLIP, SigLIP): LayerNorm,
    multi-head self-attention over all rows, LayerNorm, a two-layer MLP, each with its residual.
    ``v`` names ``hidden_size``, ``num_heads``, ``head_dim``, ``intermediate_size``, ``act`` and
    ``layer_norm_eps``; ``scale_scores``: the attention scale is applied to the scores (Idefics3's
    order of operations) rather than to the queries (CLIP's and Gemma 3's), as transformers does
    for each, so the float rounding is theirs."""

    scale_scores = False

    def __init__(self, v: Any, ckpt: CheckpointReader, em: Emitter) -> None:
        self.v, self.ckpt, self.em = v, ckpt, em

    def linear(self, x: str, module: str, out_dim: int, in_dim: int, bias: bool = True) -> str:
        w = self.ckpt.get_f32(f"{module}.weight", (out_dim, in_dim))
        y = self.em.op1("MatMul", [x, self.em.weight(f"{module}.weight", np.ascontiguousarray(w.T))])
        if bias:
            y = self.em.op1("Add", [y, self.em.weight(f"{module}.bias", self.ckpt.get_f32(f"{module}.bias",
                                                                                          (out_dim,)))])
        return y

    def layer_norm(self, x: str, module: str) -> str:
        d = self.v.hidden_size
        w = self.em.weight(f"{module}.weight", self.ckpt.get_f32(f"{module}.weight", (d,)))
        b = self.em.weight(f"{module}.bias", self.ckpt.get_f32(f"{module}.bias", (d,)))
        return self.em.op1("LayerNormalization", [x, w, b], axis=-1, epsilon=self.v.layer_norm_eps)

    def attention(self, x: str, prefix: str) -> str:
        v, em = self.v, self.em
        d, heads, hd = v.hidden_size, v.num_heads, v.head_dim
        split = em.const(np.array([0, 0, heads, hd], np.int64))

        def heads_of(name: str) -> str:
            y = em.op1("Reshape", [self.linear(x, f"{prefix}.{name}", d, d), split])
            return em.op1("Transpose", [y], perm=[0, 2, 1, 3])  # [N,H,T,hd]

        q, k, val = heads_of("q_proj"), heads_of("k_proj"), heads_of("v_proj")
        scale = em.const(np.float32(hd ** -0.5))
        if not self.scale_scores:
            q = em.op1("Mul", [q, scale])
        scores = em.op1("MatMul", [q, em.op1("Transpose", [k], perm=[0, 1, 3, 2])])
        if self.scale_scores:
            scores = em.op1("Mul", [scores, scale])
        out = em.op1("MatMul", [em.op1("Softmax", [scores], axis=-1), val])
        out = em.op1("Reshape", [em.op1("Transpose", [out], perm=[0, 2, 1, 3]),
                                 em.const(np.array([0, 0, d], np.int64))])
        return self.linear(out, f"{prefix}.out_proj", d, d)

    def layer(self, x: str, i: int) -> str:
        v, em = self.v, self.em
        prefix = f"vision.encoder.layers.{i}"
        attn = self.attention(self.layer_norm(x, f"{prefix}.layer_norm1"), f"{prefix}.self_attn")
        x = em.op1("Add", [x, attn])
        h = self.linear(self.layer_norm(x, f"{prefix}.layer_norm2"), f"{prefix}.mlp.fc1", v.intermediate_size,
                        v.hidden_size)
        h = self.linear(activation(em, h, v.act), f"{prefix}.mlp.fc2", v.hidden_size, v.intermediate_size)
        return em.op1("Add", [x, h])


class _VisionBuilder(VitLayers):
    """LLaVA's CLIP tower: the class row in front, its hidden states selected, the MLP projector."""

    v: VisionConfig

    def embeddings(self) -> str:
        """Patch embeddings with the class row in front, plus positions: [N, P+1, D]."""
        v, em = self.v, self.em
        d, p, c = v.hidden_size, v.patch_size, v.num_channels
        conv_w = em.weight("vision.embeddings.patch_embedding.weight",
                           self.ckpt.get_f32("vision.embeddings.patch_embedding.weight", (d, c, p, p)))
        patches = em.op1("Conv", ["pixel_values", conv_w], kernel_shape=[p, p], strides=[p, p])  # [N,D,g,g]
        patches = em.op1("Reshape", [patches, em.const(np.array([0, d, -1], np.int64))])
        patches = em.op1("Transpose", [patches], perm=[0, 2, 1])  # [N,P,D]
        cls = self.ckpt.get_f32("vision.embeddings.class_embedding", (d,)).reshape(1, 1, d)
        batch = em.op1("Shape", ["pixel_values"], start=0, end=1)
        cls_shape = em.op1("Concat", [batch, em.const(np.array([1, d], np.int64))], axis=0)
        cls_rows = em.op1("Expand", [em.weight("vision.embeddings.class_embedding", cls), cls_shape])
        x = em.op1("Concat", [cls_rows, patches], axis=1)
        positions = em.weight("vision.embeddings.position_embedding.weight", self.ckpt.get_f32(
            "vision.embeddings.position_embedding.weight", (v.num_patches + 1, d)))
        return em.op1("Add", [x, positions])

    def build(self) -> None:
        v, em = self.v, self.em
        hidden = [self.layer_norm(self.embeddings(), "vision.pre_layrnorm")]
        for i in range(v.layers_run):
            hidden.append(self.layer(hidden[-1], i))
        chosen = [hidden[i] for i in v.feature_layers]
        if v.select_strategy == "default":  # without the CLS row
            one, end = em.const(np.array([1])), em.const(np.array([np.iinfo(np.int64).max]))
            chosen = [em.op1("Slice", [h, one, end, one]) for h in chosen]
        x = chosen[0] if len(chosen) == 1 else em.op1("Concat", chosen, axis=-1)
        width = v.hidden_size * len(chosen)
        x = self.linear(x, "projector.linear_1", v.text_hidden_size, width, v.projector_bias)
        x = activation(em, x, v.projector_act)
        y = self.linear(x, "projector.linear_2", v.text_hidden_size, v.text_hidden_size, v.projector_bias)
        em.op("Identity", [y], outputs=["image_features"])


def build_vision_graph(vcfg: VisionConfig, ckpt: CheckpointReader, model_path: Path) -> None:
    """Write ``model_path`` (+ ``<name>.data``): the vision tower and projector of ``vcfg``, reading
    ``vision.*`` and ``projector.*`` from ``ckpt`` (:func:`.vision_config.vision_view`)."""
    weights = ExternalWeights(model_path.with_name(model_path.name + ".data"))
    em = Emitter(weights)
    try:
        _VisionBuilder(vcfg, ckpt, em).build()
    finally:
        weights.close()
    size = vcfg.image_size
    inputs = [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT,
                                            ["images", vcfg.num_channels, size, size])]
    outputs = [helper.make_tensor_value_info("image_features", TensorProto.FLOAT,
                                             ["images", vcfg.tokens_per_image, vcfg.text_hidden_size])]
    graph = helper.make_graph(em.nodes, f"{vcfg.family}_vision", inputs, outputs, em.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", VISION_OPSET)],
                              producer_name="cachesvc-inference")
    model.ir_version = 8
    onnx.save_model(model, str(model_path))
