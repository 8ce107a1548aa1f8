"""The API's port while its pipeline starts: llama-server's 503 "Loading model" at once (a
health check waited on a connection nobody accepted until the stages were up), then the
socket is the HTTP server's."""

from __future__ import annotations

import http.client
import json
import socket
import threading

from skippy_wire.tools.http_loading import LoadingAnswers

#: llama-server's answer while it loads its model.
LOADING_ERROR = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}


def _stop_within(loading: LoadingAnswers, seconds: float = 5.0) -> None:
    """``loading.stop()``, failing the test (not hanging it) if it does not return in time."""
    stopping = threading.Thread(target=loading.stop, daemon=True)
    stopping.start()
    stopping.join(seconds)
    assert not stopping.is_alive(), "stop() did not end the answering thread"


def test_every_request_while_loading_is_a_503_and_the_socket_is_handed_over_after():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    loading = LoadingAnswers(listener)
    try:
        for method, path in (("GET", "/health"), ("POST", "/v1/completions"), ("HEAD", "/")):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request(method, path, body=b"{}" if method == "POST" else None)
            answer = conn.getresponse()
            assert (answer.status, answer.getheader("retry-after"), answer.getheader("connection")) == \
                (503, "1", "close")
            assert json.loads(answer.read() or b"null") == (LOADING_ERROR if method != "HEAD" else None)
            assert answer.getheader("date", "").endswith(" GMT")
            conn.close()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:  # HEAD: the head alone
            raw.sendall(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while chunk := raw.recv(4096):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 503 ") and answer.endswith(b"\r\n\r\n")
    finally:
        _stop_within(loading)
    # stopped: a new connection waits for the server that takes the socket over
    with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
        listener.settimeout(10)
        accepted, _ = listener.accept()
        accepted.close()
    listener.close()


def test_stopping_after_the_listener_closed_ends_at_once():
    listener = socket.create_server(("127.0.0.1", 0))
    loading = LoadingAnswers(listener)
    listener.close()
    loading._thread.join(5)
    assert not loading._thread.is_alive()  # it ended on its own: its listener is gone
    _stop_within(loading)
