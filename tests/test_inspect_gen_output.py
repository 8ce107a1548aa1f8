"""``skippy-wire inspect`` on state version 16 and 17 captures: every field as for v15
(phase and flags by name, the sampling block, chat metadata), the frame part by part,
replies with kind, window, MTP draft and stats, and a v17 messages capture read without
its link's agreement (stdin)."""

from __future__ import annotations

import io
import struct
import sys

import pytest

from skippy_wire.net.driver import PipelineClient
from skippy_wire.net.server import StageServer
from skippy_wire.tools.inspect import dissect, main
from skippy_wire.tools.serve import stage_config
from skippy_wire.wire.activation_frame import DISCARD_STALE_WINDOWS, ActivationFrameV16, ActivationPartV16, GgmlType
from skippy_wire.wire.agreement import TOKENS, ActivationAgreement, ActivationPartProfile, ActivationProfile, Fixed
from skippy_wire.wire.constants import ActivationCodec
from skippy_wire.wire.frame import send_reply_ack, send_reply_message, send_reply_predicted
from skippy_wire.wire.messages import SamplingConfig, StageStateHeader, StageWireMessage, WireMessageKind as K
from skippy_wire.wire.protocol import WireProtocol
from skippy_wire.wire.replies import NativeMtpDraft, StageReply, StageReplyStats, StageReplyWindow, WireReplyKind
from skippy_wire.wire.setup import encode_packet

from test_server import PROMPT, FakeBackend, closing_factory

BF16 = ActivationCodec.BF16_RNE_V1
F32_ID, I32_ID, FRONTIER = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
GENERATION = bytes(range(16))
SAMPLING = SamplingConfig(flags=1, seed=42, temperature=0.5, top_k=40)
UNDECODED = "not decoded: an agreement-framed activation needs its link's agreement"


def _frame(protocol: WireProtocol, token_count: int = 2, *, with_i32: bool = False) -> bytes:
    """A frame of one F32 part (4 x tokens: 1, 2, 3, ...) and, optionally, an I32 part (tokens)."""
    parts = [ActivationPartV16.dense(F32_ID, GgmlType.F32, (4, token_count), 1)]
    payload = struct.pack(f"<{4 * token_count}f", *range(1, 4 * token_count + 1))
    if with_i32:
        parts.append(ActivationPartV16.dense(I32_ID, GgmlType.I32, (token_count,), 0, optional=True))
        payload += struct.pack(f"<{token_count}i", *range(-7, -7 + token_count))
    desc = ActivationFrameV16.of_parts(parts, token_count=token_count, producer_stage_index=0, layer_start=0,
                                       layer_end=4, frontier_identity=FRONTIER)
    return protocol.encode_frame(BF16, desc, payload)


def _messages(version: int, protocol: WireProtocol) -> list:
    def state(kind, **fields):
        st = StageStateHeader.new(kind, version)
        for name, value in fields.items():
            setattr(st, name, value)
        return st

    configure = StageWireMessage.configure_generation(7, 11, 2, SAMPLING, '{"a": 1}')
    configure.state.version = version
    prefill = StageWireMessage(K.PREFILL_FINAL_EMBD, 0, 2, state(K.PREFILL_FINAL_EMBD, source_stage_index=0,
                                                                 activation_codec=BF16, seq_id=3,
                                                                 checkpoint_generation=5),
                               7, 11, tokens=[5, 6], activation=_frame(protocol, with_i32=version == 16))
    # bit 6 was the RWKV7 sideband in v15; from v16 on it is carried without a name
    decode = StageWireMessage(K.DECODE_EMBD, 2, 1, state(K.DECODE_EMBD, source_stage_index=0, activation_codec=BF16,
                                                         flags=0x40, decode_step=0, current_token=9),
                              7, 11, tokens=[9], activation=_frame(protocol, 1))
    discard = StageWireMessage(DISCARD_STALE_WINDOWS, 3, 1, state(DISCARD_STALE_WINDOWS, source_stage_index=0,
                                                                  activation_codec=BF16), 7, 11,
                               activation=_frame(protocol, 1))
    return [configure, prefill, decode, discard, _stop(version)]


