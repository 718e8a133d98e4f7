"""The ``cachesvc`` command line: serve, prepare, bundles, registry, checkpoints, adapters, db,
demo-checkpoint.

Cache options (``--cache-dir``, ``--catalog-url``, ``--engine-cache-max-size-gb``) go before
the command and apply to every command; ``prepare`` and ``serve`` also accept them after.
Bad input exits 2 with one line on stderr; an operation that fails exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from cachesvc import __version__
from cachesvc.build_progress import BuildProgress
from cachesvc.config import (
    CACHE_OPTIONS,
    DECLARED,
    ServeConfig,
    add_build_arguments,
    add_cache_flags,
    add_serve_arguments,
    cli_message,
    engine_factory_spec,
)
from cachesvc.errors import CacheError, CheckpointError, ConfigError, NotFoundError
from cachesvc.gguf_checkpoints import hub_gguf_spec
from cachesvc.records import BUNDLE_STATES, SORT_KEYS, SORT_ORDERS, BundleInfo, EvictionResult
from cachesvc.store.space import human_size
from inference.build_profile import BACKENDS
from inference.demo import ARCHS as DEMO_ARCHS
from inference.demo import SIZES as DEMO_SIZES

if TYPE_CHECKING:
    from cachesvc.manager import CacheManager


_BAD_INPUT = (ConfigError, NotFoundError, CheckpointError)


class CliError(Exception):
    """A one-line error for the user; ``code`` is the exit status."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


# -- formatting ------------------------------------------------------------------------------


