"""A stage server that strangers cannot stall: admission, deadlines, size caps, TLS.

The probes run against real ``serve`` processes on 127.0.0.1 (the tiny llama model, 2
stages).  After each, a normal generation through the same stages must still give the
reference tokens, and the stages' memory (VmRSS) and thread count stay bounded.
"""

from __future__ import annotations

import re
import select
import socket
import ssl
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from skippy_wire.errors import PipelineError, StageError
from skippy_wire.net.admission import ConnectionLimit, LaneGate, StageLimits, max_message_bytes
from skippy_wire.net.driver import PipelineClient, generate_local
from skippy_wire.net.protocol_io import LinkProtocol
from skippy_wire.net.server import StageServer
from skippy_wire.net.supervision import launch_pipeline
from skippy_wire.net.tls import TLS_CLIENT_ON_PLAIN_STAGE, TlsConfig
from skippy_wire.net.transport import Peer
from skippy_wire.tools.serve import stage_config
from skippy_wire.wire.constants import READY_BYTES
from skippy_wire.wire.messages import StageWireMessage

from test_server import PROMPT as FAKE_PROMPT
from test_server import FakeBackend, fake_reference

PROMPT = [1, 10, 20, 30, 40, 50, 60, 70, 80]
MAX_TOKENS = 6
N_EMBD = 64  # the tiny model
#: Memory a probe may add to a stage, and threads beyond the connection limit.
RSS_BOUND_KB = 100 * 1024
SPARE_THREADS = 8


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from skippy_wire.stage.models import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="module")
def reference(tiny_model) -> list[int]:
    return generate_local(tiny_model, PROMPT, max_tokens=MAX_TOKENS, chunk_size=4, threads=1).tokens


def _status(pid: int) -> dict:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return {"rss_kb": int(fields["VmRSS"].split()[0]), "threads": int(fields["Threads"])}


def _generate(cluster, *, session_id: int = 1, tls=None) -> list[int]:
    with PipelineClient(*cluster.entry, timeout=30, tls=tls) as client:
        return client.generate(PROMPT, max_tokens=MAX_TOKENS, chunk_size=4, session_id=session_id).tokens


def _cluster(model, tmp_path, *extra, tls=None, protocol=15):
    return launch_pipeline(model, 2, threads=1, startup_timeout=60, reply_timeout=20, log_dir=tmp_path,
                           extra_args=[str(a) for a in extra], tls=tls, protocol=protocol)


