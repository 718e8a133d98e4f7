"""Qwen2.5-VL's vision side: config.json's ``vision_config`` read and checked, and the vision
graph (``model.vision.onnx``) written: transformers' ``Qwen2_5_VisionTransformerPretrainedModel``
for one image.

Graph I/O (one image of ``n`` patches; :func:`inference.images.qwen2_5_vl.graph_inputs` makes the
inputs from the image's patches and grid in numpy, so the graph has no index arithmetic):
  pixel_patches [n, C*T*P*P] float32 (in window order), rope_cos / rope_sin [n, head_dim] float32,
  window_rows [windows * L] int64, window_mask [windows, L] int32, window_back [n] int64,
  merge_order [n / merge**2] int64 -> image_features [n / merge**2, text hidden] float32.

The patch embedding (a Conv3d whose kernel is its stride) is one MatMul of the flattened patches;
each block is RMSNorm, attention with the 2D rotary embedding (all patches in the
``fullatt_block_indexes`` blocks, else within each window: the windows gathered into a batch of
padded sequences ``[windows, L, hidden]`` with their padding masked out of the keys, and
scattered back), RMSNorm and the SwiGLU MLP with biases; then the merger (RMSNorm, each 2x2 block
of patches side by side, Linear, GELU, Linear) and the merged rows put back in the image's order.
The attention is onnxruntime's ``com.microsoft.MultiHeadAttention`` (the graph runs on the CPU
backend only): its CPU kernel computes a full-attention block without holding the ``[heads, n,
n]`` scores (measured: a 1080p photo's 10,764 patches at Qwen2.5-VL-3B's 16 heads peak at 0.46 GB
where MatMul + Softmax would hold 7.4 GB of scores, and run faster).

Float32 whatever the bundle's precision, for LLaVA's reasons (:mod:`.vision_graph`): the tower
runs once per image, not per token (Qwen2.5-VL-3B/7B's: 0.67 B parameters, 2.7 GB in fp32), and
its features are compared to transformers' to 1e-4; quantized, its error would reach every
image token of the prompt.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from inference.builder.checkpoint_reader import CheckpointReader, prefixed_view
from inference.builder.emit import MS_DOMAIN, Emitter, ExternalWeights, activation
from inference.builder.errors import BuildInputError
from inference.builder.model_config import ModelConfig
from inference.builder.spec import EngineBuildSpec
from inference.builder.vision_config import VISION_ACTIVATIONS, preprocessor_config, text_view, vision_section
from inference.errors import UnsupportedFeatureError
from inference.families import VisionFamily, vision_family_of
from inference.images.qwen2_5_vl import GRAPH_INPUTS, QwenPreprocess, QwenPreprocessError, VisionGeometry

VISION_MODEL = "model.vision.onnx"
VISION_OPSET = 18
VISION_OUTPUTS = ("image_features",)
#: the vision tower's activations by config name (transformers' ACT2FN), as the decoder names them
ACTIVATIONS = {"silu": "silu", **VISION_ACTIVATIONS}
#: transformers' ``Qwen2_5_VLVisionConfig`` defaults
VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32, "hidden_size": 3584, "hidden_act": "silu", "intermediate_size": 3420, "num_heads": 16,
    "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
    "window_size": 112, "out_hidden_size": 3584, "fullatt_block_indexes": [7, 15, 23, 31]}
#: older configs' names of the same fields (transformers reads both)
ALIASES = {"depth": "num_hidden_layers", "num_heads": "num_attention_heads", "in_channels": "in_chans"}
RMS_EPS = 1e-6  # the vision blocks' and the merger's RMSNorm (fixed in transformers)
EXTRA_TOKENS = {"vision_start_token_id": 151652, "vision_end_token_id": 151653}


@dataclass(frozen=True)
class QwenVisionConfig:
    """What the Qwen2.5-VL vision graph computes and how the language model takes its output."""

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    window_size: int
    full_attention: tuple[int, ...]  #: the blocks that attend over the whole image
    act: str
    out_hidden_size: int
    rope_theta: float
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values of one flattened patch (channels x temporal x patch x patch)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def geometry(self) -> VisionGeometry:
        return VisionGeometry(head_dim=self.head_dim, rope_theta=self.rope_theta, patch_size=self.patch_size,
                              merge_size=self.merge_size, window_size=self.window_size)


def _int(vision: Mapping[str, Any], key: str) -> int:
    value = vision.get(key)
    if value is None and key in ALIASES:
        value = vision.get(ALIASES[key])
    if value is None:
        value = VISION_DEFAULTS[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BuildInputError(f"config.json vision_config.{key} must be a positive integer, got {value!r}")
    return value


def _token(raw: Mapping[str, Any], key: str, default: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BuildInputError(f"config.json {key} must be a token id, got {value!r}")
    return value


def vision_config_of(raw: Mapping[str, Any]) -> QwenVisionConfig:
    """The vision side of a Qwen2.5-VL config.json, checked (one line naming the field)."""
    family = vision_family_of(raw)
    assert family is not None
    vision = vision_section(raw, family, family.vision_model_types[0], required=False)
    fields = {key: _int(vision, key) for key in ("depth", "hidden_size", "intermediate_size", "num_heads",
                                                 "in_channels", "patch_size", "temporal_patch_size",
                                                 "spatial_merge_size", "window_size", "out_hidden_size")}
    hidden, heads, depth = fields["hidden_size"], fields["num_heads"], fields["depth"]
    if hidden % heads or (hidden // heads) % 4:
        raise BuildInputError(f"config.json vision_config.hidden_size {hidden} / num_heads {heads} must be a "
                              "head size divisible by 4 (its rotary embedding splits it into rows and "
                              "columns)")
    if fields["in_channels"] != 3:
        raise BuildInputError(f"config.json vision_config.in_channels {fields['in_channels']}: images are "
                              "RGB")
    if fields["window_size"] // fields["spatial_merge_size"] // fields["patch_size"] < 1:
        raise BuildInputError(f"config.json vision_config.window_size {fields['window_size']} is smaller "
                              "than one merged patch (spatial_merge_size * patch_size)")
    full = vision.get("fullatt_block_indexes", VISION_DEFAULTS["fullatt_block_indexes"])
    if not isinstance(full, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in full):
        raise BuildInputError(f"config.json vision_config.fullatt_block_indexes must be a list of block "
                              f"indexes, got {full!r}")
    act = str(vision.get("hidden_act", "silu"))
    if act not in ACTIVATIONS:
        raise UnsupportedFeatureError(f"config.json vision_config.hidden_act {act!r} is not supported; "
                                      f"supported: {', '.join(ACTIVATIONS)}")
    rope = vision.get("rope_parameters") or {}
    theta = rope.get("rope_theta", vision.get("rope_theta", 10000.0)) if isinstance(rope, Mapping) else None
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise BuildInputError(f"config.json vision_config.rope_parameters.rope_theta must be a positive "
                              f"number, got {theta!r}")
    if isinstance(rope, Mapping) and rope.get("rope_type", "axial") != "axial":
        raise UnsupportedFeatureError(f"config.json vision_config.rope_parameters.rope_type "
                                      f"{rope.get('rope_type')!r} is not supported; supported: axial")
    return QwenVisionConfig(
        depth=depth, hidden_size=hidden, intermediate_size=fields["intermediate_size"], num_heads=heads,
        in_channels=3, patch_size=fields["patch_size"], temporal_patch_size=fields["temporal_patch_size"],
        merge_size=fields["spatial_merge_size"], window_size=fields["window_size"],
        full_attention=tuple(sorted({i for i in full if 0 <= i < depth})),  # as transformers' `in`
        act=ACTIVATIONS[act], out_hidden_size=fields["out_hidden_size"], rope_theta=float(theta),
        image_token_id=_token(raw, "image_token_id", 151655),
        **{key: _token(raw, key, default) for key, default in EXTRA_TOKENS.items()},
    )


def load_preprocess(checkpoint_dir: Path, vcfg: QwenVisionConfig) -> QwenPreprocess:
    """The checkpoint's image processor settings, checked against the vision tower's patches."""
    try:
        pre = QwenPreprocess.from_config(preprocessor_config(checkpoint_dir))
    except QwenPreprocessError as exc:
        raise BuildInputError(str(exc)) from None
    for name, ours, theirs in (("patch_size", pre.patch_size, vcfg.patch_size),
                               ("temporal_patch_size", pre.temporal_patch_size, vcfg.temporal_patch_size),
                               ("merge_size", pre.merge_size, vcfg.merge_size)):
        if ours != theirs:
            raise BuildInputError(f"the image processor's {name} {ours} differs from the vision tower's "
                                  f"{theirs} (config.json vision_config)")
    return pre


def vision_view(ckpt: CheckpointReader, family: VisionFamily) -> CheckpointReader:
    """The vision tower's tensors (its patch embedding, blocks and merger) as ``vision.*``."""
    for prefix in family.vision_prefixes:
        if prefix + "patch_embed.proj.weight" in ckpt:
            return prefixed_view(ckpt, {"vision.": prefix})
    raise BuildInputError("the checkpoint has no vision tower "
                          f"({' or '.join(p + 'patch_embed.proj.weight' for p in family.vision_prefixes)})")


