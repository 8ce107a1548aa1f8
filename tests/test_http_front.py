"""The HTTP front end against real sockets (uvicorn serving in a thread on 127.0.0.1,
with the shedding protocol) and in process (Starlette's TestClient): its limits, the API's
body reads, errors, key, queue and health, over a fake engine or in-process fake stages
(no model, no stage processes)."""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gzip
import http.client
import io
import json
import re
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from test_server import Chain

from skippy_wire.net.service import Admission, Cancelled, Generation, GenerationEngine
from skippy_wire.stage.chat import ChatTemplate
from skippy_wire.tools import error_shapes, http_front
from skippy_wire.tools.api import Api
from skippy_wire.tools.api_keys import open_api_warning
from skippy_wire.tools.api_options import web_origin
from skippy_wire.tools.api_params import MAX_PROMPTS, MAX_TOKENIZE_BYTES

LIMIT = 6


@contextlib.contextmanager
def serving(app, servers=None, **config):
    """Serve ``app`` in a thread; yields its URL (``servers``: a list the server is added to)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           http=http_front.IdleSheddingProtocol, **config))
    if servers is not None:
        servers.append(server)
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


def gated_app(gate: Gate) -> Starlette:
    """An app whose /wait answers once the test opens the gate (a request being served)."""

    async def wait(request):
        gate.entered += 1
        while not gate.open.is_set():
            await asyncio.sleep(0.01)
        return PlainTextResponse("done")

    async def ok(request):
        return PlainTextResponse("ok")

    return Starlette(routes=[Route("/wait", wait), Route("/ok", ok)])


@pytest.fixture
def gated():
    gate = Gate()
    with serving(gated_app(gate), limit_concurrency=LIMIT) as url:
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


@pytest.mark.parametrize("limit", [1, 3])
def test_the_connection_limit_counts_the_connections_it_serves(limit):
    """--max-connections N served N - 1 connections (uvicorn's test counts the newcomer
    against its own limit): at 1 every request got 503."""
    gate = Gate()
    with serving(gated_app(gate), limit_concurrency=limit) as url, \
            httpx.Client(timeout=20, limits=httpx.Limits(max_connections=limit)) as client, \
            ThreadPoolExecutor(limit) as pool:
        waiting = [pool.submit(client.get, url + "/wait") for _ in range(limit - 1)]
        deadline = time.monotonic() + 10
        while gate.entered < limit - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        try:
            assert client.get(url + "/ok").text == "ok"  # the limit's last connection is served
        finally:
            gate.open.set()
        assert [f.result().text for f in waiting] == ["done"] * (limit - 1)


def test_a_request_asking_to_upgrade_is_answered_over_http_1_1_and_logs_nothing(gated, caplog):
    # curl --http2 asks for h2c; uvicorn warned twice per request, advising a WebSocket library
    url, _ = gated
    caplog.set_level(logging.WARNING, logger="uvicorn.error")
    for upgrade in ("h2c", "websocket"):
        reply = httpx.get(url + "/ok", timeout=10, headers={"Connection": "Upgrade, HTTP2-Settings",
                                                            "Upgrade": upgrade, "HTTP2-Settings": "AAMAAABkAAQAAP__"})
        assert reply.status_code == 200 and reply.text == "ok" and reply.http_version == "HTTP/1.1"
    assert not [r for r in caplog.records if r.name.startswith("uvicorn")], caplog.text


def test_requests_being_served_are_never_shed(gated):
    url, gate = gated
    busy = LIMIT  # every connection the limit allows serves a request
    with httpx.Client(timeout=20, limits=httpx.Limits(max_connections=busy)) as client, \
            ThreadPoolExecutor(busy) as pool:
        waiting = [pool.submit(client.get, url + "/wait") for _ in range(busy)]
        deadline = time.monotonic() + 10
        while gate.entered < busy and time.monotonic() < deadline:
            time.sleep(0.01)
        assert gate.entered == busy
        # Every other connection serves a request: nothing to shed, so the newcomer gets 503,
        # as an OpenAI error object with Retry-After (not uvicorn's plain text).
        refused = httpx.get(url + "/ok", timeout=10)
        assert refused.status_code == 503 and refused.headers["retry-after"] == str(error_shapes.RETRY_AFTER_S)
        assert refused.json()["error"]["type"] == "server_error"
        assert refused.json()["error"]["code"] == "too_many_connections"
        assert refused.headers["x-request-id"].startswith("req_")
        llama = httpx.post(url + "/completion", timeout=10)  # llama-server's route: its shape
        assert llama.status_code == 503 and llama.json() == {"error": {
            "code": 503, "message": "every connection is serving a request; retry later", "type": "unavailable_error"}}
        with _connect(url) as s:  # the same route in absolute form, as sent to a proxy
            s.sendall(b"POST http://h/completion HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n")
            absolute = http.client.HTTPResponse(s)
            absolute.begin()
            assert absolute.status == 503 and json.loads(absolute.read()) == llama.json()
        gate.open.set()
        assert [f.result().text for f in waiting] == ["done"] * busy
    assert httpx.get(url + "/ok", timeout=10).text == "ok"


@contextlib.contextmanager
def logged_by_uvicorn():
    """The records uvicorn's logger takes from here on (it does not propagate to the root,
    so caplog misses them); entered once the server runs, whose start configures it."""
    records: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    log = logging.getLogger("uvicorn.error")
    log.addHandler(handler)
    try:
        yield records
    finally:
        log.removeHandler(handler)


def _errors(records) -> list:
    return [r.getMessage() for r in records if r.levelno >= logging.ERROR]


@pytest.fixture
def api_url(caplog):
    """The API's routes with no stages behind them: enough for what happens before a
    request reaches the engine."""
    api = Api(None, model_id="m", chat_template=None, max_inflight=1)
    with caplog.at_level(logging.WARNING), serving(api.app(), limit_concurrency=LIMIT) as url, \
            logged_by_uvicorn() as records:
        yield url
    assert not _errors(caplog.records) and not _errors(records), (caplog.text, _errors(records))


@pytest.mark.parametrize("target", [b"http://backend.local/v1/models", b"HTTP://127.0.0.1:1/v1/models?x=1",
                                    b"https://h/v1/%6dodels"])
def test_a_request_target_in_absolute_form_is_routed_on_its_path(api_url, target):
    """``GET http://host/v1/models``, as a client set to use this server as its proxy sends it
    (RFC 9112 3.2.2: a server must accept it), was "404 Invalid URL (GET /http://...)"."""
    with _connect(api_url) as s:
        s.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(10)
        response = http.client.HTTPResponse(s)
        response.begin()
        assert response.status == 200 and json.loads(response.read())["data"][0]["id"] == "m"


def test_an_answer_before_the_body_ended_says_the_connection_closes(api_url):
    """The 404 to a body still to come closed the connection without ``Connection: close``;
    one whose body had arrived keeps the connection (and says nothing)."""
    head = b"POST /nope HTTP/1.1\r\nHost: x\r\nContent-Length: 7\r\n"
    with _connect(api_url) as s:
        s.settimeout(10)
        s.sendall(head + b"Expect: 100-continue\r\n\r\n")  # the body waits for a 100 that never comes
        response = http.client.HTTPResponse(s)
        response.begin()
        assert (response.status, response.getheader("connection")) == (404, "close")
        response.read()
        assert s.recv(1) == b""  # closed, as said
    with _connect(api_url) as s:
        s.settimeout(10)
        for _ in range(2):  # the same connection serves the next request
            s.sendall(head + b'\r\n{"a":1}')
            response = http.client.HTTPResponse(s)
            response.begin()
            assert (response.status, response.getheader("connection")) == (404, None)
            response.read()


def test_head_answers_with_the_headers_of_get(api_url):
    """HEAD skipped the error objects' reshaping: its Content-Length was not GET's (RFC 9110
    9.3.2), on llama-server's routes (the router's own refusals name the method in words)."""
    get, head = httpx.get(api_url + "/slots", timeout=10), httpx.head(api_url + "/slots", timeout=10)
    assert head.status_code == get.status_code >= 400 and head.content == b""
    assert head.headers["content-length"] == get.headers["content-length"] == str(len(get.content))
    assert head.headers["content-type"] == get.headers["content-type"]


def test_a_head_refused_while_it_still_arrives_is_answered_without_a_reset(api_url):
    """A 300 KB header: the 431 was followed by a TCP reset (the rest of the head unread at
    the close), which can destroy the answer before the client reads it."""
    with _connect(api_url) as s:
        s.settimeout(10)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 300_000 + b"\r\n\r\n")
        response = http.client.HTTPResponse(s)
        response.begin()
        assert response.status == 431 and json.loads(response.read())["error"]["message"]
        assert s.recv(1) == b""  # a FIN, not a reset


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
        assert response.getheader("connection") == "close" and s.recv(1) == b""  # a body dripped on is not read
    assert response.status == 408 and body["error"]["type"] == "invalid_request_error"


def test_an_endless_body_refused_by_the_key_check_is_read_no_further():
    # A 401 (as a 403, 404 or 405) is answered before the body is read: the connection kept
    # reading and dropping it, gigabytes a minute, for anyone without the key.
    api = Api(None, model_id="m", chat_template=None, max_inflight=1, api_keys=["k"])
    block = b"a" * 65536
    with serving(api.app(), limit_concurrency=LIMIT) as url, _post_head(url, 10 ** 12, b"") as s:
        s.settimeout(10)
        response = http.client.HTTPResponse(s)
        response.begin()
        assert response.status == 401 and json.loads(response.read())["error"]["code"] == "invalid_api_key"
        with pytest.raises(ConnectionError):  # reset once the lingering read has had its 8 MiB
            for _ in range(2000):  # 128 MiB at most
                s.sendall(block)


def test_a_client_still_sending_an_oversized_body_gets_its_413(api_url):
    # Closed at once, the connection's unread bytes would reset it under the answer.
    body = b'{"prompt": "' + b"a" * http_front.MAX_BODY_BYTES + b'"}'
    for _ in range(5):
        for content in (body, (body[i:i + 65536] for i in range(0, len(body), 65536))):  # declared, chunked
            r = httpx.post(api_url + "/v1/completions", content=content, timeout=30)
            assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
            assert r.headers["connection"] == "close"


def test_an_endless_body_gets_413_and_is_read_no_further(api_url):
    # Kept open, the connection would read and drop gigabytes a minute for as long as the
    # peer sends them.
    block = b"a" * 65536
    with _post_head(api_url, 10 ** 12, b"") as s:
        s.settimeout(10)
        with contextlib.suppress(ConnectionError):  # the server may answer and close while this sends
            for _ in range(http_front.MAX_BODY_BYTES // len(block) + 2):
                s.sendall(block)
        response = http.client.HTTPResponse(s)
        response.begin()
        assert response.status == 413 and json.loads(response.read())["error"]["type"] == "invalid_request_error"
        assert response.getheader("connection") == "close"
        with pytest.raises(ConnectionError):  # reset: what arrives now is not read
            for _ in range(2000):  # 128 MiB at most
                s.sendall(block)


def test_a_client_that_leaves_mid_body_is_no_error(api_url):
    # (the fixture asserts that nothing was logged as an error: no traceback)
    _post_head(api_url, 100, b'{"prompt": "').close()
    time.sleep(0.3)
    assert httpx.get(api_url + "/v1/models", timeout=10).json()["data"][0]["id"] == "m"


def test_a_body_dribbled_at_the_limit_is_shed_for_a_newcomer(api_url):
    stalled = [_post_head(api_url, 100, b"{") for _ in range(LIMIT)]
    try:
        time.sleep(0.2)
        assert httpx.get(api_url + "/v1/models", timeout=10).status_code == 200
        stalled[0].settimeout(5)
        assert stalled[0].recv(1) == b""  # the oldest was shed (its handler saw the client leave)
    finally:
        for s in stalled:
            s.close()


# --- the API over a fake engine ------------------------------------------------------------


class FakeTokenizer:
    """One token per UTF-8 byte; like the real one, it cannot encode an unpaired surrogate.
    ``hold``: encode() waits until it is set (``encoding`` is set meanwhile)."""

    n_vocab = 256
    eog_ids = (0,)
    bos_id, eos_id = None, 0
    tokens = [f"<b{i}>" for i in range(n_vocab)]
    max_token_bytes = 4  # an upper bound, as the real one's is (one byte each here)

    def __init__(self) -> None:
        self.hold, self.encoding = threading.Event(), threading.Event()
        self.hold.set()

    def encode(self, text: str, add_bos=None, parse_special=True) -> list[int]:
        self.encoding.set()
        assert self.hold.wait(30)
        return list(text.encode("utf-8"))

    def is_eog(self, token: int) -> bool:
        return token in self.eog_ids


class FakeEngine:
    """What :class:`Api` uses of a GenerationEngine; generate() answers "ok" once ``gate``
    is open (or raises Cancelled if cancelled by then), and records each prompt."""

    def __init__(self, ctx_size: int = 64) -> None:
        self.tokenizer, self.ctx_size = FakeTokenizer(), ctx_size
        self.counters: collections.Counter = collections.Counter()
        self.gate = threading.Event()
        self.gate.set()
        self.prompts: list[str] = []
        self.requests: list[dict] = []  # each generate()'s max_tokens, sampling, min_indent and line_time_limit_s

    def check_ready(self) -> None:
        pass

    def close(self) -> None:
        pass

    def generate(self, prompt, *, max_tokens, sampling, stop, on_text, cancelled, **ends) -> Generation:
        self.prompts.append(bytes(prompt).decode())
        self.requests.append({"max_tokens": max_tokens, "sampling": sampling, **ends})
        assert self.gate.wait(30)
        if cancelled.is_set():
            raise Cancelled("stop")
        on_text("ok", [111, 107])
        return Generation(text="ok", prompt_tokens=len(prompt), completion_tokens=1, finish_reason="stop")


ROLE_TEMPLATE = ChatTemplate("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


def _fake_api(engine=None, **kwargs) -> Api:
    return Api(engine or FakeEngine(), model_id="m", chat_template=ROLE_TEMPLATE, **{"max_inflight": 1, **kwargs})


def _until(condition, what: str) -> None:
    """Wait (10 s at most) for ``condition()``."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"prompt": "Hi \\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": ["Hi \\udc00 there"]}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi \\ud800"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     "messages"),
    ("/v1/completions", '{"prompt": "Hi", "stop": ["\\ud800"]}', "stop"),
])
def test_an_unpaired_surrogate_is_a_400_naming_the_field(path, body, param):
    with TestClient(_fake_api().app(), raise_server_exceptions=False) as client:
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param
        # a pair (one character outside the BMP) is text like any other
        ok = client.post("/v1/completions", content='{"prompt": "Hi \\ud83d\\ude00"}',
                         headers={"Content-Type": "application/json"})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path, body, param, message", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "user": 7}, "user",
     "'user' must be a string"),
    ("/v1/completions", {"prompt": "Hi", "user": ["u"]}, "user", "'user' must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi", "name": 7}]}, "messages[0].name",
     "messages[0].name must be a string"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}]},
     "messages[0].content[0].type",
     "messages[0].content parts of type 'refusal' are only allowed in assistant messages"),
])
def test_a_chat_field_of_the_wrong_type_is_a_400_naming_it(path, body, param, message):
    with TestClient(_fake_api().app()) as client:
        r = client.post(path, json=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["type"], error["param"], error["message"]) == ("invalid_request_error", param, message)