def _log(tmp_path, stage: int) -> str:
    return (tmp_path / f"stage{stage}.log").read_text(errors="replace")


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def _closed(sock: socket.socket, timeout: float) -> bool:
    """Whether the peer closes ``sock`` within ``timeout`` (what it sends is drained)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([sock], [], [], max(0.0, deadline - time.monotonic()))[0]:
            try:
                if not sock.recv(1 << 16):
                    return True
            except ConnectionError:
                return True
    return False


def _prefix(token_count: int, activation_bytes: int, version: int = 15) -> bytes:
    """An 80-byte PrefillEmbd prefix from stage 0 (activation-bearing) declaring a size."""
    header = struct.pack("<9i", version, 0, 1, 0, 0, 0, -1, -1, 0) + struct.pack("<i", 1)
    return struct.pack("<5i", 2, 0, token_count, 0, 0) + header + struct.pack("<iQQ", activation_bytes, 7, 7)


def _bounded(before: dict, pid: int, max_threads: int) -> dict:
    after = _status(pid)
    print(f"stage pid {pid}: VmRSS {before['rss_kb']} -> {after['rss_kb']} kB, threads {before['threads']} -> "
          f"{after['threads']} (bound {max_threads})")
    assert after["rss_kb"] - before["rss_kb"] < RSS_BOUND_KB, (before, after)
    assert after["threads"] <= max_threads, (before, after)
    return after


# --- unit level ------------------------------------------------------------------------


def test_message_limit_covers_a_full_context_and_is_a_few_mib():
    limit = max_message_bytes(512, 576)  # SmolLM2-135M at the default context
    assert 512 * 576 * 4 * 2 < limit < 4 * 1024 * 1024
    assert max_message_bytes(1024, 576) > limit


@pytest.mark.parametrize("version", [15, 16, 17])
def test_declared_activation_over_the_limit_is_refused_from_the_prefix(version):
    a, b = socket.socketpair()
    try:
        link = LinkProtocol(version, Peer(a), reads="messages", n_embd=N_EMBD, max_message_bytes=1 << 20)
        declared = 1_802_240 * N_EMBD * 4  # 440 MiB
        with pytest.raises(Exception, match=r"over the decoder limit of 1048576"):
            link.peer.reader.decoder.feed(_prefix(1_802_240, declared, version))
        assert link.peer.reader.decoder.buffered == 0 or link.peer.reader.decoder.error is not None
    finally:
        a.close()
        b.close()


def test_lane_gate_is_first_come_first_served_and_times_out():
    gate = LaneGate(1, wait=30.0)
    gate.acquire()
    order: list[str] = []
    started = [threading.Event(), threading.Event()]

    def waiter(name: str, index: int) -> None:
        started[index].set()
        gate.acquire()
        order.append(name)

    first = threading.Thread(target=waiter, args=("first", 0))
    first.start()
    started[0].wait(5)
    assert _wait_for(lambda: len(gate._queue) == 1, 5)
    second = threading.Thread(target=waiter, args=("second", 1))
    second.start()
    assert _wait_for(lambda: len(gate._queue) == 2, 5)
    gate.release()
    first.join(5)
    assert order == ["first"]
    gate.release()
    second.join(5)
    assert order == ["first", "second"]
    impatient = LaneGate(1, wait=0.05)
    impatient.acquire()
    with pytest.raises(StageError, match=r"^all 1 lanes are busy; gave up after 0.05 s$"):
        impatient.acquire()
    assert impatient.busy == 1 and not impatient._queue


# --- probes against serve processes ------------------------------------------------------------


@pytest.mark.slow
def test_a_connection_shed_as_its_message_completes_stays_marked_shed_until_it_ends():
    """Shed between its message's last byte and the start of its execution, a connection
    lost its shed mark when it turned busy: its closed socket was then logged as the peer
    leaving ("the peer left while its session waited for a lane")."""
    limit = ConnectionLimit(1)
    sock = object()
    limit.quiet(7, sock)
    assert limit.shed_quietest() is sock and limit.was_shed(7)
    limit.busy(7)  # its thread goes on to execute the message it had read
    assert limit.was_shed(7)
    limit.ended(7)
    assert not limit.was_shed(7) and limit.shed_quietest() is None


def test_one_connection_cannot_hold_every_lane(tiny_model, tmp_path, reference):
    with _cluster(tiny_model, tmp_path, "--max-sessions-per-connection", 2) as cluster:
        pid = cluster.stages[0].popen.pid
        before = _status(pid)
        other = PipelineClient(*cluster.entry, timeout=30)  # another user, connected already
        hog = PipelineClient(*cluster.entry, timeout=30)
        for session in (1, 2):
            hog.request(StageWireMessage.configure_generation(session, session, 4, None, None))
        with pytest.raises(PipelineError, match="closed the connection"):
            hog.request(StageWireMessage.configure_generation(3, 3, 4, None, None))
        hog.close()
        assert other.generate(PROMPT, max_tokens=MAX_TOKENS, chunk_size=4).tokens == reference
        other.close()
        assert _generate(cluster) == reference
        assert "max-sessions-per-connection 2" in _log(tmp_path, 0)
        _bounded(before, pid, before["threads"] + SPARE_THREADS)


@pytest.mark.slow
def test_slowloris_is_cut_off_within_the_message_timeout(tiny_model, tmp_path, reference):
    with _cluster(tiny_model, tmp_path, "--message-timeout", 2, "--io-timeout", 5) as cluster:
        pid = cluster.stages[0].popen.pid
        before = _status(pid)
        sock = socket.create_connection(cluster.entry, timeout=10)
        assert sock.recv(4) == READY_BYTES
        data = _prefix(4, 4 * N_EMBD * 4)
        first = time.monotonic()
        cut = None
        for byte in data:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                cut = time.monotonic()
                break
            if _closed(sock, 0.25):
                cut = time.monotonic()
                break
        sock.close()
        assert cut is not None, "a peer sending 4 bytes a second was never cut off"
        assert cut - first < 2 + 1
        said = re.search(r"message not complete 2 s after its first byte \((\d+) bytes received, at least (\d+) more "
                         r"to come; a link this slow needs a larger --message-timeout\)", _log(tmp_path, 0))
        assert said and 0 < int(said[1]) < len(data) and int(said[1]) + int(said[2]) <= len(data), _log(tmp_path, 0)
        assert _generate(cluster) == reference
        _bounded(before, pid, before["threads"] + SPARE_THREADS)


@pytest.mark.slow
def test_a_huge_declared_activation_is_refused_before_its_payload(tiny_model, tmp_path, reference):
    with _cluster(tiny_model, tmp_path) as cluster:
        pid = cluster.stages[1].popen.pid  # an activation-taking stage, reached directly
        before = _status(pid)
        host, port = cluster.stages[1].host, cluster.stages[1].port
        sock = socket.create_connection((host, port), timeout=10)
        assert sock.recv(4) == READY_BYTES
        declared = 1_802_240 * N_EMBD * 4  # 440 MiB within the protocol's 512 MiB
        sock.sendall(_prefix(1_802_240, declared))
        try:
            for _ in range(64):  # 4 MiB more: none of it may be kept
                sock.sendall(bytes(1 << 16))
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert _closed(sock, 10)
        sock.close()
        limit = max_message_bytes(512, N_EMBD)
        assert f"needs at least {80 + declared} bytes, over the decoder limit of {limit}" in _log(tmp_path, 1)
        assert _generate(cluster) == reference
        _bounded(before, pid, before["threads"] + SPARE_THREADS)


@pytest.mark.slow
def test_idle_connections_cannot_lock_users_out(tiny_model, tmp_path, reference):
    limit, idle = 64, 4
    with _cluster(tiny_model, tmp_path, "--max-connections", limit, "--idle-timeout", idle) as cluster:
        pids = [s.popen.pid for s in cluster.stages]
        before = [_status(pid) for pid in pids]
        socks = [socket.create_connection(cluster.entry, timeout=10) for _ in range(200)]
        # Each connection beyond the limit closed the one quiet longest: a user still gets in.
        assert _generate(cluster) == reference
        held = [_bounded(b, pid, limit + SPARE_THREADS) for b, pid in zip(before, pids)]
        assert held[0]["threads"] >= limit  # a thread per open connection, no more
        assert "to make room" in _log(tmp_path, 0)
        assert _closed(socks[0], 1)  # the oldest idle ones went first
        open_now = [sock for sock in socks[-limit:] if not _closed(sock, 0.05)]
        assert 0 < len(open_now) < limit
        started = time.monotonic()
        assert all(_closed(sock, idle + 3) for sock in open_now)  # the rest after the idle timeout
        assert time.monotonic() - started < idle + 3
        for sock in socks:
            sock.close()
        assert _wait_for(lambda: all(_status(p)["threads"] <= b["threads"] + 1 for p, b in zip(pids, before)), 10)
        assert _generate(cluster) == reference
        for b, pid in zip(before, pids):
            _bounded(b, pid, b["threads"] + SPARE_THREADS)


@pytest.mark.slow
def test_a_session_waiting_for_a_lane_gives_up_with_a_clear_error(tiny_model, tmp_path, reference):
    with _cluster(tiny_model, tmp_path, "--lane-wait", 1) as cluster:
        holders = [PipelineClient(*cluster.entry, timeout=30) for _ in range(2)]
        for index, holder in enumerate(holders):  # 2 connections x 2 sessions: all 4 lanes
            for session in (1, 2):
                holder.request(StageWireMessage.configure_generation(session, 10 * index + session, 4, None, None))
        with pytest.raises(PipelineError, match="closed the connection"):
            _generate(cluster, session_id=99)
        assert "all 4 lanes are busy; gave up after 1 s" in _log(tmp_path, 0)
        assert "no skippy execution lane" not in _log(tmp_path, 0)
        holders[0].request(StageWireMessage.stop(1, 1))  # one lane back: the next session gets it
        assert _generate(cluster, session_id=98) == reference
        for holder in holders:
            holder.close()
        assert _generate(cluster) == reference


# --- trust ------------------------------------------------------------------------------------


def _openssl(*args, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A throwaway CA, one certificate it signed (stages and driver), and a stranger's."""
    d = tmp_path_factory.mktemp("pki")
    for name in ("ca", "stranger-ca"):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
                 "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)
    for name, ca in (("node", "ca"), ("stranger", "stranger-ca")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                 "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", cwd=d)
    return {"node": TlsConfig(str(d / "node.pem"), str(d / "node.key"), str(d / "ca.pem")),
            "stranger": TlsConfig(str(d / "stranger.pem"), str(d / "stranger.key"), str(d / "ca.pem")),
            "ca": str(d / "ca.pem")}


