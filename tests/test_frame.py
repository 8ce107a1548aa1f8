"""Ports of the upstream binary/mod.rs tests (wire-format.md 14.1) plus byte-literal,
limit and buffer-type checks, on every implementation (``impl`` fixture)."""

from __future__ import annotations

import array
import copy
import io
import pickle
import struct

import numpy as np
import pytest

from skippy_wire.wire import codec, frame, protocol
from skippy_wire.wire.replies import NativeMtpDraft, StageReply, StageReplyWindow
from skippy_wire.tools.vector_cases import sampling_to_case
from skippy_wire.wire.constants import (
    ACTIVATION_FLAG_GEMMA3N_ALTUP,
    ACTIVATION_FLAG_INKLING_MTP_EMBD,
    ACTIVATION_FLAG_RWKV7_V_FIRST,
    ActivationCodec,
    CodecPolicy,
    activation_frame_flags_from_state_flags,
    activation_state_flags_from_frame_flags,
)
from skippy_wire.errors import InvalidDataError, InvalidInputError, UnexpectedEofError
from skippy_wire.wire.constants import (
    STAGE_SAMPLING_CONFIG_BASE_BYTES,
    STAGE_STATE_HEADER_BYTES,
    STAGE_WIRE_FIXED_HEADER_BYTES,
    StateFlags,
)
from skippy_wire.wire.messages import (
    F32,
    SamplingConfig,
    StageStateHeader,
    StageWireMessage,
    WireMessageKind as K,
)

RAW, F16, BF16, S8 = (ActivationCodec(i) for i in range(1, 5))


def f32(*values) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def prefix(kind, token_count, tsc, psc, state: StageStateHeader, count=0) -> bytes:
    """Upstream fixture ``stage_frame_prefix``: pos 0, request 7, session 11."""
    return struct.pack(
        "<5i10iiQQ", int(kind), 0, token_count, tsc, psc, state.version, state.seq_id, state.phase, state.flags,
        state.checkpoint_generation, state.prompt_token_count, state.decode_step, state.current_token,
        state.source_stage_index, int(state.activation_codec), count, 7, 11,
    )


def state_for(kind, **fields) -> StageStateHeader:
    st = StageStateHeader.new(kind)
    for k, v in fields.items():
        setattr(st, k, v)
    return st


def rt(impl, msg, n_embd, codec=None, policy=None):
    data = frame.write_stage_message(msg, impl=impl)
    out, consumed = frame.read_stage_message_from_buffer(data, n_embd, codec, policy, impl=impl)
    assert consumed == len(data)
    return out, data


def err(impl, data, n_embd, codec=None, policy=None):
    with pytest.raises((InvalidDataError, UnexpectedEofError)) as info:
        frame.read_stage_message(data, n_embd, codec, policy, impl=impl)
    return info.value


# --- header -------------------------------------------------------------------------------
def test_state_header_new_defaults_and_bytes(impl):
    msg = StageWireMessage(K.TRIM_SESSION, 0, 0, StageStateHeader.new(K.DECODE_EMBD), 0, 0)
    header = frame.write_stage_message(msg, impl=impl)[20:60]
    assert header.hex() == (
        "0f000000" "00000000" "02000000" "00000000" "00000000" "00000000" "ffffffff" "ffffffff" "ffffffff" "01000000"
    )
    st = StageStateHeader.new(K.PREFILL_FINAL_EMBD)
    assert (st.phase, st.flags) == (1, StateFlags.FINAL_CHUNK)
    assert StageStateHeader.new(K.DECODE_LIGHT_CTX).flags == StateFlags.LIGHT_CONTEXT
    assert StageStateHeader() == StageStateHeader.new(K.PREFILL_EMBD)


def test_ready_round_trips():
    buf = io.BytesIO()
    frame.send_ready(buf)
    assert buf.getvalue() == bytes.fromhex("59445253")
    frame.recv_ready(io.BytesIO(buf.getvalue()))
    with pytest.raises(InvalidDataError, match="^stage ready magic mismatch$"):
        frame.recv_ready(io.BytesIO(b"SRDY"))
    with pytest.raises(UnexpectedEofError):
        frame.recv_ready(io.BytesIO(b"YDR"))


