"""Both implementations agree on random input: the same bytes / decoded bits, or the
same error class and exact text.  Random shapes, flags, codecs (valid or not), payload
lengths near and off the expected size, and values drawn from special f32 classes."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

import pytest

from skippy_wire._impl import IMPLEMENTATION, kernel_module
from skippy_wire.errors import WireError

pytestmark = pytest.mark.skipif(IMPLEMENTATION != "cython", reason="parity needs both implementations")

SPECIAL = [0, 0x80000000, 1, 0x807FFFFF, 0x00800000, 0x3F800000, 0x3F801000, 0x3F800FFF, 0x3F808000, 0x477FEFFF,
           0x477FF000, 0x47800000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000,
           0x7F800001, 0xFFFFFFFF, 0x33000000, 0x33000001, 0x387FC000, 0x38800000, 0x3E0D1A34]

f32_words = st.one_of(
    st.sampled_from(SPECIAL),
    st.integers(0, 2**32 - 1),
    st.integers(0x33000000, 0x47800000).map(lambda b: b & ~0x1FFF),  # f16-exact-ish
    st.integers(0, 2**16 - 1).map(lambda h: h << 16),  # bf16-exact
    st.integers(-127, 127).map(lambda q: struct.unpack("<I", struct.pack("<f", q / 8))[0]),
)
flags = st.one_of(st.sampled_from([0, 0x40, 0x80, 0x100, 0x140, 0x1C0, -1, -(2**31)]), st.integers(-(2**31), 2**31 - 1))
codec_ids = st.one_of(st.integers(1, 4), st.sampled_from([0, 5, -1]))


def _outcome(fn, *args):
    try:
        result = fn(*args)
    except WireError as exc:
        return ("error", type(exc).__name__, str(exc))
    if isinstance(result, np.ndarray):
        return ("array", result.dtype.str, result.view(np.uint32).tolist())
    return ("ok", result)


def _both(name, *args):
    cy = getattr(kernel_module("codec", "cython"), name)
    py = getattr(kernel_module("codec", "python"), name)
    a, b = _outcome(cy, *args), _outcome(py, *args)
    assert a == b, f"{name}{args!r:.300}: cython {a!r:.300} python {b!r:.300}"
    return a


@st.composite
def frames(draw):
    tokens = draw(st.integers(-2, 5))
    n_embd = draw(st.integers(-2, 6))
    fl = draw(flags)
    rows = max(tokens, 0) * (2 if fl & 0x140 else 1)
    count = max(rows * max(n_embd, 0) + draw(st.sampled_from([0, 0, 0, 0, 1, -1])), 0)
    words = draw(st.lists(f32_words, min_size=count, max_size=count))
    payload = struct.pack(f"<{count}I", *words) + draw(st.sampled_from([b"", b"", b"", b"\x01"]))
    return tokens, n_embd, fl, payload


@given(frame=frames(), codec=codec_ids)
def test_encode_and_sizes_agree(frame, codec):
    tokens, n_embd, fl, payload = frame
    _both("activation_shape", tokens, n_embd, fl)
    _both("activation_f32_bytes", tokens, n_embd, fl)
    _both("activation_wire_bytes", codec, tokens, n_embd, fl)
    result = _both("encode_activation", codec, tokens, n_embd, payload, fl)
    _both("encode_f32_activation_payload", tokens, n_embd, payload, fl)
    if result[0] == "ok":
        _both("decode_activation", codec, tokens, n_embd, result[1], fl)


@given(frame=frames(), permitted=st.lists(codec_ids, max_size=5))
def test_selection_agrees(frame, permitted):
    tokens, n_embd, fl, payload = frame
    chosen = _both("select_lossless_codec", tokens, n_embd, payload, fl, permitted)
    fused = _both("select_and_encode_lossless", tokens, n_embd, payload, fl, permitted)
    if chosen[0] == "ok":
        assert fused[1][0] == chosen[1]
    _both("is_bf16_exact", payload)
    _both("is_f16_exact", payload)


@given(codec=codec_ids, tokens=st.integers(-1, 4), n_embd=st.integers(-1, 5), fl=flags, wire=st.binary(max_size=80))
def test_decode_of_arbitrary_bytes_agrees(codec, tokens, n_embd, fl, wire):
    _both("decode_activation", codec, tokens, n_embd, wire, fl)


@given(codec=st.integers(1, 4), tokens=st.integers(1, 3), n_embd=st.integers(1, 5), fl=flags, data=st.data())
def test_decode_of_right_sized_random_wire_agrees(codec, tokens, n_embd, fl, data):
    size = kernel_module("codec", "python").activation_wire_bytes(codec, tokens, n_embd, fl)
    wire = data.draw(st.binary(min_size=size, max_size=size))
    _both("decode_activation", codec, tokens, n_embd, wire, fl)


@given(words=st.lists(f32_words, max_size=40))
def test_raw_conversions_agree(words):
    b = np.array(words, dtype=np.uint32)
    for name in ("f32_bits_to_f16_bits", "f32_bits_to_bf16_bits"):
        cy = getattr(kernel_module("codec", "cython"), name)(b)
        py = getattr(kernel_module("codec", "python"), name)(b)
        assert cy.dtype == py.dtype == np.uint16 and cy.tolist() == py.tolist()
    h = (b & 0xFFFF).astype(np.uint16)
    for name in ("f16_bits_to_f32_bits", "bf16_bits_to_f32_bits"):
        cy = getattr(kernel_module("codec", "cython"), name)(h)
        py = getattr(kernel_module("codec", "python"), name)(h)
        assert cy.dtype == py.dtype == np.uint32 and cy.tolist() == py.tolist()


def test_a_masked_array_is_its_data_in_both_twins():
    """The compiled twin reads a masked array's exported data; the reference raised a
    ValueError reshaping its mask as bytes."""
    values = np.ma.array([1.0, 2.0], dtype=np.float32, mask=[False, True])
    outs = []
    for impl in ("cython", "python"):
        codec = kernel_module("codec", impl)
        assert bytes(codec.encode_activation(1, 1, 2, values, 0)) == values.data.tobytes()
        out = np.ma.zeros(8, dtype=np.uint8)
        codec.encode_activation(1, 1, 2, values.data, 0, out=out)
        outs.append(out.data.tobytes())
    assert outs == [values.data.tobytes()] * 2


@pytest.mark.parametrize("codec", [1, 2, 3, 4])
def test_the_reference_codec_holds_its_words_compactly(codec):
    # the reference twin held every value as a Python int in a list or tuple: about 40 times
    # a BF16 payload while decoding it, 10 GiB for a 256 MiB message
    values = np.linspace(-1, 1, 64 * 1024, dtype=np.float32)
    reference = kernel_module("codec", "python")
    wire = reference.encode_activation(codec, 64, 1024, values, 0)
    tracemalloc.start()
    try:
        reference.encode_activation(codec, 64, 1024, values, 0)
        encode_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        reference.decode_activation(codec, 64, 1024, wire, 0)
        decode_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert encode_peak < 4 * values.nbytes and decode_peak < 4 * values.nbytes, (encode_peak, decode_peak)
