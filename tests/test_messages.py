"""Message model and helpers (wire-format.md 2, 3, 12): enums, header defaults,
matches_kind, epochs, constructors, size estimates, exact f32 values."""

from __future__ import annotations

import math
import struct

import pytest

from skippy_wire.wire import messages as m
from skippy_wire.wire import constants as c
from skippy_wire.wire.constants import ActivationCodec, StateFlags
from skippy_wire.errors import InvalidDataError
from skippy_wire.wire.messages import (
    F32,
    SamplingConfig,
    StageStateHeader,
    StageWireMessage,
    WireMessageKind as K,
    WireStagePhase as P,
    f32_bits,
    f32_from_bits,
)


def test_kind_values_and_names():
    assert [k.value for k in K] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    assert K.DECODE_EMBD.rust_name == "DecodeEmbd" and K.DECODE_LIGHT_CTX.rust_name == "DecodeLightCtx"
    assert K.TRY_RESTORE_PREFILL_DECODE.rust_name == "TryRestorePrefillDecode"
    for missing in (0, 10, 11, 12, 23):
        with pytest.raises(ValueError):
            K(missing)


def test_expected_phases_and_predicates():
    prefill = {1, 4, 7, 13, 14, 15, 16, 17, 18, 19, 22}
    for kind in K:
        want = P.DECODE_REPLAY if kind in (5, 6) else P.DECODE_LIGHT if kind == 9 else P.PREFILL if kind in prefill else P.DECODE
        assert kind.expected_phase is want, kind
    assert {k for k in K if k.requires_predicted_reply} == {2, 4, 6, 8, 9, 21}
    assert {k for k in K if k.is_prefix_cache_control} == {15, 16, 17, 18}
    assert {k for k in K if k.is_activationless_prefix_cache_control} == {15, 16, 17}
    # section 2.1 classification predicates
    assert {k for k in K if k.is_prefill} == {1, 4} and {k for k in K if k.is_decode_replay} == {5, 6}
    assert {k for k in K if k.is_decode_light_context} == {9}
    assert [{k for k in K if getattr(k, name)} for name in ("is_session_control", "is_verify_retirement",
                                                             "is_generation_control")] == [{19}, {22}, {14}]


def test_v16_and_v17_headers_know_kind_23_and_carry_their_version():
    # wire-v16-v17.md A.1/A.2: v15's defaults but the version; DiscardStaleWindows is a
    # Decode-phase kind that matches any header of those versions.  v15 knows no kind 23.
    for version in (16, 17):
        header = StageStateHeader.new(23, version)
        assert (header.version, header.phase, header.flags) == (version, P.DECODE, 0)
        assert StageStateHeader.new(K.PREFILL_FINAL_EMBD, version).matches_kind(23)
        final = StageStateHeader.new(K.PREFILL_FINAL_EMBD, version)
        assert (final.version, final.flags) == (version, StageStateHeader.new(K.PREFILL_FINAL_EMBD).flags)
    with pytest.raises(ValueError):
        StageStateHeader.new(23)
    with pytest.raises(ValueError):
        StageStateHeader.new(K.DECODE_EMBD).matches_kind(23)


def test_matches_kind():
    for kind in K:
        assert StageStateHeader.new(kind).matches_kind(kind), kind
    st = StageStateHeader.new(K.DECODE_EMBD)
    assert not st.matches_kind(K.PREFILL_EMBD)
    st.flags |= StateFlags.FINAL_CHUNK
    assert not st.matches_kind(K.DECODE_EMBD)
    assert st.matches_kind(K.STATE_IMPORT) and st.matches_kind(K.TRIM_SESSION)  # unconditional kinds
    light = StageStateHeader.new(K.DECODE_LIGHT_CTX)
    light.flags = 0
    assert not light.matches_kind(K.DECODE_LIGHT_CTX)


def test_header_defaults():
    st = StageStateHeader.new(K.DECODE_REPLAY_FINAL_EMBD)
    assert (st.version, st.phase, st.flags, st.decode_step, st.current_token, st.source_stage_index) == (15, 3, 1, -1, -1, -1)
    assert st.activation_codec is ActivationCodec.RAW_F32_V1 and ActivationCodec.default() is ActivationCodec.RAW_F32_V1


