"""A bundle as an OCI artifact, and the checks an artifact from a registry must pass.

One image manifest per bundle (``artifactType`` :data:`ARTIFACT_TYPE`):

- the config blob (:data:`CONFIG_MEDIA_TYPE`) is JSON ``{"model": ..., "bundle": <manifest.json>}``:
  the bundle's own manifest holds its key (checkpoint digest, profile with backend, precision,
  CPU class or GPU architecture, builder version), the runtime versions, the engine record
  (quality figures) and every file with its size and SHA-256;
- one layer per bundle file (:data:`LAYER_MEDIA_TYPE`), its digest the SHA-256 the bundle
  manifest records and its relative path in the ``org.opencontainers.image.title`` annotation.

Two tags point at it: the bundle id (the canonical tag: a node that knows the key finds the
artifact with one manifest lookup) and a readable ``<model>-<profile name>``. The manifest's
annotations carry the key and the machine class, so a listing needs no config blob.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from cachesvc.cache.profiles import is_bundle_id
from cachesvc.cache.store import Manifest
from cachesvc.errors import CorruptBundleError, UntrustedArtifactError

ARTIFACT_TYPE = "application/vnd.cachesvc.bundle.v1+json"
CONFIG_MEDIA_TYPE = "application/vnd.cachesvc.bundle.config.v1+json"
LAYER_MEDIA_TYPE = "application/vnd.cachesvc.bundle.file.v1"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
TITLE = "org.opencontainers.image.title"
CREATED = "org.opencontainers.image.created"
ANN_ID = "org.cachesvc.bundle.id"
ANN_KEY = "org.cachesvc.bundle.key"
ANN_MODEL = "org.cachesvc.bundle.model"
ANN_PROFILE = "org.cachesvc.bundle.profile"
ANN_CLASS = "org.cachesvc.bundle.machine-class"
#: A bundle has tens of files; more layers than this is not a bundle of ours.
MAX_LAYERS = 10_000
#: The longest model name a pulled bundle's catalog row takes from the registry.
MAX_MODEL_CHARS = 1024


@dataclass(frozen=True)
class Layer:
    """One bundle file as a blob."""

    path: str
    digest: str
    size: int


@dataclass(frozen=True)
class Artifact:
    """What a push uploads: the config blob, the layers (files) and the manifest body."""

    config: bytes
    config_digest: str
    layers: tuple[Layer, ...]
    manifest: bytes
    tags: tuple[str, ...]


@dataclass(frozen=True)
class RemoteBundle:
    """An artifact read from a registry that passed :func:`read_remote`'s checks."""

    manifest: Manifest
    model: str
    layers: tuple[Layer, ...]

    @property
    def size_bytes(self) -> int:
        return sum(layer.size for layer in self.layers)


def machine_class(profile: dict[str, Any]) -> str:
    """``gpu:<arch>`` (TensorRT), ``cpu:<class>`` (a quantized CPU build) or ``any``."""
    if profile.get("device_arch"):
        return f"gpu:{profile['device_arch']}"
    if profile.get("cpu_class"):
        return f"cpu:{profile['cpu_class']}"
    return "any"


def model_slug(model: str) -> str:
    """A short readable name of ``model`` (hub id, directory or GGUF file): its last path part."""
    last = PurePosixPath(model.rstrip("/")).name or "model"
    if last.lower().endswith(".gguf"):
        last = last[: -len(".gguf")]
    return last


def readable_tag(model: str, profile_name: str) -> str:
    """``<model slug>-<profile name>`` in the OCI tag grammar (128 characters at most; the
    slug is cut first, the profile name keeps its digest)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_slug(model)).strip(".-") or "model"
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", profile_name)
    room = max(128 - len(name) - 1, 1)
    tag = f"{slug[:room]}-{name}"[:128]
    return tag if re.match(r"^[A-Za-z0-9_]", tag) else f"_{tag[:127]}"


def bundle_artifact(manifest: Manifest, model: str, profile_name: str) -> Artifact:
    """The artifact of a published bundle whose manifest is ``manifest``."""
    config = json.dumps(
        {"model": model, "bundle": json.loads(manifest.to_json())}, sort_keys=True, separators=(",", ":")
    ).encode()
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    layers = tuple(Layer(e.path, f"sha256:{e.sha256}", e.size) for e in manifest.files)
    key = {
        "bundle_id": manifest.bundle_id,
        "checkpoint_digest": manifest.checkpoint_digest,
        "draft_digest": manifest.draft_digest,
        "profile": manifest.profile,
    }
    body = {
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "artifactType": ARTIFACT_TYPE,
        "config": {"mediaType": CONFIG_MEDIA_TYPE, "digest": config_digest, "size": len(config)},
        "layers": [
            {
                "mediaType": LAYER_MEDIA_TYPE,
                "digest": layer.digest,
                "size": layer.size,
                "annotations": {TITLE: layer.path},
            }
            for layer in layers
        ],
        "annotations": {
            ANN_ID: manifest.bundle_id,
            ANN_KEY: json.dumps(key, sort_keys=True, separators=(",", ":")),
            ANN_MODEL: model,
            ANN_PROFILE: profile_name,
            ANN_CLASS: machine_class(manifest.profile),
            CREATED: manifest.created_at,
        },
    }
    tags = (manifest.bundle_id, readable_tag(model, profile_name))
    return Artifact(config, config_digest, layers, json.dumps(body, sort_keys=True).encode(), tags)


def check_artifact_type(oci: dict[str, Any], where: str) -> None:
    """UntrustedArtifactError unless ``oci`` is an image manifest of a cachesvc bundle."""
    kind = oci.get("artifactType")
    config = oci.get("config")
    media = config.get("mediaType") if isinstance(config, dict) else None
    if kind != ARTIFACT_TYPE or media != CONFIG_MEDIA_TYPE:
        raise UntrustedArtifactError(
            f"{where} is not a cachesvc bundle (artifactType {kind!r}, expected {ARTIFACT_TYPE})"
        )


def config_ref(oci: dict[str, Any], where: str) -> tuple[str, int]:
    """The config blob's digest and size (checked for shape)."""
    config = oci["config"]
    digest, size = config.get("digest"), config.get("size")
    if not _is_digest(digest) or not _is_size(size):
        raise UntrustedArtifactError(f"{where}: the config descriptor has no valid digest and size")
    return digest, size


