"""``GET /admin/dashboard``: a self-contained page (HTML, JS, CSS served by the app).

The page holds no data: it draws everything from the JSON admin API (``/admin/nodes``,
``/admin/stats``, ``/admin/events``, ``/admin/bundles``) with inline SVG and refreshes itself.
So it is served without the admin guard (a browser cannot attach the admin key to a page load);
every data request it makes passes the guard, with the key the operator types in when the
server has one. The Content-Security-Policy allows nothing but this origin: no external network.
"""

from __future__ import annotations

from importlib import resources
from typing import Annotated

from litestar import Response, Router, get
from litestar.exceptions import NotFoundException
from litestar.params import PathParameter

from cachesvc.http.auth import page_guard
from cachesvc.http.errors import admin_exception_handlers

_ASSETS = {
    "dashboard.js": "text/javascript",
    "dashboard.css": "text/css",
}
_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def _read(name: str) -> bytes:
    return resources.files(__package__).joinpath(name).read_bytes()


@get("/", media_type="text/html", summary="Cache dashboard (HTML page)", tags=["dashboard"])
async def dashboard_page() -> Response[bytes]:
    """The dashboard page; it loads its script and style from ``/admin/dashboard/assets``."""
    return Response(_read("index.html"), media_type="text/html", headers=_HEADERS)


@get("/assets/{name:str}", include_in_schema=False)
async def dashboard_asset(
    name: Annotated[str, PathParameter(pattern=r"^[a-z]+\.(js|css)$")],
) -> Response[bytes]:
    """One of the page's own assets (a fixed list; nothing else is served from here)."""
    media_type = _ASSETS.get(name)
    if media_type is None:
        raise NotFoundException(f"no dashboard asset {name!r}")
    return Response(_read(name), media_type=media_type, headers=_HEADERS)


def dashboard_router() -> Router:
    """Mounted at ``/admin/dashboard`` by the app: no key needed, foreign Origins refused."""
    return Router(
        path="/admin/dashboard",
        route_handlers=[dashboard_page, dashboard_asset],
        guards=[page_guard()],
        exception_handlers=admin_exception_handlers(),
    )
