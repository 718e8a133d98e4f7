"""The admin guard: ``--admin-api-key`` or, without one, loopback clients only.

Loopback is not enough against a browser on the same machine: any web page can send requests
to ``127.0.0.1``. So, with or without a key, a request from a page on another origin (its
``Origin`` header) is refused with 403, and a body must be ``application/json`` (415
otherwise), which a page cannot send cross-site without a CORS preflight that nothing here
answers. The ``Host`` header is checked app-wide (``--allowed-hosts``) against DNS rebinding.

The completion key (``--api-key``) is deliberately unknown here: it never opens admin routes.
The client address comes from the ASGI scope, never from ``X-Forwarded-For``, so a proxy on
the same machine cannot make remote callers look local; put a key on the server instead.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping

from litestar.connection import ASGIConnection
from litestar.exceptions import HTTPException, NotAuthorizedException, PermissionDeniedException
from litestar.handlers import BaseRouteHandler

from inference.openai.api_keys import any_key_matches
from inference.openai.api_keys import presented_keys as _presented_keys
from inference.openai.body_checks import foreign_origin, has_body, is_json_media_type

Guard = Callable[[ASGIConnection, BaseRouteHandler], None]


def presented_keys(headers: Mapping[str, str]) -> list[str]:
    """Credentials a request carries: ``Authorization: Bearer <key>`` and ``x-api-key: <key>``."""
    return _presented_keys(headers.get("authorization"), headers.get("x-api-key"))


def is_loopback(host: str | None) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback; False for anything else or unknown."""
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def admin_guard(admin_api_key: str | None) -> Guard:
    """A Litestar guard for admin routes and ``/metrics``.

    With a key: the request must carry it (Bearer or ``x-api-key``), else 401. Without a key:
    only loopback clients pass, everyone else gets 403.
    """
    expected = admin_api_key or None

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        _check_browser_rules(connection)
        if expected is None:
            client = connection.client
            if not is_loopback(client.host if client else None):
                raise PermissionDeniedException(
                    detail=(
                        "admin routes answer only loopback clients when the server has no "
                        "--admin-api-key; call from this machine or restart with --admin-api-key"
                    )
                )
            return
        keys = presented_keys(connection.headers)
        if not keys:
            raise NotAuthorizedException(
                detail=(
                    "admin key required: send 'Authorization: Bearer <admin key>' or 'x-api-key: <admin key>'"
                ),
                headers={"WWW-Authenticate": 'Bearer realm="cachesvc-admin"'},
            )
        # Check every presented credential so a client sending its completion key in one
        # header and the admin key in the other still gets in; no early exit leaks timing.
        if not any_key_matches(keys, expected):
            raise NotAuthorizedException(
                detail=(
                    "wrong admin key: admin routes take --admin-api-key "
                    "(the completion key does not open them)"
                ),
                headers={"WWW-Authenticate": 'Bearer realm="cachesvc-admin", error="invalid_token"'},
            )

    return guard


def page_guard() -> Guard:
    """For admin pages that hold no data (the dashboard): no key, only the browser rules.

    A foreign ``Origin`` is refused (403) as on every admin route; the page's data requests
    then pass :func:`admin_guard` like any other client's.
    """

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        _check_browser_rules(connection)

    return guard


def _check_browser_rules(connection: ASGIConnection) -> None:
    """403 for a foreign ``Origin``; 415 for a body that is not declared JSON."""
    origin = foreign_origin(connection.headers, connection.url.scheme)
    if origin is not None:
        raise PermissionDeniedException(
            detail=(
                f"admin routes refuse requests from web pages (Origin {origin!r}); "
                "call them from a script or the CLI"
            )
        )
    if has_body(connection.headers) and not is_json_media_type(connection.headers.get("content-type")):
        raise HTTPException(
            status_code=415,
            detail=(
                f"request bodies must be JSON: send 'Content-Type: application/json' "
                f"(got {connection.headers.get('content-type')!r})"
            ),
        )
