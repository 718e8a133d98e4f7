"""Request-body hygiene shared by every JSON surface (``/v1`` here, the admin API in cachesvc).

Each surface raises its own error type from these answers, so the mapping to HTTP stays in one
place per surface:

- a body must be declared ``application/json`` (or ``application/<x>+json``): a browser can
  send ``text/plain``, ``multipart/form-data`` and ``application/x-www-form-urlencoded``
  cross-site without a CORS preflight, JSON it cannot, so this closes the CSRF path;
- a request from a browser page on another origin carries that ``Origin``;
- JSON nesting is bounded: msgspec (like any recursive parser) gives up with ``RecursionError``
  near the interpreter's recursion limit, which must be a 400, not a 500, and nothing we accept
  is more than a few levels deep;
- text must be Unicode that UTF-8 can hold: bytes that are not UTF-8, and a ``\\uD800``-``\\uDFFF``
  escape that is not half of a pair, are named with where they are (msgspec reports a lone
  high surrogate as "Input data was truncated", and neither case with its field).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

__all__ = [
    "LARGE_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "BodyProblem",
    "foreign_origin",
    "has_body",
    "is_json_media_type",
    "json_body_problem",
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


@dataclass(frozen=True)
class BodyProblem:
    """Why a request body is refused before its fields are read: one line, and the JSON path of
    the field at fault (``input[1]``, as msgspec writes paths) when one is."""

    message: str
    path: str | None = None


def json_body_problem(body: bytes, max_depth: int = MAX_JSON_DEPTH) -> BodyProblem | None:
    """A problem when ``body`` is JSON nested deeper than ``max_depth`` or text that is not valid
    Unicode (see the module docstring), else None.

    Other invalid JSON is not judged here (None): the surface's own parser reports it.
    """
    too_deep = BodyProblem(
        f"the JSON body is nested more than {max_depth} levels deep; send a flat JSON object"
    )
    try:
        value = msgspec.json.decode(body)
    except RecursionError:
        return too_deep
    except msgspec.DecodeError:
        return _text_problem(body)
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


def _unpaired_surrogate(text: str) -> int | None:
    return next((i for i, ch in enumerate(text) if "\ud800" <= ch <= "\udfff"), None)


def _surrogate_problem(where: str, text: str, at: int, path: str) -> BodyProblem:
    # The message shows the surrogate as an escape: the character itself cannot be sent back.
    return BodyProblem(
        f"{where}, character {at}: \\u{ord(text[at]):04x} is an unpaired UTF-16 surrogate, not valid "
        "Unicode text; a \\ud800-\\udfff escape must be half of a pair (high, then low)",
        path or None,
    )


def _text_problem(body: bytes) -> BodyProblem | None:
    """Bytes that are not UTF-8 (their offset), or the first string holding an unpaired surrogate
    (its path and character index); None when the body's fault is something else."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return BodyProblem(
            f"the body is not valid UTF-8: byte {exc.start} (0x{body[exc.start]:02x}) cannot start or "
            "continue a character; send JSON encoded as UTF-8"
        )
    try:
        # Python's parser keeps a lone surrogate escape as a code point (msgspec refuses it); a
        # valid pair becomes one character, so every surrogate left in a string is unpaired.
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[Any, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            at = _unpaired_surrogate(item)
            if at is not None:
                return _surrogate_problem(path or "the body", item, at, path)
        elif isinstance(item, dict):
            for key in item:
                at = _unpaired_surrogate(key)
                if at is not None:
                    return _surrogate_problem(f"a key of {path or 'the body'}", key, at, path)
            children = [(v, f"{path}.{k}" if path else k) for k, v in item.items()]
            stack.extend(reversed(children))  # the first fault in the document is the one named
        elif isinstance(item, list):
            stack.extend(reversed([(v, f"{path}[{i}]") for i, v in enumerate(item)]))
    return None
