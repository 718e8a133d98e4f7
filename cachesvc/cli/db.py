"""``cachesvc db``: the catalog's schema (upgrade, current revision) and its repair."""

from __future__ import annotations

import argparse
from typing import Any

from cachesvc.cli.args import CliError, cache_config, open_manager


def cmd_db_repair(args: argparse.Namespace) -> int:
    """Move an unreadable catalog aside, open a fresh one and re-adopt the bundles on disk."""
    from cachesvc.cache.catalog import Catalog
    from cachesvc.cache.catalog.session import move_sqlite_aside
    from cachesvc.errors import CatalogError

    config = cache_config(args)
    url = config.cache.catalog_url_resolved
    if not args.force:
        catalog = Catalog(url, node="cli")
        try:
            catalog.current_revision()
            catalog.bundles.page(limit=1)
        except CatalogError:
            pass
        else:
            print("the catalog is readable; nothing to repair (--force moves it aside anyway)")
            return 0
        finally:
            catalog.close()
    if not url.startswith("sqlite:"):
        raise CliError("only a SQLite catalog file can be repaired this way; restore the database instead", 1)
    moved = move_sqlite_aside(url)
    manager = open_manager(args)
    try:
        report = manager.reconciler.reconcile()
    finally:
        manager.close()
    where = f"moved the old catalog to {moved}; " if moved is not None else ""
    print(
        f"{where}new catalog re-adopted {len(report.adopted)} bundles from disk "
        "(pins, hit counts and history start afresh)"
    )
    return 0


def cmd_db(args: argparse.Namespace) -> int:
    from cachesvc.cache.catalog import Catalog
    from cachesvc.cache.catalog.migrate import head_revision

    catalog = Catalog(cache_config(args).cache.catalog_url_resolved, node="cli")
    try:
        if args.db_command == "upgrade":
            catalog.upgrade(args.revision)
            print(f"catalog at revision {catalog.current_revision()}")
        else:
            current = catalog.current_revision()
            head = head_revision()
            state = "up to date" if current == head else f"behind (head is {head}; run `cachesvc db upgrade`)"
            print(f"{current or 'empty (never migrated)'}  {state}")
    finally:
        catalog.close()
    return 0


def add_commands(sub: Any, cache_opts: argparse.ArgumentParser) -> None:
    """``db upgrade|current|repair``."""
    db = sub.add_parser("db", help="catalog schema")
    dsub = db.add_subparsers(dest="db_command", metavar="COMMAND")
    dsub.required = True
    p = dsub.add_parser("upgrade", help="migrate the catalog to the newest schema", parents=[cache_opts])
    p.add_argument("revision", nargs="?", default="head")
    p.set_defaults(func=cmd_db)
    p = dsub.add_parser("current", help="print the catalog's schema revision", parents=[cache_opts])
    p.set_defaults(func=cmd_db)
    p = dsub.add_parser(
        "repair",
        help="move an unreadable catalog aside and re-adopt the bundles on disk",
        parents=[cache_opts],
    )
    p.add_argument("--force", action="store_true", help="move the catalog aside even if it reads fine")
    p.set_defaults(func=cmd_db_repair)
