"""``cachesvc adapters``: LoRA adapters converted into the cache: list, add, pin, remove."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from cachesvc.cache.store.space import human_size
from cachesvc.cli.args import open_manager
from cachesvc.cli.output import emit_json, human_time, short_model, table


def cmd_adapters_ls(args: argparse.Namespace) -> int:
    items = open_manager(args).adapters.list()
    if args.json:
        emit_json(items)
        return 0
    rows = [
        [a.id, short_model(a.source), a.rank, ",".join(a.targets), human_size(a.size_bytes),
         "yes" if a.pinned else "", human_time(a.last_used_at)]
        for a in items
    ]
    print(table(["ID", "SOURCE", "RANK", "TARGETS", "SIZE", "PINNED", "LAST USED"], rows, right=(2, 4)))
    return 0


def cmd_adapters_add(args: argparse.Namespace) -> int:
    info = open_manager(args).add_adapter(args.source, args.base)
    if args.json:
        emit_json(info)
        return 0
    print(f"adapter {info.id} (rank {info.rank}, {human_size(info.size_bytes)}): {info.path}")
    return 0


def _adapter_pin_command(pinned: bool) -> Callable[[argparse.Namespace], int]:
    """``adapters pin`` (``pinned``) or ``adapters unpin``."""

    def run(args: argparse.Namespace) -> int:
        m = open_manager(args)
        info = m.adapters.set_pinned(args.id, pinned)
        if args.json:
            emit_json(info)
        else:
            print(f"{'pinned' if pinned else 'unpinned'} adapter {info.id}")
        return 0

    return run


cmd_adapters_pin = _adapter_pin_command(True)


cmd_adapters_unpin = _adapter_pin_command(False)


def cmd_adapters_rm(args: argparse.Namespace) -> int:
    m = open_manager(args)
    info = m.adapters.get(args.id)
    freed = m.adapters.remove(info.id)
    if args.json:
        emit_json({"id": info.id, "freed_bytes": freed})
    else:
        print(f"removed adapter {info.id}, freed {human_size(freed)}")
    return 0


def add_commands(sub: Any, cache_opts: argparse.ArgumentParser) -> None:
    """``adapters ls|add|pin|unpin|rm``."""
    adapters = sub.add_parser("adapters", help="LoRA adapters converted into the cache")
    asub = adapters.add_subparsers(dest="adapters_command", metavar="COMMAND")
    asub.required = True
    p = asub.add_parser("ls", help="list converted LoRA adapters", parents=[cache_opts])
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_adapters_ls)
    p = asub.add_parser(
        "add",
        help="convert a PEFT LoRA adapter (directory or hub id) for a base model, once per adapter",
        parents=[cache_opts],
    )
    p.add_argument("source", metavar="SOURCE", help="PEFT adapter directory or Hugging Face id")
    p.add_argument("--base", required=True, metavar="MODEL",
                   help="the base model it adapts (checkpoint directory or hub id)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_adapters_add)
    for name, fn, text in (
        ("pin", cmd_adapters_pin, "protect an adapter from eviction"),
        ("unpin", cmd_adapters_unpin, "let an adapter be evicted again"),
        ("rm", cmd_adapters_rm, "remove an adapter now (refused while pinned or in use)"),
    ):
        p = asub.add_parser(name, help=text, description=text, parents=[cache_opts])
        p.add_argument("id", metavar="ID", help="adapter id, digest prefix or source")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=fn)
