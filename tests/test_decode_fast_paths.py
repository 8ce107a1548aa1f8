"""The per-token byte paths of a decode step (wire/frame.py): the terminal stage's
PredictedToken reply and the driver's DecodeEmbd are patched templates, so they must be
byte for byte what the general writers produce; and replies read by the compiled reader
are whole, independent objects although no dataclass __init__ runs for them."""

from __future__ import annotations

import io
import random
import re
import socket
import struct
from pathlib import Path

import pytest

from skippy_wire.errors import ActivationFrameError, InvalidInputError, WireError
from skippy_wire.net.schedule import decode_message
from skippy_wire.net.protocol_io import LinkProtocol, rows_boundary
from skippy_wire.net.transport import Peer
from skippy_wire.stage.activation import ActivationDesc, ActivationFrame
from skippy_wire.stage.bridge import frame_from_wire, packed_frame_from_wire
from skippy_wire.stage.native import raw_input
from skippy_wire.wire import codec, frame
from skippy_wire.wire.constants import I32_MAX, I32_MIN, ActivationCodec, CodecPolicy, StateFlags
from skippy_wire.wire.forwarding import ActivationFrameV1, StageConfig, forwarded_decode_bytes, forwarded_stage_message
from skippy_wire.wire.messages import SamplingConfig, StageStateHeader, StageWireMessage, WireMessageKind
from skippy_wire.wire.replies import (STATS_FIELDS, NativeMtpDraft, StageReply, StageReplyStats, StageReplyWindow,
                                      WireReplyKind)
from vector_helpers import load_cases

TOKENS = [0, 1, -1, 42, 49151, I32_MAX, I32_MIN]


@pytest.mark.parametrize("token", TOKENS)
def test_predicted_reply_bytes_equal_the_writer(token):
    buf = io.BytesIO()
    frame.send_reply_predicted(buf, token)
    assert frame.predicted_reply_bytes(token) == buf.getvalue()


@pytest.mark.parametrize("token", [I32_MAX + 1, I32_MIN - 1, True])  # a bool packed as 1 before
def test_predicted_reply_bytes_refuse_what_the_writer_refuses(token):
    with pytest.raises(InvalidInputError):
        frame.predicted_reply_bytes(token)


@pytest.fixture
def peer():
    a, b = socket.socketpair()
    yield Peer(a)
    a.close()
    b.close()


@pytest.mark.parametrize("version", [15, 16, 17])
def test_decode_step_writer_equals_encoding_every_message(peer, version):
    link = LinkProtocol(version, peer, who="test")
    rng = random.Random(version)
    prompt_len, request_id, session_id = 37, 2**40 + 3, 7
    steps = frame.DecodeStepWriter(link.encode(decode_message(5, prompt_len, 0, prompt_len, request_id, session_id)))
    for step in range(200):
        token = rng.choice(TOKENS + [rng.randrange(I32_MIN, I32_MAX)])
        pos = prompt_len + step if step < 150 else rng.randrange(0, I32_MAX)
        expected = link.encode(decode_message(token, pos, step, prompt_len, request_id, session_id))
        assert steps.message(token, pos, step) == expected


@pytest.mark.parametrize("token, pos, step, text", [
    (1, I32_MAX + 1, 0, f"pos_start value {I32_MAX + 1} does not fit its wire type"),
    (1, 0, 1.5, "state.decode_step value 1.5 does not fit its wire type"),
    ("x", 0, 0, "tokens value 'x' does not fit its wire type"),
])
def test_decode_step_writer_names_a_value_the_wire_cannot_carry(peer, token, pos, step, text):
    # a raw struct.error before
    link = LinkProtocol(15, peer, who="test")
    steps = frame.DecodeStepWriter(link.encode(decode_message(5, 10, 0, 10, 1, 1)))
    with pytest.raises(InvalidInputError) as err:
        steps.message(token, pos, step)
    assert str(err.value) == text


def test_decode_step_writer_refuses_other_messages(peer):
    link = LinkProtocol(15, peer, who="test")
    with_sampling = decode_message(5, 10, 0, 10, 1, 1, sampling=SamplingConfig(temperature=0.5))
    two_tokens = decode_message(5, 10, 0, 10, 1, 1)
    two_tokens.tokens = [5, 6]
    two_tokens.token_count = 2
    for msg in (with_sampling, two_tokens):
        with pytest.raises(ValueError, match="one token and nothing else"):
            frame.DecodeStepWriter(link.encode(msg))


