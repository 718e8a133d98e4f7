"""Registry references: ``oci://host[:port]/namespace[:tag]`` parsed and checked.

The namespace is the OCI repository every bundle goes into (its canonical tag is the bundle id,
see :mod:`cachesvc.cache.registry.artifact`); a tag after the last ``:`` names one artifact (pull by
reference). Every refusal is a one-line :class:`~cachesvc.errors.ConfigError` naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cachesvc.errors import ConfigError

SCHEME = "oci://"
# The distribution spec's grammar for repository names and tags.
_REPO_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*$")
TAG_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")
_HOST = re.compile(
    r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
_IPV6 = re.compile(r"^\[[0-9A-Fa-f:.]+\]$")
_MAX_REPO = 255


@dataclass(frozen=True)
class RegistryRef:
    """Where bundles live: a registry host (``host`` or ``host:port``), a repository, and
    optionally one tag."""

    host: str
    repository: str
    tag: str | None = None

    def __str__(self) -> str:
        tail = f":{self.tag}" if self.tag else ""
        return f"{SCHEME}{self.host}/{self.repository}{tail}"

    def with_tag(self, tag: str) -> RegistryRef:
        """The same repository, artifact ``tag``."""
        check_tag(tag)
        return RegistryRef(self.host, self.repository, tag)

    @property
    def namespace(self) -> RegistryRef:
        """The repository without a tag."""
        return RegistryRef(self.host, self.repository)


def parse_ref(text: str, *, field: str = "registry", allow_tag: bool = True) -> RegistryRef:
    """Parse ``oci://host[:port]/namespace[:tag]``; ConfigError (naming ``field``) otherwise."""
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(field, "must be a registry reference oci://host[:port]/namespace, got nothing")
    value = text.strip()
    if not value.startswith(SCHEME):
        raise ConfigError(field, f"must start with {SCHEME} (oci://host[:port]/namespace), got {value!r}")
    rest = value[len(SCHEME) :]
    host, slash, path = rest.partition("/")
    if not slash or not path:
        raise ConfigError(
            field, f"names no namespace after the host (oci://host[:port]/namespace), got {value!r}"
        )
    _check_host(host, field, value)
    tag: str | None = None
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        if not allow_tag:
            raise ConfigError(field, f"must name a namespace, not a tag, got {value!r}")
        path, _, tag = path.rpartition(":")
        if not TAG_RE.match(tag):
            raise ConfigError(
                field, f"tag {tag!r} is not a valid OCI tag ([A-Za-z0-9_][A-Za-z0-9._-]{{0,127}})"
            )
    path = path.rstrip("/")
    if not path or len(path) > _MAX_REPO or not all(_REPO_COMPONENT.match(p) for p in path.split("/")):
        raise ConfigError(
            field,
            f"namespace {path!r} is not a valid OCI repository name (lowercase letters, digits and "
            "separators . _ - between them, components joined by /)",
        )
    return RegistryRef(host, path, tag)


def check_tag(tag: str) -> str:
    """``tag`` when it fits the OCI tag grammar; ConfigError otherwise."""
    if not TAG_RE.match(tag):
        raise ConfigError("tag", f"{tag!r} is not a valid OCI tag ([A-Za-z0-9_][A-Za-z0-9._-]{{0,127}})")
    return tag


def _check_host(host: str, field: str, value: str) -> None:
    name, port = host, None
    if host.startswith("["):
        name, _, after = host.partition("]")
        name += "]"
        if after:
            if not after.startswith(":"):
                raise ConfigError(field, f"host {host!r} is not host[:port], in {value!r}")
            port = after[1:]
    elif ":" in host:
        name, _, port = host.partition(":")
    if not name or not (_HOST.match(name) or _IPV6.match(name)):
        raise ConfigError(field, f"host {name!r} is not a host name or address, in {value!r}")
    if port is not None and not (port.isdigit() and 1 <= int(port) <= 65535):
        raise ConfigError(field, f"port {port!r} is not a TCP port (1..65535), in {value!r}")