def epoch_msg(request, session, gen, prompt, step):
    st = StageStateHeader.new(K.DECODE_EMBD)
    st.checkpoint_generation, st.prompt_token_count, st.decode_step = gen, prompt, step
    return StageWireMessage(K.DECODE_EMBD, 0, 1, st, request, session)


def test_request_epoch_orders_only_matching_flows():
    older, newer = epoch_msg(7, 11, 1, 8, 2), epoch_msg(7, 11, 1, 8, 3)
    assert older.same_flow(newer) and older.is_stale_for(newer) and not newer.is_stale_for(older)
    other = epoch_msg(7, 12, 1, 8, 3)
    assert not older.same_flow(other) and not older.is_stale_for(other)
    assert not older.is_stale_for(older)
    # the epoch carries the same predicates as the message
    assert older.request_epoch() == m.RequestEpoch(7, 11, 1, 8, 2)
    assert older.request_epoch().is_stale_for(newer.request_epoch())
    assert not older.request_epoch().same_flow(other.request_epoch())


def test_request_epoch_staleness_orders_generation_before_prompt_before_decode():
    base = epoch_msg(7, 11, 1, 8, 3)
    for newer in (epoch_msg(7, 11, 2, 0, 0), epoch_msg(7, 11, 1, 9, 0), epoch_msg(7, 11, 1, 8, 4)):
        assert base.is_stale_for(newer) and not newer.is_stale_for(base)


def test_only_decode_messages_carry_authoritative_session_positions():
    assert StageWireMessage(K.DECODE_EMBD, 17).authoritative_session_position() == 17
    assert StageWireMessage(K.DECODE_EMBD, -1).authoritative_session_position() is None
    assert StageWireMessage(K.PREFILL_EMBD, 17).authoritative_session_position() is None
    for kind in (K.DECODE_READOUT, K.DECODE_LIGHT_CTX, K.VERIFY_WINDOW):
        assert StageWireMessage(kind, 3).authoritative_session_position() == 3
    assert StageWireMessage(K.DECODE_EMBD).verify_window_id() is None


def test_stop_and_configure_generation_constructors():
    stop = StageWireMessage.stop()
    assert (stop.kind, stop.request_id, stop.session_id, stop.state.phase) == (K.STOP, 0, 0, P.DECODE)
    assert StageWireMessage.stop_with_identity(4, 5).session_id == 5
    cg = StageWireMessage.configure_generation(1, 2, 33, SamplingConfig(), "{}")
    assert (cg.kind, cg.state.prompt_token_count, cg.state.phase, cg.chat_sampling_metadata) == (K.CONFIGURE_GENERATION, 33, 1, "{}")


def test_sampling_defaults_and_size():
    s = SamplingConfig()
    assert s.wire_bytes() == 225 and not s.enabled() and SamplingConfig(flags=1).enabled()
    assert s.dry_sequence_breakers == ["\n", ":", '"', "*"] and len(s.samplers) == 9
    assert f32_bits(s.dry_base) == 0x3FE00000 and f32_bits(s.xtc_threshold) == 0x3DCCCCCD
    assert SamplingConfig().samplers is not SamplingConfig().samplers  # no shared mutable defaults
    assert SamplingConfig(logit_bias=[(1, 0.0)] * 300, samplers=["é"] * 20).wire_bytes() == (
        225 + 256 * 8 - sum(4 + len(x) for x in s.samplers) + 16 * (4 + 2))


def test_estimated_wire_bytes_components():
    msg = StageWireMessage(K.STATE_IMPORT, raw_bytes=bytes(10), tokens=[1, 2])
    assert msg.estimated_wire_bytes() == 90  # StateImport counts raw bytes, not the lists
    msg = StageWireMessage(K.DECODE_EMBD, chat_sampling_metadata="é", tokens=[1], positions=[2, 3], activation=bytes(8))
    assert msg.estimated_wire_bytes() == 80 + 4 + 2 + 12 + 8