def test_ready_is_read_from_the_first_four_bytes_of_any_buffer():
    ready = frame.READY
    for data in (np.frombuffer(ready + b"\x01\0\0\0", np.uint32), np.frombuffer(ready * 2, np.uint8).reshape(2, 4),
                 array.array("i", [frame.READY_MAGIC, 7]), memoryview(ready + b"tail")):
        frame.recv_ready(data)  # a wider item or a second axis does not change which bytes are read
    with pytest.raises(InvalidDataError, match="^stage ready magic mismatch$"):
        frame.recv_ready(np.frombuffer(b"SRDY" + ready, np.uint32))
    with pytest.raises(InvalidInputError, match="^data must be a C-contiguous buffer$"):
        frame.recv_ready(memoryview(ready * 2)[::2])
    with pytest.raises(TypeError, match="^a bytes-like object is required, not 'str'$"):
        frame.recv_ready("YDRS")


# --- 14.1 ports ---------------------------------------------------------------------------
def test_stage_message_round_trips_f32(impl):
    st = state_for(K.DECODE_EMBD, checkpoint_generation=3, prompt_token_count=1, decode_step=0, current_token=11,
                   source_stage_index=0)
    sampling = SamplingConfig(flags=1, seed=42, temperature=0.8, top_p=0.9, top_k=40, logit_bias=[(123, -50.0)])
    msg = StageWireMessage(K.DECODE_EMBD, 1, 1, st, 7, 11, sampling, None, [11], [], f32(1.0, 2.0))
    out, _ = rt(impl, msg, 2)
    assert out.kind is K.DECODE_EMBD and out.tokens == [11] and bytes(out.activation) == f32(1.0, 2.0)
    assert out.state.source_stage_index == 0 and (out.request_id, out.session_id) == (7, 11)
    assert tuple(out.request_epoch()) == (7, 11, 3, 1, 0)
    assert out.state.flags & StateFlags.SAMPLING and not out.state.flags & StateFlags.CHAT_SAMPLING_METADATA
    assert out.chat_sampling_metadata is None
    assert out.sampling.seed == 42 and out.sampling.top_k == 40
    assert out.sampling.logit_bias == [(123, -50.0)]
    # every other field keeps its default, bit for bit (floats compare as f32 patterns:
    # 0.8 reads back as the f32 nearest to 0.8)
    assert sampling_to_case(out.sampling) == sampling_to_case(sampling)
    assert out.sampling.temperature == np.float32(0.8)


@pytest.mark.parametrize("c,size", [(RAW, 16), (F16, 8), (BF16, 8), (S8, 12)])
def test_stage_message_round_trips_every_activation_codec_with_sideband_rows(impl, c, size):
    flags = StateFlags.RWKV7_V_FIRST_SIDEBAND
    st = state_for(K.DECODE_EMBD, source_stage_index=0, flags=int(flags), activation_codec=c)
    payload = codec.encode_activation(c, 1, 2, f32(1, -1, 0.5, -0.5), flags)
    assert len(payload) == size == codec.activation_wire_bytes(c, 1, 2, flags)
    msg = StageWireMessage(K.DECODE_EMBD, 0, 1, st, 7, 9, None, None, [42], [], payload)
    out, _ = rt(impl, msg, 2, c)
    assert out.state.activation_codec == c and len(out.activation) == 16
    if c is RAW:
        assert bytes(out.activation) == f32(1, -1, 0.5, -0.5)
    assert out.activation_f32().dtype == np.float32 and out.activation_f32().shape == (4,)


def _f16_message() -> bytes:
    st = state_for(K.DECODE_EMBD, source_stage_index=0, activation_codec=F16)
    msg = StageWireMessage(K.DECODE_EMBD, 0, 1, st, 7, 9, None, None, [], [], bytes.fromhex("003c00c0"))
    return frame.write_stage_message(msg)


def test_stage_message_rejects_codec_mismatch_and_malformed_compact_header(impl):
    data = _f16_message()
    assert len(data) == 84 and data[56:60] == struct.pack("<i", 2) and data[60:64] == struct.pack("<i", 4)
    assert str(err(impl, data[:80], 2, RAW)) == "stage activation codec mismatch"
    bad = bytearray(data)
    bad[60:64] = struct.pack("<i", 5)
    assert str(err(impl, bytes(bad), 2)) == "activation payload size mismatch"
    bad = bytearray(data)
    bad[56:60] = struct.pack("<i", 99)
    assert str(err(impl, bytes(bad), 2)) == "unknown stage activation codec"


@pytest.mark.parametrize("codec_arg, policy_arg", [(3.0, None), ("bf16", None), (True, None), (F16, 1.0), (F16, "auto"),
                                                   (F16, True)])
