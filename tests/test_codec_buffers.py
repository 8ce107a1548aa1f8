"""Every codec over every buffer type (numcodecs check_encode_decode style): bytes,
bytearray, memoryview, array.array, ndarrays of any shape, misaligned and read-only
memory; wire payloads of any dtype, f32 input as f32 or raw bytes (other element types
are refused: tests/test_wire_types_audit.py).  Non-contiguous input raises
InvalidInputError from both implementations; objects without the buffer protocol raise
TypeError."""

from __future__ import annotations

import array
import mmap
import struct

import ml_dtypes
import numpy as np
import pytest

from skippy_wire.errors import InvalidInputError, UnexpectedEofError
from skippy_wire.wire import frame

VALUES = [1.0, -2.5, 0.5, -0.0, 3.0, 0.125, 1024.0, -7.0]
PAYLOAD = struct.pack("<8f", *VALUES)
T, N = 2, 4


def _buffers(raw: bytes, typed: bool = True):
    """The same bytes as different exporters, keyed by a readable name; ``typed=False``
    leaves out the element types that are not f32 or raw bytes."""
    shifted = bytearray(len(raw) + 3)
    shifted[3:] = raw
    arr = np.frombuffer(raw, dtype=np.uint8).copy()
    yield "bytes", raw
    yield "bytearray", bytearray(raw)
    yield "memoryview", memoryview(raw)
    yield "memoryview-misaligned", memoryview(shifted)[3:]
    yield "ndarray-u8", arr
    yield "ndarray-readonly", np.frombuffer(raw, dtype=np.uint8)
    if len(raw) % 4 == 0:
        yield "array-f", array.array("f", struct.unpack(f"<{len(raw) // 4}f", raw))
        yield "ndarray-f32", arr.view(np.float32)
        yield "ndarray-f32-2d", arr.view(np.float32).reshape(2, -1)
        yield "memoryview-f32-2d", memoryview(arr.view(np.float32).reshape(2, -1))
    if len(raw) % 2 == 0 and typed:
        yield "ndarray-bf16", arr.view(ml_dtypes.bfloat16)  # not exportable with a format
        yield "ndarray-f16", arr.view(np.float16)
        yield "array-H", array.array("H", struct.unpack(f"<{len(raw) // 2}H", raw))


@pytest.mark.parametrize("codec", [1, 2, 3, 4])
def test_every_buffer_type_encodes_and_decodes_identically(codec_impl, codec):
    reference = codec_impl.encode_activation(codec, T, N, PAYLOAD, 0)
    for name, buf in _buffers(PAYLOAD, typed=False):
        assert codec_impl.encode_activation(codec, T, N, buf, 0) == reference, name
    decoded = codec_impl.decode_activation(codec, T, N, reference, 0)
    for name, buf in _buffers(reference):
        assert codec_impl.decode_activation(codec, T, N, buf, 0).tobytes() == decoded.tobytes(), name


def test_selection_and_exactness_over_buffer_types(codec_impl):
    for name, buf in _buffers(PAYLOAD, typed=False):
        assert codec_impl.select_lossless_codec(T, N, buf, 0, [1, 2, 3]) == 3, name
        assert codec_impl.select_and_encode_lossless(T, N, buf, 0, (3, 1))[0] == 3, name
        assert codec_impl.is_bf16_exact(buf) and codec_impl.is_f16_exact(buf), name
        assert codec_impl.encode_f32_activation_payload(T, N, buf, 0) == PAYLOAD, name


def _non_contiguous():
    base = np.arange(32, dtype=np.float32)
    yield "ndarray-strided", base[::2][:8]
    yield "ndarray-fortran", base[:16].reshape(4, 4).T[:, :2]
    yield "memoryview-strided", memoryview(base.tobytes())[::2]
    yield "bf16-strided", base.astype(ml_dtypes.bfloat16)[::2]


def test_non_contiguous_buffers_are_refused_the_same_way(codec_impl):
    for name, buf in _non_contiguous():
        for call in (
            lambda: codec_impl.encode_activation(1, T, N, buf, 0),
            lambda: codec_impl.decode_activation(1, T, N, buf, 0),
            lambda: codec_impl.select_lossless_codec(T, N, buf, 0, [1]),
            lambda: codec_impl.is_bf16_exact(buf),
        ):
            with pytest.raises(InvalidInputError) as info:
                call()
            assert str(info.value) == "payload must be a C-contiguous buffer", name


def _gone_buffers():
    released = memoryview(bytearray(32))
    released.release()
    closed = mmap.mmap(-1, 32)
    closed.close()
    yield released, "operation forbidden on released memoryview object"
    yield closed, "mmap closed or invalid"


def test_a_buffer_that_is_gone_is_said_gone_not_non_contiguous(codec_impl):
    """The compiled codec said "payload must be a C-contiguous buffer" (and "out must ...")
    of a released memoryview or a closed mmap, where the twin says Python's ValueError."""
    for buf, said in _gone_buffers():
        for call in (
            lambda: codec_impl.encode_activation(1, 1, 8, buf, 0),
            lambda: codec_impl.encode_activation(1, 1, 8, bytes(32), 0, out=buf),
            lambda: codec_impl.decode_activation(1, 1, 8, buf, 0),
            lambda: codec_impl.is_bf16_exact(buf),
        ):
            with pytest.raises(ValueError, match=f"^{said}$"):
                call()


def test_objects_without_a_buffer_raise_type_error(codec_impl):
    for obj in ([1.0, 2.0], "abcd", None, 3.0):
        with pytest.raises(TypeError):
            codec_impl.encode_activation(1, 1, 1, obj, 0)
        with pytest.raises(TypeError):
            codec_impl.decode_activation(1, 1, 1, obj, 0)


def test_zero_dimensional_and_empty_buffers(codec_impl):
    assert codec_impl.encode_activation(3, 1, 1, np.float32(2.0), 0) == b"\x00\x40"
    assert codec_impl.encode_activation(3, 0, 4, np.empty((0, 4), np.float32), 0) == b""
    assert codec_impl.decode_activation(2, 0, 4, b"", 0).shape == (0,)


def test_empty_buffers_of_two_dimensions_are_empty_bytes(codec_impl, impl):
    # memoryview.cast refuses a shape holding a zero: the twin raised a raw TypeError for these
    empty = memoryview(np.zeros((0, 4), np.float32))
    assert codec_impl.encode_activation(3, 0, 4, empty, 0) == b""
    assert codec_impl.decode_activation(1, 0, 4, empty, 0).nbytes == 0
    assert codec_impl.is_bf16_exact(empty)
    assert codec_impl.encode_activation(3, 0, 4, b"", 0, out=memoryview(np.zeros((0, 4), np.float32))).nbytes == 0
    with pytest.raises(UnexpectedEofError):
        frame.read_stage_message_from_buffer(empty, 4, impl=impl)
    assert frame.StageMessageDecoder(4, impl=impl).feed(empty) == []


def test_object_arrays_are_refused(codec_impl):
    """numpy would export an object array's pointers as its bytes; both impls refuse."""
    for arr in (np.array([1.0, 2.0], dtype=object), np.array([(1.0, None)], dtype=[("a", "f4"), ("b", "O")])):
        with pytest.raises(InvalidInputError, match="^payload must not be an array of Python objects$"):
            codec_impl.encode_activation(1, 1, 2, arr, 0)
        with pytest.raises(InvalidInputError):
            codec_impl.is_f16_exact(arr)
