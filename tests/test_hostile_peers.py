"""A stage against a hostile peer: what it logs, which links it takes, and how it outlives
a failing accept.

Fast tests run stages in-process (the fake runtime of :mod:`test_server`); the slow ones
probe real ``serve`` processes over loopback (helpers of :mod:`test_hardening`) and then
check that a normal generation still gives the reference tokens, with memory, threads and
file descriptors back within bounds.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import socket
import struct
import sys
import time

import pytest

from skippy_wire.errors import PipelineError
from skippy_wire.net import connlog
from skippy_wire.net.admission import StageLimits
from skippy_wire.net.connlog import LOG_BURST, LOG_RATE, MAX_PEER_TEXT, ConnectionLog, peer_text
from skippy_wire.net.driver import PipelineClient
from skippy_wire.net.schedule import decode_message, prefill_messages
from skippy_wire.net.protocol_io import LinkProtocol
from skippy_wire.net.server import StageServer
from skippy_wire.net.supervision import StageProcess, stage_env
from skippy_wire.net.transport import Peer, connect
from skippy_wire.tools.serve import stage_config
from skippy_wire.wire.constants import READY_BYTES
from skippy_wire.wire.frame import write_stage_message
from skippy_wire.wire.messages import StageWireMessage
from skippy_wire.wire.setup import SETUP_MAGIC, STAGE_PROTOCOL_GENERATION, SetupRole

from test_hardening import (MAX_TOKENS, PROMPT, SPARE_THREADS, _bounded, _closed, _cluster, _generate, _log,
                            _status, _wait_for)
import test_hardening
from test_protocol_links import _chain, _shutdown
from test_server import PROMPT as FAKE_PROMPT
from test_server import FakeBackend, fake_reference

tiny_model, reference = test_hardening.tiny_model, test_hardening.reference  # the fixtures
SERVER_LOG = "skippy_wire.net.server"
#: A log line of the ``serve`` format: every line starts with its time stamp.
LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} stage\[\d+\] [A-Z]+ ")


def _packet(body: bytes) -> bytes:
    return struct.pack("<III", SETUP_MAGIC, STAGE_PROTOCOL_GENERATION, len(body)) + body


#: Setup packets a hostile peer sends instead of a Hello.  The last ones put text of the
#: peer's choosing into the stage's error (a line break, 60 KB, a 4000-digit number).
HOSTILE_HELLOS = {
    "deep list": b"[" * 30000 + b"]" * 30000,
    "deep object": b'{"a":' * 20000 + b"1" + b"}" * 20000,
    "duplicate key": b'{"role":"TokensAndControl","role":"Activation"}',
    "NaN": b'{"role":NaN}',
    "giant float": b'{"role":"TokensAndControl","sender":null,"target":["stage0",1e999],"output":null}',
    "wrong types": b'{"role":5,"sender":[],"target":{},"output":"x"}',
    "not utf-8": b'{"role":"\xff\xfe"}',
    "lone surrogate": b'{"role":"\\ud800"}',
    "empty": b"",
    "forged line": b'{"role\\n2026-01-01 00:00:00,000 stage[1] ERROR forged":1}',
    "escape sequence": b'{"role":"\\u001b[2J"}',
    "huge echo": b'{"role":"' + b"A" * 60000 + b'"}',
    "giant integer": b'{"role":"TokensAndControl","sender":null,"target":["stage0",' + b"9" * 4000 + b'],"output":null}',
}


def _send_and_wait_close(address, data: bytes, timeout: float = 10.0) -> bool:
    sock = socket.create_connection(address, timeout=timeout)
    try:
        sock.sendall(data)
    except (BrokenPipeError, ConnectionResetError):
        pass
    closed = _closed(sock, timeout)
    sock.close()
    return closed


# --- what a stage logs -----------------------------------------------------------------------


def test_peer_text_is_one_printable_line_of_bounded_length():
    assert peer_text("plain text: 42") == "plain text: 42"
    forged = peer_text("key\n2026-01-01 ERROR forged\r\x1b[2J")
    assert "\n" not in forged and "\r" not in forged and "\x1b" not in forged
    assert forged == "key\\n2026-01-01 ERROR forged\\r\\x1b[2J"
    long = peer_text("A" * 60000)
    assert long.startswith("A" * MAX_PEER_TEXT) and long.endswith(f"({60000 - MAX_PEER_TEXT} more characters)")
    assert len(long) < MAX_PEER_TEXT + 40
    assert peer_text(ValueError("x\ny")) == "x\\ny"


def test_connection_log_drops_a_flood_and_says_how_much(monkeypatch, caplog):
    now = [100.0]
    monkeypatch.setattr(connlog.time, "monotonic", lambda: now[0])
    clog = ConnectionLog(logging.getLogger("test.connlog"), burst=3, rate=2.0)
    with caplog.at_level(logging.INFO, logger="test.connlog"):
        for i in range(10):
            clog.error("connection %d: %s; closing", i, "bad\nthing")
        clog.info("connection %d: ready", 99)  # another level has its own budget
        now[0] += 0.5  # one line's worth of budget back
        clog.error("connection %d: late", 10)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[:3] == [f"connection {i}: bad\\nthing; closing" for i in range(3)]
    assert lines[3] == "connection 99: ready"
    assert lines[4] == "connection 10: late [7 earlier lines at this level not logged: log rate limit]"
    assert len(lines) == 5 and clog.dropped == 7


def test_a_logger_s_own_lines_get_the_same_budget(monkeypatch, caplog):
    # uvicorn logs every malformed HTTP request itself; the filter bounds those lines too
    now = [100.0]
    monkeypatch.setattr(connlog.time, "monotonic", lambda: now[0])
    logger = logging.getLogger("test.uvicorn-like")
    records = connlog.RateLimitedRecords(burst=2, rate=1.0)
    logger.addFilter(records)
    try:
        with caplog.at_level(logging.WARNING, logger="test.uvicorn-like"):
            for _ in range(6):
                logger.warning("Invalid HTTP request received.")
            now[0] += 1.0
            logger.warning("Invalid %s request received.", "HTTP")
    finally:
        logger.removeFilter(records)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["Invalid HTTP request received."] * 2 + [
        "Invalid HTTP request received. [4 earlier lines at this level not logged: log rate limit]"]
    assert records.budget.dropped == 4


def test_hostile_setup_json_is_one_bounded_line_each_and_the_stages_serve_on(caplog):
    servers = _chain(17)
    try:
        with caplog.at_level(logging.INFO, logger=SERVER_LOG):
            for name, body in HOSTILE_HELLOS.items():
                for server in servers:
                    assert _send_and_wait_close(server.address, _packet(body)), name
            with PipelineClient(*servers[0].address, timeout=10, protocol=17) as client:
                assert client.generate(FAKE_PROMPT, max_tokens=3, chunk_size=4).tokens == fake_reference(FAKE_PROMPT, 3)
        messages = [r.getMessage() for r in caplog.records if r.name == SERVER_LOG]
        assert sum("stage setup failed" in m for m in messages) == 2 * len(HOSTILE_HELLOS)
        for message in messages:
            assert "\n" not in message and "\x1b" not in message, message[:200]
            assert len(message) < 2 * MAX_PEER_TEXT, message[:200]
        assert not any(r.exc_info for r in caplog.records)
        assert "unknown field `role\\n2026-01-01 00:00:00,000 stage[1] ERROR forged`" in caplog.text
    finally:
        _shutdown(servers)


def test_a_flood_of_bad_connections_logs_a_bounded_number_of_lines(caplog):
    servers = _chain(15, splits=((0, 6),))
    try:
        with caplog.at_level(logging.INFO, logger=SERVER_LOG):
            flood = 3 * LOG_BURST
            for _ in range(flood):
                assert _send_and_wait_close(servers[0].address, b"\xff" * 96)
            errors = [r for r in caplog.records if r.levelno == logging.ERROR]
            # Each of the first connections is logged; a flood past the budget is not.
            assert LOG_BURST <= len(errors) < flood, len(errors)
            assert len(caplog.records) < 2 * flood
            # Once budget is back, the next line says how many were not logged.
            assert _wait_for(lambda: _send_and_wait_close(servers[0].address, b"\xff" * 96)
                             and "at this level not logged: log rate limit" in caplog.text, 10)
        with PipelineClient(*servers[0].address, timeout=10) as client:
            assert client.generate(FAKE_PROMPT, max_tokens=3, chunk_size=4).tokens == fake_reference(FAKE_PROMPT, 3)
    finally:
        _shutdown(servers)


# --- which links a stage takes -----------------------------------------------------------------


def test_a_v17_stage_takes_only_the_links_of_its_place(caplog):
    """A driver's TokensAndControl link belongs on stage 0 and an Activation link on a later
    stage; another role is refused right after the handshake, not at the first message."""
    servers = _chain(17)
    try:
        with caplog.at_level(logging.ERROR, logger=SERVER_LOG):
            with pytest.raises(PipelineError, match="closed the connection|connection lost"):
                with PipelineClient(*servers[1].address, timeout=10, protocol=17) as client:
                    client.request(StageWireMessage.configure_generation(1, 1, 4, None, None))
            for server in servers:
                peer = Peer(connect(*server.address, 10))
                link = LinkProtocol(17, peer)
                try:
                    link.connect(SetupRole.PREDICTION_RETURN, servers[0].identity, None, timeout=10)
                    peer.send(link.encode(StageWireMessage.configure_generation(1, 1, 4, None, None)))
                    with pytest.raises(Exception):
                        peer.read()
                except Exception:  # noqa: BLE001 -- refused during the handshake: as good
                    pass
                finally:
                    peer.close()
            assert _wait_for(lambda: "takes only Activation links" in caplog.text, 10)
        assert "peer set up a TokensAndControl link; this stage takes only Activation links" in caplog.text
        assert "peer set up a PredictionReturn link; this stage takes only Activation links" in caplog.text
        with PipelineClient(*servers[0].address, timeout=10, protocol=17) as client:
            assert client.generate(FAKE_PROMPT, max_tokens=3, chunk_size=4).tokens == fake_reference(FAKE_PROMPT, 3)
    finally:
        _shutdown(servers)


# --- a peer that does not read its replies ------------------------------------------------------


def _stalled_non_reader(address) -> socket.socket:
    """A connection that sends Stops for a session nobody holds and reads none of the Acks,
    until the stage's sends to it are stuck (it no longer reads either)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address)
    sock.settimeout(5)
    assert sock.recv(4) == READY_BYTES
    stops = write_stage_message(StageWireMessage.stop(9, 9)) * 512
    sock.setblocking(False)
    deadline, stuck = time.monotonic() + 30, None
    while time.monotonic() < deadline:
        try:
            sock.send(stops)
            stuck = None
        except BlockingIOError:
            stuck = stuck or time.monotonic()
            if time.monotonic() - stuck > 0.5:
                return sock
            time.sleep(0.02)
    raise AssertionError("the stage kept reading")


