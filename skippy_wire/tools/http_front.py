"""The HTTP front end's plumbing beneath the routes of :mod:`.api`: the routes open without
an API key (:mod:`.api_keys`), bounded request-body reads, and the uvicorn protocol that
sheds idle connections at the connection limit and answers an error object beyond it
(docs/security.md "The HTTP endpoint")."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import socket
import sys
import time
from http import HTTPStatus
from typing import Callable, Optional

import h11
import uvicorn
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..net.connlog import peer_text
from .error_shapes import CLOSE, RETRY_AFTER_S, error_object, error_response, for_route
from .http_middleware import RequestIds, new_request_id, route_path

#: Routes open without the API key (as llama-server keeps its health check open, with and
#: without the /v1 prefix, as the route answers).
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
#: The largest request body read (a context's worth of text is far smaller); a larger one
#: gets 413 before more of it is buffered.
MAX_BODY_BYTES = 8 << 20
BODY_TOO_LARGE = f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB"
#: The largest request head read (h11's default, 431 past it, arriving or complete: IdleSheddingProtocol).
MAX_HEAD_BYTES = 16 << 10
#: Bytes of request bodies buffered at once, all connections together: each may hold up
#: to MAX_BODY_BYTES while its body arrives, and --max-connections of them would hold GiBs.
MAX_BUFFERED_BODY_BYTES = 64 << 20
#: A body of more than BODY_PIECES_FREE pieces (its chunks, or what each read of a plain one
#: brought) must average this many bytes a piece, all of them counted: the HTTP parser's cost
#: is per piece, and a body of one-byte chunks held the event loop, and every other client, a
#: second a MiB.
MIN_BODY_PIECE_BYTES, BODY_PIECES_FREE = 256, 1024
#: Seconds a request body may take once its head has arrived (as a stage's --message-timeout); slower: 408.
BODY_TIMEOUT_S = 30
#: After an answer given while the request's body still arrives (413, 408, 401, 404 ...),
#: the connection closes: that body is read and dropped for at most this long and this much before the
#: connection closes: closed at once, the unread bytes would make the kernel reset it and a
#: client still sending could lose the answer; never closed, a peer could stream forever.
LINGER_S = 2.0
LINGER_BYTES = MAX_BODY_BYTES
#: Seconds a connection's answer may wait on a client that reads none of it (the write
#: buffer full) before the connection closes: nginx's ``send_timeout`` default.  A stream
#: whose client stopped reading would otherwise hold its connection for good.
STALLED_READER_S = 60
#: Request headers a browser page may send cross-origin (``--cors-origin``): any, as
#: llama-server allows them.  OpenAI's JavaScript client sends its ``X-Stainless-*`` headers
#: on every request, and a preflight that refused one would block every call it makes.
CORS_HEADERS = ["*"]
#: Response headers such a page may read beyond the safelisted ones.
CORS_EXPOSED = ["X-Request-Id", "Retry-After"]
#: The methods HTTP defines (RFC 9110 9.3, and PATCH, RFC 5789): one on a path without it
#: is 405 with Allow; any other method is 501 (RFC 9110 9.1).
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})


def listening_socket(host: str, port: int) -> socket.socket:
    """The API's listening socket (an IPv6 host: IPv6, ``::`` taking IPv4 too, as llama-server's does; a
    link-local one with its zone, ``fe80::1%eth0``, as the resolver gives its scope)."""
    if ":" not in host:
        return socket.create_server((host, port))
    address = socket.getaddrinfo(host, port, socket.AF_INET6, socket.SOCK_STREAM, 0, socket.AI_NUMERICHOST)[0][4]
    return socket.create_server(address, family=socket.AF_INET6, dualstack_ipv6=host == "::")


def netloc(host: str, port: int) -> str:
    """``HOST:PORT`` as a URL writes it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def shutting_down_error() -> dict:
    """What a request still unanswered when the server stops is told (uvicorn cancels what
    outlives its graceful period, and would log a traceback and send a text 500)."""
    return error_object("the server is shutting down; retry later", type_="server_error", code="shutting_down")


def shutting_down_response() -> JSONResponse:
    return JSONResponse(shutting_down_error(), status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})


#: Bytes of a request head kept as it arrives: the route of one that does not parse (its
#: method and target; llama-server's paths are short) picks its error object's shape.
_HEAD_PEEK_BYTES = 256
_REQUEST_TARGET = re.compile(rb"[!-~]+ ([!->@-~]+)[ ?]")  # its path: up to the query or the version


