"""The API's ASGI middleware beneath its error objects (:mod:`.error_shapes`): request ids,
absolute-form targets, and the requests refused before any route sees them (an ambiguous
length, a POST from a web page of an origin not allowed)."""

from __future__ import annotations

import re
import uuid
from typing import Optional
from urllib.parse import unquote

from .error_shapes import CLOSE, error_response

#: A client's own ``X-Request-Id`` that is echoed: visible ASCII, not too long.
_CLIENT_REQUEST_ID = re.compile(rb"[\x21-\x7e]{1,128}")


class RefuseAmbiguousLength:
    """ASGI middleware: a request with both ``Content-Length`` and ``Transfer-Encoding`` gets
    400 and its connection closes (RFC 9112 6.3): a proxy in front that went by the other
    header would take the rest of its body for a request of its own (request smuggling)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            names = {name for name, _ in scope["headers"]}
            if b"content-length" in names and b"transfer-encoding" in names:
                response = error_response(400, "a request may not carry both Content-Length and Transfer-Encoding",
                                          headers=CLOSE)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RefuseForeignOrigins:
    """ASGI middleware: a request that changes something (a POST) from a web page of an
    origin not given with ``--cors-origin`` gets 403.  CORS only keeps such a page from
    reading the answer; a "simple" POST (``Content-Type: text/plain``) needs no preflight,
    so without this any site a user visits could make a local API generate.  Browsers send
    ``Origin`` with every such request; command-line and SDK clients send none."""

    def __init__(self, app, allowed: tuple[str, ...] = ()) -> None:
        self.app, self.allowed = app, {origin.lower().encode() for origin in allowed}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            origin = dict(scope["headers"]).get(b"origin")
            if origin is not None and origin.lower() not in self.allowed and b"*" not in self.allowed:
                shown = origin.decode("latin-1")[:200]
                response = error_response(403, f"a request from the web page origin {shown!r} is refused "
                                          "(--cors-origin ORIGIN allows one)", code="origin_not_allowed")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


#: The scheme and authority of an absolute-form request target (``POST http://host/v1/...``).
_ABSOLUTE_FORM = re.compile(rb"[A-Za-z][A-Za-z0-9+.-]*://[^/]*")


def _origin_form(raw_path: bytes) -> bytes:
    """A target's path in origin form: an absolute-form one less its scheme and authority."""
    absolute = _ABSOLUTE_FORM.match(raw_path)
    return (raw_path[absolute.end():] or b"/") if absolute else raw_path


class OriginForm:
    """ASGI middleware: a request whose target is in absolute form, as a client sends it to
    a proxy, is routed on its path (RFC 9112 3.2.2: a server must accept that form; uvicorn
    passes the whole URL on as the path, which no route matched)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (raw_path := _origin_form(scope["raw_path"])) != scope["raw_path"]:
            scope = {**scope, "raw_path": raw_path, "path": unquote(raw_path.decode("ascii"))}
        await self.app(scope, receive, send)


def route_path(target: bytes) -> Optional[str]:
    """The path a request target is routed on (as uvicorn and :class:`OriginForm` read it);
    None for one that is not ASCII."""
    try:
        return unquote(_origin_form(target.partition(b"?")[0]).decode("ascii")) or "/"
    except UnicodeDecodeError:
        return None


def new_request_id() -> bytes:
    return b"req_" + uuid.uuid4().hex.encode()


class RequestIds:
    """ASGI middleware: every response carries ``X-Request-Id``, as OpenAI's do (its clients
    expose it as ``_request_id``, to quote in a report): the client's own where it sent a
    usable one, so both sides log the same id, else a new ``req_`` one."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"")
        request_id = given if _CLIENT_REQUEST_ID.fullmatch(given) else new_request_id()

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, sending)


__all__ = ["RefuseAmbiguousLength", "RefuseForeignOrigins", "OriginForm", "route_path", "new_request_id",
           "RequestIds"]
