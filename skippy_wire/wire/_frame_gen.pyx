# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled state versions 16 and 17 (the twin of ``skippy_wire.wire._reference.frame_gen``).

Same kernel API and semantics as the reference.  How: descriptors are parsed into C
structs straight from the caller's buffer and validated there (wire-v16-v17.md A.5), F32
parts go through the codec kernels of ``_codec_kernels.h`` directly (F16/BF16/raw; S8 and
every error through the compiled ``_codec`` module, which owns the codec error texts), a
reader's RawF32V1 frame is built in one ``bytes`` object (header copied, parts decoded in
place), and the v15 layout around the activation is written by the compiled ``_frame``.

This file: descriptors and frames.  ``_frame_gen_check.pxi``: the writer's value scan.
``_frame_gen_msg.pxi``: stage messages.
``_frame_gen_agreed.pxi``: agreements and agreement-framed activations (v17).
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.dict cimport PyDict_Copy
from cpython.object cimport PyObject
from cpython.ref cimport Py_DECREF
from libc.stdint cimport int32_t, uint16_t, uint32_t, int64_t, uint64_t, uint8_t
from libc.string cimport memcpy, memcmp, memset

from skippy_wire.wire._codec_kernels cimport (
    skw_copy_le32_to_host, skw_decode_bf16, skw_decode_f16, skw_encode_bf16, skw_encode_f16, skw_mul_u64,
)
from skippy_wire.wire._le_bytes cimport ld_u32, ld_u64, st_u32, st_u64

cdef extern from "Python.h":
    ctypedef struct PyTypeObject:
        PyObject* (*tp_new)(PyTypeObject*, PyObject*, PyObject*)

import dataclasses

from ..errors import InvalidDataError, InvalidInputError, UnexpectedEofError, WireError
from .activation_frame import ActivationFrameV16, ActivationPartV16
from .agreement import ActivationPartProfile, ActivationProfile, Dynamic, Fixed, TOKENS
from .constants import ActivationCodec, CodecPolicy
from .constants import I32_MAX, I32_MIN, U32_MAX, U64_MAX
from .constants import (
    AGREEMENT_RANGE_TEXT,
    DECODED_MAX_TEXT,
    DESCRIPTOR_RANGE_TEXT,
    PART_AXES_TEXT,
    NO_RAW_FALLBACK_TEXT,
    UNKNOWN_CODEC_TEXT,
    WIRE_MAX_TEXT,
    MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES,
    MAX_STAGE_DRY_SEQUENCE_BREAKERS,
    MAX_STAGE_LOGIT_BIAS,
    MAX_STAGE_SAMPLERS,
    MAX_STAGE_SAMPLING_STRING_BYTES,
    MAX_STAGE_SIDEBAND_VALUES,
    MAX_STAGE_STATE_IMPORT_BYTES,
)
from .messages import SAMPLING_WIRE_ORDER, LogitBias, SamplingConfig, StageStateHeader, StageWireMessage, f32_from_bits
from .constants import wire_int
from .field_checks import check_admission, holds_objects, out_of_range_error, wire_bool
from . import _codec
from . import _frame

cdef enum:
    FRAME_VERSION = 2
    MAX_PARTS = 16
    OPTIONAL = 1
    HEADER = 68
    PART = 128
    RAW = 1
    F16 = 2
    BF16 = 3
    S8 = 4

cdef uint64_t MAX_BYTES = 536870912