def test_a_peer_that_reads_no_replies_is_shed_like_an_idle_one(caplog):
    """A connection holding no session whose reply waits for a peer that does not read is
    quiet: at the connection limit a newcomer closes it instead of being refused for up to
    the io timeout."""
    server = StageServer(FakeBackend(0, 6, 0), stage_config(0, 0, 6, "raw-f32-v1", "fixed"), io_timeout=30.0,
                         reply_timeout=5.0, limits=StageLimits(max_connections=1))
    server.start()
    stalled = _stalled_non_reader(server.address)
    try:
        with caplog.at_level(logging.WARNING, logger=SERVER_LOG):
            with PipelineClient(*server.address, timeout=10) as client:
                assert client.generate(FAKE_PROMPT, max_tokens=3, chunk_size=4).tokens == fake_reference(FAKE_PROMPT, 3)
        assert "to make room" in caplog.text and "refused" not in caplog.text
    finally:
        stalled.close()
        server.shutdown()


# --- a failing accept --------------------------------------------------------------------------


class _FlakyListener:
    """A listening socket whose first ``failures`` accepts fail as when descriptors run out."""

    def __init__(self, listener: socket.socket, failures: int) -> None:
        self.listener, self.failures = listener, failures

    def accept(self):
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self.listener.accept()

    def __getattr__(self, name):
        return getattr(self.listener, name)


