"""Property fuzzing of the codec kernels: random inputs never crash, raise only our error
classes, and the compiled and reference kernels agree on every input, including the
error class and its exact text.

Budget: the ``HYPOTHESIS_PROFILE`` profiles of conftest.py (default 200 examples each).
The exhaustive f32 sweep is ``skippy-wire verify-exhaustive`` (tests/test_verify.py).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from skippy_wire._impl import IMPLEMENTATION, kernel_module
from skippy_wire.errors import WireError

pytestmark = pytest.mark.skipif(IMPLEMENTATION == "python", reason="parity needs the compiled kernels")

SPECIAL_BITS = [0x00000000, 0x80000000, 0x00000001, 0x007FFFFF, 0x00800000, 0x3F800000, 0xBF800000,
                0x3F808000, 0x3F818000, 0x33000000, 0x33000001, 0x387FE000, 0x38800000, 0x477FE000,
                0x477FEFFF, 0x477FF000, 0x47800000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000,
                0xFF800000, 0x7F800001, 0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x3E0D1A34]
CODECS = st.sampled_from([1, 2, 3, 4]) | st.integers(-2, 7)
FLAGS = st.sampled_from([0, 0x40, 0x80, 0x100, 0x140, 0x1C0, 0x7FFFFFFF, -1]) | st.integers(-(2**31), 2**31 - 1)
DIM = st.integers(0, 6) | st.sampled_from([-1, -(2**31), 2**31 - 1, 2**30, 2**28, 1 << 27])
f32_bits = st.sampled_from(SPECIAL_BITS) | st.integers(0, 2**32 - 1) | st.integers(0x3F000000, 0x40000000)


def _kernels():
    return kernel_module("codec", "cython"), kernel_module("codec", "python")


def outcome(fn, *args):
    """("ok", canonical result) or ("err", class name, text); any non-WireError fails."""
    try:
        value = fn(*args)
    except WireError as exc:
        return ("err", type(exc).__name__, str(exc))
    except (TypeError, OverflowError) as exc:  # argument-type errors must agree too
        return ("typeerr", type(exc).__name__)
    if isinstance(value, np.ndarray):
        return ("ok", value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (bytes, bytearray, memoryview)):
        return ("ok", bytes(value))
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], (bytes, bytearray, memoryview)):
        return ("ok", int(value[0]), bytes(value[1]))
    return ("ok", value)


def both(name, *args):
    cy, py = _kernels()
    a, b = outcome(getattr(cy, name), *args), outcome(getattr(py, name), *args)
    assert a == b, f"{name}{args!r}: cython {a!r} != python {b!r}"
    return a


@st.composite
def activation_case(draw):
    """A shape, flags and a payload that usually (not always) has the right length."""
    codec = draw(CODECS)
    t, n = draw(DIM), draw(DIM)
    flags = draw(FLAGS)
    elements = t * n * (2 if flags & 0x140 else 1) if 0 <= t <= 6 and 0 <= n <= 6 else draw(st.integers(0, 8))
    count = elements + draw(st.sampled_from([0, 0, 0, 0, -1, 1]))
    values = draw(st.lists(f32_bits, min_size=max(count, 0), max_size=max(count, 0)))
    payload = np.array(values, dtype="<u4").tobytes()
    if draw(st.integers(0, 9)) == 0:
        payload = payload[: draw(st.integers(0, len(payload)))] + draw(st.binary(max_size=3))
    return codec, t, n, flags, payload


@given(activation_case())
@example((2, 1, 4, 0, np.array([0x3F800000, 0x3F801000, 0x3F803000, 0x80000000], "<u4").tobytes()))
@example((3, 1, 1, 0, np.array([0x7F7F8000], "<u4").tobytes()))
@example((2, 1, 1, 0, np.array([0x477FF000], "<u4").tobytes()))
@example((4, 1, 2, 0, np.array([0x7F7FFFFF, 0xFF7FFFFF], "<u4").tobytes()))
def test_encode_parity(case):
    codec, t, n, flags, payload = case
    both("encode_activation", codec, t, n, payload, flags)
    both("encode_f32_activation_payload", t, n, payload, flags)
    both("activation_shape", t, n, flags)
    both("activation_f32_bytes", t, n, flags)
    both("activation_wire_bytes", codec, t, n, flags)


@given(activation_case(), st.lists(st.sampled_from([1, 2, 3, 4]), max_size=5))
def test_select_parity(case, permitted):
    _, t, n, flags, payload = case
    both("select_lossless_codec", t, n, payload, flags, permitted)
    both("select_and_encode_lossless", t, n, payload, flags, permitted)
    both("is_bf16_exact", payload[: len(payload) // 4 * 4])
    both("is_f16_exact", payload[: len(payload) // 4 * 4])


@given(CODECS, DIM, DIM, FLAGS, st.binary(max_size=80))
def test_decode_random_bytes_parity(codec, t, n, flags, wire):
    both("decode_activation", codec, t, n, wire, flags)


@given(st.integers(1, 4), st.integers(0, 4), st.integers(1, 5), st.sampled_from([0, 0x40]), st.data())
def test_decode_right_length_parity(codec, t, n, flags, data):
    """Wire of exactly the right length: the interesting path (non-finite, -128, scales)."""
    cy, _ = _kernels()
    try:
        size = cy.activation_wire_bytes(codec, t, n, flags)
    except WireError:
        return
    wire = data.draw(st.binary(min_size=size, max_size=size))
    both("decode_activation", codec, t, n, wire, flags)


@given(st.lists(f32_bits, max_size=64))
def test_raw_conversion_parity(values):
    cy, py = _kernels()
    bits = np.array(values, dtype=np.uint32)
    for name in ("f32_bits_to_bf16_bits", "f32_bits_to_f16_bits"):
        assert np.array_equal(getattr(cy, name)(bits), getattr(py, name)(bits)), name
    halves = (bits & np.uint32(0xFFFF)).astype(np.uint16)
    for name in ("bf16_bits_to_f32_bits", "f16_bits_to_f32_bits"):
        assert np.array_equal(getattr(cy, name)(halves), getattr(py, name)(halves)), name


@pytest.mark.parametrize("buffer_kind", ["bytes", "bytearray", "memoryview", "ndarray-u8", "ndarray-f32", "misaligned"])
def test_buffer_kinds_parity(buffer_kind):
    values = np.array([0x3F800000, 0x3F801000, 0xC0000000, 0x80000000], dtype="<u4")
    raw = values.tobytes()
    if buffer_kind == "bytes":
        payload = raw
    elif buffer_kind == "bytearray":
        payload = bytearray(raw)
    elif buffer_kind == "memoryview":
        payload = memoryview(raw)
    elif buffer_kind == "ndarray-u8":
        payload = np.frombuffer(raw, dtype=np.uint8)
    elif buffer_kind == "ndarray-f32":
        payload = values.view(np.float32)
    else:
        payload = memoryview(bytearray(b"\0" + raw))[1:]
    for codec in (1, 2, 3, 4):
        assert both("encode_activation", codec, 1, 4, payload, 0)[0] == "ok"
