"""Gemma 3's vision side for the builder: config.json -> :class:`Gemma3VisionConfig`, the
preprocessing and image tokens of its processor, the vision graph and ``engine.json``'s record.

The graph (``model.vision.onnx``, float32): ``pixel_values [images, 3, size, size]`` -> SigLIP
(a patch convolution with bias, learned positions, no class row; pre-norm encoder layers with
LayerNorm and gelu-tanh MLPs; ``post_layernorm``) -> Gemma 3's projector (the patch grid
average-pooled to ``mm_tokens_per_image`` rows, Gemma's RMSNorm with ``(1 + w)``, a matmul by
``mm_input_projection_weight``) -> ``image_features [images, mm_tokens_per_image, text_hidden]``.

Float32 whatever the bundle's precision, as LLaVA's: the tower is small next to the language model
(Gemma 3 4B's SigLIP-So400m + projector: ~0.42 B parameters, 1.7 GB in float32), it runs once per
image, not once per token, and its features are compared to transformers' to 1e-4, which a
quantized tower would not meet.

In the prompt an image is ``<start_of_image>`` + ``mm_tokens_per_image`` image tokens +
``<end_of_image>``, with ``"\\n\\n"`` on either side written into the text before tokenization (as
Gemma3Processor does: the newlines merge with the text around them), and its image tokens attend
to one another both ways in the language model (the decoder's ``image_attention``
"bidirectional").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from inference.builder.checkpoint_reader import CheckpointReader, prefixed_view
from inference.builder.emit import Emitter, ExternalWeights
from inference.builder.errors import BuildInputError
from inference.builder.model_config import ModelConfig
from inference.builder.spec import EngineBuildSpec
from inference.builder.vision_config import (
    PREPROCESSOR_FILE,
    PROCESSOR_FILE,
    VISION_ACTIVATIONS,
    _first_present,
    _positive,
    _read_object,
    check_heads,
    text_view,
    vision_section,
)
from inference.builder.vision_graph import (
    VISION_INPUTS,
    VISION_MODEL,
    VISION_OPSET,
    VISION_OUTPUTS,
    VitLayers,
)
from inference.errors import UnsupportedFeatureError
from inference.families import VisionFamily, vision_family_of
from inference.images.gemma3 import gemma3_preprocess
from inference.images.preprocess import ClipPreprocess, PreprocessConfigError

FAMILY = "gemma3"
#: What Gemma3Processor writes on either side of an image's tokens (``full_image_sequence``).
TEXT_AROUND = "\n\n"
#: Gemma3Config's and Gemma3Processor's defaults.
DEFAULT_TOKENS = 256
DEFAULT_BOI, DEFAULT_EOI, DEFAULT_IMAGE = 255999, 256000, 262144


@dataclass(frozen=True)
class Gemma3VisionConfig:
    """The SigLIP tower, the projector, and the tokens of one image."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    act: str
    #: feature rows of one image (``mm_tokens_per_image``)
    rows: int
    text_hidden_size: int
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_side(self) -> int:
        return math.isqrt(self.rows)

    @property
    def pool(self) -> int:
        """The average pool's kernel and stride (patches per image row per output row)."""
        return self.patches_per_side // self.tokens_per_side

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of one image: ``<start_of_image>``, its rows, ``<end_of_image>``."""
        return self.rows + 2


def _token(raw: Mapping[str, Any], keys: tuple[str, ...], default: int) -> int:
    value = next((raw[k] for k in keys if k in raw), default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BuildInputError(f"config.json {keys[0]} must be a token id, got {value!r}")
    return value


def config_from(raw: Mapping[str, Any], text_hidden: int) -> Gemma3VisionConfig:
    """Gemma 3's vision side of a config.json (refusals name the field)."""
    family = vision_family_of(raw)
    assert family is not None and family.name == FAMILY
    vision = vision_section(raw, family, "siglip_vision_model")
    where = "vision_config."
    # SiglipVisionConfig's defaults
    hidden = _positive(vision, "hidden_size", where, 768)
    heads = _positive(vision, "num_attention_heads", where, 12)
    image_size = _positive(vision, "image_size", where, 224)
    patch = _positive(vision, "patch_size", where, 16)
    check_heads(hidden, heads)
    if image_size % patch:
        raise BuildInputError(f"config.json vision_config.image_size {image_size} is not a multiple of "
                              f"patch_size {patch}")
    act = str(vision.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in VISION_ACTIVATIONS:
        raise UnsupportedFeatureError(f"config.json vision_config.hidden_act {act!r} is not supported; "
                                      f"supported: {', '.join(VISION_ACTIVATIONS)}")
    rows = _positive(raw, "mm_tokens_per_image", "", DEFAULT_TOKENS)
    side, per_side = math.isqrt(rows), image_size // patch
    if side * side != rows or per_side % side:
        raise BuildInputError(
            f"config.json mm_tokens_per_image {rows} must be a square whose side divides the "
            f"{per_side} patches per side of the vision tower (average pooling to whole rows)")
    return Gemma3VisionConfig(
        hidden_size=hidden, intermediate_size=_positive(vision, "intermediate_size", where, 3072),
        num_heads=heads, num_layers=_positive(vision, "num_hidden_layers", where, 12),
        image_size=image_size, patch_size=patch, num_channels=_positive(vision, "num_channels", where, 3),
        layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)), act=VISION_ACTIVATIONS[act], rows=rows,
        text_hidden_size=text_hidden,
        image_token_id=_token(raw, ("image_token_index", "image_token_id"), DEFAULT_IMAGE),
        boi_token_id=_token(raw, ("boi_token_index", "boi_token_id"), DEFAULT_BOI),
        eoi_token_id=_token(raw, ("eoi_token_index", "eoi_token_id"), DEFAULT_EOI),
    )


