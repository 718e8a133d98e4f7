"""The registry is untrusted: a tampered blob, a bundle of another CPU class, an artifact of
another type, a missing tag and a registry that is down each get one clear error (or, on a
cache miss, one warning and a local build), and nothing is published from them."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path

import pytest

from cachesvc.cache.manager import CacheManager
from cachesvc.cache.profiles import BuildOptions, BundleKey, ProfileRequest
from cachesvc.cache.registry import parse_ref
from cachesvc.cache.registry.artifact import Artifact, bundle_artifact
from cachesvc.cache.registry.client import MANIFEST_MEDIA_TYPE, RegistryClient
from cachesvc.cache.registry.transfer import upload
from cachesvc.cache.store import read_manifest
from cachesvc.errors import (
    RegistryNotFoundError,
    RegistryUnavailableError,
    UntrustedArtifactError,
)
from inference.cpu_class import CPU_CLASSES, cpu_class
from tests.cache.conftest import assert_consistent
from tests.registry.conftest import Registry, open_node
from tests.support.cache import FileBuilder
from tests.support.net import free_port

INT4 = ProfileRequest(precision="int4")


def _pushed(tmp_path: Path, registry: Registry, checkpoint: Path) -> tuple[CacheManager, str]:
    a = open_node(tmp_path / "node-a", registry)
    bid = a.prepare(str(checkpoint), INT4).bundle_id
    a.registry.push(bid)
    return a, bid


def _nothing_published(m: CacheManager) -> None:
    assert m.catalog.bundles.all() == []
    assert list((m.layout.root / "engines").glob("*/*")) == []
    assert list(m.layout.staging.iterdir()) == []
    assert all(e.kind != "pull" for e in m.catalog.events.recent(limit=50))


def test_a_tampered_blob_is_refused_and_the_miss_builds_locally(
    tmp_path: Path, registry: Registry, checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a, _bid = _pushed(tmp_path, registry, checkpoint)
    # The bundle files' blob (4096 bytes): same size, other bytes.
    (blob,) = [p for p in registry.blobs() if p.stat().st_size == 4096]
    data = bytearray(blob.read_bytes())
    data[100] ^= 0xFF
    blob.write_bytes(bytes(data))

    b = open_node(tmp_path / "node-b", registry)
    with pytest.raises(UntrustedArtifactError, match="does not match its digest"):
        b.pull(str(checkpoint), INT4)
    _nothing_published(b)

    builder = FileBuilder(files=3, file_size=4096)
    c = open_node(tmp_path / "node-c", registry, builder=builder)
    with caplog.at_level(logging.WARNING, logger="cachesvc.manager"):
        result = c.prepare(str(checkpoint), INT4)
    assert result.built and result.pulled_from is None and builder.calls == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        len(warnings) == 1
        and "does not match its digest" in warnings[0]
        and "building it here" in warnings[0]
    )
    assert_consistent(c)
    for m in (a, b, c):
        m.close()


def _foreign_class_artifact(a: CacheManager, bid: str) -> tuple[str, Artifact, Path]:
    """The same files, declared as built for another CPU class (a well-formed artifact)."""
    info = a.catalog.bundles.require(bid)
    bundle_dir = a.layout.root / info.path
    manifest = read_manifest(bundle_dir)
    other = next(c for c in CPU_CLASSES if c != cpu_class())
    options = dataclasses.replace(BuildOptions.from_dict(dict(manifest.profile)), cpu_class=other)
    key = BundleKey.of(manifest.checkpoint_digest, options)
    foreign = dataclasses.replace(manifest, bundle_id=key.id, profile=options.to_dict())
    return key.id, bundle_artifact(foreign, info.model, options.name), bundle_dir


def test_a_bundle_of_another_cpu_class_is_never_pulled(
    tmp_path: Path, registry: Registry, checkpoint: Path
) -> None:
    a, bid = _pushed(tmp_path, registry, checkpoint)
    foreign_id, artifact, files = _foreign_class_artifact(a, bid)
    ns = parse_ref(registry.url)
    with RegistryClient(ns.host, insecure=True) as client:
        upload(client, ns.repository, artifact, files)

    b = open_node(tmp_path / "node-b", registry)
    with pytest.raises(UntrustedArtifactError, match=r"built for CPU class .*; not pulled"):
        b.pull(ref=f"{registry.url}:{foreign_id}")
    _nothing_published(b)
    # Listing says it does not fit this node.
    fits = {e.bundle_id: e.fits_this_node for e in b.registry.list_remote()}
    assert fits == {bid: True, foreign_id: False}

    # A registry that serves it under this node's own key: refused, built here instead.
    with RegistryClient(ns.host, insecure=True) as client:
        upload(client, ns.repository, artifact, files, tags=(bid,))
    builder = FileBuilder(files=3, file_size=4096)
    c = open_node(tmp_path / "node-c", registry, builder=builder)
    with pytest.raises(UntrustedArtifactError, match=r"not pulled|refused"):
        c.pull(str(checkpoint), INT4)
    result = c.prepare(str(checkpoint), INT4)
    assert result.built and builder.calls == 1
    assert_consistent(c)
    for m in (a, b, c):
        m.close()


def test_an_artifact_of_another_type_is_refused(tmp_path: Path, registry: Registry) -> None:
    ns = parse_ref(registry.url)
    config = b"{}"
    with RegistryClient(ns.host, insecure=True) as client:
        digest = "sha256:" + hashlib.sha256(config).hexdigest()
        client.push_blob(ns.repository, digest, len(config), config)
        body = {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "artifactType": "application/vnd.example.other+json",
            "config": {"mediaType": "application/vnd.example.config+json", "digest": digest, "size": 2},
            "layers": [],
        }
        client.put_manifest(ns.repository, "other", json.dumps(body).encode())
    b = open_node(tmp_path / "node-b", registry)
    with pytest.raises(UntrustedArtifactError) as info:
        b.pull(ref=f"{registry.url}:other")
    assert "is not a cachesvc bundle" in str(info.value) and "\n" not in str(info.value)
    _nothing_published(b)
    b.close()


def test_a_missing_tag_is_a_clear_404(tmp_path: Path, registry: Registry) -> None:
    b = open_node(tmp_path / "node-b", registry)
    with pytest.raises(RegistryNotFoundError) as info:
        b.pull(ref=f"{registry.url}:no-such-tag")
    assert "404" in str(info.value) and "no-such-tag" in str(info.value)
    _nothing_published(b)
    b.close()


def test_a_registry_that_is_down_fails_fast_and_a_miss_builds_locally(
    tmp_path: Path, checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    down = Registry(f"127.0.0.1:{free_port()}", tmp_path, f"oci://127.0.0.1:{free_port()}/fleet/bundles")
    b = open_node(tmp_path / "node-b", down)
    with pytest.raises(RegistryUnavailableError, match="unreachable: connection refused"):
        b.pull(str(checkpoint), INT4)
    builder = FileBuilder(files=3, file_size=4096)
    c = open_node(tmp_path / "node-c", down, builder=builder)
    # What an earlier pull cut short left to resume: the local build that follows replaces it.
    c.resolve(str(checkpoint))
    partial = c.store.new_staging_dir(c.catalog_bundle_id(str(checkpoint), INT4))
    (partial / "part-000.bin").write_bytes(b"half")
    with caplog.at_level(logging.WARNING, logger="cachesvc.manager"):
        assert c.prepare(str(checkpoint), INT4).built
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unreachable" in warnings[0]
    assert builder.calls == 1
    assert_consistent(c)
    b.close()
    c.close()