@pytest.mark.parametrize("field, value, code", [
    ("temperature", 3, "decimal_above_max_value"), ("temperature", -0.5, "decimal_below_min_value"),
    ("temperature", "hot", "invalid_type"), ("max_tokens", 0, "integer_below_min_value"),
    ("max_tokens", 2.5, "invalid_type"), ("n", 1000, "integer_above_max_value"), ("stream", "yes", "invalid_type"),
    ("user", 7, "invalid_type"), ("logit_bias", 7, "invalid_type"), ("prompt", {"a": 1}, "invalid_type"),
    ("stop", 7, "invalid_type"), ("stop", ["a", "b", "c", "d", "e"], None),
])
def test_a_field_refused_by_its_type_or_range_carries_openai_s_code(field, value, code):
    # every 400 had "code": null; the OpenAI SDK's clients branch on e.code
    with TestClient(_fake_api().app()) as client:
        r = client.post("/v1/completions", json={"prompt": "Hi", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert r.json()["error"]["code"] == code, r.text


@pytest.mark.parametrize("messages, param, code", [
    (None, "messages", "missing_required_parameter"), ([], "messages", "empty_array"),
    ("Hi", "messages", "invalid_type"), ([{"role": "wizard", "content": "Hi"}], "messages[0].role", "invalid_value"),
    ([{"role": "user"}], "messages[0].content", "missing_required_parameter"),
    ([{"role": "user", "content": "Hi"}, {"role": "user", "content": 5}], "messages[1].content", "invalid_type"),
])
def test_malformed_messages_carry_openai_s_param_and_code(messages, param, code):
    # they carried "param": "messages" and "code": null whatever the fault
    with TestClient(_fake_api().app()) as client:
        r = client.post("/v1/chat/completions", json={"messages": messages} if messages is not None else {})
        assert r.status_code == 400, r.text
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code), r.text


def test_the_unspecified_ipv6_host_listens_on_ipv4_too_and_is_warned_about(monkeypatch):
    # (the sockets are not made: `::` would listen on every interface of the machine running the tests)
    made = []
    monkeypatch.setattr(socket, "create_server", lambda address, **kwargs: made.append((address[:2], kwargs)))
    for host in ("::", "::1", "127.0.0.1"):
        http_front.listening_socket(host, 8080)
    assert made == [(("::", 8080), {"family": socket.AF_INET6, "dualstack_ipv6": True}),
                    (("::1", 8080), {"family": socket.AF_INET6, "dualstack_ipv6": False}), (("127.0.0.1", 8080), {})]
    assert open_api_warning("::", 8080, []).startswith("warning: listening on [::]:8080, beyond loopback")
    assert open_api_warning("::", 8080, ["key"]) is None and open_api_warning("::1", 8080, []) is None


def test_deeply_nested_json_is_a_400():
    body = '{"prompt": "Hi", "x": ' + "[" * 200_000 + "]" * 200_000 + "}"
    with TestClient(_fake_api().app(), raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body is not valid JSON"


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_are_not_json(literal):
    # Python's reader takes them; RFC 8259 and OpenAI's API do not (an unknown field carried one in)
    engine = FakeEngine()
    with TestClient(_fake_api(engine).app()) as client:
        r = client.post("/v1/completions", content='{"prompt": "Hi", "x": %s}' % literal,
                        headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body is not valid JSON"
    assert engine.prompts == []


def test_an_integer_too_long_to_read_is_named_as_such_not_as_invalid_json():
    with TestClient(_fake_api().app()) as client:
        for digits in ("9" * 5000, "-" + "9" * 5000):
            r = client.post("/v1/completions", content='{"prompt": "Hi", "seed": %s}' % digits,
                            headers={"Content-Type": "application/json"})
            assert r.status_code == 400
            assert r.json()["error"]["message"] == ("the request body holds an integer of 5000 digits; at most "
                                                    f"{sys.get_int_max_str_digits()} are read")
        assert client.post("/v1/completions", json={"prompt": "Hi", "seed": 10 ** 20}).status_code == 400  # range
        assert client.post("/v1/completions", json={"prompt": "Hi", "seed": -5, "max_tokens": 2}).status_code == 200


def test_a_compressed_body_is_a_415_naming_its_encoding():
    """A gzip body read as "not valid JSON"; the encoding named is what to change, and
    Accept-Encoding says what is taken (RFC 9110 12.5.3)."""
    body = gzip.compress(json.dumps({"prompt": "Hi"}).encode())
    with TestClient(_fake_api().app()) as client:
        r = client.post("/v1/completions", content=body,
                        headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert r.status_code == 415 and r.json()["error"]["message"].startswith("unsupported Content-Encoding 'gzip'")
        assert r.headers["accept-encoding"] == "identity"
        r = client.post("/v1/completions", json={"prompt": "Hi"}, headers={"Content-Encoding": "identity"})
        assert r.status_code == 200


@pytest.mark.parametrize("prompt, ctx, fragment", [
    ("x" * 20, 16, "at least 21 tokens (20 in the prompt, at least 1 in the completion)"),
    ("x" * 16, 16, "at least 17 tokens (16 in the prompt, at least 1 in the completion)"),
])
def test_the_context_length_error_counts_truly(prompt, ctx, fragment):
    with TestClient(_fake_api(FakeEngine(ctx_size=ctx)).app()) as client:
        r = client.post("/v1/completions", json={"prompt": prompt})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        assert fragment in r.json()["error"]["message"], r.json()
        fits = client.post("/v1/completions", json={"prompt": "x" * (ctx - 4), "max_tokens": 5}).json()["error"]
        assert f"{ctx + 1} tokens ({ctx - 4} in the prompt, 5 in the completion)" in fits["message"]
        assert client.post("/v1/completions", json={"prompt": "x" * (ctx - 1)}).status_code == 200


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized():
    engine = FakeEngine(ctx_size=16)
    with TestClient(_fake_api(engine).app()) as client:
        for path, body in (("/v1/completions", {"prompt": "x" * 65}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 65}]})):
            r = client.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert not engine.tokenizer.encoding.is_set()  # 16 tokens of at most 4 bytes: never encoded


def test_an_out_of_range_number_is_echoed_cut_short():
    """A 4,000-digit max_tokens came back whole in the error message."""
    with TestClient(_fake_api().app()) as client:
        r = client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": ' + b"9" * 4000 + b"}",
                        headers={"Content-Type": "application/json"})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and message.startswith("'max_tokens' must be between -1 and 2147483647, got 999")
    assert message.endswith("... (3700 more characters)") and len(message) < 400, message