def _stop(version: int) -> StageWireMessage:
    stop = StageWireMessage.stop(7, 11)
    stop.state.version = version
    return stop


def _agreement() -> ActivationAgreement:
    part = ActivationPartProfile(F32_ID, 0, 2, 1, False, (Fixed(4), TOKENS, Fixed(1), Fixed(1)))
    return ActivationAgreement(GENERATION, [ActivationProfile(1, 0, 0, 4, FRONTIER, 32, 8, [part])])


def _replies() -> bytes:
    buf = io.BytesIO()
    send_reply_ack(buf)
    stats = StageReplyStats()
    stats.observe_prefill_compute(1, 1500, 8)
    send_reply_predicted(buf, 42, stats)
    send_reply_message(buf, StageReply(WireReplyKind.PREDICTED_TOKENS, 5, [5, 6], StageReplyWindow(9),
                                       NativeMtpDraft([6, 7], 120), StageReplyStats()))
    return buf.getvalue()


def _capture(tmp_path, version: int) -> tuple:
    """``(messages path, replies path)`` of one hop in ``version``, written without a stage."""
    protocol = WireProtocol(version)
    agreement = _agreement() if version == 17 else None
    messages = b"".join(protocol.write(m, agreement) for m in _messages(version, protocol))
    replies = b"\x59\x44\x52\x53" + _replies()
    if version == 17:
        hello = {"role": "Activation", "sender": None, "target": ["s1", 1], "output": None}
        messages = encode_packet(hello) + encode_packet(list(GENERATION)) + messages
        offer = {"role": "Activation", "receiver": None, "agreement": agreement.to_json()}
        replies = encode_packet(offer) + encode_packet(list(GENERATION)) + _replies()
    paths = tmp_path / "hop1-messages.bin", tmp_path / "hop1-replies.bin"
    paths[0].write_bytes(messages)
    paths[1].write_bytes(replies)
    return paths


class _Stdin:
    def __init__(self, data: bytes) -> None:
        self.buffer = io.BytesIO(data)


def _inspect(capsys, *args) -> tuple:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("version", [16, 17])
def test_messages_show_every_state_field_and_the_sampling_block(tmp_path, capsys, version):
    code, out, err = _inspect(capsys, _capture(tmp_path, version)[0])
    assert (code, err) == (0, "")
    assert f"message (state version {version}), " in out and "CONFIGURE_GENERATION (14)" in out
    assert (f"state: version {version}  seq_id 0  phase Prefill (1)  flags 0x28 [SAMPLING|CHAT_SAMPLING_METADATA]  "
            "checkpoint_generation 0  prompt_token_count 2") in out
    assert "seq_id 3  phase Prefill (1)  flags 0x1 [FINAL_CHUNK]  checkpoint_generation 5" in out
    assert "phase Decode (2)  flags 0x40 [0x40]" in out  # no v15 sideband name
    assert "activation_codec bf16-rne-v1 (3)" in out
    assert "sampling: flags 1  seed 42  temperature 0.5  top_p 1.0  top_k 40" in out
    assert "samplers [" in out and "ignore_eos False" in out and "sampling: present" not in out
    assert "chat_sampling_metadata (8 bytes): '{\"a\": 1}'" in out
    assert "tokens: [5, 6]" in out and "STOP (3)" in out and "request_id 7  session_id 11" in out
    assert "5 records" in out if version == 16 else "7 records" in out


@pytest.mark.parametrize("version", [16, 17])
def test_discard_stale_windows_is_named_with_its_fields(tmp_path, capsys, version):
    _, out, _ = _inspect(capsys, _capture(tmp_path, version)[0])
    record = out.split("DISCARD_STALE_WINDOWS (23)")[1].split("\n#")[0]
    assert "pos_start 3  token_count 1" in record
    assert "phase Decode (2)  flags 0x0 [none]" in record and "source_stage_index 0" in record
    assert "frame v2: producer 0  layers 0..4  token_count 1" in record


