"""Request-body hygiene shared by every JSON surface (``/v1`` here, the admin API in cachesvc).

Each surface raises its own error type from these answers, so the mapping to HTTP stays in one
place per surface:

- a body must be declared ``application/json`` (or ``application/<x>+json``): a browser can
  send ``text/plain``, ``multipart/form-data`` and ``application/x-www-form-urlencoded``
  cross-site without a CORS preflight, JSON it cannot, so this closes the CSRF path;
- a request from a browser page on another origin carries that ``Origin``;
- JSON nesting is bounded: msgspec (like any recursive parser) gives up with ``RecursionError``
  near the interpreter's recursion limit, which must be a 400, not a 500, and nothing we accept
  is more than a few levels deep.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

import msgspec

__all__ = [
    "LARGE_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "foreign_origin",
    "has_body",
    "is_json_media_type",
    "json_nesting_error",
]

#: Deepest nesting of arrays/objects accepted in a request body (tool schemas need a dozen).
MAX_JSON_DEPTH = 64


def has_body(headers: Mapping[str, str]) -> bool:
    """True when the request announces a non-empty body (length or chunked transfer)."""
    length = headers.get("content-length")
    if length is not None:
        return length.strip() not in ("", "0")
    return "transfer-encoding" in headers


def is_json_media_type(content_type: str | None) -> bool:
    """True for ``application/json`` and ``application/<subtype>+json`` (parameters ignored)."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    if not media.startswith("application/"):
        return False
    subtype = media.removeprefix("application/")
    return subtype == "json" or subtype.endswith("+json")


def foreign_origin(headers: Mapping[str, str], scheme: str) -> str | None:
    """The ``Origin`` a request carries when it is not this server's own origin, else None.

    Browsers send ``Origin`` on every cross-origin request (and on same-origin POSTs); a
    client outside a browser usually sends none. Same origin means the same scheme and the same
    ``host[:port]`` as the ``Host`` header (which the allowed-hosts check has vetted). An opaque
    origin (``null``, from sandboxed frames and ``file:`` pages) is foreign.
    """
    origin = headers.get("origin")
    if origin is None:
        return None
    parts = urlsplit(origin.strip())
    host = headers.get("host", "")
    if parts.scheme == scheme and parts.netloc and parts.netloc.lower() == host.strip().lower():
        return None
    return origin


#: Bodies larger than this are checked in a worker thread, off the event loop.
LARGE_BODY_BYTES = 64 * 1024


def json_nesting_error(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> str | None:
    """A message when ``body`` is JSON nested deeper than ``max_depth``, else None.

    Invalid JSON is not judged here (None): the surface's own parser reports it with its message.
    """
    too_deep = f"the JSON body is nested more than {max_depth} levels deep"
    try:
        value = msgspec.json.decode(body)
    except RecursionError:
        return too_deep
    except msgspec.DecodeError:
        return None
    # Iterative walk: the check itself must not recurse.
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth + 1 > max_depth:
            return too_deep
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return None
