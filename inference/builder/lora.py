"""PEFT LoRA adapters -> onnxruntime adapter files for a LoRA-capable bundle.

A bundle built with ``lora`` (:func:`inference.builder.graph.build_decoder_graph`) has, for
every layer and every projection (q/k/v/o, gate/up/down), two graph inputs
``<prefix>.lora_A [in, r]`` and ``<prefix>.lora_B [r, out]`` whose defaults are rank 0 (no
adapter: no change). An adapter file (onnxruntime's ``AdapterFormat``) holds the values of the
pairs an adapter targets; the engine activates one per run (``RunOptions.add_active_adapter``),
so one loaded bundle serves many adapters with its base weights shared.

:func:`convert_peft_adapter` reads a PEFT adapter directory (``adapter_config.json`` +
``adapter_model.safetensors``), checks it against the base model (the model family it declares,
its shapes; every value finite), folds the scale
(``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA) into B, and writes the file. What PEFT can
express that this graph cannot (DoRA, biases, extra trained modules, embedding or lm_head
targets, per-module rank patterns) is refused with one line naming the field.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from inference.builder.errors import BuildInputError
from inference.builder.layout import layer_slots, names_for
from inference.builder.model_config import ModelConfig
from inference.builder.safetensors_reader import SafetensorsCheckpoint
from inference.families import FAMILIES, family_by_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: A transformers class name -> its model family (``Qwen2ForCausalLM`` -> ``Qwen2``).
_FAMILY = re.compile(r"^([A-Za-z0-9]+?)(?:For[A-Z]\w*|LMHeadModel|PreTrainedModel|Model)$")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.([\w.]+?)\."
                  r"lora_([AB])(?:\.default)?\.weight$")


class LoraAdapterError(BuildInputError):
    """An adapter this bundle cannot run (with what to fix)."""


@dataclass(frozen=True)
class LoraInfo:
    """What an adapter file holds: rank, scale, targeted modules, layers, parameter count."""

    rank: int
    scale: float
    targets: tuple[str, ...]
    layers: int
    parameters: int

    def record(self) -> dict[str, Any]:
        """JSON-ready."""
        return {"rank": self.rank, "scale": self.scale, "targets": list(self.targets),
                "layers": self.layers, "parameters": self.parameters}


def lora_modules(cfg: ModelConfig, layer: int = 0) -> dict[str, tuple[int, int]]:
    """The projections an adapter may target in layer ``layer`` of ``cfg``'s family (its
    ``lora_targets``, by module path under ``model.layers.{i}.``, e.g. ``self_attn.q_proj``) ->
    (in, out). Layers differ where the family's do (Gemma 4's global layers, its layers sharing
    another's K/V, which have no k/v projections)."""
    names = names_for(cfg)
    targets = family_by_name(cfg.family).lora_targets
    out: dict[str, tuple[int, int]] = {}
    for slot, shape, _ in layer_slots(cfg, layer):
        path = names.layer_names[slot]
        if len(shape) == 2 and path.rsplit(".", 1)[-1] in targets:
            out[path] = (shape[1], shape[0])
    return out


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    """``adapter_config.json``, checked for what the graph can run."""
    path = Path(adapter_dir) / ADAPTER_CONFIG
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoraAdapterError(f"{adapter_dir} has no {ADAPTER_CONFIG}: give a PEFT LoRA adapter directory "
                               "(adapter_config.json + adapter_model.safetensors)") from None
    except ValueError as exc:
        raise LoraAdapterError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise LoraAdapterError(f"{path} must hold a JSON object")
    kind = raw.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoraAdapterError(f"peft_type {kind!r} is not supported: only LORA adapters are")
    refusals = {
        "use_dora": (bool(raw.get("use_dora")), "DoRA adapters are not supported"),
        "bias": (raw.get("bias", "none") != "none", "adapters that train biases are not supported"),
        "modules_to_save": (bool(raw.get("modules_to_save")), "extra trained modules are not supported"),
        "fan_in_fan_out": (bool(raw.get("fan_in_fan_out")), "Conv1D (GPT-2) adapters are not supported"),
        "rank_pattern": (bool(raw.get("rank_pattern")), "per-module ranks are not supported"),
        "alpha_pattern": (bool(raw.get("alpha_pattern")), "per-module alphas are not supported"),
    }
    for field, (bad, why) in refusals.items():
        if bad:
            raise LoraAdapterError(f"{path}: {field}: {why}")
    rank = raw.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoraAdapterError(f"{path}: r must be a positive integer, got {rank!r}")
    return raw


def declared_base(config: dict[str, Any]) -> tuple[str, str] | None:
    """The base model class an adapter says it was trained on and its family (``model_type``),
    e.g. ``("Qwen2ForCausalLM", "qwen2")``: PEFT's ``auto_mapping.base_model_class`` (written by
    ``save_pretrained`` for an adapter made without a ``task_type``); None when it declares none
    (``base_model_name_or_path`` is a name or a path, not a class: not read)."""
    mapping = config.get("auto_mapping")
    cls = mapping.get("base_model_class") if isinstance(mapping, dict) else None
    if not isinstance(cls, str) or not cls.strip():
        return None
    registered = [f.model_types[0] for f in FAMILIES if cls in f.architectures]
    if registered:  # the registry knows it (Qwen2MoeForCausalLM is qwen2_moe, not "qwen2moe")
        return cls, registered[0]
    match = _FAMILY.match(cls)
    return cls, (match[1] if match else cls).lower()