def test_read_replies_are_whole_and_independent(impl):
    stats = StageReplyStats(*range(1, len(STATS_FIELDS) + 1))
    written = frame.write_reply(StageReply(WireReplyKind.PREDICTED_TOKENS, 9, [9, 10], StageReplyWindow(4), None, stats))
    first, used = frame.read_reply_from_buffer(written, impl=impl)
    second, _ = frame.read_reply_from_buffer(written, impl=impl)
    assert used == len(written)
    assert type(first) is StageReply and type(first.stats) is StageReplyStats
    assert type(first.window) is StageReplyWindow and first.window.window_id == 4
    assert first.stats.as_tuple() == stats.as_tuple() and first == second
    first.stats.merge(StageReplyStats(kv_lookup_hits=100))  # a relay merges the Acks it owes
    first.predicted_tokens.append(11)
    assert second.stats.kv_lookup_hits == 1 and second.predicted_tokens == [9, 10]
    assert first.stats.kv_lookup_hits == 101
    assert frame.write_reply(second) == written


# --- a forwarding stage: the forwarded DecodeEmbd from the incoming bytes, replies relayed as bytes ---

CODECS = list(ActivationCodec)


def _general_forward(config, raw, payload, n_embd, impl):
    """The forwarded bytes by the general path: read, forward (section 9), write; or the error."""
    incoming = frame.read_stage_message_from_buffer(raw, n_embd, impl=impl)[0]
    out = ActivationFrameV1.f32(list(struct.unpack(f"<{len(payload) // 4}f", payload)), incoming.token_count)
    try:
        return frame.write_stage_message(forwarded_stage_message(config, incoming, out, n_embd, impl=impl), impl=impl)
    except WireError as error:
        return error


def _random_decode(rng, n_embd):
    """A DecodeEmbd as some upstream could send it: sidebands, flags, codec and activation vary."""
    state = StageStateHeader.new(WireMessageKind.DECODE_EMBD)
    state.flags = rng.choice([0, 0, int(StateFlags.FINAL_CHUNK), int(StateFlags.FULL_STATE), 0x4000])
    state.decode_step, state.current_token = rng.randrange(I32_MIN, I32_MAX), rng.randrange(I32_MIN, I32_MAX)
    state.checkpoint_generation, state.seq_id = rng.randrange(0, 9), rng.randrange(-3, 9)
    tokens = [rng.randrange(I32_MIN, I32_MAX) for _ in range(rng.choice([0, 1, 1, 2]))]
    positions = [rng.randrange(0, 1 << 20) for _ in range(rng.choice([0, 0, 1, 3]))]
    token_count = rng.choice([1, 1, 2])
    activation = b""
    if rng.random() < 0.6:  # from an earlier stage: an encoded activation in some codec
        state.source_stage_index = rng.randrange(0, 4)
        state.activation_codec = rng.choice(CODECS)
        values = [rng.uniform(-4, 4) for _ in range(token_count * n_embd)]
        activation = codec.encode_activation(state.activation_codec, token_count, n_embd,
                                             struct.pack(f"<{len(values)}f", *values))
    msg = StageWireMessage(WireMessageKind.DECODE_EMBD, rng.randrange(0, I32_MAX), token_count, state,
                           rng.randrange(0, 1 << 64), rng.randrange(0, 1 << 64), tokens=tokens, positions=positions,
                           activation=activation)
    return frame.write_stage_message(msg)


def test_forwarded_decode_bytes_equal_the_general_path(impl):
    rng, n_embd, taken = random.Random(15), 8, 0
    for _ in range(300):
        raw = _random_decode(rng, n_embd)
        token_count = struct.unpack_from("<i", raw, 8)[0]
        rows = token_count * n_embd
        payload = struct.pack(f"<{rows}f", *(rng.uniform(-70000, 70000) for _ in range(rows)))
        config = StageConfig(stage_index=rng.choice([0, 1, 2, 2**31 - 1, 2**31 + 5]), layer_start=rng.choice([0, 4]),
                             layer_end=8, activation_codec=rng.choice(CODECS))
        fast = forwarded_decode_bytes(config, raw, payload, token_count, n_embd, impl=impl)
        expected = _general_forward(config, raw, payload, n_embd, impl)
        if fast is None:
            continue
        taken += 1
        assert fast.data == expected
        assert fast.codec == config.activation_codec
        assert fast.activation_bytes == struct.unpack_from("<i", fast.data, 60)[0]
    assert taken > 150  # the path is taken for ordinary decode steps, not only skipped


