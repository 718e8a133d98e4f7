"""Model pool benchmark: cold load vs warm time to first token, and swapping models.

Against demo checkpoints (random weights; ``--size 0.5b`` is the Qwen2.5-0.5B shape, ``tiny``
the 2-layer test model), built once into ``--work`` with ``cachesvc prepare`` and served by a
real ``cachesvc serve`` child with no model argument (the whole catalog), this measures:

* **cold TTFT**: the first streamed token of a request for a model that is not loaded (lease,
  engine load, tokenizer, scheduler start, prefill), after ``DELETE /admin/engines/{id}``;
* **warm TTFT**: the same request with the model loaded;
* **alternating two models**: requests per second over ``--requests`` non-streamed completions
  that alternate between two models, with ``--max-loaded-models 1`` (every request swaps) and
  ``2`` (both stay loaded).

Every number is the best (TTFT) or median (rps) of ``--repeats`` runs. Not a test: numbers
depend on the machine and its neighbours.

    PYTHONPATH=. .venv/bin/python bench/pool.py [--size 0.5b] [--work DIR] [--repeats 3]
    PYTHONPATH=. .venv/bin/python bench/pool.py --quick   # CI: tiny, one repeat, a fresh work dir
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import scratch_dir  # noqa: E402
from cachesvc.cache.manager import CacheManager  # noqa: E402
from inference.demo import SIZES, write_demo_checkpoint  # noqa: E402
from tests.support.net import free_port, wait_http_ok  # noqa: E402

PROFILE = ("--max-input-len", "128", "--max-kv-cache-capacity", "256")
PROMPT = [5, 17, 42, 7, 99, 3, 11, 64]


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("cachesvc")
    return [str(script)] if script.exists() else [sys.executable, "-m", "cachesvc.cli"]


def prepare(work: Path, size: str) -> tuple[Path, dict[str, str]]:
    """Two checkpoints (qwen2, llama) built into ``work/cache``; name -> bundle id."""
    cache = work / "cache"
    names: dict[str, str] = {}
    for seed, arch in enumerate(("qwen2", "llama"), start=1):
        ckpt = work / f"{arch}-{size}"
        if not (ckpt / "config.json").exists():
            write_demo_checkpoint(ckpt, arch=arch, size=size, seed=seed)
        subprocess.run([*_cli(), "--cache-dir", str(cache), "prepare", str(ckpt), *PROFILE], check=True)
    manager = CacheManager.open(cache, max_size_bytes=10**13)
    try:
        for b in manager.queries.list_bundles(state="ready").items:
            names[b.model] = b.id
    finally:
        manager.close()
    return cache, names


@contextmanager
def server(cache: Path, *flags: str) -> Iterator[str]:
    """A ``cachesvc serve`` (no model: the catalog) on a free port; yields its base URL."""
    port = free_port()
    argv = [*_cli(), "serve", "--cache-dir", str(cache), "--host", "127.0.0.1", "--port", str(port), *flags]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health/ready", timeout=120, proc=proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def ttft(client: httpx.Client, model: str) -> float:
    """Seconds to the first streamed completion chunk."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "stream": True, "temperature": 0}
    start = time.perf_counter()
    with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and '"choices"' in line:
                return time.perf_counter() - start
    raise RuntimeError("no token")


def alternate(client: httpx.Client, models: list[str], n: int) -> float:
    """Requests per second over ``n`` completions alternating between ``models``."""
    start = time.perf_counter()
    for i in range(n):
        body = {"model": models[i % len(models)], "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        client.post("/v1/completions", json=body).raise_for_status()
    return n / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", choices=SIZES, default="0.5b")
    parser.add_argument("--work", type=Path, default=None, help="default: /tmp/cachesvc-bench-pool")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--quick", action="store_true", help="CI: --size tiny, one repeat, 4 requests")
    args = parser.parse_args()
    if args.quick:
        args.size, args.repeats, args.requests = "tiny", 1, 4
        args.work = args.work or scratch_dir("bench-pool-")
    args.work = args.work or Path("/tmp/cachesvc-bench-pool")
    args.work.mkdir(parents=True, exist_ok=True)
    cache, names = prepare(args.work, args.size)
    models = sorted(names)
    first, bid = models[0], names[models[0]]
    result: dict[str, object] = {"size": args.size}
    with server(cache, "--max-loaded-models", "2") as url, httpx.Client(base_url=url, timeout=600) as c:
        cold, warm = [], []
        for _ in range(args.repeats):
            c.delete(f"/admin/engines/{bid}")
            cold.append(ttft(c, first))
            warm.append(ttft(c, first))
        result["cold_ttft_s"] = round(min(cold), 4)
        result["warm_ttft_s"] = round(min(warm), 4)
    for limit in ("1", "2"):
        with server(cache, "--max-loaded-models", limit) as url, httpx.Client(base_url=url, timeout=600) as c:
            alternate(c, models, 2)  # both loaded once (or swapped) before timing
            rates = [alternate(c, models, args.requests) for _ in range(args.repeats)]
            result[f"alternating_rps_max_loaded_{limit}"] = round(statistics.median(rates), 2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
