"""``cachesvc checkpoints``: the resolved checkpoints; remove one."""

from __future__ import annotations

import argparse
from typing import Any

from cachesvc.cache.store.space import human_size
from cachesvc.cli.args import open_manager
from cachesvc.cli.output import emit_json, short_model, table


def cmd_checkpoints_ls(args: argparse.Namespace) -> int:
    items = open_manager(args).catalog.checkpoints.all()
    if args.json:
        emit_json(items)
        return 0
    rows = [
        [
            c.digest[:16],
            short_model(c.source),
            human_size(c.size_bytes),
            c.file_count,
            len(c.bundle_ids),
            str(c.path),
        ]
        for c in items
    ]
    print(table(["DIGEST", "SOURCE", "SIZE", "FILES", "BUNDLES", "PATH"], rows, right=(2, 3, 4)))
    return 0


def cmd_checkpoints_rm(args: argparse.Namespace) -> int:
    done = open_manager(args).remove_checkpoint(args.ref, with_bundles=args.with_bundles)
    if args.json:
        emit_json(done)
        return 0
    if done.bundles_removed:
        print(f"removed {len(done.bundles_removed)} bundle(s), freed {human_size(done.bundle_bytes)}")
    if done.files_deleted:
        print(f"removed checkpoint {done.digest[:16]} ({done.path}), freed {human_size(done.file_bytes)}")
    else:
        print(f"forgot checkpoint {done.digest[:16]}; its files at {done.path} are not the cache's and stay")
    return 0


def add_commands(sub: Any, cache_opts: argparse.ArgumentParser) -> None:
    """``checkpoints ls`` and ``checkpoints rm``."""
    ckpts = sub.add_parser("checkpoints", help="resolved checkpoints")
    csub = ckpts.add_subparsers(dest="checkpoints_command", metavar="COMMAND")
    csub.required = True
    p = csub.add_parser("ls", help="list resolved checkpoints", parents=[cache_opts])
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_checkpoints_ls)
    p = csub.add_parser(
        "rm",
        help="remove a checkpoint: its catalog row, and its files when the cache downloaded or "
        "converted it (a local directory of yours is only forgotten)",
        parents=[cache_opts],
    )
    p.add_argument("ref", metavar="ID|PATH", help="digest (or its first 8+ characters), path or model id")
    p.add_argument(
        "--with-bundles",
        action="store_true",
        help="also remove this node's idle bundles built from it (refused without it when it has some)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_checkpoints_rm)