def test_activation_f32_payload_limit():
    msg = StageWireMessage(K.DECODE_EMBD, activation=memoryview(bytearray(16)))
    assert msg.activation_f32_payload() == bytes(16)
    big = StageWireMessage(K.DECODE_EMBD)
    big.activation = bytearray(2**29 + 1)
    with pytest.raises(InvalidDataError, match="^decoded activation payload byte count exceeds maximum$"):
        big.activation_f32_payload()


@pytest.mark.parametrize("bits", [0, 0x80000000, 0x3F800000, 0x00000001, 0x7F7FFFFF, 0x7F800000, 0xFF800000,
                                  0x7FC00000, 0x7F800001, 0xFFC01234, 0x7FBFFFFF])
def test_f32_values_keep_their_bits(bits):
    value = f32_from_bits(bits)
    assert f32_bits(value) == bits
    if math.isnan(value):
        assert type(value) is F32 and repr(value) == f"F32(0x{bits:08x})"
    else:
        assert type(value) is float


def test_f32_bits_of_python_floats_round_to_nearest_and_overflow_to_infinity():
    assert f32_bits(0.8) == 0x3F4CCCCD
    assert f32_bits(1e39) == 0x7F800000 and f32_bits(-1e39) == 0xFF800000
    assert f32_bits(3.4028235e38) == 0x7F7FFFFF
    assert f32_bits(1) == 0x3F800000
    assert struct.pack("<I", f32_bits(-0.0)) == struct.pack("<f", -0.0)


#: wire-format.md section 1, transcribed.
SPEC_CONSTANTS = {
    "STAGE_STATE_VERSION": 15, "READY_MAGIC": 0x53524459, "LLAMA_TOKEN_NULL": -1,
    "STAGE_STATE_HEADER_BYTES": 40, "STAGE_WIRE_FIXED_HEADER_BYTES": 80,
    "STAGE_SAMPLING_CONFIG_BASE_BYTES": 108, "STAGE_LOGIT_BIAS_WIRE_BYTES": 8, "MAX_STAGE_LOGIT_BIAS": 256,
    "MAX_STAGE_SAMPLERS": 16, "MAX_STAGE_DRY_SEQUENCE_BREAKERS": 8, "MAX_STAGE_SAMPLING_STRING_BYTES": 64,
    "MAX_STAGE_PREDICTED_TOKENS": 262_144, "MAX_STAGE_SIDEBAND_VALUES": 1_048_576,
    "MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES": 8_388_608, "MAX_STAGE_STATE_IMPORT_BYTES": 536_870_912,
    "MAX_STAGE_ACTIVATION_BYTES": 536_870_912, "MAX_STAGE_DECODED_ACTIVATION_BYTES": 536_870_912,
}


def test_constants_are_the_spec_values():
    assert {name: getattr(c, name) for name in SPEC_CONSTANTS} == SPEC_CONSTANTS
    assert c.READY_BYTES == bytes.fromhex("59445253")
    assert c.STAGE_REPLY_STATS_BYTES == 27 * 8


def test_message_and_reply_equality_compare_contents_not_containers():
    from skippy_wire.wire.replies import StageReply, WireReplyKind

    a = StageWireMessage(K.DECODE_EMBD, 3, 1, tokens=[5], positions=(3,), activation=b"\x01\x02")
    b = StageWireMessage(K.DECODE_EMBD, 3, 1, tokens=(5,), positions=[3], activation=memoryview(b"\x01\x02"))
    assert a == b
    assert a != StageWireMessage(K.DECODE_EMBD, 3, 1, tokens=[5], positions=[3], activation=b"\x01\x03")
    assert a != StageWireMessage(K.DECODE_EMBD, 3, 1, tokens=[5], positions=[3], activation=b"\x01\x02",
                                 request_id=9)
    assert a != "not a message" and a.__eq__(1) is NotImplemented
    r = StageReply(WireReplyKind.PREDICTED_TOKENS, predicted=2, predicted_tokens=(2, 4))
    assert r == StageReply(WireReplyKind.PREDICTED_TOKENS, predicted=2, predicted_tokens=[2, 4])
    assert r != StageReply(WireReplyKind.PREDICTED_TOKENS, predicted=2, predicted_tokens=[2, 5])
