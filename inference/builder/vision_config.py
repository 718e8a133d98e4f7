"""config.json of a vision-language checkpoint -> the vision tower and projector the builder writes.

The language model is read as its text family's decoder (:func:`inference.builder.model_config.
model_config_from` follows ``text_config``); this module reads the rest: the CLIP vision tower,
which of its hidden states feed the projector, the projector, the image token and how many
tokens one image takes, and the image preprocessing of ``preprocessor_config.json``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from inference.builder.checkpoint_reader import CheckpointReader, prefixed_view
from inference.builder.errors import BuildInputError
from inference.errors import UnsupportedFeatureError
from inference.families import VisionFamily, vision_family_of
from inference.images.preprocess import ClipPreprocess, PreprocessConfigError

if TYPE_CHECKING:
    from inference.builder.model_config import ModelConfig
    from inference.builder.spec import EngineBuildSpec

#: The vision tower's activations by config name (transformers' ACT2FN).
VISION_ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh",
                      "gelu_new": "gelu_tanh"}
SELECT_STRATEGIES = ("default", "full")
PREPROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"


@dataclass(frozen=True)
class VisionConfig:
    """What the vision graph computes and how the language model takes its output."""

    family: str
    hidden_size: int
    intermediate_size: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    act: str
    #: indices into the tower's hidden states (0: the embeddings after pre_layrnorm, i: layer i's
    #: output), concatenated along the features when several
    feature_layers: tuple[int, ...]
    select_strategy: str  # "default": without the CLS row; "full": with it
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int

    @property
    def num_patches(self) -> int:
        """Patches of one image."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        """Feature rows (image tokens in the prompt) of one image."""
        return self.num_patches + (1 if self.select_strategy == "full" else 0)

    @property
    def layers_run(self) -> int:
        """Encoder layers the graph runs: up to the deepest selected hidden state."""
        return max(self.feature_layers)

    @property
    def head_dim(self) -> int:
        """The attention's head size."""
        return self.hidden_size // self.num_heads


