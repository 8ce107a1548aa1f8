# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False, cdivision=True
"""Compiled activation codec kernels (wire-format.md sections 5-8).

Same functions, signatures and behaviour as the pure-Python twin
``skippy_wire.wire._reference.codec``.  The conversions live in ``_codec_kernels.h`` (nogil C
over raw little-endian bytes, a portable auto-vectorised path plus an AVX2/F16C path
picked at run time); this module checks sizes in upstream order, acquires buffers,
releases the GIL around payload-sized work and turns kernel statuses into exceptions.
"""

from cpython.buffer cimport PyBUF_FORMAT, PyBUF_ND, PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_CheckExact
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy

from skippy_wire.wire._codec_kernels cimport *

cimport numpy as cnp
import numpy as np
import sys

from ..errors import InvalidDataError, InvalidInputError
from .constants import wire_int
from .field_checks import flat_bytes

cnp.import_array()

include "_wire_constants.pxi"

#: Payloads at least this large (in input bytes) are converted with the GIL released.
#: Measured (AMD EPYC, AVX2 path): a GIL release/re-acquire round trip costs ~35 ns, a
#: 32 KiB bf16 encode ~1.1 us, so from here on the release costs under 5% and lets other
#: threads run; below it the GIL is kept.  ``_set_nogil_threshold`` changes it (tests).
NOGIL_THRESHOLD = 32768
cdef size_t _nogil_threshold = NOGIL_THRESHOLD

NON_CONTIGUOUS = _wc.NON_CONTIGUOUS_TEXT
OBJECT_ARRAY = _wc.OBJECT_ARRAY_TEXT
DIMENSION_RANGE = _wc.DIMENSION_RANGE_TEXT
STATE_FLAGS_RANGE = _wc.STATE_FLAGS_RANGE_TEXT
BITS_DTYPE_U32 = _wc.BITS_DTYPE_U32_TEXT
BITS_DTYPE_U16 = _wc.BITS_DTYPE_U16_TEXT
OUT_NON_CONTIGUOUS = _wc.OUT_NON_CONTIGUOUS_TEXT
OUT_READ_ONLY = _wc.OUT_READ_ONLY_TEXT
OUT_OBJECT_ARRAY = _wc.OUT_OBJECT_ARRAY_TEXT
OUT_OVERLAP = _wc.OUT_OVERLAP_TEXT
PAYLOAD_FORMAT = _wc.PAYLOAD_FORMAT_TEXT
NOT_BYTES_LIKE = _wc.NOT_BYTES_LIKE_TEXT

cdef bint _LITTLE_HOST = sys.byteorder == "little"

_MESSAGES = {
    E_NEGATIVE_DIMENSIONS: _wc.NEGATIVE_DIMENSIONS_TEXT,
    E_TOKEN_OVERFLOW: "activation token count overflow",
    E_ROW_OVERFLOW: "activation row count overflow",
    E_COLUMNS: "activation columns must be positive",
    E_ELEMENT_OVERFLOW: "activation element count overflow",
    E_BYTE_OVERFLOW: "activation byte count overflow",
    E_DECODED_OVERFLOW: "decoded activation byte count overflow",
    E_DECODED_MAX: _wc.DECODED_MAX_TEXT,
    E_F32_SIZE: "F32 activation payload size mismatch",
    E_WIRE_OVERFLOW: _wc.WIRE_OVERFLOW_TEXT,
    E_S8_ROW_OVERFLOW: "S8 row byte count overflow",
    E_WIRE_MAX: _wc.WIRE_MAX_TEXT,
    E_WIRE_SIZE: _wc.WIRE_SIZE_TEXT,
    E_NOT_FINITE: "activation values must be finite",
    E_F16_RANGE: "F16 activation value is out of range",
    E_BF16_RANGE: "BF16 activation value is out of range",
    E_S8_SCALE: "S8 activation row scale is not finite and positive",
    E_S8_RANGE: "S8 activation value is out of range",
    E_S8_RESERVED: "S8 activation payload contains reserved -128 value",
    E_DECODED_NON_FINITE: "activation payload contains non-finite value",
    E_NO_RAW: _wc.NO_RAW_FALLBACK_TEXT,
    E_UNKNOWN_CODEC: _wc.UNKNOWN_CODEC_TEXT,
}


