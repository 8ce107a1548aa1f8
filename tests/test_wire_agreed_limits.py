"""Size limits of agreement-framed activations (wire-v16-v17.md B.6.3 step 9, B.6.5).

The receiver compares the bytes left after the dynamic values with the sum of the part wire
sizes, the same sum as the v17 plain frame decoder's: an F32 part's wire size is its v15
encoded size, which fails with "activation payload byte count exceeds maximum" when the part
alone exceeds 512 MiB (S8 with 1-wide rows: 5 wire bytes per 4 logical bytes).  Before, the
agreement decoder summed uncapped sizes and reported a size mismatch instead.  Nothing is
allocated for the declared sizes: the inputs here are a few dozen bytes.
"""

from __future__ import annotations

import struct

import pytest

from conftest import IMPLS
from skippy_wire.errors import InvalidDataError, UnexpectedEofError
from skippy_wire.wire.agreement import TOKENS, ActivationAgreement, ActivationPartProfile, ActivationProfile, Dynamic, Fixed
from skippy_wire.wire.protocol import kernels

RAW, F16, BF16, S8 = 1, 2, 3, 4
GENERATION = bytes(range(1, 17))
IDENTITY = b"\x01" * 32
FRONTIER = b"\x03" * 32
MAX = 536_870_912


def _agreement(columns, ggml_type=0) -> ActivationAgreement:
    """One part: ``columns`` (axis 0, the S8 row width) x a dynamic row count x tokens."""
    part = ActivationPartProfile(IDENTITY, ggml_type, 3, 2, False,
                                 (columns, Dynamic(1, 2**62), TOKENS, Fixed(1)))
    return ActivationAgreement(GENERATION, [ActivationProfile(1, 0, 0, 4, FRONTIER, 8, 1, [part])])


def _wire(rows: int, tokens: int = 1, body: bytes = b"") -> bytes:
    return GENERATION + struct.pack("<IIIHQ", 1, tokens, 1, 1, rows) + body


def _error(impl, agreement, codec, data):
    with pytest.raises(InvalidDataError) as err:
        kernels(impl).agreed_decode(agreement, codec, data)
    return str(err.value)


@pytest.mark.parametrize("impl", IMPLS)
def test_s8_part_over_512_mib_is_a_part_size_error(impl):
    # 2^27 one-wide rows: 512 MiB decoded (allowed), 640 MiB as S8
    agreement = _agreement(Fixed(1))
    assert _error(impl, agreement, S8, _wire(2**27)) == "activation payload byte count exceeds maximum"
    assert _error(impl, agreement, S8, _wire(2**27, body=bytes(64))) == "activation payload byte count exceeds maximum"


@pytest.mark.parametrize("impl", IMPLS)
def test_s8_part_at_the_limit_is_a_size_mismatch(impl):
    # rows x 5 <= 512 MiB: a part size that is allowed, so the short body is a mismatch
    rows = MAX // 5
    assert _error(impl, _agreement(Fixed(1)), S8, _wire(rows)) == "activation frame wire byte count mismatch"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("codec", [RAW, F16, BF16])
def test_other_codecs_of_the_same_part_are_size_mismatches(impl, codec):
    assert _error(impl, _agreement(Fixed(1)), codec, _wire(2**27)) == "activation frame wire byte count mismatch"


@pytest.mark.parametrize("impl", IMPLS)
def test_wider_s8_rows_stay_under_the_part_limit(impl):
    # 4-wide rows: S8 is 8 bytes per 16 logical bytes
    assert _error(impl, _agreement(Fixed(4)), S8, _wire(2**25)) == "activation frame wire byte count mismatch"


@pytest.mark.parametrize("impl", IMPLS)
def test_decoded_limit_comes_before_the_part_size(impl):
    # one row more is over 512 MiB decoded: validation (B.6.3 step 8) reports it first
    assert _error(impl, _agreement(Fixed(1)), S8, _wire(2**27 + 1)) == \
        "decoded activation payload byte count exceeds maximum"


@pytest.mark.parametrize("impl", IMPLS)
def test_non_f32_part_is_never_capped_by_the_codec(impl):
    # an I32 part is copied verbatim: its wire size is its 512 MiB payload
    assert _error(impl, _agreement(Fixed(1), ggml_type=26), S8, _wire(2**27)) == \
        "activation frame wire byte count mismatch"


@pytest.mark.parametrize("impl", IMPLS)
def test_the_plain_v17_frame_decoder_agrees(impl):
    # the same part as a v17 frame descriptor over a short buffer (B.6.5)
    head = struct.pack("<IiiiIIIQ", 2, 0, 0, 4, 1, 1, 1, MAX) + FRONTIER
    part = IDENTITY + struct.pack("<IIiI4q4QQQ", 0, 3, 2, 0, 1, 2**27, 1, 1, 4, 4, 4 * 2**27, MAX, 0, MAX)
    for codec, text in ((S8, "activation payload byte count exceeds maximum"),
                        (RAW, "activation frame wire byte count mismatch")):
        with pytest.raises(InvalidDataError) as err:
            kernels(impl).decode_frame(codec, head + part + bytes(8), 17)
        assert str(err.value) == text


@pytest.mark.parametrize("impl", IMPLS)
def test_short_dynamic_value_is_eof_before_any_size(impl):
    with pytest.raises(UnexpectedEofError):
        kernels(impl).agreed_decode(_agreement(Fixed(1)), S8, _wire(2**27)[:-1])


def _two_dynamic_axes() -> ActivationAgreement:
    """F32 ``Dynamic(1, 2^63-1)`` x tokens x ``Dynamic(1, 4)``: the first value alone can
    overflow the strides."""
    part = ActivationPartProfile(IDENTITY, 0, 3, 1, False,
                                 (Dynamic(1, 2**63 - 1), TOKENS, Dynamic(1, 4), Fixed(1)))
    return ActivationAgreement(GENERATION, [ActivationProfile(1, 0, 0, 4, FRONTIER, 8, 1, [part])])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("rest", [b"", struct.pack("<Q", 9), struct.pack("<Q", 2)],
                         ids=["next-value-missing", "next-value-out-of-bounds", "next-value-in-bounds"])
def test_layout_overflow_is_found_at_the_axis_that_overflows(impl, rest):
    # B.6.3 step 7: upstream multiplies each axis into the stride as it reads it, so 4 x
    # (2^63 - 1) overflows before the next dynamic value is read: neither its absence (EOF)
    # nor its bound (9 > 4) is what the receiver reports.
    data = GENERATION + struct.pack("<IIIHQ", 1, 1, 1, 1, 2**63 - 1) + rest
    assert _error(impl, _two_dynamic_axes(), RAW, data) == "activation layout overflow"