def read_processor(checkpoint_dir: Path, vcfg: Gemma3VisionConfig) -> ClipPreprocess:
    """The checkpoint's image preprocessing and its processor's ``image_seq_length``:
    ``preprocessor_config.json`` (the hub's layout; ``image_seq_length`` there or in
    ``processor_config.json``), else ``processor_config.json``'s ``image_processor`` (transformers 5)."""
    folder = Path(checkpoint_dir)
    processor = _read_object(folder / PROCESSOR_FILE) if (folder / PROCESSOR_FILE).is_file() else {}
    if (folder / PREPROCESSOR_FILE).is_file():
        image = _read_object(folder / PREPROCESSOR_FILE)
    elif isinstance(processor.get("image_processor"), dict):
        image = processor["image_processor"]
    else:
        raise BuildInputError(f"{checkpoint_dir} has no {PREPROCESSOR_FILE} or {PROCESSOR_FILE} "
                              "image_processor; a vision-language checkpoint needs its image processor's "
                              "settings (save the processor with the model)")
    try:
        pre = gemma3_preprocess(image)
        size = pre.output_size()
    except PreprocessConfigError as exc:
        raise BuildInputError(str(exc)) from None
    if size != (vcfg.image_size, vcfg.image_size):
        raise BuildInputError(f"the image processor makes {size[0]}x{size[1]} images; the vision tower takes "
                              f"{vcfg.image_size}x{vcfg.image_size}")
    if vcfg.num_channels != 3:
        raise BuildInputError(f"config.json vision_config.num_channels {vcfg.num_channels}: images are RGB")
    seq = processor.get("image_seq_length", image.get("image_seq_length", DEFAULT_TOKENS))
    if seq != vcfg.rows:
        raise BuildInputError(f"the processor's image_seq_length {seq!r} differs from config.json "
                              f"mm_tokens_per_image {vcfg.rows}")
    return pre


def token_text(checkpoint_dir: Path, token_id: int, what: str) -> str:
    """The text of a special token (tokenizer.json ``added_tokens``): the placeholder the chat template
    writes, which the server's text expansion finds."""
    path = Path(checkpoint_dir) / "tokenizer.json"
    added = _read_object(path).get("added_tokens", []) if path.is_file() else []
    for entry in added if isinstance(added, list) else []:
        if isinstance(entry, dict) and entry.get("id") == token_id and isinstance(entry.get("content"), str):
            return str(entry["content"])
    raise BuildInputError(f"the tokenizer (tokenizer.json added_tokens) has no token {token_id}, "
                          f"config.json's {what}")


