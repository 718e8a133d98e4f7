"""Bundle ready on a fresh node: pulled from an OCI registry vs built, same run, same machine.

Node A (its own cache directory and catalog) builds the bundle and pushes it to a real CNCF
distribution registry (Debian's ``docker-registry``) on a loopback port; node B, a fresh cache,
prepares the same model and profile with the registry configured and pulls it. Both are the
manager's ``prepare`` as ``serve`` runs it on a miss; the engine load that follows is the same
work on both nodes and is not timed. Prints build, push and pull seconds, the build/pull ratio
and the bytes moved; not a test.

    PYTHONPATH=. .venv/bin/python bench/registry_pull.py            # SmolLM2 int4 + the 0.5b demo
    PYTHONPATH=. .venv/bin/python bench/registry_pull.py --quick    # the tiny demo (CI)

Over loopback the pull is disk and hashing bound; over a network add bytes / bandwidth.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import smollm2_checkpoint
from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import ProfileRequest
from cachesvc.cache.registry import RegistrySettings, parse_ref
from cachesvc.cache.store.space import human_size
from inference.demo import write_demo_checkpoint
from tests.support.net import free_port


def start_registry(work: Path) -> tuple[subprocess.Popen[bytes], str] | None:
    """``docker-registry`` on a free loopback port (None, with one line, when not installed)."""
    binary = shutil.which("docker-registry")
    if binary is None:
        print("docker-registry is not installed (apt-get install docker-registry); skipped")
        return None
    port = free_port()
    config = work / "registry.yml"
    config.write_text(
        f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: {work / 'blobs'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    proc = subprocess.Popen(
        [binary, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1)
            return proc, f"oci://127.0.0.1:{port}/bench/bundles"
        except httpx.TransportError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("docker-registry did not start in 20 s")


def measure(work: Path, name: str, checkpoint: Path, precision: str, ref: str) -> tuple[str, ...]:
    settings = RegistrySettings(parse_ref(ref), insecure=True)
    request = ProfileRequest(precision=precision)
    a = CacheManager.open(work / f"{name}-a", max_size_bytes=10**12, registry=settings)
    t0 = time.perf_counter()
    built = a.prepare(str(checkpoint), request)
    build = time.perf_counter() - t0
    assert built.built
    t0 = time.perf_counter()
    pushed = a.registry.push(built.bundle_id)
    push = time.perf_counter() - t0
    a.close()
    b = CacheManager.open(work / f"{name}-b", max_size_bytes=10**12, registry=settings)
    t0 = time.perf_counter()
    got = b.prepare(str(checkpoint), request)
    pull = time.perf_counter() - t0
    assert got.pulled_from is not None and not got.built, "node B built instead of pulling"
    size = b.catalog.bundles.require(got.bundle_id).size_bytes
    b.close()
    return (
        name,
        precision,
        f"{build:.2f}",
        f"{push:.2f}",
        f"{pull:.2f}",
        f"{build / pull:.1f}x",
        human_size(size),
        human_size(pushed.bytes_uploaded),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny demo checkpoint only (CI)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cachesvc-bench-registry-") as tmp:
        work = Path(tmp)
        started = start_registry(work)
        if started is None:
            return
        proc, ref = started
        try:
            models: list[tuple[str, Path, str]] = []
            if args.quick:
                models.append(("demo-tiny", write_demo_checkpoint(work / "tiny", size="tiny"), "fp32"))
            else:
                smol = smollm2_checkpoint(work)
                if smol is not None:
                    models.append(("SmolLM2-135M", smol, "int4"))
                models.append(("demo-0.5b", write_demo_checkpoint(work / "half", size="0.5b"), "fp32"))
            rows: list[tuple[str, ...]] = [
                ("model", "precision", "build s", "push s", "pull s", "build/pull", "bundle", "uploaded")
            ]
            rows += [measure(work, name, path, precision, ref) for name, path, precision in models]
        finally:
            proc.terminate()
            proc.wait(10)
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print(
            "  ".join(
                c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )


if __name__ == "__main__":
    main()
