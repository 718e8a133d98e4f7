"""What a model is called where people read it: the served name.

``/v1/models``, ``/health``, the dashboard and the admin API's ``model_name`` fields name a
checkpoint the same way: an operator's alias where one names it, else its hub id, else the last
component of its local path (``qwen3-tiny`` for ``/data/qwen3-tiny``). Local paths stay out of what
a client or a dashboard shows first (a tooltip may carry them).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from cachesvc.cache.records import AliasInfo


def is_path(model: str) -> bool:
    """Whether a checkpoint name is a local path (not a hub id such as ``org/model``)."""
    return os.path.isabs(model) or model.startswith(("~", "./", "../"))


def short_name(model: str) -> str:
    """The last component of a checkpoint path (``/data/qwen3-tiny/`` -> ``qwen3-tiny``)."""
    return Path(model.rstrip("/" + os.sep)).name or model


def public_name(model: str) -> str:
    """A checkpoint path by its last component, a hub id as it is."""
    return short_name(model) if is_path(model) else model


def model_labels(models: Iterable[str], aliases: Iterable[AliasInfo],
                 bundle_models: Mapping[str, str]) -> dict[str, str]:
    """``model`` -> its served name, for each of ``models``: the first alias (by name) that names
    the checkpoint or one of its bundles (``bundle_models``: bundle id -> model), else
    :func:`public_name`."""
    named: dict[str, str] = {}
    for alias in sorted(aliases, key=lambda a: a.name):
        target = alias.model if alias.model is not None else bundle_models.get(alias.bundle_id or "")
        if target is not None:
            named.setdefault(target, alias.name)
    return {m: named.get(m) or public_name(m) for m in models}
