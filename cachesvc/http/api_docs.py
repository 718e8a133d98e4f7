"""The OpenAPI viewers, from our own origin: Swagger UI (``/schema/swagger``) and ReDoc
(``/schema/redoc``) next to the JSON (``/schema``, ``/schema/openapi.json``).

Litestar's render plugins load the viewers' scripts from CDNs (a blank page offline, and a
third party learns who reads the docs); here they load them from ``/schema/assets/``, served
from the files the ``openapi-ui-bundles`` package ships (Swagger UI 5, which renders OpenAPI
3.1; ReDoc 2), and the Content-Security-Policy of every ``/schema`` response lets a browser
load nothing from anywhere else. Everything under ``/schema`` sits behind one guard: with
``--admin-api-key`` the pages and their assets need that key, like the JSON.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Annotated

from litestar import Response, get
from litestar.datastructures import ResponseHeader
from litestar.exceptions import NotFoundException
from litestar.openapi.plugins import (
    JsonRenderPlugin,
    OpenAPIRenderPlugin,
    RedocRenderPlugin,
    SwaggerRenderPlugin,
)
from litestar.params import PathParameter
from openapi_ui_bundles import redoc, swagger_ui

#: Where the viewers' files are served (under the ``/schema`` router).
ASSETS = "/schema/assets"
_FILES: dict[str, tuple[Path, str]] = {
    "swagger-ui-bundle.js": (swagger_ui.static_path, "text/javascript"),
    "swagger-ui-standalone-preset.js": (swagger_ui.static_path, "text/javascript"),
    "swagger-ui.css": (swagger_ui.static_path, "text/css"),
    "favicon-32x32.png": (swagger_ui.static_path, "image/png"),
    "redoc.standalone.js": (redoc.static_path, "text/javascript"),
}
_FAVICON = f"<link rel='icon' type='image/png' href='{ASSETS}/favicon-32x32.png'>"
#: The pages' own inline script (the spec) and the viewers' inline styles are allowed; no other
#: origin is (ReDoc renders in a worker started from a blob: URL).
CSP = (
    "default-src 'none'; script-src 'self' 'unsafe-inline'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; connect-src 'self'; worker-src 'self' blob:; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
RESPONSE_HEADERS = [
    ResponseHeader(name="Content-Security-Policy", value=CSP),
    ResponseHeader(name="X-Content-Type-Options", value="nosniff"),
]


def render_plugins() -> list[OpenAPIRenderPlugin]:
    """The JSON first (what ``/schema`` answers), then the two viewers on local assets."""
    return [
        JsonRenderPlugin(),
        SwaggerRenderPlugin(
            js_url=f"{ASSETS}/swagger-ui-bundle.js",
            css_url=f"{ASSETS}/swagger-ui.css",
            standalone_preset_js_url=f"{ASSETS}/swagger-ui-standalone-preset.js",
            favicon=_FAVICON,
        ),
        RedocRenderPlugin(js_url=f"{ASSETS}/redoc.standalone.js", google_fonts=False, favicon=_FAVICON),
    ]


@functools.cache
def _read(name: str) -> bytes:
    folder, _ = _FILES[name]
    return (folder / name).read_bytes()


@get("/assets/{name:str}", include_in_schema=False, sync_to_thread=True)
def docs_asset(
    name: Annotated[str, PathParameter(pattern=r"^[a-z0-9.-]+$")],
) -> Response[bytes]:
    """One file of the viewers (a fixed list; nothing else is served from here)."""
    if name not in _FILES:
        raise NotFoundException(f"no OpenAPI viewer asset {name!r}")
    return Response(_read(name), media_type=_FILES[name][1], headers={"Cache-Control": "max-age=86400"})
