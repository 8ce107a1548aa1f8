"""Stage links in state versions 15, 16 and 17: the same tokens in every version, the v17
setup handshake in the server, version mismatches named on both sides, and inspect on
v16/v17 captures."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skippy_wire.errors import PipelineError, PipelineMismatch, StageError
from skippy_wire.net import protocol_io
from skippy_wire.net.driver import PipelineClient, generate_local
from skippy_wire.net.protocol_io import (
    VERSION_NOTICE_MAGIC,
    LinkProtocol,
    driver_identity,
    parse_plan,
    parse_version_notice,
    peer_version_of,
    version_notice,
)
from skippy_wire.net.server import StageServer
from skippy_wire.net.transport import Peer
from skippy_wire.net.supervision import launch_pipeline
from skippy_wire.stage.models import write_tiny_llama_gguf
from skippy_wire.tools.inspect import main as inspect_main
from skippy_wire.tools.inspect_gen import detect_protocol
from skippy_wire.tools.serve import stage_config
from skippy_wire.wire.frame import write_stage_message
from skippy_wire.wire.constants import READY_BYTES
from skippy_wire.wire.messages import StageStateHeader, StageWireMessage, WireMessageKind
from skippy_wire.wire.protocol import WireProtocol
from skippy_wire.wire.setup import SetupError, SetupRole, StagePeer, StageSetupConfig, client_setup
from skippy_wire.wire.agreement import TOKENS, ActivationPartProfile, ActivationProfile, Fixed

from test_server import N_EMBD, N_LAYER, PROMPT, FakeBackend, closing_factory, fake_reference

REPO = Path(__file__).resolve().parents[1]


def _chain(protocol, splits=((0, 3), (3, 6)), codec="raw-f32-v1", policy="fixed", protocols=None):
    servers, downstream = [], None
    for index in reversed(range(len(splits))):
        start, end = splits[index]
        version = protocols[index] if protocols else protocol
        server = StageServer(FakeBackend(start, end, index), stage_config(index, start, end, codec, policy),
                             downstream=downstream, io_timeout=5.0, reply_timeout=5.0, protocol=version)
        server.start()
        servers.insert(0, server)
        downstream = server.address
    return servers


def _shutdown(servers):
    for server in servers:
        server.shutdown()


@pytest.fixture
def chains():
    yield from closing_factory(_chain, _shutdown)


@pytest.mark.parametrize("protocol", [15, 16, 17])
@pytest.mark.parametrize("splits", [((0, 3), (3, 6)), ((0, 2), (2, 4), (4, 6))])
@pytest.mark.parametrize("codec,policy", [("raw-f32-v1", "fixed"), ("raw-f32-v1", "auto-lossless-v1"),
                                          ("bf16-rne-v1", "fixed")])
def test_every_version_gives_the_tokens_of_one_stage(chains, protocol, splits, codec, policy):
    servers = chains(protocol, splits, codec, policy)
    with PipelineClient(*servers[0].address, timeout=10, protocol=protocol) as client:
        result = client.generate(PROMPT, max_tokens=6, chunk_size=4)
    assert result.tokens == fake_reference(PROMPT, 6)


def test_v16_forwards_a_multipart_frame_and_v17_agreement_framing(chains, tmp_path):
    # The forwarded sizes differ by version: v16 adds the 68 + 128 byte frame headers, v17 the 30-byte
    # agreement header instead (the tokens are the same, above).
    sizes = {}
    for protocol in (15, 16, 17):
        servers = chains(protocol)
        events = []
        servers[0].events = events.append
        with PipelineClient(*servers[0].address, timeout=10, protocol=protocol) as client:
            client.generate(PROMPT, max_tokens=3, chunk_size=4)
        deadline = time.monotonic() + 5
        while not events and time.monotonic() < deadline:
            time.sleep(0.01)
        sizes[protocol] = sum(events[0]["forwarded_bytes"].values())
    frames = events[0]["forwarded_messages"]
    assert sizes[16] - sizes[15] == frames * (68 + 128)
    assert sizes[17] - sizes[15] == frames * 30


def test_v17_stage_refuses_a_hello_with_a_wrong_sender_index(chains, caplog):
    servers = chains(17)
    out = ActivationProfile(1, 5, 0, 3, b"\0" * 32, 512, 1,
                            [ActivationPartProfile(b"\1" * 32, 0, 2, 1, False, (Fixed(N_EMBD), TOKENS, Fixed(1), Fixed(1)))])
    wrong = StageSetupConfig("skippy-wire", "skippy-wire", "skippy-wire", "stage5", 5, 0, 3,
                             downstream=StagePeer("stage1", 1))
    sock = socket.create_connection(servers[1].address, timeout=5)
    with caplog.at_level(logging.ERROR, logger="skippy_wire.net.server"):
        with pytest.raises(SetupError) as info:
            client_setup(sock, SetupRole.ACTIVATION, wrong, out, timeout=5)
        assert str(info.value) == "stage peer closed during setup"
        deadline = time.monotonic() + 5
        while "admitted upstream relationship mismatch" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    sock.close()
    assert "stage setup failed: admitted upstream relationship mismatch" in caplog.text
    # The stage still serves a correct pipeline afterwards.
    with PipelineClient(*servers[0].address, timeout=10, protocol=17) as client:
        assert client.generate(PROMPT, max_tokens=3, chunk_size=4).tokens == fake_reference(PROMPT, 3)


def test_v17_driver_checks_the_run_it_reached(chains):
    servers = chains(17)
    with pytest.raises(PipelineError, match="stage setup failed: admitted downstream relationship mismatch "
                                            r"\(run 'skippy-wire', here 'another-run'\)"):
        PipelineClient(*servers[0].address, timeout=5, protocol=17, identity=driver_identity("another-run"))
    # the model is named as the id --model-id sets, on this side of the link too
    with pytest.raises(PipelineError, match="stage setup failed: admitted downstream relationship mismatch "
                                            r"\(model id 'skippy-wire', here 'smol-copy'\)"):
        PipelineClient(*servers[0].address, timeout=5, protocol=17,
                       identity=driver_identity(model_id="smol-copy"))


def test_v17_driver_of_running_stages_checks_their_model_id_alone(chains):
    # a driver given another model's file than the stages' read its tokens as theirs: garbage, exit 0
    servers = chains(17)
    with pytest.raises(PipelineMismatch, match="stage setup failed: admitted downstream relationship mismatch "
                                               r"\(model id 'skippy-wire', here 'tiny'\)$"):
        PipelineClient(*servers[0].address, timeout=5, protocol=17, model_id="tiny")
    with PipelineClient(*servers[0].address, timeout=5, protocol=17, model_id="skippy-wire") as client:
        assert client.generate(PROMPT, max_tokens=3, chunk_size=4).tokens == fake_reference(PROMPT, 3)
    with pytest.raises(TypeError, match="model_id must be a str, not int"):
        PipelineClient(*servers[0].address, timeout=5, protocol=17, model_id=7)
    for ignored in (dict(protocol=16), dict(protocol=17, identity=driver_identity())):  # no setup, or one that checks
        with pytest.raises(ValueError, match="model_id is checked under protocol 17 without an identity"):
            PipelineClient(*servers[0].address, timeout=5, model_id="tiny", **ignored)


def test_v17_setup_past_its_deadline_is_no_mismatch_a_refused_one_is(chains):
    """A stage 0 slow to set up (its downstream still loading) was taken for a mismatch:
    `api --connect` exited instead of waiting for it."""
    silent = socket.create_server(("127.0.0.1", 0))  # takes the connection, never answers the setup
    try:
        with pytest.raises(PipelineError, match="no answer to the stage setup within 0.5 s$") as info:
            PipelineClient(*silent.getsockname()[:2], timeout=0.5, protocol=17)
        assert not isinstance(info.value, PipelineMismatch)
    finally:
        silent.close()
    servers = chains(17)
    with pytest.raises(PipelineMismatch, match="stage setup failed: admitted downstream relationship mismatch"):
        PipelineClient(*servers[0].address, timeout=5, protocol=17, identity=driver_identity("another-run"))


@pytest.mark.parametrize("stage,driver", [(16, 15), (15, 16), (17, 15), (17, 16), (15, 17), (16, 17)])
def test_in_process_mismatch_names_both_versions(chains, caplog, stage, driver):
    servers = chains(stage)
    with caplog.at_level(logging.ERROR, logger="skippy_wire.net.server"):
        with pytest.raises(PipelineError) as info:
            with PipelineClient(*servers[0].address, timeout=10, protocol=driver) as client:
                client.generate(PROMPT, max_tokens=2)
        deadline = time.monotonic() + 5
        while "this stage speaks" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    host, port = servers[0].address
    assert str(info.value) == f"stage 0 at {host}:{port} speaks state version {stage}, this driver speaks state version {driver}"
    assert f"this stage speaks state version {stage}" in caplog.text
    if stage != 17 or driver == 17:
        assert f"peer speaks state version {driver}, this stage speaks state version {stage}" in caplog.text


def test_a_later_message_of_another_version_is_logged_naming_both(chains, caplog):
    # the exact upstream text alone: the versions it leaves out are the detail, logged beside it
    servers = chains(16)
    message = StageWireMessage.stop(1, 1)
    message.state.version = 16
    stop = bytearray(WireProtocol(16).write(message))
    with caplog.at_level(logging.ERROR, logger="skippy_wire.net.server"):
        with socket.create_connection(servers[0].address, timeout=5) as s:
            assert s.recv(4) == READY_BYTES
            s.sendall(bytes(stop))
            assert s.recv(4096)  # answered
            struct.pack_into("<i", stop, 20, 99)
            s.sendall(bytes(stop))
            assert s.recv(4096) == b""  # closed
        deadline = time.monotonic() + 5
        while "malformed" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    assert ("malformed stage message (InvalidData: unsupported stage state version (peer sent state version 99, "
            "this side speaks state version 16)); closing") in caplog.text


def test_version_notice_and_detection():
    assert parse_version_notice(version_notice(16)) == 16
    assert version_notice(15)[:4] == VERSION_NOTICE_MAGIC and parse_version_notice(b"READY123") is None
    assert peer_version_of(bytes(20) + (16).to_bytes(4, "little")) == 16
    assert peer_version_of(bytes.fromhex("53505453") + bytes(8)) == 17
    assert [p.layer_start for p in parse_plan("0-15,15-30")] == [0, 15]
    with pytest.raises(ValueError):
        parse_plan("0:15")


# -- real processes on 127.0.0.1 --------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def _errors(log_dir: Path) -> str:
    time.sleep(0.3)
    return "\n".join(p.read_text(errors="replace") for p in sorted(log_dir.glob("stage*.log")))


@pytest.mark.slow
@pytest.mark.parametrize("protocol", [16, 17])
def test_processes_give_the_tokens_of_one_stage(tiny, protocol):
    with launch_pipeline(tiny, 2, threads=1, protocol=protocol) as cluster:
        with PipelineClient(*cluster.entry, timeout=30, protocol=protocol, identity=cluster.identity) as client:
            result = client.generate([1, 10, 20, 30], max_tokens=6)
    assert result.tokens == generate_local(tiny, [1, 10, 20, 30], max_tokens=6, threads=1).tokens


@pytest.mark.slow
def test_processes_v16_stage0_with_v15_stage1_fail_clearly(tiny, tmp_path):
    with launch_pipeline(tiny, 2, threads=1, protocols=[16, 15], log_dir=tmp_path) as cluster:
        with pytest.raises(PipelineError, match="closed the connection"):
            with PipelineClient(*cluster.entry, timeout=30, protocol=16) as client:
                client.generate([1, 10, 20], max_tokens=2)
        logs = _errors(tmp_path)
        down = cluster.stages[1].address
    assert f"downstream {down} speaks state version 15, this stage speaks state version 16" in logs
    assert "peer speaks state version 16, this stage speaks state version 15" in logs


@pytest.mark.slow
def test_processes_v15_driver_against_v16_stage_fails_clearly(tiny, tmp_path):
    with launch_pipeline(tiny, 2, threads=1, protocol=16, log_dir=tmp_path) as cluster:
        with pytest.raises(PipelineError) as info:
            with PipelineClient(*cluster.entry, timeout=30, protocol=15) as client:
                client.generate([1, 10, 20], max_tokens=2)
        logs = _errors(tmp_path)
        entry = cluster.stages[0].address
    assert str(info.value) == f"stage 0 at {entry} speaks state version 16, this driver speaks state version 15"
    assert "\n" not in str(info.value)
    assert "peer speaks state version 15, this stage speaks state version 16" in logs


def _cli(*args, timeout=300):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "skippy_wire", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["16", "17"])
@pytest.mark.parametrize("codec", [("raw-f32-v1", "fixed"), ("raw-f32-v1", "auto-lossless-v1")])
def test_run_check_in_every_version(protocol, codec):
    proc = _cli("run", "The capital of France is", "--max-tokens", "8", "--check", "--quiet", "--protocol", protocol,
                "--activation-codec", codec[0], "--activation-codec-policy", codec[1])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check: OK" in proc.stderr and f"state version {protocol}" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("protocol", [16, 17])
def test_inspect_dissects_v16_and_v17_captures(tmp_path, capsys, protocol):
    proc = _cli("run", "Hello", "--max-tokens", "3", "--quiet", "--protocol", str(protocol), "--capture", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    hop1 = (tmp_path / "hop1-messages.bin").read_bytes()
    assert detect_protocol(hop1, replies=False) == protocol
    for name in ("hop0-messages.bin", "hop0-replies.bin", "hop1-messages.bin", "hop1-replies.bin"):
        assert inspect_main([str(tmp_path / name)]) == 0, name
    out = capsys.readouterr().out
    assert f"message (state version {protocol})" in out
    assert "frame v2: producer 0" in out and "part 0: F32  rank 2  token_axis 1" in out
    if protocol == 17:
        assert "setup Hello" in out and "setup Offer" in out and "agreement-framed activation" in out
        assert '"role":"TokensAndControl"' in out and '"role":"Activation"' in out
    # Forcing the wrong version fails at the first message.
    assert inspect_main([str(tmp_path / "hop1-messages.bin"), "--protocol", "15"]) == 1


def _logged_after(caplog, text: str) -> str:
    deadline = time.monotonic() + 5
    while text not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    return caplog.text


@pytest.mark.parametrize("protocol", [15, 16, 17])
def test_a_message_at_a_wrong_position_is_one_line_in_every_version(chains, caplog, protocol):
    # The v16/v17 readers give the kind as a plain int: naming it must not need the enum.
    from skippy_wire.net.schedule import decode_message

    servers = chains(protocol)
    with caplog.at_level(logging.INFO, logger="skippy_wire.net.server"):
        with PipelineClient(*servers[0].address, timeout=10, protocol=protocol) as client:
            with pytest.raises(PipelineError, match="closed the connection"):
                client.request(decode_message(5, 100, 0, 100, 78, 78))
        text = _logged_after(caplog, "holds 0 tokens")
    assert "DECODE_EMBD at position 100, but session 78 holds 0 tokens; closing" in text
    assert "unexpected error" not in text and "Traceback" not in text


@pytest.mark.parametrize("protocol", [16, 17])
def test_kind_23_is_read_and_refused_as_unsupported(chains, caplog, protocol):
    from skippy_wire.wire.activation_frame import DISCARD_STALE_WINDOWS
    from skippy_wire.wire.messages import StageStateHeader, StageWireMessage, WireStagePhase

    servers = chains(protocol)
    discard = StageWireMessage(DISCARD_STALE_WINDOWS, 1, 1, StageStateHeader(phase=WireStagePhase.DECODE), 0, 0)
    with caplog.at_level(logging.INFO, logger="skippy_wire.net.server"):
        with PipelineClient(*servers[0].address, timeout=10, protocol=protocol) as client:
            with pytest.raises(PipelineError, match="closed the connection"):
                client.send_bytes(client._link.encode(discard), "DiscardStaleWindows")
                client.receive("DiscardStaleWindows")
        text = _logged_after(caplog, "DISCARD_STALE_WINDOWS")
    assert "unsupported stage message kind DISCARD_STALE_WINDOWS (23); closing" in text
    assert "unexpected error" not in text
    with PipelineClient(*servers[0].address, timeout=10, protocol=protocol) as client:
        assert client.generate(PROMPT, max_tokens=3, chunk_size=4).tokens == fake_reference(PROMPT, 3)


@pytest.mark.parametrize("protocol,activation", [
    (16, struct.pack("<IiiiIIIQ", 2, 0, 0, 3, 1, 1, 1, 4 * N_EMBD)[:30]),  # a frame header cut short
    (17, b"\x01" * 10),  # shorter than its agreement's own header
])
def test_a_whole_message_whose_activation_ends_early_is_malformed_not_a_disconnect(chains, caplog, protocol,
                                                                                   activation):
    """The stage logged "peer disconnected in the middle of a message" while the peer, still
    connected, had sent every byte: the activation's own UnexpectedEof was taken for the
    socket's."""
    servers = chains(protocol, ((0, 6),))
    kind = WireMessageKind.DECODE_EMBD
    header = dataclasses.replace(StageStateHeader.new(kind), source_stage_index=0, flags=1)
    data = bytearray(write_stage_message(StageWireMessage(kind, 0, 1, header, 1, 3, tokens=[1],
                                                          activation=activation)))
    struct.pack_into("<i", data, 20, protocol)  # the header's version (wire-format.md 3.1)
    with caplog.at_level(logging.INFO, logger="skippy_wire.net.server"):
        with PipelineClient(*servers[0].address, timeout=10, protocol=protocol) as client:
            client.send_bytes(bytes(data), "DecodeEmbd")
            with pytest.raises(PipelineError, match="closed the connection"):
                client.receive("DecodeEmbd")
        text = _logged_after(caplog, "UnexpectedEof")
    assert "malformed stage message (UnexpectedEof: " in text and "disconnected" not in text