def test_messages_that_cannot_fit_the_context_are_refused_before_they_are_rendered():
    """280,000 empty messages (7.7 MiB) waited for the one rendering thread and held it 3 s
    before their 400; twenty such requests held the API's memory at 1.7 GB."""
    engine = FakeEngine(ctx_size=16)
    api = _fake_api(engine)
    rendered, render = [], api.prompt_reader.rendered
    api.prompt_reader.rendered = lambda body: rendered.append(body) or render(body)
    many = [{"role": "user", "content": ""}] * 17  # a token each at least: 17 > 16
    texts = [{"role": "user", "content": [{"type": "text", "text": "x" * 33}]}, {"role": "user", "content": "y" * 32}]
    with TestClient(api.app()) as client:
        for messages in (many, texts):  # (texts: 65 bytes > 16 tokens x 4)
            r = client.post("/v1/chat/completions", json={"messages": messages})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
            assert client.post("/apply-template", json={"messages": messages}).status_code == 400
        assert not rendered
        assert client.post("/apply-template", json={"messages": many[:16]}).status_code == 200 and rendered


def test_a_mixed_prompt_too_long_for_the_context_is_refused_before_any_piece_is_tokenized():
    # A million one-letter texts: each piece is a token at least, and each passed the size
    # check on its own, so they were tokenized one call at a time (seconds) before the 400.
    engine = FakeEngine(ctx_size=16)
    with TestClient(_fake_api(engine).app()) as client:
        for prompt in ([["x"] * 16], [1] * 10 + ["x"] * 6, [["x" * 33, "y" * 32]]):  # (texts: 65 bytes > 16 x 4)
            r = client.post("/v1/completions", json={"prompt": prompt})
            assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert not engine.tokenizer.encoding.is_set()
        assert client.post("/v1/completions", json={"prompt": [1] * 10 + ["x"] * 5}).status_code == 200


def test_a_request_with_both_body_lengths_is_refused_and_its_connection_closed():
    with serving(_fake_api().app(), limit_concurrency=LIMIT) as url:
        s = _connect(url)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        s.close()
    assert answer.startswith(b"HTTP/1.1 400 ") and b"both Content-Length and Transfer-Encoding" in answer
    assert answer.count(b"HTTP/1.1 ") == 1  # the request behind it was not served


def test_a_body_in_tiny_chunks_is_refused_before_it_holds_the_event_loop():
    """150,000 one-byte chunks a write held the event loop a second a MiB: every other client
    waited (an 8-token stream took 10 s against 0.2 s).  Chunks of a few hundred bytes pass."""
    with serving(_fake_api().app(), limit_concurrency=LIMIT) as url:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        s = _connect(url)
        s.sendall(head + b"1\r\n \r\n" * 150_000)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        s.close()
        assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
        assert b"request body in pieces of 1 bytes on average (a body of more than 1024 pieces must average 256" \
            in answer
        body = json.dumps({"prompt": "hi", "max_tokens": 1, "pad": "x" * 600_000}).encode()
        chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 300]), body[i:i + 300]) for i in range(0, len(body), 300))
        s = _connect(url)
        s.sendall(head.replace(b"Host: x", b"Host: x\r\nConnection: close") + chunked + b"0\r\n\r\n")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        s.close()
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


