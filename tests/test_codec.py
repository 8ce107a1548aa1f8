"""Ports of the upstream activation-codec unit tests (wire-format.md 14.2) and of the
public codec API contract, run against every implementation."""

from __future__ import annotations

import struct

import numpy as np
import pytest

import skippy_wire
from skippy_wire.wire import codec as api
from skippy_wire._impl import IMPLEMENTATION, kernel_module
from skippy_wire.wire.constants import LOSSLESS_CODECS, ActivationCodec
from skippy_wire.errors import InvalidDataError, InvalidInputError

RAW, F16, BF16, S8 = 1, 2, 3, 4
RWKV7 = 0x40
F32_MAX = 0x7F7FFFFF
F32_MIN_POSITIVE = 0x00800000
NAN = 0x7FC00000
INF = 0x7F800000


def f32(*values) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def bits(*words) -> bytes:
    return struct.pack(f"<{len(words)}I", *words)


def out_bits(arr) -> list[int]:
    return arr.view(np.uint32).tolist()


def shape_args(shape):
    """Upstream tests use the internal shape (primary_rows, sideband_rows, columns).  The
    public API derives sideband rows from a flag (0 or token_count), so an upstream shape
    with another sideband count becomes a plain frame with the same rows and layout."""
    tokens, sideband, columns = shape
    if sideband == tokens and tokens:
        return tokens, columns, RWKV7
    return tokens + sideband, columns, 0


def encode(k, codec, shape, payload):
    t, n, flags = shape_args(shape)
    return k.encode_activation(codec, t, n, payload, flags)


def decode(k, codec, shape, wire):
    t, n, flags = shape_args(shape)
    return k.decode_activation(codec, t, n, wire, flags)


def select(k, shape, payload, permitted):
    t, n, flags = shape_args(shape)
    return k.select_lossless_codec(t, n, payload, flags, permitted)


def raises(text, fn, *args):
    with pytest.raises(InvalidDataError) as info:
        fn(*args)
    assert str(info.value) == text
    assert type(info.value) is InvalidDataError
    return info.value


SHAPE = (2, 1, 2)


def test_raw_f32_is_exact_and_shape_aware(codec_impl):
    payload = struct.pack("<f", -0.0) + f32(1.0, -2.5) + bits(F32_MIN_POSITIVE) + f32(7.0, -9.0)
    wire = encode(codec_impl, RAW, SHAPE, payload)
    assert len(wire) == 24 and wire == payload
    assert decode(codec_impl, RAW, SHAPE, wire).tobytes() == payload


def test_f16_and_bf16_use_round_to_nearest_even_golden_bytes(codec_impl):
    shape = (1, 0, 4)
    values = f32(1.0, 1.0004883, 1.0014648, -0.0)
    assert encode(codec_impl, F16, shape, values) == bytes.fromhex("003c003c023c0080")
    values = f32(1.0, 1.0039063, 1.0117188, -0.0)
    assert encode(codec_impl, BF16, shape, values) == bytes.fromhex("803f803f823f0080")


def test_s8_rows_have_deterministic_golden_bytes_and_zero_rows_use_scale_one(codec_impl):
    shape = (2, 0, 4)
    wire = encode(codec_impl, S8, shape, f32(0, 0, 0, 0, -1, -0.5, 0.5, 1))
    assert wire == bytes.fromhex("0000803f00000000" "0402013c81c0407f")
    got = decode(codec_impl, S8, shape, wire)
    expected = np.array([0, 0, 0, 0, -1, -64 / 127, 64 / 127, 1], dtype=np.float32)
    assert out_bits(got) == out_bits(expected)


def test_s8_uses_symmetric_range_zero_point_and_round_to_even(codec_impl):
    wire = encode(codec_impl, S8, (1, 0, 5), f32(-1, -0.5, 0, 0.5, 1))
    assert list(wire[4:]) == [129, 192, 0, 64, 127]
    # round_to_even_i8: -2.5 -> -2, -1.5 -> -2, 1.5 -> 2, 2.5 -> 2.  With max_abs 127 the
    # scale is exactly 1.0, so each value is its own quotient.
    wire = encode(codec_impl, S8, (1, 0, 5), f32(127, -2.5, -1.5, 1.5, 2.5))
    assert wire[:4] == f32(1.0)
    assert [b - 256 if b > 127 else b for b in wire[4:]] == [127, -2, -2, 2, 2]