def test_v17_connect_and_close_is_not_an_error(chains, caplog):
    # A port check connects and leaves: as on v15, an INFO line, not a failed setup.
    servers = chains(17)
    with caplog.at_level(logging.INFO, logger="skippy_wire.net.server"):
        socket.create_connection(servers[0].address, timeout=5).close()
        text = _logged_after(caplog, "before its setup")
    assert "closed by peer before its setup" in text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_bytes_that_are_no_setup_are_a_failed_setup_not_a_made_up_version(chains, caplog):
    # An HTTP request or random bytes to a v17 stage were logged as "peer speaks state
    # version 225976378", their word at the version's offset read as one.
    servers = chains(17)
    with caplog.at_level(logging.INFO, logger="skippy_wire.net.server"):
        for junk in (b"GET / HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n", bytes(range(7, 71))):
            with socket.create_connection(servers[0].address, timeout=5) as s:
                s.sendall(junk)
                s.recv(64)  # until the stage closes
        text = _logged_after(caplog, "incompatible stage setup protocol")
    assert text.count("stage setup failed: incompatible stage setup protocol") == 2
    assert "peer speaks state version" not in text


def test_the_look_for_a_version_after_a_failed_setup_is_bounded_as_a_whole(chains, monkeypatch):
    # After a header that is no setup, the stage reads on for a stage message's version
    # word; a peer trickling those bytes had NOTICE_WAIT_SECONDS for each of them
    monkeypatch.setattr(protocol_io, "NOTICE_WAIT_SECONDS", 0.3)
    servers = chains(17)
    with socket.create_connection(servers[0].address, timeout=5) as s:
        s.sendall(struct.pack("<III", 0xDEADBEEF, 12, 100))
        closed_at = None
        for sent in range(1, 13):  # a byte every 0.2 s: 2.4 s in all, the stage's wait 0.3 s in all
            time.sleep(0.2)
            try:
                s.sendall(b"x")
            except OSError:  # reset: the stage had closed
                closed_at = sent
                break
            s.settimeout(0.0)
            try:
                if s.recv(1024) == b"":
                    closed_at = sent
                    break
            except BlockingIOError:
                pass
            except OSError:
                closed_at = sent
                break
        assert closed_at is not None and closed_at < 12, closed_at


