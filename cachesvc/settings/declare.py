"""One declaration per launch setting: a dataclass field of its group whose metadata is a
:class:`Setting` (help, rule, flag layout, environment variable).

The field gives the name, the type and the default; the :class:`Setting` everything else. The
flags (:mod:`cachesvc.settings.arguments`), the docs table (:mod:`cachesvc.settings.table`), the
environment list and the validation of :class:`Group` are all read from these declarations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar, cast

from cachesvc.errors import ConfigError
from cachesvc.settings.rules import Invalid

T = TypeVar("T")
_KEY = "setting"


@dataclass(frozen=True)
class Setting:
    """Everything about one setting but its name, type and default (those are the field's)."""

    #: ``--help`` text of the flag (for a setting without a flag: its variable's help).
    help: str
    #: Returns the value, normalised, or raises :class:`~cachesvc.settings.rules.Invalid`.
    rule: Callable[[object], Any]
    #: The ``--help`` heading the flag appears under; None: no flag (an environment variable).
    section: str | None
    #: The ``CACHESVC_*`` variable that gives its default, the variable's default as text, and
    #: its help where it is not ``help``.
    env: str | None = None
    env_default: str = ""
    env_help: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    #: An argparse action (``store_true``, ``append``, a class); None: a value flag.
    action: Any = None
    #: The argparse ``type=`` when the field's type does not say it (JSON text).
    arg_type: Callable[[str], Any] | None = None
    #: ``--help`` appends ``(default: X)``; off where the help text says the default itself.
    show_default: bool = True
    #: The positional argument (``model``) rather than a flag.
    positional: bool = False
    #: Kept for compatibility but would change nothing: why (refused when not the default).
    no_effect: str | None = None
    #: How ``repr()`` shows a value that is not None (keys, passwords); None: as it is.
    mask: Callable[[Any], str] | None = None
    #: The docs table's default column where the value alone does not say it.
    doc_default: str | None = None


def setting(default: T, spec: Setting) -> T:
    """A group field with a fixed ``default``, declared by ``spec``."""
    return cast(T, dataclasses.field(default=default, metadata={_KEY: spec}))


def setting_from(factory: Callable[[], T], spec: Setting) -> T:
    """A group field whose default ``factory`` makes when a group is built (the environment)."""
    return cast(T, dataclasses.field(default_factory=factory, metadata={_KEY: spec}))


@dataclass(frozen=True)
class EnvVar:
    """One ``CACHESVC_*`` environment variable."""

    name: str
    #: Its value when unset or blank, as text.
    default: str
    help: str
    #: The flag that wins over it (``--cache-dir`` over ``CACHESVC_CACHE_DIR``), if any.
    flag: str | None = None
    #: The setting it gives the default of, if it is a launch setting.
    setting: str | None = None


class Declared(NamedTuple):
    """A setting as declared: its name, type annotation (text), fixed default (None when made by a
    factory), whether a factory makes the default, and its :class:`Setting`."""

    name: str
    annotation: str
    default: Any
    factory: bool
    spec: Setting

    @property
    def flag(self) -> str:
        """The flag (``--max-batch-size``), ``model`` for the positional, or the environment
        variable of a setting without a flag."""
        if self.spec.section is None and self.spec.env is not None:
            return self.spec.env
        return self.name if self.spec.positional else "--" + self.name.replace("_", "-")

    @property
    def kind(self) -> type | None:
        """``int`` or ``float`` for a number, else None (text, flags, paths...)."""
        return {"int": int, "int | None": int, "float": float, "float | None": float}.get(self.annotation)


_DECLARED: dict[type, tuple[Declared, ...]] = {}


def declared(group: type) -> tuple[Declared, ...]:
    """The settings a group class declares, in order."""
    if group not in _DECLARED:
        out = []
        for f in dataclasses.fields(group):
            fixed = f.default is not dataclasses.MISSING
            default = f.default if fixed else None
            out.append(Declared(f.name, str(f.type), default, not fixed, f.metadata[_KEY]))
        _DECLARED[group] = tuple(out)
    return _DECLARED[group]


@dataclass(frozen=True, repr=False)
class Group:
    """A settings group: a frozen dataclass of :func:`setting` fields, each value checked by its
    rule when the group is built (the error names the flag); :meth:`check` adds rules across the
    group's own fields; then a compatibility flag that would change nothing is refused."""

    def __post_init__(self) -> None:
        for item in declared(type(self)):
            value = getattr(self, item.name)
            try:
                normalised = item.spec.rule(value)
            except Invalid as exc:
                raise ConfigError(item.flag, str(exc)) from None
            if normalised is not value:
                # Frozen: normalisation (int -> float, ~ expansion) happens once, here.
                object.__setattr__(self, item.name, normalised)
        self.check()
        for item in declared(type(self)):
            why = item.spec.no_effect
            if why is not None and getattr(self, item.name) != item.default:
                raise ConfigError(item.flag, f"has no effect in this version ({why}): drop {item.flag}")

    def check(self) -> None:
        """Rules across this group's fields; none unless a group adds them."""

    def __repr__(self) -> str:
        parts = []
        for item in declared(type(self)):
            value = getattr(self, item.name)
            shown = item.spec.mask(value) if item.spec.mask and value is not None else repr(value)
            parts.append(f"{item.name}={shown}")
        return f"{type(self).__name__}({', '.join(parts)})"
