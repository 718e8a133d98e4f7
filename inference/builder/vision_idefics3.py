"""Idefics3 and SmolVLM: config.json -> the SigLIP tower and pixel-shuffle connector the builder
writes as the bundle's vision graph, the image preprocessing and the image's prompt tokens.

The vision graph: ``pixel_values [tiles, 3, tile, tile]`` float32 (every frame of an image, one
tile square: :class:`inference.images.idefics3.TilePreprocess`) -> ``image_features [tiles,
tokens_per_tile, text_hidden]``: the patch embedding (a convolution with bias), the learned
position embeddings, pre-norm encoder layers (LayerNorm, gelu_pytorch_tanh MLP), the post-layernorm,
then the connector: pixel shuffle by ``scale_factor`` and one Linear without bias.

Positions: transformers buckets each patch's fractional coordinate into the position grid
(``Idefics3VisionEmbeddings``; it lets a frame have any size). A frame here is always a full tile
(the processor's frames are one tile square, its ``pixel_attention_mask`` all ones), so the
buckets are a constant of the tile and the tower's sizes: computed once here with transformers'
float32 arithmetic and written as the gathered table. They are not always the identity: with
``n`` patches a side, ``arange(1/n, 1, 1/n)`` rounds so that for some ``n`` (19, 25, 29, 31, ...)
a patch lands in its neighbour's bucket; the table keeps transformers' choice (torch's CPU arange:
it differs by device, and for the hub's towers, 26, 27 and 32 patches a side, is the identity).

Float32 whatever the bundle's precision, as LLaVA's tower (:mod:`.vision_graph`): small next to
the language model (SmolVLM's SigLIP base/16 at 512: ~0.09 B parameters), run once per tile, and
compared to transformers' features to 1e-4.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from inference.builder.checkpoint_reader import CheckpointReader, prefixed_view
from inference.builder.emit import Emitter, ExternalWeights
from inference.builder.errors import BuildInputError
from inference.builder.vision_config import VISION_ACTIVATIONS, check_heads, text_view, vision_section
from inference.builder.vision_graph import (
    VISION_INPUTS,
    VISION_MODEL,
    VISION_OPSET,
    VISION_OUTPUTS,
    VitLayers,
)
from inference.errors import UnsupportedFeatureError
from inference.families import VisionFamily, vision_family_of
from inference.images.idefics3 import TilePreprocess, TilePrompt
from inference.images.preprocess import PreprocessConfigError

if TYPE_CHECKING:
    from inference.builder.model_config import ModelConfig
    from inference.builder.spec import EngineBuildSpec

PREPROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"
#: ``image_seq_len`` of transformers' processors when their config names none.
DEFAULT_IMAGE_SEQ_LEN = 169
#: The processors' marker tokens (``SmolVLMProcessor`` reads them from the tokenizer's
#: ``extra_special_tokens``, these being its defaults; ``Idefics3Processor`` writes them as is).
FAKE_TOKEN, IMAGE_TOKEN, GLOBAL_TOKEN = "<fake_token_around_image>", "<image>", "<global-img>"
TOKEN_ATTRIBUTES = {"fake_image_token": FAKE_TOKEN, "image_token": IMAGE_TOKEN,
                    "global_image_token": GLOBAL_TOKEN}


@dataclass(frozen=True)
class TiledVisionConfig:
    """The SigLIP tower and connector of an Idefics3 / SmolVLM config.json."""

    family: str
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_layers: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    act: str
    scale_factor: int
    text_hidden_size: int
    image_token_id: int

    @property
    def head_dim(self) -> int:
        """The attention's head size."""
        return self.hidden_size // self.num_heads

    @property
    def side(self) -> int:
        """Patches a side of the position-embedding grid (``image_size // patch_size``)."""
        return self.image_size // self.patch_size


