"""The chat page served at ``/`` (``lmserve --no-webui`` turns it off).

The page and its assets are static files of this package, read once when the app is built
and served without the API key: the page itself holds nothing secret, and every API call
it makes sends the key the user typed (see docs/webui.md).
"""

from __future__ import annotations

from importlib import resources
from typing import Any

from litestar import Response, get
from litestar.exceptions import NotFoundException
from litestar.types import ControllerRouterHandler

# name under /webui/ -> media type; index.html is served at /
ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# The page loads its own scripts and styles and calls this server's API, nothing else.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
HEADERS = {
    "cache-control": "no-cache",
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}


def load_assets() -> dict[str, bytes]:
    folder = resources.files(__name__)
    return {name: folder.joinpath(name).read_bytes() for name in ASSETS}


def routes() -> list[ControllerRouterHandler]:
    """``GET /`` (the page) and ``GET /webui/{name}`` (its scripts and styles), public."""
    assets = load_assets()

    def reply(name: str) -> Response[bytes]:
        return Response(assets[name], media_type=ASSETS[name], headers=HEADERS)

    @get("/", opt={"public": True}, include_in_schema=False, sync_to_thread=False)
    def page() -> Response[bytes]:
        return reply("index.html")

    @get("/webui/{name:str}", opt={"public": True}, include_in_schema=False, sync_to_thread=False)
    def asset(name: str) -> Response[bytes]:
        if name not in assets or name == "index.html":
            raise NotFoundException()
        return reply(name)

    handlers: list[Any] = [page, asset]
    return handlers
