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
_BY_ARCH = {a: f for f in FAMILIES for a in f.architectures}
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
_BY_GGUF: dict[str, list[Family]] = {}
for _f in FAMILIES:
    for _a in _f.gguf_architectures:
        _BY_GGUF.setdefault(_a, []).append(_f)


def family_names() -> tuple[str, ...]:
    """Every family's name, in registry order."""
    return tuple(f.name for f in FAMILIES)


def unsupported(what: str) -> BuildInputError:
    """The one-line refusal for a model of no registered family."""
    return BuildInputError(
        f"unsupported model family {what}; supported: {', '.join(family_names())} (see {DOCS_PAGE})"
    )


def family_of_config(raw: Mapping[str, Any]) -> Family:
    """The family of a config.json: by its first architecture, else by its model_type."""
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
