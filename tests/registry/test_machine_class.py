"""What fits this node: a pulled bundle's key must be the one its profile and checkpoint give,
its backend built here with the same builder version, its CPU class or GPU architecture this
node's. The TensorRT builder is a stand-in (hardware is faked, as elsewhere: no GPU here)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from cachesvc.cache.builders import Builder
from cachesvc.cache.profiles import LAYOUT_VERSION, BuildOptions, BundleKey
from cachesvc.cache.registry import BundleRegistry, RegistrySettings
from cachesvc.cache.registry.artifact import RemoteBundle
from cachesvc.cache.store import Manifest
from cachesvc.errors import UntrustedArtifactError
from inference.cpu_class import CPU_CLASSES, cpu_class
from tests.registry.conftest import open_node

DIGEST = "ab" * 32


@dataclass
class GpuBuilder:
    """A TensorRT builder's identity (what ``check_fits`` reads): no GPU is touched."""

    device_arch: str
    version: str = "trt-10.1"
    backend: str = "tensorrt"


def _remote(options: BuildOptions) -> RemoteBundle:
    key = BundleKey.of(DIGEST, options)
    manifest = Manifest(
        layout_version=LAYOUT_VERSION,
        bundle_id=key.id,
        checkpoint_digest=DIGEST,
        draft_digest=None,
        profile=options.to_dict(),
        backend=options.backend,
        versions={},
        engine={},
        files=(),
        created_at="2026-12-05T00:00:00+00:00",
    )
    return RemoteBundle(manifest, "org/model", ())


@pytest.fixture
def registry_for(tmp_path: Path) -> Any:
    node = open_node(tmp_path / "node")

    def make(builders: dict[str, Any]) -> BundleRegistry:
        mapping: dict[str, Builder] = {**node.builders, **builders}
        return BundleRegistry(
            node.catalog, node.store, mapping, settings=RegistrySettings(), max_size_bytes=10**9
        )

    yield make
    node.close()


def test_a_tensorrt_bundle_for_another_gpu_is_refused(registry_for: Any) -> None:
    here = registry_for({"tensorrt": GpuBuilder("sm90")})
    sm80 = BuildOptions(backend="tensorrt", precision="fp16", device_arch="sm80", builder_version="trt-10.1")
    with pytest.raises(UntrustedArtifactError, match=r"built for GPU sm80, this node has sm90; not pulled"):
        here.check_fits(_remote(sm80), "ref")
    sm90 = replace(sm80, device_arch="sm90")
    assert here.check_fits(_remote(sm90), "ref").id == BundleKey.of(DIGEST, sm90).id
    other_version = registry_for({"tensorrt": GpuBuilder("sm90", version="trt-10.3")})
    with pytest.raises(UntrustedArtifactError, match=r"builder trt-10\.1, this node runs trt-10\.3"):
        other_version.check_fits(_remote(sm90), "ref")
    with pytest.raises(UntrustedArtifactError, match="no such backend"):
        registry_for({}).check_fits(_remote(sm90), "ref")


def test_cpu_bundles_fit_by_class_and_a_forged_id_is_refused(registry_for: Any) -> None:
    here = registry_for({})
    fp32 = BuildOptions(precision="fp32", builder_version="test-1")
    assert here.check_fits(_remote(fp32), "ref").id == BundleKey.of(DIGEST, fp32).id  # any CPU
    mine = replace(fp32, precision="int4", cpu_class=cpu_class())
    assert here.check_fits(_remote(mine), "ref").id == BundleKey.of(DIGEST, mine).id
    other = replace(mine, cpu_class=next(c for c in CPU_CLASSES if c != cpu_class()))
    with pytest.raises(UntrustedArtifactError, match="not pulled"):
        here.check_fits(_remote(other), "ref")
    remote = _remote(mine)
    forged = RemoteBundle(replace(remote.manifest, bundle_id="0123456789abcdef-0123456789ab"), "m", ())
    with pytest.raises(UntrustedArtifactError, match="is not the id of its key"):
        here.check_fits(forged, "ref")