def _positive(raw: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BuildInputError(f"config.json {where}{key} must be a positive integer, got {value!r}")
    return value


#: How a bundle's image rows attend in the language model: causally (LLaVA, Idefics3), or both
#: ways within each image (Gemma 3; the decoder graph's ``image_attention``).
IMAGE_ATTENTION = ("causal", "bidirectional")


class VisionSide(Protocol):
    """The vision side of a family with a builder of its own (:attr:`VisionFamily.builder`), through
    one build: made from config.json (its refusals), then :meth:`check` (the spec, the checkpoint's
    processor files and tokenizer), :meth:`build_graph`, :meth:`record`."""

    #: how the language model's image rows attend (:data:`IMAGE_ATTENTION`)
    image_attention: str

    def check(self, checkpoint_dir: Path, cfg: ModelConfig, spec: EngineBuildSpec) -> None:
        """Refuse in one line what cannot be built; read what the record needs."""
        ...

    @property
    def min_image_tokens(self) -> int:
        """Image tokens (feature rows) of the smallest image (after :meth:`check`): the least the
        profile's image-token limits may be."""
        ...

    def text_view(self, ckpt: CheckpointReader) -> CheckpointReader:
        """The language model's tensors under a text checkpoint's names."""
        ...

    def build_graph(self, ckpt: CheckpointReader, model_path: Path) -> None:
        """Write the vision graph from the whole checkpoint ``ckpt``."""
        ...

    def record(self) -> dict[str, Any]:
        """``engine.json``'s ``vision`` record (``family`` names the runtime's encoder)."""
        ...


def vision_side_from(raw: Mapping[str, Any], text_hidden: int) -> VisionSide | None:
    """The vision side of a family with a builder of its own (None for LLaVA's and text models)."""
    family = vision_family_of(raw)
    if family is None or family.builder is None:
        return None
    side: VisionSide = importlib.import_module(family.builder).vision_side(raw, text_hidden)
    return side


def check_vision_config(raw: Mapping[str, Any]) -> None:
    """The vision side's refusals of a config.json (nothing for a text model)."""
    if vision_side_from(raw, 0) is None:
        vision_config_from(raw, 0)


def vision_section(raw: Mapping[str, Any], family: VisionFamily, default_kind: str, *,
                   required: bool = True) -> Mapping[str, Any]:
    """config.json's ``vision_config`` of a ``family`` checkpoint, checked to be an object of one of
    the family's vision model types (``default_kind`` where it names none; an absent section is
    refused, or read as empty where not ``required``)."""
    vision = raw.get("vision_config") if required else raw.get("vision_config", {})
    if not isinstance(vision, Mapping):
        raise BuildInputError("config.json vision_config must be an object")
    kind = vision.get("model_type", default_kind)
    if kind not in family.vision_model_types:
        raise UnsupportedFeatureError(
            f"config.json vision_config.model_type {kind!r} is not supported for {family.name}; supported: "
            f"{', '.join(family.vision_model_types)}")
    return vision


def check_heads(hidden: int, heads: int) -> None:
    """The tower's width splits into its attention heads."""
    if hidden % heads:
        raise BuildInputError(f"config.json vision_config.hidden_size {hidden} is not a multiple of "
                              f"num_attention_heads {heads}")


def vision_config_from(raw: Mapping[str, Any], text_hidden: int) -> VisionConfig | None:
    """The CLIP vision side of a config.json (None for a text model, and for a family with a
    builder of its own: :func:`vision_side_from`)."""
    family = vision_family_of(raw)
    if family is None or family.builder is not None:
        return None
    vision = vision_section(raw, family, "clip_vision_model")
    where = "vision_config."
    hidden = _positive(vision, "hidden_size", where, 768)
    heads = _positive(vision, "num_attention_heads", where, 12)
    layers = _positive(vision, "num_hidden_layers", where, 12)
    image_size = _positive(vision, "image_size", where, 224)
    patch = _positive(vision, "patch_size", where, 32)
    check_heads(hidden, heads)
    if image_size % patch:
        raise BuildInputError(f"config.json vision_config.image_size {image_size} is not a multiple of "
                              f"patch_size {patch}")
    act = str(vision.get("hidden_act", "quick_gelu"))
    if act not in VISION_ACTIVATIONS:
        raise UnsupportedFeatureError(f"config.json vision_config.hidden_act {act!r} is not supported; "
                                      f"supported: {', '.join(VISION_ACTIVATIONS)}")
    chosen = raw.get("vision_feature_layer", -2)
    chosen_list = list(chosen) if isinstance(chosen, list) else [chosen]
    feature_layers = []
    for value in chosen_list:
        if isinstance(value, bool) or not isinstance(value, int) or not -(layers + 1) <= value <= layers:
            raise BuildInputError(f"config.json vision_feature_layer {chosen!r} is not a hidden state of the "
                                  f"{layers}-layer vision tower")
        feature_layers.append(value % (layers + 1))
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in SELECT_STRATEGIES:
        raise UnsupportedFeatureError(f"config.json vision_feature_select_strategy {strategy!r} is not "
                                      f"supported; supported: {', '.join(SELECT_STRATEGIES)}")
    projector_act = str(raw.get("projector_hidden_act", "gelu"))
    if projector_act not in VISION_ACTIVATIONS or projector_act == "quick_gelu":
        raise UnsupportedFeatureError(f"config.json projector_hidden_act {projector_act!r} is not supported")
    token = raw.get("image_token_id", raw.get("image_token_index", 32000))
    if isinstance(token, bool) or not isinstance(token, int) or token < 0:
        raise BuildInputError(f"config.json image_token_index must be a token id, got {token!r}")
    return VisionConfig(
        family=family.name, hidden_size=hidden,
        intermediate_size=_positive(vision, "intermediate_size", where, 3072),
        num_heads=heads, image_size=image_size, patch_size=patch,
        num_channels=_positive(vision, "num_channels", where, 3),
        layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5)), act=VISION_ACTIVATIONS[act],
        feature_layers=tuple(feature_layers), select_strategy=str(strategy),
        projector_act=VISION_ACTIVATIONS[projector_act],
        projector_bias=bool(raw.get("multimodal_projector_bias", True)),
        text_hidden_size=text_hidden, image_token_id=token,
    )


