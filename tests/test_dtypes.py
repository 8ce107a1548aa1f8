"""Codec ids, policies and flag mappings (wire-format.md 2.4-2.5, 6.1, 8.2)."""

import pytest

from skippy_wire.wire.forwarding import ActivationDType
from skippy_wire.wire.constants import (
    LOSSLESS_CODECS,
    ActivationCodec,
    CodecPolicy,
    activation_frame_flags_from_state_flags,
    activation_payload_multiplier_from_state_flags,
    activation_state_flags_from_frame_flags,
)

RAW, F16, BF16, S8 = (ActivationCodec.RAW_F32_V1, ActivationCodec.F16_RNE_V1,
                      ActivationCodec.BF16_RNE_V1, ActivationCodec.S8_ROW_F32_RNE_V1)


def test_codec_ids_and_identities():
    assert [int(c) for c in ActivationCodec] == [1, 2, 3, 4]
    assert [c.identity() for c in ActivationCodec] == ["raw-f32-v1", "f16-rne-v1", "bf16-rne-v1", "s8-row-f32-rne-v1"]
    assert all(ActivationCodec.from_identity(c.identity()) is c for c in ActivationCodec)
    assert all(ActivationCodec.from_rust_name(c.rust_name) is c for c in ActivationCodec)
    assert ActivationCodec.default() is RAW  # activation_codec_default_is_bit_exact
    with pytest.raises(ValueError, match="^unknown activation codec 'q8'$"):
        ActivationCodec.from_identity("q8")


def test_upstream_spellings_follow_from_member_names():
    # The Rust variants and serde strings as upstream writes them (skippy-protocol).
    assert [c.rust_name for c in ActivationCodec] == ["RawF32V1", "F16RneV1", "Bf16RneV1", "S8RowF32RneV1"]
    assert [p.serde_name for p in CodecPolicy] == ["fixed", "auto-lossless-v1"]
    assert [d.rust_name for d in ActivationDType] == ["Unknown", "F32", "F16", "Bf16"]
    assert CodecPolicy.from_rust_name("AutoLosslessV1") is CodecPolicy.AUTO_LOSSLESS_V1
    with pytest.raises(ValueError, match="^unknown activation codec policy 'auto'$"):
        CodecPolicy.from_serde_name("auto")
    with pytest.raises(ValueError, match="^unknown activation codec 'Bf16'$"):
        ActivationCodec.from_rust_name("Bf16")  # case matters, as in serde


def test_policy_compatible_permits_identity():
    fixed, auto = CodecPolicy.FIXED, CodecPolicy.AUTO_LOSSLESS_V1
    assert all(fixed.compatible(c) for c in ActivationCodec)
    assert [auto.compatible(c) for c in ActivationCodec] == [True, False, False, False]
    for configured in ActivationCodec:
        for frame in ActivationCodec:
            assert fixed.permits(configured, frame) == (configured == frame)
            assert auto.permits(configured, frame) == (configured == RAW and frame in (RAW, BF16, F16))
    assert fixed.identity(F16) == "f16-rne-v1"
    assert auto.identity(RAW) == "auto-lossless-v1"
    assert set(LOSSLESS_CODECS) == {RAW, BF16, F16}
    for policy in CodecPolicy:
        assert CodecPolicy.from_serde_name(policy.serde_name) is policy
    assert [p.rust_name for p in CodecPolicy] == ["Fixed", "AutoLosslessV1"]


@pytest.mark.parametrize("frame, state", [(1, 0x40), (2, 0x80), (4, 0x100), (7, 0x1C0), (0, 0)])
def test_flag_mapping_round_trips(frame, state):
    assert activation_state_flags_from_frame_flags(frame) == state
    assert activation_frame_flags_from_state_flags(state) == frame


def test_flag_mapping_drops_other_bits():
    assert activation_state_flags_from_frame_flags(0xFFFF_FFFF_FFFF_FFF8) == 0
    assert activation_frame_flags_from_state_flags(0x3F | 0x200 | -(1 << 31)) == 0
    assert activation_frame_flags_from_state_flags(-1) == 7


def test_row_multiplier():
    assert activation_payload_multiplier_from_state_flags(0) == 1
    assert activation_payload_multiplier_from_state_flags(0x80) == 1  # GEMMA3N never multiplies
    assert activation_payload_multiplier_from_state_flags(0x40) == 2
    assert activation_payload_multiplier_from_state_flags(0x100) == 2
    assert activation_payload_multiplier_from_state_flags(0x140) == 2  # never 3