def test_a_failing_accept_does_not_end_the_listener(caplog):
    server = StageServer(FakeBackend(0, 6, 0), stage_config(0, 0, 6, "raw-f32-v1", "fixed"),
                         io_timeout=5.0, reply_timeout=5.0)
    server._listener = _FlakyListener(server._listener, 3)
    with caplog.at_level(logging.ERROR, logger=SERVER_LOG):
        server.start()
        try:
            with PipelineClient(*server.address, timeout=10) as client:
                assert client.generate(FAKE_PROMPT, max_tokens=3, chunk_size=4).tokens == fake_reference(FAKE_PROMPT, 3)
        finally:
            server.shutdown()
    assert "cannot accept a connection ([Errno 24] Too many open files); retrying" in caplog.text


# --- serve processes ---------------------------------------------------------------------------


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _one_line_each(text: str) -> None:
    for line in text.splitlines():
        assert LOG_LINE.match(line), f"not a log line of its own: {line[:200]!r}"
    assert "Traceback" not in text


@pytest.mark.slow
def test_hostile_setups_and_messages_leave_v17_stages_serving(tiny_model, tmp_path, reference):
    with _cluster(tiny_model, tmp_path, "--io-timeout", 5, protocol=17) as cluster:
        pids = [s.popen.pid for s in cluster.stages]
        before = [_status(pid) for pid in pids]
        fds = [_fds(pid) for pid in pids]
        addresses = [(s.host, s.port) for s in cluster.stages]
        for name, body in HOSTILE_HELLOS.items():
            for address in addresses:
                assert _send_and_wait_close(address, _packet(body)), name
        # A valid Hello, then garbage instead of the acceptance.
        hello = {"role": "TokensAndControl", "sender": None, "target": ["stage0", 0], "output": None}
        assert _send_and_wait_close(cluster.entry, _packet(json.dumps(hello).encode()) + b"\xde\xad" * 512)
        # A driver on stage 1 (one that does not check whom it reached): refused after its handshake.
        with pytest.raises(PipelineError, match="closed the connection|connection lost"):
            with PipelineClient(*addresses[1], timeout=10, protocol=17) as client:
                client.request(StageWireMessage.configure_generation(1, 1, 4, None, None))
        # Messages a stage cannot execute: each closes only its connection.
        first = next(prefill_messages(PROMPT, 4, 1, 1))
        probes = {
            "decode far beyond the context": [decode_message(5, 10 ** 6, 0, 1, 1, 1)],
            "decode at a negative position": [decode_message(5, -5, 0, 1, 1, 1)],
            "negative token": list(prefill_messages([-5, 1, 2], 4, 1, 1)),
            "token past the vocabulary": list(prefill_messages([256, 1, 2], 4, 1, 1)),
            "prompt past the context": list(prefill_messages(list(range(1, 200)) * 3, 64, 1, 1)),
            "token count lie": [dataclasses.replace(first, token_count=10 ** 6)],
            "no tokens": [dataclasses.replace(first, token_count=0, tokens=[])],
            "decode after stop": [*prefill_messages(PROMPT, 4, 1, 1), StageWireMessage.stop(1, 1),
                                  decode_message(5, len(PROMPT), 0, len(PROMPT), 1, 1)],
        }
        for name, messages in probes.items():
            with pytest.raises(PipelineError, match="closed the connection|connection lost"), \
                    PipelineClient(*cluster.entry, timeout=10, protocol=17, identity=cluster.identity) as client:
                for msg in messages:
                    client.request(msg)
        with PipelineClient(*cluster.entry, timeout=10, protocol=17, identity=cluster.identity) as client:
            assert int(client.request(StageWireMessage.stop(7, 7)).kind) == 1  # no such session: Ack
        with PipelineClient(*cluster.entry, timeout=30, protocol=17, identity=cluster.identity) as client:
            assert client.generate(PROMPT, max_tokens=MAX_TOKENS, chunk_size=4).tokens == reference
        for b, pid, fd in zip(before, pids, fds):
            _bounded(b, pid, b["threads"] + SPARE_THREADS)
            assert _wait_for(lambda: _fds(pid) <= fd + 2, 10), (fd, _fds(pid))
        assert "takes only Activation links" in _log(tmp_path, 1)
        assert "outside the vocabulary" in _log(tmp_path, 0)
        for stage in (0, 1):
            _one_line_each(_log(tmp_path, stage))