cdef int raise_status(int status) except -1:
    """The one place where a status becomes an exception (pyarrow check_status)."""
    raise InvalidDataError(_MESSAGES[status])


def _set_simd(enabled):
    """Enable (default) or disable the AVX2/F16C paths; returns the previous setting.

    Disabled, every kernel runs its portable path, which is what tests compare against.
    """
    global skw_simd_enabled
    previous = bool(skw_simd_enabled)
    skw_simd_enabled = 1 if enabled else 0
    return previous


def simd_active():
    """Whether the AVX2/F16C paths run (enabled and supported by this CPU)."""
    return bool(skw_simd_enabled and skw_cpu_has_avx2_f16c())


def _set_nogil_threshold(size_t nbytes):
    """Set the payload size (bytes) from which the GIL is released; returns the old one."""
    global _nogil_threshold
    previous = _nogil_threshold
    _nogil_threshold = nbytes
    return previous


# --------------------------------------------------------------------------- arguments


cdef int _codec_id(object codec) except -1:
    codec = wire_int(codec)
    if not (MIN_CODEC <= codec <= MAX_CODEC):
        raise_status(E_UNKNOWN_CODEC)  # 6.1: ids 0, 5, ... are invalid
    return <int>codec


cdef int _dims(object token_count, object n_embd, object state_flags, Dims *d) except -1:
    token_count = wire_int(token_count)
    n_embd = wire_int(n_embd)
    state_flags = wire_int(state_flags)
    if not (-2147483648 <= token_count <= 2147483647 and -2147483648 <= n_embd <= 2147483647):
        raise InvalidInputError(DIMENSION_RANGE)
    if not -2147483648 <= state_flags <= 2147483647:
        raise InvalidInputError(STATE_FLAGS_RANGE)
    d.token_count = token_count
    d.n_embd = n_embd
    d.doubled = (state_flags & F_DOUBLING) != 0
    return 0


cdef int _acquire(object obj, Py_buffer *view, str object_array=OBJECT_ARRAY,
                  str non_contiguous=NON_CONTIGUOUS) except -1:
    """Raw bytes of any C-contiguous buffer; one rule for everything else.  An object array
    is refused first: numpy would export (and a writer clobber) the object pointers."""
    if isinstance(obj, cnp.ndarray) and (<cnp.ndarray>obj).dtype.hasobject:
        raise InvalidInputError(object_array)
    _get_buffer(obj, view, PyBUF_SIMPLE, non_contiguous)
    return 0


cdef int _get_buffer(object obj, Py_buffer *view, int flags, str non_contiguous) except -1:
    try:
        PyObject_GetBuffer(obj, view, flags)
    except TypeError:  # no buffer protocol at all: the twin's words (not memoryview's)
        raise TypeError(NOT_BYTES_LIKE.format(type(obj).__name__)) from None
    except Exception:
        if not isinstance(obj, cnp.ndarray):  # (an array's memory cannot be gone; its dtype may not export)
            memoryview(obj)  # a buffer that cannot be had at all (released, a closed mmap): the twin's error
        raise InvalidInputError(non_contiguous) from None  # else its layout is what failed
    return 0


cdef bint _f32_format(const char *fmt) noexcept:
    """Whether a buffer format holds raw bytes ('B', 'b', 'c', any byte order) or
    little-endian f32 values or bit patterns ('<f' / '<I', or 'f' / 'I' native or '='
    on a little-endian host)."""
    cdef char order = 0
    if fmt == NULL:  # the exporter's "unsigned bytes"
        return True
    if fmt[0] == b'@' or fmt[0] == b'=' or fmt[0] == b'<' or fmt[0] == b'>' or fmt[0] == b'!':
        order = fmt[0]
        fmt += 1
    if fmt[0] == 0 or fmt[1] != 0:
        return False
    if fmt[0] == b'B' or fmt[0] == b'b' or fmt[0] == b'c':
        return True
    if fmt[0] == b'f' or fmt[0] == b'I':
        return order == b'<' or (_LITTLE_HOST and (order == 0 or order == b'@' or order == b'='))
    return False