# Descriptor texts (A.9), in the order of the checks.
E_VERSION = "unsupported activation frame version"
E_PART_COUNT = "activation frame part count is invalid"
E_DECODED_MAX = DECODED_MAX_TEXT
E_PAYLOAD_LEN = "activation payload byte count mismatch"
E_FLAGS = "activation part has unsupported flags"
E_DUPLICATE = "activation frame has duplicate part identities"
E_NEGATIVE_AXIS = "activation part has a negative token axis"
E_SHAPE = "activation part shape is invalid"
E_TOKEN_DIM = "activation part token dimension does not match frame"
E_GGML_TYPE = "activation part has unsupported ggml type"
E_DIM = "activation part dimension is not positive"
E_DENSE = "activation part is not densely packed"
E_ELEMENTS = "activation part element count overflow"
E_STRIDE = "activation part stride overflow"
E_LAYOUT = "activation part payload layout is inconsistent"
E_OFFSET = "activation payload byte count overflow"
E_TOTAL = "activation descriptor payload size mismatch"
E_WIRE_MAX = WIRE_MAX_TEXT
E_FRAME_MAX = "activation frame wire byte count exceeds maximum"
E_FRAME_SIZE = "activation frame wire byte count mismatch"
E_NO_RAW = NO_RAW_FALLBACK_TEXT
E_CODEC = UNKNOWN_CODEC_TEXT


cdef struct Part:
    uint8_t identity[32]
    uint32_t ggml_type
    uint32_t rank
    int32_t token_axis
    uint32_t flags
    int64_t dims[4]
    uint64_t strides[4]
    uint64_t offset
    uint64_t nbytes


cdef struct Desc:
    uint32_t version
    int32_t producer
    int32_t layer_start
    int32_t layer_end
    uint32_t tokens
    uint32_t sequences
    uint32_t count
    uint64_t payload
    uint8_t frontier[32]
    Part parts[16]


cdef int _raise(str text) except -1:
    raise InvalidDataError(text)


cdef int _codec_id(object codec) except -1:
    cdef object c = wire_int(codec)
    if not 1 <= c <= 4:
        _raise(E_CODEC)
    return <int>c


cdef inline int _element_bytes(uint32_t ggml_type) noexcept nogil:
    if ggml_type == 0 or ggml_type == 26:
        return 4
    if ggml_type == 1 or ggml_type == 30:
        return 2
    return 0


# --- descriptors -----------------------------------------------------------------------------
_FIELD_NAMES = ("version", "producer_stage_index", "layer_start", "layer_end", "token_count", "sequence_count",
                "payload_bytes", "ggml_type", "rank", "token_axis", "flags", "dimensions", "byte_strides",
                "payload_offset", "payload_bytes", "dimensions", "byte_strides")


cdef int _from_object(object obj, Desc* d) except -1:
    """A Python descriptor into ``d``; version and part count are checked first (A.5 1-2)."""
    cdef bint wrong_version
    try:  # a value whose comparison has no truth value (an array) is no version
        wrong_version = obj.version != FRAME_VERSION
    except (TypeError, ValueError):
        raise InvalidInputError(f"{DESCRIPTOR_RANGE_TEXT}: version") from None
    if wrong_version:
        _raise(E_VERSION)
    parts = obj.parts
    if type(parts) is not list and not isinstance(parts, (list, tuple)):  # a dict or set is no list of parts
        raise InvalidInputError(f"{DESCRIPTOR_RANGE_TEXT}: parts")
    cdef Py_ssize_t n = len(parts), i, k
    if n < 1 or n > MAX_PARTS:
        _raise(E_PART_COUNT)
    cdef Part* p
    cdef int f = 0  # the field being converted (_FIELD_NAMES), of part i, axis k: for the error
    try:
        d.version = wire_int(obj.version)
        f = 1
        d.producer = wire_int(obj.producer_stage_index)
        f = 2
        d.layer_start = wire_int(obj.layer_start)
        f = 3
        d.layer_end = wire_int(obj.layer_end)
        f = 4
        d.tokens = wire_int(obj.token_count)
        f = 5
        d.sequences = wire_int(obj.sequence_count)
        d.count = <uint32_t>n
        f = 6
        d.payload = wire_int(obj.payload_bytes)
        _copy32(d.frontier, obj.frontier_identity, "frontier_identity")
        for i in range(n):
            part = parts[i]
            if type(part) is not ActivationPartV16 and not isinstance(part, ActivationPartV16):
                raise InvalidInputError(f"{DESCRIPTOR_RANGE_TEXT}: parts[{i}]")
            p = &d.parts[i]
            _copy32(p.identity, part.identity, f"parts[{i}].identity")
            f = 7
            p.ggml_type = wire_int(part.ggml_type)
            f = 8
            p.rank = wire_int(part.rank)
            f = 9
            p.token_axis = wire_int(part.token_axis)
            f = 10
            p.flags = wire_int(part.flags)
            # tuples: a snapshot that converting an item cannot shrink, indexed unchecked below
            f = 15
            dims = tuple(part.dimensions)
            f = 16
            strides = tuple(part.byte_strides)
            if len(dims) != 4 or len(strides) != 4:
                raise InvalidInputError(PART_AXES_TEXT)
            for k in range(4):
                f = 11
                p.dims[k] = wire_int(dims[k])
                f = 12
                p.strides[k] = wire_int(strides[k])
            f = 13
            p.offset = wire_int(part.payload_offset)
            f = 14
            p.nbytes = wire_int(part.payload_bytes)
    except (OverflowError, TypeError, IndexError):
        name = _FIELD_NAMES[f]
        if f >= 7:
            name = f"parts[{i}].{name}" + (f"[{k}]" if f in (11, 12) else "")
        raise InvalidInputError(f"{DESCRIPTOR_RANGE_TEXT}: {name}") from None
    return 0