def check_base_family(config: dict[str, Any], cfg: ModelConfig, where: Path) -> None:
    """``LoraAdapterError`` when the adapter declares a base model of another family than ``cfg``
    (a Qwen2 adapter on a Llama base of the same shapes would run, and answer nonsense)."""
    declared = declared_base(config)
    if declared is not None and declared[1] != cfg.model_type:
        raise LoraAdapterError(
            f"{where}: the adapter was made for {declared[0]} ({declared[1]}) but the base model is "
            f"{cfg.architecture} ({cfg.model_type}); load it on a {declared[1]} base model"
        )


def adapter_scale(config: dict[str, Any]) -> float:
    """PEFT's scale: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``."""
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def adapter_arrays(adapter_dir: Path, cfg: ModelConfig) -> tuple[dict[str, np.ndarray], LoraInfo]:
    """The graph inputs an adapter sets (``<prefix>.lora_A [in, r]``, ``.lora_B [r, out]``,
    scale folded into B) and what it holds."""
    config = read_adapter_config(adapter_dir)
    check_base_family(config, cfg, Path(adapter_dir) / ADAPTER_CONFIG)
    weights_path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        raise LoraAdapterError(f"{adapter_dir} has no {ADAPTER_WEIGHTS} (PEFT's safetensors weights)")
    reader = SafetensorsCheckpoint.from_file(weights_path)
    scale = adapter_scale(config)
    modules = {m: io for i in range(cfg.num_layers) for m, io in lora_modules(cfg, i).items()}
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key in reader.names():
        match = _KEY.match(key)
        if match is None:
            raise LoraAdapterError(f"{weights_path}: tensor {key!r} targets no projection of a decoder "
                                   f"layer ({', '.join(modules)}); embedding/lm_head adapters are "
                                   "not supported")
        layer, module, side = int(match[1]), match[2], match[3]
        if module not in modules:
            raise LoraAdapterError(f"{weights_path}: {key!r}: module {module} is not one of "
                                   f"{', '.join(modules)} (the {cfg.family} family's LoRA targets"
                                   f"{'; LoRA of the experts is not supported' if cfg.moe else ''})")
        if layer >= cfg.num_layers:
            raise LoraAdapterError(f"{weights_path}: {key!r}: layer {layer} but the base model has "
                                   f"{cfg.num_layers} layers (an adapter of another model?)")
        if module not in lora_modules(cfg, layer):
            raise LoraAdapterError(f"{weights_path}: {key!r}: layer {layer} of the base model has no "
                                   f"{module} (an adapter of another model?)")
        pairs.setdefault((layer, module), {})[side] = reader.get_f32(key)
    if not pairs:
        raise LoraAdapterError(f"{weights_path} holds no LoRA weights")
    rank = int(config["r"])
    out: dict[str, np.ndarray] = {}
    for (layer, module), sides in sorted(pairs.items()):
        prefix = f"model.layers.{layer}.{module}"
        if set(sides) != {"A", "B"}:
            raise LoraAdapterError(f"{weights_path}: {prefix} has lora_{''.join(sides)} only; both A and B "
                                   "are needed")
        d_in, d_out = lora_modules(cfg, layer)[module]
        a, b = sides["A"], sides["B"]
        if a.shape != (rank, d_in) or b.shape != (d_out, rank):
            raise LoraAdapterError(
                f"{weights_path}: {prefix}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the "
                f"base model (expected [{rank}, {d_in}] / [{d_out}, {rank}]): an adapter of another model?")
        folded = {"A": np.ascontiguousarray(a.T), "B": np.ascontiguousarray(b.T * np.float32(scale))}
        for side, values in folded.items():
            # NaN or Inf would reach every answer of the adapter's name (as '' or garbage).
            if not np.isfinite(values).all():
                raise LoraAdapterError(
                    f"{weights_path}: {prefix}.lora_{side} holds NaN or Inf values (after PEFT's scale "
                    f"{scale:g}); the adapter is broken: train or export it again")
            out[f"{prefix}.lora_{side}"] = values
    info = LoraInfo(rank=rank, scale=scale, targets=tuple(sorted({m.rsplit(".", 1)[-1] for _, m in pairs})),
                    layers=len({layer for layer, _ in pairs}),
                    parameters=int(sum(v.size for v in out.values())))
    return out, info


def convert_peft_adapter(adapter_dir: Path, cfg: ModelConfig, out_path: Path) -> LoraInfo:
    """Write ``out_path`` (onnxruntime adapter format) from the PEFT adapter in ``adapter_dir``."""
    arrays, info = adapter_arrays(adapter_dir, cfg)
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(1)
    fmt.set_parameters({name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in arrays.items()})
    fmt.export_adapter(str(out_path))
    return info