def human_time(value: datetime | None) -> str:
    """A UTC timestamp to the second, or '-'."""
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """Aligned plain-text table; columns listed in ``right`` are right-aligned."""
    cells = [[str(c) for c in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def to_jsonable(value: Any) -> Any:
    """Dataclasses, paths and datetimes to JSON-ready values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def emit_json(value: Any) -> None:
    print(json.dumps(to_jsonable(value), indent=2, sort_keys=True))


def bundle_json(info: BundleInfo, root: Path) -> dict[str, Any]:
    data = to_jsonable(info)
    data["path"] = str(root / info.path)
    return data


# -- commands --------------------------------------------------------------------------------


def _cache_config(args: argparse.Namespace) -> ServeConfig:
    """The cache options given on the command line, validated and defaulted like ``serve``'s."""
    given = {name: getattr(args, name, None) for name in CACHE_OPTIONS}
    return ServeConfig.from_mapping({k: v for k, v in given.items() if v is not None})


def _manager(args: argparse.Namespace) -> CacheManager:
    from cachesvc.entry import open_cache

    return open_cache(_cache_config(args))


def cmd_prepare(args: argparse.Namespace) -> int:
    from cachesvc.default_model import choose

    config = _serve_config(args)
    m = _manager(args)
    try:
        with BuildProgress() as progress:
            result = m.prepare(
                config.build.model or choose(config.cache.cache_dir)[0],
                config.profile_request(),
                progress=progress,
            )
    finally:
        m.close()
    if args.json:
        emit_json(
            {
                "bundle_id": result.bundle_id,
                "bundle_dir": str(result.bundle_dir),
                "model_dir": str(result.model_dir),
                "draft_dir": str(result.draft_dir) if result.draft_dir else None,
                "draft_bundle_id": result.draft_bundle_id,
                "draft_bundle_dir": str(result.draft_bundle_dir) if result.draft_bundle_dir else None,
                "built": result.built,
                "build_seconds": result.build_seconds,
                "pulled_from": result.pulled_from,
            }
        )
    else:
        verb = f"built in {result.build_seconds:.1f}s" if result.built else "cache hit"
        if result.pulled_from is not None:
            verb = f"pulled from {result.pulled_from}"
        print(f"{result.bundle_id}  {verb}\n{result.bundle_dir}")
    return 0


def cmd_bundles_ls(args: argparse.Namespace) -> int:
    m = _manager(args)
    page = m.queries.list_bundles(
        model=args.model,
        state=args.state,
        backend=args.backend,
        sort=args.sort,
        order=args.order,
        limit=args.limit,
    )
    if args.json:
        emit_json([bundle_json(b, m.layout.root) for b in page.items])
        return 0
    rows = [
        [
            b.id,
            _short_model(b.model),
            b.profile_name.rsplit("-", 1)[0],
            b.state,
            human_size(b.size_bytes),
            b.hit_count,
            human_time(b.last_used_at),
            "yes" if b.pinned else "",
        ]
        for b in page.items
    ]
    print(
        table(
            ["ID", "MODEL", "PROFILE", "STATE", "SIZE", "HITS", "LAST USED (UTC)", "PINNED"],
            rows,
            right=(4, 5),
        )
    )
    shown = f"{len(page.items)} of {page.total}" if page.total > len(page.items) else str(page.total)
    print(f"\n{shown} bundles, {human_size(page.total_bytes)} (cap {human_size(m.max_size_bytes)})")
    return 0


def _short_model(model: str) -> str:
    return model if len(model) <= 40 else "…" + model[-39:]


def cmd_bundles_show(args: argparse.Namespace) -> int:
    m = _manager(args)
    d = m.queries.bundle_detail(args.id)
    if args.json:
        data = to_jsonable(d)
        data["bundle"]["path"] = str(m.layout.root / d.bundle.path)
        emit_json(data)
        return 0
    b = d.bundle
    fields = [
        ("id", b.id),
        ("model", b.model),
        ("checkpoint", b.checkpoint_digest),
        ("profile", b.profile_name),
        ("backend", b.backend),
        ("state", b.state + (f" ({b.error})" if b.error else "")),
        ("path", m.layout.root / b.path),
        ("size", f"{human_size(b.size_bytes)} in {b.file_count} files"),
        ("created", human_time(b.created_at)),
        ("built", f"{human_time(b.built_at)}" + (f" in {b.build_seconds:.1f}s" if b.build_seconds else "")),
        ("last used", human_time(b.last_used_at)),
        ("hits", b.hit_count),
        ("pinned", "yes" if b.pinned else "no"),
        ("verified", human_time(b.last_verified_at)),
        ("leased by", ", ".join(f"pid {h.pid} on {h.host} since {h.since}" for h in d.holders) or "-"),
    ]
    engine = (d.manifest or {}).get("engine", {})
    kv = engine.get("kv_cache")
    if isinstance(kv, dict) and "dtype" in kv:
        fields.append(("kv cache", f"{kv['dtype']}, {human_size(int(kv.get('bytes_per_token', 0)))} a token"))
    vision = engine.get("vision")
    if isinstance(vision, dict) and "max_image_tokens" in vision:
        fields.append(("images", f"{vision.get('tokens_per_image')} tokens an image; at most "
                       f"{vision['max_image_tokens']} image tokens a request, "
                       f"{vision.get('max_image_tokens_per_image')} an image"))
    quality = engine.get("quality")
    if isinstance(quality, dict):
        fields.append(("quality", _quality_line(quality)))
        for c in quality.get("candidates") or []:
            layout = " (8-bit codes)" if c.get("int8_layout") == "codes" else ""
            fields.append((f"  plan {c.get('plan')}{layout}", _candidate_line(c, quality)))
    print(table(["FIELD", "VALUE"], fields))
    if d.files:
        print()
        print(
            table(
                ["FILE", "SIZE", "SHA-256"],
                [[f["path"], human_size(f["size"]), f["sha256"][:16]] for f in d.files],
            )
        )
    if d.events:
        print()
        rows = [
            [human_time(e.at), e.kind, e.reason or "", human_size(e.bytes) if e.bytes else ""]
            for e in d.events
        ]
        print(table(["AT (UTC)", "EVENT", "REASON", "BYTES"], rows))
    return 0


def _quality_line(q: dict[str, Any]) -> str:
    """The quality gate's figures of a quantized bundle, in one line."""
    plan = f"kernel plan {q['plan']} (--kernels {q.get('kernels_mode')}), " if "plan" in q else ""
    if q.get("kv_cache_dtype", "float32") != "float32":
        plan += f"{q['kv_cache_dtype']} KV, "
    kept = "kept" if q.get("reference_cached") else "computed"
    seconds = f", gate {q.get('seconds')} s, fp32 reference {kept}" if "plan" in q else ""
    return (f"{plan}greedy agreement {q.get('greedy_agreement')} with {q.get('reference')}, min logit cosine "
            f"{q.get('min_logit_cosine')} ({q.get('prompts')} prompts, {q.get('tokens')} tokens, "
            f"CPU class {q.get('cpu_class')}{seconds})")


def _candidate_line(c: dict[str, Any], q: dict[str, Any]) -> str:
    """One kernel plan the gate measured."""
    return (f"{'chosen' if c.get('passed') else 'rejected'}: agreement {c.get('greedy_agreement')}, "
            f"{c.get('identical')} of {q.get('prompts')} prompts identical for {q.get('identity_tokens')} "
            f"tokens, {c.get('decode_tok_s')} tok/s at 1 row, {c.get('decode_tok_s_rows')} at "
            f"{q.get('prompts')}, {c.get('seconds')} s")


def cmd_bundles_rm(args: argparse.Namespace) -> int:
    freed = _manager(args).evictor.remove(args.id)
    print(f"removed {args.id}, freed {human_size(freed)}")
    return 0


def _pin_command(pinned: bool) -> Callable[[argparse.Namespace], int]:
    """``bundles pin`` (``pinned``) or ``bundles unpin``."""

    def run(args: argparse.Namespace) -> int:
        info = _manager(args).set_pinned(args.id, pinned)
        print(f"{'pinned' if pinned else 'unpinned'} {info.id}")
        return 0

    return run


cmd_bundles_pin = _pin_command(True)
cmd_bundles_unpin = _pin_command(False)


def cmd_bundles_verify(args: argparse.Namespace) -> int:
    m = _manager(args)
    result = m.verifier.verify(args.id)
    if args.json:
        emit_json(result)
    elif result.ok and result.state == "stale":
        print(
            f"{result.bundle_id}: files ok, but STALE (built for another GPU or TensorRT version; "
            "never loaded here, evicted first): "
            f"{m.catalog.bundles.require(result.bundle_id).error}"
        )
    elif result.ok:
        print(f"{result.bundle_id}: ok ({result.files_checked} files, {human_size(result.bytes_checked)})")
    else:
        print(f"{result.bundle_id}: CORRUPT, marked and never served again; `cachesvc prepare` rebuilds it")
        print(table(["FILE", "PROBLEM"], [[x["path"], x["reason"]] for x in result.mismatches]))
    return 0 if result.ok else 1


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
    m = _manager(args)
    _print_eviction(m.evictor.prune(args.max_size_bytes, dry_run=args.dry_run), args.json, m.layout.root)
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    m = _manager(args)
    _print_eviction(m.evictor.clear(dry_run=args.dry_run), args.json, m.layout.root)
    return 0


def cmd_reconcile(args: argparse.Namespace) -> int:
    report = _manager(args).reconciler.reconcile()
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
    s = _manager(args).queries.stats()
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
                    [_short_model(p.model), p.bundles, human_size(p.size_bytes), p.hits, p.misses]
                    for p in s.per_model
                ],
                right=(1, 2, 3, 4),
            )
        )
    return 0


