"""Push bundles to an OCI registry and pull them into the cache (``manager.registry``).

A pull is untrusted input end to end: the manifest must be a cachesvc bundle (artifactType),
its key must be the one asked for and built for this node's class (CPU class, GPU
architecture, builder version), its size must fit the cache cap and the free disk before a
byte is downloaded, every layer's path must be a relative path inside the bundle, and every
layer is streamed into a staging directory with its size and SHA-256 checked against the OCI
descriptor and the bundle manifest; then the bundle is published like a build (the caller
holds the bundle's exclusive lock; one ``os.replace``) and the catalog row records the pull.
A kill at any point leaves a staging directory that reconcile removes, never a bundle.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachesvc.cache.builders import Builder
from cachesvc.cache.catalog import Catalog
from cachesvc.cache.crashpoints import crash_point
from cachesvc.cache.profiles import BuildOptions, BundleKey, is_bundle_id
from cachesvc.cache.records import BundleInfo
from cachesvc.cache.registry.artifact import (
    ANN_CLASS,
    ANN_MODEL,
    ANN_PROFILE,
    Artifact,
    Layer,
    RemoteBundle,
    bundle_artifact,
    check_artifact_type,
    config_ref,
    read_remote,
)
from cachesvc.cache.registry.client import MAX_DOCUMENT_BYTES, RegistryClient
from cachesvc.cache.registry.reference import RegistryRef, parse_ref
from cachesvc.cache.store import MANIFEST_NAME, BundleStore, read_manifest
from cachesvc.cache.store.manifest import sha256_file, walk_entries
from cachesvc.cache.store.space import human_size, require_free
from cachesvc.errors import (
    ConfigError,
    ConflictError,
    CorruptBundleError,
    RegistryUnavailableError,
    UntrustedArtifactError,
)
from inference.cpu_class import cpu_class

log = logging.getLogger("cachesvc.registry")

#: Layers of one pull downloaded at once (a bundle's few large files share the bandwidth).
PARALLEL_LAYERS = 4


@dataclass(frozen=True)
class RegistrySettings:
    """Where this node's bundles are shared: ``ref`` (None: no registry), plain HTTP when
    ``insecure``, and whether every bundle this node builds is pushed (``push``)."""

    ref: RegistryRef | None = None
    insecure: bool = False
    push: bool = False
    timeout: float = 30.0


@dataclass(frozen=True)
class PushResult:
    """What a push did: where, under which tags, and how much it uploaded."""

    bundle_id: str
    ref: str
    tags: tuple[str, ...]
    digest: str
    blobs_uploaded: int
    blobs_skipped: int
    bytes_uploaded: int


@dataclass(frozen=True)
class PullResult:
    """A pulled and published bundle."""

    bundle_id: str
    ref: str
    bundle_dir: Path
    size_bytes: int
    seconds: float
    info: BundleInfo
    #: The bundle was in the cache already: nothing was downloaded.
    already: bool = False
    #: Files a killed pull had already downloaded, checked and kept (a resumed pull).
    reused: int = 0


@dataclass(frozen=True)
class RemoteEntry:
    """One bundle a registry holds (from its manifest's annotations)."""

    bundle_id: str
    model: str
    profile: str
    machine_class: str
    size_bytes: int
    ref: str
    fits_this_node: bool


class BundleRegistry:
    """Push, pull and list bundles in the node's OCI registry (or one named per call)."""

    def __init__(
        self,
        catalog: Catalog,
        store: BundleStore,
        builders: Mapping[str, Builder],
        *,
        settings: RegistrySettings,
        max_size_bytes: int,
    ) -> None:
        self.catalog = catalog
        self.store = store
        self.builders = builders
        self.settings = settings
        self.max_size_bytes = max_size_bytes

    @property
    def configured(self) -> bool:
        return self.settings.ref is not None

    def resolve_ref(self, ref: str | RegistryRef | None) -> RegistryRef:
        """``ref`` (text or parsed), else the configured registry; ConfigError when neither."""
        if isinstance(ref, RegistryRef):
            return ref
        if ref:
            return parse_ref(ref, field="ref")
        if self.settings.ref is None:
            raise ConfigError(
                "registry", "no registry is configured; give --registry oci://host[:port]/namespace"
            )
        return self.settings.ref

    def client(self, ref: RegistryRef) -> RegistryClient:
        return RegistryClient.for_ref(ref, insecure=self.settings.insecure, timeout=self.settings.timeout)

    # -- push --------------------------------------------------------------------------------

    def push(self, bundle_id: str, ref: str | RegistryRef | None = None) -> PushResult:
        """Upload this node's ready bundle ``bundle_id`` (blobs the registry has are skipped),
        then its config and manifest under the bundle id and the readable tag. The bundle is
        held under a shared lease meanwhile, so no eviction removes it half way."""
        target = self.resolve_ref(ref).namespace
        info = self.catalog.bundles.require(bundle_id)
        if info.state != "ready":
            raise ConflictError(
                f"bundle {bundle_id} is {info.state}, not ready; only ready bundles are pushed",
                reason=info.state,
            )
        lease = self.store.locks.lease(bundle_id, timeout=30.0)
        try:
            bundle_dir = self.store.layout.root / info.path
            manifest = read_manifest(bundle_dir)
            artifact = bundle_artifact(manifest, info.model, info.profile_name)
            with self.client(target) as client:
                uploaded, skipped, nbytes, digest = upload(client, target.repository, artifact, bundle_dir)
        finally:
            lease.release()
        self.catalog.events.add(
            "push",
            bundle_id=bundle_id,
            model=info.model,
            nbytes=nbytes,
            detail=str(target.with_tag(artifact.tags[0])),
        )
        log.info(
            "pushed bundle %s to %s (%d blobs uploaded, %d already there, %s)",
            bundle_id,
            target,
            uploaded,
            skipped,
            human_size(nbytes),
        )
        return PushResult(bundle_id, str(target), artifact.tags, digest, uploaded, skipped, nbytes)

    # -- pull --------------------------------------------------------------------------------

    def fetch(self, ref: RegistryRef, client: RegistryClient) -> RemoteBundle:
        """Read and check the artifact ``ref`` names (manifest and config; no layer yet)."""
        assert ref.tag is not None
        oci, _digest = client.get_manifest(ref.repository, ref.tag)
        where = str(ref)
        check_artifact_type(oci, where)
        digest, size = config_ref(oci, where)
        if size > MAX_DOCUMENT_BYTES:
            raise UntrustedArtifactError(
                f"{where}: its config is {size} bytes, over the {MAX_DOCUMENT_BYTES} read"
            )
        return read_remote(oci, client.read_blob(ref.repository, digest, MAX_DOCUMENT_BYTES), where)

    def check_fits(self, remote: RemoteBundle, where: str) -> BundleKey:
        """The key of ``remote`` when this node can run it: the id is the one its profile and
        checkpoint give, its backend is built here with the same builder version, and a CPU
        class or GPU architecture in its profile is this node's. UntrustedArtifactError else."""
        manifest = remote.manifest
        try:
            options = BuildOptions.from_dict(dict(manifest.profile))
        except (ConfigError, TypeError) as exc:
            raise UntrustedArtifactError(
                f"{where}: its profile is not one this cachesvc builds ({exc})"
            ) from None
        key = BundleKey.of(manifest.checkpoint_digest, options)
        if key.id != manifest.bundle_id or key.backend != manifest.backend:
            raise UntrustedArtifactError(
                f"{where}: its bundle id {manifest.bundle_id} is not the id of its key ({key.id})"
            )
        builder = self.builders.get(options.backend)
        if builder is None:
            raise UntrustedArtifactError(
                f"{where}: it is a {options.backend} bundle and this node has no such backend"
            )
        if options.builder_version != builder.version:
            raise UntrustedArtifactError(
                f"{where}: built by {options.backend} builder {options.builder_version}, "
                f"this node runs {builder.version}"
            )
        if options.cpu_class is not None and options.cpu_class != cpu_class():
            raise UntrustedArtifactError(
                f"{where}: built for CPU class {options.cpu_class}, this node is {cpu_class()}; not pulled"
            )
        here = getattr(builder, "device_arch", None) if options.backend == "tensorrt" else None
        if options.device_arch is not None and options.device_arch != here:
            raise UntrustedArtifactError(
                f"{where}: built for GPU {options.device_arch}, this node has {here or 'none'}; not pulled"
            )
        return key

    def pull_locked(
        self, ref: RegistryRef, *, expected: BundleKey | None = None, model: str | None = None
    ) -> PullResult:
        """Pull the artifact ``ref`` names into the cache; the caller holds the exclusive lock
        of the bundle (``expected``'s, when the caller knows the key: then the artifact must be
        exactly that bundle). ``model``: the catalog row's model (default: the pushing node's)."""
        where = str(ref)
        started = time.monotonic()
        with self.client(ref) as client:
            remote = self.fetch(ref, client)
            key = self.check_fits(remote, where)
            if expected is not None and (key.id, key.checkpoint_digest) != (
                expected.id,
                expected.checkpoint_digest,
            ):
                raise UntrustedArtifactError(f"{where} holds bundle {key.id}, not {expected.id}: refused")
            size = remote.size_bytes
            if size > self.max_size_bytes:
                raise UntrustedArtifactError(
                    f"{where} is {human_size(size)}, over the cache cap of {human_size(self.max_size_bytes)}"
                )
            require_free(self.store.layout.root, size, f"pulling {where}")
            staging = self._resume_dir(key.id) or self.store.new_staging_dir(key.id)
            try:
                reused = self._download(client, ref.repository, remote, staging)
                try:
                    self.store.publish_as(staging, key, remote.manifest)
                except CorruptBundleError as exc:
                    raise UntrustedArtifactError(f"{where}: {exc}") from None
            except RegistryUnavailableError:
                # The registry went away part way: what arrived stays in staging, checked
                # file by file when the next pull resumes it (reconcile removes it otherwise).
                raise
            except BaseException:
                self.store.remove_staging(staging)
                raise
        seconds = time.monotonic() - started
        info = self.catalog.bundles.record_pull(
            key,
            model=model or remote.model,
            size_bytes=size,
            file_count=len(remote.layers),
            seconds=seconds,
            ref=where,
        )
        log.info(
            "pulled bundle %s from %s in %.1fs (%s; %d files resumed)",
            key.id,
            where,
            seconds,
            human_size(size),
            reused,
        )
        return PullResult(
            key.id, where, self.store.layout.root / key.relpath, size, seconds, info, reused=reused
        )

    def _resume_dir(self, bundle_id: str) -> Path | None:
        """A staging directory a killed pull (or build) of ``bundle_id`` left, to resume into;
        the caller holds the bundle's exclusive lock, so nothing writes there any more. Older
        ones go."""
        leftovers = sorted(
            (p for bid, p in self.store.staging_dirs() if bid == bundle_id), key=lambda p: p.stat().st_mtime
        )
        for old in leftovers[:-1]:
            self.store.remove_staging(old)
        return leftovers[-1] if leftovers else None

    def _download(self, client: RegistryClient, repository: str, remote: RemoteBundle, staging: Path) -> int:
        """Stream the layers into ``staging``, ``PARALLEL_LAYERS`` at once; a file already there
        (a resumed pull) with the layer's size and SHA-256 is kept, anything else in ``staging``
        is removed. Returns how many files were kept. The first failure stops the rest (layers
        not started are cancelled) and is raised."""
        root = staging.resolve()
        wanted = {layer.path for layer in remote.layers}
        for rel, _st in walk_entries(staging):
            if rel not in wanted and rel != MANIFEST_NAME:
                (staging / rel).unlink()
        todo: list[tuple[Layer, Path]] = []
        for layer in remote.layers:
            target = staging / layer.path
            target.parent.mkdir(parents=True, exist_ok=True)
            # The path was checked for '..' and absolute parts; resolving guards the rest.
            if not target.parent.resolve().is_relative_to(root):
                raise UntrustedArtifactError(f"layer path {layer.path!r} leaves the bundle: refused")
            if not _holds(target, layer.size, layer.digest):
                target.unlink(missing_ok=True)
                todo.append((layer, target))
        if not todo:
            return len(remote.layers)

        def fetch(layer: Layer, target: Path) -> None:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            with os.fdopen(fd, "wb") as out:
                client.download_blob(repository, layer.digest, layer.size, out)

        with ThreadPoolExecutor(
            max_workers=min(PARALLEL_LAYERS, len(todo)), thread_name_prefix="cachesvc-pull"
        ) as pool:
            futures = [pool.submit(fetch, layer, target) for layer, target in todo]
            try:
                for index, future in enumerate(as_completed(futures)):
                    future.result()
                    if index == 0:
                        crash_point("pull:layer")
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        return len(remote.layers) - len(todo)

    # -- listing -----------------------------------------------------------------------------

    def list_remote(
        self, ref: str | RegistryRef | None = None, *, model: str | None = None
    ) -> list[RemoteEntry]:
        """The bundles the registry holds (their canonical tags), with whether each fits this
        node's class; ``model`` keeps those whose model name contains it."""
        target = self.resolve_ref(ref).namespace
        found: list[RemoteEntry] = []
        here = {"any", f"cpu:{cpu_class()}"}
        for backend, builder in self.builders.items():
            arch = getattr(builder, "device_arch", None) if backend == "tensorrt" else None
            if arch:
                here.add(f"gpu:{arch}")
        with self.client(target) as client:
            for tag in sorted(t for t in client.tags(target.repository) if is_bundle_id(t)):
                # Annotations are the registry's word, shown as they are; a pull checks the
                # artifact itself (``check_fits``) before it trusts any of it.
                try:
                    oci, _ = client.get_manifest(target.repository, tag)
                    check_artifact_type(oci, str(target.with_tag(tag)))
                except UntrustedArtifactError as exc:
                    log.info("registry ls: skipped %s (%s)", tag, exc)
                    continue
                raw_notes = oci.get("annotations")
                notes: dict[str, Any] = raw_notes if isinstance(raw_notes, dict) else {}
                name = str(notes.get(ANN_MODEL, ""))
                if model is not None and model not in name:
                    continue
                raw_layers = oci.get("layers")
                layers: list[Any] = raw_layers if isinstance(raw_layers, list) else []
                size = sum(
                    x["size"] for x in layers if isinstance(x, dict) and isinstance(x.get("size"), int)
                )
                klass = str(notes.get(ANN_CLASS, "any"))
                profile = str(notes.get(ANN_PROFILE, ""))
                found.append(
                    RemoteEntry(tag, name, profile, klass, size, str(target.with_tag(tag)), klass in here)
                )
        return found


def upload(
    client: RegistryClient,
    repository: str,
    artifact: Artifact,
    files_dir: Path,
    tags: tuple[str, ...] | None = None,
) -> tuple[int, int, int, str]:
    """Upload ``artifact`` (its layers read from ``files_dir``; blobs the registry has are
    skipped), its config, then its manifest under ``tags`` (default: the artifact's).
    Returns (blobs uploaded, blobs skipped, bytes uploaded, manifest digest)."""
    uploaded = skipped = nbytes = 0
    for layer in artifact.layers:
        if client.push_blob(repository, layer.digest, layer.size, files_dir / layer.path):
            uploaded, nbytes = uploaded + 1, nbytes + layer.size
        else:
            skipped += 1
    client.push_blob(repository, artifact.config_digest, len(artifact.config), artifact.config)
    digest = ""
    # The manifest goes last: a tag never names an artifact whose blobs are not all there.
    for tag in tags or artifact.tags:
        digest = client.put_manifest(repository, tag, artifact.manifest)
    return uploaded, skipped, nbytes, digest


def _holds(path: Path, size: int, digest: str) -> bool:
    """Whether ``path`` is a regular file (not a symlink) of ``size`` bytes hashing to ``digest``."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return False
    return f"sha256:{sha256_file(path)[1]}" == digest
