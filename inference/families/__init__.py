"""The model families the builder knows: one module per family, one registry that reads them.

A family module declares, once, everything that is particular to it (see :class:`Family`):
the transformers ``model_type``s and architecture class names and the GGUF
``general.architecture`` names it covers, how its ``config.json`` maps onto the builder's one
layer description (:class:`inference.builder.model_config.ModelConfig`), its weight names when
they differ from Llama's (:mod:`inference.builder.layout`), what llama.cpp's converter did to its
tensors, its tokenizer kind, its default reasoning/tool parsers, its LoRA target modules and a
tiny configuration for tests and the demo checkpoint writer.

Everything else reads this registry: the safetensors gate (``model_config``), the GGUF reader,
the demo writer (``inference.demo``), the ``auto`` parser table (``inference.openai.handle``),
the docs' support table (docs/model-families.md, kept equal by a test) and the tests' family
lists. "Adding a model family" in that page says what to declare.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from inference.errors import BuildInputError

#: Where the families and their limits are described (named in every refusal).
DOCS_PAGE = "docs/model-families.md"

#: Config-to-features hook: config.json (raw) -> ModelConfig feature fields.
Features = Callable[[Mapping[str, Any]], dict[str, Any]]
#: GGUF-to-config hook: (metadata getter taking a key without the ``<arch>.`` prefix, tensor
#: names) -> config.json keys beyond the common ones.
GgufConfig = Callable[[Callable[[str, Any], Any], frozenset[str]], dict[str, Any]]

LLAMA_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: Mixture-of-experts families: adapters of the attention only (expert LoRA is refused).
ATTENTION_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
#: GGUF-match hook: (metadata getter as for GgufConfig) -> whether the file is of this family.
GgufMatch = Callable[[Callable[[str, Any], Any]], bool]


def moe_size(raw: Mapping[str, Any], key: str, default: int | None = None) -> int:
    """A positive integer of a mixture-of-experts config (``BuildInputError`` naming ``key``)."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BuildInputError(f"config.json field {key!r} must be a positive integer, got {value!r}")
    return value


def pattern_layer_types(raw: Mapping[str, Any], pattern: object) -> tuple[str, ...]:
    """The layers' types as the builder takes them ("full"/"sliding"): config.json's
    ``layer_types`` where it lists them, else transformers' default for a sliding-window family:
    every ``pattern``-th layer (1-based) global, the others sliding."""
    from inference.builder.model_config import layer_types_of  # (the builder imports the registry)

    layers = int(raw["num_hidden_layers"])
    if raw.get("layer_types"):
        return layer_types_of(raw, layers)
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise BuildInputError(
            f"config.json sliding_window_pattern must be a positive integer, got {pattern!r}")
    return tuple("sliding" if (i + 1) % pattern else "full" for i in range(layers))


def gguf_swa_layers(meta: Callable[[str, Any], Any]) -> list[str] | None:
    """config.json's ``layer_types`` from llama.cpp's per-layer ``attention.sliding_window_pattern``
    array (true: the layer slides), or None where the file has no such array of one value a layer."""
    pattern = meta("attention.sliding_window_pattern", None)
    layers = meta("block_count", 0)
    if not isinstance(pattern, tuple) or len(pattern) != layers:
        return None
    return ["sliding_attention" if flag else "full_attention" for flag in pattern]


def gguf_sliding(meta: Callable[[str, Any], Any]) -> dict[str, Any]:
    """config.json's ``sliding_window`` (None without one) and, where the file lists them, its
    ``layer_types`` (:func:`gguf_swa_layers`; else the family's default pattern applies)."""
    window = meta("attention.sliding_window", None)
    out: dict[str, Any] = {"sliding_window": int(window) if window else None}
    types = gguf_swa_layers(meta)
    if window and types is not None:
        out["layer_types"] = types
    return out


def _no_features(raw: Mapping[str, Any]) -> dict[str, Any]:
    return {}