def test_s8_encoder_only_emits_frames_the_decoder_can_reconstruct(codec_impl):
    for value in (F32_MAX, F32_MAX | 0x80000000):
        raises("S8 activation value is out of range", encode, codec_impl, S8, (1, 0, 1), bits(value))


def test_s8_decoder_rejects_reserved_negative_128(codec_impl):
    raises("S8 activation payload contains reserved -128 value", decode, codec_impl, S8, (1, 0, 1), f32(1.0) + b"\x80")


def test_s8_tiny_rows_use_the_minimum_positive_subnormal_scale(codec_impl):
    wire = encode(codec_impl, S8, (1, 0, 2), bits(1, 63))
    assert wire == bits(1) + bytes([1, 63])
    assert out_bits(decode(codec_impl, S8, (1, 0, 2), wire)) == [1, 63]


def test_s8_quantization_uses_f64_quotients_before_rounding(codec_impl):
    wire = encode(codec_impl, S8, (1, 0, 2), f32(1.0) + bits(0x3E0D1A34))
    assert list(wire[4:]) == [127, 17]


def test_sideband_rows_are_included_in_shape_and_s8_chunks_are_invariant(codec_impl):
    values = [1, -1, 0.5, -0.5, 2, -2]
    whole = encode(codec_impl, S8, SHAPE, f32(*values))
    rows = b"".join(encode(codec_impl, S8, (1, 0, 2), f32(*values[i : i + 2])) for i in range(0, 6, 2))
    assert whole == rows
    assert decode(codec_impl, S8, SHAPE, whole).shape == (6,)
    # With a real sideband flag the v_first rows follow the primary rows, same codec.
    sideband = encode(codec_impl, S8, (2, 2, 2), f32(*values, 4, -4))
    assert sideband == whole + encode(codec_impl, S8, (1, 0, 2), f32(4, -4))


def test_raw_f32_preserves_non_finite_bit_patterns(codec_impl):
    payload = bits(0x7FC01234, INF, 0xFF800000)
    wire = encode(codec_impl, RAW, (1, 0, 3), payload)
    assert out_bits(decode(codec_impl, RAW, (1, 0, 3), wire)) == [0x7FC01234, INF, 0xFF800000]
    assert select(codec_impl, (1, 0, 3), payload, [RAW, F16, BF16]) == RAW


def test_compressed_codecs_reject_non_finite_values_and_malformed_payloads(codec_impl):
    shape = (1, 0, 1)
    for codec in (F16, BF16, S8):
        raises("activation values must be finite", encode, codec_impl, codec, shape, bits(NAN))
        raises("activation values must be finite", encode, codec_impl, codec, shape, bits(INF))
        raises("activation payload size mismatch", decode, codec_impl, codec, shape, b"")
    raises("activation payload size mismatch", decode, codec_impl, RAW, shape, b"")
    raises("S8 activation row scale is not finite and positive", decode, codec_impl, S8, shape, bytes(5))
    raises("activation payload contains non-finite value", decode, codec_impl, F16, shape, b"\x00\x7c")
    raises("activation payload contains non-finite value", decode, codec_impl, BF16, shape, b"\x80\x7f")
    raises("activation payload contains non-finite value", decode, codec_impl, S8, shape, bits(F32_MAX) + bytes([127]))
    raises("F16 activation value is out of range", encode, codec_impl, F16, shape, bits(F32_MAX))
    raises("BF16 activation value is out of range", encode, codec_impl, BF16, shape, bits(F32_MAX))


def test_checked_limits_reject_overflow_and_payloads_over_protocol_maximum(codec_impl):
    # Upstream's (usize::MAX, 1, 1) shape is not expressible through the i32 API; the
    # largest i32 frame with a sideband overflows the decoded byte count instead.
    raises("decoded activation byte count overflow", codec_impl.encode_activation, RAW, 2**31 - 1, 2**31 - 1, b"", RWKV7)
    raises("decoded activation payload byte count exceeds maximum", decode, codec_impl, RAW, (134217729, 0, 1), b"")
    raises("activation payload byte count exceeds maximum", decode, codec_impl, S8, (107374183, 0, 1), b"")