def test_a_mutual_tls_connection_counts_once_against_the_connection_limit(certs):
    """The TLS socket replaces the plain one it wraps: two idle TLS connections at a limit
    of 2 are both kept (each used to count twice, so the second shed the first)."""
    tls = certs["node"]
    server = StageServer(FakeBackend(0, 6), stage_config(0, 0, 6, "raw-f32-v1", "fixed"), io_timeout=5.0,
                         reply_timeout=5.0, tls=tls, limits=StageLimits(max_connections=2))
    server.start()
    try:
        with PipelineClient(*server.address, timeout=10, tls=tls) as first, \
                PipelineClient(*server.address, timeout=10, tls=tls) as second:
            assert _wait_for(lambda: len(server._connections) == 2, 5)
            time.sleep(0.2)
            assert server.connection_limit.shed_count == 0
            for session_id, client in enumerate((first, second), 1):
                assert client.generate(FAKE_PROMPT, max_tokens=3, chunk_size=4, session_id=session_id).tokens \
                    == fake_reference(FAKE_PROMPT, 3)
    finally:
        server.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("protocol", [15, 17])
def test_mutual_tls_pipeline_matches_plain_and_refuses_strangers(tiny_model, tmp_path, reference, certs, protocol):
    tls = certs["node"]
    with _cluster(tiny_model, tmp_path, tls=tls, protocol=protocol) as cluster:
        socket.create_connection(cluster.entry, timeout=10).close()  # a port check: no stranger
        with PipelineClient(*cluster.entry, timeout=30, tls=tls, protocol=protocol,
                            identity=cluster.identity) as client:
            assert client.generate(PROMPT, max_tokens=MAX_TOKENS, chunk_size=4).tokens == reference
        with pytest.raises(PipelineError, match="requires mutual TLS; this driver speaks plain TCP"):
            PipelineClient(*cluster.entry, timeout=30, protocol=protocol, identity=cluster.identity)
        # A client with no certificate, and one signed by another CA: refused by the stage.
        bare = ssl.create_default_context(cafile=certs["ca"])
        bare.check_hostname = False
        for label, context in (("no certificate", bare), ("another CA", certs["stranger"].client_context())):
            sock = socket.create_connection(cluster.entry, timeout=10)
            try:
                with pytest.raises((ssl.SSLError, ConnectionError, PipelineError)):
                    sock = context.wrap_socket(sock, server_hostname="127.0.0.1")
                    sock.settimeout(10)
                    if not sock.recv(4):
                        raise PipelineError(f"{label}: closed")
            finally:
                sock.close()
        with PipelineClient(*cluster.entry, timeout=30, tls=tls, protocol=protocol,
                            identity=cluster.identity) as client:
            assert client.generate(PROMPT, max_tokens=MAX_TOKENS, chunk_size=4, session_id=2).tokens == reference
    log = _log(tmp_path, 0)
    assert "did not start a TLS handshake" in log
    assert "connection 1 from 127.0.0.1" in log and "closed by peer before its setup" in log
    assert "mutual TLS" in log