def test_forwarded_decode_bytes_match_the_golden_decode_messages(impl):
    """Every golden DecodeEmbd upstream wrote without a sampling block or chat metadata."""
    taken = 0
    for case in load_cases(Path(__file__).parent / "golden" / "v15", "frame"):
        if not case["write"]["ok"] or case["message"]["kind"] != int(WireMessageKind.DECODE_EMBD):
            continue
        raw, n_embd = bytes.fromhex(case["write"]["hex"]), case["n_embd"]
        try:
            token_count = frame.read_stage_message_from_buffer(raw, n_embd, impl=impl)[0].token_count
        except WireError:
            continue
        payload = struct.pack(f"<{token_count * n_embd}f", *(0.25 * i - 3 for i in range(token_count * n_embd)))
        for config in (StageConfig(stage_index=1, layer_start=4, layer_end=8, activation_codec=c) for c in CODECS):
            fast = forwarded_decode_bytes(config, raw, payload, token_count, n_embd, impl=impl)
            if fast is not None:
                taken += 1
                assert fast.data == _general_forward(config, raw, payload, n_embd, impl), case["id"]
    assert taken >= 4


def test_forwarded_decode_bytes_leave_the_rest_to_the_general_path():
    n_embd, payload = 4, struct.pack("<4f", 1, 2, 3, 4)
    config = StageConfig(stage_index=1, layer_start=4, layer_end=8, activation_codec=ActivationCodec.F16_RNE_V1)
    plain = frame.write_stage_message(decode_message(5, 10, 0, 10, 1, 1))
    assert forwarded_decode_bytes(config, plain, payload, 1, n_embd) is not None
    with_sampling = frame.write_stage_message(
        decode_message(5, 10, 0, 10, 1, 1, sampling=SamplingConfig(temperature=0.5)))
    with_metadata = decode_message(5, 10, 0, 10, 1, 1)
    with_metadata.chat_sampling_metadata = "{}"
    prefill = decode_message(5, 10, 0, 10, 1, 1)
    prefill.kind = WireMessageKind.PREFILL_EMBD
    for raw in (with_sampling, frame.write_stage_message(with_metadata), frame.write_stage_message(prefill), plain[:60]):
        assert forwarded_decode_bytes(config, raw, payload, 1, n_embd) is None
    auto = StageConfig(stage_index=1, activation_codec_policy=CodecPolicy.AUTO_LOSSLESS_V1)
    assert forwarded_decode_bytes(auto, plain, payload, 1, n_embd) is None
    assert forwarded_decode_bytes(config, plain, payload, 2, n_embd) is None  # short frame: the range check's
    assert forwarded_decode_bytes(config, plain, payload[:8], 1, n_embd) is None  # wrong width: the encoder's
    s8 = StageConfig(stage_index=1, activation_codec=ActivationCodec.S8_ROW_F32_RNE_V1)
    assert forwarded_decode_bytes(s8, plain, struct.pack("<4f", 1, float("nan"), 3, 4), 1, n_embd) is None


@pytest.mark.parametrize("version", [15, 16])
def test_link_forward_gives_the_encoded_forwarded_message(peer, version):
    """The link's bytes are its encoding of the general path's message, in version 15 by
    the byte path (v16 takes the general path: the frame travels as it is)."""
    link, n_embd = LinkProtocol(version, peer, who="test"), 8
    config = StageConfig(stage_index=0, layer_start=0, layer_end=4, activation_codec=ActivationCodec.F16_RNE_V1)
    incoming = decode_message(5, 10, 3, 10, 1, 1)
    raw = link.encode(incoming)
    values = [0.5 * i - 2 for i in range(n_embd)]
    output = ActivationFrame(ActivationDesc.f32_rows(n_embd, 1, layer_end=4), struct.pack(f"<{n_embd}f", *values))
    forwarded = link.forward(config, incoming, output, n_embd, raw)
    expected = link.forwarded(config, incoming, output, n_embd).message
    assert forwarded.data == link.encode(expected)
    assert forwarded.codec == ActivationCodec.F16_RNE_V1 and forwarded.activation_bytes == len(expected.activation)
    assert link.forward(config, incoming, output, n_embd).data == forwarded.data  # without the bytes: the same