class BodyTooLarge(Exception):
    """A request body over :data:`MAX_BODY_BYTES`."""


class BodiesBufferFull(Exception):
    """The bodies being received hold :data:`MAX_BUFFERED_BODY_BYTES` already."""


#: Bytes the body reads in progress hold (one event loop reads them all: no lock).
_buffered = 0


async def read_body(request: Request) -> bytes:
    """The whole body, refused (BodyTooLarge) as soon as it is known to pass the limit,
    or (BodiesBufferFull) when the bodies being received would hold too much together;
    ``asyncio.TimeoutError`` after :data:`BODY_TIMEOUT_S`, ``ClientDisconnect`` if the client
    left."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise BodyTooLarge
    return await asyncio.wait_for(_gather(request), BODY_TIMEOUT_S)


async def _gather(request: Request) -> bytes:
    global _buffered
    body = bytearray()
    try:
        async for chunk in request.stream():
            if len(body) + len(chunk) > MAX_BODY_BYTES:
                raise BodyTooLarge
            if _buffered + len(chunk) > MAX_BUFFERED_BODY_BYTES:
                raise BodiesBufferFull
            body += chunk
            _buffered += len(chunk)
        return bytes(body)
    finally:
        _buffered -= len(body)


async def too_many_connections(scope, receive, send) -> None:
    """The answer to a request beyond the connection limit: an error object in its route's
    shape where uvicorn would send ``text/plain`` "Service Unavailable", and the connection closed."""
    answer = error_object("every connection is serving a request; retry later", type_="server_error",
                          code="too_many_connections")
    response = JSONResponse(for_route(503, answer, route_path(scope["raw_path"])), status_code=503,
                            headers={"Retry-After": str(RETRY_AFTER_S), **CLOSE})
    await response(scope, receive, send)


_REFUSED_CONNECTION = RequestIds(too_many_connections)  # outside the application's middleware


#: What uvicorn logs, alone, for a request that does not parse (replaced by a line with the peer and the reason).
_INVALID_REQUEST = "Invalid HTTP request received."


class _ProtocolLog(logging.LoggerAdapter):
    """uvicorn's logger for one connection, less its own line for a request that does not parse."""

    @property
    def level(self) -> int:  # uvicorn reads it
        return self.logger.level

    def warning(self, msg, *args, **kwargs) -> None:
        if msg != _INVALID_REQUEST:
            super().warning(msg, *args, **kwargs)


class RefusedRequest(h11.RemoteProtocolError):
    """A request this front refuses as h11 refuses a malformed one, its text the answer's
    message (h11's own reasons quote the peer's bytes: those go to the log alone)."""


class IdleSheddingProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, except that a new connection at the connection limit
    closes the one that has been quiet longest instead of leaving every request 503, and
    that a request still refused gets :func:`too_many_connections`.

    uvicorn answers 503 to any request while ``limit_concurrency`` connections are open,
    idle ones included, and a connection that never finishes its request head stays open,
    so one peer holding that many idle connections would lock every client out.  Here a
    connection is quiet while it has no request whose head has arrived and whose response
    is unfinished (the test uvicorn's own graceful shutdown uses to close connections), or
    while its request's body is still arriving; it is shed oldest first, counting from its
    opening or its last response.  Requests being served are never shed.

    The limit is taken from uvicorn (``limit_concurrency`` None to it) and applied in
    :attr:`app`, which uvicorn reads the moment a request head arrives to pick the ASGI
    application to run: the same test at the same moment as uvicorn's own, with this
    answer instead of its plain text one."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_connections, self.limit_concurrency = self.limit_concurrency, None
        self.logger = _ProtocolLog(self.logger)
        self.protocol_error: Optional[h11.RemoteProtocolError] = None  # why the last request did not parse
        self.request_path: Optional[str] = None  # the route of the request whose head has arrived
        self.head_start = b""  # the start of the next request's head as h11 holds it (_HEAD_PEEK_BYTES)
        next_event = self.conn.next_event

        def remembering_next_event():
            if self.conn.their_state is h11.IDLE and len(self.head_start) < _HEAD_PEEK_BYTES:
                self.head_start = self.conn.trailing_data[0][:_HEAD_PEEK_BYTES]  # a head maybe pipelined
            try:
                event = next_event()
                if isinstance(event, h11.Request):
                    self.request_path = route_path(event.target)
                    if event.http_version not in (b"1.0", b"1.1"):  # HTTP/2's preface, 9.9, 0.9 (RFC 9110 15.6.6)
                        raise RefusedRequest(f"HTTP/{event.http_version.decode()} is not supported: this server "
                                             "speaks HTTP/1.1", error_status_hint=505)
                    if _head_bytes(event) > MAX_HEAD_BYTES:
                        raise RefusedRequest(f"request head over {MAX_HEAD_BYTES >> 10} KiB", error_status_hint=431)
                    self.body_pieces = self.body_bytes = 0
                elif isinstance(event, h11.Data):
                    self.body_pieces, self.body_bytes = self.body_pieces + 1, self.body_bytes + len(event.data)
                    pieces = self.body_pieces
                    if pieces > BODY_PIECES_FREE and self.body_bytes < MIN_BODY_PIECE_BYTES * pieces:
                        raise RefusedRequest(
                            f"request body in pieces of {self.body_bytes // pieces} bytes on average (a body of more "
                            f"than {BODY_PIECES_FREE} pieces must average {MIN_BODY_PIECE_BYTES}: send larger chunks)")
                # a chunk's size line says what it brings (h11's chunked reader keeps the rest of it): one
                # past the limit is refused at once, as a Content-Length is, not after the body timeout
                chunk_rest = getattr(getattr(self.conn, "_reader", None), "_bytes_in_chunk", 0)
                if self.body_bytes + chunk_rest > MAX_BODY_BYTES:
                    raise RefusedRequest(BODY_TOO_LARGE, error_status_hint=413)
                return event
            except h11.RemoteProtocolError as exc:
                self.protocol_error = exc
                raise

        self.conn.next_event = remembering_next_event
        self.body_pieces = self.body_bytes = 0  # of the request whose body arrives
        self.lingering: Optional[int] = None  # bytes dropped since the close was asked for
        self.linger_end: Optional[asyncio.TimerHandle] = None
        self.stalled: Optional[asyncio.TimerHandle] = None  # set while the client reads nothing
        self.serving: Optional[asyncio.Task] = None  # the task that runs its request

    @property
    def app(self):
        limit = self.max_connections
        # uvicorn's own test (>=, counting this connection) served one connection fewer than
        # the limit, and none at --max-connections 1; this request's task is not counted yet
        if limit is not None and (len(self.connections) > limit or len(self.tasks) >= limit):
            self.logger.warning("Exceeded concurrency limit.")
            return _REFUSED_CONNECTION
        return self._announcing_close

    async def _announcing_close(self, scope, receive, send) -> None:
        """The application; an answer before the request's body ended says it closes (RFC 9112 9.6)."""
        self.serving = asyncio.current_task()

        async def sending(message) -> None:
            if message["type"] == "http.response.start" and self.conn.their_state is h11.SEND_BODY:
                if (b"connection", b"close") not in (headers := list(message.get("headers", []))):
                    message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self._app(scope, receive, sending)

    @app.setter
    def app(self, app) -> None:
        self._app = app

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.quiet_since = self.loop.time()
        super().connection_made(transport)
        self.transport = LingeringClose(transport, self)  # what each request's cycle closes
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            quiet = [c for c in self.connections if c is not self and c.is_quiet()]
            if quiet:
                min(quiet, key=lambda c: c.quiet_since).shed()

    def on_response_complete(self) -> None:
        self.quiet_since = self.loop.time()
        self.request_path, self.head_start = None, b""  # (the next request's head may be parsed at once)
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY:  # answered (401, 404, 413 ...) before its body ended
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._unstall()
        self.stalled = self.loop.call_later(STALLED_READER_S, self.stalled_reader)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unstall()

    def connection_lost(self, exc: Optional[Exception]) -> None:
        self._unstall()
        if self.linger_end is not None:
            self.linger_end.cancel()
        super().connection_lost(exc)

    def _unstall(self) -> None:
        if self.stalled is not None:
            self.stalled.cancel()
            self.stalled = None

    def stalled_reader(self) -> None:
        self.logger.warning("a client read none of its answer for %g s: its connection is closed", STALLED_READER_S)
        self.transport.abort()  # close() would wait for the buffer to drain; the request sees the client gone

    def data_received(self, data: bytes) -> None:
        if self.lingering is None:
            super().data_received(data)
            return
        self.lingering += len(data)
        if self.lingering > LINGER_BYTES:
            self.transport.close()

    def is_quiet(self) -> bool:
        return self.cycle is None or self.cycle.response_complete or self.conn.their_state is h11.SEND_BODY

    def shed(self) -> None:
        self.connections.discard(self)  # counted out now, not when the loop gets to it (its task too)
        self.tasks.discard(self.serving)
        self.transport.close_now()

    def shutdown(self) -> None:
        super().shutdown()
        if self.lingering is not None:  # a server stopping waits for no body
            self.transport.close_now()

    def _unsupported_upgrade_warning(self) -> None:
        """Nothing logged for a request asking to upgrade (``curl --http2``'s h2c, a WebSocket):
        it is answered over HTTP/1.1, as RFC 9110 7.8 lets a server do, where uvicorn warned
        twice per request, advising a WebSocket library this API has no use for."""

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it cannot parse (a malformed head), as an error object
        in its route's shape where uvicorn sends ``text/plain`` (OpenAI's where the head shows
        no route), 431 for a head over h11's size limit,
        501 naming the transfer coding refused; logged with the peer and h11's reason
        (uvicorn's line gives neither); the connection then closes."""
        error, self.protocol_error = self.protocol_error, None
        status = getattr(error, "error_status_hint", 400)
        peer = "%s:%d" % tuple(self.client[:2]) if self.client else "a peer"
        self.logger.warning("invalid HTTP request from %s (%s); closing", peer, peer_text(error or "no reason given"))
        said = isinstance(error, RefusedRequest) or status == 501  # h11's 501 reasons are fixed texts
        type_ = "not_supported_error" if status in (501, 505) else "invalid_request_error"
        path = self.request_path
        if path is None and (line := _REQUEST_TARGET.match(self.head_start)):
            path = route_path(line[1])
        body = JSONResponse(for_route(status, error_object(str(error) if said else msg, type_=type_), path)).body
        headers = [*self.server_state.default_headers,  # Date and Server, as every other answer
                   (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close"), (b"x-request-id", new_request_id())]
        for event in (h11.Response(status_code=status, headers=headers, reason=HTTPStatus(status).phrase.encode()),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        if self.cycle is not None:  # a body refused mid-way: its request's own answer goes to no one (h11
            self.cycle.disconnected = True  # would refuse it, logging a traceback), its reads end at once
            self.cycle.message_event.set()
        self.transport.close()


def _head_bytes(request: h11.Request) -> int:
    """The size of ``request``'s head as sent (``METHOD TARGET HTTP/1.1``, ``Name: value`` lines, CRLFs)."""
    line = len(request.method) + len(request.target) + len(b"HTTP/") + len(request.http_version) + 4
    return line + sum(len(name) + len(value) + 4 for name, value in request.headers.raw_items()) + 2


class LingeringClose:
    """A connection's transport whose ``close()``, while a request's body (or the rest of a
    head that does not parse) still arrives, sends the answer and a FIN at once but closes
    after :data:`LINGER_S` or :data:`LINGER_BYTES` more bytes (the protocol drops them), or when
    the peer closes (Apache's and nginx's lingering close).  Everything else is the transport's."""

    def __init__(self, transport, protocol: IdleSheddingProtocol) -> None:
        self._transport, self._protocol = transport, protocol

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def write(self, data) -> None:
        # a connection lost (reset) takes no more: asyncio would log a line for each write
        # the request makes before the loop tells it the client is gone
        if not self._transport.is_closing():
            self._transport.write(data)

    def close_now(self) -> None:
        self._transport.close()

    def close(self) -> None:
        protocol, transport = self._protocol, self._transport
        unread = protocol.conn.their_state in (h11.SEND_BODY, h11.ERROR)
        if protocol.lingering is not None or transport.is_closing() or not unread:
            transport.close()
            return
        protocol.lingering = 0
        if transport.can_write_eof():  # (not under TLS)
            transport.write_eof()
        protocol.linger_end = protocol.loop.call_later(LINGER_S, transport.close)


class StoppingServer(uvicorn.Server):
    """uvicorn's server, saying through ``say`` what a stop waits for: the requests in flight
    and their grace period (a second Ctrl-C ends it), then how many it cut off.  uvicorn's own
    ERROR line for those is dropped: stopping is no error.  ``refuse_waiting()`` answers the
    requests still queued at once and says how many.  A signal ignored when it is made (Ctrl-C
    in a background job of a script, ``nohup``) stays ignored, as by every other command."""

    def __init__(self, config: uvicorn.Config, say: Callable[[str], None],
                 refuse_waiting: Callable[[], int] = lambda: 0) -> None:
        super().__init__(config)
        self.say, self.refuse_waiting = say, refuse_waiting
        self.stopped_by: Optional[int] = None  # the first signal it stopped for
        self.ended: Optional[str] = None  # why nothing could be served any more (stop_when)
        self.ignored = {sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) is signal.SIG_IGN}

    def handle_exit(self, sig: int, frame) -> None:
        if sig in self.ignored:  # uvicorn handles it whatever it was before
            return
        if self.stopped_by is None:
            self.stopped_by = sig
        super().handle_exit(sig, frame)

    def stop_for(self, sig: int, _frame=None) -> None:
        """A handler of a signal uvicorn does not handle (SIGHUP): stop as it stops on its own."""
        if self.stopped_by is None:
            self.stopped_by = sig
        self.should_exit = True

    def stop_when(self, ended: Callable[[], Optional[str]], every_s: float) -> None:
        """In a thread of its own: once ``ended()`` names why nothing can be served any more (a
        stage process gone), keep it in :attr:`ended` and stop, instead of answering every
        request with 502."""
        while not self.should_exit:
            why = ended()
            if why is not None:
                self.ended, self.should_exit = why, True
                return
            time.sleep(every_s)

    async def shutdown(self, sockets=None) -> None:
        refused = self.refuse_waiting()  # requests not started are answered now, not after the grace period
        running = len(self.server_state.tasks) - refused
        if running > 0:
            self.say(f"stopping: {running} request(s) in flight get up to "
                     f"{self.config.timeout_graceful_shutdown:g} s to finish (Ctrl-C again: stop now)"
                     + (f"; {refused} queued refused" if refused else ""))
        log = logging.getLogger("uvicorn.error")
        log.addFilter(self._cut_off)
        try:
            await super().shutdown(sockets)
        finally:
            log.removeFilter(self._cut_off)

    def _cut_off(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Cancel %s running task(s)"):
            self.say(f"stopping: {record.args[0]} request(s) cut off")
            return False
        return True


class LongNumber(ValueError):
    """An integer in a JSON body with more digits than Python converts (a valid JSON number)."""


def _json_int(digits: str) -> int:
    limit = getattr(sys, "get_int_max_str_digits", lambda: 0)()  # (Python 3.10.7 on)
    if len(digits.lstrip("-")) > limit > 0:
        raise LongNumber(f"the request body holds an integer of {len(digits.lstrip('-'))} digits; at most {limit} "
                         "are read")
    return int(digits)


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # RFC 8259 has no NaN or Infinity; Python reads them


def _parsed(data: bytes):
    """``json.loads(data)``; LongNumber when the body is valid JSON but holds an integer
    Python will not read (looked for only then: a parse_int hook slows every body 3x)."""
    try:
        return json.loads(data, parse_constant=_no_constant)
    except ValueError:
        json.loads(data, parse_int=_json_int, parse_constant=_no_constant)
        raise


async def json_body(request: Request) -> dict | Response:
    """The request's body as a JSON object, or the error response that says why it is not one."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":  # a compressed body would read as "not valid JSON"
        return error_response(415, f"unsupported Content-Encoding {encoding!r}: send the JSON body uncompressed",
                              headers={"Accept-Encoding": "identity", **CLOSE})  # what it takes (RFC 9110 12.5.3)
    try:
        body = _parsed(await read_body(request))
    except LongNumber as exc:
        return error_response(400, str(exc))
    except BodyTooLarge:
        return error_response(413, BODY_TOO_LARGE, headers=CLOSE)
    except BodiesBufferFull:
        return error_response(503, "the server is receiving too many request bodies at once; retry later",
                              type_="server_error", headers={"Retry-After": str(RETRY_AFTER_S), **CLOSE})
    except asyncio.TimeoutError:
        return error_response(408, f"the request body did not arrive within {BODY_TIMEOUT_S} s", headers=CLOSE)
    except ClientDisconnect:
        return Response(status_code=499)  # nobody is left to read it
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: nested too deep
        return error_response(400, "the request body is not valid JSON")
    if not isinstance(body, dict):
        return error_response(400, "the request body must be a JSON object")
    return body
