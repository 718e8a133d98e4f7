"""Cache-hit ``prepare`` latency vs. cache population, and eviction planning over 100k rows.

Prints a table; not a test. Targets: hit latency flat in the number of bundles (within 2x from
10 to 1,000), eviction planning <= 50 ms for 100,000 catalog rows.

    .venv/bin/python bench/cache_hit.py [--repeat 200] [--quick]

``--quick`` (CI, ``bench/run_quick.sh``): 5 and 25 bundles, 20 hits, 5,000 rows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

from sqlalchemy import insert

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cachesvc.cache.catalog import utcnow
from cachesvc.cache.catalog.models import BundleRow
from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from tests.support.cache import FileBuilder, make_checkpoint


def hit_latency(root: Path, bundles: int, repeat: int) -> tuple[float, float, float]:
    """Fill a cache with ``bundles`` bundles of 20 files, then time repeated hits (ms)."""
    m = CacheManager.open(
        root / "cache", max_size_bytes=10**12, builders={"onnxruntime": FileBuilder(files=20, file_size=256)}
    )
    ckpt = make_checkpoint(root / "ckpt")
    t0 = time.perf_counter()
    for i in range(bundles):
        m.prepare(str(ckpt), ProfileRequest(max_input_len=1 + i, max_kv_cache_capacity=100_000))
    fill = time.perf_counter() - t0
    request = ProfileRequest(max_input_len=1 + bundles // 2, max_kv_cache_capacity=100_000)
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        result = m.prepare(str(ckpt), request)
        samples.append((time.perf_counter() - t) * 1000)
        assert not result.built
    m.close()
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99) - 1], fill


def planning(root: Path, rows: int, repeat: int = 5) -> tuple[float, float, int]:
    """Plan an eviction over ``rows`` catalog rows (cap exceeded by 10 bundles). Returns ms."""
    # The rows below are this node's: a manager plans and sums its own node's rows only.
    m = CacheManager.open(
        root / "plan", max_size_bytes=10**12, builders={"onnxruntime": FileBuilder()}, node="bench"
    )
    base = utcnow() - timedelta(days=30)
    batch: list[dict[str, object]] = []
    for i in range(rows):
        at = base + timedelta(seconds=i)
        batch.append(
            {
                "id": f"{i:016x}-{i:012x}",
                "model": f"model-{i % 50}",
                "checkpoint_digest": f"{i % 50:064x}",
                "draft_digest": None,
                "profile": {},
                "profile_name": f"p{i}",
                "backend": "onnxruntime",
                "path": f"engines/{i % 50:016x}/p{i}",
                "size_bytes": 1_000_000,
                "file_count": 20,
                "state": "ready",
                "created_at": at,
                "built_at": at,
                "build_seconds": 1.0,
                "last_used_at": at,
                "hit_count": 0,
                "pinned": i % 97 == 0,
                "last_verified_at": at,
                "error": None,
                "node": "bench",
            }
        )
    with m.catalog.engine.begin() as conn:
        for start in range(0, rows, 10_000):
            conn.execute(insert(BundleRow), batch[start : start + 10_000])
    cap = rows * 1_000_000 - 10 * 1_000_000
    times = []
    plan = None
    for _ in range(repeat):
        t = time.perf_counter()
        plan = m.evictor.plan(cap)
        times.append((time.perf_counter() - t) * 1000)
    assert plan is not None
    t = time.perf_counter()
    total = m.catalog.bundles.total_size()
    sum_ms = (time.perf_counter() - t) * 1000
    assert total == rows * 1_000_000
    m.close()
    return min(times), sum_ms, len(plan.evict)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--sizes", default="10,100,1000")
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--quick", action="store_true", help="small sizes: seconds, not minutes (CI)")
    args = parser.parse_args()
    if args.quick:
        args.repeat, args.sizes, args.rows = 20, "5,25", 5_000
    print("cache-hit prepare latency (bundles of 20 files; median and p99 of", args.repeat, "hits)")
    print(f"{'bundles':>8} {'median ms':>10} {'p99 ms':>8} {'fill s':>8} {'vs 10':>7}")
    baseline = None
    for n in (int(x) for x in args.sizes.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            med, p99, fill = hit_latency(Path(tmp), n, args.repeat)
        baseline = baseline or med
        print(f"{n:>8} {med:>10.2f} {p99:>8.2f} {fill:>8.1f} {med / baseline:>6.2f}x")
    with tempfile.TemporaryDirectory() as tmp:
        best, sum_ms, evicted = planning(Path(tmp), args.rows)
    print()
    print(
        f"eviction planning over {args.rows:,} rows (cap exceeded by 10 bundles): best {best:.1f} ms "
        f"(plans {evicted} evictions; target <= 50 ms); SUM(size) alone {sum_ms:.1f} ms"
    )


if __name__ == "__main__":
    main()
