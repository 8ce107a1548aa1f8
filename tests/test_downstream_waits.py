"""A stage's waits on its downstream end with the connection they are for: a downstream host
that drops the packets (its connect never completes) or that accepts and never sends READY
holds a stage thread only until the upstream connection has gone -- its driver gave up, or
the stage shed it to make room -- so --max-connections still bounds the stage's threads."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

import pytest

from skippy_wire.net.admission import StageLimits
from skippy_wire.net.server import StageServer
from skippy_wire.net.transport import UPSTREAM_CHECK_S, connect
from skippy_wire.tools.serve import stage_config

from test_hardening import _wait_for
from test_server import FakeBackend

#: Well under the stage's own downstream connect timeout (10 s): only giving up on a gone
#: upstream ends the waits this soon.
ENDS_WITHIN_S = 3 * UPSTREAM_CHECK_S


@contextlib.contextmanager
def listener_that_takes_nothing(answers_connects: bool):
    """A TCP listener that accepts nothing: with ``answers_connects`` the first connection
    completes (the kernel queues it) and then hears nothing; without, its queue is full and
    every connect hangs, as with a host that drops the packets."""
    listener = socket.socket()
    held = []
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        if not answers_connects:
            held.append(socket.create_connection(listener.getsockname()))  # fills the queue
        yield listener.getsockname()[:2]
    finally:
        for sock in held:
            sock.close()
        listener.close()


def _stage_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("stage-conn-")]


def test_a_connect_that_hangs_ends_when_abandoned_or_timed_out():
    with listener_that_takes_nothing(answers_connects=False) as (host, port):
        started = time.monotonic()
        with pytest.raises(ConnectionAbortedError):
            connect(host, port, timeout=60.0, abandoned=lambda: time.monotonic() - started > 0.2)
        assert time.monotonic() - started < ENDS_WITHIN_S
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            connect(host, port, timeout=0.5, abandoned=lambda: False)
        assert time.monotonic() - started < ENDS_WITHIN_S


def test_a_watched_connect_gives_the_socket_a_plain_connect_gives():
    with socket.create_server(("127.0.0.1", 0)) as server:
        sock = connect(*server.getsockname()[:2], timeout=7.0, abandoned=lambda: False)
        with sock:
            assert sock.gettimeout() == 7.0
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            accepted, _ = server.accept()
            with accepted:
                sock.sendall(b"ping")
                assert accepted.recv(4) == b"ping"
        port = server.getsockname()[1]
    with pytest.raises(ConnectionRefusedError):  # the listener is gone: refused at once, not polled
        connect("127.0.0.1", port, timeout=60.0, abandoned=lambda: False)


@pytest.mark.parametrize("answers_connects, said", [
    (False, "cannot connect to downstream 127.0.0.1:{port}: given up: the connection it was for has gone"),
    (True, "upstream closed the connection while waiting for downstream 127.0.0.1:{port} to send READY"),
])
def test_a_stage_stops_waiting_on_its_downstream_when_its_driver_leaves(answers_connects, said, caplog):
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    with listener_that_takes_nothing(answers_connects) as downstream:
        server = StageServer(FakeBackend(0, 3, 0), stage_config(0, 0, 3, "raw-f32-v1", "fixed"),
                             downstream=downstream, reply_timeout=60.0)
        server.start()
        try:
            driver = socket.create_connection(server.address)
            assert _wait_for(lambda: _stage_threads(), 5.0)
            time.sleep(0.2)  # the stage is waiting on its downstream now
            driver.close()
            left = time.monotonic()
            assert _wait_for(lambda: not _stage_threads(), ENDS_WITHIN_S), _stage_threads()
            assert time.monotonic() - left < ENDS_WITHIN_S
            assert _wait_for(lambda: said.format(port=downstream[1]) in caplog.text, 2.0), caplog.text
        finally:
            server.shutdown()


def test_connections_shed_while_their_downstream_hangs_take_their_threads_with_them():
    with listener_that_takes_nothing(answers_connects=False) as downstream:
        server = StageServer(FakeBackend(0, 3, 0), stage_config(0, 0, 3, "raw-f32-v1", "fixed"),
                             downstream=downstream, reply_timeout=60.0, limits=StageLimits(max_connections=2))
        server.start()
        clients = []
        try:
            for _ in range(8):  # each new one sheds a quiet one to make room
                clients.append(socket.create_connection(server.address))
                time.sleep(0.05)
            assert _wait_for(lambda: len(_stage_threads()) <= 2, ENDS_WITHIN_S), _stage_threads()
        finally:
            for client in clients:
                client.close()
            server.shutdown()