cdef int _acquire_f32(object obj, Py_buffer *view) except -1:
    """``_acquire`` for a payload read as f32 values: its elements must be raw bytes or
    little-endian f32 values or bit patterns (an array's dtype uint8, int8, or float32 or
    uint32 in little-endian order; another buffer's format as ``_f32_format``); anything
    else (float64, int32, float16, big-endian...) is refused naming it."""
    cdef cnp.ndarray arr
    cdef int type_num
    cdef bint little
    if PyBytes_CheckExact(obj) or PyByteArray_CheckExact(obj):
        _get_buffer(obj, view, PyBUF_SIMPLE, NON_CONTIGUOUS)
        return 0
    if isinstance(obj, cnp.ndarray):  # by dtype: some (ml_dtypes bfloat16) export no format
        _acquire(obj, view)
        arr = <cnp.ndarray>obj
        type_num = cnp.PyArray_TYPE(arr)
        little = (cnp.PyArray_ISNOTSWAPPED(arr) != 0) == _LITTLE_HOST
        if not (type_num == cnp.NPY_UINT8 or type_num == cnp.NPY_INT8
                or ((type_num == cnp.NPY_FLOAT32 or type_num == cnp.NPY_UINT32) and little)):
            PyBuffer_Release(view)
            raise InvalidInputError(PAYLOAD_FORMAT.format(f"dtype {arr.dtype}"))
        return 0
    _get_buffer(obj, view, PyBUF_ND | PyBUF_FORMAT, NON_CONTIGUOUS)
    if not _f32_format(view.format):
        text = PAYLOAD_FORMAT.format(f"format {view.format.decode('ascii', 'replace')!r}")
        PyBuffer_Release(view)
        raise InvalidInputError(text)
    return 0


# --------------------------------------------------------------------------- sizes (5.1-5.3)


cdef int frame_shape(const Dims *d, Shape *s) noexcept nogil:
    """5.1: rows = primary + sideband, elements = rows x columns."""
    cdef uint64_t sideband, rows
    if d.token_count < 0 or d.n_embd <= 0:
        return E_NEGATIVE_DIMENSIONS
    if skw_mul_u64(<uint64_t>d.token_count, 1 if d.doubled else 0, &sideband):
        return E_TOKEN_OVERFLOW
    rows = <uint64_t>d.token_count + sideband
    if rows < sideband:
        return E_ROW_OVERFLOW
    s.rows = rows
    s.columns = <uint64_t>d.n_embd
    if s.columns == 0:
        return E_COLUMNS
    if skw_mul_u64(rows, s.columns, &s.elements):
        return E_ELEMENT_OVERFLOW
    return OK


cdef int encoded_size(int codec, const Shape *s, uint64_t *size) noexcept nogil:
    """5.3 after the shape: per-codec size, overflow, then the 512 MiB cap."""
    cdef uint64_t row_bytes
    if codec == RAW_F32_V1:
        if skw_mul_u64(s.elements, 4, size):
            return E_WIRE_OVERFLOW
    elif codec == F16_RNE_V1 or codec == BF16_RNE_V1:
        if skw_mul_u64(s.elements, 2, size):
            return E_WIRE_OVERFLOW
    else:
        row_bytes = s.columns + 4
        if row_bytes < 4:
            return E_S8_ROW_OVERFLOW
        if skw_mul_u64(s.rows, row_bytes, size):
            return E_WIRE_OVERFLOW
    if size[0] > MAX_ACTIVATION:
        return E_WIRE_MAX
    return OK