@pytest.mark.parametrize("request_head, status, reason", [
    (b"GARBAGE\r\n\r\n", 400, "illegal request line: bytearray(b'GARBAGE')"),
    (b"GET /v1/models/\xff HTTP/1.1\r\nHost: x\r\n\r\n", 400, "illegal request line: bytearray(b'GET /v1/models/"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n", 400, "bad Content-Length"),
    (b"GET / HTTP/1.1\r\nX: " + b"a" * 70_000, 431, "Receive buffer too long"),
    # complete in one write: h11 holds only a head still arriving to its limit, and took this one
    (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 17_000 + b"\r\n\r\n", 431,
     "request head over 16 KiB")])
def test_a_request_that_cannot_be_parsed_is_an_openai_error(request_head, status, reason):
    """uvicorn answered it ``text/plain`` "Invalid HTTP request received.", logged alone (no
    peer, no reason), and a head over h11's limit 400 rather than 431."""
    with serving(_fake_api().app(), limit_concurrency=LIMIT) as url, logged_by_uvicorn() as records:
        s = _connect(url)
        s.sendall(request_head)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        s.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status) and b"content-type: application/json" in head.lower()
    lines = [r.getMessage() for r in records]
    assert len(lines) == 1 and re.fullmatch(r"invalid HTTP request from 127\.0\.0\.1:\d+ \(.*\); closing", lines[0])
    assert reason in lines[0] and lines[0].isprintable(), lines
    assert re.search(rb"\r\nx-request-id: req_[0-9a-f]{32}\r\n", head + b"\r\n", re.IGNORECASE)  # as every answer
    # a Date, as RFC 9110 6.6.1 asks of a 4xx
    assert re.search(rb"\r\ndate: \w{3}, \d\d \w{3} \d{4} [\d:]{8} GMT\r\n", head + b"\r\n", re.IGNORECASE)
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("coding", [b"Transfer-Encoding: gzip, chunked",
                                    b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked"])
def test_a_transfer_coding_not_supported_is_a_501_that_says_so(coding):
    """It was a 501 saying only "Invalid HTTP request received." (uvicorn's text for any request h11 refuses)."""
    with serving(_fake_api().app(), limit_concurrency=LIMIT) as url, logged_by_uvicorn():
        with _connect(url) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + coding + b"\r\n\r\n")
            response = http.client.HTTPResponse(s)
            response.begin()
            error = json.loads(response.read())["error"]
    assert response.status == 501 and error["type"] == "not_supported_error"
    assert "Transfer-Encoding" in error["message"], error


_GZIP_HEAD = b" HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"


@pytest.mark.parametrize("requests, status, llama", [
    ([b"POST /completion HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n900000\r\n"], 413, True),
    ([b"POST /tokenize HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 17_000 + b"\r\n\r\n"], 431, True),
    ([b"POST /completion?x=1" + _GZIP_HEAD], 501, True),  # a head h11 refuses: its route as it arrived
    ([b"POST http://h/apply-template" + _GZIP_HEAD], 501, True),
    ([b"POST /v1/completions" + _GZIP_HEAD], 501, False),
    ([b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", b"POST /detokenize" + _GZIP_HEAD], 501, True),
    ([b"GET /props HTTP/1.1\r\nHost: x\r\n\r\n", b"POST /v1/chat/completions" + _GZIP_HEAD], 501, False),
    ([b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\nPOST /tokenize" + _GZIP_HEAD], 501, True),  # pipelined
    ([b"POST /completion?q=" + b"a" * 300 + _GZIP_HEAD], 501, True)])
def test_a_request_refused_by_the_http_layer_gets_its_routes_error_shape(requests, status, llama):
    """On llama-server's routes a body past the limit in chunks, a head too large or a transfer
    coding refused were answered in OpenAI's shape (``code`` null where llama-server's clients
    read the status), while the same refusal from a Content-Length got llama-server's; and
    their JSON was spaced unlike every other answer's.  (Earlier requests on the connection
    are answered first; the refused one is the last.)"""
    with serving(_fake_api().app(), limit_concurrency=LIMIT) as url, logged_by_uvicorn():
        with _connect(url) as s:
            # one buffer for every answer: a reader per answer drops what it read past its own
            answers = io.BufferedReader(socket.SocketIO(s, "rb"))
            answers.close = lambda: None  # (http.client closes its reader after each answer)
            for request in requests:
                s.sendall(request)
                for _ in range(request.count(b" HTTP/1.1\r\n")):  # (pipelined: two in one write)
                    response = http.client.HTTPResponse(SimpleNamespace(makefile=lambda *args: answers))
                    response.begin()
                    body = response.read()
    answer = json.loads(body)
    assert response.status == status and body == json.dumps(answer, separators=(",", ":")).encode()
    if llama:
        assert set(answer["error"]) == {"code", "message", "type"} and answer["error"]["code"] == status
    else:
        assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["code"] is None


@pytest.mark.parametrize("request_head, version", [(b"GET /v1/models HTTP/9.9\r\nHost: x\r\n\r\n", "9.9"),
                                                   (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "2.0"),  # HTTP/2's preface
                                                   (b"GET /v1/models HTTP/0.9\r\n\r\n", "0.9")])
def test_an_http_version_other_than_1_x_is_a_505(request_head, version):
    """They were served as HTTP/1.1 (HTTP/2's preface a 501 for its PRI method, then a 400)."""
    with serving(_fake_api().app(), limit_concurrency=LIMIT) as url, logged_by_uvicorn():
        with _connect(url) as s:
            s.sendall(request_head)
            response = http.client.HTTPResponse(s)
            response.begin()
            error = json.loads(response.read())["error"]
            assert s.recv(1) == b""  # then the connection closes
    assert response.status == 505 and error["type"] == "not_supported_error"
    assert error["message"] == f"HTTP/{version} is not supported: this server speaks HTTP/1.1"


def test_options_star_is_named_as_sent():
    """Its 404 said "Invalid URL (OPTIONS /*)"."""
    with serving(_fake_api().app(), limit_concurrency=LIMIT) as url, logged_by_uvicorn():
        with _connect(url) as s:
            s.sendall(b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n")
            response = http.client.HTTPResponse(s)
            response.begin()
            message = json.loads(response.read())["error"]["message"]
    assert response.status == 404 and message == "Invalid URL (OPTIONS *)"


def test_a_stream_whose_client_reset_writes_nothing_more_and_asyncio_logs_nothing():
    """Pieces written after a reset, before the loop told the request its client had gone
    (here after a stall of the loop), each logged asyncio's "socket.send() raised exception."."""
    records, written = [], []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        time.sleep(0.5)  # the loop stalls; the client resets meanwhile
        for _ in range(50):
            await send({"type": "http.response.body", "body": b"x" * 100, "more_body": True})
        written.append(True)

    logging.getLogger("asyncio").addHandler(handler)
    try:
        with serving(app, limit_concurrency=LIMIT) as url:
            s = _connect(url)
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(4096).startswith(b"HTTP/1.1 200 ")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset on close
            s.close()
            _until(lambda: written, "the application wrote its pieces")
    finally:
        logging.getLogger("asyncio").removeHandler(handler)
    assert [r.getMessage() for r in records] == []


def test_a_head_of_just_the_largest_size_is_served():
    line, host = b"GET /v1/models HTTP/1.1\r\n", b"Host: x\r\n"
    filler = http_front.MAX_HEAD_BYTES - len(line) - len(host) - len(b"X-Big: \r\n\r\n")
    for size, status in ((filler, 200), (filler + 1, 431)):
        with serving(_fake_api().app(), limit_concurrency=LIMIT) as url, _connect(url) as s:
            s.settimeout(10)
            s.sendall(line + host + b"X-Big: " + b"a" * size + b"\r\n\r\n")
            response = http.client.HTTPResponse(s)
            response.begin()
            assert response.status == status


def test_the_bodies_being_received_share_one_budget(monkeypatch):
    monkeypatch.setattr(http_front, "MAX_BUFFERED_BODY_BYTES", 1000)
    with serving(_fake_api().app(), limit_concurrency=LIMIT) as url:
        held = _connect(url)  # a body that stops half-way holds 600 bytes of the budget
        held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1200\r\n\r\n" + b" " * 600)
        _until(lambda: http_front._buffered == 600, "the first body is buffered")
        r = httpx.post(url + "/v1/completions", content=b'{"prompt": "x"}' + b" " * 500, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
        assert httpx.post(url + "/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 200
        held.close()
        _until(lambda: http_front._buffered == 0, "a body given up gives its bytes back")


def test_routing_errors_are_openai_errors():
    with TestClient(_fake_api().app()) as client:
        missing = client.post("/v1/foo", json={})
        assert missing.status_code == 404
        assert missing.json()["error"] == {"message": "Invalid URL (POST /v1/foo)", "type": "invalid_request_error",
                                           "param": None, "code": None}
        wrong = client.get("/v1/chat/completions")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert wrong.json()["error"]["type"] == "invalid_request_error"
        assert client.request("PATCH", "/v1/models").status_code == 405  # defined by HTTP, not on this path
        for path in ("/v1/models", "/nowhere"):  # a method HTTP does not define, on any path (RFC 9110 9.1)
            unknown = client.request("BREW", path)
            assert unknown.status_code == 501
            assert unknown.json()["error"]["message"] == f"Method not implemented (BREW {path})"


def test_the_api_key_goes_in_either_header_and_the_scheme_in_any_case():
    with TestClient(_fake_api(api_keys=["s3cret"]).app()) as client:
        for headers in ({"Authorization": "Bearer s3cret"}, {"Authorization": "bearer s3cret"},
                        {"Authorization": "BEARER  s3cret"}, {"X-Api-Key": "s3cret"}):
            assert client.get("/v1/models", headers=headers).status_code == 200, headers
        for headers in ({"Authorization": "s3cret"}, {"Authorization": "Basic s3cret"}, {"X-Api-Key": "wrong"},
                        {"Authorization": "Bearer s3cret2"}, {"X-Api-Key": "Bearer s3cret"}):
            r = client.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", headers
            assert r.headers["www-authenticate"] == "Bearer"  # RFC 9110 11.6.1: the scheme to use


def test_one_key_given_as_a_string_is_one_key():
    # a str was taken as its characters, each a key: "s" alone was let in
    with TestClient(_fake_api(api_keys="s3cret").app()) as client:
        assert client.get("/v1/models", headers={"X-Api-Key": "s3cret"}).status_code == 200
        assert client.get("/v1/models", headers={"X-Api-Key": "s"}).status_code == 401


def test_any_of_several_keys_admits_and_no_other():
    # one key was all it took: a second --api-key replaced the first, and a key file's lines after its first went unread
    with TestClient(_fake_api(api_keys=["alpha", "beta"]).app()) as client:
        for headers in ({"Authorization": "Bearer alpha"}, {"X-Api-Key": "beta"}, {"Authorization": "Bearer beta"}):
            assert client.get("/v1/models", headers=headers).status_code == 200, headers
        for headers in ({"Authorization": "Bearer alpha,beta"}, {"X-Api-Key": "alph"}, {"Authorization": "Basic beta"}):
            assert client.get("/v1/models", headers=headers).status_code == 401, headers


def test_llama_servers_routes_refuse_in_its_error_shape_whoever_refuses():
    """A missing key, a foreign origin and a wrong method on llama-server's own routes got
    OpenAI's error object (``code`` a name or null); its clients read the HTTP status there."""
    with TestClient(_fake_api(api_keys=["k"], cors_origins=("http://page.example",)).app()) as client:
        for method, path, headers, status, kind in (
                ("POST", "/completion", {}, 401, "authentication_error"),
                ("POST", "/tokenize", {"Origin": "http://evil.example", "Authorization": "Bearer k"}, 403,
                 "invalid_request_error"),
                ("GET", "/tokenize", {"Authorization": "Bearer k"}, 405, "invalid_request_error"),
                ("GET", "/slots", {"Authorization": "Bearer k"}, 501, "not_supported_error")):
            r = client.request(method, path, json={"content": "x"} if method == "POST" else None, headers=headers)
            error = r.json()["error"]
            assert r.status_code == status and set(error) == {"code", "message", "type"}, r.text
            assert error["code"] == status and error["type"] == kind and error["message"], r.text
            if status == 401:  # llama-server's words (they said how to send a key, in words of their own)
                assert error["message"] == "Invalid API Key"
        assert client.get("/tokenize", headers={"Authorization": "Bearer k"}).headers["allow"] == "POST"
        r = client.get("/v1/models")  # OpenAI's routes keep OpenAI's object
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.json()["error"]["message"] == "Invalid API Key"


def test_health_is_open_under_either_of_its_paths():
    """/v1/health, the same route, asked for the key that /health does not need."""
    with TestClient(_fake_api(api_keys=["s3cret"]).app()) as client:
        for path in ("/health", "/v1/health"):
            r = client.get(path)
            assert r.status_code == 200 and r.json() == {"status": "ok"}, path


def _post_raw(url: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = _connect(url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


@contextlib.contextmanager
def _serving_request_a(**api_options):
    """An API served whose fake engine holds request "A" generating until its gate opens:
    yields the engine, the API, its URL, a pool of two clients and A's future."""
    engine = FakeEngine()
    api = _fake_api(engine, **api_options)
    engine.gate.clear()
    with serving(api.app(), limit_concurrency=LIMIT) as url, ThreadPoolExecutor(2) as pool:
        first = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "A"}, timeout=30)
        _until(lambda: engine.prompts == ["A"], "request A generates")
        yield engine, api, url, pool, first


def test_a_queued_client_that_leaves_gives_its_place_up_at_once():
    with _serving_request_a(max_queue=1) as (engine, api, url, pool, first):
        with _post_raw(url, {"prompt": "B"}):
            _until(lambda: api.admission.waiting == 1, "the second request queues")
        # Its client gone, it leaves the queue while the lane is still busy ...
        _until(lambda: api.admission.waiting == 0, "the abandoned request leaves the queue")
        # counted once, as cancelled (it was counted nowhere)
        assert (engine.counters["requests"], engine.counters["cancelled"]) == (1, 1)
        third = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "C"}, timeout=30)
        _until(lambda: api.admission.waiting == 1, "the third request queues in its place")
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert metrics.count("\nskippy_queue_depth 1\n") == metrics.count("\nllamacpp:requests_deferred 1\n") == 1
        engine.gate.set()
        # ... and never runs: the lane goes to the next in line.
        assert [f.result().json()["choices"][0]["text"] for f in (first, third)] == ["ok", "ok"]
    assert engine.prompts == ["A", "C"]
    assert (api.admission.running, api.admission.waiting) == (0, 0)


def test_a_request_whose_client_left_before_admission_never_generates():
    # (a stream: one that has started would be cancelled, but only after its prefill)
    engine, servers = FakeEngine(), []
    api = _fake_api(engine)
    engine.tokenizer.hold.clear()
    with serving(api.app(), servers, limit_concurrency=LIMIT) as url:
        with _post_raw(url, {"prompt": "A", "stream": True}):
            assert engine.tokenizer.encoding.wait(10)
        _until(lambda: not servers[0].server_state.connections, "the server sees the client go")
        engine.tokenizer.hold.set()  # the request goes on to admission, a lane free
        _until(lambda: not servers[0].server_state.tasks, "the request is handled")
        assert (api.admission.running, api.admission.waiting) == (0, 0)
        r = httpx.post(url + "/v1/completions", json={"prompt": "B", "stream": True}, timeout=30)
        assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert engine.prompts == ["B"]


class FloodingEngine(FakeEngine):
    """Streams 256 KiB pieces of text, ten a second, until cancelled (64 at most)."""

    def generate(self, prompt, *, max_tokens, sampling, stop, on_text, cancelled, **ends) -> Generation:
        for _ in range(64):
            if cancelled.is_set():
                self.counters["flood_cancelled"] += 1
                raise Cancelled("stop")
            on_text("x" * (256 << 10), [120])
            time.sleep(0.1)
        return Generation(text="", prompt_tokens=len(prompt), completion_tokens=64, finish_reason="length")


def test_a_stream_whose_client_reads_nothing_is_closed(monkeypatch):
    # Its connection was held for good: never quiet (an answer unfinished), so never shed.
    monkeypatch.setattr(http_front, "STALLED_READER_S", 0.5)
    engine, servers = FloodingEngine(), []
    with serving(_fake_api(engine).app(), servers, limit_concurrency=LIMIT) as url, logged_by_uvicorn() as records:
        host, port = url.removeprefix("http://").split(":")
        reader = socket.socket()
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        reader.connect((host, int(port)))
        with reader:
            body = json.dumps({"prompt": "A", "stream": True}).encode()
            reader.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            _until(lambda: engine.counters["flood_cancelled"] == 1, "the stalled stream is cancelled")
            _until(lambda: not servers[0].server_state.connections, "its connection is closed")
    assert "a client read none of its answer for 0.5 s: its connection is closed" in [r.getMessage() for r in records]
    assert not _errors(records)


def test_health_asks_every_stage():
    """With stages someone else runs (``--connect``), a later stage that is gone makes
    /health 503 although stage 0 still holds a live connection for the engine."""
    chain = Chain([(0, 2), (2, 4), (4, 6)])
    api = Api(GenerationEngine(chain.entry, FakeTokenizer(), ctx_size=64, timeout=10, chunk_size=4),
              model_id="m", chat_template=None, max_inflight=1)
    try:
        with TestClient(api.app()) as client:
            assert client.get("/health").json() == {"status": "ok"}
            assert client.get("/health").json() == {"status": "ok"}  # a pooled connection reused
            chain.servers[2].shutdown()  # the last stage goes
            r = client.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "unavailable" and r.json()["error"]["message"], r.json()
    finally:
        api.close()
        chain.close()


def test_a_batch_of_prompts_on_one_lane_runs_one_after_another():
    engine = FakeEngine(ctx_size=64)
    with TestClient(_fake_api(engine).app()) as client:
        r = client.post("/v1/completions", json={"prompt": ["hi", [111, 107], "yo"], "max_tokens": -1})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [(c["index"], c["text"], c["finish_reason"]) for c in body["choices"]] == \
            [(0, "ok", "stop"), (1, "ok", "stop"), (2, "ok", "stop")]
        assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}
        assert engine.prompts == ["hi", "ok", "yo"]
        assert [q["max_tokens"] for q in engine.requests] == [62, 62, 62]  # each its own rest of the context
        # streamed: each choice's text and its end, by index, then [DONE]
        r = client.post("/v1/completions", json={"prompt": ["a", "b"], "stream": True,
                                                 "stream_options": {"include_usage": True}})
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert [(c["choices"][0]["index"], c["choices"][0]["text"], c["choices"][0]["finish_reason"])
                for c in chunks[:-1]] == [(0, "ok", None), (0, "", "stop"), (1, "ok", None), (1, "", "stop")]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 2
        # bounded, and every element must be a prompt
        r = client.post("/v1/completions", json={"prompt": ["x"] * (MAX_PROMPTS + 1)})
        assert r.status_code == 400 and r.json()["error"]["message"] == \
            f"'prompt' may hold at most {MAX_PROMPTS} prompts ({MAX_PROMPTS} generations with 'n')"
        for bad in (["x", []], ["x", [1.5]], [True], ["x", [1, None]]):
            r = client.post("/v1/completions", json={"prompt": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", (bad, r.text)
    assert len(engine.prompts) == 5  # nothing generated for a refused batch


def test_a_batch_borrows_the_idle_lanes_and_gives_them_back():
    with _serving_request_a(max_inflight=3) as (engine, api, url, pool, lone):
        batch = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": ["b0", "b1", "b2"]}, timeout=30)
        # two lanes idle: the batch's own and one borrowed generate side by side ...
        _until(lambda: sorted(engine.prompts) == ["A", "b0", "b1"], "the batch borrows the idle lane")
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert "\nskippy_requests_running 2\n" in metrics and "\nskippy_lanes_busy 3\n" in metrics, metrics
        # llama-server's counts its busy slots, as the lanes busy here
        assert "\n# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 3\n" in metrics, metrics
        time.sleep(0.2)
        assert len(engine.prompts) == 3  # ... and the third prompt waits for one of them
        engine.gate.set()
        assert lone.result().status_code == 200
        assert [c["text"] for c in batch.result().json()["choices"]] == ["ok"] * 3
    assert sorted(engine.prompts) == ["A", "b0", "b1", "b2"]
    assert (api.admission.running, api.admission.borrowed, api.admission.waiting) == (0, 0, 0)


@pytest.mark.parametrize("route", ["/v1/completions", "/completion"])
def test_a_batch_is_refused_at_its_first_prompt_too_long_before_the_rest_is_tokenized(route, monkeypatch):
    """All 48 prompts of a batch were tokenized (one thread for every request: about 10 s of
    SmolLM2's tokenizer, everyone's completions waiting) before the first was found too long."""
    engine = FakeEngine(ctx_size=64)
    encoded = []
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text, add_bos=None: encoded.append(text) or
                        list(text.encode("utf-8")))
    with TestClient(_fake_api(engine).app()) as client:
        r = client.post(route, json={"prompt": ["a", "x" * 100, "b", "c"], "max_tokens": 1})
    assert r.status_code == 400 and "context" in r.text, r.text
    assert encoded == ["a", "x" * 100] and not engine.prompts


def test_a_request_waits_for_one_prompt_of_a_batch_at_the_tokenizer_not_all_of_them(monkeypatch):
    """The one tokenizing thread read a whole batch as one task: 48 long prompts that each fit
    held every other request's tokenizing for about 10 s."""
    engine = FakeEngine()
    first, release, encoded = threading.Event(), threading.Event(), []

    def encode(text, add_bos=None):
        encoded.append(text)
        if text == "b0":  # the batch's first prompt holds the tokenizer until "L" queues behind it
            first.set()
            assert release.wait(30)
        return list(text.encode("utf-8"))

    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    api = _fake_api(engine, max_inflight=2)
    with serving(api.app(), limit_concurrency=LIMIT) as url, ThreadPoolExecutor(2) as pool:
        batch = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": ["b0", "b1", "b2"], "max_tokens": 1},
                            timeout=30)
        assert first.wait(10)
        lone = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "L", "max_tokens": 1}, timeout=30)
        _until(lambda: api._tokenizer_waiting == 2, "the lone request waits for the tokenizer")
        release.set()
        assert lone.result().status_code == batch.result().status_code == 200
    assert encoded == ["b0", "L", "b1", "b2"]


def test_a_batch_whose_client_left_is_read_no_further(monkeypatch):
    """Its prompts were all tokenized for nobody (about 10 s for 48 long ones, everyone's
    completions waiting) before the queue found the client gone."""
    engine = FakeEngine()
    release, encoded = threading.Event(), []

    def encode(text, add_bos=None):
        encoded.append(text)
        assert text != "b0" or release.wait(30)  # the first prompt holds the tokenizer
        return list(text.encode("utf-8"))

    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    with serving(_fake_api(engine).app(), limit_concurrency=LIMIT) as url:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
            httpx.post(url + "/v1/completions", json={"prompt": ["b0", "b1", "b2"], "max_tokens": 1}, timeout=0.5)
        release.set()
        _until(lambda: engine.counters["cancelled"] == 1, "the request is counted as cancelled")
    assert encoded == ["b0"] and not engine.prompts


def test_a_tokenize_text_over_the_limit_is_refused_without_queueing_for_the_tokenizer():
    """It waited behind whatever held the one tokenizing thread (a long batch) before its
    size was looked at, its parsed body kept meanwhile."""
    engine = FakeEngine()
    engine.tokenizer.hold.clear()  # the tokenizer busy with another request
    with serving(_fake_api(engine).app(), limit_concurrency=LIMIT) as url, ThreadPoolExecutor(1) as pool:
        busy = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=30)
        assert engine.tokenizer.encoding.wait(10)
        r = httpx.post(url + "/tokenize", json={"content": "x" * (MAX_TOKENIZE_BYTES + 1)}, timeout=5)
        assert r.status_code == 400 and "/tokenize takes at most" in r.json()["error"]["message"], r.text
        engine.tokenizer.hold.set()
        assert busy.result().json()["choices"][0]["text"] == "ok"


def test_requests_beyond_what_the_lanes_and_queue_hold_are_refused_at_the_tokenizer():
    """Requests queued for the one tokenizing thread without bound, each keeping its parsed
    body (8 MB bodies behind a long batch took the api from 229 to 639 MiB)."""
    engine = FakeEngine()
    engine.tokenizer.hold.clear()
    api = _fake_api(engine, max_inflight=1, max_queue=1)
    with serving(api.app(), limit_concurrency=LIMIT) as url, ThreadPoolExecutor(2) as pool:
        held = [pool.submit(httpx.post, url + "/v1/completions", json={"prompt": p, "max_tokens": 1}, timeout=30)
                for p in ("a", "b")]
        _until(lambda: api._tokenizer_waiting == 2, "two requests at the tokenizer")
        # OpenAI's error object on its routes, llama-server's (its type for a 503) on its own
        for route, body, code, kind in (("/v1/completions", {"prompt": "c"}, "queue_full", "server_error"),
                                        ("/tokenize", {"content": "c"}, 503, "unavailable_error"),
                                        ("/completion", {"prompt": "c"}, 503, "unavailable_error")):
            r = httpx.post(url + route, json=body, timeout=5)
            assert r.status_code == 503 and r.json()["error"]["code"] == code, r.text
            assert r.json()["error"]["type"] == kind, r.text
            assert r.headers["Retry-After"] and "wait for the tokenizer" in r.json()["error"]["message"]
        engine.tokenizer.hold.set()
        assert [f.result().status_code for f in held] == [200, 200]
    assert api._tokenizer_waiting == 0


class PerPromptEngine(FakeEngine):
    """A FakeEngine whose generation of a prompt named in ``held`` waits for its own event."""

    def __init__(self, held) -> None:
        super().__init__()
        self.held = {prompt: threading.Event() for prompt in held}

    def generate(self, prompt, **kw) -> Generation:
        assert self.held.get(bytes(prompt).decode(), self.gate).wait(30)
        return super().generate(prompt, **kw)


def test_a_batch_gives_its_borrowed_lanes_back_to_a_request_that_waits():
    """A batch (or n choices) kept every lane it borrowed until all its generations were done:
    one request with n=64 made the next request wait its whole length."""
    engine = PerPromptEngine(["b0", "b1", "b2", "b3"])
    api = _fake_api(engine, max_inflight=2)
    with serving(api.app(), limit_concurrency=LIMIT) as url, ThreadPoolExecutor(2) as pool:
        batch = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": ["b0", "b1", "b2", "b3"]},
                            timeout=30)
        _until(lambda: api.admission.borrowed == 1 and len(engine.held) == 4 and api.admission.running == 2,
               "the batch borrows the idle lane")
        lone = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "L"}, timeout=30)
        _until(lambda: api.admission.waiting == 1, "a request waits")
        engine.held["b0"].set()
        engine.held["b1"].set()  # both lanes free: the borrowed one goes to L, the batch's own takes b2
        assert lone.result().json()["choices"][0]["text"] == "ok"
        assert "b3" not in engine.prompts and not batch.done()
        engine.held["b2"].set()
        engine.held["b3"].set()
        assert [c["text"] for c in batch.result().json()["choices"]] == ["ok"] * 4
    assert (api.admission.running, api.admission.borrowed, api.admission.waiting) == (0, 0, 0)


def test_borrowers_take_only_idle_lanes_and_never_before_a_waiting_request():
    async def scenario():
        admission = Admission(max_inflight=3, max_queue=4)
        first, second = admission.ticket(), admission.ticket()
        assert first.done() and second.done() and admission.borrow(5) == 1  # only the one idle lane
        waiting = admission.ticket()
        assert not waiting.done() and admission.borrow(1) == 0
        admission.give_back()  # the borrowed lane goes to the request in line, not to a borrower
        assert waiting.done() and admission.borrow(1) == 0
        assert (admission.running, admission.borrowed, admission.waiting) == (3, 0, 0)

    asyncio.run(scenario())


def test_n_choices_each_prompt_with_the_next_seed():
    engine = FakeEngine(ctx_size=64)
    with TestClient(_fake_api(engine).app()) as client:
        r = client.post("/v1/completions", json={"prompt": ["hi", "yo"], "n": 2, "seed": 7, "temperature": 1})
        assert [(c["index"], c["text"]) for c in r.json()["choices"]] == [(0, "ok"), (1, "ok"), (2, "ok"), (3, "ok")]
        # each prompt's tokens count once, however many choices it has (as OpenAI bills them)
        assert r.json()["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
        assert engine.prompts == ["hi", "hi", "yo", "yo"]  # prompt by prompt, n of each
        assert [q["sampling"].seed for q in engine.requests] == [7, 8, 7, 8]
        client.post("/v1/completions", json={"prompt": "hi", "n": 2, "seed": 2**32 - 2})
        assert [q["sampling"].seed for q in engine.requests[-2:]] == [2**32 - 2, 2**32 - 1]
        client.post("/v1/completions", json={"prompt": "hi", "n": 2})  # unseeded: each draws its own
        assert [q["sampling"].seed for q in engine.requests[-2:]] == [None, None]
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "n": 2})
        assert [(c["index"], c["message"]) for c in chat.json()["choices"]] == \
            [(0, {"role": "assistant", "content": "ok", "refusal": None}),
             (1, {"role": "assistant", "content": "ok", "refusal": None})]
        assert chat.json()["usage"]["completion_tokens"] == 2
        stream = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "n": 2,
                                                           "stream": True})
        chunks = [json.loads(line[len("data: "):]) for line in stream.text.splitlines()
                  if line.startswith("data: {")]
        assert [(c["choices"][0]["index"], c["choices"][0]["delta"], c["choices"][0]["finish_reason"])
                for c in chunks] == [(0, {"role": "assistant", "refusal": None, "content": ""}, None),
                                     (1, {"role": "assistant", "refusal": None, "content": ""}, None),
                                     (0, {"content": "ok"}, None), (0, {}, "stop"),
                                     (1, {"content": "ok"}, None), (1, {}, "stop")]
        before = len(engine.prompts)
        r = client.post("/v1/completions", json={"prompt": ["a"] * 33, "n": 2})  # 66 generations
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        r = client.post("/v1/completions", json={"prompt": "a", "n": 65})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert len(engine.prompts) == before