def test_a_reader_s_codec_or_policy_argument_that_is_no_integer_is_a_type_error(impl, codec_arg, policy_arg):
    # as the codec functions say of it: 3.0 was taken as BF16 and "bf16" read as corrupt data (InvalidDataError)
    for read in (lambda data: frame.read_stage_message(data, 2, codec_arg, policy_arg, impl=impl),
                 lambda data: frame.StageMessageDecoder(2, codec_arg, policy_arg).feed(data)):
        with pytest.raises(TypeError, match=f"^{'policy' if policy_arg else 'codec'} must be an int, not "):
            read(_f16_message())
    with pytest.raises(InvalidDataError, match="^unknown stage activation codec$"):
        frame.read_stage_message(_f16_message(), 2, 99, impl=impl)
    with pytest.raises(InvalidDataError, match="^unknown stage activation codec policy$"):
        frame.read_stage_message(_f16_message(), 2, F16, 99, impl=impl)


@pytest.mark.parametrize("c", [RAW, BF16, F16, S8])
def test_stage_message_auto_lossless_policy_admits_only_exact_codec_set(impl, c):
    st = state_for(K.DECODE_EMBD, source_stage_index=0, activation_codec=c)
    msg = StageWireMessage(K.DECODE_EMBD, 0, 1, st, 7, 9, activation=codec.encode_activation(c, 1, 2, f32(1.0, -2.0)))
    data = frame.write_stage_message(msg, impl=impl)
    if c is S8:
        assert str(err(impl, data, 2, RAW, CodecPolicy.AUTO_LOSSLESS_V1)) == "stage activation codec mismatch"
    else:
        out = frame.read_stage_message(data, 2, RAW, CodecPolicy.AUTO_LOSSLESS_V1, impl=impl)
        assert out.state.activation_codec == c and out.activation_f32().tolist() == [1.0, -2.0]


def test_verify_window_message_round_trips_window_metadata(impl):
    st = state_for(K.VERIFY_WINDOW, seq_id=42, prompt_token_count=128, decode_step=7, current_token=1001)
    msg = StageWireMessage(K.VERIFY_WINDOW, 135, 4, st, 1, 2, tokens=[1001, 1002, 1003, 1004])
    out, _ = rt(impl, msg, 2048)
    assert (out.verify_window_id(), out.verify_window_base_position(), out.verify_window_token_count()) == (42, 135, 4)
    assert out.authoritative_session_position() == 135
    assert out.tokens == [1001, 1002, 1003, 1004] and out.state.decode_step == 7


def test_stage_message_rejects_old_state_version(impl):
    data = prefix(K.DECODE_EMBD, 1, 0, 0, state_for(K.DECODE_EMBD, version=14))
    assert str(err(impl, data, 2)) == "unsupported stage state version"


def test_stage_message_rejects_legacy_kind_10(impl):
    assert str(err(impl, struct.pack("<5i", 10, 0, 1, 0, 0), 2)) == "unknown stage message kind"


@pytest.mark.parametrize("version, kind", [(15, 99), (15, 10), (15, 23), (16, 99), (17, 10), (17, -1)])
def test_writers_refuse_a_kind_their_readers_refuse(impl, version, kind):
    # before: the bytes were written, and every reader refused them ("unknown stage message kind")
    msg = StageWireMessage(kind, 0, 0, StageStateHeader(version=version))
    with pytest.raises(InvalidInputError, match=f"kind value {kind} is no state version {version} stage message kind"):
        protocol.write_stage_message(msg, protocol=version, impl=impl)
    with pytest.raises(InvalidInputError, match="kind value 7 is no stage reply kind"):
        frame.write_reply(StageReply(kind=7), impl=impl)


@pytest.mark.parametrize("version", [15, 16, 17])
@pytest.mark.parametrize("codec", [0, 5, 9, -1])
def test_writers_refuse_an_activation_codec_their_readers_refuse(impl, version, codec):
    # before: the bytes were written, and every reader refused them ("unknown stage activation codec")
    state = StageStateHeader(version=version)
    state.activation_codec = codec
    with pytest.raises(InvalidInputError, match=f"state.activation_codec value {codec} is no stage activation codec"):
        protocol.write_stage_message(StageWireMessage(K.STOP, 0, 0, state), protocol=version, impl=impl)


def test_discard_stale_windows_is_written_from_state_version_16(impl):
    msg = StageWireMessage(23, 0, 0, StageStateHeader(version=16))
    data = protocol.write_stage_message(msg, protocol=16, impl=impl)
    assert protocol.read_stage_message(data, protocol=16, impl=impl).kind == 23


def test_stage_message_estimates_full_wire_transfer_bytes(impl):
    st = state_for(K.PREFILL_EMBD, source_stage_index=0)
    msg = StageWireMessage(K.PREFILL_EMBD, 0, 2, st, 1, 2, SamplingConfig(flags=1, logit_bias=[(1, -1.0), (2, 1.0)]),
                           "{}", [1, 2], [0], bytes(16))
    data = frame.write_stage_message(msg, impl=impl)
    assert msg.estimated_wire_bytes() == len(data) == 355