cdef int _f32_input(const Dims *d, Py_ssize_t nbytes, Shape *s) noexcept nogil:
    """7.1 steps 1-4: shape, decoded size and its cap, then the input length."""
    cdef uint64_t expected
    cdef int st = frame_shape(d, s)
    if st:
        return st
    if skw_mul_u64(s.elements, 4, &expected):
        return E_DECODED_OVERFLOW
    if expected > MAX_DECODED:
        return E_DECODED_MAX
    if <uint64_t>nbytes != expected:
        return E_F32_SIZE
    return OK


def activation_shape(token_count, n_embd, state_flags):
    """(primary_rows, sideband_rows, columns) of a frame (5.1)."""
    cdef Dims d
    cdef Shape s = Shape(0, 0, 0)
    _dims(token_count, n_embd, state_flags, &d)
    cdef int st = frame_shape(&d, &s)
    if st:
        raise_status(st)
    return d.token_count, s.rows - <uint64_t>d.token_count, d.n_embd


def activation_f32_bytes(token_count, n_embd, state_flags):
    """The f32 byte size of a frame (5.2); n_embd = 0 is allowed, no maximum."""
    cdef Dims d
    cdef uint64_t tokens = 0, elements = 0, size = 0
    _dims(token_count, n_embd, state_flags, &d)
    if d.token_count < 0 or d.n_embd < 0:
        raise_status(E_NEGATIVE_DIMENSIONS)
    if skw_mul_u64(<uint64_t>d.token_count, 2 if d.doubled else 1, &tokens):
        raise_status(E_TOKEN_OVERFLOW)
    if skw_mul_u64(tokens, <uint64_t>d.n_embd, &elements):
        raise_status(E_ELEMENT_OVERFLOW)
    if skw_mul_u64(elements, 4, &size):
        raise_status(E_BYTE_OVERFLOW)
    return size


def activation_wire_bytes(codec, token_count, n_embd, state_flags):
    """Encoded payload size of a frame in ``codec`` (5.3)."""
    cdef int c = _codec_id(codec)
    cdef Dims d
    cdef Shape s = Shape(0, 0, 0)
    cdef uint64_t size = 0
    _dims(token_count, n_embd, state_flags, &d)
    cdef int st = frame_shape(&d, &s)
    if st == OK:
        st = encoded_size(c, &s, &size)
    if st:
        raise_status(st)
    return size


# --------------------------------------------------------------------------- encode


cdef int _open_out(object out, Py_buffer *ob, uint64_t size, const uint8_t *src,
                   Py_ssize_t nbytes, uint8_t **dst) except -1:
    """Acquire ``out`` into ``ob`` for writing ``size`` bytes: C-contiguous, writable, big
    enough and not overlapping the payload (the kernels read the payload after writing)."""
    _acquire(out, ob, OUT_OBJECT_ARRAY, OUT_NON_CONTIGUOUS)
    cdef const uint8_t *o = <const uint8_t *>ob.buf
    try:
        if ob.readonly:
            raise InvalidInputError(OUT_READ_ONLY)
        if <uint64_t>ob.len < size:
            raise InvalidInputError(_out_too_small(ob.len, size))
        if size and nbytes and o < src + nbytes and src < o + size:
            raise InvalidInputError(OUT_OVERLAP)
    except BaseException:
        PyBuffer_Release(ob)
        raise
    dst[0] = <uint8_t *>ob.buf
    return 0


def _out_too_small(have, need):
    return f"out buffer too small: {have} bytes for an encoded size of {need} bytes"


cdef object _out_result(object out, uint64_t size):
    """A flat unsigned-byte memoryview of exactly the first ``size`` bytes of ``out``."""
    if isinstance(out, cnp.ndarray):
        # some dtypes (ml_dtypes bfloat16) have no buffer format: view them as bytes.
        view = memoryview(out.reshape(-1).view(np.uint8))
    else:
        view = flat_bytes(memoryview(out))
    return view[:size]


# The payload-sized kernels, one dispatcher so that every call site releases the GIL the
# same way: from ``_nogil_threshold`` input bytes on, never below.
ctypedef int (*UniformKernel)(const uint8_t *s, uint8_t *d, size_t n) noexcept nogil

