"""The few calls of the OCI distribution protocol that bundles need, over httpx.

Why not the ``oras`` SDK: measured against the CNCF registry (docs/registry.md), its
``Registry.do_request`` retries every failed request five times with sleeps of 3 to 83 seconds
(an unreachable registry answers after minutes, where a cache miss must fall back to a local
build at once), its token backend cannot answer a plain ``Basic`` challenge (htpasswd), its
monolithic upload reads the whole blob into memory and it sets no timeouts. The protocol part
we need is small: this module.

Credentials come from the Docker config file the ecosystem writes (``docker login``, ``oras
login``): ``$DOCKER_CONFIG/config.json`` or ``~/.docker/config.json``, else
``$REGISTRY_AUTH_FILE`` (podman, skopeo); inline ``auth`` entries only (credential helpers are
not run). TLS by default; plain HTTP only with ``insecure``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from cachesvc.cache.registry.reference import RegistryRef
from cachesvc.errors import (
    RegistryAuthError,
    RegistryError,
    RegistryNotFoundError,
    RegistryUnavailableError,
    UntrustedArtifactError,
)

MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
#: The largest manifest or config blob read into memory (a bundle's has a few hundred files).
MAX_DOCUMENT_BYTES = 4 * 1024 * 1024
_CHUNK = 1024 * 1024
_CHALLENGE_PARAM = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class Credentials:
    """A user name and password (or token) for basic auth and token requests."""

    username: str
    password: str

    @property
    def basic(self) -> str:
        raw = f"{self.username}:{self.password}".encode()
        return "Basic " + base64.b64encode(raw).decode()

    def __repr__(self) -> str:
        return f"Credentials(username={self.username!r}, password='***')"


def docker_config_credentials(host: str, env: Mapping[str, str] | None = None) -> Credentials | None:
    """The credentials the Docker config file (or ``REGISTRY_AUTH_FILE``) holds for ``host``;
    ``env`` stands in for the environment (tests)."""
    if env is None:
        env = {
            "DOCKER_CONFIG": os.environ.get("DOCKER_CONFIG", ""),
            "REGISTRY_AUTH_FILE": os.environ.get("REGISTRY_AUTH_FILE", ""),
            "HOME": os.environ.get("HOME", ""),
        }
    candidates = []
    if env.get("DOCKER_CONFIG"):
        candidates.append(Path(env["DOCKER_CONFIG"]) / "config.json")
    candidates.append(Path(env.get("HOME") or str(Path.home())) / ".docker" / "config.json")
    if env.get("REGISTRY_AUTH_FILE"):
        candidates.append(Path(env["REGISTRY_AUTH_FILE"]))
    for path in candidates:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        auths = data.get("auths") if isinstance(data, dict) else None
        if not isinstance(auths, dict):
            continue
        for key in (host, f"https://{host}", f"http://{host}"):
            entry = auths.get(key)
            if isinstance(entry, dict):
                found = _entry_credentials(entry)
                if found is not None:
                    return found
    return None


def _entry_credentials(entry: dict[str, Any]) -> Credentials | None:
    if isinstance(entry.get("auth"), str) and entry["auth"]:
        try:
            user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
        except ValueError:
            return None
        return Credentials(user, password)
    if isinstance(entry.get("username"), str) and isinstance(entry.get("password"), str):
        return Credentials(entry["username"], entry["password"])
    return None


class RegistryClient:
    """One registry host; every method names its repository. Errors are the RegistryError
    family, one line each, naming the registry and what to do."""

    def __init__(
        self,
        host: str,
        *,
        insecure: bool = False,
        credentials: Credentials | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.host = host
        scheme = "http" if insecure else "https"
        self.credentials = credentials if credentials is not None else docker_config_credentials(host)
        self._http = httpx.Client(
            base_url=f"{scheme}://{host}",
            timeout=httpx.Timeout(timeout, connect=min(timeout, 5.0)),
            follow_redirects=True,
        )
        self._auth: dict[str, str] = {}

    @classmethod
    def for_ref(cls, ref: RegistryRef, *, insecure: bool = False, timeout: float = 30.0) -> RegistryClient:
        """A client for ``ref``'s host."""
        return cls(ref.host, insecure=insecure, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests ----------------------------------------------------------------------------

    def _send(
        self, method: str, url: str, *, scope: str, stream: bool = False, **kwargs: Any
    ) -> httpx.Response:
        """One request, answering one auth challenge (Basic, or a Bearer token for ``scope``);
        the status is not checked. A streamed body is sent once: the upload's ``POST`` has
        already answered the challenge of its scope."""
        headers = dict(kwargs.pop("headers", {}) or {})
        for attempt in range(2):
            if scope in self._auth:
                headers["Authorization"] = self._auth[scope]
            try:
                request = self._http.build_request(method, url, headers=headers, **kwargs)
                response = self._http.send(request, stream=stream)
            except httpx.TimeoutException as exc:
                raise RegistryUnavailableError(
                    f"registry {self.host} timed out ({type(exc).__name__})"
                ) from exc
            except httpx.TransportError as exc:
                raise RegistryUnavailableError(
                    f"registry {self.host} is unreachable: {_reason(exc)}"
                ) from exc
            if response.status_code != 401 or attempt == 1:
                return response
            response.close()
            self._authenticate(response, scope)
        raise AssertionError("unreachable")

    def _request(self, method: str, url: str, *, scope: str, **kwargs: Any) -> httpx.Response:
        """One request, read whole, its status checked."""
        return self._check_status(self._send(method, url, scope=scope, **kwargs), method, url)

    def _authenticate(self, response: httpx.Response, scope: str) -> None:
        challenge = response.headers.get("www-authenticate", "")
        kind = challenge.split(" ", 1)[0].lower()
        if self.credentials is None and kind == "basic":
            raise RegistryAuthError(
                f"registry {self.host} wants credentials (401); log in with `docker login {self.host}` "
                "(the Docker config file) or set REGISTRY_AUTH_FILE"
            )
        if kind == "basic":
            assert self.credentials is not None
            self._auth[scope] = self.credentials.basic
            return
        if kind != "bearer":
            raise RegistryAuthError(
                f"registry {self.host} asks for {kind or 'unknown'} auth, which cachesvc does not speak"
            )
        params = dict(_CHALLENGE_PARAM.findall(challenge))
        realm = params.pop("realm", "")
        if not realm.startswith(("http://", "https://")):
            raise RegistryAuthError(f"registry {self.host} sent a token challenge without a realm URL")
        params.setdefault("scope", scope)
        headers = {"Authorization": self.credentials.basic} if self.credentials else {}
        try:
            answer = self._http.get(realm, params=params, headers=headers)
        except httpx.TransportError as exc:
            raise RegistryUnavailableError(
                f"token service of {self.host} is unreachable: {_reason(exc)}"
            ) from exc
        if answer.status_code != 200:
            raise RegistryAuthError(
                f"registry {self.host} refused a token ({answer.status_code}); check the credentials"
            )
        try:
            body = answer.json()
            token = body.get("token") or body.get("access_token")
        except ValueError:
            token = None
        if not isinstance(token, str) or not token:
            raise RegistryAuthError(f"registry {self.host} sent no token")
        self._auth[scope] = f"Bearer {token}"

    def _check_status(self, response: httpx.Response, method: str, url: str) -> httpx.Response:
        code = response.status_code
        if code < 400 or (code == 404 and method == "HEAD"):
            return response
        detail = _registry_message(response)
        if code in (401, 403):
            raise RegistryAuthError(
                f"registry {self.host} refused {method} {url} ({code}{detail}); check the credentials "
                "in the Docker config file"
            )
        if code == 404:
            raise RegistryNotFoundError(f"registry {self.host} has no {url} (404{detail})")
        if code >= 500:
            raise RegistryUnavailableError(f"registry {self.host} failed {method} {url} ({code}{detail})")
        raise RegistryError(f"registry {self.host} refused {method} {url} ({code}{detail})")

    # -- manifests -----------------------------------------------------------------------------

    def get_manifest(self, repository: str, reference: str) -> tuple[dict[str, Any], str]:
        """The image manifest under ``reference`` (tag or digest) and its digest; at most
        ``MAX_DOCUMENT_BYTES`` are read, and a digest reference must match what came."""
        url = f"/v2/{repository}/manifests/{reference}"
        with self._stream("GET", url, scope=_pull(repository), headers={"Accept": MANIFEST_MEDIA_TYPE}) as r:
            data = _read_capped(r, MAX_DOCUMENT_BYTES, f"the manifest {repository}:{reference}")
            media = r.headers.get("content-type", "").split(";")[0].strip()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if reference.startswith("sha256:") and reference != digest:
            raise UntrustedArtifactError(
                f"registry {self.host} sent a manifest whose digest is not {reference}"
            )
        try:
            manifest = json.loads(data)
        except ValueError as exc:
            raise UntrustedArtifactError(
                f"registry {self.host}: manifest {repository}:{reference} is not JSON"
            ) from exc
        if not isinstance(manifest, dict):
            raise UntrustedArtifactError(
                f"registry {self.host}: manifest {repository}:{reference} is not an object"
            )
        if media and media != MANIFEST_MEDIA_TYPE and manifest.get("mediaType") != MANIFEST_MEDIA_TYPE:
            raise UntrustedArtifactError(
                f"{repository}:{reference} is a {media}, not an OCI image manifest of a cachesvc bundle"
            )
        return manifest, digest

    def put_manifest(self, repository: str, tag: str, body: bytes) -> str:
        """Store ``body`` (an OCI image manifest) under ``tag``; returns its digest."""
        self._request(
            "PUT",
            f"/v2/{repository}/manifests/{tag}",
            scope=_push(repository),
            content=body,
            headers={"Content-Type": MANIFEST_MEDIA_TYPE},
        )
        return "sha256:" + hashlib.sha256(body).hexdigest()

    def tags(self, repository: str) -> list[str]:
        """Every tag of ``repository`` (empty when it does not exist), following pagination."""
        found: list[str] = []
        url: str | None = f"/v2/{repository}/tags/list?n=1000"
        while url:
            try:
                r = self._request("GET", url, scope=_pull(repository))
            except RegistryNotFoundError:
                return found
            try:
                found.extend(t for t in (r.json().get("tags") or []) if isinstance(t, str))
            except (ValueError, AttributeError) as exc:
                raise RegistryError(f"registry {self.host} sent a tag list that is not JSON") from exc
            url = _next_link(r.headers.get("link", ""))
        return found

    # -- blobs ------------------------------------------------------------------------------

    def blob_exists(self, repository: str, digest: str) -> bool:
        """Whether the repository holds the blob (HEAD)."""
        r = self._request("HEAD", f"/v2/{repository}/blobs/{digest}", scope=_push(repository))
        return r.status_code == 200

    def push_blob(self, repository: str, digest: str, size: int, source: Path | bytes) -> bool:
        """Upload one blob unless the registry has it; True when it was uploaded. A file is
        streamed (1 MiB reads), never read whole."""
        if self.blob_exists(repository, digest):
            return False
        start = self._request(
            "POST",
            f"/v2/{repository}/blobs/uploads/",
            scope=_push(repository),
            headers={"Content-Length": "0"},
        )
        location = start.headers.get("location")
        if not location:
            raise RegistryError(f"registry {self.host} started an upload without a Location")
        sep = "&" if "?" in location else "?"
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        if isinstance(source, bytes):
            self._request(
                "PUT",
                f"{location}{sep}digest={digest}",
                scope=_push(repository),
                content=source,
                headers=headers,
            )
            return True
        with open(source, "rb") as fh:
            self._request(
                "PUT",
                f"{location}{sep}digest={digest}",
                scope=_push(repository),
                content=_file_chunks(fh),
                headers=headers,
            )
        return True

    def read_blob(self, repository: str, digest: str, limit: int) -> bytes:
        """A small blob (a config) read whole, at most ``limit`` bytes, its digest checked."""
        with self._stream("GET", f"/v2/{repository}/blobs/{digest}", scope=_pull(repository)) as r:
            data = _read_capped(r, limit, f"blob {digest}")
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            raise UntrustedArtifactError(f"registry {self.host} sent blob {digest} with other content")
        return data

    def download_blob(self, repository: str, digest: str, size: int, out: BinaryIO) -> None:
        """Stream the blob into ``out``, checking its size while reading and its digest at the
        end (UntrustedArtifactError on any difference; ``out`` then holds garbage)."""
        sha = hashlib.sha256()
        got = 0
        with self._stream("GET", f"/v2/{repository}/blobs/{digest}", scope=_pull(repository)) as r:
            for chunk in r.iter_bytes(_CHUNK):
                got += len(chunk)
                if got > size:
                    raise UntrustedArtifactError(
                        f"blob {digest} is larger than the {size} bytes its manifest says"
                    )
                sha.update(chunk)
                out.write(chunk)
        if got != size:
            raise UntrustedArtifactError(f"blob {digest} has {got} bytes, its manifest says {size}")
        if "sha256:" + sha.hexdigest() != digest:
            raise UntrustedArtifactError(f"blob {digest} does not match its digest: refused")

    @contextmanager
    def _stream(
        self, method: str, url: str, *, scope: str, headers: dict[str, str] | None = None
    ) -> Iterator[httpx.Response]:
        """A streamed response, after the auth handshake and the status checks."""
        response = self._send(method, url, scope=scope, stream=True, headers=headers)
        try:
            if response.status_code >= 400:
                response.read()
            yield self._check_status(response, method, url)
        finally:
            response.close()


def _pull(repository: str) -> str:
    return f"repository:{repository}:pull"


def _push(repository: str) -> str:
    return f"repository:{repository}:pull,push"


def _file_chunks(fh: BinaryIO) -> Iterator[bytes]:
    while chunk := fh.read(_CHUNK):
        yield chunk


def _read_capped(response: httpx.Response, limit: int, what: str) -> bytes:
    declared = response.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise UntrustedArtifactError(f"{what} is {declared} bytes, over the {limit} cachesvc reads")
    data = bytearray()
    for chunk in response.iter_bytes(_CHUNK):
        data += chunk
        if len(data) > limit:
            raise UntrustedArtifactError(f"{what} is over the {limit} bytes cachesvc reads")
    return bytes(data)


def _registry_message(response: httpx.Response) -> str:
    try:
        errors = response.json().get("errors") or []
        first = errors[0]
        text = str(first.get("message") or first.get("code") or "")
    except (ValueError, AttributeError, IndexError, TypeError, httpx.ResponseNotRead):
        return ""
    return f": {text[:200]}" if text else ""


def _reason(exc: Exception) -> str:
    text = str(exc) or type(exc).__name__
    if "refused" in text.lower():
        return "connection refused"
    if "SSL" in text or "TLS" in text:
        return f"TLS failed ({text.splitlines()[0][:120]}); a plain-HTTP registry needs --registry-insecure"
    return text.splitlines()[0][:200]


def _next_link(header: str) -> str | None:
    match = re.search(r"<([^>]+)>;\s*rel=\"?next\"?", header)
    return match.group(1) if match else None