def test_lossless_selector_uses_bf16_only_for_exactly_representable_values(codec_impl):
    shape = (1, 1, 3)
    payload = f32(1.0, -2.5, 0.0, -0.0) + bits(F32_MIN_POSITIVE) + f32(8.0)
    assert select(codec_impl, shape, payload, [RAW, BF16]) == BF16
    wire = encode(codec_impl, BF16, shape, payload)
    assert decode(codec_impl, BF16, shape, wire).tobytes() == payload
    payload = f32(1.0, -2.5, 0.0, -0.0, 1.000001, 8.0)
    assert select(codec_impl, shape, payload, [RAW, BF16]) == RAW


def _finite_bf16_as_f32() -> np.ndarray:
    h = np.arange(65536, dtype=np.uint32)
    h = h[(h & 0x7F80) != 0x7F80]
    return h << 16


def _finite_f16_as_f32() -> np.ndarray:
    h = np.arange(65536, dtype=np.uint16)
    h = h[(h & 0x7C00) != 0x7C00]
    return h.view(np.float16).astype(np.float32).view(np.uint32)


@pytest.mark.parametrize("codec,finite_values,count",
                         [(BF16, _finite_bf16_as_f32, 65280), (F16, _finite_f16_as_f32, 63488)], ids=["bf16", "f16"])
def test_lossless_selector_round_trips_every_finite_value_exactly(codec_impl, codec, finite_values, count):
    values = finite_values()
    assert values.size == count
    shape = (values.size, 0, 1)
    assert select(codec_impl, shape, values, [RAW, codec]) == codec
    wire = encode(codec_impl, codec, shape, values)
    assert np.array_equal(decode(codec_impl, codec, shape, wire).view(np.uint32), values)


def test_lossless_selector_uses_bf16_tie_break_and_f16_when_it_alone_is_exact(codec_impl):
    permitted = [RAW, F16, BF16]
    assert select(codec_impl, (1, 0, 1), f32(1.0), permitted) == BF16
    assert select(codec_impl, (1, 0, 1), f32(1 + 2**-10), permitted) == F16
    assert select(codec_impl, (1, 0, 1), f32(65536.0), permitted) == BF16


def test_lossless_selector_requires_one_codec_to_cover_the_whole_frame(codec_impl):
    assert select(codec_impl, (1, 1, 1), f32(1 + 2**-10, 65536.0), [RAW, F16, BF16]) == RAW


def test_lossless_selector_requires_raw_and_never_selects_unpermitted_lossy_codecs(codec_impl):
    payload = f32(1.0, -2.0)
    raises("lossless activation selection requires RawF32 fallback", select, codec_impl, (1, 0, 2), payload, [BF16])
    assert select(codec_impl, (1, 0, 2), payload, [RAW, S8]) == RAW


def test_lossless_selector_validates_shape_values_and_empty_payload_cost(codec_impl):
    raises("F32 activation payload size mismatch", select, codec_impl, (1, 0, 2), f32(1.0), [RAW, BF16])
    assert select(codec_impl, (1, 0, 1), bits(NAN), [RAW, BF16]) == RAW
    assert select(codec_impl, (0, 0, 4), b"", [RAW, BF16]) == RAW
    # An empty frame is never compact, but RAW must still be permitted.
    raises("lossless activation selection requires RawF32 fallback", select, codec_impl, (0, 0, 4), b"", [BF16])


# --------------------------------------------------------------------------- sizes and checks


