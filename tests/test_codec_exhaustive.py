"""Exhaustive checks where the space is small: every 16-bit pattern, every f16 rounding
midpoint and its one-ulp neighbours, each sticky bit under the subnormal half-way points
(numpy test_half.py style).  The full 2^32 f32 sweep is behind ``-m slow``."""

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


@pytest.mark.slow
def test_every_f32_pattern_against_the_oracles():
    """All 2^32 f32 bit patterns through the compiled raw conversions and the portable
    scalar path: f16 vs numpy (NaN by the 0x7c01 policy), bf16 vs ml_dtypes (NaN by the
    keep-top-bits-and-quiet policy)."""
    import ml_dtypes

    from skippy_wire import _codec

    step = 1 << 24
    for start in range(0, 1 << 32, step):
        b = np.arange(start, start + step, dtype=np.uint64).astype(np.uint32)
        nan = (b & 0x7FFFFFFF) > 0x7F800000
        with np.errstate(over="ignore", invalid="ignore"):
            want16 = b.view(np.float32).astype(np.float16).view(np.uint16)
            want_bf = b.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
        want16 = np.where(nan, ((b >> 16) & 0x8000) | 0x7C01, want16).astype(np.uint16)
        want_bf = np.where(nan, (b >> 16) | 0x40, want_bf).astype(np.uint16)
        assert _first_mismatch(_codec.f32_bits_to_f16_bits(b), want16, b) is None
        assert _first_mismatch(_codec.f32_bits_to_bf16_bits(b), want_bf, b) is None
        # Encode path (finite values only), SIMD and portable alike.
        fin = b[~nan & ((b & 0x7F800000) != 0x7F800000)]
        f16_ok = fin[(want16[~nan & ((b & 0x7F800000) != 0x7F800000)] & 0x7C00) != 0x7C00]
        for simd in (True, False):
            previous = _codec._set_simd(simd)
            try:
                wire = _codec.encode_activation(2, f16_ok.size, 1, f16_ok, 0)
                with np.errstate(over="ignore"):
                    ref = f16_ok.view(np.float32).astype(np.float16).view(np.uint16)
                assert wire == ref.astype("<u2").tobytes()
            finally:
                _codec._set_simd(previous)
