"""Where a request's images may come from: inline ``data:`` URLs always; ``file://`` URLs under
the directory the server is told (``--allowed-local-media-path``); ``http(s)`` URLs of the hosts it
is told (``--allowed-media-domains``), fetched with limits on size, time and redirects.

A ``file://`` path is resolved with its symlinks before the containment check, so a link inside
the directory that points out of it is refused. A fetched URL's redirects must stay on allowed
hosts. Every refusal is an :class:`~inference.images.decode.ImageInputError` (the caller's 400
names the request field). Reading and fetching run in the worker thread that decodes the image.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from inference.images.decode import MAX_IMAGE_BYTES, ImageInputError, check_data_url, data_url_bytes

if TYPE_CHECKING:  # httpx is imported where a fetch runs, not at server start
    import httpx

#: Seconds a fetch may take (connect and each read), and how many redirects it follows.
FETCH_TIMEOUT = 10.0
MAX_REDIRECTS = 3


@dataclass(frozen=True)
class MediaPolicy:
    """What a server reads images from besides ``data:`` URLs: files under ``local_root``, and
    ``http(s)`` URLs of ``domains`` (host names, exact; empty: none)."""

    local_root: Path | None = None
    domains: tuple[str, ...] = ()
    timeout: float = FETCH_TIMEOUT
    max_redirects: int = MAX_REDIRECTS
    max_bytes: int = MAX_IMAGE_BYTES


def _scheme(url: str) -> str:
    return url.split(":", 1)[0].lower() if ":" in url else ""


def check_url(url: str, policy: MediaPolicy) -> None:
    """Refuse, before reading anything (cheap: on the event loop), a URL this server does not read:
    an unknown scheme, a ``file://`` outside the allowed directory, a host not allowed, a ``data:``
    URL whose header or size is wrong."""
    scheme = _scheme(url)
    if scheme == "file":
        _local_path(url, policy)
    elif scheme in ("http", "https"):
        _check_host(url, policy)
    else:
        check_data_url(url)


def read_url(url: str, policy: MediaPolicy) -> bytes:
    """The bytes of an image URL (:func:`check_url` rules, then the size cap while reading)."""
    scheme = _scheme(url)
    if scheme == "file":
        path = _local_path(url, policy)
        size = path.stat().st_size
        if size > policy.max_bytes:
            raise _too_big(f"a file of {size} bytes", policy)
        return path.read_bytes()
    if scheme in ("http", "https"):
        return _fetch(url, policy)
    return data_url_bytes(url)


def _local_path(url: str, policy: MediaPolicy) -> Path:
    if policy.local_root is None:
        raise ImageInputError("is a file:// URL; this server reads no local files (start it with "
                              "--allowed-local-media-path DIR): send the image as a data: URL")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ImageInputError(f"names the host {parts.netloc!r}; a file:// URL must be file:///absolute/path")
    root = policy.local_root.resolve()
    try:
        path = Path(urllib.parse.unquote(parts.path)).resolve(strict=True)
    except (OSError, RuntimeError):
        raise ImageInputError("names a file that does not exist (or cannot be read)") from None
    if not path.is_relative_to(root):
        raise ImageInputError(f"is outside the allowed media directory {str(policy.local_root)!r} (symlinks "
                              "are followed before the check)")
    if not path.is_file():
        raise ImageInputError("is not a regular file")
    return path


def _check_host(url: str, policy: MediaPolicy) -> None:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if not policy.domains:
        raise ImageInputError("is an http(s) URL; this server fetches none (start it with "
                              "--allowed-media-domains HOSTS): send the image as a data: URL")
    if host not in policy.domains:
        raise ImageInputError(f"is on host {host!r}, which this server does not fetch from (allowed: "
                              f"{', '.join(policy.domains)})")


def _too_big(what: str, policy: MediaPolicy) -> ImageInputError:
    return ImageInputError(f"is {what}; images are accepted up to {policy.max_bytes} bytes")


def _fetch(url: str, policy: MediaPolicy) -> bytes:
    import httpx

    with httpx.Client(timeout=policy.timeout, follow_redirects=False) as client:
        for _ in range(policy.max_redirects + 1):
            _check_host(url, policy)  # the first URL and every redirect's
            try:
                with client.stream("GET", url) as response:
                    if response.is_redirect:
                        url = str(httpx.URL(url).join(response.headers.get("location", "")))
                        continue
                    return _body(response, policy)
            except httpx.TimeoutException:
                raise ImageInputError(f"could not be fetched within {policy.timeout:g} s") from None
            except httpx.HTTPError as exc:
                raise ImageInputError(f"could not be fetched: {type(exc).__name__}") from None
    raise ImageInputError(f"redirects more than {policy.max_redirects} times")


def _body(response: httpx.Response, policy: MediaPolicy) -> bytes:
    """A fetched image's bytes, refused past the size cap (by its header, then while reading)."""
    if response.status_code != 200:
        raise ImageInputError(f"could not be fetched: the server answered HTTP {response.status_code}")
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > policy.max_bytes:
        raise _too_big(f"{declared} bytes", policy)
    data = bytearray()
    for chunk in response.iter_bytes():
        data += chunk
        if len(data) > policy.max_bytes:
            raise _too_big(f"more than {policy.max_bytes} bytes", policy)
    return bytes(data)
