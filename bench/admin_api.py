"""Admin API benchmark: latency and throughput of the hot read routes on a large catalog.

Fills a fresh catalog with 10,000 bundle rows and 100,000 events (bulk insert through the
catalog's SQLAlchemy models, then the running totals that ``stats()`` reads are rebuilt from
the events exactly as the catalog keeps them), serves the admin router and ``/metrics`` with
uvicorn on a loopback port in a child process, and drives it with a loopback load generator
(``wrk`` when it is on PATH, else an httpx async client), printing a table:

    PYTHONPATH=. .venv/bin/python bench/admin_api.py [--bundles 10000] [--events 100000]
        [--seconds 5] [--concurrency 8] [--client auto|wrk|httpx]
        [--pg-url postgresql+psycopg://...] [--plan-rows 100000] [--quick]

``--quick`` (CI, ``bench/run_quick.sh``): 200 bundles, 2,000 events, 0.5 s per route and
concurrency (2 connections), 2,000 rows to plan over.

With a PostgreSQL server (``--pg-url``, default ``$CACHESVC_TEST_PG_URL``) every measurement
runs on SQLite and on PostgreSQL (a fresh database, dropped afterwards) and the table shows
them side by side. Eviction planning is measured in process: an LRU plan down to half the
cache over ``--plan-rows`` bundle rows (the planner reads keyset pages of the node's rows).

Two runs per route: one connection (latency without queueing) and ``--concurrency``
connections (throughput). Targets (issue 5): list p50 <= 5 ms, stats p50 <= 10 ms, list
>= 1,000 req/s. Not a test: numbers depend on the machine and its neighbours.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.support.net import NotReadyError, free_port, wait_http_ok  # noqa: E402

ADMIN_KEY = "bench-admin-key"
MAX_SIZE_BYTES = 10**15
ROUTES: tuple[tuple[str, str, float | None, float | None], ...] = (
    # name, path, p50 target (ms), req/s target
    ("list", "/admin/bundles?limit=100", 5.0, 1000.0),
    ("stats", "/admin/stats", 10.0, None),
    ("metrics", "/metrics", None, None),
)


# -- catalog fill ------------------------------------------------------------------------------


def populate(url: str, cache_dir: Path, n_bundles: int, n_events: int, seed: int = 5) -> None:
    """Bulk-load ``n_bundles`` bundle rows and ``n_events`` events (plus their running totals)."""
    from sqlalchemy import insert

    from cachesvc.cache.catalog import Catalog
    from cachesvc.cache.catalog.models import BundleRow, CheckpointRow, EventRow
    from cachesvc.cache.profiles import BuildOptions, bundle_id, bundle_relpath

    rng = random.Random(seed)
    catalog = Catalog(url, node="bench")
    try:
        catalog.upgrade()
        now = datetime.now(UTC)
        models = [f"bench-org/model-{i:03d}" for i in range(100)]
        profiles = [
            BuildOptions(max_input_len=2**k, max_kv_cache_capacity=2 ** (k + 1), builder_version="bench")
            for k in range(7, 12)
        ] + [
            BuildOptions(
                precision="int8", cpu_class="avx2", max_input_len=2**k, max_kv_cache_capacity=2 ** (k + 1)
            )
            for k in range(7, 12)
        ]
        # Ten profiles per checkpoint; a model has several checkpoints (revisions).
        checkpoints: dict[str, str] = {}
        bundles: list[dict[str, object]] = []
        for i in range(n_bundles):
            ck = i // len(profiles)
            model = models[ck % len(models)]
            opts = profiles[i % len(profiles)]
            digest = f"{ck + 1:016x}{ck % len(models):048x}"
            checkpoints[digest] = model
            created = now - timedelta(days=30, seconds=rng.randrange(0, 86400 * 30))
            bundles.append(
                {
                    "id": bundle_id(digest, opts),
                    "model": model,
                    "checkpoint_digest": digest,
                    "draft_digest": None,
                    "profile": opts.to_dict(),
                    "profile_name": opts.name,
                    "backend": opts.backend,
                    "path": str(bundle_relpath(digest, opts)),
                    "size_bytes": rng.randrange(10**6, 10**9),
                    "file_count": rng.randrange(2, 12),
                    "state": rng.choices(("ready", "failed", "corrupt"), (95, 4, 1))[0],
                    "created_at": created,
                    "built_at": created + timedelta(seconds=30),
                    "build_seconds": rng.uniform(2, 600),
                    "last_used_at": created + timedelta(seconds=rng.randrange(0, 86400 * 30)),
                    "hit_count": rng.randrange(0, 10_000),
                    "pinned": rng.random() < 0.02,
                    "last_verified_at": None,
                    "error": None,
                    "node": "bench",
                }
            )
        kinds = ("hit", "miss", "build_ok", "build_failed", "evict")
        reasons = ("lru", "manual", "clear", "stale", "corrupt")
        events: list[dict[str, object]] = []
        start = now - timedelta(days=30)
        for j in range(n_events):
            b = bundles[rng.randrange(len(bundles))]
            kind = rng.choices(kinds, (70, 10, 8, 2, 10))[0]
            events.append(
                {
                    "at": start + timedelta(seconds=j * 25),
                    "kind": kind,
                    "bundle_id": b["id"],
                    "checkpoint_digest": b["checkpoint_digest"],
                    "model": b["model"],
                    "reason": rng.choice(reasons) if kind == "evict" else None,
                    "bytes": b["size_bytes"] if kind == "evict" else None,
                    "seconds": rng.uniform(2, 600) if kind in ("build_ok", "build_failed") else None,
                    "detail": None,
                    "node": "bench",
                }
            )
        with catalog.engine.begin() as conn:
            conn.execute(
                insert(CheckpointRow),
                [
                    {
                        "digest": d,
                        "source": m,
                        "path": str(cache_dir / "checkpoints" / d[:16]),
                        "size_bytes": 10**9,
                        "file_count": 8,
                        "resolved_at": now,
                        "node": "bench",
                    }
                    for d, m in checkpoints.items()
                ],
            )
            for i in range(0, len(bundles), 5000):
                conn.execute(insert(BundleRow), bundles[i : i + 5000])
            for i in range(0, len(events), 5000):
                conn.execute(insert(EventRow), events[i : i + 5000])
        # The running totals the catalog maintains per event, rebuilt from the log.
        catalog.events.rebuild_totals()
        if catalog.engine.dialect.name == "postgresql":
            # What autovacuum does after a bulk load, done now: without planner statistics
            # PostgreSQL sorts the node's rows for every keyset page instead of walking the index.
            with catalog.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                conn.exec_driver_sql("ANALYZE")
    finally:
        catalog.close()


# -- server (child process) --------------------------------------------------------------------


def serve(cache_dir: Path, port: int, url: str) -> None:
    """Run the admin router and /metrics on uvicorn (loopback) over the given cache."""
    import uvicorn

    from cachesvc.cache.manager import CacheManager
    from cachesvc.serving.app import create_app
    from cachesvc.settings.config import ServeConfig

    manager = CacheManager.open(
        cache_dir, catalog_url=url, node="bench", max_size_bytes=MAX_SIZE_BYTES, builders={}
    )
    # The service's own app (admin API, /metrics, health), as `cachesvc serve` builds it.
    app = create_app(
        ServeConfig(
            cache_dir=cache_dir,
            catalog_url=url,
            node_name="bench",
            admin_api_key=ADMIN_KEY,
            port=port,
            # The filled events span weeks: no retention, or the heartbeat would prune them.
            event_retention_days=0,
            event_retention_rows=0,
        ),
        manager,
    )
    try:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)
    finally:
        manager.close()


def _wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    try:
        wait_http_ok(
            f"{base}/admin/stats", timeout=timeout, proc=proc, headers={"x-api-key": ADMIN_KEY}, interval=0.2
        )
    except NotReadyError as exc:
        raise SystemExit(str(exc)) from None


# -- load generators ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    """One route under one load."""

    route: str
    connections: int
    requests: int
    non_2xx: int
    seconds: float
    p50_ms: float
    p99_ms: float
    db: str = ""

    @property
    def rps(self) -> float:
        """Requests per second."""
        return self.requests / self.seconds if self.seconds else 0.0


_WRK_SCRIPT = """
wrk.headers["x-api-key"] = "%s"
done = function(summary, latency, requests)
  local non2xx = summary.errors.status + summary.errors.connect + summary.errors.read
    + summary.errors.write + summary.errors.timeout
  io.write(string.format(
    "BENCHJSON {\\"requests\\": %%d, \\"us\\": %%d, \\"p50\\": %%f, \\"p99\\": %%f, \\"bad\\": %%d}\\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99), non2xx))
end
"""


def run_wrk(name: str, url: str, connections: int, seconds: float, script: Path) -> Result:
    """Drive ``url`` with wrk (one thread: the server needs the other core)."""
    out = subprocess.run(
        ["wrk", "-t1", f"-c{connections}", f"-d{max(1, round(seconds))}s", "-s", str(script), url],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("BENCHJSON "))
    data = json.loads(line.removeprefix("BENCHJSON "))
    return Result(
        route=name,
        connections=connections,
        requests=int(data["requests"]),
        non_2xx=int(data["bad"]),
        seconds=data["us"] / 1e6,
        p50_ms=data["p50"] / 1000,
        p99_ms=data["p99"] / 1000,
    )


async def _httpx_load(url: str, connections: int, seconds: float) -> tuple[list[float], int, float]:
    latencies: list[float] = []
    bad = 0
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(headers={"x-api-key": ADMIN_KEY}, limits=limits, timeout=30) as client:
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal bad
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                r = await client.get(url)
                latencies.append(time.perf_counter() - t0)
                bad += not 200 <= r.status_code < 300

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(connections)))
        elapsed = time.perf_counter() - started
    return latencies, bad, elapsed


def run_httpx(name: str, url: str, connections: int, seconds: float) -> Result:
    """Drive ``url`` with an httpx async client (slower than wrk: the client costs CPU too)."""
    latencies, bad, elapsed = asyncio.run(_httpx_load(url, connections, seconds))
    latencies.sort()
    q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else latencies * 99
    return Result(
        route=name,
        connections=connections,
        requests=len(latencies),
        non_2xx=bad,
        seconds=elapsed,
        p50_ms=q[49] * 1000,
        p99_ms=q[98] * 1000,
    )


# -- main --------------------------------------------------------------------------------------


def _verdict(value: float, target: float | None, *, higher_is_better: bool) -> str:
    if target is None:
        return ""
    ok = value >= target if higher_is_better else value <= target
    return "ok" if ok else "MISS"


def plan_eviction(url: str, cache_dir: Path, rows: int, repeats: int = 5) -> tuple[float, int]:
    """Median ms of an LRU plan down to half the cache over ``rows`` bundle rows; bundles planned."""
    from cachesvc.cache.manager import CacheManager

    populate(url, cache_dir, rows, 1)
    manager = CacheManager.open(
        cache_dir, catalog_url=url, node="bench", max_size_bytes=MAX_SIZE_BYTES, builders={}
    )
    try:
        cap = manager.catalog.bundles.total_size() // 2
        times, planned = [], 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            plan = manager.evictor.plan(cap)
            times.append((time.perf_counter() - t0) * 1000)
            planned = len(plan.evict)
        return statistics.median(times), planned
    finally:
        manager.close()


@contextmanager
def catalogs(tmp: Path, pg_url: str | None) -> Iterator[list[tuple[str, Callable[[str], str]]]]:
    """(name, url_for(label)) per database: SQLite files, and fresh PostgreSQL databases."""
    made: list[str] = []

    def sqlite_url(label: str) -> str:
        return f"sqlite:///{tmp / f'{label}.sqlite3'}"

    def pg(label: str) -> str:
        from tests.support.databases import ensure_database

        assert pg_url is not None
        name = f"cachesvc_bench_{os.getpid()}_{label}"
        made.append(name)
        return ensure_database(pg_url, name)

    found: list[tuple[str, Callable[[str], str]]] = [("sqlite", sqlite_url)]
    if pg_url:
        found.append(("postgresql", pg))
    try:
        yield found
    finally:
        if pg_url and made:
            from tests.support.databases import drop_databases

            drop_databases(pg_url, f"cachesvc_bench_{os.getpid()}_")


def main(argv: Sequence[str] | None = None) -> int:
    """Fill a catalog, start the server, load each route, print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bundles", type=int, default=10_000)
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=5.0, help="load time per route and concurrency")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--client", choices=("auto", "wrk", "httpx"), default="auto")
    parser.add_argument(
        "--pg-url",
        default=os.environ.get("CACHESVC_TEST_PG_URL"),
        help="PostgreSQL server to compare with (default: $CACHESVC_TEST_PG_URL; none: SQLite only)",
    )
    parser.add_argument("--plan-rows", type=int, default=100_000, help="bundle rows for eviction planning")
    parser.add_argument("--quick", action="store_true", help="CI: a small catalog, half a second per route")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.bundles, args.events, args.seconds, args.concurrency, args.plan_rows = 200, 2_000, 0.5, 2, 2_000
    if args.serve is not None:
        serve(args.serve, args.port, args.url)
        return 0
    for name in ("bundles", "events", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.seconds <= 0:
        parser.error("--seconds must be positive")
    client = args.client
    if client == "auto":
        client = "wrk" if shutil.which("wrk") else "httpx"
    elif client == "wrk" and not shutil.which("wrk"):
        parser.error("--client wrk: wrk is not on PATH (apt-get install wrk), or use --client httpx")

    results: list[Result] = []
    fills: dict[str, float] = {}
    plans: dict[str, tuple[float, int]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="cachesvc-bench-") as tmp,
        catalogs(Path(tmp), args.pg_url) as dbs,
    ):
        for db, url_for in dbs:
            results += _run_routes(db, url_for("routes"), Path(tmp) / f"cache-{db}", args, client, fills)
            plans[db] = plan_eviction(url_for("plan"), Path(tmp) / f"plan-{db}", args.plan_rows)
    _print(results, fills, plans, args, client)
    return 0 if all(r.non_2xx == 0 for r in results) else 1


def _run_routes(
    db: str, url: str, cache_dir: Path, args: argparse.Namespace, client: str, fills: dict[str, float]
) -> list[Result]:
    cache_dir.mkdir()
    tmp = cache_dir.parent
    t0 = time.perf_counter()
    populate(url, cache_dir, args.bundles, args.events)
    fills[db] = time.perf_counter() - t0
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", str(cache_dir), "--port", str(port), "--url", url], env=env
    )
    results: list[Result] = []
    try:
        _wait_ready(base, proc)
        script = Path(tmp) / "bench.lua"
        script.write_text(_WRK_SCRIPT % ADMIN_KEY)
        for name, path, _, _ in ROUTES:
            route_url = base + path
            # Warm caches (SQLite pages, msgspec encoders) before measuring.
            for _ in range(20):
                httpx.get(route_url, headers={"x-api-key": ADMIN_KEY}, timeout=30).raise_for_status()
            for connections in (1, args.concurrency):
                if client == "wrk":
                    result = run_wrk(name, route_url, connections, args.seconds, script)
                else:
                    result = run_httpx(name, route_url, connections, args.seconds)
                results.append(replace(result, db=db))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return results