def test_generation_config_round_trips_sampling_metadata(impl):
    meta = '{"grammar":"root ::= \\"x\\""}'
    sampling = SamplingConfig(flags=1, seed=42, temperature=0.8, top_p=0.9, top_k=40)
    out, _ = rt(impl, StageWireMessage.configure_generation(7, 11, 123, sampling, meta), 2048)
    assert out.kind is K.CONFIGURE_GENERATION and out.token_count == 0 and out.tokens == []
    assert bytes(out.activation) == b"" and (out.request_id, out.session_id) == (7, 11)
    assert out.state.prompt_token_count == 123
    assert out.state.flags & (StateFlags.SAMPLING | StateFlags.CHAT_SAMPLING_METADATA) == 0x28
    assert out.chat_sampling_metadata == meta and out.sampling.seed == 42 and out.sampling.top_k == 40


@pytest.mark.parametrize("length,ok", [(8_388_608, True), (8_388_609, False)])
def test_stage_message_metadata_length_limit(impl, length, ok):
    st = state_for(K.CONFIGURE_GENERATION, flags=int(StateFlags.CHAT_SAMPLING_METADATA))
    data = prefix(K.CONFIGURE_GENERATION, 0, 0, 0, st) + struct.pack("<I", length)
    e = err(impl, data, 2048)
    # at the limit the reader waits for the bytes; one over, it refuses before reading them
    assert str(e) == ("failed to fill whole buffer" if ok else "chat sampling metadata length exceeds maximum")
    if ok:
        assert e.needed == 84 + length


def test_driver_origin_message_round_trips_without_activation(impl):
    st = state_for(K.PREFILL_EMBD, prompt_token_count=2, current_token=22)
    out, _ = rt(impl, StageWireMessage(K.PREFILL_EMBD, 0, 2, st, 13, 17, tokens=[11, 22]), 2048)
    assert out.tokens == [11, 22] and bytes(out.activation) == b"" and out.state.source_stage_index == -1
    assert not out.state.flags & StateFlags.SAMPLING and out.sampling is None


class CountingReader(io.RawIOBase):
    def __init__(self, data):
        self.inner = io.BytesIO(data)
        self.reads = 0

    def read(self, n=-1):
        self.reads += 1
        return self.inner.read(n)


def test_stage_message_bulk_reads_sidebands(impl):
    data = (prefix(K.PREFILL_EMBD, 4096, 4096, 4096, StageStateHeader.new(K.PREFILL_EMBD))
            + struct.pack("<4096i", *range(4096)) + struct.pack("<4096i", *range(10000, 14096)))
    reader = CountingReader(data)
    out = frame.read_stage_message(reader, 2048, impl=impl)
    assert out.tokens == list(range(4096)) and out.positions == list(range(10000, 14096))
    assert reader.reads < 128


def test_stage_message_bulk_writes_sidebands(impl):
    class CountingWriter(io.BytesIO):
        writes = 0

        def write(self, b):
            CountingWriter.writes += 1
            return super().write(b)

    msg = StageWireMessage(K.TRIM_SESSION, 0, 0, StageStateHeader.new(K.TRIM_SESSION), 1, 2,
                           tokens=list(range(4096)), positions=list(range(4096)))
    out = CountingWriter()
    frame.write_stage_message_to(out, msg, impl=impl)
    assert CountingWriter.writes < 128 and len(out.getvalue()) == 80 + 8 * 4096


@pytest.mark.parametrize("tsc,psc,text", [
    (1_048_577, 0, "token sideband count exceeds maximum"),
    (0, 1_048_577, "position sideband count exceeds maximum"),
    (-1, 0, "negative wire count"),
])
def test_stage_message_rejects_sideband_counts_over_limit(impl, tsc, psc, text):
    data = prefix(K.PREFILL_EMBD, 0, tsc, psc, StageStateHeader.new(K.PREFILL_EMBD))
    assert str(err(impl, data, 2)) == text


def test_sideband_count_at_limit_is_accepted_and_waits_for_its_bytes(impl):
    data = prefix(K.PREFILL_EMBD, 0, 1_048_576, 0, StageStateHeader.new(K.PREFILL_EMBD))
    e = err(impl, data, 2)
    assert isinstance(e, UnexpectedEofError) and e.needed == 80 + 4 * 1_048_576