def _positive(raw: Mapping[str, Any], key: str, where: str, default: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BuildInputError(f"config.json {where}{key} must be a positive integer, got {value!r}")
    return value


def tiled_config_from(raw: Mapping[str, Any], text_hidden: int) -> TiledVisionConfig:
    """The vision side of an Idefics3 / SmolVLM config.json (``Idefics3VisionConfig``'s defaults
    where it leaves a field out); one line naming the field it cannot build."""
    family = vision_family_of(raw)
    assert family is not None and family.builder == __name__
    vision = vision_section(raw, family, family.vision_model_types[0], required=False)
    where = "vision_config."
    hidden = _positive(vision, "hidden_size", where, 1152)
    heads = _positive(vision, "num_attention_heads", where, 16)
    image_size = _positive(vision, "image_size", where, 224)
    patch = _positive(vision, "patch_size", where, 32)
    check_heads(hidden, heads)
    if image_size < patch:
        raise BuildInputError(f"config.json vision_config.image_size {image_size} is smaller than its "
                              f"patch_size {patch}")
    act = str(vision.get("hidden_act", "gelu_pytorch_tanh"))
    if act not in VISION_ACTIVATIONS:
        raise UnsupportedFeatureError(f"config.json vision_config.hidden_act {act!r} is not supported; "
                                      f"supported: {', '.join(VISION_ACTIVATIONS)}")
    scale = _positive(raw, "scale_factor", "", 2)
    token = raw.get("image_token_id", 128257)
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise BuildInputError(f"config.json image_token_id must be a token id, got {token!r}")
    return TiledVisionConfig(
        family=family.name, hidden_size=hidden,
        intermediate_size=_positive(vision, "intermediate_size", where, 3072), num_heads=heads,
        num_layers=_positive(vision, "num_hidden_layers", where, 12), image_size=image_size, patch_size=patch,
        num_channels=_positive(vision, "num_channels", where, 3),
        layer_norm_eps=float(vision.get("layer_norm_eps", 1e-6)), act=VISION_ACTIVATIONS[act],
        scale_factor=scale, text_hidden_size=text_hidden, image_token_id=token)


#: float32 values per vector of torch's CPU ``arange`` kernel (two vectors a step of its loop).
ARANGE_VECTOR = 8


def torch_arange(start: float, end: float, step: float) -> np.ndarray:
    """``torch.arange(start, end, step)`` in float32 as torch computes it on the CPU: each run of
    two vectors of :data:`ARANGE_VECTOR` values starts at ``float32(start + step * i)`` and adds
    ``k * step`` in double to it; the values after the last whole run are ``start + step * i``."""
    count = max(math.ceil((end - start) / step), 0)
    out = np.empty(count, np.float32)
    whole = count // (2 * ARANGE_VECTOR) * (2 * ARANGE_VECTOR)
    for base in range(0, whole, ARANGE_VECTOR):
        first = float(np.float32(start + step * base))
        out[base:base + ARANGE_VECTOR] = [first + k * step for k in range(ARANGE_VECTOR)]
    out[whole:] = [start + step * i for i in range(whole, count)]
    return out


def position_ids(side: int, grid: int) -> np.ndarray:
    """The position-embedding row of each patch of a full ``grid x grid`` frame, row-major, for a
    ``side x side`` table: transformers' bucketing (``Idefics3VisionEmbeddings.forward`` with an
    all-ones patch mask) in its float32 arithmetic on the CPU."""
    boundaries = torch_arange(1 / side, 1.0, 1 / side)
    coords = np.arange(grid, dtype=np.float32) * (np.float32(1.0) / np.float32(grid))
    coords = np.minimum(coords, np.float32(1.0 - 1e-6))
    buckets = np.searchsorted(boundaries, coords, side="right").astype(np.int64)
    return (buckets[:, None] * side + buckets[None, :]).reshape(-1)


class _TowerBuilder(VitLayers):
    """SigLIP with bucketed positions and the pixel-shuffle connector (scores scaled after the
    product, as transformers' Idefics3 attention does)."""

    v: TiledVisionConfig
    scale_scores = True

    def __init__(self, v: TiledVisionConfig, tile: int, ckpt: CheckpointReader, em: Emitter) -> None:
        super().__init__(v, ckpt, em)
        self.tile = tile

    def embeddings(self) -> str:
        """Patch embeddings plus the bucketed positions: [N, grid^2, D]."""
        v, em = self.v, self.em
        d, p, c = v.hidden_size, v.patch_size, v.num_channels
        name = "vision.embeddings.patch_embedding"
        conv_w = em.weight(f"{name}.weight", self.ckpt.get_f32(f"{name}.weight", (d, c, p, p)))
        conv_b = em.weight(f"{name}.bias", self.ckpt.get_f32(f"{name}.bias", (d,)))
        patches = em.op1("Conv", ["pixel_values", conv_w, conv_b], kernel_shape=[p, p], strides=[p, p])
        patches = em.op1("Reshape", [patches, em.const(np.array([0, d, -1], np.int64))])
        x = em.op1("Transpose", [patches], perm=[0, 2, 1])  # [N, grid^2, D]
        table = self.ckpt.get_f32("vision.embeddings.position_embedding.weight", (v.side ** 2, d))
        rows = np.ascontiguousarray(table[position_ids(v.side, self.tile // p)])
        return em.op1("Add", [x, em.weight("vision.embeddings.position_rows", rows)])

    def connector(self, x: str) -> str:
        """Pixel shuffle (``Idefics3Connector.pixel_shuffle``) then the projection: [N, T, text]."""
        v, em = self.v, self.em
        d, s, g = v.hidden_size, v.scale_factor, self.tile // v.patch_size
        x = em.op1("Reshape", [x, em.const(np.array([0, g, g // s, d * s], np.int64))])
        x = em.op1("Transpose", [x], perm=[0, 2, 1, 3])
        x = em.op1("Reshape", [x, em.const(np.array([0, g // s, g // s, d * s * s], np.int64))])
        x = em.op1("Transpose", [x], perm=[0, 2, 1, 3])
        x = em.op1("Reshape", [x, em.const(np.array([0, (g // s) ** 2, d * s * s], np.int64))])
        return self.linear(x, "connector.modality_projection.proj", v.text_hidden_size, d * s * s, bias=False)

    def build(self) -> None:
        x = self.embeddings()
        for i in range(self.v.num_layers):
            x = self.layer(x, i)
        x = self.layer_norm(x, "vision.post_layernorm")
        self.em.op("Identity", [self.connector(x)], outputs=["image_features"])


def build_tiled_vision_graph(vcfg: TiledVisionConfig, tile: int, ckpt: CheckpointReader,
                             model_path: Path) -> None:
    """Write ``model_path`` (+ ``<name>.data``): the tower and connector of ``vcfg`` for frames of
    ``tile`` pixels a side, reading ``vision.*`` and ``connector.*`` from ``ckpt``."""
    weights = ExternalWeights(model_path.with_name(model_path.name + ".data"))
    em = Emitter(weights)
    try:
        _TowerBuilder(vcfg, tile, ckpt, em).build()
    finally:
        weights.close()
    grid = tile // vcfg.patch_size // vcfg.scale_factor
    inputs = [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT,
                                            ["images", vcfg.num_channels, tile, tile])]
    outputs = [helper.make_tensor_value_info("image_features", TensorProto.FLOAT,
                                             ["images", grid * grid, vcfg.text_hidden_size])]
    graph = helper.make_graph(em.nodes, f"{vcfg.family}_vision", inputs, outputs, em.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", VISION_OPSET)],
                              producer_name="cachesvc-inference")
    model.ir_version = 8
    onnx.save_model(model, str(model_path))


def _read_object(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BuildInputError(f"{path.name} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise BuildInputError(f"{path.name} must hold a JSON object")
    return raw


def _first_present(ckpt: CheckpointReader, prefixes: tuple[str, ...], probe: str, what: str) -> str:
    for prefix in prefixes:
        if prefix + probe in ckpt:
            return prefix
    raise BuildInputError(f"the checkpoint has no {what} ({' or '.join(p + probe for p in prefixes)})")


def _token_strings(checkpoint_dir: Path, family: str) -> dict[str, str]:
    """The marker strings the family's processor writes: SmolVLM's from the tokenizer's
    ``extra_special_tokens`` (or its top-level keys), Idefics3's fixed."""
    out = dict(TOKEN_ATTRIBUTES)
    path = checkpoint_dir / "tokenizer_config.json"
    if family != "smolvlm" or not path.is_file():
        return out
    config = _read_object(path)
    extra = config.get("extra_special_tokens")
    for key in out:
        value = extra.get(key) if isinstance(extra, Mapping) else None
        value = config.get(key) if value is None else value
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def tile_prompt(checkpoint_dir: Path, family: str, image_token_id: int, tokens_per_tile: int,
                max_grid: int) -> TilePrompt:
    """The ids of an image's prompt pieces, each tokenized by the checkpoint's tokenizer between the
    tokens around it in the processor's expansion (so a tokenizer whose pieces depend on their
    neighbours gives what it gives in the expanded prompt)."""
    from inference.serving.tokenizer import TokenizerError, load_tokenizer

    try:
        tok = load_tokenizer(checkpoint_dir)
    except TokenizerError as exc:
        raise BuildInputError(str(exc)) from None
    names = _token_strings(checkpoint_dir, family)
    fake_text, image_text = names["fake_image_token"], names["image_token"]
    image, fake = tok.encode(image_text), tok.encode(fake_text)
    if image != [image_token_id]:
        raise BuildInputError(f"the tokenizer makes {image_text!r} {image}, not config.json image_token_id "
                              f"[{image_token_id}]: the checkpoint's tokenizer and model disagree")
    if len(fake) != 1:
        raise BuildInputError(f"the tokenizer has no token {fake_text!r} (it makes {fake}): save the "
                              "processor with the model")

    def between(before: str, piece: str, after: str) -> tuple[int, ...]:
        ids = tok.encode(before + piece + after)
        head, tail = tok.encode(before), tok.encode(after)
        assert ids[:len(head)] == head and ids[len(ids) - len(tail):] == tail, (piece, ids)
        return tuple(ids[len(head):len(ids) - len(tail)])

    return TilePrompt(
        image=image_token_id, tokens_per_tile=tokens_per_tile, fake=tuple(fake),
        global_image=between(fake_text, names["global_image_token"], image_text),
        newline=between(image_text, "\n", fake_text), last_newlines=between(image_text, "\n\n", fake_text),
        tile_tags=tuple(tuple(between(fake_text, f"<row_{r}_col_{c}>", image_text)
                              for c in range(1, max_grid + 1)) for r in range(1, max_grid + 1)))


class TiledVisionSide:
    """An Idefics3 / SmolVLM checkpoint's vision side through a build: the config's tower (read
    and checked on construction), then :meth:`check` reads the processor's settings and the
    tokenizer, :meth:`build_graph` writes the graph and :meth:`record` says what ``engine.json``
    keeps (``vision``)."""

    image_attention = "causal"

    def __init__(self, raw: Mapping[str, Any], text_hidden: int) -> None:
        family = vision_family_of(raw)
        assert family is not None
        self.family: VisionFamily = family
        self.config = tiled_config_from(raw, text_hidden)
        self._preprocess: TilePreprocess | None = None
        self._prompt: TilePrompt | None = None

    @property
    def tokens_per_tile(self) -> int:
        """Image tokens (feature rows) of one frame."""
        assert self._preprocess is not None
        grid = self._preprocess.tile // self.config.patch_size // self.config.scale_factor
        return grid * grid

    @property
    def min_image_tokens(self) -> int:
        """An image that is not split: the global frame's rows."""
        return self.tokens_per_tile

    def _load_preprocess(self, folder: Path) -> tuple[TilePreprocess, int]:
        processor = _read_object(folder / PROCESSOR_FILE) if (folder / PROCESSOR_FILE).is_file() else None
        if (folder / PREPROCESSOR_FILE).is_file():
            raw = _read_object(folder / PREPROCESSOR_FILE)
        elif processor is not None and isinstance(processor.get("image_processor"), dict):
            raw = processor["image_processor"]
        else:
            raise BuildInputError(f"{folder} has no {PREPROCESSOR_FILE} or {PROCESSOR_FILE} with an "
                                  "image_processor; a vision-language checkpoint needs its image processor's "
                                  "settings (save the processor with the model)")
        try:
            pre = TilePreprocess.from_config(raw)
        except PreprocessConfigError as exc:
            raise BuildInputError(str(exc)) from None
        seq = (processor or {}).get("image_seq_len", DEFAULT_IMAGE_SEQ_LEN)
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 1:
            raise BuildInputError(f"{PROCESSOR_FILE} image_seq_len must be a positive integer, got {seq!r}")
        return pre, seq

    def check(self, checkpoint_dir: Path, cfg: ModelConfig, spec: EngineBuildSpec) -> None:
        """What this checkpoint cannot be built with, in one line naming the field; reads the
        image processor's settings and the prompt pieces' ids."""
        v = self.config
        if spec.task != "generate":
            raise BuildInputError(f"task {spec.task!r} is not supported for a vision-language checkpoint "
                                  f"({v.family}); build task 'generate'")
        if spec.lora:
            raise BuildInputError(f"lora is not supported for a vision-language checkpoint ({v.family}) yet")
        if not 0 <= v.image_token_id < cfg.vocab_size:
            raise BuildInputError(f"config.json image_token_id {v.image_token_id} is outside the language "
                                  f"model's vocabulary ({cfg.vocab_size})")
        if v.num_channels != 3:
            raise BuildInputError(f"config.json vision_config.num_channels {v.num_channels}: images are RGB")
        pre, seq = self._load_preprocess(Path(checkpoint_dir))
        grid = pre.tile // v.patch_size
        if grid % v.scale_factor:
            raise BuildInputError(f"config.json scale_factor {v.scale_factor} does not divide the "
                                  f"{grid}x{grid} patches of a {pre.tile}-pixel tile "
                                  "(max_image_size.longest_edge)")
        self._preprocess = pre
        if seq != self.tokens_per_tile:
            raise BuildInputError(
                f"{PROCESSOR_FILE} image_seq_len {seq} is not the {self.tokens_per_tile} image tokens the "
                f"vision tower makes of a {pre.tile}-pixel tile ((tile / patch_size)^2 / scale_factor^2)")
        self._prompt = tile_prompt(Path(checkpoint_dir), v.family, v.image_token_id, seq, pre.max_grid)
        smallest = len(self._prompt.tokens(0, 0))
        if smallest >= spec.max_input_len:
            raise BuildInputError(f"one image takes at least {smallest} prompt tokens; max_input_len "
                                  f"{spec.max_input_len} leaves no room for the text: raise max_input_len")

    def text_view(self, ckpt: CheckpointReader) -> CheckpointReader:
        """The language model's tensors under a text checkpoint's names."""
        return text_view(ckpt, self.family)

    def build_graph(self, ckpt: CheckpointReader, model_path: Path) -> None:
        """Write the vision graph (the tower and connector of the whole checkpoint ``ckpt``)."""
        assert self._preprocess is not None
        tower = _first_present(ckpt, self.family.vision_prefixes, "embeddings.patch_embedding.weight",
                               "vision tower")
        connector = _first_present(ckpt, self.family.projector_prefixes, "modality_projection.proj.weight",
                                   "connector")
        view = prefixed_view(ckpt, {"vision.": tower, "connector.": connector})
        build_tiled_vision_graph(self.config, self._preprocess.tile, view, model_path)

    def record(self) -> dict[str, Any]:
        """What ``engine.json`` records under ``vision``."""
        assert self._preprocess is not None and self._prompt is not None
        return {
            "family": self.config.family,
            "model": VISION_MODEL,
            "inputs": list(VISION_INPUTS),
            "outputs": list(VISION_OUTPUTS),
            "precision": "fp32",
            "image_size": self._preprocess.tile,
            "image_token_id": self.config.image_token_id,
            "placeholder_id": self.config.image_token_id,
            "tokens_per_image": None,
            "tokens_per_tile": self.tokens_per_tile,
            "feature_size": self.config.text_hidden_size,
            "preprocess": self._preprocess.record(),
            "prompt": self._prompt.record(),
        }


def vision_side(raw: Mapping[str, Any], text_hidden: int) -> TiledVisionSide:
    """The family hook (:attr:`inference.families.VisionFamily.builder`): this checkpoint's side."""
    return TiledVisionSide(raw, text_hidden)
