"""The dashboard's static shell: `/` and `/static/<name>`, open to anyone.

The shell holds no data: the page asks for the user token once and reads everything
from the token-protected JSON routes. Only the files shipped in service/static/ are
served, looked up by exact name in a table built at start-up, so no request path
ever reaches the filesystem (no traversal, no symlinks followed at request time).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import Response

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".ico": "image/x-icon",
    ".png": "image/png",
}

# Scripts and styles only from this origin, no inline script, no eval, no framing, and
# fetch only back to this API: an injected string can neither run nor phone home.
CSP = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)

SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",  # frame-ancestors for browsers that predate it
    "Cross-Origin-Opener-Policy": "same-origin",
    # The files change only with the package: the browser may keep them but must
    # revalidate (a cheap 304 by ETag), so an upgrade is never mixed with stale JS.
    "Cache-Control": "no-cache",
}


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


def load_assets() -> dict[str, Asset]:
    """Every regular file directly in STATIC_DIR with a known type, by name."""
    assets: dict[str, Asset] = {}
    if not STATIC_DIR.is_dir():
        return assets
    for path in sorted(STATIC_DIR.iterdir()):
        kind = CONTENT_TYPES.get(path.suffix.lower())
        if kind is None or not path.is_file() or path.is_symlink():
            continue
        body = path.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        assets[path.name] = Asset(body, kind, etag)
    return assets


ASSETS = load_assets()

router = APIRouter(include_in_schema=False)


def _serve(request: Request, name: str) -> Response:
    asset = ASSETS.get(name)
    if asset is None:
        return Response(
            b'{"detail":"no such file"}',
            status_code=404,
            media_type="application/json",
            headers={"X-Content-Type-Options": "nosniff"},
        )
    headers = {**SECURITY_HEADERS, "ETag": asset.etag}
    if asset.etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers=headers)
    body = b"" if request.method == "HEAD" else asset.body
    response = Response(body, media_type=asset.content_type, headers=headers)
    if request.method == "HEAD":
        response.headers["content-length"] = str(len(asset.body))
    return response


@router.api_route("/", methods=["GET", "HEAD"])
async def index(request: Request) -> Response:
    """The dashboard's page (no data in it)."""
    return _serve(request, "index.html")


@router.api_route("/static/{name}", methods=["GET", "HEAD"])
async def static(request: Request, name: str) -> Response:
    """One file of the dashboard, by exact name."""
    return _serve(request, name)