class _SiglipBuilder(VitLayers):
    """SigLIP (no class row, a convolution with bias) and Gemma 3's projector."""

    v: Gemma3VisionConfig

    def embeddings(self) -> str:
        """Patch embeddings (the convolution's bias included) plus positions: [N, P, D]."""
        v, em = self.v, self.em
        d, p, c = v.hidden_size, v.patch_size, v.num_channels
        name = "vision.embeddings.patch_embedding"
        conv_w = em.weight(f"{name}.weight", self.ckpt.get_f32(f"{name}.weight", (d, c, p, p)))
        conv_b = em.weight(f"{name}.bias", self.ckpt.get_f32(f"{name}.bias", (d,)))
        patches = em.op1("Conv", ["pixel_values", conv_w, conv_b], kernel_shape=[p, p], strides=[p, p])
        patches = em.op1("Reshape", [patches, em.const(np.array([0, d, -1], np.int64))])
        patches = em.op1("Transpose", [patches], perm=[0, 2, 1])  # [N,P,D]
        positions = em.weight("vision.embeddings.position_embedding.weight", self.ckpt.get_f32(
            "vision.embeddings.position_embedding.weight", (v.patches_per_side ** 2, d)))
        return em.op1("Add", [patches, positions])

    def projector(self, x: str) -> str:
        """Gemma3MultiModalProjector: [N, P, D] -> the grid [N, D, g, g] average-pooled to
        [N, D, t, t] -> [N, t*t, D] -> RMSNorm (float32, times 1 + w) -> matmul -> [N, t*t, text]."""
        v, em = self.v, self.em
        d, g = v.hidden_size, v.patches_per_side
        grid = em.op1("Reshape", [em.op1("Transpose", [x], perm=[0, 2, 1]),
                                  em.const(np.array([0, d, g, g], np.int64))])
        pooled = em.op1("AveragePool", [grid], kernel_shape=[v.pool, v.pool], strides=[v.pool, v.pool])
        rows = em.op1("Transpose", [em.op1("Reshape", [pooled, em.const(np.array([0, d, -1], np.int64))])],
                      perm=[0, 2, 1])
        mean_sq = em.op1("ReduceMean", [em.op1("Mul", [rows, rows]), em.const(np.array([-1], np.int64))],
                         keepdims=1)
        eps = em.const(np.float32(v.layer_norm_eps))
        rms = em.op1("Sqrt", [em.op1("Add", [mean_sq, eps])])
        normed = em.op1("Mul", [rows, em.op1("Reciprocal", [rms])])
        w = self.ckpt.get_f32("projector.mm_soft_emb_norm.weight", (d,))
        normed = em.op1("Mul", [normed, em.weight("projector.mm_soft_emb_norm.weight.plus1",
                                                  (1.0 + w).astype(np.float32))])
        proj = self.ckpt.get_f32("projector.mm_input_projection_weight", (d, v.text_hidden_size))
        return em.op1("MatMul", [normed, em.weight("projector.mm_input_projection_weight", proj)])

    def build(self) -> None:
        x = self.embeddings()
        for i in range(self.v.num_layers):
            x = self.layer(x, i)
        x = self.layer_norm(x, "vision.post_layernorm")
        self.em.op("Identity", [self.projector(x)], outputs=["image_features"])


def build_vision_graph(vcfg: Gemma3VisionConfig, ckpt: CheckpointReader, model_path: Path) -> None:
    """Write ``model_path`` (+ ``<name>.data``): the tower and projector of ``vcfg``, reading
    ``vision.*`` and ``projector.*`` from ``ckpt`` (:meth:`Gemma3Side.views`)."""
    weights = ExternalWeights(model_path.with_name(model_path.name + ".data"))
    em = Emitter(weights)
    try:
        _SiglipBuilder(vcfg, ckpt, em).build()
    finally:
        weights.close()
    size = vcfg.image_size
    inputs = [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT,
                                            ["images", vcfg.num_channels, size, size])]
    outputs = [helper.make_tensor_value_info("image_features", TensorProto.FLOAT,
                                             ["images", vcfg.rows, vcfg.text_hidden_size])]
    graph = helper.make_graph(em.nodes, f"{FAMILY}_vision", inputs, outputs, em.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", VISION_OPSET)],
                              producer_name="cachesvc-inference")
    model.ir_version = 8
    onnx.save_model(model, str(model_path))