cdef enum Kernel:
    # the uniform kernels, (src, dst, n) -> int, in the order of _UNIFORM
    K_ENCODE_BF16      # -> non-zero when a value needs the error walk
    K_ENCODE_F16
    K_DECODE_BF16      # -> non-zero when a value is not finite
    K_DECODE_F16
    K_EXACT_BF16       # -> 1 when every value is exact (dst, if not NULL, gets the patterns)
    K_EXACT_F16
    K_UNIFORM_COUNT
    # the others
    K_FIND_NON_FINITE  # -> index of the first non-finite f32, or -1
    K_FIND_BF16_OVERFLOW  # -> index of the first f32 that rounds to a BF16 infinity, or -1
    K_FIND_F16_OVERFLOW   # -> the same for F16
    K_COPY             # n = byte count
    K_COPY_LE32
    K_ENCODE_S8        # -> failing row or -1, ``kind`` set
    K_DECODE_S8        # -> failing row or -1, ``kind`` set

cdef UniformKernel _UNIFORM[<int>K_UNIFORM_COUNT]
_UNIFORM[:] = [skw_encode_bf16, skw_encode_f16, skw_decode_bf16, skw_decode_f16, skw_exact_bf16, skw_exact_f16]


cdef Py_ssize_t _dispatch(int op, const uint8_t *src, uint8_t *dst, size_t n, size_t rows, size_t cols,
                          int *kind) noexcept nogil:
    if op < K_UNIFORM_COUNT:
        return _UNIFORM[op](src, dst, n)
    if op == K_FIND_NON_FINITE:
        return skw_find_non_finite32(src, n)
    if op == K_FIND_BF16_OVERFLOW:
        return skw_find_bf16_overflow(src, n)
    if op == K_FIND_F16_OVERFLOW:
        return skw_find_f16_overflow(src, n)
    if op == K_COPY:
        memcpy(dst, src, n)
    elif op == K_COPY_LE32:
        skw_copy_le32_to_host(src, dst, n)
    elif op == K_ENCODE_S8:
        return skw_encode_s8(src, dst, rows, cols, kind)
    else:
        return skw_decode_s8(src, dst, rows, cols, kind)
    return 0


cdef Py_ssize_t _run(int op, const uint8_t *src, uint8_t *dst, size_t n, bint release,
                     const Shape *s=NULL, int *kind=NULL) noexcept:
    """Run one kernel, with the GIL released when ``release``."""
    cdef Py_ssize_t r
    cdef size_t rows = s.rows if s != NULL else 0, cols = s.columns if s != NULL else 0
    if release:
        with nogil:
            r = _dispatch(op, src, dst, n, rows, cols, kind)
    else:
        r = _dispatch(op, src, dst, n, rows, cols, kind)
    return r