@pytest.mark.slow
def test_a_reconnecting_flood_cannot_fill_the_log(tiny_model, tmp_path, reference):
    flood = 1000
    with _cluster(tiny_model, tmp_path) as cluster:
        pids = [s.popen.pid for s in cluster.stages]
        before = [_status(pid) for pid in pids]
        fds = [_fds(pid) for pid in pids]
        sizes = [len(_log(tmp_path, stage)) for stage in (0, 1)]
        started = time.monotonic()
        for i in range(flood):
            sock = socket.create_connection(cluster.entry, timeout=10)
            sock.sendall(b"\xff" * 96 if i % 2 else b"")
            if i % 3 == 0:  # a reset instead of a close
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        assert _generate(cluster) == reference
        # The budget of two levels (info: ready, closed; error), with the flood's refill:
        # unbounded, every connection would be two lines on each stage.
        budget = 2 * (LOG_BURST + LOG_RATE * (time.monotonic() - started)) + 10
        assert budget < flood
        for stage, size in zip((0, 1), sizes):
            grown = len(_log(tmp_path, stage)[size:].splitlines())
            assert grown < budget, (stage, grown, budget)
            _one_line_each(_log(tmp_path, stage))
        for b, pid, fd in zip(before, pids, fds):
            _bounded(b, pid, b["threads"] + SPARE_THREADS)
            assert _wait_for(lambda: _fds(pid) <= fd + 2, 10), (fd, _fds(pid))