cdef int _copy32(uint8_t* dst, object value, str name) except -1:
    """An identity: a buffer of exactly 32 bytes (an int would make ``bytes(n)`` zeros, a
    list of ints is no buffer); anything else is refused naming the field."""
    cdef bytes raw = None
    if type(value) is bytes:
        raw = value
    else:
        try:
            raw = bytes(memoryview(value))
        except (TypeError, ValueError, BufferError):
            pass
    if raw is None or len(raw) != 32:
        raise InvalidInputError(f"{DESCRIPTOR_RANGE_TEXT}: {name}")
    memcpy(dst, <const char*>raw, 32)
    return 0


cdef object _to_object(const Desc* d):
    cdef uint32_t i
    cdef const Part* p
    parts = []
    for i in range(d.count):
        p = &d.parts[i]
        parts.append(ActivationPartV16(
            PyBytes_FromStringAndSize(<const char*>p.identity, 32), p.ggml_type, p.rank, p.token_axis, p.flags,
            (p.dims[0], p.dims[1], p.dims[2], p.dims[3]),
            (p.strides[0], p.strides[1], p.strides[2], p.strides[3]), p.offset, p.nbytes))
    return ActivationFrameV16(d.version, d.producer, d.layer_start, d.layer_end, d.tokens, d.sequences, d.payload,
                              PyBytes_FromStringAndSize(<const char*>d.frontier, 32), parts)


cdef int _read_desc(const uint8_t* b, Py_ssize_t n, Desc* d) except -1:
    """A.6.3 steps 1-2 (part_count checked as soon as it is read)."""
    cdef uint32_t i, k
    cdef const uint8_t* q
    cdef Part* p
    if n < 28:
        raise UnexpectedEofError()
    d.version = ld_u32(b)
    d.producer = <int32_t>ld_u32(b + 4)
    d.layer_start = <int32_t>ld_u32(b + 8)
    d.layer_end = <int32_t>ld_u32(b + 12)
    d.tokens = ld_u32(b + 16)
    d.sequences = ld_u32(b + 20)
    d.count = ld_u32(b + 24)
    if d.count < 1 or d.count > MAX_PARTS:
        _raise(E_PART_COUNT)
    if n < HEADER + PART * <Py_ssize_t>d.count:
        raise UnexpectedEofError()
    d.payload = ld_u64(b + 28)
    memcpy(d.frontier, b + 36, 32)
    for i in range(d.count):
        q = b + HEADER + PART * i
        p = &d.parts[i]
        memcpy(p.identity, q, 32)
        p.ggml_type = ld_u32(q + 32)
        p.rank = ld_u32(q + 36)
        p.token_axis = <int32_t>ld_u32(q + 40)
        p.flags = ld_u32(q + 44)
        for k in range(4):
            p.dims[k] = <int64_t>ld_u64(q + 48 + 8 * k)
            p.strides[k] = ld_u64(q + 80 + 8 * k)
        p.offset = ld_u64(q + 112)
        p.nbytes = ld_u64(q + 120)
    return 0


