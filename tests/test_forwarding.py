"""Forwarding (wire-format.md 9): ports of the skippy-server 0.76.1 forwarding.rs tests
(14.3) on every implementation, plus the error texts and the v1 descriptor layout."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from skippy_wire.wire import frame
from skippy_wire.wire.constants import ACTIVATION_FLAG_RWKV7_V_FIRST, ActivationCodec, CodecPolicy, activation_frame_flags_from_state_flags
from skippy_wire.errors import InvalidDataError
from skippy_wire.wire.forwarding import (
    ActivationDescV1,
    ActivationDType,
    ActivationFrameV1,
    ActivationLayout,
    ForwardingError,
    StageConfig,
    forwarded_stage_message,
    forwarded_stage_message_timed,
)
from skippy_wire.wire.constants import StateFlags
from skippy_wire.wire.messages import SamplingConfig, StageStateHeader, StageWireMessage, WireMessageKind

RAW, F16, BF16 = ActivationCodec.RAW_F32_V1, ActivationCodec.F16_RNE_V1, ActivationCodec.BF16_RNE_V1
AUTO = CodecPolicy.AUTO_LOSSLESS_V1
F32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]


def stage_config(**kw) -> StageConfig:
    base = dict(stage_index=1, layer_start=4, layer_end=8)
    base.update(kw)
    return StageConfig(**base)


def incoming(token_count=1) -> StageWireMessage:
    return StageWireMessage(WireMessageKind.DECODE_EMBD, 7, token_count, StageStateHeader.new(WireMessageKind.DECODE_EMBD),
                            42, 99, tokens=[11])


def f32_frame(flags, token_count, values) -> ActivationFrameV1:
    return ActivationFrameV1.f32(values, token_count, flags=flags, producer_stage_index=1, layer_start=4, layer_end=8)


def forward(impl, config, inc, out, width=2):
    return forwarded_stage_message_timed(config, inc, out, width, impl=impl)


def test_forwarded_stage_message_preserves_rwkv7_sideband_shape(impl):
    fwd = forward(impl, stage_config(activation_codec=F16), incoming(), f32_frame(ACTIVATION_FLAG_RWKV7_V_FIRST, 1, [1, 2, 3, 4]))
    msg = fwd.message
    assert msg.state.activation_codec is F16 and len(msg.activation) == 8
    assert msg.state.flags & StateFlags.RWKV7_V_FIRST_SIDEBAND
    assert activation_frame_flags_from_state_flags(msg.state.flags) == ACTIVATION_FLAG_RWKV7_V_FIRST
    assert fwd.activation_encode_ms >= 0.0
    wire = frame.write_stage_message(msg, impl=impl)
    assert wire.hex() == (  # wire-format.md 4.7 (a)
        "02000000070000000100000001000000000000000f0000000000000002000000400000000000000000000000"
        "ffffffffffffffff0100000002000000080000002a000000000000006300000000000000" "0b000000003c004000420044"
    )
    decoded = frame.read_stage_message(wire, 2, F16, impl=impl)
    assert len(decoded.activation) == 16 and decoded.activation_f32().tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("values,flags,codec,size", [
    ([1.0, 2.0], 0, BF16, 4),                                       # both exact: BF16 wins
    ([1.0009766, 2.0], 0, F16, 4),                                  # only F16 exact
    ([1.0009766, 2.0, 65536.0, 4.0], ACTIVATION_FLAG_RWKV7_V_FIRST, RAW, 16),  # mixed halves -> raw
])
def test_auto_lossless_selection(impl, values, flags, codec, size):
    msg = forward(impl, stage_config(activation_codec_policy=AUTO), incoming(), f32_frame(flags, 1, values)).message
    assert msg.state.activation_codec is codec and len(msg.activation) == size
    # lossless: the receiver (Raw + AutoLosslessV1) gets the producer's f32 bits back
    got = frame.read_stage_message(frame.write_stage_message(msg, impl=impl), 2, RAW, AUTO, impl=impl)
    assert bytes(got.activation) == f32_frame(flags, 1, values).payload


def test_auto_lossless_rejects_a_non_raw_fallback(impl):
    with pytest.raises(ForwardingError) as info:
        forward(impl, stage_config(activation_codec=F16, activation_codec_policy=AUTO), incoming(), f32_frame(0, 1, [1.0, 2.0]))
    assert str(info.value) == "activation codec policy AutoLosslessV1 is incompatible with configured codec F16RneV1"


def test_first_stage_applies_auto_lossless_selection(impl):
    config = stage_config(stage_index=0, layer_start=0, activation_codec_policy=AUTO)
    msg = forwarded_stage_message(config, incoming(), f32_frame(0, 1, [1.0, 2.0]), 2, impl=impl)
    assert msg.state.source_stage_index == 0 and msg.state.activation_codec is BF16


def test_compact_activation_encode_failure_does_not_fall_back_to_raw(impl):
    with pytest.raises(ForwardingError) as info:
        forward(impl, stage_config(activation_codec=F16), incoming(), f32_frame(0, 1, [F32_MAX, 1.0]))
    assert str(info.value) == (
        "encode f32 output activation payload; frame_dtype=F32 incoming_tokens=1 output_tokens=1 "
        "activation_width=2 payload_bytes=8 frame_payload_bytes=8 state_flags=0: F16 activation value is out of range"
    )
    assert isinstance(info.value.cause, InvalidDataError)
    # a numpy payload: its bytes, not its element count (it read payload_bytes=2)
    numpy_frame = f32_frame(0, 1, [F32_MAX, 1.0])
    numpy_frame.payload = np.frombuffer(numpy_frame.payload, dtype=np.float32)
    with pytest.raises(ForwardingError, match="activation_width=2 payload_bytes=8 frame_payload_bytes=8 "):
        forward(impl, stage_config(activation_codec=F16), incoming(), numpy_frame)


def test_non_first_stage_must_not_emit_a_short_activation_frame(impl):
    with pytest.raises(ForwardingError) as info:
        forward(impl, stage_config(), incoming(4), f32_frame(0, 1, [1.0, 2.0, 3.0, 4.0]), 4)
    assert str(info.value) == (
        "stage 1 (layers 4..8) produced 1 activation tokens for 4 incoming tokens; "
        "non-first stages must execute the full range"
    )


def test_first_stage_may_emit_a_short_activation_frame(impl):
    config = stage_config(stage_index=0, layer_start=0)
    msg = forward(impl, config, incoming(4), f32_frame(0, 1, [1.0] * 16), 4).message
    assert len(msg.activation) == 64  # encoded with incoming.token_count x width values


def test_forwarding_keeps_flags_drops_metadata_and_copies_lists(impl):
    inc = incoming()
    inc.state.flags |= StateFlags.FULL_STATE
    inc.sampling = SamplingConfig(seed=3)
    inc.chat_sampling_metadata = '{"x":1}'
    inc.positions = [7]
    msg = forward(impl, stage_config(stage_index=2**32 - 1), inc, f32_frame(0, 1, [1.0, 2.0])).message
    assert msg.chat_sampling_metadata is None and msg.sampling == inc.sampling and msg.sampling is not inc.sampling
    assert msg.state.flags & StateFlags.FULL_STATE and msg.state.source_stage_index == -1  # u32 -> i32
    assert inc.state.source_stage_index == -1 and inc.state.activation_codec is RAW  # incoming untouched
    assert (msg.tokens, msg.positions, msg.pos_start, msg.request_id, msg.session_id) == ([11], [7], 7, 42, 99)
    assert msg.tokens is not inc.tokens and bytes(msg.raw_bytes) == b""


@pytest.mark.parametrize("policy,text", [
    (CodecPolicy.FIXED, "encode f32 output activation payload; frame_dtype=F16 incoming_tokens=1 output_tokens=1 "
                        "activation_width=2 payload_bytes=8 frame_payload_bytes=8 state_flags=0: "
                        "unsupported activation dtype conversion: F16 to f32"),
    (AUTO, "unsupported activation dtype selection: F16"),
])
def test_non_f32_frames_are_rejected(impl, policy, text):
    out = f32_frame(0, 1, [1.0, 2.0])
    out.desc.dtype = ActivationDType.F16
    with pytest.raises(ForwardingError) as info:
        forward(impl, stage_config(activation_codec_policy=policy), incoming(), out)
    assert str(info.value) == text


def test_selector_errors_propagate_unchanged(impl):
    with pytest.raises(InvalidDataError) as info:  # 3 values for a 1 x 2 frame
        forward(impl, stage_config(activation_codec_policy=AUTO), incoming(), f32_frame(0, 1, [1.0, 2.0, 3.0]))
    assert str(info.value) == "F32 activation payload size mismatch" and not isinstance(info.value, ForwardingError)


def test_activation_desc_v1_layout():
    desc = ActivationDescV1(1, ActivationDType.F32, ActivationLayout.TOKEN_MAJOR, -1, 4, 8, 3, 1, 96, 5)
    data = desc.to_bytes()
    assert len(data) == 48
    assert data == struct.pack("<Iiiiiii", 1, 1, 1, -1, 4, 8, 3) + struct.pack("<IQQ", 1, 96, 5)
    assert ActivationDescV1.from_bytes(data) == desc
