"""``cachesvc models``: served model names (aliases in the catalog)."""

from __future__ import annotations

import argparse
from typing import Any

from cachesvc.cli.args import open_manager
from cachesvc.cli.output import emit_json, table
from cachesvc.errors import NotFoundError


def cmd_models_ls(args: argparse.Namespace) -> int:
    items = open_manager(args).catalog.aliases.all()
    if args.json:
        emit_json(items)
        return 0
    rows = [[a.name, a.bundle_id or "-", a.model or "-", a.created_at.isoformat()] for a in items]
    print(table(["NAME", "BUNDLE", "MODEL", "CREATED"], rows))
    return 0


def cmd_models_alias(args: argparse.Namespace) -> int:
    manager = open_manager(args)
    target: str = args.target
    try:
        manager.catalog.bundles.require(target)
        alias = manager.set_alias(args.name, bundle_id=target)
    except NotFoundError:
        alias = manager.set_alias(args.name, model=target)
    print(f"{alias.name} -> {alias.bundle_id or alias.model}")
    return 0


def cmd_models_unalias(args: argparse.Namespace) -> int:
    open_manager(args).remove_alias(args.name)
    print(f"removed {args.name}")
    return 0


def add_commands(sub: Any, cache_opts: argparse.ArgumentParser) -> None:
    """``models ls|alias|unalias``."""
    models = sub.add_parser("models", help="served model names (aliases)")
    msub = models.add_subparsers(dest="models_command", metavar="COMMAND")
    msub.required = True
    p = msub.add_parser("ls", help="list model aliases", parents=[cache_opts])
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_models_ls)
    p = msub.add_parser("alias", help="serve a bundle id or checkpoint under NAME", parents=[cache_opts])
    p.add_argument("name", help="the served name")
    p.add_argument("target", help="a bundle id, or a checkpoint id/path in the catalog")
    p.set_defaults(func=cmd_models_alias)
    p = msub.add_parser("unalias", help="remove a model alias", parents=[cache_opts])
    p.add_argument("name")
    p.set_defaults(func=cmd_models_unalias)
