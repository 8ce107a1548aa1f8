"""The v17 setup handshake over real loopback sockets, version mismatches between peers,
and hostile bytes (never a crash, never an allocation from a declared length)."""

from __future__ import annotations

import os
import socket
import struct
import threading

import numpy as np
import pytest

from skippy_wire.errors import InvalidDataError, UnexpectedEofError, WireError
from skippy_wire.wire.activation_frame import ActivationFrameV16, ActivationPartV16, GgmlType
from skippy_wire.wire.agreement import TOKENS, ActivationPartProfile, ActivationProfile, Fixed
from skippy_wire.wire.constants import ActivationCodec
from skippy_wire.wire.frame import send_ready, write_stage_message as write_v15
from skippy_wire.wire.messages import StageStateHeader, StageWireMessage, WireMessageKind
from skippy_wire.wire.protocol import ProtocolVersionError, StageConnection, WireProtocol, kernels
from skippy_wire.wire.setup import (
    SetupError,
    SetupRole,
    StagePeer,
    StageSetupConfig,
    client_setup,
    encode_packet,
    server_setup,
)

BF16 = ActivationCodec.BF16_RNE_V1
IDENTITY = b"\x01" * 32
FRONTIER = b"\x03" * 32


def profile(producer=0, layers=(0, 4)) -> ActivationProfile:
    part = ActivationPartProfile(IDENTITY, 0, 2, 1, False, (Fixed(4), TOKENS, Fixed(1), Fixed(1)))
    return ActivationProfile(1, producer, layers[0], layers[1], FRONTIER, 32, 8, [part])


def sender_config(**kw) -> StageSetupConfig:
    values = dict(run_id="r", topology_id="p", model_id="m", stage_id="s0", stage_index=0, layer_start=0, layer_end=4,
                  downstream=StagePeer("s1", 1))
    values.update(kw)
    return StageSetupConfig(**values)


def receiver_config(**kw) -> StageSetupConfig:
    values = dict(run_id="r", topology_id="p", model_id="m", stage_id="s1", stage_index=1, layer_start=4, layer_end=8)
    values.update(kw)
    return StageSetupConfig(**values)


def run_pair(client, server):
    """Run ``server(sock)`` in a thread and ``client(sock)`` here over a TCP loopback pair."""
    listener = socket.create_server(("127.0.0.1", 0))
    result: dict = {}

    def serve():
        conn, _ = listener.accept()
        with conn:
            try:
                result["server"] = ("ok", server(conn))
            except Exception as exc:  # noqa: BLE001 - reported to the test
                result["server"] = ("err", exc)

    thread = threading.Thread(target=serve)
    thread.start()
    with socket.create_connection(listener.getsockname()) as sock:
        try:
            result["client"] = ("ok", client(sock))
        except Exception as exc:  # noqa: BLE001
            result["client"] = ("err", exc)
    thread.join(10)
    listener.close()
    return result["client"], result["server"]


def frame_message(version: int, protocol: WireProtocol, values=(1.0, 2.0, 3.0, 4.0)) -> StageWireMessage:
    desc = ActivationFrameV16.of_parts([ActivationPartV16.dense(IDENTITY, GgmlType.F32, (4, 1), 1)], token_count=1,
                                       producer_stage_index=0, layer_start=0, layer_end=4, frontier_identity=FRONTIER)
    frame = protocol.encode_frame(BF16, desc, np.array(values, "<f4").tobytes())
    state = StageStateHeader.new(WireMessageKind.DECODE_EMBD)
    state.version, state.source_stage_index, state.activation_codec = version, 0, BF16
    return StageWireMessage(WireMessageKind.DECODE_EMBD, 5, 1, state, 7, 11, activation=frame)


