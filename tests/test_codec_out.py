"""``encode_activation(..., out=buf)``: encoding into a caller's buffer gives the bytes
of the allocating path, at the start of ``out``, in every buffer kind; bad buffers raise
the same InvalidInputError text from both implementations; upstream errors keep their
text and order."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

import skippy_wire.wire.codec as api
from skippy_wire._impl import IMPLEMENTATION, kernel_module
from skippy_wire.errors import InvalidDataError, InvalidInputError, WireError

IMPLS = ["python"] if IMPLEMENTATION == "python" else ["cython", "python"]
both_impls = pytest.mark.skipif(IMPLEMENTATION != "cython", reason="parity needs both implementations")

CODECS = (1, 2, 3, 4)
# (token_count, n_embd, state_flags): plain, both sideband flags (rows doubled), a flag
# that does not double, an empty frame and a one-column frame.
SHAPES = [(1, 8, 0), (3, 16, 0x40), (2, 5, 0x100), (2, 3, 0x80), (0, 4, 0x140), (4, 1, 0)]
SENTINEL = 0xA5


def _payload(tokens, n_embd, flags, seed=0):
    rows = tokens * (2 if flags & 0x140 else 1)
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, n_embd), dtype=np.float32) * 4).astype(np.float32)


def _outcome(fn, *args, **kwargs):
    try:
        result = fn(*args, **kwargs)
    except (WireError, TypeError) as exc:
        return ("error", type(exc).__name__, str(exc))
    return ("ok", bytes(result))


def _buffers(size):
    """(name, buffer, raw byte view of its memory) for every supported kind."""
    ba = bytearray([SENTINEL]) * size
    big = bytearray([SENTINEL]) * (size + 13)
    u8 = np.full(size, SENTINEL, dtype=np.uint8)
    f32 = np.zeros((size + 3) // 4 + 2, dtype=np.float32)  # byte length counts
    f32.view(np.uint8)[:] = SENTINEL
    bf16 = np.zeros((size + 1) // 2 + 1, dtype=ml_dtypes.bfloat16)  # no buffer format
    bf16.view(np.uint8)[:] = SENTINEL
    grid = np.full((2, size + 1), SENTINEL, dtype=np.uint8)  # 2-D, C-contiguous
    backing = bytearray([SENTINEL]) * (size + 8)
    mv = memoryview(backing)[3 : 3 + size + 2]  # misaligned start, writable slice
    return [
        ("bytearray", ba, memoryview(ba)),
        ("bytearray+13", big, memoryview(big)),
        ("uint8", u8, memoryview(u8)),
        ("float32", f32, memoryview(f32.view(np.uint8))),
        ("bfloat16", bf16, memoryview(bf16.view(np.uint8))),
        ("uint8 2-D", grid, memoryview(grid.reshape(-1))),
        ("memoryview @3", mv, mv),
    ]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(hex, s)))
def test_out_equals_bytes_result_in_every_buffer_kind(codec_impl, codec, shape):
    tokens, n_embd, flags = shape
    x = _payload(tokens, n_embd, flags)
    want = codec_impl.encode_activation(codec, tokens, n_embd, x, flags)
    assert isinstance(want, bytes)
    size = codec_impl.activation_wire_bytes(codec, tokens, n_embd, flags)
    assert len(want) == size
    for name, buf, raw in _buffers(size):
        got = codec_impl.encode_activation(codec, tokens, n_embd, x, flags, out=buf)
        assert isinstance(got, memoryview), name
        assert (got.format, got.ndim, got.nbytes, got.readonly) == ("B", 1, size, False), name
        assert bytes(got) == want, name
        assert bytes(raw[:size]) == want, name  # written at the start of out ...
        assert set(bytes(raw[size:])) <= {SENTINEL}, name  # ... and nothing after it
        if size:
            got[0] ^= 0xFF  # the result is a view of out's memory, not a copy
            assert raw[0] == want[0] ^ 0xFF, name


def test_out_buffer_is_reusable(codec_impl):
    buf = bytearray(64)
    for seed in range(3):
        x = _payload(2, 8, 0, seed)
        got = codec_impl.encode_activation(3, 2, 8, x, 0, out=buf)
        assert bytes(got) == codec_impl.encode_activation(3, 2, 8, x, 0)


def _framed_payload():
    """A 2x8 payload inside a larger array, so that an out overlapping it can be big enough."""
    backing = np.zeros(64, dtype=np.float32)
    backing[:16] = _payload(2, 8, 0).reshape(-1)
    return backing[:16], backing


def _bad_outs(x, backing, size):
    ro = np.zeros(size, dtype=np.uint8)
    ro.flags.writeable = False
    return [
        (bytes(size), "out must be a writable buffer"),
        (memoryview(bytearray(size)).toreadonly(), "out must be a writable buffer"),
        (ro, "out must be a writable buffer"),
        (np.zeros(2 * size + 2, dtype=np.uint8)[::2], "out must be a C-contiguous buffer"),
        (memoryview(bytearray(2 * size + 2))[::2], "out must be a C-contiguous buffer"),
        (np.zeros((size + 1, 2), dtype=np.uint8, order="F"), "out must be a C-contiguous buffer"),
        (bytearray(size - 1), f"out buffer too small: {size - 1} bytes for an encoded size of {size} bytes"),
        (np.zeros(1, dtype=np.float32), f"out buffer too small: 4 bytes for an encoded size of {size} bytes"),
        (np.zeros(size, dtype=object), "out must not be an array of Python objects"),
        (x, "out must not overlap the payload"),
        (backing.view(np.uint8)[4:], "out must not overlap the payload"),
        (backing.view(np.uint8)[60:], "out must not overlap the payload"),
    ]


@pytest.mark.parametrize("codec", CODECS)
def test_bad_out_raises_invalid_input_and_writes_nothing(codec_impl, codec):
    x, backing = _framed_payload()
    before = backing.tobytes()
    size = codec_impl.activation_wire_bytes(codec, 2, 8, 0)
    for out, text in _bad_outs(x, backing, size):
        with pytest.raises(InvalidInputError) as info:
            codec_impl.encode_activation(codec, 2, 8, x, 0, out=out)
        assert str(info.value) == text, type(out)
    assert backing.tobytes() == before  # overlap was refused before any write
    # Adjacent but not overlapping is fine.
    got = codec_impl.encode_activation(codec, 2, 8, x, 0, out=backing.view(np.uint8)[64:])
    assert bytes(got) == codec_impl.encode_activation(codec, 2, 8, x, 0)
    with pytest.raises(TypeError):
        codec_impl.encode_activation(codec, 2, 8, x, 0, out=12)


@both_impls
@pytest.mark.parametrize("codec", CODECS)
def test_both_impls_give_identical_out_errors(codec):
    cy, py = kernel_module("codec", "cython"), kernel_module("codec", "python")
    x, backing = _framed_payload()
    size = cy.activation_wire_bytes(codec, 2, 8, 0)
    for (out_a, _), (out_b, _) in zip(_bad_outs(x, backing, size), _bad_outs(x, backing, size)):
        a = _outcome(cy.encode_activation, codec, 2, 8, x, 0, out=out_a)
        b = _outcome(py.encode_activation, codec, 2, 8, x, 0, out=out_b)
        assert a == b and a[0] == "error"
    # A non-buffer is a TypeError in both, as for payloads (CPython words it per caller).
    for k in (cy, py):
        with pytest.raises(TypeError):
            k.encode_activation(codec, 2, 8, x, 0, out=12)


def _bits(words):
    return np.array(words, dtype=np.uint32).view(np.float32)


# Upstream errors, with any out (even a bad one), keep their text: out is checked only
# where the allocating path would allocate.
UPSTREAM = [
    (1, 2, 8, np.zeros(15, np.float32), "F32 activation payload size mismatch"),
    (3, -1, 8, np.zeros(0, np.float32), "negative activation dimensions"),
    (5, 2, 8, np.zeros(16, np.float32), "unknown stage activation codec"),
    (4, 2, 8, _bits([0x7F800000] + [0] * 15), "activation values must be finite"),
    (4, 2, 8, _bits([0x7FC00000] * 16), "activation values must be finite"),
]


@pytest.mark.parametrize("case", UPSTREAM, ids=lambda c: c[4])
def test_upstream_errors_come_before_out_checks(codec_impl, case):
    codec, tokens, n_embd, x, text = case
    for out in (None, bytearray(1024), bytes(1), bytearray(0)):
        with pytest.raises(InvalidDataError) as info:
            codec_impl.encode_activation(codec, tokens, n_embd, x, 0, out=out)
        assert str(info.value) == text


@pytest.mark.parametrize("codec,word,text", [
    (2, 0x7F800000, "activation values must be finite"),
    (3, 0xFFC00000, "activation values must be finite"),
    (2, 0x47800000, "F16 activation value is out of range"),
    (3, 0x7F7FFFFF, "BF16 activation value is out of range"),
])
def test_half_value_errors_follow_out_checks(codec_impl, codec, word, text):
    """F16/BF16 check values while converting, so a bad out is reported first; with a
    good out the value error is unchanged (out may then be partially written)."""
    x = _bits([0] * 15 + [word])
    with pytest.raises(InvalidInputError, match="out buffer too small: 1 bytes"):
        codec_impl.encode_activation(codec, 2, 8, x, 0, out=bytearray(1))
    with pytest.raises(InvalidDataError) as info:
        codec_impl.encode_activation(codec, 2, 8, x, 0, out=bytearray(32))
    assert str(info.value) == text


def test_public_wrapper(impl, monkeypatch):
    monkeypatch.setattr(api, "_kernels", kernel_module("codec", impl))
    x = _payload(3, 8, 0x40)
    want = api.encode_activation(api.ActivationCodec(3), 3, 8, x, 0x40)
    assert isinstance(want, bytes)
    buf = np.empty(len(want) + 7, dtype=np.uint8)
    got = api.encode_activation(3, 3, 8, x, 0x40, out=buf)
    assert isinstance(got, memoryview) and bytes(got) == want
    with pytest.raises(InvalidInputError, match="writable"):
        api.encode_activation(3, 3, 8, x, 0x40, out=want)


f32_words = st.one_of(
    st.sampled_from([0, 0x80000000, 1, 0x3F800000, 0x477FEFFF, 0x477FF000, 0x7F7FFFFF, 0x7F800000, 0x7FC00000]),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**16 - 1).map(lambda h: h << 16),
)


@st.composite
def cases(draw):
    tokens = draw(st.integers(-1, 4))
    n_embd = draw(st.integers(0, 6))
    fl = draw(st.sampled_from([0, 0x40, 0x80, 0x100, 0x140]))
    rows = max(tokens, 0) * (2 if fl & 0x140 else 1)
    count = max(rows * n_embd + draw(st.sampled_from([0, 0, 0, 1, -1])), 0)
    words = draw(st.lists(f32_words, min_size=count, max_size=count))
    payload = struct.pack(f"<{count}I", *words)
    out_len = draw(st.integers(0, 4 * rows * (n_embd + 4) + 8))
    offset = draw(st.integers(0, 3))
    return draw(st.integers(0, 5)), tokens, n_embd, fl, payload, out_len, offset


@given(case=cases())
@example(case=(4, 1, 1, 0, b"\xff\xff\x7f\x7f", 0, 0))  # S8 sizes out before it range-checks
def test_out_parity_with_bytes_path_and_across_impls(case):
    codec, tokens, n_embd, fl, payload, out_len, offset = case
    seen = []
    for name in IMPLS:
        k = kernel_module("codec", name)
        backing = bytearray([SENTINEL]) * (out_len + offset)
        out = memoryview(backing)[offset:]
        got = _outcome(k.encode_activation, codec, tokens, n_embd, payload, fl, out=out)
        plain = _outcome(k.encode_activation, codec, tokens, n_embd, payload, fl)
        if got[0] == "ok":
            assert plain == got
            assert backing[offset : offset + len(got[1])] == got[1]
            assert set(backing[offset + len(got[1]) :]) <= {SENTINEL}
            assert set(backing[:offset]) <= {SENTINEL}
        elif got[1] == "InvalidInputError" and got[2].startswith("out buffer too small"):
            assert plain[0] == "ok" or codec in (2, 3, 4)  # F16/BF16/S8 check values after out
            if plain[0] == "ok":
                assert out_len < len(plain[1])
        else:
            assert got == plain  # upstream errors unchanged
        seen.append(got)
    assert all(s == seen[0] for s in seen)


def test_threads_encode_into_their_own_buffers(codec_impl, impl):
    # 64 x 1024 f32 = 256 KiB, above the compiled GIL-release threshold; the twin is slow.
    rows, cols = (64, 1024) if impl == "cython" else (2, 64)
    jobs = [(codec, _payload(rows, cols, 0, seed)) for seed in range(4) for codec in CODECS]
    want = [codec_impl.encode_activation(c, rows, cols, x, 0) for c, x in jobs]
    buffers = [bytearray(len(w)) for w in want]

    def work(i):
        codec, x = jobs[i]
        return bytes(codec_impl.encode_activation(codec, rows, cols, x, 0, out=buffers[i]))

    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(3):
            assert list(pool.map(work, range(len(jobs)))) == want
            assert [bytes(b) for b in buffers] == want
