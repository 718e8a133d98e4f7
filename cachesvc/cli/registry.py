"""``cachesvc registry``: the fleet's OCI registry of bundles (push and pull are ``bundles``
commands)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from cachesvc.cache.store.space import human_size
from cachesvc.cli.args import open_manager
from cachesvc.cli.output import emit_json, short_model, table


def cmd_registry_ls(args: argparse.Namespace) -> int:
    m = open_manager(args)
    try:
        entries = m.registry.list_remote(model=args.model)
    finally:
        m.close()
    if args.json:
        emit_json({"items": [dataclasses.asdict(e) for e in entries]})
        return 0
    rows = [(e.bundle_id, short_model(e.model), e.profile, e.machine_class, human_size(e.size_bytes),
             "yes" if e.fits_this_node else "no") for e in entries]
    print(table(("BUNDLE", "MODEL", "PROFILE", "CLASS", "SIZE", "FITS HERE"), rows, right=(4,)))
    return 0


def add_commands(sub: Any, cache_opts: argparse.ArgumentParser) -> None:
    """``registry ls``."""
    registry = sub.add_parser("registry", help="the fleet's OCI registry of bundles")
    rsub = registry.add_subparsers(dest="registry_command", metavar="COMMAND")
    rsub.required = True
    p = rsub.add_parser("ls", help="bundles the registry holds, and whether each fits this node",
                        parents=[cache_opts])
    p.add_argument("--model", default=None, help="only models whose name contains this")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_registry_ls)