def test_v16_frames_show_every_part_with_its_values(tmp_path, capsys):
    _, out, _ = _inspect(capsys, _capture(tmp_path, 16)[0])
    assert "activation: activation frame (bf16-rne-v1), " in out
    assert "frame v2: producer 0  layers 0..4  token_count 2  sequence_count 1  parts 2" in out
    assert "part 0: F32  rank 2  token_axis 1  flags 0  dims [4, 2, 1, 1]" in out
    assert "min 1  max 8  mean 4.5  non-finite 0" in out and "values: [1, 2, 3, 4, 5, 6, 7, 8]" in out
    assert "part 1: I32  rank 1  token_axis 0  flags 1 (OPTIONAL)  dims [2, 1, 1, 1]" in out
    assert "values: [-7, -6]" in out


def test_v17_activations_are_decoded_under_the_sibling_agreement(tmp_path, capsys):
    code, out, _ = _inspect(capsys, _capture(tmp_path, 17)[0])
    assert code == 0
    assert "#0 @0 setup Hello" in out and "setup accept" in out
    assert "activation: agreement-framed activation (bf16-rne-v1), " in out
    assert f"agreed: generation {GENERATION.hex()}  profile 1  token_count 2  sequence_count 1  presence 0b1" in out
    assert "values: [1, 2, 3, 4, 5, 6, 7, 8]" in out and UNDECODED not in out


@pytest.mark.parametrize("version", [16, 17])
def test_replies_show_kind_window_mtp_draft_and_stats(tmp_path, capsys, version):
    code, out, _ = _inspect(capsys, _capture(tmp_path, version)[1])
    assert code == 0 and "<WireReplyKind" not in out
    if version == 17:
        assert "#0 @0 setup Offer" in out and "setup ready" in out
    assert "reply, 236 bytes: ACK (1)" in out and "stats: all 27 fields zero" in out
    assert ("PREDICTED_TOKEN (2)\n  predicted 42  predicted_tokens [42]  window {window_id 0}  "
            "native_mtp_draft none") in out
    assert "stats: prefill_compute_us_at_slowest_rate 1500" in out
    assert ("PREDICTED_TOKENS (3)\n  predicted 5  predicted_tokens [5, 6]  window {window_id 9}  native_mtp_draft "
            "{token_ids [6, 7], proposal_compute_us 120}") in out


def test_v17_messages_from_stdin_keep_going_without_the_agreement(tmp_path, capsys, monkeypatch):
    data = _capture(tmp_path, 17)[0].read_bytes()
    monkeypatch.setattr(sys, "stdin", _Stdin(data))
    code, out, err = _inspect(capsys, "-")
    assert (code, err) == (0, "")
    assert out.count(UNDECODED) == 3 and "frame v2" not in out
    assert "PREFILL_FINAL_EMBD (4)" in out and "tokens: [5, 6]" in out and "STOP (3)" in out
    assert "flags 0x1 [FINAL_CHUNK]" in out and "sampling: flags 1  seed 42" in out
    assert f"agreed: generation {GENERATION.hex()}  profile 1  token_count 2" in out
    assert out.endswith(f"7 records, {len(data)} bytes\n")