@pytest.mark.slow
@pytest.mark.parametrize("protocol", [15, 16, 17])
def test_a_mutual_tls_driver_on_plain_stages_is_told_so_on_both_ends(tiny_model, tmp_path, reference, certs,
                                                                      protocol):
    """The plain stage read the ClientHello as an unknown message kind (v15, v16) or an
    absurd state version (v17)."""
    with _cluster(tiny_model, tmp_path, protocol=protocol) as cluster:
        with pytest.raises(PipelineError, match=r"^TLS handshake with stage 0 at 127\.0\.0\.1:\d+ failed: .* "
                                                r"\(does it use mutual TLS with the same CA\?\)$"):
            PipelineClient(*cluster.entry, timeout=30, tls=certs["node"], protocol=protocol,
                           identity=cluster.identity)
        with PipelineClient(*cluster.entry, timeout=30, protocol=protocol, identity=cluster.identity) as client:
            assert client.generate(PROMPT, max_tokens=MAX_TOKENS, chunk_size=4).tokens == reference
    log = _log(tmp_path, 0)
    assert TLS_CLIENT_ON_PLAIN_STAGE in log
    assert "unknown stage message kind" not in log and "peer speaks state version" not in log


@pytest.mark.slow
def test_binding_beyond_loopback_warns_that_the_data_plane_is_unauthenticated(tiny_model, tmp_path):
    with launch_pipeline(tiny_model, 1, threads=1, startup_timeout=60, log_dir=tmp_path,
                         extra_args=["--listen", "0.0.0.0:0"]):
        pass
    log = _log(tmp_path, 0)
    assert "beyond loopback: the stage data plane is unauthenticated plain TCP" in log
    with launch_pipeline(tiny_model, 1, threads=1, startup_timeout=60, log_dir=tmp_path / "lo"):
        pass
    assert "unauthenticated" not in (tmp_path / "lo" / "stage0.log").read_text()