def test_handshake_then_v17_messages_over_tcp(impl):
    sent = frame_message(17, WireProtocol(17, impl=impl))

    def client(sock):
        conn = StageConnection(sock, 17, impl=impl)
        conn.establish(client_setup(sock, SetupRole.ACTIVATION, sender_config(), profile(), timeout=5, impl=impl))
        conn.write_message(sent)
        return conn.agreement

    def server(sock):
        role, agreement = server_setup(sock, receiver_config(), profile(), timeout=5, impl=impl)
        conn = StageConnection(sock, 17, impl=impl)
        conn.establish(agreement)
        return role, agreement, conn.read_message()

    (ck, agreement), (sk, (role, server_agreement, got)) = run_pair(client, server)
    assert (ck, sk) == ("ok", "ok")
    assert role is SetupRole.ACTIVATION and agreement == server_agreement and any(agreement.generation)
    assert got.token_count == 1 and got.state.activation_codec == BF16
    desc, payload = WireProtocol(17, impl=impl).decode_frame(ActivationCodec.RAW_F32_V1, got.activation)
    assert np.frombuffer(payload, "<f4").tolist() == [1.0, 2.0, 3.0, 4.0]
    again = StageConnection(None, 17, impl=impl)
    again.establish(agreement)
    with pytest.raises(InvalidDataError, match="cannot replace an established activation agreement"):
        again.establish(agreement)


@pytest.mark.parametrize("model_id", ["m", "another"])  # a handshake that succeeds, one that fails
def test_setup_clears_the_sockets_timeouts_whatever_they_were(impl, model_id):
    # B.2: cleared when setup ends (they were put back to the caller's 7 s before)
    def client(sock):
        sock.settimeout(7.0)
        try:
            client_setup(sock, SetupRole.ACTIVATION, sender_config(), profile(), timeout=5, impl=impl)
        except SetupError:
            pass
        return sock.gettimeout()

    def server(sock):
        sock.settimeout(7.0)
        try:
            server_setup(sock, receiver_config(model_id=model_id), profile(), timeout=5, impl=impl)
        except SetupError:
            pass
        return sock.gettimeout()

    assert run_pair(client, server) == (("ok", None), ("ok", None))


class _ResetSocket:
    """A socket whose peer has reset the connection: every send fails as the kernel's does."""

    def settimeout(self, value):
        pass

    def recv(self, n):
        raise AssertionError("the client writes its Hello first")

    def send(self, data):
        raise BrokenPipeError(32, "Broken pipe")


def test_a_socket_error_during_setup_propagates_with_its_system_text(impl):
    # B.2: only an end of stream (or a write taking 0 bytes) is "stage peer closed during setup"
    with pytest.raises(BrokenPipeError, match="Broken pipe"):
        client_setup(_ResetSocket(), SetupRole.ACTIVATION, sender_config(), profile(), timeout=5, impl=impl)


def _server_error(hello_bytes: bytes, impl, **kw) -> SetupError:
    def client(sock):
        sock.sendall(hello_bytes)
        sock.shutdown(socket.SHUT_WR)
        return sock.recv(1 << 16)

    def server(sock):
        return server_setup(sock, receiver_config(**kw.pop("config", {})), profile(), timeout=5, impl=impl, **kw)

    _, (kind, error) = run_pair(client, server)
    assert kind == "err" and isinstance(error, SetupError), error
    return error


def _hello(sender=None, **output) -> bytes:
    config = sender_config(**(sender or {}))
    body = {"role": "Activation",
            "sender": {"run": "r", "topology": "p", "model": "m", "stage": config.stage_id, "index": config.stage_index,
                       "layer_start": config.layer_start, "layer_end": config.layer_end},
            "target": ["s1", 1], "output": profile(**output).to_json()}
    return encode_packet(body)


def test_server_accepts_the_well_formed_hello(impl):
    def client(sock):
        return client_setup(sock, "Activation", sender_config(), profile(), timeout=5, impl=impl)

    (ck, _), (sk, _) = run_pair(client, lambda s: server_setup(s, receiver_config(), profile(), timeout=5, impl=impl))
    assert (ck, sk) == ("ok", "ok")


def test_wrong_magic(impl):
    bad = b"XXXX" + _hello()[4:]
    assert str(_server_error(bad, impl)) == "incompatible stage setup protocol"


def test_wrong_protocol_generation(impl):
    bad = _hello()[:4] + struct.pack("<I", 11) + _hello()[8:]
    assert str(_server_error(bad, impl)) == "incompatible stage setup protocol"


def test_bad_json(impl):
    body = b'{"role":"Activation",'
    error = _server_error(struct.pack("<III", 0x53545053, 12, len(body)) + body, impl)
    assert str(error) == "decode stage setup" and error.detail.startswith("decode stage setup: ")


