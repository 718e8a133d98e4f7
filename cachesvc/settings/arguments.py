"""argparse flags generated from the setting declarations (:mod:`cachesvc.settings.declare`).

A value flag's ``type=`` parses the text and applies the setting's rule, so argparse errors name
the flag: ``argument --port: must be an integer between 1 and 65535, got 0``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from typing import Any

from cachesvc.settings.declare import Declared
from cachesvc.settings.rules import Invalid


def _arg_type(item: Declared) -> Callable[[str], Any]:
    """An argparse ``type=`` that parses the text and applies the setting's rule."""
    kind = item.kind
    convert: Callable[[str], Any] = kind or str
    what = {int: "an integer", float: "a number"}.get(kind, "text") if kind else "text"
    rule = item.spec.rule

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        try:
            return rule(value)
        except Invalid as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = item.name
    return parse


def add_flag(group: Any, item: Declared) -> None:
    """Add the setting's flag (or the positional) to a parser or argument group."""
    spec = item.spec
    kwargs: dict[str, Any] = {}
    if spec.action is not None:
        kwargs["action"] = spec.action
    if spec.choices is not None:
        kwargs["choices"] = spec.choices
    if spec.action is None and spec.choices is None:
        kwargs["type"] = spec.arg_type or _arg_type(item)
    if spec.metavar is not None:
        kwargs["metavar"] = spec.metavar
    elif "type" in kwargs and spec.arg_type is None and item.kind is not None:
        kwargs["metavar"] = "N" if item.kind is int else "NUM"
    # The field's own default, not the parser's where they differ: a repeatable flag starts
    # from None, and --help must still show the real one.
    kwargs["default"] = None if spec.action == "append" else item.default
    help_text = spec.help
    if spec.show_default and spec.action != "store_true" and item.default is not None:
        help_text += f" (default: {item.default})"
    if spec.positional:
        group.add_argument(item.name, nargs="?", help=help_text, **kwargs)
    else:
        group.add_argument(item.flag, dest=item.name, help=help_text, **kwargs)


def add_flags(parser: argparse.ArgumentParser, items: Iterable[Declared], sections: Iterable[str]) -> None:
    """One argument group per section (its ``--help`` heading), holding that section's flags."""
    items = tuple(items)
    for title in sections:
        group = parser.add_argument_group(title)
        for item in items:
            if item.spec.section == title and not item.spec.positional:
                add_flag(group, item)


def add_plain_flag(group: Any, item: Declared, dest: str) -> None:
    """The setting's flag with no default and no rule (only the number parsed), stored in ``dest``:
    for options whose value is validated later, with the rest of a config."""
    kwargs: dict[str, Any] = {"type": item.kind} if item.kind else {}
    if item.spec.action == "store_true":
        kwargs = {"action": "store_true"}
    help_text = item.spec.help
    if item.spec.show_default and item.default is not None and "action" not in kwargs:
        help_text += f" (default: {item.default})"
    if "action" not in kwargs:
        kwargs["metavar"] = item.spec.metavar
    group.add_argument(item.flag, dest=dest, default=argparse.SUPPRESS, help=help_text, **kwargs)