def _random_reply(rng):
    tokens = [rng.randrange(I32_MIN, I32_MAX) for _ in range(rng.choice([0, 1, 1, 3]))]
    draft = None
    if rng.random() < 0.3:
        draft = NativeMtpDraft([rng.randrange(I32_MIN, I32_MAX) for _ in range(rng.randrange(0, 4))],
                                    rng.randrange(-(1 << 63), 1 << 63))
    stats = StageReplyStats(*(rng.choice([0, 0, rng.randrange(-(1 << 63), 1 << 63)]) for _ in STATS_FIELDS))
    return StageReply(rng.choice(list(WireReplyKind)), rng.randrange(I32_MIN, I32_MAX), tokens,
                      StageReplyWindow(rng.randrange(I32_MIN, I32_MAX)), draft, stats)


def test_a_read_reply_writes_back_to_its_own_bytes(impl):
    """Why a stage may relay a downstream reply as the bytes it received: the encoding is
    canonical, so what the reader accepts the writer reproduces exactly."""
    rng = random.Random(11)
    for _ in range(300):
        written = frame.write_reply(_random_reply(rng))
        reply, used = frame.read_reply_from_buffer(written, impl=impl)
        assert used == len(written) and frame.write_reply(reply) == written


def test_the_reader_keeps_the_bytes_of_a_record_that_arrived_in_one_receive():
    a, b = socket.socketpair()
    try:
        peer = Peer(a)
        one, two = frame.predicted_reply_bytes(7), frame.write_reply(StageReply(WireReplyKind.ACK, 0, []))
        b.sendall(one + two)
        assert peer.read().predicted == 7 and peer.reader.last_raw == one
        assert peer.read().kind == WireReplyKind.ACK and peer.reader.last_raw == two
        b.sendall(one[:100])  # split over two receives: no bytes kept
        assert peer.reader.wait_readable(1.0)
        b.sendall(one[100:])
        assert peer.read().predicted == 7 and peer.reader.last_raw is None
    finally:
        a.close()
        b.close()


# --- a decode step's input on a later stage: the descriptor packed once per shape ---

@pytest.mark.parametrize("token_count", [0, 1, 3])
@pytest.mark.parametrize("with_boundary", [False, True])
def test_packed_wire_input_equals_the_frame_packed(token_count, with_boundary):
    n_embd = 8
    boundary = rows_boundary(n_embd) if with_boundary else None
    if with_boundary:
        boundary.parts[0].identity = bytes(range(32))
        boundary.frontier_identity = bytes(range(32, 64))
    payload = struct.pack(f"<{n_embd * token_count}f", *range(n_embd * token_count))
    args = (payload, token_count, n_embd, 1, 0, 15)
    for _ in range(2):  # the second from the cache
        packed = packed_frame_from_wire(*args, boundary=boundary)
        assert raw_input(packed) == raw_input(frame_from_wire(*args, boundary=boundary))
        assert not packed.has_optional_parts()


def test_packed_wire_input_refuses_what_the_frame_refuses():
    for args in ((bytes(28), 1, 8, 1, 0, 15), (bytes(32), 1, 8, 1, 0, 15, 1)):
        with pytest.raises(ActivationFrameError) as want:
            frame_from_wire(*args)
        with pytest.raises(ActivationFrameError, match=re.escape(str(want.value))):
            packed_frame_from_wire(*args)


@pytest.mark.parametrize("origin, text", [
    ((2**40, 0, 15), "activation producer_stage_index 1099511627776 exceeds 2147483647"),
    ((1, -2**31 - 1, 15), "activation layer_start -2147483649 is below -2147483648"),
    ((1, 0, 1.5), "activation layer_end must be an integer, not float"),
    ((True, 0, 15), "activation producer_stage_index must be an integer, not bool"),  # was stage 1
])
def test_a_wire_frame_s_origin_beyond_i32_is_refused_by_name_when_built(origin, text):
    # frame_from_wire built it, and its first use failed in struct's words
    for build in (frame_from_wire, packed_frame_from_wire):
        with pytest.raises(ActivationFrameError, match=f"^{re.escape(text)}$"):
            build(bytes(32), 1, 8, *origin)


def test_a_packed_frame_s_float_origin_is_refused_after_the_equal_int_s():
    # the packed descriptor is cached per shape, and 15.0 == 15 found the int's descriptor
    packed_frame_from_wire(bytes(32), 1, 8, 1, 0, 15)
    for origin in ((1, 0, 15.0), (1.0, 0, 15)):
        with pytest.raises(ActivationFrameError) as want:
            frame_from_wire(bytes(32), 1, 8, *origin)
        with pytest.raises(ActivationFrameError, match=f"^{re.escape(str(want.value))}$"):
            packed_frame_from_wire(bytes(32), 1, 8, *origin)