def cmd_models_ls(args: argparse.Namespace) -> int:
    items = _manager(args).catalog.aliases.all()
    if args.json:
        emit_json(items)
        return 0
    rows = [[a.name, a.bundle_id or "-", a.model or "-", a.created_at.isoformat()] for a in items]
    print(table(["NAME", "BUNDLE", "MODEL", "CREATED"], rows))
    return 0


def cmd_models_alias(args: argparse.Namespace) -> int:
    manager = _manager(args)
    target: str = args.target
    try:
        manager.catalog.bundles.require(target)
        alias = manager.set_alias(args.name, bundle_id=target)
    except NotFoundError:
        alias = manager.set_alias(args.name, model=target)
    print(f"{alias.name} -> {alias.bundle_id or alias.model}")
    return 0


def cmd_models_unalias(args: argparse.Namespace) -> int:
    _manager(args).remove_alias(args.name)
    print(f"removed {args.name}")
    return 0


def cmd_checkpoints_ls(args: argparse.Namespace) -> int:
    items = _manager(args).catalog.checkpoints.all()
    if args.json:
        emit_json(items)
        return 0
    rows = [
        [
            c.digest[:16],
            _short_model(c.source),
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
    done = _manager(args).remove_checkpoint(args.ref, with_bundles=args.with_bundles)
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


def cmd_adapters_ls(args: argparse.Namespace) -> int:
    items = _manager(args).adapters.list()
    if args.json:
        emit_json(items)
        return 0
    rows = [
        [a.id, _short_model(a.source), a.rank, ",".join(a.targets), human_size(a.size_bytes),
         "yes" if a.pinned else "", human_time(a.last_used_at)]
        for a in items
    ]
    print(table(["ID", "SOURCE", "RANK", "TARGETS", "SIZE", "PINNED", "LAST USED"], rows, right=(2, 4)))
    return 0


def cmd_adapters_add(args: argparse.Namespace) -> int:
    info = _manager(args).add_adapter(args.source, args.base)
    if args.json:
        emit_json(info)
        return 0
    print(f"adapter {info.id} (rank {info.rank}, {human_size(info.size_bytes)}): {info.path}")
    return 0


def _adapter_pin_command(pinned: bool) -> Callable[[argparse.Namespace], int]:
    """``adapters pin`` (``pinned``) or ``adapters unpin``."""

    def run(args: argparse.Namespace) -> int:
        m = _manager(args)
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
    m = _manager(args)
    info = m.adapters.get(args.id)
    freed = m.adapters.remove(info.id)
    if args.json:
        emit_json({"id": info.id, "freed_bytes": freed})
    else:
        print(f"removed adapter {info.id}, freed {human_size(freed)}")
    return 0


def cmd_db_repair(args: argparse.Namespace) -> int:
    """Move an unreadable catalog aside, open a fresh one and re-adopt the bundles on disk."""
    from cachesvc.catalog import Catalog
    from cachesvc.catalog.session import move_sqlite_aside
    from cachesvc.errors import CatalogError

    config = _cache_config(args)
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
    manager = _manager(args)
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
    from cachesvc.catalog import Catalog
    from cachesvc.catalog.migrate import head_revision

    catalog = Catalog(_cache_config(args).cache.catalog_url_resolved, node="cli")
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


def cmd_fleet_status(args: argparse.Namespace) -> int:
    from cachesvc.catalog import Catalog
    from cachesvc.catalog.fleet import FleetCatalog
    from cachesvc.fleet.status import exit_code, status_lines

    catalog = Catalog(_cache_config(args).cache.catalog_url_resolved, node="cli")
    try:
        nodes = FleetCatalog(catalog).nodes()
    finally:
        catalog.close()
    if args.json:
        emit_json({"items": nodes})
    else:
        print("\n".join(status_lines(nodes)))
    return exit_code(nodes)


def cmd_bundles_push(args: argparse.Namespace) -> int:
    m = _manager(args)
    try:
        result = m.registry.push(args.id)
    finally:
        m.close()
    if args.json:
        emit_json(dataclasses.asdict(result))
    else:
        print(f"{result.bundle_id}  pushed to {result.ref} as {', '.join(result.tags)}: "
              f"{result.blobs_uploaded} blobs uploaded ({human_size(result.bytes_uploaded)}), "
              f"{result.blobs_skipped} already there")
    return 0


def cmd_bundles_pull(args: argparse.Namespace) -> int:
    from cachesvc.entry import open_cache

    config = ServeConfig.from_namespace(args)
    model = config.build.model
    if model is None and args.ref is None:
        raise ConfigError("--model", "give a model (--model M) or a reference with a tag (oci://host/ns:TAG)")
    m = open_cache(config)
    try:
        result = m.pull(model, config.profile_request() if model else None, ref=args.ref)
    finally:
        m.close()
    if args.json:
        emit_json({"bundle_id": result.bundle_id, "ref": result.ref, "bundle_dir": str(result.bundle_dir),
                   "size_bytes": result.size_bytes, "seconds": result.seconds, "already": result.already})
    elif result.already:
        print(f"{result.bundle_id}  already in the cache\n{result.bundle_dir}")
    else:
        print(f"{result.bundle_id}  pulled from {result.ref} in {result.seconds:.1f}s "
              f"({human_size(result.size_bytes)})\n{result.bundle_dir}")
    return 0


def cmd_registry_ls(args: argparse.Namespace) -> int:
    m = _manager(args)
    try:
        entries = m.registry.list_remote(model=args.model)
    finally:
        m.close()
    if args.json:
        emit_json({"items": [dataclasses.asdict(e) for e in entries]})
        return 0
    rows = [(e.bundle_id, _short_model(e.model), e.profile, e.machine_class, human_size(e.size_bytes),
             "yes" if e.fits_this_node else "no") for e in entries]
    print(table(("BUNDLE", "MODEL", "PROFILE", "CLASS", "SIZE", "FITS HERE"), rows, right=(4,)))
    return 0


def cmd_demo_checkpoint(args: argparse.Namespace) -> int:
    from inference.demo import write_demo_checkpoint

    out = write_demo_checkpoint(
        Path(args.dir), arch=args.arch, size=args.size, dtype=args.dtype, seed=args.seed
    )
    print(f"wrote a {args.size} {args.arch} {args.dtype} demo checkpoint with RANDOM weights to {out}")
    return 0


def _serve_config(args: argparse.Namespace) -> ServeConfig:
    config = ServeConfig.from_namespace(args)
    gguf_file = getattr(args, "gguf_file", None)
    if gguf_file is not None:
        if config.build.model is None:
            raise CheckpointError("--gguf-file names a file in a hub repo; give the repo id as the model")
        build = dataclasses.replace(config.build, model=hub_gguf_spec(config.build.model, gguf_file))
        config = dataclasses.replace(config, build=build)
    return config


def cmd_serve(args: argparse.Namespace) -> int:
    config = _serve_config(args)
    from cachesvc.default_model import choose
    from cachesvc.model_loading import engine_factory_from_spec
    from cachesvc.server import serve

    # Without a model the whole catalog is served, with the default model when this is a first
    # run or the catalog holds it (cachesvc.default_model). The environment's factory
    # (CACHESVC_ENGINE_FACTORY, read by the config) is the test-only way into the engine seam.
    return serve(
        config,
        engine_factory=engine_factory_from_spec(engine_factory_spec()),
        default_model=lambda: choose(config.cache.cache_dir),
    )


# -- parser ----------------------------------------------------------------------------------


def _add_cache_commands(sub: Any, parents: list[argparse.ArgumentParser]) -> None:
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


def _cache_options(prefix: str = "") -> _OneLineParser:
    """The cache options; the top level stores them under ``top_*`` so that a subcommand's own
    defaults (argparse lets a subparser's defaults overwrite the parent's values) cannot hide them."""
    p = _OneLineParser(add_help=False)
    add_cache_flags(p.add_argument_group("cache"), prefix)
    return p


class _OneLineParser(argparse.ArgumentParser):
    """Bad input is one line on stderr (no usage dump), exit 2; ``--help`` shows the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    """The full ``cachesvc`` argument parser."""
    cache_opts = _cache_options()
    parser = _OneLineParser(
        prog="cachesvc",
        description="Engine-bundle cache for Hugging Face LLM checkpoints, with OpenAI-style serving.",
        parents=[_cache_options("top_")],
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"cachesvc {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "serve", help="prepare a bundle and serve OpenAI-style completions", allow_abbrev=False
    )
    add_serve_arguments(p)
    p.add_argument("--gguf-file", default=None, metavar="NAME",
                   help="serve this .gguf file of the hub repo given as the model")
    p.set_defaults(func=cmd_serve, engine_cache_max_size_gb=None)

    p = sub.add_parser(
        "prepare", help="build (or find) the bundle for a model and profile", allow_abbrev=False
    )
    # Checked with the rest of the config (from_namespace): its error is the config's.
    p.add_argument("model", nargs="?", default=None, help=DECLARED["model"].spec.help)
    add_build_arguments(p)
    p.add_argument("--gguf-file", default=None, metavar="NAME",
                   help="serve this .gguf file of the hub repo given as the model")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_prepare, engine_cache_max_size_gb=None)

    bundles = sub.add_parser("bundles", help="list and manage bundles")
    bsub = bundles.add_subparsers(dest="bundles_command", metavar="COMMAND")
    bsub.required = True
    p = bsub.add_parser("ls", help="list bundles", parents=[cache_opts])
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--sort", choices=SORT_KEYS, default="last_used")
    p.add_argument("--order", choices=SORT_ORDERS, default="desc")
    p.add_argument("--model", default=None, help="model id/dir as given, or a checkpoint digest prefix")
    p.add_argument("--state", choices=BUNDLE_STATES, default=None)
    p.add_argument("--backend", choices=BACKENDS, default=None)
    p.add_argument("--limit", type=int, default=1000, help="at most this many rows (default 1000)")
    p.set_defaults(func=cmd_bundles_ls)
    for name, fn, text in (
        ("show", cmd_bundles_show, "one bundle: manifest, files, leases, events"),
        ("rm", cmd_bundles_rm, "evict one bundle now (refused while leased or pinned)"),
        ("pin", cmd_bundles_pin, "protect a bundle from eviction"),
        ("unpin", cmd_bundles_unpin, "allow a bundle to be evicted again"),
        ("verify", cmd_bundles_verify, "re-hash a bundle against its manifest"),
    ):
        p = bsub.add_parser(name, help=text, description=text, parents=[cache_opts])
        p.add_argument("id", help="bundle id (see `cachesvc bundles ls`)")
        if name in ("show", "verify"):
            p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=fn)
    p = bsub.add_parser("push", help="push a bundle to the OCI registry (--registry)", parents=[cache_opts])
    p.add_argument("id", help="bundle id (see `cachesvc bundles ls`)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_bundles_push)
    p = bsub.add_parser(
        "pull", help="pull a bundle from the OCI registry: by model and profile, or by reference",
        allow_abbrev=False,
    )
    p.add_argument("ref", nargs="?", default=None, metavar="REF",
                   help="oci://host[:port]/namespace:TAG (default: --registry, looked up by --model's key)")
    p.add_argument("--model", dest="model", default=None, help="the model whose bundle to pull")
    add_build_arguments(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_bundles_pull, engine_cache_max_size_gb=None)
    _add_cache_commands(bsub, [cache_opts])
    _add_cache_commands(sub, [cache_opts])

    registry = sub.add_parser("registry", help="the fleet's OCI registry of bundles")
    rsub = registry.add_subparsers(dest="registry_command", metavar="COMMAND")
    rsub.required = True
    p = rsub.add_parser("ls", help="bundles the registry holds, and whether each fits this node",
                        parents=[cache_opts])
    p.add_argument("--model", default=None, help="only models whose name contains this")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_registry_ls)

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

    p = sub.add_parser("demo-checkpoint", help="write a random-weight demo checkpoint", allow_abbrev=False)
    p.add_argument("dir", help="output directory")
    p.add_argument("--arch", choices=DEMO_ARCHS, default="qwen2")
    p.add_argument("--size", choices=DEMO_SIZES, default="tiny")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo_checkpoint)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cachesvc`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in CACHE_OPTIONS:
        # A value given after the command wins over one given before it.
        if getattr(args, name, None) is None:
            setattr(args, name, getattr(args, "top_" + name, None))
    if args.engine_cache_max_size_gb is None:
        del args.engine_cache_max_size_gb  # ServeConfig's default applies
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("alembic").setLevel(logging.WARNING)
    try:
        return int(args.func(args))
    except _BAD_INPUT as exc:
        text = cli_message(exc) if isinstance(exc, ConfigError) else str(exc)
        print(f"cachesvc: error: {text}", file=sys.stderr)
        return 2
    except CacheError as exc:
        print(f"cachesvc: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`cachesvc stats --json | head`): that is not an error of ours.
        # Point stdout at /dev/null so the interpreter's final flush does not fail again
        # (https://docs.python.org/3/library/signal.html#note-on-sigpipe).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a command killed by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