class _Builder:
    def __init__(self, v: QwenVisionConfig, ckpt: CheckpointReader, em: Emitter) -> None:
        self.v, self.ckpt, self.em = v, ckpt, em
        self.last_axis = em.const(np.array([-1], np.int64))

    def linear(self, x: str, module: str, out_dim: int, in_dim: int, bias: bool = True) -> str:
        w = self.ckpt.get_f32(f"{module}.weight", (out_dim, in_dim))
        y = self.em.op1("MatMul", [x, self.em.weight(f"{module}.weight", np.ascontiguousarray(w.T))])
        if bias:
            b = self.ckpt.get_f32(f"{module}.bias", (out_dim,))
            y = self.em.op1("Add", [y, self.em.weight(f"{module}.bias", b)])
        return y

    def rms_norm(self, x: str, module: str) -> str:
        """transformers' ``Qwen2_5_VLRMSNorm`` (eps 1e-6): x / sqrt(mean(x^2) + eps) * w."""
        em, d = self.em, self.v.hidden_size
        mean = em.op1("ReduceMean", [em.op1("Mul", [x, x]), self.last_axis], keepdims=1)
        std = em.op1("Sqrt", [em.op1("Add", [mean, em.const(np.float32(RMS_EPS))])])
        w = em.weight(f"{module}.weight", self.ckpt.get_f32(f"{module}.weight", (d,)))
        return em.op1("Mul", [em.op1("Div", [x, std]), w])

    def rotate(self, x: str, cos: str, sin: str) -> str:
        """x [n, heads, hd] rotated: x * cos + rotate_half(x) * sin (cos/sin [n, 1, hd])."""
        em, half = self.em, self.v.head_dim // 2
        x1 = em.op1("Slice", [x, em.const(np.array([0])), em.const(np.array([half])), self.last_axis])
        x2 = em.op1("Slice", [x, em.const(np.array([half])), em.const(np.array([2 * half])), self.last_axis])
        rotated = em.op1("Concat", [em.op1("Neg", [x2]), x1], axis=-1)
        return em.op1("Add", [em.op1("Mul", [x, cos]), em.op1("Mul", [rotated, sin])])

    def attention(self, x: str, i: int, cos: str, sin: str, window: bool) -> str:
        v, em = self.v, self.em
        d, heads, hd = v.hidden_size, v.num_heads, v.head_dim
        prefix = f"vision.blocks.{i}.attn"
        qkv = em.op1("Reshape", [self.linear(x, f"{prefix}.qkv", 3 * d, d),
                                 em.const(np.array([0, 3, heads, hd], np.int64))])  # [n, 3, H, hd]
        q, k, val = (em.op1("Gather", [qkv, em.const(np.array(j, np.int64))], axis=1) for j in range(3))
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)  # [n, H, hd]
        # onnxruntime's MultiHeadAttention: its CPU kernel never holds the [heads, n, n] scores of
        # a full-attention block (a 1080p photo: 10,764 patches, 7.4 GB of scores).
        attrs = {"num_heads": heads, "scale": float(hd ** -0.5)}
        if not window:  # one sequence of every patch
            one = em.const(np.array([1, -1, d], np.int64))
            q3, k3, v3 = (em.op1("Reshape", [t, one]) for t in (q, k, val))
            out = em.op1("MultiHeadAttention", [q3, k3, v3], domain=MS_DOMAIN, **attrs)  # [1, n, D]
        else:  # the windows as padded sequences [W, L, D], their padding masked out of the keys
            longest = em.op1("Shape", ["window_mask"], start=1, end=2)
            blocks = em.op1("Concat", [em.const(np.array([-1], np.int64)), longest,
                                       em.const(np.array([d], np.int64))], axis=0)
            qw, kw, vw = (em.op1("Reshape", [em.op1("Gather", [t, "window_rows"], axis=0), blocks])
                          for t in (q, k, val))
            out = em.op1("MultiHeadAttention", [qw, kw, vw, "", "window_mask"], domain=MS_DOMAIN, **attrs)
            out = em.op1("Gather", [em.op1("Reshape", [out, em.const(np.array([-1, d], np.int64))]),
                                    "window_back"], axis=0)  # [n, D]
        out = em.op1("Reshape", [out, em.const(np.array([-1, d], np.int64))])
        return self.linear(out, f"{prefix}.proj", d, d)

    def block(self, x: str, i: int, cos: str, sin: str) -> str:
        v, em = self.v, self.em
        prefix = f"vision.blocks.{i}"
        window = i not in v.full_attention
        x = em.op1("Add", [x, self.attention(self.rms_norm(x, f"{prefix}.norm1"), i, cos, sin, window)])
        h = self.rms_norm(x, f"{prefix}.norm2")
        gate = self.linear(h, f"{prefix}.mlp.gate_proj", v.intermediate_size, v.hidden_size)
        up = self.linear(h, f"{prefix}.mlp.up_proj", v.intermediate_size, v.hidden_size)
        y = self.linear(em.op1("Mul", [activation(em, gate, v.act), up]), f"{prefix}.mlp.down_proj",
                        v.hidden_size, v.intermediate_size)
        return em.op1("Add", [x, y])

    def build(self) -> None:
        v, em = self.v, self.em
        name = "vision.patch_embed.proj.weight"
        conv = self.ckpt.get_f32(name, (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size,
                                        v.patch_size))
        x = em.op1("MatMul", ["pixel_patches", em.weight(name, np.ascontiguousarray(
            conv.reshape(v.hidden_size, v.patch_dim).T))])
        one = em.const(np.array([1], np.int64))
        cos, sin = (em.op1("Unsqueeze", [t, one]) for t in ("rope_cos", "rope_sin"))  # [n, 1, hd]
        for i in range(v.depth):
            x = self.block(x, i, cos, sin)
        merged = v.hidden_size * v.merge_size ** 2
        x = em.op1("Reshape", [self.rms_norm(x, "vision.merger.ln_q"),
                               em.const(np.array([-1, merged], np.int64))])
        x = activation(em, self.linear(x, "vision.merger.mlp.0", merged, merged), "gelu")
        x = self.linear(x, "vision.merger.mlp.2", v.out_hidden_size, merged)
        em.op("Gather", [x, "merge_order"], outputs=["image_features"], axis=0)


