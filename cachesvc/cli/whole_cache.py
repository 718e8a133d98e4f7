"""The commands on the whole cache: ``prune``, ``clear``, ``reconcile``, ``stats`` (at the top
and under ``bundles``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cachesvc.cache.records import EvictionResult
from cachesvc.cache.store.space import human_size
from cachesvc.cli.args import open_manager
from cachesvc.cli.output import emit_json, human_time, short_model, table, to_jsonable
from cachesvc.errors import ConfigError


def _print_eviction(result: EvictionResult, as_json: bool, root: Path) -> None:
    if as_json:
        emit_json(
            {
                "dry_run": result.dry_run,
                "evict": [
                    {
                        "id": e.bundle_id,
                        "size_bytes": e.size_bytes,
                        "path": str(root / e.path),
                        "reason": e.reason,
                    }
                    for e in result.plan.evict
                    if e.bundle_id in result.evicted
                ],
                "skipped": [
                    {"id": s.bundle_id, "size_bytes": s.size_bytes, "reason": s.reason, "stale": s.stale}
                    for s in result.skipped
                ],
                "freed_bytes": result.freed_bytes,
                "total_before": result.plan.total_before,
                "total_after": result.total_after,
                "max_size_bytes": result.plan.max_bytes,
            }
        )
        return
    verb = "would evict" if result.dry_run else "evicted"
    rows = [
        [e.bundle_id, human_size(e.size_bytes), f"{verb} ({e.reason})"]
        for e in result.plan.evict
        if e.bundle_id in result.evicted
    ]
    rows += [
        [s.bundle_id, human_size(s.size_bytes), f"kept ({s.reason}{', stale' if s.stale else ''})"]
        for s in result.skipped
    ]
    if rows:
        print(table(["ID", "SIZE", "ACTION"], rows, right=(1,)))
        print()
    print(
        f"{verb} {len(result.evicted)} bundles, {human_size(result.freed_bytes)}; "
        f"cache {human_size(result.plan.total_before)} -> {human_size(result.total_after)}"
    )


def cmd_prune(args: argparse.Namespace) -> int:
    if args.max_size_bytes is not None and args.max_size_bytes < 0:
        raise ConfigError("--max-size-bytes", f"must not be negative, got {args.max_size_bytes}")
    m = open_manager(args)
    _print_eviction(m.evictor.prune(args.max_size_bytes, dry_run=args.dry_run), args.json, m.layout.root)
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    m = open_manager(args)
    _print_eviction(m.evictor.clear(dry_run=args.dry_run), args.json, m.layout.root)
    return 0


def cmd_reconcile(args: argparse.Namespace) -> int:
    report = open_manager(args).reconciler.reconcile()
    if args.json:
        emit_json(report)
    else:
        print(
            f"adopted {len(report.adopted)}, forgotten {len(report.forgotten)}, "
            f"staging removed {len(report.staging_removed)}, unverifiable removed {len(report.corrupt)}, "
            f"stale {len(report.stale)}, ready again {len(report.restored)}"
        )
    return 0


def cmd_stats(args: argparse.Namespace) -> int:
    s = open_manager(args).queries.stats()
    if args.json:
        data = to_jsonable(s)
        data.pop("build_seconds", None)
        emit_json(data)
        return 0
    rate = f"{s.hit_rate:.1%}" if s.hit_rate is not None else "-"
    median = f"{s.median_build_seconds:.1f}s" if s.median_build_seconds is not None else "-"
    rows = [
        ("size", f"{human_size(s.size_bytes)} of {human_size(s.max_size_bytes)}"),
        ("bundles", f"{s.bundles} " + " ".join(f"{k}={v}" for k, v in sorted(s.bundles_by_state.items()))),
        ("checkpoints", f"{s.checkpoints} ({human_size(s.checkpoint_bytes)} under checkpoints/)"),
        ("hits / misses", f"{s.hits} / {s.misses} (hit rate {rate})"),
        ("builds ok / failed", f"{s.builds_ok} / {s.builds_failed} (median {median})"),
        ("registry pulls / pushes", f"{s.pulls} ({human_size(s.pulled_bytes)}) / {s.pushes} "
                                    f"({human_size(s.pushed_bytes)})"),
        (
            "evictions",
            ", ".join(
                f"{r}={s.evictions_by_reason[r]} ({human_size(s.evicted_bytes_by_reason.get(r, 0))})"
                for r in sorted(s.evictions_by_reason)
            )
            or "-",
        ),
        ("since", human_time(s.since)),
    ]
    print(table(["STAT", "VALUE"], rows))
    if s.per_model:
        print()
        print(
            table(
                ["MODEL", "BUNDLES", "SIZE", "HITS", "MISSES"],
                [
                    [short_model(p.model), p.bundles, human_size(p.size_bytes), p.hits, p.misses]
                    for p in s.per_model
                ],
                right=(1, 2, 3, 4),
            )
        )
    return 0


def add_commands(sub: Any, cache_opts: argparse.ArgumentParser) -> None:
    """``prune``, ``clear``, ``reconcile`` and ``stats`` under ``sub``."""
    parents = [cache_opts]

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_text: str) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(
            name, help=help_text, description=help_text, parents=parents
        )
        p.set_defaults(func=fn)
        return p

    p = add("prune", cmd_prune, "evict least-recently-used idle bundles down to a size")
    p.add_argument(
        "--max-size-bytes", type=int, default=None, metavar="N", help="target size (default: the cap)"
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add("clear", cmd_clear, "remove every idle bundle (pinned and leased ones stay; checkpoints stay)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add("reconcile", cmd_reconcile, "re-sync the catalog with the disk")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = add("stats", cmd_stats, "cache statistics")
    p.add_argument("--json", action="store_true", help="machine-readable output")
