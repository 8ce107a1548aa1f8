"""What the API's port answers while the pipeline behind it starts: llama-server's 503
"Loading model" to every request, at once, so that a health check (a load balancer's, a
container's readiness probe) reads "not yet" instead of waiting on a connection nobody
accepts until the stages are up.  uvicorn takes the listening socket over afterwards."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from email.utils import formatdate

from .error_shapes import RETRY_AFTER_S, error_object, llama_error

#: llama-server's answer while it loads its model.
LOADING_ERROR = llama_error(503, error_object("Loading model"))
#: Seconds a request's head may take to arrive, and its answer to be taken.
_IO_S = 1.0
#: Seconds between looks at whether loading has ended.
_POLL_S = 0.05


class LoadingAnswers:
    """Answers every connection to ``listener`` with :data:`LOADING_ERROR` from a thread,
    until :meth:`stop` (then the socket is the HTTP server's, connections that wait in its
    backlog included)."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="loading-answers", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self.listener], [], [], _POLL_S)
                if ready:
                    conn, _ = self.listener.accept()
                    with conn:
                        _answer(conn)
            except (OSError, ValueError):  # the listener closed (the command ending), or a client gone
                if self.listener.fileno() < 0:
                    return


def _answer(conn: socket.socket) -> None:
    conn.settimeout(_IO_S)
    try:
        request = conn.recv(1 << 16)  # the request's head (what is unread is drained after the answer)
    except OSError:
        return
    body = json.dumps(LOADING_ERROR).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ndate: {formatdate(usegmt=True)}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\nretry-after: {RETRY_AFTER_S}\r\n"
            "connection: close\r\n\r\n")
    try:
        conn.sendall(head.encode() + (b"" if request.startswith(b"HEAD ") else body))  # HEAD: the head alone
        conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + _IO_S
        while time.monotonic() < deadline and conn.recv(1 << 16):  # unread bytes would reset the answer away
            pass
    except OSError:
        pass