def test_size_functions(codec_impl):
    k = codec_impl
    assert k.activation_shape(3, 5, 0) == (3, 0, 5)
    assert k.activation_shape(3, 5, RWKV7 | 0x100) == (3, 3, 5)  # never triples
    assert k.activation_shape(3, 5, 0x80) == (3, 0, 5)  # GEMMA3N never doubles
    assert k.activation_f32_bytes(3, 0, RWKV7) == 0
    assert k.activation_f32_bytes(3, 5, RWKV7) == 120
    assert k.activation_f32_bytes(2**31 - 1, 2**31 - 1, 0) == (2**31 - 1) ** 2 * 4  # no maximum
    raises("activation byte count overflow", k.activation_f32_bytes, 2**31 - 1, 2**31 - 1, RWKV7)
    raises("negative activation dimensions", k.activation_f32_bytes, 0, -1, 0)
    raises("negative activation dimensions", k.activation_shape, 1, 0, 0)
    assert [k.activation_wire_bytes(c, 2, 3, RWKV7) for c in (RAW, F16, BF16, S8)] == [48, 24, 24, 28]
    assert k.activation_wire_bytes(RAW, 1, 2**27, 0) == 2**29  # exactly the cap is accepted
    raises("activation payload byte count exceeds maximum", k.activation_wire_bytes, RAW, 1, 2**27 + 1, 0)
    raises("activation wire byte count overflow", k.activation_wire_bytes, RAW, 2**31 - 1, 2**31 - 1, RWKV7)
    for codec in (0, 5, -1):
        raises("unknown stage activation codec", k.activation_wire_bytes, codec, 1, 1, 0)
        raises("unknown stage activation codec", k.encode_activation, codec, 1, 1, f32(1.0), 0)
        raises("unknown stage activation codec", k.select_lossless_codec, 1, 1, f32(1.0), 0, [RAW, codec])


def test_dimensions_outside_i32_are_rejected(codec_impl):
    for t, n in ((2**31, 1), (1, -(2**31) - 1)):
        with pytest.raises(InvalidInputError):
            codec_impl.activation_wire_bytes(RAW, t, n, 0)
    with pytest.raises(TypeError):
        codec_impl.activation_shape(1.0, 2, 0)


def test_a_bool_is_no_codec_id_or_dimension(codec_impl):
    # as everywhere on the wire: True was codec 1 (RawF32V1) or a dimension of 1
    payload = f32(1.0, 2.0)
    for args in ((True, 1, 2, payload, 0), (RAW, True, 2, payload, 0), (RAW, 1, 2, payload, False)):
        with pytest.raises(TypeError, match="a bool is not a wire integer"):
            codec_impl.encode_activation(*args)
    with pytest.raises(TypeError, match="a bool is not a wire integer"):
        codec_impl.activation_wire_bytes(RAW, 1, True, 0)
    with pytest.raises(TypeError, match="a bool is not a wire integer"):
        codec_impl.select_lossless_codec(1, 2, payload, 0, [True, 3])


def test_state_flags_outside_i32_are_rejected_not_truncated(codec_impl):
    """2**32 read as 0 and 2**32 + 0x40 as a doubling flag: upstream's flag word is an i32."""
    import skippy_wire as sw

    payload = f32(*([1.0] * 8))
    for flags in (2**31, 2**32, 2**32 + 0x40, -(2**31) - 1, 2**70):
        for call in (lambda: codec_impl.activation_shape(1, 4, flags),
                     lambda: codec_impl.activation_f32_bytes(1, 4, flags),
                     lambda: codec_impl.activation_wire_bytes(RAW, 1, 4, flags),
                     lambda: codec_impl.encode_activation(RAW, 1, 4, payload[:16], flags),
                     lambda: codec_impl.decode_activation(RAW, 1, 4, payload[:16], flags),
                     lambda: codec_impl.select_lossless_codec(1, 4, payload[:16], flags, [RAW]),
                     lambda: sw.activation_frame_flags_from_state_flags(flags),
                     lambda: sw.activation_payload_multiplier_from_state_flags(flags)):
            with pytest.raises(InvalidInputError, match="^state flags must fit in an i32$"):
                call()
    for flags in (-(2**31) | 0x40, 2**31 - 1, -1):  # every bit of the word, the sign bit included
        assert codec_impl.activation_shape(1, 4, flags)[1] == 1
    for frame_flags in (-1, 2**64):
        with pytest.raises(InvalidInputError, match="^activation frame flags must fit in a u64$"):
            sw.activation_state_flags_from_frame_flags(frame_flags)
    for convert in (sw.activation_state_flags_from_frame_flags, sw.activation_frame_flags_from_state_flags):
        with pytest.raises(TypeError, match="a bool is not a wire integer"):  # True was flag bit 0
            convert(True)


