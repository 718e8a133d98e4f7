"""The artifact mapping and the checks on what a registry sends: every layer one file of the
bundle manifest (path, digest, size), safe relative paths, our artifact type, a sane config."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import pytest

from cachesvc.cache.profiles import LAYOUT_VERSION, BuildOptions, BundleKey
from cachesvc.cache.registry.artifact import (
    ANN_CLASS,
    ARTIFACT_TYPE,
    TITLE,
    bundle_artifact,
    read_remote,
)
from cachesvc.cache.store import FileEntry, Manifest
from cachesvc.errors import UntrustedArtifactError

OPTIONS = BuildOptions(precision="fp32", builder_version="test-1")
KEY = BundleKey.of("cd" * 32, OPTIONS)
FILES = (
    FileEntry("model.onnx", 10, "1" * 64),
    FileEntry("tokenizer/tokenizer.json", 20, "2" * 64),
)
MANIFEST = Manifest(
    layout_version=LAYOUT_VERSION,
    bundle_id=KEY.id,
    checkpoint_digest="cd" * 32,
    draft_digest=None,
    profile=OPTIONS.to_dict(),
    backend="onnxruntime",
    versions={"onnxruntime": "1.20"},
    engine={"quality": {"agreement": 1.0}},
    files=FILES,
    created_at="2026-12-05T00:00:00+00:00",
)


def _parts() -> tuple[dict[str, Any], bytes]:
    artifact = bundle_artifact(MANIFEST, "org/SmolLM2-135M", OPTIONS.name)
    return json.loads(artifact.manifest), artifact.config


def test_a_bundle_maps_to_one_manifest_with_a_layer_per_file() -> None:
    artifact = bundle_artifact(MANIFEST, "org/SmolLM2-135M", OPTIONS.name)
    oci = json.loads(artifact.manifest)
    assert oci["artifactType"] == ARTIFACT_TYPE and oci["annotations"][ANN_CLASS] == "any"
    assert [(layer["annotations"][TITLE], layer["digest"], layer["size"]) for layer in oci["layers"]] == [
        ("model.onnx", "sha256:" + "1" * 64, 10),
        ("tokenizer/tokenizer.json", "sha256:" + "2" * 64, 20),
    ]
    assert artifact.tags == (KEY.id, f"SmolLM2-135M-{OPTIONS.name}")
    remote = read_remote(oci, artifact.config, "ref")
    assert remote.manifest == MANIFEST and remote.model == "org/SmolLM2-135M" and remote.size_bytes == 30


def _set(path: list[Any], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(oci: dict[str, Any]) -> None:
        node: Any = oci
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = value

    return change


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (_set(["artifactType"], "application/vnd.example+json"), "is not a cachesvc bundle"),
        (
            _set(["config", "mediaType"], "application/vnd.oci.image.config.v1+json"),
            "is not a cachesvc bundle",
        ),
        (_set(["layers", 0, "annotations", TITLE], "../model.onnx"), "'..' are refused"),
        (_set(["layers", 0, "annotations", TITLE], "/etc/model.onnx"), "absolute paths"),
        (_set(["layers", 0, "annotations", TITLE], "other.onnx"), "is not a file of the bundle manifest"),
        (_set(["layers", 0, "digest"], "sha256:" + "9" * 64), "another digest or size"),
        (_set(["layers", 0, "size"], 11), "another digest or size"),
        (_set(["layers", 0, "digest"], "md5:abc"), "no valid sha256 digest"),
        (_set(["layers", 0, "mediaType"], "application/octet-stream"), "is not a bundle file layer"),
        (lambda oci: oci["layers"].pop(), "no layer for the bundle file 'tokenizer/tokenizer.json'"),
        (lambda oci: oci["layers"].append(copy.deepcopy(oci["layers"][0])), "or repeats one"),
    ],
)
def test_a_manifest_that_disagrees_with_the_bundle_is_refused(
    change: Callable[[dict[str, Any]], None], says: str
) -> None:
    oci, config = _parts()
    change(oci)
    with pytest.raises(UntrustedArtifactError) as info:
        read_remote(oci, config, "oci://r/ns:t")
    assert says in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("config", "says"),
    [
        (b"not json", "is not a cachesvc bundle config"),
        (json.dumps({"model": "m"}).encode(), "is not a cachesvc bundle config"),
        (
            json.dumps({"model": "m", "bundle": {"files": []}}).encode(),
            "bundle manifest in its config is invalid",
        ),
        (json.dumps({"model": "a\x00b", "bundle": json.loads(MANIFEST.to_json())}).encode(), "not printable"),
        (json.dumps({"model": "m" * 2000, "bundle": json.loads(MANIFEST.to_json())}).encode(), "longer than"),
    ],
)
def test_a_config_that_is_not_ours_is_refused(config: bytes, says: str) -> None:
    oci, _ = _parts()
    with pytest.raises(UntrustedArtifactError, match=says):
        read_remote(oci, config, "oci://r/ns:t")