def read_remote(oci: dict[str, Any], config: bytes, where: str) -> RemoteBundle:
    """Check an artifact's manifest and config against each other: every layer is one file of
    the bundle manifest, with the same path, SHA-256 and size, and a safe relative path; no
    file is missing or repeated. UntrustedArtifactError (one line) otherwise."""
    check_artifact_type(oci, where)
    try:
        raw = json.loads(config)
        model = raw["model"]
        manifest = Manifest.from_json(json.dumps(raw["bundle"]).encode())
    except CorruptBundleError as exc:
        raise UntrustedArtifactError(
            f"{where}: the bundle manifest in its config is invalid ({exc})"
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise UntrustedArtifactError(f"{where}: its config is not a cachesvc bundle config ({exc})") from None
    if not isinstance(model, str) or not is_bundle_id(manifest.bundle_id):
        raise UntrustedArtifactError(f"{where}: its config names no model or no valid bundle id")
    if not model or len(model) > MAX_MODEL_CHARS or not model.isprintable():
        raise UntrustedArtifactError(
            f"{where}: its model name is empty, longer than {MAX_MODEL_CHARS} characters or not printable"
        )
    items = oci.get("layers")
    if not isinstance(items, list) or len(items) > MAX_LAYERS:
        raise UntrustedArtifactError(f"{where}: layers must be a list of at most {MAX_LAYERS}")
    expected = {e.path: e for e in manifest.files}
    layers: list[Layer] = []
    for index, item in enumerate(items):
        layer = _layer(item, f"{where}: layer {index}")
        entry = expected.pop(layer.path, None)
        if entry is None:
            raise UntrustedArtifactError(
                f"{where}: layer {index} ({layer.path!r}) is not a file of the bundle manifest, "
                "or repeats one"
            )
        if layer.digest != f"sha256:{entry.sha256}" or layer.size != entry.size:
            raise UntrustedArtifactError(
                f"{where}: layer {index} ({layer.path!r}) has another digest or size than the bundle manifest"
            )
        layers.append(layer)
    if expected:
        raise UntrustedArtifactError(f"{where}: no layer for the bundle file {sorted(expected)[0]!r}")
    return RemoteBundle(manifest, model, tuple(layers))


def _layer(item: Any, where: str) -> Layer:
    if not isinstance(item, dict) or item.get("mediaType") != LAYER_MEDIA_TYPE:
        raise UntrustedArtifactError(f"{where} is not a bundle file layer ({LAYER_MEDIA_TYPE})")
    annotations = item.get("annotations")
    path = annotations.get(TITLE) if isinstance(annotations, dict) else None
    if not isinstance(path, str) or not safe_relpath(path):
        raise UntrustedArtifactError(
            f"{where}: path {path!r} is not a relative path inside the bundle "
            "(absolute paths and '..' are refused)"
        )
    digest, size = item.get("digest"), item.get("size")
    if not (isinstance(digest, str) and isinstance(size, int) and _is_digest(digest) and _is_size(size)):
        raise UntrustedArtifactError(f"{where}: no valid sha256 digest and size")
    return Layer(path, digest, size)


def safe_relpath(path: str) -> bool:
    """A normalised relative POSIX path inside a bundle (no ``..``, no absolute path, no
    backslash, not the bundle's own ``manifest.json``)."""
    return bool(path) and not (
        path.startswith("/")
        or "\\" in path
        or "\x00" in path
        or any(part in ("..", ".", "") for part in path.split("/"))
        or path == "manifest.json"
    )


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", value) is not None


def _is_size(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