def build_vision_graph(vcfg: QwenVisionConfig, ckpt: CheckpointReader, model_path: Path) -> None:
    """Write ``model_path`` (+ ``<name>.data``): the vision tower and merger of ``vcfg``, reading
    ``vision.*`` from ``ckpt`` (:func:`vision_view`)."""
    weights = ExternalWeights(model_path.with_name(model_path.name + ".data"))
    em = Emitter(weights)
    try:
        _Builder(vcfg, ckpt, em).build()
    finally:
        weights.close()
    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    shapes: dict[str, tuple[int, list[str | int]]] = {
        "pixel_patches": (f32, ["patches", vcfg.patch_dim]),
        "rope_cos": (f32, ["patches", vcfg.head_dim]), "rope_sin": (f32, ["patches", vcfg.head_dim]),
        "window_rows": (i64, ["window_slots"]),
        "window_mask": (TensorProto.INT32, ["windows", "window_length"]),
        "window_back": (i64, ["patches"]), "merge_order": (i64, ["tokens"]),
    }
    inputs = [helper.make_tensor_value_info(name, *shapes[name]) for name in GRAPH_INPUTS]
    outputs = [helper.make_tensor_value_info("image_features", f32, ["tokens", vcfg.out_hidden_size])]
    graph = helper.make_graph(em.nodes, "qwen2_5_vl_vision", inputs, outputs, em.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", VISION_OPSET),
                                                    helper.make_opsetid(MS_DOMAIN, 1)],
                              producer_name="cachesvc-inference")
    model.ir_version = 8
    onnx.save_model(model, str(model_path))


