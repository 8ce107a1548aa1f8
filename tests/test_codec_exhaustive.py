"""Exhaustive checks where the space is small: every 16-bit pattern, every f16 rounding
midpoint and its one-ulp neighbours, each sticky bit under the subnormal half-way points
(numpy test_half.py style).  ``-m slow`` adds every mantissa of the edge exponents on
both kernel paths; the full 2^32 sweep is ``python -m skippy_wire verify-exhaustive``."""

from __future__ import annotations

import numpy as np
import pytest

ALL16 = np.arange(65536, dtype=np.uint32).astype(np.uint16)


def _spec_f16_to_f32(h: np.ndarray) -> np.ndarray:
    """6.5 widening via numpy for finite patterns; inf/NaN as sign | 0x7f800000 | m << 13."""
    h = h.astype(np.uint16)
    out = h.view(np.float16).astype(np.float32).view(np.uint32).copy()
    special = (h & 0x7C00) == 0x7C00
    hs = h[special].astype(np.uint32)
    out[special] = ((hs & 0x8000) << 16) | 0x7F800000 | ((hs & 0x3FF) << 13)
    return out


def _first_mismatch(got, want, inputs):
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = bad[0]
        return f"{bad.size} mismatches; first input {int(inputs[i]):#x}: got {int(got[i]):#x}, want {int(want[i]):#x}"
    return None


def test_all_f16_patterns_widen_exactly(codec_impl):
    got = codec_impl.f16_bits_to_f32_bits(ALL16)
    assert _first_mismatch(got, _spec_f16_to_f32(ALL16), ALL16) is None


def test_all_bf16_patterns_widen_exactly(codec_impl):
    got = codec_impl.bf16_bits_to_f32_bits(ALL16)
    assert np.array_equal(got, ALL16.astype(np.uint32) << 16)


@pytest.mark.parametrize("codec,non_finite", [(2, 0x7C00), (3, 0x7F80)])
def test_decode_every_16bit_pattern(codec_impl, codec, non_finite):
    """Each pattern decoded alone: finite ones widen exactly, inf/NaN are rejected."""
    finite = ALL16[(ALL16 & non_finite) != non_finite]
    wire = finite.astype("<u2").tobytes()
    out = codec_impl.decode_activation(codec, finite.size, 1, wire, 0).view(np.uint32)
    want = _spec_f16_to_f32(finite) if codec == 2 else finite.astype(np.uint32) << 16
    assert _first_mismatch(out, want, finite) is None
    from skippy_wire.errors import InvalidDataError

    for h in ALL16[(ALL16 & non_finite) == non_finite][::7]:
        with pytest.raises(InvalidDataError, match="^activation payload contains non-finite value$"):
            codec_impl.decode_activation(codec, 2, 1, np.array([0x3C00, h], dtype="<u2").tobytes(), 0)


def _f16_midpoints() -> np.ndarray:
    """Every f32 half-way between adjacent positive finite f16 values (and up to inf),
    with its +-1 ulp neighbours, both signs."""
    h = np.arange(0x7C00, dtype=np.uint32).astype(np.uint16)
    lo = h.view(np.float16).astype(np.float64)
    hi = np.append(lo[1:], 65536.0)
    mid = ((lo + hi) / 2).astype(np.float32).view(np.uint32)  # exact: 11-bit values
    pts = np.concatenate([mid, mid - 1, mid + 1])
    pts = pts[(pts & 0x7F800000) != 0x7F800000]
    return np.concatenate([pts, pts | 0x80000000]).astype(np.uint32)


def _sticky_bits() -> np.ndarray:
    """Under the half-way point of each f16 subnormal: the half bit plus each lower bit."""
    out = []
    for e in range(102, 113):  # f32 exponents of the f16 subnormal range (and 2^-25)
        for m in range(0, 23):
            out.append((e << 23) | (1 << m))
            out.append((e << 23) | (1 << m) | 1)
            out.append((e << 23) | 0x7FFFFF ^ (1 << m))
    return np.array(out, dtype=np.uint32)


def test_f16_midpoints_and_sticky_bits_match_numpy(codec_impl):
    pts = np.concatenate([_f16_midpoints(), _sticky_bits()])
    with np.errstate(over="ignore"):
        want = pts.view(np.float32).astype(np.float16).view(np.uint16)
    got = codec_impl.f32_bits_to_f16_bits(pts)
    assert _first_mismatch(got, want, pts) is None


def test_bf16_midpoints_match_ml_dtypes(codec_impl):
    import ml_dtypes

    h = np.arange(0x7F80, dtype=np.uint32)
    mid = (h << 16) | 0x8000
    pts = np.concatenate([mid, mid - 1, mid + 1])
    pts = np.concatenate([pts, pts | 0x80000000]).astype(np.uint32)
    want = pts.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    got = codec_impl.f32_bits_to_bf16_bits(pts)
    assert _first_mismatch(got, want, pts) is None


#: f32 exponent fields where f16 rounding changes regime: the flush-to-zero edge (101,
#: 102), the subnormal/normal boundary (112, 113) and the overflow edge (142, 143).
#: The whole 2^32 space is `python -m skippy_wire verify-exhaustive` (skippy_wire/verify.py).
EDGE_EXPONENTS = (101, 102, 103, 112, 113, 142, 143)


@pytest.mark.slow
@pytest.mark.parametrize("exponent", EDGE_EXPONENTS)
def test_every_mantissa_at_the_edge_exponents(exponent):
    """All 2^24 patterns (both signs, every mantissa) of an edge exponent through the
    compiled raw conversions (portable formula) and the checked F16 encoder on both
    paths (F16C and portable): bit-identical to numpy / ml_dtypes for every input."""
    import ml_dtypes

    from skippy_wire.wire import _codec as _codec
    from skippy_wire.errors import InvalidDataError

    m = np.arange(1 << 23, dtype=np.uint32)
    b = np.concatenate([(exponent << 23) | m, 0x80000000 | (exponent << 23) | m]).astype(np.uint32)
    with np.errstate(over="ignore"):
        want16 = b.view(np.float32).astype(np.float16).view(np.uint16)
    want_bf = b.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    assert _first_mismatch(_codec.f32_bits_to_f16_bits(b), want16, b) is None
    assert _first_mismatch(_codec.f32_bits_to_bf16_bits(b), want_bf, b) is None
    ok = b[(want16 & 0x7C00) != 0x7C00]
    for simd in (True, False):
        previous = _codec._set_simd(simd)
        try:
            if ok.size:
                wire = np.frombuffer(_codec.encode_activation(2, ok.size, 1, ok, 0), dtype="<u2")
                assert _first_mismatch(wire, want16[(want16 & 0x7C00) != 0x7C00], ok) is None
                back = _codec.decode_activation(2, ok.size, 1, wire, 0).view(np.uint32)
                assert _first_mismatch(back, _spec_f16_to_f32(wire), wire) is None
            if ok.size < b.size:
                with pytest.raises(InvalidDataError, match="^F16 activation value is out of range$"):
                    _codec.encode_activation(2, b.size, 1, b, 0)
        finally:
            _codec._set_simd(previous)
