"""A real CNCF distribution registry (Debian's ``docker-registry``) on a loopback port.

Each test that asks for ``registry`` gets its own server with a throwaway storage directory;
``auth_registry`` adds basic auth through an htpasswd file (``htpasswd`` from apache2-utils).
The tests skip, saying why, only when the binaries are not installed (.ci/run installs them).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.registry import RegistrySettings, parse_ref
from tests.admin.conftest import MAX_SIZE
from tests.support.cache import FileBuilder, make_checkpoint
from tests.support.databases import catalog_url_for, shared_catalog_url
from tests.support.net import NotReadyError, free_port

REGISTRY_BIN = shutil.which("docker-registry")
HTPASSWD_BIN = shutil.which("htpasswd")
USER, PASSWORD = "fleet", "s3cret-pass"


@dataclass(frozen=True)
class Registry:
    """A running registry: its address, storage directory and the ``oci://`` namespace."""

    host: str
    storage: Path
    url: str

    def blobs(self) -> list[Path]:
        """Every blob data file in its storage (for tampering)."""
        return sorted(self.storage.glob("docker/registry/v2/blobs/sha256/*/*/data"))


def _start(tmp: Path, *, htpasswd: Path | None = None) -> Iterator[Registry]:
    if REGISTRY_BIN is None:
        pytest.skip("docker-registry is not installed (apt-get install docker-registry)")
    port = free_port()
    storage = tmp / "storage"
    auth = f"auth:\n  htpasswd:\n    realm: cachesvc-test\n    path: {htpasswd}\n" if htpasswd else ""
    config = tmp / "registry.yml"
    config.write_text(
        "version: 0.1\nlog:\n  level: error\n"
        f"storage:\n  filesystem:\n    rootdirectory: {storage}\n  delete:\n    enabled: true\n"
        f"http:\n  addr: 127.0.0.1:{port}\n{auth}"
    )
    log = open(tmp / "registry.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([REGISTRY_BIN, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            _wait_up(port, proc)
        except NotReadyError as exc:
            pytest.fail(f"registry did not start: {exc}; log: {(tmp / 'registry.log').read_text()[-2000:]}")
        yield Registry(f"127.0.0.1:{port}", storage, f"oci://127.0.0.1:{port}/fleet/bundles")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _wait_up(port: int, proc: subprocess.Popen[bytes]) -> None:
    """Until ``/v2/`` answers (200, or 401 with auth: either way it is up)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise NotReadyError(f"docker-registry exited with {proc.returncode}", exited=True)
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1).status_code in (200, 401):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise NotReadyError("docker-registry did not answer in 20 s", exited=False)


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    """A registry without auth."""
    folder = tmp_path / "registry"
    folder.mkdir()
    yield from _start(folder)


@pytest.fixture
def auth_registry(tmp_path: Path) -> Iterator[Registry]:
    """A registry with basic auth (user ``USER``, password ``PASSWORD``)."""
    if HTPASSWD_BIN is None:
        pytest.skip("htpasswd is not installed (apt-get install apache2-utils)")
    folder = tmp_path / "auth-registry"
    folder.mkdir()
    htpasswd = folder / "htpasswd"
    subprocess.run([HTPASSWD_BIN, "-Bbc", str(htpasswd), USER, PASSWORD], check=True, capture_output=True)
    yield from _start(folder, htpasswd=htpasswd)


def open_node(
    cache_dir: Path,
    registry: Registry | None = None,
    *,
    push: bool = False,
    builder: FileBuilder | None = None,
    catalog_url: str | None = None,
    node: str | None = None,
) -> CacheManager:
    """A node: its own cache directory and catalog (or ``catalog_url``, shared, as node
    ``node``), the file-writing test builder, and (optionally) the registry over plain HTTP."""
    # Plain HTTP for every registry this node talks to (loopback), named here or per call.
    settings = RegistrySettings(parse_ref(registry.url) if registry else None, insecure=True, push=push)
    return CacheManager.open(
        cache_dir,
        catalog_url=catalog_url or catalog_url_for(cache_dir),
        max_size_bytes=MAX_SIZE,
        builders={"onnxruntime": builder or FileBuilder(files=3, file_size=4096)},
        offline=True,
        registry=settings,
        node=node,
        claim_node=node is not None,
    )


def fleet_catalog_url(tmp_path: Path) -> str:
    """One catalog for several nodes: a PostgreSQL database under ``catalog_db``'s postgresql
    variant, else one SQLite file."""
    return shared_catalog_url("registry_fleet") or f"sqlite:///{tmp_path / 'fleet.sqlite3'}"


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "models" / "tiny", seed=1)