cdef void _write_desc(const Desc* d, uint8_t* out) noexcept nogil:
    cdef uint32_t i, k
    cdef uint8_t* q
    cdef const Part* p
    st_u32(out, d.version)
    st_u32(out + 4, <uint32_t>d.producer)
    st_u32(out + 8, <uint32_t>d.layer_start)
    st_u32(out + 12, <uint32_t>d.layer_end)
    st_u32(out + 16, d.tokens)
    st_u32(out + 20, d.sequences)
    st_u32(out + 24, d.count)
    st_u64(out + 28, d.payload)
    memcpy(out + 36, d.frontier, 32)
    for i in range(d.count):
        q = out + HEADER + PART * i
        p = &d.parts[i]
        memcpy(q, p.identity, 32)
        st_u32(q + 32, p.ggml_type)
        st_u32(q + 36, p.rank)
        st_u32(q + 40, <uint32_t>p.token_axis)
        st_u32(q + 44, p.flags)
        for k in range(4):
            st_u64(q + 48 + 8 * k, <uint64_t>p.dims[k])
            st_u64(q + 80 + 8 * k, p.strides[k])
        st_u64(q + 112, p.offset)
        st_u64(q + 120, p.nbytes)


cdef int _validate(const Desc* d, int64_t payload_len) except -1:
    """A.5 in order; ``payload_len`` < 0 when no payload is supplied."""
    cdef uint32_t i, j, k
    cdef uint64_t offset = 0, stride, count, next_offset
    cdef int size
    cdef const Part* p
    if d.version != FRAME_VERSION:
        _raise(E_VERSION)
    if d.count < 1 or d.count > MAX_PARTS:
        _raise(E_PART_COUNT)
    if d.payload > MAX_BYTES:
        _raise(E_DECODED_MAX)
    if payload_len >= 0 and <uint64_t>payload_len != d.payload:
        _raise(E_PAYLOAD_LEN)
    for i in range(d.count):
        p = &d.parts[i]
        if p.flags & ~(<uint32_t>OPTIONAL):
            _raise(E_FLAGS)
        for j in range(i):
            if memcmp(p.identity, d.parts[j].identity, 32) == 0:
                _raise(E_DUPLICATE)
        if p.token_axis < 0:
            _raise(E_NEGATIVE_AXIS)
        if p.rank < 1 or p.rank > 4 or <uint32_t>p.token_axis >= p.rank:
            _raise(E_SHAPE)
        if p.dims[p.token_axis] != <int64_t>d.tokens:
            _raise(E_TOKEN_DIM)
        size = _element_bytes(p.ggml_type)
        if size == 0:
            _raise(E_GGML_TYPE)
        stride = <uint64_t>size
        count = 1
        for k in range(p.rank):
            if p.dims[k] <= 0:
                _raise(E_DIM)
            if p.strides[k] != stride:
                _raise(E_DENSE)
            if skw_mul_u64(count, <uint64_t>p.dims[k], &count):
                _raise(E_ELEMENTS)
            if skw_mul_u64(stride, <uint64_t>p.dims[k], &stride):
                _raise(E_STRIDE)
        if p.offset != offset or p.nbytes != stride:
            _raise(E_LAYOUT)
        next_offset = offset + p.nbytes
        if next_offset < offset:
            _raise(E_OFFSET)
        offset = next_offset
    if offset != d.payload:
        _raise(E_TOTAL)
    return 0


