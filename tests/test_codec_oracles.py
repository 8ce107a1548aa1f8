"""Random f32 bit patterns (uint32 viewed as float32, so NaN, inf and subnormals are
covered) against the reference encoders: numpy float16 and ml_dtypes bfloat16.  Finite
values must agree bit for bit; NaN is checked by its own policy, not by the oracles
(they disagree on NaN bits, see docs/numerics.md).  The compiled kernels are compared
on both their SIMD and portable paths."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from skippy_wire._impl import IMPLEMENTATION
from skippy_wire.errors import InvalidDataError


def _random_bits(seed: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    b = rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
    # Bias a third of the samples to the f16 range (exponents 100..145) where rounding
    # is interesting, and a few to the exact boundaries.
    k = n // 3
    e = rng.integers(100, 146, size=k, dtype=np.uint32)
    b[:k] = (b[:k] & 0x807FFFFF) | (e << 23)
    return b


def _hex_mismatch(got, want, inputs):
    bad = np.flatnonzero(got != want)
    if bad.size == 0:
        return None
    i = bad[0]
    return f"{bad.size} mismatches; first input {int(inputs[i]):#010x}: got {int(got[i]):#06x}, want {int(want[i]):#06x}"


@pytest.fixture(params=["simd", "portable"])
def simd_mode(request, impl):
    """Run compiled tests once per kernel path (the twin has one path; it runs twice)."""
    if impl != "cython":
        yield request.param
        return
    from skippy_wire.wire import _codec as _codec

    previous = _codec._set_simd(request.param == "simd")
    yield request.param
    _codec._set_simd(previous)


def _sample_size(impl):
    return 200_000 if impl == "cython" else 10_000


def test_raw_f16_conversion_matches_numpy(codec_impl, impl, simd_mode):
    b = _random_bits(1, _sample_size(impl))
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    with np.errstate(over="ignore", invalid="ignore"):
        want = b.view(np.float32).astype(np.float16).view(np.uint16)
    got = codec_impl.f32_bits_to_f16_bits(b)
    assert _hex_mismatch(got[~nan], want[~nan], b[~nan]) is None
    assert np.array_equal(got[nan], (((b[nan] >> 16) & 0x8000) | 0x7C01).astype(np.uint16))


def test_raw_bf16_conversion_matches_ml_dtypes(codec_impl, impl, simd_mode):
    b = _random_bits(2, _sample_size(impl))
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    with np.errstate(invalid="ignore"):
        want = b.view(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    got = codec_impl.f32_bits_to_bf16_bits(b)
    assert _hex_mismatch(got[~nan], want[~nan], b[~nan]) is None
    assert np.array_equal(got[nan], ((b[nan] >> 16) | 0x40).astype(np.uint16))


def _encodable(b: np.ndarray, codec: int) -> np.ndarray:
    finite = (b & 0x7F800000) != 0x7F800000
    b = b[finite]
    with np.errstate(over="ignore"):
        h = b.view(np.float32).astype(np.float16 if codec == 2 else ml_dtypes.bfloat16).view(np.uint16)
    limit = 0x7C00 if codec == 2 else 0x7F80
    return b[(h & limit) != limit]


@pytest.mark.parametrize("codec", [2, 3])
def test_encode_matches_oracle_on_finite_in_range_values(codec_impl, impl, simd_mode, codec):
    b = _encodable(_random_bits(3 + codec, _sample_size(impl)), codec)
    wire = codec_impl.encode_activation(codec, b.size, 1, b, 0)
    with np.errstate(over="ignore"):
        want = b.view(np.float32).astype(np.float16 if codec == 2 else ml_dtypes.bfloat16)
    got = np.frombuffer(wire, dtype="<u2")
    assert _hex_mismatch(got, want.view(np.uint16), b) is None
    # Misaligned input must not change a byte.
    shifted = bytearray(b.nbytes + 1)
    shifted[1:] = b.tobytes()
    assert codec_impl.encode_activation(codec, b.size, 1, memoryview(shifted)[1:], 0) == wire


@pytest.mark.parametrize("codec", [2, 3])
def test_decode_matches_oracle(codec_impl, impl, simd_mode, codec):
    rng = np.random.default_rng(10 + codec)
    h = rng.integers(0, 1 << 16, size=_sample_size(impl), dtype=np.uint32).astype(np.uint16)
    limit = 0x7C00 if codec == 2 else 0x7F80
    h = h[(h & limit) != limit]
    out = codec_impl.decode_activation(codec, h.size, 1, h.astype("<u2").tobytes(), 0)
    want = h.view(np.float16 if codec == 2 else ml_dtypes.bfloat16).astype(np.float32)
    assert _hex_mismatch(out.view(np.uint32), want.view(np.uint32), h) is None


def test_exactness_scans_match_their_definition(codec_impl, impl, simd_mode):
    """is_*_exact means decode(encode(x)) == x bit for bit, NaN/inf never exact."""
    b = _random_bits(20, 4000)
    # Mix in values that are exact, so both answers occur.
    rng = np.random.default_rng(21)
    exact16 = rng.integers(0, 0x7C00, size=4000, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    for chunk in np.array_split(np.concatenate([b, exact16, exact16 & 0xFFFF0000]), 400):
        finite = bool(np.all((chunk & 0x7F800000) != 0x7F800000))
        with np.errstate(over="ignore"):
            f16 = chunk.view(np.float32).astype(np.float16).astype(np.float32).view(np.uint32)
        want16 = finite and bool(np.array_equal(f16, chunk))
        want_bf = finite and bool(np.all((chunk & 0xFFFF) == 0))
        assert codec_impl.is_f16_exact(chunk) == want16
        assert codec_impl.is_bf16_exact(chunk) == want_bf
        choice = codec_impl.select_lossless_codec(chunk.size, 1, chunk, 0, [1, 2, 3])
        assert choice == (3 if want_bf else 2 if want16 else 1)


@pytest.mark.skipif(IMPLEMENTATION != "cython", reason="only the compiled module has two paths")
def test_simd_and_portable_paths_agree_on_long_buffers():
    """The SIMD loops process 8 values at a time: lengths around those blocks, errors in
    the vector body and in the scalar tail, exactness failing in any block."""
    from skippy_wire.wire import _codec as _codec

    rng = np.random.default_rng(30)
    for n in (1, 7, 8, 9, 15, 16, 17, 63, 8191, 8192, 8193, 20001):
        b = _random_bits(int(rng.integers(1 << 30)), n)
        cases = [b, b & 0xFFFF0000, _encodable(b, 2)]
        for pos in {0, n // 2, n - 1}:
            c = (b & 0xFFFF0000).copy()
            c[pos] = 0x7F7FFFFF  # out of range for both
            cases.append(c)
        for data in cases:
            results = []
            for simd in (True, False):
                previous = _codec._set_simd(simd)
                try:
                    row = []
                    for codec in (2, 3):
                        try:
                            row.append(_codec.encode_activation(codec, data.size, 1, data, 0))
                        except InvalidDataError as exc:
                            row.append(str(exc))
                    row.append(_codec.select_and_encode_lossless(data.size, 1, data, 0, [1, 2, 3]))
                    row.append((_codec.is_bf16_exact(data), _codec.is_f16_exact(data)))
                    halves = (data >> 16).astype(np.uint16)
                    for codec in (2, 3):
                        try:
                            row.append(_codec.decode_activation(codec, halves.size, 1, halves, 0).tobytes())
                        except InvalidDataError as exc:
                            row.append(str(exc))
                    results.append(row)
                finally:
                    _codec._set_simd(previous)
            assert results[0] == results[1], f"n={n}"


def _s8_rows(seed: int, cols: int) -> np.ndarray:
    """Rows that stress S8: random scales, exact half-way quotients, tiny subnormal rows,
    zero rows, and rows whose f32(q) * scale overflows at varying positions."""
    rng = np.random.default_rng(seed)
    rows = [rng.standard_normal(cols).astype(np.float32) * np.float32(10.0 ** rng.integers(-30, 30))]
    ties = (rng.integers(-254, 255, cols) / 2).astype(np.float32)
    ties[0] = 127.0  # scale exactly 1.0, so every k + 0.5 is a tie
    rows += [ties, np.zeros(cols, np.float32), np.arange(cols, dtype=np.uint32).view(np.float32)]
    over = rng.standard_normal(cols).astype(np.float32)
    over[rng.integers(cols)] = np.float32(3.4028235e38)
    rows.append(over)
    return np.stack(rows)


@pytest.mark.parametrize("cols", [1, 3, 4, 5, 8, 13, 64])
def test_s8_paths_and_twin_agree(cols):
    """S8 on the SIMD path (vroundpd), the portable path and the reference twin."""
    from skippy_wire._impl import kernel_module

    ref = kernel_module("codec", "python")
    kernels = [("python", ref)]
    if IMPLEMENTATION == "cython":
        kernels.append(("cython", kernel_module("codec", "cython")))
    for seed in range(6):
        data = _s8_rows(seed, cols)
        for r in range(data.shape[0]):
            row = np.ascontiguousarray(data[r])
            results = set()
            for name, k in kernels:
                modes = [True, False] if name == "cython" else [None]
                for mode in modes:
                    previous = k._set_simd(mode) if mode is not None else None
                    try:
                        results.add(k.encode_activation(4, 1, cols, row, 0))
                    except InvalidDataError as exc:
                        results.add(str(exc))
                    finally:
                        if mode is not None:
                            k._set_simd(previous)
            assert len(results) == 1, (cols, seed, r, results)