def test_float_where_an_integer_belongs(impl):
    hello = _hello().replace(b'"index":0', b'"index":0.0')
    hello = hello[:8] + struct.pack("<I", len(hello) - 12) + hello[12:]
    assert str(_server_error(hello, impl)) == "decode stage setup"


def test_non_contiguous_layers(impl):
    # the sender ends at layer 3 but the receiver starts at layer 4
    error = _server_error(_hello(sender={"layer_end": 3}, layers=(0, 3)), impl)
    assert str(error) == "admitted upstream relationship mismatch"
    assert error.detail == "upstream layer_end 3, here 4"  # the operator's clue; the text is upstream's


def test_another_model_id_is_named_as_the_model_id(impl):
    # "model 'm'" sent an operator whose hosts name the model's file differently to the
    # model files; the id is what --model-id sets
    hello = _hello().replace(b'"model":"m"', b'"model":"smol-copy"')
    hello = hello[:8] + struct.pack("<I", len(hello) - 12) + hello[12:]
    error = _server_error(hello, impl)
    assert str(error) == "admitted upstream relationship mismatch"
    assert error.detail == "model id 'smol-copy', here 'm'"


def test_wrong_sender_index(impl):
    error = _server_error(_hello(sender={"stage_index": 1}, producer=1), impl)
    assert str(error) == "admitted upstream relationship mismatch"
    assert error.detail == "upstream stage index 1, here 0"



def test_sender_u32s_are_compared_as_i32_like_upstream(impl):
    # upstream compares the output's i32 producer with `sender.index as i32`: index 2^31 wraps
    # to -2^31, passes the relationship check, and the negative producer then fails the
    # agreement's validation (B.5) with upstream's text
    index = 2**31
    body = {"role": "Activation",
            "sender": {"run": "r", "topology": "p", "model": "m", "stage": "s0", "index": index,
                       "layer_start": 0, "layer_end": 4},
            "target": ["s1", index + 1], "output": profile(producer=-index).to_json()}
    error = _server_error(encode_packet(body), impl, config={"stage_index": index + 1})
    assert str(error) == "invalid activation profile"
    body["output"] = profile(producer=index - 1).to_json()  # no wrap: a plain mismatch
    error = _server_error(encode_packet(body), impl, config={"stage_index": index + 1})
    assert str(error) == "admitted upstream relationship mismatch"

def test_client_rejects_a_stale_ready_generation(impl):
    def server(sock):
        hello = sock.recv(1 << 16)
        assert hello[:4] == b"SPTS"
        offer = {"role": "Activation",
                 "receiver": {"run": "r", "topology": "p", "model": "m", "stage": "s1", "index": 1,
                              "layer_start": 4, "layer_end": 8},
                 "agreement": {"generation": list(range(1, 17)), "profiles": [profile().to_json()]}}
        sock.sendall(encode_packet(offer))
        sock.recv(1 << 16)
        sock.sendall(encode_packet(list(range(2, 18))))

    (ck, error), _ = run_pair(lambda s: client_setup(s, "Activation", sender_config(), profile(), timeout=5,
                                                      impl=impl), server)
    assert ck == "err" and str(error) == "setup confirmation generation mismatch"


@pytest.mark.parametrize("then_message", [True, False])
def test_v16_peer_talking_to_a_v17_listener_names_both_versions(impl, then_message):
    """A v16 peer starts with READY (and then stage messages): the exact upstream text
    stays, ``detail`` names both versions."""
    def client(sock):
        with sock.makefile("wb", buffering=0) as out:
            send_ready(out)
            if then_message:
                out.write(WireProtocol(16, impl=impl).write(StageWireMessage.stop()))
        sock.shutdown(socket.SHUT_WR)

    _, (kind, error) = run_pair(client, lambda s: server_setup(s, receiver_config(), profile(), timeout=5, impl=impl))
    want = "incompatible stage setup protocol" if then_message else "stage peer closed during setup"
    assert kind == "err" and str(error) == want
    assert "16" in error.detail and "17" in error.detail


