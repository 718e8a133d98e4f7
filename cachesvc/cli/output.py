"""How the commands print: aligned tables, one-line sizes and times, ``--json`` values."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from cachesvc.cache.records import BundleInfo


def human_time(value: datetime | None) -> str:
    """A UTC timestamp to the second, or '-'."""
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """Aligned plain-text table; columns listed in ``right`` are right-aligned."""
    cells = [[str(c) for c in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def to_jsonable(value: Any) -> Any:
    """Dataclasses, paths and datetimes to JSON-ready values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def emit_json(value: Any) -> None:
    print(json.dumps(to_jsonable(value), indent=2, sort_keys=True))


def bundle_json(info: BundleInfo, root: Path) -> dict[str, Any]:
    data = to_jsonable(info)
    data["path"] = str(root / info.path)
    return data


def short_model(model: str) -> str:
    return model if len(model) <= 40 else "…" + model[-39:]
