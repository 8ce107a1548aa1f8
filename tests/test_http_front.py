"""The HTTP front end's limits against real sockets: uvicorn serving in a thread on
127.0.0.1, with the shedding protocol, and the API's body reads (no stages needed)."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from skippy_wire.tools import http_front
from skippy_wire.tools.api import Api

LIMIT = 6


@contextlib.contextmanager
def serving(app, **config):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           http=http_front.IdleSheddingProtocol, **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.started
        yield "http://127.0.0.1:%d" % listener.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        listener.close()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


class Gate:
    def __init__(self) -> None:
        self.open, self.entered = threading.Event(), 0


@pytest.fixture
def gated():
    """An app whose /wait answers once the test opens the gate (a request being served)."""
    gate = Gate()

    async def wait(request):
        gate.entered += 1
        while not gate.open.is_set():
            await asyncio.sleep(0.01)
        return PlainTextResponse("done")

    async def ok(request):
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/wait", wait), Route("/ok", ok)])
    with serving(app, limit_concurrency=LIMIT) as url:
        try:
            yield url, gate
        finally:
            gate.open.set()


def test_idle_connections_at_the_limit_do_not_lock_clients_out(gated):
    url, _ = gated
    idle = []
    try:
        for i in range(3 * LIMIT):  # silent ones, and ones stuck inside a request head
            idle.append(_connect(url))
            if i % 2:
                idle[-1].sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.2)
        assert httpx.get(url + "/ok", timeout=10).text == "ok"
        # The oldest were shed: the server closed them.
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""
    finally:
        for s in idle:
            s.close()


def test_requests_being_served_are_never_shed(gated):
    url, gate = gated
    busy = LIMIT - 1  # uvicorn answers 503 once the open connections reach its limit
    with httpx.Client(timeout=20, limits=httpx.Limits(max_connections=busy)) as client, \
            ThreadPoolExecutor(busy) as pool:
        waiting = [pool.submit(client.get, url + "/wait") for _ in range(busy)]
        deadline = time.monotonic() + 10
        while gate.entered < busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gate.entered == busy
        # Every other connection serves a request: nothing to shed, so the newcomer gets 503.
        assert httpx.get(url + "/ok", timeout=10).status_code == 503
        gate.open.set()
        assert [f.result().text for f in waiting] == ["done"] * busy
    assert httpx.get(url + "/ok", timeout=10).text == "ok"


@pytest.fixture
def api_url(caplog):
    """The API's routes with no stages behind them: enough for what happens before a
    request reaches the engine."""
    api = Api(None, model_id="m", chat_template=None, max_inflight=1)
    with caplog.at_level(logging.WARNING), serving(api.app(), limit_concurrency=LIMIT) as url:
        yield url
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def _post_head(url: str, length: int, part: bytes) -> socket.socket:
    s = _connect(url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (length, part))
    return s


def test_a_body_that_stalls_gets_408(api_url, monkeypatch):
    monkeypatch.setattr(http_front, "BODY_TIMEOUT_S", 0.5)
    with _post_head(api_url, 100, b'{"prompt": "') as s:
        s.settimeout(10)
        response = http.client.HTTPResponse(s)
        response.begin()
        body = json.loads(response.read())
    assert response.status == 408 and body["error"]["type"] == "invalid_request_error"


def test_a_client_that_leaves_mid_body_is_no_error(api_url):
    # (the fixture asserts that nothing was logged as an error: no traceback)
    _post_head(api_url, 100, b'{"prompt": "').close()
    time.sleep(0.3)
    assert httpx.get(api_url + "/v1/models", timeout=10).json()["data"][0]["id"] == "m"


def test_a_body_dribbled_at_the_limit_is_shed_for_a_newcomer(api_url):
    # (A request head arriving at the limit gets 503 and a closed connection, so a peer holds
    # at most one fewer than the limit this way.)
    stalled = [_post_head(api_url, 100, b"{") for _ in range(LIMIT - 1)]
    try:
        time.sleep(0.2)
        assert httpx.get(api_url + "/v1/models", timeout=10).status_code == 200
        stalled[0].settimeout(5)
        assert stalled[0].recv(1) == b""  # the oldest was shed (its handler saw the client leave)
    finally:
        for s in stalled:
            s.close()