def test_v15_peer_talking_to_a_v16_reader_names_both_versions(impl):
    msg = StageWireMessage.stop()  # a v15 message
    data = write_v15(msg)

    def client(sock):
        sock.sendall(data)

    def server(sock):
        return StageConnection(sock, 16, impl=impl).read_message()

    _, (kind, error) = run_pair(client, server)
    assert kind == "err" and isinstance(error, ProtocolVersionError)
    assert (error.received, error.expected) == (15, 16)
    # upstream's exact text, as every wire error's (it had both versions appended); the detail names them
    assert str(error) == "unsupported stage state version"
    assert error.detail == "peer sent state version 15, this side speaks state version 16"
    with pytest.raises(InvalidDataError) as raw:
        kernels(impl).read_stage_message_from_buffer(16, data, None, 0, 0, None)
    assert str(raw.value) == "unsupported stage state version"


def test_v16_writer_to_v17_reader_names_both_versions(impl):
    data = WireProtocol(16, impl=impl).write(frame_message(16, WireProtocol(16, impl=impl)))
    with pytest.raises(ProtocolVersionError) as error:
        WireProtocol(17, impl=impl).read(data)
    assert (error.value.received, error.value.expected) == (16, 17)
    assert str(error.value) == "unsupported stage state version"  # as the vectors pin it, through the public reader


def test_declared_huge_setup_length_is_refused_before_reading(impl):
    header = struct.pack("<III", 0x53545053, 12, 0xFFFFFFFF)
    assert str(_server_error(header, impl)) == "stage setup message exceeds limit"


def test_declared_huge_activation_count_is_refused(impl):
    msg = frame_message(16, WireProtocol(16, impl=impl))
    data = bytearray(WireProtocol(16, impl=impl).write(msg))
    data[60:64] = struct.pack("<i", 0x7FFFFFFF)
    with pytest.raises(InvalidDataError, match="activation payload byte count exceeds maximum"):
        WireProtocol(16, impl=impl).read(bytes(data))


def test_huge_frame_descriptor_is_refused_without_allocating(impl):
    """A frame header declaring a 512 MiB part over a few bytes fails on sizes alone."""
    protocol = WireProtocol(16, impl=impl)
    wire = protocol.encode_frame(ActivationCodec.RAW_F32_V1, ActivationFrameV16.of_parts(
        [ActivationPartV16.dense(IDENTITY, GgmlType.F32, (4, 1), 1)], token_count=1), bytes(16))
    forged = bytearray(wire[:196])
    forged[28:36] = struct.pack("<Q", 1 << 29)  # payload_bytes
    forged[68 + 48:68 + 56] = struct.pack("<q", 1 << 27)  # dimension 0
    forged[68 + 88:68 + 96] = struct.pack("<Q", 1 << 29)  # stride 1
    forged[68 + 96:68 + 112] = struct.pack("<QQ", 1 << 29, 1 << 29)
    forged[68 + 120:68 + 128] = struct.pack("<Q", 1 << 29)
    with pytest.raises(InvalidDataError, match="activation frame wire byte count exceeds maximum"):
        protocol.decode_frame(ActivationCodec.RAW_F32_V1, bytes(forged))


@pytest.mark.parametrize("version", [16, 17])
def test_random_bytes_never_crash(impl, version):
    rng = np.random.default_rng(version)
    protocol = WireProtocol(version, impl=impl)
    base = bytearray(WireProtocol(16, impl=impl).write(frame_message(16, WireProtocol(16, impl=impl))))
    base[20:24] = struct.pack("<i", version)
    agreement = None
    for i in range(3000):
        data = bytearray(base)
        for _ in range(1 + i % 4):
            data[int(rng.integers(len(data)))] ^= int(rng.integers(1, 256))
        if i % 7 == 0:
            data = data[: int(rng.integers(len(data)))]
        try:
            protocol.read_from_buffer(bytes(data), agreement=agreement)
        except WireError:
            pass
    for _ in range(500):
        blob = os.urandom(int(rng.integers(0, 400)))
        for fn in (lambda: protocol.decode_frame(BF16, blob), lambda: protocol.read_from_buffer(blob)):
            try:
                fn()
            except (WireError, UnexpectedEofError):
                pass