def _no_gguf_config(meta: Callable[[str, Any], Any], names: frozenset[str]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Family:
    """One model family: what it covers and how it differs from the Llama layer."""

    name: str  #: the family's own model_type (the docs' row name)
    architectures: tuple[str, ...]  #: transformers class names (config.json ``architectures``)
    model_types: tuple[str, ...]  #: config.json ``model_type`` values
    #: transformers config class and tiny kwargs (on top of tests' common tiny shape) that
    #: exercise the family's distinctive features: the parity case and the demo checkpoint.
    config_class: str
    tiny: Mapping[str, Any] = field(default_factory=dict)
    gguf_architectures: tuple[str, ...] = ()  #: llama.cpp ``general.architecture`` names
    #: Where several families share a GGUF architecture (Mixtral is written as "llama"): whether
    #: a file is this family's, from its metadata (None: the architecture's default family).
    gguf_match: GgufMatch | None = None
    features: Features = _no_features
    gguf_config: GgufConfig = _no_gguf_config
    #: llama.cpp's converter permuted the Q/K rows (its Llama-style RoPE pairs neighbours).
    gguf_permuted_qk: bool = False
    #: llama.cpp's converter stored ``w + offset`` for every norm weight (Gemma: 1).
    gguf_norm_offset: float = 0.0
    #: GGUF layer tensor name -> layout slot, where it differs from :data:`layout.GGUF_SLOTS`.
    gguf_slots: Mapping[str, str] = field(default_factory=dict)
    #: layout slot -> Hugging Face name under ``model.layers.{i}.``, where it differs from Llama's.
    hf_names: Mapping[str, str] = field(default_factory=dict)
    #: slot -> Hugging Face name of a tensor outside the layers (``final_norm``), where it
    #: differs from :data:`layout.HF_GLOBAL_NAMES`.
    hf_global_names: Mapping[str, str] = field(default_factory=dict)
    tokenizer: str = "bpe"  #: "bpe" or "sentencepiece" (as its GGUF's tokenizer.ggml.model says)
    parsers: tuple[str, str] = ("none", "none")  #: ``auto`` (reasoning, tool-call) parsers
    lora_targets: tuple[str, ...] = LLAMA_LORA_TARGETS
    notes: str = ""  #: the docs row's remark (what is covered, what is not)

    @property
    def architecture(self) -> str:
        """The main transformers class (what a converted GGUF's config.json names)."""
        return self.architectures[0]


@dataclass(frozen=True)
class VisionFamily:
    """A vision-language family: a vision tower and projector in front of a language model of a
    registered text family (config.json's ``text_config``, built as that family's decoder).

    The checkpoint's tensors sit under prefixes that differ between transformers releases
    (``language_model.model.`` as written by ``save_pretrained``, ``model.language_model.`` in
    its in-memory layout); each tuple lists the candidates, the first one present is used."""

    name: str  #: config.json ``model_type`` of the whole model (the docs' row name)
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    #: (the checkpoint's prefix for the decoder's ``model.``, for its ``lm_head.``) candidate pairs
    text_prefixes: tuple[tuple[str, str], ...]
    vision_prefixes: tuple[str, ...]  #: where the vision tower's ``embeddings.`` ... live
    projector_prefixes: tuple[str, ...]  #: where the projector's ``linear_1`` ... live
    vision_model_types: tuple[str, ...]  #: ``vision_config.model_type`` values it builds
    text_model_type: str = "llama"  #: ``text_config.model_type`` when the config leaves it out
    #: transformers' config defaults of a language model by its model_type: the hub's configs
    #: (llava-hf's) write only the fields that differ from them in ``text_config``
    text_defaults: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    notes: str = ""
    #: The module that builds this family's vision side (``vision_side(raw, text_hidden)``, see
    #: :class:`inference.builder.vision_config.VisionSide`); None: LLaVA's CLIP builder.
    builder: str | None = None
    #: transformers ties ``lm_head`` to the embedding by the top-level ``tie_word_embeddings``
    #: (default False), whatever ``text_config`` says (Idefics3's models read their own config).
    tie_from_top: bool = False
    #: The language model's config.json where ``text_config`` over ``text_defaults`` is not it
    #: (Qwen2.5-VL: the hub's flat config, a text model_type of its own): raw -> that config.
    text_config: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    #: ModelConfig fields the family sets on its language model (Qwen2.5-VL: ``mrope_section``).
    text_features: Features = _no_features
    #: the docs table's language-model cell where it is not "text_config of a registered family"
    language_model: str = ""


def _load_vision() -> tuple[VisionFamily, ...]:
    from inference.families import gemma3, idefics3, llava, qwen2_5_vl

    return (llava.VISION_FAMILY, idefics3.IDEFICS3, idefics3.SMOLVLM, gemma3.VISION_FAMILY,
            qwen2_5_vl.VISION_FAMILY)


def _load() -> tuple[Family, ...]:
    from inference.families import (
        arcee,
        cohere,
        exaone4,
        gemma,
        gemma4,
        glm4,
        granite,
        llama,
        ministral,
        mistral,
        mixtral,
        nemotron,
        olmo2,
        olmo3,
        phi,
        phi3,
        qwen2,
        qwen2_moe,
        qwen3,
        qwen3_moe,
        seed_oss,
        smollm3,
        stablelm,
        starcoder2,
    )

    return (*(m.FAMILY for m in (llama, mistral, ministral, qwen2, qwen3, phi3, phi, granite, smollm3)),
            gemma.GEMMA, gemma.GEMMA2, gemma.GEMMA3, gemma4.GEMMA4,
            *(m.FAMILY for m in (olmo2, olmo3, exaone4, stablelm, starcoder2, nemotron, seed_oss, arcee)),
            cohere.COHERE, cohere.COHERE2, glm4.FAMILY,
            *(m.FAMILY for m in (mixtral, qwen2_moe, qwen3_moe)))


FAMILIES: tuple[Family, ...] = _load()
#: Vision-language families: apart from :data:`FAMILIES`, whose every entry is a text decoder
#: with its own parity case; their language model is one of :data:`FAMILIES`.
VISION_FAMILIES: tuple[VisionFamily, ...] = _load_vision()
_VISION_BY_ARCH = {a: f for f in VISION_FAMILIES for a in f.architectures}
_VISION_BY_TYPE = {t: f for f in VISION_FAMILIES for t in f.model_types}
_BY_ARCH = {a: f for f in FAMILIES for a in f.architectures}
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_GGUF: dict[str, list[Family]] = {}
for _f in FAMILIES:
    for _a in _f.gguf_architectures:
        _BY_GGUF.setdefault(_a, []).append(_f)


def family_names() -> tuple[str, ...]:
    """Every text family's name, in registry order."""
    return tuple(f.name for f in FAMILIES)


def vision_family_names() -> tuple[str, ...]:
    """Every vision-language family's name, in registry order."""
    return tuple(f.name for f in VISION_FAMILIES)


def unsupported(what: str) -> BuildInputError:
    """The one-line refusal for a model of no registered family."""
    return BuildInputError(
        f"unsupported model family {what}; supported: {', '.join(family_names())}; vision-language: "
        f"{', '.join(vision_family_names())} (see {DOCS_PAGE})"
    )


def vision_family_of(raw: Mapping[str, Any]) -> VisionFamily | None:
    """The vision-language family of a config.json (by architecture, else model_type), or None."""
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if isinstance(arch, str):
        return _VISION_BY_ARCH.get(arch)
    model_type = raw.get("model_type")
    return _VISION_BY_TYPE.get(model_type) if isinstance(model_type, str) else None


def text_config_of(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The language model's config.json of a vision-language config: its ``text_config`` over
    ``tie_word_embeddings`` of the top level over transformers' defaults of that model type (the
    family's ``text_defaults``; ``model_type`` the family's default where it is left out)."""
    family = vision_family_of(raw)
    if family is None:
        raise ValueError("not a vision-language config")
    if family.text_config is not None:
        own = family.text_config(raw)
        if own.get("model_type") not in _BY_TYPE:
            raise unsupported(f"{own.get('model_type')!r} (the language model of a {family.name} checkpoint)")
        return own
    text = raw.get("text_config")
    if text is None:
        text = {}
    if not isinstance(text, Mapping):
        raise BuildInputError(f"config.json text_config must be an object, got {type(text).__name__}")
    model_type = text.get("model_type", family.text_model_type)
    top = {"tie_word_embeddings": raw["tie_word_embeddings"]} if "tie_word_embeddings" in raw else {}
    out = {**family.text_defaults.get(str(model_type), {}), **top, **text, "model_type": model_type}
    if family.tie_from_top:
        out["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings", False))
    out.pop("architectures", None)
    if out["model_type"] not in _BY_TYPE:
        raise unsupported(f"{out['model_type']!r} (the language model of a {family.name} checkpoint)")
    return out


def family_of_config(raw: Mapping[str, Any]) -> Family:
    """The family of a config.json: by its first architecture, else by its model_type (of a
    vision-language checkpoint: its language model's family)."""
    if vision_family_of(raw) is not None:
        return family_of_config(text_config_of(raw))
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if isinstance(arch, str) and arch in _BY_ARCH:
        return _BY_ARCH[arch]
    model_type = raw.get("model_type")
    if arch is None and isinstance(model_type, str) and model_type in _BY_TYPE:
        return _BY_TYPE[model_type]
    if arch is None and model_type is None:
        raise BuildInputError(
            "config.json names no model family (no 'architectures', no 'model_type'); supported: "
            f"{', '.join(family_names())} (see {DOCS_PAGE})"
        )
    raise unsupported(repr(arch if arch is not None else model_type))


def family_of_gguf(arch: object, meta: Callable[[str, Any], Any] | None = None) -> Family:
    """The family of a GGUF's ``general.architecture`` (and, where families share one, of its
    ``<arch>.*`` metadata, read through ``meta``)."""
    if isinstance(arch, str) and arch in _BY_GGUF:
        candidates = _BY_GGUF[arch]
        if meta is not None:
            for f in candidates:
                if f.gguf_match is not None and f.gguf_match(meta):
                    return f
        default = [f for f in candidates if f.gguf_match is None]
        if default:
            return default[0]
    raise unsupported(f"{arch!r} (GGUF general.architecture)")


def family_by_name(name: str) -> Family:
    """The family whose model_types include ``name`` (KeyError if none)."""
    return _BY_TYPE[name]


def auto_parsers() -> dict[str, tuple[str, str]]:
    """``model_type`` -> default (reasoning, tool-call) parsers, every registered model_type."""
    return {t: f.parsers for f in FAMILIES for t in f.model_types}


def support_table() -> str:
    """The docs' support table (docs/model-families.md holds exactly this; a test checks)."""
    rows = ["| family | transformers classes | GGUF `general.architecture` | tokenizer | auto parsers "
            "(reasoning, tools) | LoRA targets | notes |",
            "|---|---|---|---|---|---|---|"]
    for f in FAMILIES:
        gguf = ", ".join(f.gguf_architectures) or "—"
        rows.append(f"| {f.name} | {', '.join(f.architectures)} | {gguf} | {f.tokenizer} | "
                    f"{f.parsers[0]}, {f.parsers[1]} | {', '.join(f.lora_targets)} | {f.notes} |")
    return "\n".join(rows) + "\n"


def vision_support_table() -> str:
    """The docs' vision-language table (docs/model-families.md holds exactly this; a test checks)."""
    rows = ["| family | transformers classes | vision tower | language model | notes |",
            "|---|---|---|---|---|"]
    for f in VISION_FAMILIES:
        language = f.language_model or f"text_config of a registered family (default {f.text_model_type})"
        rows.append(f"| {f.name} | {', '.join(f.architectures)} | {', '.join(f.vision_model_types)} | "
                    f"{language} | {f.notes} |")
    return "\n".join(rows) + "\n"