def _read_object(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BuildInputError(f"{path.name} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise BuildInputError(f"{path.name} must hold a JSON object")
    return raw


def preprocessor_config(checkpoint_dir: Path) -> dict[str, Any]:
    """The checkpoint's image processor settings: ``preprocessor_config.json``, as the hub's
    checkpoints have it, else ``processor_config.json``'s ``image_processor``, as transformers 5
    saves a processor."""
    folder = Path(checkpoint_dir)
    if (folder / PREPROCESSOR_FILE).is_file():
        raw = _read_object(folder / PREPROCESSOR_FILE)
    elif (folder / PROCESSOR_FILE).is_file():
        nested = _read_object(folder / PROCESSOR_FILE).get("image_processor")
        if not isinstance(nested, dict):
            raise BuildInputError(f"{PROCESSOR_FILE} has no image_processor object")
        raw = nested
    else:
        raise BuildInputError(f"{checkpoint_dir} has no {PREPROCESSOR_FILE} or {PROCESSOR_FILE}; a "
                              "vision-language checkpoint needs its image processor's settings (save the "
                              "processor with the model)")
    return raw


def load_preprocess(checkpoint_dir: Path, vcfg: VisionConfig) -> ClipPreprocess:
    """The checkpoint's image preprocessing (:func:`preprocessor_config`), checked against the
    vision tower's input size."""
    raw = preprocessor_config(checkpoint_dir)
    try:
        pre = ClipPreprocess.from_config(raw)
        size = pre.output_size()
    except PreprocessConfigError as exc:
        raise BuildInputError(str(exc)) from None
    if size != (vcfg.image_size, vcfg.image_size):
        raise BuildInputError(f"the image processor makes {size[0]}x{size[1]} images; the vision tower takes "
                              f"{vcfg.image_size}x{vcfg.image_size}")
    if vcfg.num_channels != 3:
        raise BuildInputError(f"config.json vision_config.num_channels {vcfg.num_channels}: images are RGB")
    return pre


def _first_present(ckpt: CheckpointReader, prefixes: tuple[str, ...], probe: str, what: str) -> str:
    for prefix in prefixes:
        if prefix + probe in ckpt:
            return prefix
    raise BuildInputError(f"the checkpoint has no {what} ({' or '.join(p + probe for p in prefixes)})")


def text_view(ckpt: CheckpointReader, family: VisionFamily) -> CheckpointReader:
    """The language model's tensors under a text checkpoint's names (``model.``, ``lm_head.``)."""
    for decoder, head in family.text_prefixes:
        if decoder + "embed_tokens.weight" in ckpt:
            return prefixed_view(ckpt, {"model.": decoder, "lm_head.": head})
    raise BuildInputError("the checkpoint has no language model embedding "
                          f"({' or '.join(d + 'embed_tokens.weight' for d, _ in family.text_prefixes)})")


def vision_view(ckpt: CheckpointReader, family: VisionFamily) -> CheckpointReader:
    """The vision tower's tensors as ``vision.*`` and the projector's as ``projector.*``."""
    tower = _first_present(ckpt, family.vision_prefixes, "embeddings.patch_embedding.weight", "vision tower")
    projector = _first_present(ckpt, family.projector_prefixes, "linear_1.weight", "multi-modal projector")
    return prefixed_view(ckpt, {"vision.": tower, "projector.": projector})


def vision_family(raw: Mapping[str, Any]) -> VisionFamily:
    """The vision-language family of ``raw`` (a config :func:`vision_config_from` accepted)."""
    family = vision_family_of(raw)
    assert family is not None
    return family


def processor_chat_template(checkpoint_dir: Path) -> str | None:
    """The processor's chat template of a checkpoint that keeps it in ``chat_template.json`` (the
    hub's llava-hf checkpoints: the template that places ``<image>``), else None."""
    path = Path(checkpoint_dir) / "chat_template.json"
    if not path.is_file():
        return None
    template = _read_object(path).get("chat_template")
    if not isinstance(template, str):
        raise BuildInputError("chat_template.json must hold a string chat_template")
    return template