def test_f16_range_boundaries(codec_impl):
    ok = {0x477FEFFF: 0x7BFF, 0x477FE000: 0x7BFF}  # 65519.996 and 65504 -> 0x7bff
    for value, half in ok.items():
        assert encode(codec_impl, F16, (1, 0, 1), bits(value)) == struct.pack("<H", half)
    for value in (0x477FF000, 0x47800000, 0xC77FF000):  # 65520 ties to infinity
        raises("F16 activation value is out of range", encode, codec_impl, F16, (1, 0, 1), bits(value))
    # A non-finite value anywhere wins over an earlier out-of-range one (6.2 step 3).
    raises("activation values must be finite", encode, codec_impl, F16, (1, 0, 2), bits(0x47800000, NAN))
    raises("activation values must be finite", encode, codec_impl, BF16, (1, 0, 2), bits(F32_MAX, INF))


def test_bf16_range_boundaries(codec_impl):
    assert encode(codec_impl, BF16, (1, 0, 1), bits(0x7F7F7FFF)) == b"\x7f\x7f"
    raises("BF16 activation value is out of range", encode, codec_impl, BF16, (1, 0, 1), bits(0x7F7F8000))
    raises("BF16 activation value is out of range", encode, codec_impl, BF16, (1, 0, 1), bits(0xFF7F8000))


def test_encode_f32_activation_payload(codec_impl):
    payload = f32(1, 2, 3, 4)
    assert codec_impl.encode_f32_activation_payload(1, 2, payload, RWKV7) == payload
    raises("F32 activation payload size mismatch", codec_impl.encode_f32_activation_payload, 1, 2, payload, 0)
    # n_embd = 0 passes the f32 size check (0 bytes) and then fails the shape.
    raises("negative activation dimensions", codec_impl.encode_f32_activation_payload, 1, 0, b"", 0)
    raises("decoded activation payload byte count exceeds maximum", codec_impl.encode_f32_activation_payload, 1, 2**27 + 1, b"", 0)


def test_decode_returns_an_owned_float32_array(codec_impl):
    wire = bytearray(encode(codec_impl, F16, (1, 0, 2), f32(1.5, -2.0)))
    out = decode(codec_impl, F16, (1, 0, 2), wire)
    wire[:] = b"\x00" * 4  # the result must not alias the input
    assert out.dtype == np.float32 and out.ndim == 1 and out.flags.writeable
    assert out.tolist() == [1.5, -2.0]


def test_nan_policy_vectors(codec_impl):
    """The raw conversions' NaN policy (docs/numerics.md), tested on its own vectors."""
    f16 = {0x7FC01234: 0x7C01, 0xFFC00000: 0xFC01, 0x7F800001: 0x7C01, 0x7FFFFFFF: 0x7C01, INF: 0x7C00, 0xFF800000: 0xFC00}
    got = codec_impl.f32_bits_to_f16_bits(np.array(list(f16), dtype=np.uint32))
    assert got.tolist() == list(f16.values())
    bf16 = {0x7FC01234: 0x7FC0, 0x7F800001: 0x7FC0, 0x7FFFFFFF: 0x7FFF, 0xFFC00000: 0xFFC0, 0x7F810000: 0x7FC1, INF: 0x7F80}
    got = codec_impl.f32_bits_to_bf16_bits(np.array(list(bf16), dtype=np.uint32))
    assert got.tolist() == list(bf16.values())
    # Widening keeps the payload (f16 payload shifted left by 13).
    assert codec_impl.f16_bits_to_f32_bits(np.array([0x7C01, 0xFE00], dtype=np.uint16)).tolist() == [0x7F802000, 0xFFC00000]
    assert codec_impl.bf16_bits_to_f32_bits(np.array([0x7FC1], dtype=np.uint16)).tolist() == [0x7FC10000]


def test_raw_conversions_keep_shape_and_check_dtype(codec_impl):
    a = np.arange(12, dtype=np.uint32).reshape(3, 4) << 20
    assert codec_impl.f32_bits_to_f16_bits(a).shape == (3, 4)
    assert codec_impl.f32_bits_to_bf16_bits(a[:, ::2]).shape == (3, 2)
    with pytest.raises(TypeError):
        codec_impl.f32_bits_to_f16_bits(a.astype(np.int64))
    with pytest.raises(TypeError):
        codec_impl.f16_bits_to_f32_bits(a)