def test_llama_server_routes_without_v1_and_its_props():
    with TestClient(_fake_api(FakeEngine(ctx_size=64)).app()) as client:
        assert client.get("/models").json() == client.get("/v1/models").json()
        assert client.get("/v1/health").json() == client.get("/health").json() == {"status": "ok"}
        r = client.post("/completions", json={"prompt": "Hi", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ok"
        r = client.post("/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["object"] == "chat.completion"
        props = client.get("/props").json()
        settings = props["default_generation_settings"]
        assert settings["n_ctx"] == 64 and props["total_slots"] == 1
        # /completion's defaults, as the llama.cpp web UI reads them
        assert {k: settings["params"][k] for k in ("temperature", "top_k", "top_p", "min_p", "n_predict")} == {
            "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "n_predict": -1}
        assert props["model_path"] == "m" and props["chat_template"] == ROLE_TEMPLATE.source
        assert props["bos_token"] == "" and props["eos_token"] == "<b0>"  # the model has no BOS, its EOS
        # no slots to list or save: llama-server's answer where its slots endpoint is off
        for r in (client.get("/slots"), client.post("/slots/0?action=save", json={"filename": "x"})):
            assert r.status_code == 501 and r.json() == {"error": {
                "code": 501, "message": "This server does not support slots endpoint.", "type": "not_supported_error"}}
        # nor embeddings, reranking or infill: 501 as llama-server started without them (a 404 reads as a
        # wrong base URL to its clients), in its shape on its routes and in OpenAI's under /v1
        for path, what in (("/embedding", "embeddings"), ("/embeddings", "embeddings"), ("/rerank", "reranking"),
                           ("/reranking", "reranking"), ("/infill", "infill")):
            r = client.post(path, json={"content": "hi"})
            assert r.status_code == 501 and r.json() == {"error": {
                "code": 501, "message": f"This server does not support {what}.", "type": "not_supported_error"}}
        for path, what in (("/v1/embeddings", "embeddings"), ("/v1/rerank", "reranking")):
            r = client.post(path, json={"input": "hi"})
            assert r.status_code == 501 and r.json()["error"]["message"] == f"This server does not support {what}."
            assert r.json()["error"]["type"] == "not_supported_error"


def test_llama_server_request_conventions():
    engine = FakeEngine(ctx_size=64)
    with TestClient(_fake_api(engine).app()) as client:
        # a batch of one token list, as the openai client types allow
        assert client.post("/v1/completions", json={"prompt": [[104, 105]]}).status_code == 200
        assert engine.prompts[-1] == "hi"
        # n_predict is max_tokens; -1 is the rest of the context
        client.post("/v1/completions", json={"prompt": "hi", "n_predict": 5})
        assert engine.requests[-1]["max_tokens"] == 5
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1})
        assert engine.requests[-1]["max_tokens"] == 64 - 2
        # ignore_eos: every end-of-generation token is banned, beside the client's own biases
        client.post("/v1/completions", json={"prompt": "hi", "ignore_eos": True, "logit_bias": {"7": 1}})
        sampling = engine.requests[-1]["sampling"]
        assert sampling.logit_bias == {7: 1.0, 0: float("-inf")} and sampling.wire().ignore_eos
        # a final assistant message is continued from its text
        client.post("/v1/chat/completions", json={"messages": [
            {"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]})
        assert engine.prompts[-1] == "user: Count\n1, 2,"
        # ... and so is a lone one, and an assistant's refusal part is its text
        client.post("/v1/chat/completions", json={"messages": [{"role": "assistant", "content": "Once"}]})
        assert engine.prompts[-1] == "Once"
        client.post("/v1/chat/completions", json={"messages": [
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
            {"role": "user", "content": "Ok"}]})
        assert engine.prompts[-1] == "assistant: No.\nuser: Ok\n"
        # a trailing slash is not a route (Starlette would redirect, which clients don't follow)
        for method, path in (("GET", "/v1/models/"), ("POST", "/v1/chat/completions/")):
            r = client.request(method, path, json={}, follow_redirects=False)
            assert r.status_code == 404, (path, r.status_code)


def test_cross_origin_calls_only_from_the_origins_given():
    """A browser page may call the API only from a ``--cors-origin``; its preflight needs no
    key, the call itself still does."""
    page, key = "http://page.example:8080", {"Authorization": "Bearer k"}
    preflight = {"Origin": page, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    with TestClient(_fake_api(api_keys=["k"]).app()) as client:  # the default: no cross-origin calls
        r = client.options("/v1/completions", headers=preflight)
        assert r.status_code == 401 and "access-control-allow-origin" not in r.headers
        # the call itself is refused too: CORS alone would only hide the answer from the page
        r = client.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": page, **key})
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in r.headers
    engine = FakeEngine()
    with TestClient(_fake_api(engine).app()) as client:  # no key: a "simple" POST needs no preflight
        r = client.post("/v1/completions", content='{"prompt": "x"}',
                        headers={"Origin": page, "Content-Type": "text/plain"})
        assert r.status_code == 403 and engine.prompts == []
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200  # no Origin: no page
    with TestClient(_fake_api(cors_origins=("*",)).app()) as client:
        assert client.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": page}).status_code == 200
    with TestClient(_fake_api(api_keys=["k"], cors_origins=(page,)).app()) as client:
        r = client.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        assert "POST" in r.headers["access-control-allow-methods"]
        r = client.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": page, **key})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        assert client.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": page}).status_code == 401
        other = client.options("/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        # an error object like every other refusal (the CORS library's was plain text)
        assert other.json() == {"error": {"message": "Disallowed CORS origin", "type": "invalid_request_error",
                                          "param": None, "code": None}}
        r = client.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": "http://evil.example", **key})
        assert r.status_code == 403


@pytest.mark.parametrize("text", ["http://page.example/", "page.example", "ftp://page.example", "http://a:99999",
                                  "http://[::1"])
def test_a_cors_origin_is_checked_as_browsers_send_it(text):
    with pytest.raises(argparse.ArgumentTypeError, match="an origin is SCHEME://HOST"):
        web_origin(text)
    assert web_origin("https://page.example") == "https://page.example" and web_origin("*") == "*"


@pytest.mark.parametrize("text, sent", [
    ("http://[0:0::1]:3000", "http://[::1]:3000"), ("http://localhost:80", "http://localhost"),
    ("HTTP://[::1]:4000", "http://[::1]:4000"), ("http://[::1]:0443", "http://[::1]:443"),
    ("https://Page.Example:443", "https://page.example")])
def test_a_cors_origin_is_kept_as_a_browser_sends_it(text, sent):
    """Taken as written, such an origin matched no browser's Origin header (or was refused:
    the scheme's case)."""
    assert web_origin(text) == sent
    with TestClient(_fake_api(cors_origins=(web_origin(text),)).app()) as client:
        r = client.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": sent})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == sent


def test_props_names_the_model_file_and_the_alias_apart():
    """`model_path` said the model id (the alias with -a), where llama-server gives the GGUF path."""
    with TestClient(_fake_api(model_path="/models/m.gguf").app()) as client:
        assert client.get("/props").json()["model_path"] == "/models/m.gguf"
        assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["m"]


def test_a_stop_answers_the_queued_requests_at_once_and_lets_the_running_one_finish():
    engine = FakeEngine()
    engine.gate.clear()  # the running request holds its lane until the gate opens
    api = _fake_api(engine)
    said: list[str] = []
    listener = socket.create_server(("127.0.0.1", 0))
    server = http_front.StoppingServer(uvicorn.Config(api.app(), log_level="warning", lifespan="off",
                                                      timeout_graceful_shutdown=30), said.append,
                                       api.admission.refuse_waiting)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    url = "http://127.0.0.1:%d/v1/completions" % listener.getsockname()[1]
    answers: dict[str, httpx.Response] = {}

    def call(name: str) -> None:
        answers[name] = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=60)

    running, queued = (threading.Thread(target=call, args=(name,), daemon=True) for name in ("running", "queued"))
    try:
        running.start()
        _until(lambda: api.admission.running == 1, "the first request runs")
        queued.start()
        _until(lambda: api.admission.waiting == 1, "the second request waits")
        server.should_exit = True
        queued.join(20)  # answered while the running one still holds its lane (30 s of grace)
        assert answers["queued"].status_code == 503, answers
        assert answers["queued"].json()["error"]["code"] == "shutting_down"
        assert "running" not in answers
        engine.gate.set()
        running.join(20)
        thread.join(20)
    finally:
        engine.gate.set()
        server.should_exit = True
        listener.close()
    assert answers["running"].status_code == 200
    assert said == ["stopping: 1 request(s) in flight get up to 30 s to finish (Ctrl-C again: stop now); "
                    "1 queued refused"]


def test_a_signal_ignored_when_the_server_starts_stays_ignored():
    """uvicorn handles Ctrl-C whatever its handler was: `skippy-wire api &` in a script (its
    SIGINT ignored, as a shell starts background jobs) stopped at a Ctrl-C meant for another
    program, unlike every other command."""
    listener = socket.create_server(("127.0.0.1", 0))
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        server = http_front.StoppingServer(uvicorn.Config(_fake_api().app(), log_level="warning", lifespan="off"),
                                           lambda line: None)

        def ctrl_c_once_serving() -> None:  # uvicorn's handlers are in place once it has started
            deadline = time.monotonic() + 10
            while not server.started and time.monotonic() < deadline:
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
            server.should_exit = True

        ctrl_c = threading.Thread(target=ctrl_c_once_serving, daemon=True)
        ctrl_c.start()
        server.run(sockets=[listener])  # in the main thread: uvicorn installs its handlers only there
        ctrl_c.join()
    finally:
        signal.signal(signal.SIGINT, previous)
        listener.close()
    assert server.stopped_by is None and not server.force_exit


def test_a_stop_says_what_it_waits_for_and_what_it_cut_off(caplog):
    # a request that never finishes: the stop names it and its grace period, then the cut-off
    # in the command's own lines, where uvicorn logged an ERROR
    entered = threading.Event()

    async def endless(request):
        entered.set()
        await asyncio.sleep(60)

    said: list[str] = []
    listener = socket.create_server(("127.0.0.1", 0))
    server = http_front.StoppingServer(uvicorn.Config(Starlette(routes=[Route("/", endless)]), log_level="warning",
                                                      lifespan="off", timeout_graceful_shutdown=0.3), said.append)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    def call() -> None:
        with contextlib.suppress(httpx.HTTPError):  # cut off
            httpx.get("http://127.0.0.1:%d/" % listener.getsockname()[1], timeout=10)

    client = threading.Thread(target=call, daemon=True)
    try:
        client.start()
        assert entered.wait(10)
        with caplog.at_level(logging.ERROR, logger="uvicorn.error"):
            server.should_exit = True
            thread.join(10)
    finally:
        server.should_exit = True
        listener.close()
    assert said == ["stopping: 1 request(s) in flight get up to 0.3 s to finish (Ctrl-C again: stop now)",
                    "stopping: 1 request(s) cut off"]
    assert not [r for r in caplog.records if "Cancel" in r.getMessage()]


def test_an_api_open_beyond_loopback_without_a_key_is_warned_about():
    assert open_api_warning("127.0.0.1", 9337, []) is None
    assert open_api_warning("0.0.0.0", 9337, ["secret"]) is None
    for host in ("0.0.0.0", "10.0.0.5"):
        assert open_api_warning(host, 9337, []) == (
            f"warning: listening on {host}:9337, beyond loopback, without --api-key: anyone who can reach this port "
            "can generate (docs/security.md)")


@pytest.mark.parametrize("size_line", [b"800001", b"ffffffffffffffffff"])
def test_a_chunk_declared_past_the_body_limit_is_refused_at_its_size_line(size_line):
    """A chunk of 8 MiB + 1 (or of more than 2^64 bytes) held its connection until the body
    timeout (30 s, then 408), where a Content-Length past the limit got 413 at once."""
    with serving(_fake_api().app(), limit_concurrency=LIMIT) as url:
        s = _connect(url)
        s.settimeout(10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"10\r\n" + b"x" * 16 + b"\r\n" + size_line + b"\r\nabc")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        s.close()
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b"the request body is larger than 8 MiB" in answer


@pytest.mark.parametrize("body", [b"800001\r\nabc", b"1\r\na\r\n" * 1100], ids=["413", "tiny-pieces"])
def test_a_body_refused_mid_way_leaves_no_traceback_in_the_log(body):
    """A route that does not read its body answered after the refusal had: h11 refused that second
    answer and uvicorn logged "Exception in ASGI application" with a traceback, one per request."""
    with serving(_fake_api().app(), limit_concurrency=LIMIT) as url, logged_by_uvicorn() as records:
        s = _connect(url)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
        s.close()
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 200  # (the task ended meanwhile)
    assert answer.startswith((b"HTTP/1.1 413 ", b"HTTP/1.1 400 ")) and answer.count(b"HTTP/1.1 ") == 1, answer[:300]
    assert not _errors(records), _errors(records)
