"""The settings as a Markdown table (docs/configuration.md keeps it between
``<!-- settings:start -->`` and ``<!-- settings:end -->``; a test keeps the two equal)."""

from __future__ import annotations

import argparse
from collections.abc import Iterable

from cachesvc.settings.declare import Declared, EnvVar


def _cell(text: str) -> str:
    # argparse help doubles its percent signs; a cell must not split at a pipe, and <think> or
    # <cache-dir> is text, not an HTML tag.
    return text.replace("%%", "%").replace("|", "\\|").replace("<", "\\<")


def _flag(item: Declared) -> str:
    spec = item.spec
    if spec.positional:
        return f"`{item.name}` (positional)"
    if spec.section is None:
        return "none"
    if spec.action is argparse.BooleanOptionalAction:
        return f"`{item.flag}` / `--no-{item.flag[2:]}`"
    if spec.action == "append":
        return f"`{item.flag} {spec.metavar}` (repeatable)"
    return f"`{item.flag}`"


def _default(item: Declared) -> str:
    spec = item.spec
    if spec.doc_default is not None:
        return spec.doc_default
    if item.factory:  # read from its variable when a config is built
        return f"`{spec.env_default}`" if spec.env_default else "unset"
    if isinstance(item.default, bool):
        return "on" if item.default else "off"
    return "none" if item.default is None else f"`{item.default}`"


def _help(item: Declared) -> str:
    spec = item.spec
    text = spec.help
    if spec.choices is not None:
        text += "; one of " + ", ".join(f"`{c}`" for c in spec.choices)
    if spec.no_effect is not None:
        text += f"; refused unless the default: {spec.no_effect}"
    return _cell(text)


def markdown_table(items: Iterable[tuple[str, Declared]], others: Iterable[EnvVar] = ()) -> str:
    """One row per (group name, setting): the attribute, flag, variable, default and help; then
    one per variable in ``others`` (no setting). Each line ends with a newline."""
    lines = ["| setting | flag | variable | default | help |", "|---|---|---|---|---|"]
    for group, item in items:
        env = f"`{item.spec.env}`" if item.spec.env else ""
        row = [f"`{group}.{item.name}`", _flag(item), env, _default(item), _help(item)]
        lines.append(f"| {' | '.join(row)} |")
    for var in others:
        default = f"`{var.default}`" if var.default else "unset"
        lines.append(f"| none | none | `{var.name}` | {default} | {_cell(var.help)} |")
    return "".join(line + "\n" for line in lines)