def test_prefill_wire_overhead_is_fixed_and_bounded(impl):
    msg = StageWireMessage(K.PREFILL_EMBD, 0, 128, StageStateHeader.new(K.PREFILL_EMBD), 2**64 - 2, 2**64 - 1,
                           tokens=list(range(128)))
    data = frame.write_stage_message(msg, impl=impl)
    assert len(data) == 80 + 512
    assert (STAGE_STATE_HEADER_BYTES, STAGE_SAMPLING_CONFIG_BASE_BYTES, STAGE_WIRE_FIXED_HEADER_BYTES) == (40, 108, 80)
    out, _ = rt(impl, msg, 2048)
    assert (out.request_id, out.session_id) == (2**64 - 2, 2**64 - 1)


def test_verify_retirement_round_trips_exact_identity(impl):
    out, _ = rt(impl, StageWireMessage(K.RETIRE_VERIFY_WINDOW, 128, 8, StageStateHeader.new(K.RETIRE_VERIFY_WINDOW)), 2)
    assert (out.kind, out.pos_start, out.token_count) == (K.RETIRE_VERIFY_WINDOW, 128, 8)
    assert out.state.matches_kind(K.RETIRE_VERIFY_WINDOW)


def test_session_control_messages_are_fixed_header_only(impl):
    msg = StageWireMessage(K.TRIM_SESSION, 0, 0, StageStateHeader.new(K.TRIM_SESSION), 23, 29)
    data = frame.write_stage_message(msg, impl=impl)
    assert data.hex() == (
        "13000000000000000000000000000000000000000f0000000000000001000000000000000000000000000000"
        "ffffffffffffffffffffffff01000000000000001700000000000000" "1d00000000000000"
    )
    out, _ = rt(impl, msg, 2)
    assert (out.request_id, out.session_id, out.tokens, bytes(out.activation)) == (23, 29, [], b"")


def test_state_import_message_round_trips_raw_bytes(impl):
    msg = StageWireMessage(K.STATE_IMPORT, 0, 4, StageStateHeader.new(K.STATE_IMPORT), 1, 2, raw_bytes=bytes([1, 2, 3, 4]))
    out, _ = rt(impl, msg, 2)
    assert bytes(out.raw_bytes) == bytes([1, 2, 3, 4]) and out.tokens == [] and bytes(out.activation) == b""


def test_state_import_limits(impl):
    data = prefix(K.STATE_IMPORT, 536_870_913, 0, 0, StageStateHeader.new(K.STATE_IMPORT))
    assert str(err(impl, data, 2)) == "state import byte count exceeds maximum"
    msg = StageWireMessage(K.STATE_IMPORT, 0, 8, StageStateHeader.new(K.STATE_IMPORT), 1, 2, raw_bytes=bytes(4))
    with pytest.raises(InvalidInputError, match="^state import raw byte count mismatch$") as info:
        frame.write_stage_message(msg, impl=impl)
    assert len(info.value.partial) == 80  # the prefix was emitted before the check


def test_state_export_message_round_trips_without_payload(impl):
    out, _ = rt(impl, StageWireMessage(K.STATE_EXPORT, state=StageStateHeader.new(K.STATE_EXPORT)), 2)
    assert out.kind is K.STATE_EXPORT and out.tokens == [] and bytes(out.activation) == b"" and bytes(out.raw_bytes) == b""


def test_stage_message_rejects_activation_payload_over_limit(impl):
    st = state_for(K.DECODE_EMBD, source_stage_index=0, flags=int(StateFlags.GEMMA3N_ALTUP_SIDEBAND))
    assert str(err(impl, prefix(K.DECODE_EMBD, 262_145, 0, 0, st), 1024)) == "activation payload byte count exceeds maximum"
    # exactly 512 MiB is admitted (then the count must match: 0 != 512 MiB)
    assert str(err(impl, prefix(K.DECODE_EMBD, 262_144, 0, 0, st), 512)) == "activation payload size mismatch"


@pytest.mark.parametrize("flag,frame_flag,kind", [
    (StateFlags.RWKV7_V_FIRST_SIDEBAND, ACTIVATION_FLAG_RWKV7_V_FIRST, K.DECODE_EMBD),
    (StateFlags.INKLING_MTP_EMBD_SIDEBAND, ACTIVATION_FLAG_INKLING_MTP_EMBD, K.PREFILL_EMBD),
])
def test_doubling_sideband_activation_round_trips(impl, flag, frame_flag, kind):
    payload = codec.encode_f32_activation_payload(1, 2, f32(1, 2, 3, 4), flag)
    st = state_for(kind, source_stage_index=0, flags=int(flag))
    out, _ = rt(impl, StageWireMessage(kind, 0, 1, st, 1, 2, tokens=[42], activation=payload), 2)
    assert len(out.activation) == 16 and out.activation_f32_payload() == f32(1, 2, 3, 4)
    assert activation_frame_flags_from_state_flags(out.state.flags) == frame_flag
    assert activation_state_flags_from_frame_flags(frame_flag) == flag