def _print(
    results: list[Result],
    fills: dict[str, float],
    plans: dict[str, tuple[float, int]],
    args: argparse.Namespace,
    client: str,
) -> None:
    filled = ", ".join(f"{db} {s:.1f} s" for db, s in fills.items())
    print(
        f"\nadmin API on uvicorn (1 worker, loopback), client {client}; catalog {args.bundles:,} bundles, "
        f"{args.events:,} events (filled in {filled}); {os.cpu_count()} CPUs\n"
    )
    header = (
        f"{'db':<10} {'route':<34} {'conns':>5} {'requests':>9} {'req/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'non-2xx':>7}  targets"
    )
    print(header)
    print("-" * len(header))
    targets = {name: (p50, rps) for name, _, p50, rps in ROUTES}
    paths = {name: path for name, path, _, _ in ROUTES}
    for r in results:
        p50_target, rps_target = targets[r.route]
        notes = []
        if p50_target is not None:
            notes.append(f"p50<={p50_target:g} ms {_verdict(r.p50_ms, p50_target, higher_is_better=False)}")
        if rps_target is not None and r.connections > 1:
            notes.append(f">={rps_target:,.0f} req/s {_verdict(r.rps, rps_target, higher_is_better=True)}")
        print(
            f"{r.db:<10} GET {paths[r.route]:<30} {r.connections:>5} {r.requests:>9,} {r.rps:>9,.0f} "
            f"{r.p50_ms:>8.2f} {r.p99_ms:>8.2f} {r.non_2xx:>7}  {'; '.join(notes)}"
        )
    print(
        f"\neviction planning over {args.plan_rows:,} bundle rows "
        "(LRU plan down to half the cache, median of 5)"
    )
    for db, (ms, planned) in plans.items():
        print(f"{db:<10} {ms:>9.1f} ms  ({planned:,} bundles planned)")


if __name__ == "__main__":
    raise SystemExit(main())