class Gemma3Side:
    """Gemma 3's :class:`inference.builder.vision_config.VisionSide`."""

    family = FAMILY
    image_attention = "bidirectional"

    def __init__(self, raw: Mapping[str, Any], text_hidden: int) -> None:
        self.vcfg = config_from(raw, text_hidden)
        family = vision_family_of(raw)
        assert family is not None
        self._family: VisionFamily = family
        self._preprocess: ClipPreprocess | None = None
        self._placeholder_text = ""

    def check(self, checkpoint_dir: Path, cfg: ModelConfig, spec: EngineBuildSpec) -> None:
        """The spec and the language model, then the processor and tokenizer settings."""
        self._check_spec(cfg, spec)
        self.read(checkpoint_dir)

    @property
    def min_image_tokens(self) -> int:
        """Every image: ``mm_tokens_per_image`` rows."""
        return self.vcfg.rows

    def text_view(self, ckpt: CheckpointReader) -> CheckpointReader:
        """The language model's tensors under a text checkpoint's names."""
        return self.views(ckpt)[0]

    def build_graph(self, ckpt: CheckpointReader, model_path: Path) -> None:
        """Write the vision graph from the whole checkpoint ``ckpt``."""
        build_vision_graph(self.vcfg, self.views(ckpt)[1], model_path)

    def _check_spec(self, cfg: ModelConfig, spec: EngineBuildSpec) -> None:
        v = self.vcfg
        if spec.task != "generate":
            raise BuildInputError(f"task {spec.task!r} is not supported for a vision-language checkpoint "
                                  f"({FAMILY}); build task 'generate'")
        if spec.lora:
            raise BuildInputError(f"lora is not supported for a vision-language checkpoint ({FAMILY}) yet")
        for key, token in (("image_token_index", v.image_token_id), ("boi_token_index", v.boi_token_id),
                           ("eoi_token_index", v.eoi_token_id)):
            if not 0 <= token < cfg.vocab_size:
                raise BuildInputError(f"config.json {key} {token} is outside the language model's vocabulary "
                                      f"({cfg.vocab_size})")
        if v.prompt_tokens >= spec.max_input_len:
            raise BuildInputError(f"one image takes {v.prompt_tokens} prompt tokens; max_input_len "
                                  f"{spec.max_input_len} leaves no room for the text: raise max_input_len")

    def read(self, checkpoint_dir: Path) -> None:
        self._preprocess = read_processor(checkpoint_dir, self.vcfg)
        self._placeholder_text = token_text(checkpoint_dir, self.vcfg.boi_token_id, "boi_token_index")

    def views(self, ckpt: CheckpointReader) -> tuple[CheckpointReader, CheckpointReader]:
        family = self._family
        tower = _first_present(ckpt, family.vision_prefixes, "embeddings.patch_embedding.weight",
                               "vision tower")
        projector = _first_present(ckpt, family.projector_prefixes, "mm_input_projection_weight",
                                   "multi-modal projector")
        return text_view(ckpt, family), prefixed_view(ckpt, {"vision.": tower, "projector.": projector})

    def record(self) -> dict[str, Any]:
        v = self.vcfg
        assert self._preprocess is not None, "read() the checkpoint first"
        return {
            "family": FAMILY,
            "model": VISION_MODEL,
            "inputs": list(VISION_INPUTS),
            "outputs": list(VISION_OUTPUTS),
            "precision": "fp32",
            "image_size": v.image_size,
            "image_token_id": v.image_token_id,
            "placeholder_id": v.boi_token_id,
            "end_id": v.eoi_token_id,
            "placeholder_text": self._placeholder_text,
            "text_around": TEXT_AROUND,
            "rows_per_image": v.rows,
            "tokens_per_image": v.prompt_tokens,
            "feature_size": v.text_hidden_size,
            "image_attention": self.image_attention,
            "preprocess": self._preprocess.record(),
        }


def vision_side(raw: Mapping[str, Any], text_hidden: int) -> Gemma3Side:
    """The family hook (:attr:`inference.families.VisionFamily.builder`): this checkpoint's side."""
    return Gemma3Side(raw, text_hidden)

