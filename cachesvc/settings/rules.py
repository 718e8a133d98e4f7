"""Value rules of the launch settings: each takes a value and returns it (normalised) or raises
:class:`Invalid`; the caller names the flag (a ``ConfigError`` or an argparse error)."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from inference.build_profile import ProfileError, check_shape

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


class Invalid(Exception):
    """A value breaks a rule; the caller attaches the flag (ConfigError or ArgumentTypeError)."""


def is_int(value: object) -> bool:
    # bool is an int subclass, but True as a batch size is a bug, not a request for 1.
    return isinstance(value, int) and not isinstance(value, bool)


def int_rule(minimum: int, maximum: int | None = None) -> Callable[[object], int]:
    if maximum is not None:
        if minimum == 1 and maximum == 65535:
            what = f"an integer between {minimum} and {maximum}"
        else:
            what = f"a {'positive' if minimum == 1 else 'non-negative'} integer <= {maximum}"
    else:
        what = "a positive integer" if minimum == 1 else "a non-negative integer"

    def check(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Invalid(f"must be {what}, got {value!r} ({type(value).__name__})")
        if value < minimum or (maximum is not None and value > maximum):
            raise Invalid(f"must be {what}, got {value}")
        return value

    return check


def optional(rule: Callable[[object], Any]) -> Callable[[object], Any]:
    def check(value: object) -> Any:
        return None if value is None else rule(value)

    return check


def keep_alive_rule(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Invalid(f"must be seconds (-1 = never unload, 0 = unload when idle), got {value!r}")
    number = float(value)
    if not math.isfinite(number) or (number < 0 and number != -1):
        raise Invalid(f"must be -1 (never unload), 0 (unload when idle) or positive seconds, got {value!r}")
    return number


def positive_float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Invalid(f"must be a finite number greater than 0, got {value!r} ({type(value).__name__})")
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise Invalid(f"must be a finite number greater than 0, got {value!r}")
    return number


def non_negative_float(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Invalid(f"must be a finite number, 0 or more, got {value!r} ({type(value).__name__})")
    number = float(value)
    if not math.isfinite(number) or number < 0:
        raise Invalid(f"must be a finite number, 0 or more, got {value!r}")
    return number


def choice_rule(choices: tuple[str, ...]) -> Callable[[object], str]:
    def check(value: object) -> str:
        if not isinstance(value, str) or value not in choices:
            raise Invalid(f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    return check


def text_rule(what: str, *, optional: bool) -> Callable[[object], str | None]:
    def check(value: object) -> str | None:
        if value is None and optional:
            return None
        if not isinstance(value, str) or not value.strip():
            raise Invalid(f"must be {what}, got {value!r}")
        return value

    return check


def list_rule(what: str) -> Callable[[object], str | None]:
    def check(value: object) -> str | None:
        if value is None:
            return None
        if not isinstance(value, str) or not split_list(value):
            raise Invalid(f"must be {what}, got {value!r}")
        return value

    return check


def split_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


#: A LoRA adapter's served name: what a request's ``model`` names to run it.
_LORA_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def lora_modules_rule(value: object) -> tuple[str, ...]:
    """vLLM's ``--lora-modules``: ``NAME=PATH`` or ``{"name": ..., "path": ...}`` each; returned
    as ``NAME=PATH`` strings, names unique."""
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, tuple | list):
        raise Invalid(f"must be a list of NAME=PATH entries, got {value!r}")
    out: list[str] = []
    names: set[str] = set()
    for item in value:
        name, path = _lora_module(item)
        if name in names:
            raise Invalid(f"names the adapter {name!r} twice")
        names.add(name)
        out.append(f"{name}={path}")
    return tuple(out)


def _lora_module(item: object) -> tuple[str, str]:
    if isinstance(item, str) and item.lstrip().startswith("{"):
        try:
            obj = json.loads(item)
        except ValueError:
            raise Invalid(
                f'{item!r} is not valid JSON; give NAME=PATH or {{"name": NAME, "path": PATH}}'
            ) from None
        if not (
            isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("path"), str)
        ):
            raise Invalid(f'{item!r} needs string "name" and "path" keys')
        name, path = obj["name"], obj["path"]
    elif isinstance(item, str) and "=" in item:
        name, _, path = item.partition("=")
    else:
        raise Invalid(
            f"{item!r} is not NAME=PATH (a served name, then the PEFT adapter's directory or hub id)"
        )
    name, path = name.strip(), path.strip()
    if not _LORA_NAME_RE.match(name):
        raise Invalid(
            f"adapter name {name!r} must be 1-128 letters, digits or ._:/- (first a letter or digit)"
        )
    if not path:
        raise Invalid(f"adapter {name!r} has no path")
    return name, path


def lora_module_pairs(modules: tuple[str, ...]) -> list[tuple[str, str]]:
    """``--lora-modules`` as (served name, adapter source) pairs."""
    return [(m.partition("=")[0], m.partition("=")[2]) for m in modules]


def bool_rule(value: object) -> bool:
    if not isinstance(value, bool):
        raise Invalid(f"must be true or false, got {value!r} ({type(value).__name__})")
    return value


def path_rule(value: object) -> Path:
    if not isinstance(value, str | os.PathLike) or not str(os.fspath(value)).strip():
        raise Invalid(f"must be a directory path, got {value!r}")
    return Path(value).expanduser()


def catalog_url_rule(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _URL_RE.match(value):
        raise Invalid(
            "must be an SQLAlchemy database URL such as sqlite:////var/lib/cachesvc/catalog.sqlite3 "
            f"or postgresql+psycopg://user@host/db, got {value!r}"
        )
    return value


def shape_rule(name: str) -> Callable[[object], int]:
    def check(value: object) -> int:
        try:
            return check_shape(name, value)
        except ProfileError as exc:
            raise Invalid(exc.detail) from None

    return check


positive_int = int_rule(1)
non_negative_int = int_rule(0)