@pytest.mark.slow
def test_a_stage_out_of_file_descriptors_recovers(tiny_model, tmp_path, reference):
    """Connections past the process's descriptor limit fail to be accepted; the stage logs
    it, keeps listening and serves again once they are gone."""
    limit = 32
    setlimit = ("import os, resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, "
                f"({limit}, {limit})); os.execv(sys.argv[1], sys.argv[1:])")
    args = ["--model", str(tiny_model), "--layer-start", "0", "--layer-end", "4", "--stage-index", "0",
            "--listen", "127.0.0.1:0", "--threads", "1", "--max-connections", str(4 * limit)]
    stage = StageProcess(0, (0, 4), args, env=stage_env(), log_path=tmp_path / "stage0.log",
                         prefix=[sys.executable, "-c", setlimit])
    try:
        stage.wait_listening(60)
        socks = []
        for _ in range(2 * limit):
            try:
                socks.append(socket.create_connection((stage.host, stage.port), timeout=2))
            except OSError:
                break
        assert _wait_for(lambda: "cannot accept a connection" in _log(tmp_path, 0), 10)
        for sock in socks:
            sock.close()
        assert stage.popen.poll() is None, _log(tmp_path, 0)[-2000:]

        def serves() -> bool:
            try:
                with PipelineClient(stage.host, stage.port, timeout=10) as client:
                    return client.generate(PROMPT, max_tokens=MAX_TOKENS, chunk_size=4).tokens == reference
            except PipelineError:
                return False

        assert _wait_for(serves, 20)
        _one_line_each(_log(tmp_path, 0))
    finally:
        stage.terminate()