cdef uint64_t _part_wire(int codec, const Part* p, bint capped) except? 0xFFFFFFFFFFFFFFFF:
    """A.4: one part's wire size (F32 parts as the v15 encoded size, capped at 512 MiB)."""
    cdef uint64_t n, columns, size
    if p.ggml_type != 0:
        return p.nbytes
    n = p.nbytes // 4
    columns = <uint64_t>p.dims[0]
    if codec == RAW:
        size = 4 * n
    elif codec == F16 or codec == BF16:
        size = 2 * n
    else:
        size = (n // columns) * (columns + 4)
    if capped and size > MAX_BYTES:
        _raise(E_WIRE_MAX)
    return size


cdef uint64_t _frame_size(int codec, const Desc* d) except? 0xFFFFFFFFFFFFFFFF:
    """A.6.1 after validation."""
    cdef uint64_t total = HEADER + PART * <uint64_t>d.count
    cdef uint32_t i
    for i in range(d.count):
        total += _part_wire(codec, &d.parts[i], True)
    if total > MAX_BYTES:
        _raise(E_FRAME_MAX)
    return total


cdef int _code_parts(int codec, const Desc* d, const uint8_t* src, uint8_t* dst, bint encode) except -1:
    """The payload section part by part, in order; the first error wins (A.4).  Encoding
    reads each part at its payload offset and writes the section packed; decoding (a
    section whose size already matches) reads it packed and writes each part at its offset."""
    cdef uint32_t i
    cdef const Part* p
    cdef uint64_t wire
    for i in range(d.count):
        p = &d.parts[i]
        wire = _part_wire(codec, p, encode)
        if encode:
            _encode_part(codec, p, src + p.offset, dst, wire)
            dst += wire
        else:
            _decode_part(codec, p, src, dst + p.offset, wire)
            src += wire
    return 0


cdef int _encode_part(int codec, const Part* p, const uint8_t* src, uint8_t* out, uint64_t wire) except -1:
    cdef size_t n = <size_t>(p.nbytes // 4)
    cdef int bad
    if p.ggml_type != 0 or codec == RAW:
        memcpy(out, src, p.nbytes)
    elif codec == S8:
        encoded = _codec.encode_activation(S8, n // <size_t>p.dims[0], p.dims[0], _slice(src, p.nbytes), 0)
        memcpy(out, PyBytes_AS_STRING(encoded), wire)
    else:
        with nogil:
            bad = skw_encode_bf16(src, out, n) if codec == BF16 else skw_encode_f16(src, out, n)
        if bad:  # the codec module raises the exact error, in its order
            _codec.encode_activation(codec, n // <size_t>p.dims[0], p.dims[0], _slice(src, p.nbytes), 0)
    return 0


cdef int _decode_part(int codec, const Part* p, const uint8_t* wire, uint8_t* out, uint64_t size) except -1:
    cdef size_t n = <size_t>(p.nbytes // 4)
    cdef int bad
    if p.ggml_type != 0:
        memcpy(out, wire, p.nbytes)
    elif codec == RAW:
        with nogil:
            skw_copy_le32_to_host(wire, out, n)
    elif codec == S8:
        decoded = _codec.decode_activation(S8, n // <size_t>p.dims[0], p.dims[0], _slice(wire, size), 0)
        memcpy(out, PyBytes_AS_STRING(decoded.tobytes()), p.nbytes)
    else:
        with nogil:
            bad = skw_decode_bf16(wire, out, n) if codec == BF16 else skw_decode_f16(wire, out, n)
        if bad:
            _codec.decode_activation(codec, n // <size_t>p.dims[0], p.dims[0], _slice(wire, size), 0)
    return 0


cdef object _slice(const uint8_t* p, uint64_t n):
    return PyBytes_FromStringAndSize(<const char*>p, <Py_ssize_t>n)


cdef int _check_frame_size(int codec, const Desc* d, Py_ssize_t length, int version) except -1:
    """A.6.3 step 4 (v16) / B.6.5 (v17)."""
    cdef uint64_t total = 0
    cdef uint32_t i
    if version == 16:
        if _frame_size(codec, d) != <uint64_t>length:
            _raise(E_FRAME_SIZE)
        return 0
    for i in range(d.count):
        total += _part_wire(codec, &d.parts[i], True)
    if total != <uint64_t>(length - HEADER - PART * <Py_ssize_t>d.count):
        _raise(E_FRAME_SIZE)
    return 0


cdef class _Buffer:
    """A read-only byte buffer held for the duration of a call."""
    cdef Py_buffer view
    cdef bint held

    def __cinit__(self, object obj):
        self.held = False
        if holds_objects(obj):
            raise InvalidInputError("activation must be a C-contiguous bytes-like object")
        try:
            PyObject_GetBuffer(obj, &self.view, PyBUF_SIMPLE)
        except (TypeError, BufferError, ValueError):
            raise InvalidInputError("activation must be a C-contiguous bytes-like object") from None
        self.held = True

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)


# --- the frame API (A.6) ---------------------------------------------------------------------
def validate_frame(desc, payload_len=None):
    cdef Desc d
    _from_object(desc, &d)
    cdef int64_t n = -1
    if payload_len is not None:
        length = wire_int(payload_len)
        # a length no payload can have mismatches at step 4 (MAX + 1 exceeds any valid total)
        n = length if 0 <= length <= MAX_BYTES else MAX_BYTES + 1
    _validate(&d, n)


def frame_wire_bytes(codec, desc):
    cdef int c = _codec_id(codec)
    cdef Desc d
    _from_object(desc, &d)
    _validate(&d, -1)
    return _frame_size(c, &d)


cdef bytes _encode(int c, Desc* d, object payload):
    cdef _Buffer buf = _Buffer(payload)
    _validate(d, buf.view.len)
    cdef uint64_t size = _frame_size(c, d)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>size)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    _write_desc(d, o)
    _code_parts(c, d, <const uint8_t*>buf.view.buf, o + HEADER + PART * d.count, True)
    return out


def encode_frame(codec, desc, payload):
    cdef int c = _codec_id(codec)
    cdef Desc d
    _from_object(desc, &d)
    return _encode(c, &d, payload)


cdef bytes _decode_ptr(int c, Desc* d, const uint8_t* b, Py_ssize_t n, int version, bint with_header):
    """Decode a v16 frame: the logical payload, or with ``with_header`` the RawF32V1 frame."""
    _read_desc(b, n, d)
    _validate(d, -1)
    _check_frame_size(c, d, n, version)
    cdef Py_ssize_t head = HEADER + PART * d.count
    return _finish(c, d, b, b + head, with_header)


cdef bytes _finish(int c, const Desc* d, const uint8_t* header, const uint8_t* wire, bint with_header):
    """The decoded payload (after ``header``, copied, when ``with_header``; NULL: rebuilt)."""
    cdef Py_ssize_t head = HEADER + PART * d.count
    cdef Py_ssize_t skip = head if with_header else 0
    cdef bytes out = PyBytes_FromStringAndSize(NULL, skip + <Py_ssize_t>d.payload)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    if with_header:
        if header != NULL:
            memcpy(o, header, head)
        else:
            _write_desc(d, o)
    _code_parts(c, d, wire, o + skip, False)
    return out


cdef bytes _decode_into(int c, Desc* d, object data, int version, bint with_header):
    cdef _Buffer buf = _Buffer(data)
    return _decode_ptr(c, d, <const uint8_t*>buf.view.buf, buf.view.len, version, with_header)


def decode_frame(codec, data, int version=16):
    cdef int c = _codec_id(codec)
    cdef Desc d
    payload = _decode_into(c, &d, data, version, False)
    return _to_object(&d), payload


include "_frame_gen_select.pxi"
include "_frame_gen_check.pxi"
include "_frame_gen_msg.pxi"
include "_frame_gen_agreed.pxi"