def test_gemma3n_altup_sideband_activation_round_trips(impl):
    flag = StateFlags.GEMMA3N_ALTUP_SIDEBAND
    st = state_for(K.DECODE_EMBD, source_stage_index=0, flags=int(flag))
    payload = f32(*range(8))
    out, _ = rt(impl, StageWireMessage(K.DECODE_EMBD, 0, 1, st, 1, 2, activation=payload), 8)
    assert len(out.activation) == 32 and bytes(out.activation) == payload
    assert activation_frame_flags_from_state_flags(out.state.flags) == ACTIVATION_FLAG_GEMMA3N_ALTUP


def test_f32_activation_payload_can_be_taken_or_copied():
    payload = codec.encode_f32_activation_payload(1, 2, f32(1, -1))
    msg = StageWireMessage(K.DECODE_EMBD, activation=payload)
    assert msg.activation_f32_payload() == f32(1, -1) and bytes(msg.activation) == f32(1, -1)
    assert msg.take_activation_f32_payload() == f32(1, -1) and msg.activation == b""


# --- decoded payload representation and buffer types --------------------------------------
def test_decoded_activation_is_a_read_only_byte_view(impl):
    st = state_for(K.DECODE_EMBD, source_stage_index=0, activation_codec=BF16)
    msg = StageWireMessage(K.DECODE_EMBD, 0, 1, st, activation=codec.encode_activation(BF16, 1, 4, f32(1, 2, 3, 4)))
    out, _ = rt(impl, msg, 4, BF16)
    view = out.activation
    assert isinstance(view, memoryview) and view.readonly and view.format == "B" and view.nbytes == 16
    with pytest.raises(TypeError):
        view[0] = 1
    assert out.activation_f32().tolist() == [1, 2, 3, 4]
    assert out == StageWireMessage(K.DECODE_EMBD, 0, 1, st, activation=f32(1, 2, 3, 4))


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview, lambda b: np.frombuffer(b, np.float32),
                                  lambda b: array.array("f", np.frombuffer(b, np.float32).tolist())])
def test_writer_and_reader_accept_any_contiguous_buffer(impl, wrap):
    payload = f32(1.5, -2.25)
    st = state_for(K.DECODE_EMBD, source_stage_index=0)
    msg = StageWireMessage(K.DECODE_EMBD, 0, 1, st, tokens=array.array("i", [5]), activation=wrap(payload))
    data = frame.write_stage_message(msg, impl=impl)
    out, consumed = frame.read_stage_message_from_buffer(wrap(data) if not callable(getattr(wrap, "tolist", None)) else data, 2, impl=impl)
    assert bytes(out.activation) == payload and out.tokens == [5] and consumed == len(data)


def test_non_contiguous_activation_is_invalid_input(impl):
    st = state_for(K.DECODE_EMBD, source_stage_index=0)
    strided = np.arange(8, dtype=np.float32)[::2]
    with pytest.raises(InvalidInputError, match="C-contiguous"):
        frame.write_stage_message(StageWireMessage(K.DECODE_EMBD, 0, 1, st, activation=strided), impl=impl)


@pytest.mark.parametrize("field,value", [("pos_start", 2**31), ("request_id", -1), ("tokens", [2**31])])
def test_values_outside_their_wire_type_are_invalid_input(impl, field, value):
    msg = StageWireMessage(K.PREFILL_EMBD, state=StageStateHeader.new(K.PREFILL_EMBD))
    setattr(msg, field, value)
    with pytest.raises(InvalidInputError, match=field):
        frame.write_stage_message(msg, impl=impl)


# --- writer checks and partial output -----------------------------------------------------
def test_writer_rejects_activation_on_activationless_messages(impl):
    msg = StageWireMessage(K.PROBE_PREFILL, state=state_for(K.PROBE_PREFILL, source_stage_index=0), activation=b"x")
    with pytest.raises(InvalidInputError, match="^activationless stage message contains activation payload$") as info:
        frame.write_stage_message(msg, impl=impl)
    assert len(info.value.partial) == 20


def test_stop_with_activation_is_written_but_rejected_by_the_reader(impl):
    msg = StageWireMessage(K.STOP, state=state_for(K.STOP, source_stage_index=0), activation=b"abcd")
    data = frame.write_stage_message(msg, impl=impl)
    assert len(data) == 84 and data[60:64] == struct.pack("<i", 4)
    assert str(err(impl, data, 2)) == "activationless stage message contains activation payload"


