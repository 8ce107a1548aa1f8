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

from skippy_wire.net.admission import MAX_DOWNSTREAM_SETUPS, StageLimits
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
    # (it said "cannot connect to downstream ...: given up" of every port check, whose connect had not failed)
    (False, "upstream left while connecting to downstream 127.0.0.1:{port}"),
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
            # the driver's leaving, not a failure of this stage's downstream: no ERROR line naming it
            assert [r.levelname for r in caplog.records if said.format(port=downstream[1]) in r.getMessage()] \
                == ["INFO"], caplog.text
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


def opening_downstream(protocol: int, downstream, reply_timeout: float, tls=None):
    """``_open_downstream`` of a stage at ``protocol`` for an upstream connection (one end
    of a socket pair, the other returned), run in a thread; its outcome in a list."""
    server = StageServer(FakeBackend(0, 3, 0), stage_config(0, 0, 3, "raw-f32-v1", "fixed"), downstream=downstream,
                         reply_timeout=reply_timeout, protocol=protocol, tls=tls)
    server.start()  # its listener then closes with shutdown()
    upstream, driver_end = socket.socketpair()
    outcome: list = []

    def open_it() -> None:
        started = time.monotonic()
        try:
            outcome.append(server._open_downstream(1, upstream))
        except Exception as exc:  # noqa: BLE001 -- the outcome under test
            outcome.append(exc)
        outcome.append(time.monotonic() - started)

    thread = threading.Thread(target=open_it, daemon=True)
    thread.start()
    return server, upstream, driver_end, thread, outcome


@pytest.mark.parametrize("protocol, waiting_for", [(15, "to send READY"), (16, "to send READY"),
                                                  (17, "to answer the stage setup")])
def test_every_protocol_s_first_wait_on_the_downstream_ends_when_the_upstream_goes(protocol, waiting_for):
    with listener_that_takes_nothing(answers_connects=True) as downstream:
        server, upstream, driver_end, thread, outcome = opening_downstream(protocol, downstream, 60.0)
        try:
            time.sleep(0.3)
            driver_end.close()
            thread.join(ENDS_WITHIN_S)
            assert not thread.is_alive()
            error, took = outcome
            assert str(error) == (f"upstream closed the connection while waiting for downstream "
                                  f"127.0.0.1:{downstream[1]} {waiting_for}; giving up"), error
            assert took < 0.3 + ENDS_WITHIN_S
        finally:
            upstream.close()
            server.shutdown()


def test_the_ready_wait_keeps_its_own_timeout_while_it_looks_at_the_upstream():
    """It used to look until the timeout, then wait the whole timeout once more."""
    with listener_that_takes_nothing(answers_connects=True) as downstream:
        server, upstream, driver_end, thread, outcome = opening_downstream(15, downstream, 1.5)
        try:
            thread.join(10.0)
            error, took = outcome
            assert "did not send READY" in str(error) and 1.4 < took < 1.5 + UPSTREAM_CHECK_S, (error, took)
        finally:
            driver_end.close()
            upstream.close()
            server.shutdown()


def test_a_watched_connect_tries_each_address_of_the_host_in_turn(monkeypatch):
    """As socket.create_connection: one that takes no connection within the timeout, then
    the next (a dual-stack name whose first address is dropped still connects)."""
    with listener_that_takes_nothing(answers_connects=False) as dead, \
            socket.create_server(("127.0.0.1", 0)) as live:
        addresses = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", dead),
                     (socket.AF_INET, socket.SOCK_STREAM, 6, "", live.getsockname()[:2])]
        monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: addresses)
        with connect("two.example", 1, timeout=0.5, abandoned=lambda: False) as sock:
            assert sock.getpeername()[:2] == live.getsockname()[:2]
        addresses.reverse()
        addresses[0] = (socket.AF_INET, socket.SOCK_STREAM, 6, "", dead)  # both dead: the first failure
        addresses[1] = (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 1))
        with pytest.raises(TimeoutError):
            connect("two.example", 1, timeout=0.5, abandoned=lambda: False)


def test_downstreams_that_lead_back_set_up_a_bounded_number_of_connections_and_say_why(caplog):
    """A -> B -> A (an operator's two --downstream addresses naming each other): each stage
    accepted, opened its downstream, which accepted and connected back, without end: over
    10,000 connections in 8 s, both cores busy, long after the driver had gone.  Now each
    stage sets up at most MAX_DOWNSTREAM_SETUPS at once and refuses one more, and the chain
    comes apart."""
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    servers = [StageServer(FakeBackend(0, 3, 0), stage_config(0, 0, 3, "raw-f32-v1", "fixed"),
                           downstream=("127.0.0.1", 1), reply_timeout=60.0) for _ in range(2)]
    servers[0].downstream, servers[1].downstream = servers[1].address, servers[0].address
    for server in servers:
        server.start()
    try:
        driver = socket.create_connection(servers[0].address)
        time.sleep(1.0)  # the storm's time to grow
        accepted = [server._conn_seq for server in servers]
        assert sum(accepted) <= 2 * (MAX_DOWNSTREAM_SETUPS + 2), accepted
        driver.close()
        assert _wait_for(lambda: not any(server._connections for server in servers), 5.0), \
            [len(server._connections) for server in servers]
        assert sum(server._conn_seq for server in servers) == sum(accepted)  # none since
        assert "downstreams that lead back to this stage, A -> B -> A" in caplog.text, caplog.text
    finally:
        for server in servers:
            server.shutdown()