def test_is_exact_definitions(codec_impl):
    assert codec_impl.is_bf16_exact(f32(1.0, -0.0, 65536.0)) and codec_impl.is_f16_exact(f32(1.0, -0.0))
    assert not codec_impl.is_f16_exact(f32(65536.0)) and not codec_impl.is_bf16_exact(f32(1 + 2**-10))
    assert codec_impl.is_bf16_exact(bits(0x00010000)) and not codec_impl.is_f16_exact(bits(0x00010000))
    assert not codec_impl.is_bf16_exact(bits(INF)) and not codec_impl.is_f16_exact(bits(INF))
    assert not codec_impl.is_f16_exact(bits(0x7F802000))  # a NaN that would round-trip bitwise
    assert codec_impl.is_bf16_exact(b"") and codec_impl.is_f16_exact(b"")
    raises("F32 activation payload size mismatch", codec_impl.is_bf16_exact, b"\x00" * 6)


# --------------------------------------------------------------------------- public API


def test_public_api_accepts_enums_and_defaults():
    payload = f32(1.0, 2.0)
    assert api.encode_activation(ActivationCodec.BF16_RNE_V1, 1, 2, payload) == bytes.fromhex("803f0040")
    assert api.activation_wire_bytes(ActivationCodec.S8_ROW_F32_RNE_V1, 1, 2) == 6
    codec = api.select_lossless_codec(1, 2, payload)
    assert codec is ActivationCodec.BF16_RNE_V1
    codec, wire = api.select_and_encode_lossless(1, 2, f32(1 + 2**-10, 2.0))
    assert codec is ActivationCodec.F16_RNE_V1 and wire == api.encode_activation(codec, 1, 2, f32(1 + 2**-10, 2.0))
    assert api.select_lossless_codec(1, 2, payload, permitted=[ActivationCodec.RAW_F32_V1]) is ActivationCodec.RAW_F32_V1
    assert api.decode_activation(3, 1, 2, bytes.fromhex("803f0040")).tolist() == [1.0, 2.0]
    assert tuple(LOSSLESS_CODECS) == (1, 3, 2)
    with pytest.raises(InvalidDataError, match="^unknown stage activation codec$"):
        api.encode_activation(7, 1, 2, payload)
    with pytest.raises(TypeError):
        api.encode_activation("bf16", 1, 2, payload)


def test_public_views_are_zero_copy():
    wire = bytearray(api.encode_activation(3, 1, 3, f32(1.0, -2.0, 0.5)))
    view = api.bf16_view(wire)
    assert view.dtype.name == "bfloat16" and view.astype(np.float32).tolist() == [1.0, -2.0, 0.5]
    wire[0:2] = b"\x00\x40"  # 2.0: the view sees the change
    assert float(view[0]) == 2.0
    half = api.f16_view(memoryview(b"\x00" + api.encode_activation(2, 1, 2, f32(1.5, -3.0)))[1:])
    assert half.dtype == np.float16 and half.tolist() == [1.5, -3.0]
    with pytest.raises(InvalidDataError, match="^activation payload size mismatch$"):
        api.f16_view(b"\x00\x01\x02")
    for view_of in (api.bf16_view, api.f16_view):  # the codec functions' refusals, not numpy's
        with pytest.raises(InvalidInputError, match="^payload must not be an array of Python objects$"):
            view_of(np.array([1, 2], dtype=object))
        with pytest.raises(InvalidInputError, match="^payload must be a C-contiguous buffer$"):
            view_of(np.zeros((4, 4), np.uint8)[:, ::2])


def test_package_reexports_and_flag_mapping():
    for name in ("encode_activation", "decode_activation", "select_lossless_codec", "bf16_view", "is_f16_exact"):
        assert getattr(skippy_wire, name) is getattr(api, name)
    assert api.activation_state_flags_from_frame_flags(0b111 | 1 << 9) == 0x1C0
    assert api.activation_frame_flags_from_state_flags(0x1C0 | 1) == 0b111
    assert api.activation_payload_multiplier_from_state_flags(0x100) == 2


def test_expected_implementation_is_live():
    """The compiled kernels are live unless the twin was asked for (zstandard's habit)."""
    module = api.kernels()
    if IMPLEMENTATION == "cython":
        assert module.__name__ == "skippy_wire.wire._codec" and module.__file__.endswith((".so", ".pyd"))
    else:
        assert module.__name__ == "skippy_wire.wire._reference.codec"
    assert module is kernel_module("codec")