def test_a_tls_handshake_stalled_by_a_stranger_is_closed_when_shed_not_at_the_io_timeout(certs):
    """At the connection limit the stalled handshake is shed: its socket and thread go at
    once.  Wrapping the socket for TLS detached it, so the shed's shutdown() missed, and the
    stranger kept a thread and a descriptor, no longer counted, until --io-timeout: a loop of
    such connections grew both without bound."""
    tls = certs["node"]
    server = StageServer(FakeBackend(0, 6), stage_config(0, 0, 6, "raw-f32-v1", "fixed"), io_timeout=20.0,
                         reply_timeout=5.0, tls=tls, limits=StageLimits(max_connections=1))
    server.start()
    staller = socket.create_connection(server.address, timeout=5)
    try:
        staller.sendall(b"\x16\x03\x01\x00\x50")  # a ClientHello's record header, then nothing
        assert _wait_for(lambda: any(t.name == "stage-conn-1" for t in threading.enumerate()), 5)
        time.sleep(0.3)
        with PipelineClient(*server.address, timeout=10, tls=tls) as client:
            assert client.generate(FAKE_PROMPT, max_tokens=3, chunk_size=4).tokens == fake_reference(FAKE_PROMPT, 3)
        assert server.connection_limit.shed_count == 1
        assert _closed(staller, 3.0)
        assert _wait_for(lambda: not any(t.name == "stage-conn-1" for t in threading.enumerate()), 3.0)
    finally:
        staller.close()
        server.shutdown()
