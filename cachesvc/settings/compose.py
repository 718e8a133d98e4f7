"""Settings by name -> values for the groups: what ``ServeConfig(...)``, ``from_mapping`` and
``from_namespace`` share. Flat names (``max_batch_size``, ``max-batch-size``, ``--max-batch-size``)
are the external format; each goes to the one group that declares it."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cachesvc.errors import ConfigError
from cachesvc.settings.declare import Declared, Group, declared
from cachesvc.settings.speculative import SpeculativeConfig


def build_groups(
    groups: Mapping[str, type[Group]], given: Mapping[str, Group | None], values: Mapping[str, Any]
) -> dict[str, Group]:
    """Each group: the one given, with the ``values`` it declares replaced, or a new one from them."""
    owner = {d.name: name for name, cls in groups.items() for d in declared(cls)}
    unknown = sorted(set(values) - set(owner))
    if unknown:
        raise TypeError(f"ServeConfig() got an unexpected keyword argument {unknown[0]!r}")
    out: dict[str, Group] = {}
    for name, cls in groups.items():
        mine = {k: v for k, v in values.items() if owner[k] == name}
        group = given.get(name)
        if group is None:
            group = cls(**mine)
        elif mine:
            group = dataclasses.replace(group, **mine)
        out[name] = group
    return out


def mapping_values(mapping: Mapping[str, Any], settings: Mapping[str, Declared]) -> dict[str, Any]:
    """``from_mapping``'s keys to setting names, values converted where unambiguous; unknown keys
    and a setting given twice are refused by name."""
    known = list(settings)
    values: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in mapping.items():
        if not isinstance(key, str):
            raise ConfigError(repr(key), f"option names must be strings, got {type(key).__name__}")
        name = key.removeprefix("--").replace("-", "_")
        if name not in settings:
            hint = difflib.get_close_matches(name, known, n=1)
            suggestion = f"; did you mean {hint[0]!r}?" if hint else ""
            raise ConfigError(key, f"unknown option {key!r}{suggestion} (known: {', '.join(known)})")
        if name in values:
            raise ConfigError(settings[name].flag, f"given twice (as {given_as[name]!r} and {key!r})")
        given_as[name] = key
        values[name] = _convert(settings[name], value)
    if values.get("cache_dir", 0) is None:
        del values["cache_dir"]  # None means "the default", as it does on the command line
    return values


def _convert(item: Declared, value: Any) -> Any:
    """The unambiguous conversions; everything else goes to the rules unchanged."""
    if item.annotation == "Path" and isinstance(value, str) and value.strip():
        return Path(value)
    if item.annotation == "SpeculativeConfig | None" and isinstance(value, str | Mapping):
        return SpeculativeConfig.parse(value)
    if item.kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def namespace_values(namespace: argparse.Namespace, settings: Mapping[str, Declared]) -> dict[str, Any]:
    """The settings an argparse namespace holds; other attributes (subcommand state) are ignored."""
    given = vars(namespace)
    values = {name: given[name] for name in settings if name in given}
    if values.get("cache_dir") is None:
        # The parser's None means "the default", which depends on the environment.
        values.pop("cache_dir", None)
    else:
        values["cache_dir"] = Path(values["cache_dir"])
    return values