cdef object _encode_checked(int codec, const Shape *s, const uint8_t *src, Py_ssize_t nbytes, object out=None):
    """6.2 steps 3-5 on a payload whose length already matches the shape.

    Returns new bytes, or with ``out`` a memoryview of its first encoded bytes.  ``out``
    is checked exactly where the bytes would be allocated, after every upstream check
    that precedes writing; an encode error found while converting (F16/BF16 range, S8
    row) may leave ``out`` partially written."""
    cdef uint64_t out_size = 0
    cdef size_t n = <size_t>s.elements
    cdef bint nogil_ = <size_t>nbytes >= _nogil_threshold
    cdef int st, kind = 0
    cdef object result = None
    cdef uint8_t *dst = NULL
    cdef Py_buffer ob
    cdef bint held = False

    if codec == S8_ROW_F32_RNE_V1:
        # 6.2 step 3 over the whole array, before any conversion.
        if _run(K_FIND_NON_FINITE, src, NULL, n, nogil_) >= 0:
            raise_status(E_NOT_FINITE)
    st = encoded_size(codec, s, &out_size)  # 6.2 step 4, before allocating
    if st:
        raise_status(st)
    if out is None:
        result = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>out_size)
        dst = <uint8_t *>PyBytes_AS_STRING(result)
    else:
        _open_out(out, &ob, out_size, src, nbytes, &dst)
        held = True
    try:
        if codec == RAW_F32_V1:  # bit-exact, NaN payloads included (6.4)
            _run(K_COPY, src, dst, <size_t>nbytes, nogil_)
        elif codec == S8_ROW_F32_RNE_V1:
            if _run(K_ENCODE_S8, src, dst, n, nogil_, s, &kind) >= 0:
                raise_status(E_S8_SCALE if kind == SKW_S8_BAD_SCALE else E_S8_RANGE)
        else:
            # F16 / BF16: one fused pass converts and OR-accumulates the checks; only when
            # it reports a problem are the errors located, in upstream order (any
            # non-finite value anywhere first, then the first value that rounds to infinity).
            if _run(K_ENCODE_BF16 if codec == BF16_RNE_V1 else K_ENCODE_F16, src, dst, n, nogil_):
                if _run(K_FIND_NON_FINITE, src, NULL, n, nogil_) >= 0:
                    raise_status(E_NOT_FINITE)
                if codec == BF16_RNE_V1:
                    if _run(K_FIND_BF16_OVERFLOW, src, NULL, n, nogil_) >= 0:
                        raise_status(E_BF16_RANGE)
                elif _run(K_FIND_F16_OVERFLOW, src, NULL, n, nogil_) >= 0:
                    raise_status(E_F16_RANGE)
                # Neither walk finds it: another thread changed the input after the first pass
                # saw a value out of range, whose non-finite half is in the output; refuse it.
                raise_status(E_BF16_RANGE if codec == BF16_RNE_V1 else E_F16_RANGE)
        if held:
            result = _out_result(out, out_size)
    finally:
        if held:
            PyBuffer_Release(&ob)
    return result


def encode_activation(codec, token_count, n_embd, payload, state_flags, *, out=None):
    """Encode an f32 frame (7.1, then the common procedure of 6.2); into ``out`` when given."""
    cdef int c = _codec_id(codec)
    cdef Py_buffer view
    cdef Dims d
    cdef Shape s = Shape(0, 0, 0)
    cdef int st
    _acquire_f32(payload, &view)
    try:
        _dims(token_count, n_embd, state_flags, &d)
        st = _f32_input(&d, view.len, &s)
        if st:
            raise_status(st)
        return _encode_checked(c, &s, <const uint8_t *>view.buf, view.len, out)
    finally:
        PyBuffer_Release(&view)


def encode_f32_activation_payload(token_count, n_embd, payload, state_flags):
    """7.2: the f32 size check of 5.2 first (n_embd = 0 passes it), then raw encode."""
    cdef Py_buffer view
    _acquire_f32(payload, &view)
    try:
        expected = activation_f32_bytes(token_count, n_embd, state_flags)
        if expected > MAX_DECODED:
            raise_status(E_DECODED_MAX)
        if view.len != expected:
            raise_status(E_F32_SIZE)
        return encode_activation(RAW_F32_V1, token_count, n_embd, payload, state_flags)
    finally:
        PyBuffer_Release(&view)


# --------------------------------------------------------------------------- decode


