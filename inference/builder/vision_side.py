"""The builder's hook for a vision-language family with build steps of its own (a
:class:`inference.families.VisionFamily` with ``vision_side``; LLaVA's CLIP tower and MLP projector
are :mod:`.vision_config` and :mod:`.vision_graph`): what :func:`.ort_backend.build_bundle` asks of
it, around the language model it builds as for every vision family."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, cast

from inference.builder.checkpoint_reader import CheckpointReader
from inference.builder.model_config import ModelConfig
from inference.builder.spec import EngineBuildSpec
from inference.families import vision_family_of

#: How a bundle's image rows attend in the language model: causally (LLaVA), or both ways
#: within each image (Gemma 3; the decoder graph's ``image_attention``).
IMAGE_ATTENTION = ("causal", "bidirectional")


class VisionSide(Protocol):
    """One checkpoint's vision side, read from its config.json (refusals: one line naming the field)."""

    family: str
    #: how the language model's image rows attend (:data:`IMAGE_ATTENTION`)
    image_attention: str

    def check(self, cfg: ModelConfig, spec: EngineBuildSpec) -> None:
        """Refuse a spec or language model this side cannot be built with."""
        ...

    def read(self, checkpoint_dir: Path) -> None:
        """Read and check the checkpoint's processor and tokenizer settings."""
        ...

    def views(self, ckpt: CheckpointReader) -> tuple[CheckpointReader, CheckpointReader]:
        """(the language model's tensors under a text checkpoint's names, the vision side's)."""
        ...

    def write(self, vision_ckpt: CheckpointReader, out_dir: Path) -> Path:
        """Write the vision graph(s) into ``out_dir``; the main graph's path."""
        ...

    def record(self) -> dict[str, Any]:
        """``engine.json``'s ``vision`` record (``family`` names the runtime's encoder)."""
        ...


def vision_side_of(raw: Mapping[str, Any], text_hidden: int) -> VisionSide | None:
    """The vision side of a config.json whose family has its own build steps, else None (a text
    model, or LLaVA: :func:`.vision_config.vision_config_from`)."""
    family = vision_family_of(raw)
    if family is None or family.vision_side is None:
        return None
    return cast(VisionSide, family.vision_side(raw, text_hidden))