def test_stop_consumes_only_its_header(impl):
    data = frame.write_stage_message(StageWireMessage.stop(5, 6), impl=impl) + b"trailing"
    out, consumed = frame.read_stage_message_from_buffer(data, 2, impl=impl)
    assert consumed == 80 and out.kind is K.STOP and (out.request_id, out.session_id) == (5, 6)


def test_a_nan_read_off_the_wire_is_its_own_value_in_every_message_read(impl):
    """The compiled reader shares the values of a sampling block it has read before: a NaN's
    F32 was mutable (changing one message's changed every later read of the same bytes), and
    a message holding a NaN was unequal to its own copy."""
    s = SamplingConfig(temperature=F32(0x7FC00001), logit_bias=[(3, F32(0xFFC01234))])
    data = frame.write_stage_message(StageWireMessage.configure_generation(1, 2, 0, s), impl=impl)
    first = frame.read_stage_message_from_buffer(data, 2, impl=impl)[0]
    with pytest.raises(AttributeError, match="immutable"):
        first.sampling.temperature.bits = 0x7FC0DEAD
    again = frame.read_stage_message_from_buffer(data, 2, impl=impl)[0]
    assert again.sampling.temperature.bits == 0x7FC00001
    assert first == again == pickle.loads(pickle.dumps(first)) == copy.deepcopy(first)
    assert frame.write_stage_message(again, impl=impl) == data
    assert F32(0x7FC00001) != F32(0x7FC00002) and len({F32(0x7FC00001), F32(0x7FC00001)}) == 1
    assert F32(0) == F32(0x80000000) == 0.0 and F32(0x7FC00001) != F32(0x3F800000)  # floats but NaNs: as floats
    assert F32(0x3F800000) == 1.0 and hash(F32(0x3F800000)) == hash(1.0)


def test_a_message_repr_stays_short_whatever_it_carries(impl):
    """A 16 MiB StateImport read off the wire had a repr of 67 million characters (512 MiB:
    2 GB), an activation's or a reply's long token list megabytes."""
    big = StageWireMessage(K.STATE_IMPORT, 0, 1 << 24, StageStateHeader.new(K.STATE_IMPORT), raw_bytes=bytes(1 << 24))
    read = frame.read_stage_message_from_buffer(frame.write_stage_message(big, impl=impl), 576, impl=impl)[0]
    assert "raw_bytes=<16777216 bytes>" in repr(read) and len(repr(read)) < 1000 and len(repr(big)) < 1000
    reply = StageReply(predicted_tokens=list(range(1 << 20)))
    assert "predicted_tokens=[0, 1, 2, 3, 4, 5, ...]" in repr(reply) and len(repr(reply)) < 2000
    # token ids in an array are ids, not a payload; a released buffer is shown, not raised
    released = memoryview(b"abcd")
    released.release()
    ids = StageWireMessage(K.DECODE_EMBD, tokens=np.arange(1 << 20, dtype=np.int32), activation=released)
    assert "tokens=array([0, 1, 2, 3, 4, 5, ...], dtype=int32, shape=(1048576,))" in repr(ids)
    assert "activation=<released memory" in repr(ids)
    # nested: a reply's draft, a message's sampling block; an int past Python's printable digits
    reply = StageReply(native_mtp_draft=NativeMtpDraft(list(range(1 << 18))), window=StageReplyWindow(10**5000))
    assert "token_ids=[0, 1, 2, 3, 4, 5, ...]" in repr(reply) and len(repr(reply)) < 2000
    biases = SamplingConfig(logit_bias=[(i, 0.5) for i in range(10**5)])
    sampling = StageWireMessage.configure_generation(1, 2, 0, biases)
    assert len(repr(sampling)) < 4000
    huge = StageWireMessage(K.PREFILL_EMBD, request_id=10**5000, state=StageStateHeader(seq_id=10**5000))
    assert "request_id=<an int of 16610 bits>" in repr(huge) and "seq_id=<an int of 16610 bits>" in repr(huge)


def test_sampling_writer_truncates_lists_and_rejects_long_strings(impl):
    s = SamplingConfig(logit_bias=[(i, 0.5) for i in range(300)], dry_sequence_breakers=["a"] * 9,
                       samplers=["b"] * 17)
    out, data = rt(impl, StageWireMessage.configure_generation(1, 2, 0, s), 2)
    assert len(out.sampling.logit_bias) == 256 and len(out.sampling.dry_sequence_breakers) == 8
    assert len(out.sampling.samplers) == 16
    assert len(data) == StageWireMessage.configure_generation(1, 2, 0, s).estimated_wire_bytes()
    s = SamplingConfig(samplers=["x" * 64])
    rt(impl, StageWireMessage.configure_generation(1, 2, 0, s), 2)  # 64 bytes is the limit, accepted
    s = SamplingConfig(samplers=["é" * 33])  # 66 UTF-8 bytes
    with pytest.raises(InvalidDataError, match="^sampling string exceeds maximum length$"):
        frame.write_stage_message(StageWireMessage.configure_generation(1, 2, 0, s), impl=impl)