def decode_activation(codec, token_count, n_embd, wire, state_flags):
    """Decode a wire payload to a new 1-D float32 array (7.4 and 6.3)."""
    cdef int c = _codec_id(codec)
    cdef Py_buffer view
    cdef Dims d
    cdef Shape s = Shape(0, 0, 0)
    cdef uint64_t decoded = 0, expected = 0
    cdef int st, kind = 0
    cdef size_t n
    cdef const uint8_t *src
    cdef uint8_t *dst
    cdef cnp.ndarray out
    cdef cnp.npy_intp dims[1]
    cdef bint nogil_
    _acquire(wire, &view)
    try:
        _dims(token_count, n_embd, state_flags, &d)
        st = frame_shape(&d, &s)
        if st == OK and skw_mul_u64(s.elements, 4, &decoded):
            st = E_DECODED_OVERFLOW
        if st == OK and decoded > MAX_DECODED:
            st = E_DECODED_MAX
        if st == OK:
            st = encoded_size(c, &s, &expected)
        if st == OK and <uint64_t>view.len != expected:
            st = E_WIRE_SIZE
        if st:
            raise_status(st)
        # Only now, with the size checked against the 512 MiB caps, allocate.
        n = <size_t>s.elements
        dims[0] = <cnp.npy_intp>n
        out = cnp.PyArray_EMPTY(1, dims, cnp.NPY_FLOAT32, 0)
        src = <const uint8_t *>view.buf
        dst = <uint8_t *>cnp.PyArray_DATA(out)
        nogil_ = <size_t>view.len >= _nogil_threshold
        if c == RAW_F32_V1:  # no checks beyond the length (6.4)
            _run(K_COPY_LE32, src, dst, n, nogil_)
        elif c == BF16_RNE_V1 or c == F16_RNE_V1:
            if _run(K_DECODE_BF16 if c == BF16_RNE_V1 else K_DECODE_F16, src, dst, n, nogil_):
                raise_status(E_DECODED_NON_FINITE)
        else:
            if _run(K_DECODE_S8, src, dst, n, nogil_, &s, &kind) >= 0:
                if kind == SKW_S8_BAD_SCALE:
                    raise_status(E_S8_SCALE)
                raise_status(E_S8_RESERVED if kind == SKW_S8_RESERVED else E_DECODED_NON_FINITE)
        return out
    finally:
        PyBuffer_Release(&view)


include "_codec_select.pxi"


# --------------------------------------------------------------------------- raw conversions


cdef cnp.ndarray _bits_in(object bits, object dtype, str message):
    if not isinstance(bits, np.ndarray) or (<cnp.ndarray>bits).dtype != dtype:
        raise TypeError(message)
    return np.ascontiguousarray(bits)


ctypedef void (*narrow_fn)(const uint32_t *, uint16_t *, size_t) noexcept nogil
ctypedef void (*widen_fn)(const uint16_t *, uint32_t *, size_t) noexcept nogil


ctypedef fused convert_fn:
    narrow_fn
    widen_fn


cdef cnp.ndarray _convert(object bits, convert_fn convert):
    """u32 patterns -> u16 (narrow) or u16 -> u32 (widen), same shape, element by element."""
    cdef bint narrow = convert_fn is narrow_fn
    cdef cnp.ndarray a = _bits_in(bits, np.uint32 if narrow else np.uint16, BITS_DTYPE_U32 if narrow else BITS_DTYPE_U16)
    cdef cnp.ndarray out = np.empty(np.shape(bits), dtype=np.uint16 if narrow else np.uint32)
    cdef void *src = cnp.PyArray_DATA(a)
    cdef void *dst = cnp.PyArray_DATA(out)
    cdef size_t n = <size_t>cnp.PyArray_SIZE(a)
    with nogil:
        if convert_fn is narrow_fn:
            convert(<const uint32_t *>src, <uint16_t *>dst, n)
        else:
            convert(<const uint16_t *>src, <uint32_t *>dst, n)
    return out


def f32_bits_to_bf16_bits(bits):
    """Raw 6.6 conversion of every element (no checks; NaN keeps its top bits, quieted)."""
    return _convert[narrow_fn](bits, skw_u32_to_bf16_array)


def f32_bits_to_f16_bits(bits):
    """Raw 6.5 conversion of every element (no checks; NaN -> 0x7c01 | sign)."""
    return _convert[narrow_fn](bits, skw_u32_to_f16_array)


def bf16_bits_to_f32_bits(bits):
    """Raw bf16 -> f32 widening (exact)."""
    return _convert[widen_fn](bits, skw_bf16_to_u32_array)


def f16_bits_to_f32_bits(bits):
    """Raw 6.5 f16 -> f32 widening (exact; NaN payloads shifted up)."""
    return _convert[widen_fn](bits, skw_f16_to_u32_array)