class QwenVisionSide:
    """The vision side of a Qwen2.5-VL checkpoint (:class:`.vision_config.VisionSide`): its tower
    read from config.json on construction (the refusals), then :meth:`check` against the language
    model and the spec, :meth:`build_graph`, :meth:`record`."""

    image_attention = "causal"

    def __init__(self, raw: Mapping[str, Any], text_hidden: int) -> None:
        family = vision_family_of(raw)
        assert family is not None
        self._family: VisionFamily = family
        self.vcfg = vision_config_of(raw)
        self._text_hidden = text_hidden
        self._preprocess: QwenPreprocess | None = None

    def check(self, checkpoint_dir: Path, cfg: ModelConfig, spec: EngineBuildSpec) -> None:
        """The spec and the language model (``BuildInputError`` naming the field), then the image
        processor's settings."""
        family, vcfg = self._family, self.vcfg
        if spec.task != "generate":
            raise BuildInputError(f"task {spec.task!r} is not supported for a vision-language checkpoint "
                                  f"({family.name}); build task 'generate'")
        if spec.lora:
            raise BuildInputError(f"lora is not supported for a vision-language checkpoint ({family.name}) "
                                  "yet")
        if vcfg.out_hidden_size != cfg.hidden_size:
            raise BuildInputError(f"config.json vision_config.out_hidden_size {vcfg.out_hidden_size} differs "
                                  f"from the language model's hidden_size {cfg.hidden_size}")
        for key in ("image_token_id", *EXTRA_TOKENS):
            token = getattr(vcfg, key)
            if not 0 <= token < cfg.vocab_size:
                raise BuildInputError(f"config.json {key} {token} is outside the language model's vocabulary "
                                      f"({cfg.vocab_size})")
        preprocess = load_preprocess(checkpoint_dir, vcfg)
        if preprocess.min_tokens() + 2 >= spec.max_input_len:
            raise BuildInputError(f"the smallest image takes {preprocess.min_tokens()} prompt tokens "
                                  f"(min_pixels {preprocess.min_pixels}) plus its markers; max_input_len "
                                  f"{spec.max_input_len} leaves no room for the text: raise max_input_len")
        self._preprocess = preprocess
        self._text_hidden = cfg.hidden_size

    @property
    def min_image_tokens(self) -> int:
        """The smallest image (``min_pixels``): its rows."""
        assert self._preprocess is not None
        return int(self._preprocess.min_tokens())

    def text_view(self, ckpt: CheckpointReader) -> CheckpointReader:
        """The language model's tensors under a text checkpoint's names."""
        return text_view(ckpt, self._family)

    def build_graph(self, ckpt: CheckpointReader, model_path: Path) -> None:
        """Write the vision graph from the whole checkpoint ``ckpt``."""
        build_vision_graph(self.vcfg, vision_view(ckpt, self._family), model_path)

    def record(self) -> dict[str, Any]:
        """What ``engine.json`` records under ``vision``."""
        v = self.vcfg
        assert self._preprocess is not None
        return {
            "family": "qwen2_5_vl",
            "model": VISION_MODEL,
            "inputs": list(GRAPH_INPUTS),
            "outputs": list(VISION_OUTPUTS),
            "precision": "fp32",
            "image_token_id": v.image_token_id,
            "placeholder_id": v.image_token_id,
            "tokens_per_image": None,  # it follows each image's size
            "feature_size": self._text_hidden,
            "vision_start_token_id": v.vision_start_token_id,
            "vision_end_token_id": v.vision_end_token_id,
            "preprocess": self._preprocess.record(),
            "geometry": v.geometry.record(),
        }


def vision_side(raw: Mapping[str, Any], text_hidden: int) -> QwenVisionSide:
    """The family hook (:attr:`inference.families.VisionFamily.builder`): this checkpoint's side."""
    return QwenVisionSide(raw, text_hidden)