def test_sampling_nan_fields_round_trip_bit_exactly(impl):
    from skippy_wire.wire.messages import F32, f32_bits

    s = SamplingConfig(temperature=F32(0x7F800001), top_p=F32(0xFFC01234), logit_bias=[(1, F32(0x7FA00000))])
    out, _ = rt(impl, StageWireMessage.configure_generation(1, 2, 0, s), 2)
    assert f32_bits(out.sampling.temperature) == 0x7F800001
    assert f32_bits(out.sampling.top_p) == 0xFFC01234
    assert f32_bits(out.sampling.logit_bias[0][1]) == 0x7FA00000


def test_reader_reports_needed_bytes_for_a_short_buffer(impl):
    data = _f16_message()
    for cut in (0, 3, 20, 79, 80, 83):
        e = err(impl, data[:cut], 2)
        assert isinstance(e, UnexpectedEofError) and str(e) == "failed to fill whole buffer"
        assert cut < e.needed <= len(data)


def test_repeated_sampling_blocks_decode_to_independent_objects(impl):
    """Readers may reuse the decode of a repeated sampling block; results stay independent
    and a block that differs in any byte is decoded afresh."""
    s = SamplingConfig(seed=1, logit_bias=[(5, 0.5)], samplers=["top_k", "temperature"])
    data = frame.write_stage_message(StageWireMessage.configure_generation(1, 2, 0, s), impl=impl)
    a = frame.read_stage_message(data, 2, impl=impl)
    b = frame.read_stage_message(data, 2, impl=impl)
    assert a.sampling == b.sampling and a.sampling is not b.sampling
    a.sampling.samplers.append("x")
    a.sampling.logit_bias.clear()
    a.sampling.dry_sequence_breakers.clear()
    c = frame.read_stage_message(data, 2, impl=impl)
    assert c.sampling.samplers == ["top_k", "temperature"] and c.sampling.logit_bias == [(5, 0.5)]
    assert c.sampling.dry_sequence_breakers == ["\n", ":", '"', "*"]
    for changed in (SamplingConfig(seed=1, logit_bias=[(5, 0.5)], samplers=["top_k", "temperaturf"]),
                    SamplingConfig(seed=1, logit_bias=[(5, 0.5)], samplers=["top_k"])):
        other = frame.write_stage_message(StageWireMessage.configure_generation(1, 2, 0, changed), impl=impl)
        assert frame.read_stage_message(other, 2, impl=impl).sampling.samplers == changed.samplers
    # a truncated copy of a cached block is still a short read
    with pytest.raises(UnexpectedEofError):
        frame.read_stage_message(data[:-1], 2, impl=impl)


def _peak_bytes(fn) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    del result
    return peak


@pytest.mark.parametrize("source", ["bytes", "bytearray", "stream"])
def test_a_read_copies_the_payload_at_most_once(source):
    """Compiled path (a performance property; the twin's codec decodes through Python
    lists): reading a 4 MiB raw activation allocates one payload-sized block (the decoded
    array) from a buffer; a stream read additionally gathers the message bytes once."""
    impl = "cython"
    n = 1 << 20
    st = state_for(K.DECODE_EMBD, source_stage_index=0)
    data = frame.write_stage_message(StageWireMessage(K.DECODE_EMBD, 0, 1, st, activation=bytes(4 * n)), impl=impl)
    if source == "stream":
        peak = _peak_bytes(lambda: frame.read_stage_message(io.BytesIO(data), n, impl=impl))
        assert peak < 2.5 * 4 * n, peak
    else:
        buf = data if source == "bytes" else bytearray(data)
        peak = _peak_bytes(lambda: frame.read_stage_message(buf, n, impl=impl))
        assert 4 * n <= peak < 1.25 * 4 * n, peak


def test_compiled_framing_is_live():
    """On CPython the compiled kernels are the default (no silent fallback to the twin)."""
    import platform

    from skippy_wire._impl import IMPLEMENTATION

    compiled = frame.kernels("cython")
    assert compiled.__name__ == "skippy_wire.wire._frame" and not compiled.__file__.endswith(".py")
    if platform.python_implementation() == "CPython" and IMPLEMENTATION == "cython":
        assert frame.kernels() is compiled
