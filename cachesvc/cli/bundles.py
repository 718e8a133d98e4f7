"""``cachesvc bundles``: list, show, remove, pin, verify, push and pull bundles."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

from cachesvc.cache.records import BUNDLE_STATES, SORT_KEYS, SORT_ORDERS
from cachesvc.cache.store.space import human_size
from cachesvc.cli.args import open_manager
from cachesvc.cli.output import bundle_json, emit_json, human_time, short_model, table, to_jsonable
from cachesvc.errors import ConfigError
from cachesvc.settings.config import ServeConfig, add_build_arguments
from inference.build_profile import BACKENDS


def cmd_bundles_ls(args: argparse.Namespace) -> int:
    m = open_manager(args)
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
            short_model(b.model),
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


def cmd_bundles_show(args: argparse.Namespace) -> int:
    m = open_manager(args)
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
    verdict = "chosen" if c.get("passed") else "rejected"
    if c.get("slower_than_exact"):
        verdict = "rejected (answers like fp32 but no faster than the exact plan)"
    beside = ""
    if c.get("exact_decode_tok_s") is not None:
        how = "side by side" if c.get("side_by_side") else "timed apart"
        beside = f" (exact plan {how}: {c['exact_decode_tok_s']} / {c.get('exact_decode_tok_s_rows')})"
    return (f"{verdict}: agreement {c.get('greedy_agreement')}, "
            f"{c.get('identical')} of {q.get('prompts')} prompts identical for {q.get('identity_tokens')} "
            f"tokens, {c.get('decode_tok_s')} tok/s at 1 row, {c.get('decode_tok_s_rows')} at "
            f"{q.get('prompts')}{beside}, {c.get('seconds')} s")


def cmd_bundles_rm(args: argparse.Namespace) -> int:
    freed = open_manager(args).evictor.remove(args.id)
    print(f"removed {args.id}, freed {human_size(freed)}")
    return 0


def _pin_command(pinned: bool) -> Callable[[argparse.Namespace], int]:
    """``bundles pin`` (``pinned``) or ``bundles unpin``."""

    def run(args: argparse.Namespace) -> int:
        info = open_manager(args).set_pinned(args.id, pinned)
        print(f"{'pinned' if pinned else 'unpinned'} {info.id}")
        return 0

    return run


cmd_bundles_pin = _pin_command(True)


cmd_bundles_unpin = _pin_command(False)


def cmd_bundles_verify(args: argparse.Namespace) -> int:
    m = open_manager(args)
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


def cmd_bundles_push(args: argparse.Namespace) -> int:
    m = open_manager(args)
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
    from cachesvc.serving.entry import open_cache

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


def add_commands(sub: Any, cache_opts: argparse.ArgumentParser) -> Any:
    """``bundles`` and its commands; returns its subparsers (the cache-wide commands join them)."""
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
    return bsub