def test_v17_replies_from_stdin_are_told_by_the_offer(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", _Stdin(_capture(tmp_path, 17)[1].read_bytes()))
    code, out, _ = _inspect(capsys, "-")
    assert code == 0 and "setup Offer" in out and "PREDICTED_TOKEN (2)" in out and "5 records" in out


def test_without_the_agreement_a_malformed_message_still_fails(tmp_path, capsys, monkeypatch):
    data = _capture(tmp_path, 17)[0].read_bytes()
    # cut inside the last activation: truncated, whatever the agreement
    stop = WireProtocol(17).write(_stop(17))
    cut = data[:-len(stop) - 10]
    monkeypatch.setattr(sys, "stdin", _Stdin(cut))
    code, out, err = _inspect(capsys, "-")
    assert code == 1 and "UnexpectedEof" in err and out.count(UNDECODED) == 2
    # an activationless kind that declares activation bytes is refused as such, not skipped
    bad = bytearray(stop) + b"\0" * 30
    struct.pack_into("<i", bad, 60, 30)
    monkeypatch.setattr(sys, "stdin", _Stdin(data[:-len(stop)] + bytes(bad)))
    code, _, err = _inspect(capsys, "-", "--messages")
    assert code == 1 and "activationless stage message contains activation payload" in err


def _chain(protocol, capture):
    servers, downstream = [], None
    for index, (start, end) in reversed(list(enumerate(((0, 3), (3, 6))))):
        server = StageServer(FakeBackend(start, end, index), stage_config(index, start, end, "raw-f32-v1", "fixed"),
                             downstream=downstream, io_timeout=5.0, reply_timeout=5.0, protocol=protocol,
                             capture=f"{capture}/hop1" if downstream else None)
        server.start()
        servers.insert(0, server)
        downstream = server.address
    return servers


@pytest.fixture
def chains():
    yield from closing_factory(_chain, lambda servers: [s.shutdown() for s in servers])


@pytest.mark.parametrize("protocol", [16, 17])
def test_captures_of_a_running_chain(chains, tmp_path, capsys, monkeypatch, protocol):
    servers = chains(protocol, tmp_path)
    with PipelineClient(*servers[0].address, timeout=10, protocol=protocol, capture=tmp_path / "hop0") as client:
        client.generate(PROMPT, max_tokens=3, chunk_size=4, sampling=SAMPLING)
    servers[0].shutdown()  # the hop's capture files are complete once its connection closed
    for name in ("hop0-messages.bin", "hop0-replies.bin", "hop1-messages.bin", "hop1-replies.bin"):
        assert main([str(tmp_path / name)]) == 0, name
    out = capsys.readouterr().out
    assert "phase Prefill (1)" in out and "phase Decode (2)" in out and "[SAMPLING]" in out
    assert "sampling: flags 1  seed 42" in out and "PREDICTED_TOKEN (2)" in out and "stats: " in out
    assert "frame v2: producer 0  layers 0..3" in out
    if protocol == 17:
        monkeypatch.setattr(sys, "stdin", _Stdin((tmp_path / "hop1-messages.bin").read_bytes()))
        code, out, err = _inspect(capsys, "-")
        assert (code, err) == (0, "") and UNDECODED in out and "PREFILL_FINAL_EMBD (4)" in out


def test_dissect_names_the_version_of_every_message():
    protocol = WireProtocol(16)
    data = b"".join(protocol.write(m) for m in _messages(16, protocol))
    out = io.StringIO()
    assert dissect(data, out=out) == 5
    assert out.getvalue().count("(state version 16)") == 5


def test_a_flags_word_with_bit_31_is_shown_as_its_32_bits(tmp_path, capsys):
    stop = _stop(16)
    stop.state.flags = -0x80000000 | 0x1
    path = tmp_path / "hop1-messages.bin"
    path.write_bytes(WireProtocol(16).write(stop))
    code, out, _ = _inspect(capsys, path)
    assert code == 0 and "flags 0x80000001 [FINAL_CHUNK|0x80000000]" in out and "0x-" not in out


def test_an_n_embd_beyond_i32_is_a_usage_error(tmp_path, capsys):
    path = tmp_path / "hop1-messages.bin"
    path.write_bytes(WireProtocol(15).write(_stop(15)))
    with pytest.raises(SystemExit) as info:
        main([str(path), "--n-embd", str(2**63)])
    assert info.value.code == 2 and "argument --n-embd: must be between 1 and 2147483647" in capsys.readouterr().err


@pytest.mark.parametrize("body, why", [
    (b'{"pad": "' + b"x" * 70_000 + b'"}', "InvalidData: stage setup message exceeds limit"),
    (b"\xff\xfe not json", "InvalidData: decode stage setup"),
])
def test_a_setup_packet_a_peer_would_refuse_is_malformed(tmp_path, capsys, body, why):
    path = tmp_path / "hop1-replies.bin"
    path.write_bytes(struct.pack("<III", 0x53545053, 12, len(body)) + body)
    code, _, err = _inspect(capsys, path)
    assert code == 1 and f"#0 @0: {why}" in err


def test_a_third_setup_packet_is_malformed(tmp_path, capsys):
    path = tmp_path / "hop1-replies.bin"
    path.write_bytes(encode_packet({"role": "Activation"}) + encode_packet([1]) + encode_packet([2]))
    code, _, err = _inspect(capsys, path)
    assert code == 1 and "#2 @" in err and "a side of a link sends 2" in err


@pytest.mark.parametrize("cut", [8, 17])
def test_a_truncated_setup_packet_says_how_many_bytes_are_left_once(tmp_path, capsys, cut):
    """"setup packet of 716 bytes truncated (17 bytes left) (17 bytes left)": said twice."""
    messages, _ = _capture(tmp_path, 17)
    path = tmp_path / "cut.bin"
    path.write_bytes(messages.read_bytes()[:cut])
    code, _, err = _inspect(capsys, path)
    assert code == 1 and err.count("bytes left") == 1 and err.rstrip().endswith(f"({cut} bytes left)"), err


@pytest.mark.parametrize("prefix", ["replies", "messages"])
def test_a_capture_prefix_holding_messages_or_replies_is_read_by_its_files_ends(tmp_path, capsys, prefix):
    """`serve --capture DIR/replies` writes replies-messages.bin, which was read as replies
    ("unknown stage reply kind"); under DIR/messages the sibling was looked for as
    replies-replies.bin, so the activations were not decoded."""
    messages, replies = _capture(tmp_path, 17)
    renamed = messages.rename(tmp_path / f"{prefix}-messages.bin")
    replies.rename(tmp_path / f"{prefix}-replies.bin")
    code, out, err = _inspect(capsys, renamed)
    assert (code, err) == (0, "")
    assert "message (state version 17)" in out and UNDECODED not in out
    assert "values: [1, 2, 3, 4, 5, 6, 7, 8]" in out


@pytest.mark.parametrize("version, forced, which, why", [
    (16, 17, 1, "READY in a state version 17 stream (a v17 link starts with the setup handshake instead)"),
    (17, 16, 1, "a setup packet in a state version 16 stream (only a v17 link starts with the setup handshake)"),
    (17, 15, 0, "a setup packet in a state version 15 stream (only a v17 link starts with the setup handshake)"),
])
def test_a_forced_protocol_refuses_the_opening_of_another_version(tmp_path, capsys, version, forced, which, why):
    """`--protocol 17` showed a v16 capture's READY as a record, `--protocol 16` a v17 capture's
    setup packets: neither opening exists in the version forced."""
    code, _, err = _inspect(capsys, _capture(tmp_path, version)[which], "--protocol", forced)
    assert code == 1 and f"#0 @0: InvalidData: {why} (" in err, err


def test_a_sibling_replies_file_of_another_link_leaves_the_activations_undecoded(tmp_path, capsys):
    """A hop1-replies.bin left from another run made a valid capture fail ("stale activation
    agreement"): its Offer's generation is not the one this capture's accept packet names."""
    messages, replies = _capture(tmp_path, 17)
    offer = {"role": "Activation", "receiver": None,
             "agreement": dict(_agreement().to_json(), generation=list(range(16, 32)))}
    replies.write_bytes(encode_packet(offer) + encode_packet(list(range(16, 32))))
    code, out, err = _inspect(capsys, messages)
    assert (code, err) == (0, "") and UNDECODED in out


def test_a_sibling_offer_whose_agreement_does_not_parse_leaves_the_activations_undecoded(tmp_path, capsys):
    messages, replies = _capture(tmp_path, 17)
    replies.write_bytes(encode_packet({"role": "Activation", "agreement": {}}))
    code, out, err = _inspect(capsys, messages)
    assert (code, err) == (0, "") and UNDECODED in out


def test_a_v17_activation_shorter_than_its_header_is_malformed_without_an_agreement_too(tmp_path, capsys):
    protocol = WireProtocol(17)
    msgs = _messages(17, protocol)
    carrying = next(m for m in msgs if len(m.activation))
    data = bytearray(protocol.write(carrying, _agreement()))
    count = struct.unpack_from("<i", data, 60)[0]
    struct.pack_into("<i", data, 60, 10)
    path = tmp_path / "messages.bin"  # no sibling: no agreement
    path.write_bytes(bytes(data[:len(data) - count]) + b"\x01" * 10)
    code, _, err = _inspect(capsys, path, "--protocol", "17")
    assert code == 1 and "shorter than its 30-byte header" in err
