"""``cachesvc fleet status``: converged / converging / failed per node of the catalog."""

from __future__ import annotations

import argparse
from typing import Any

from cachesvc.cli.args import cache_config
from cachesvc.cli.output import emit_json


def cmd_fleet_status(args: argparse.Namespace) -> int:
    from cachesvc.cache.catalog import Catalog
    from cachesvc.cache.catalog.fleet import FleetCatalog
    from cachesvc.fleet.status import exit_code, status_lines

    catalog = Catalog(cache_config(args).cache.catalog_url_resolved, node="cli")
    try:
        nodes = FleetCatalog(catalog).nodes()
    finally:
        catalog.close()
    if args.json:
        emit_json({"items": nodes})
    else:
        print("\n".join(status_lines(nodes)))
    return exit_code(nodes)


def add_commands(sub: Any, cache_opts: argparse.ArgumentParser) -> None:
    """``fleet status``."""
    fleet = sub.add_parser("fleet", help="nodes sharing this catalog")
    fsub = fleet.add_subparsers(dest="fleet_command", metavar="COMMAND")
    fsub.required = True
    p = fsub.add_parser(
        "status",
        help="converged / converging / failed per node (exit 0, 3 while converging, 1 on a failure)",
        parents=[cache_opts],
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_fleet_status)