def test_a_driver_whose_message_the_stage_reads_as_another_version_is_told_so(chains):
    # The stage answers with a notice naming its own version, which is the driver's too:
    # "speaks state version 17, this driver speaks state version 17" named no difference.
    from skippy_wire.net.schedule import decode_message

    servers = chains(17)
    host, port = servers[0].address
    with PipelineClient(host, port, timeout=10, protocol=17) as client:
        with pytest.raises(PipelineError) as info:
            client.send_bytes(WireProtocol(15).write(decode_message(5, 0, 0, 1, 7, 7)), "DecodeEmbd")
            client.receive("DecodeEmbd")
    assert str(info.value) == (f"stage 0 at {host}:{port} refused what this driver sent as not of state version 17, "
                               "which both speak")


def test_a_setup_refused_further_down_is_a_closed_handshake_with_a_hint(chains):
    # A v17 stage whose downstream refuses the setup closes its upstream one without a
    # reason on the wire; the driver said only "stage setup failed: stage peer closed during setup".
    servers = chains(17, splits=((0, 3), (4, 6)))
    host, port = servers[0].address
    with pytest.raises(PipelineError) as info:
        PipelineClient(host, port, timeout=5, protocol=17)
    assert str(info.value) == (f"stage 0 at {host}:{port} closed the connection during the setup handshake (a stage "
                               "failed or refused the setup; the stages' logs say which and why)")


def test_a_downstream_that_closes_or_resets_is_said_in_words(monkeypatch):
    """A send to a closed downstream logged "closed the connection ([Errno 32] Broken pipe)"."""
    def raising(exc):
        def fail(*args):
            raise exc
        return fail

    a, b = socket.socketpair()
    with a, b:
        link = LinkProtocol(15, Peer(a), who="downstream 10.0.0.2:9000")
        monkeypatch.setattr(link.peer, "send", raising(BrokenPipeError(32, "Broken pipe")))
        with pytest.raises(StageError) as closed:
            link.send_within(b"x", 1.0)
        monkeypatch.setattr(link.peer.reader, "read", raising(ConnectionResetError(104, "Connection reset by peer")))
        with pytest.raises(StageError) as reset:
            link.read_owed_replies(1.0, 0.0)
    assert str(closed.value) == "downstream 10.0.0.2:9000 closed the connection (broken pipe)"
    assert str(reset.value) == "downstream 10.0.0.2:9000 reset the connection (connection reset by peer)"
