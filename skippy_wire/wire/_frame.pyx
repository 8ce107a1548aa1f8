# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled stage-message framing (the twin of ``skippy_wire.wire._reference.frame``).

Same kernel functions and semantics as the reference; the difference is how: fields are
loaded byte-wise as little-endian straight from the caller's buffer (no ``struct``, no
intermediate copies), objects are built from C, the writer sizes the output once and
fills one ``bytes`` object, and the activation payload is decoded by the compiled codec
(``skippy_wire.wire._codec``) directly from a view of the input: the decode is the only copy.

The module is complete on its own: it never calls the reference twin.  Its parts, by concern:
``_frame_read.pxi`` (section 4.5), ``_frame_write.pxi`` (4.4) and ``_frame_reply.pxi`` (11.2).
"""

from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE, PyBUF_C_CONTIGUOUS
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF, Py_DECREF
from cpython.dict cimport PyDict_Copy
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport int32_t, uint32_t, int64_t, uint64_t, uint8_t
from libc.string cimport memcpy, memcmp

from skippy_wire.wire._codec cimport (
    OK, Dims, Shape, encoded_size, frame_shape, raise_status,
)
from skippy_wire.wire._le_bytes cimport ld_i32, ld_u32, ld_u64, st_u32, st_u64

cdef extern from "Python.h":
    const char* PyUnicode_AsUTF8AndSize(object, Py_ssize_t*) except NULL
    object PyMemoryView_FromObject(object)
    object PyMemoryView_FromMemory(char*, Py_ssize_t, int)
    int PyBUF_READ
    bint PyBytes_CheckExact(object)
    Py_ssize_t PyBytes_GET_SIZE(object)
    object PyFloat_FromDouble(double)
    ctypedef struct PyTypeObject:
        PyObject* (*tp_new)(PyTypeObject*, PyObject*, PyObject*)
    Py_ssize_t Py_REFCNT(object)
    double PyFloat_AsDouble(object) except? -1.0
    bint PyLong_Check(object)
    object PyNumber_Index(object)

include "_wire_constants.pxi"

from ..errors import InvalidDataError, InvalidInputError, UnexpectedEofError, WireError
from . import _codec
from .constants import SEQUENCE_CHANGED_TEXT, ActivationCodec
from .messages import (
    ACTIVATIONLESS_READ_KINDS,
    ACTIVATIONLESS_WRITE_KINDS,
    F32,
    SAMPLING_WIRE_ORDER,
    LogitBias,
    SamplingConfig,
    StageStateHeader,
    StageWireMessage,
    WireMessageKind,
)
from .field_checks import check_admission, holds_objects, out_of_range_error
from .replies import (
    STATS_FIELDS,
    NativeMtpDraft,
    StageReply,
    StageReplyStats,
    StageReplyWindow,
    WireReplyKind,
    reply_out_of_range_error,
)

# --- kinds and codecs as C values (their definitions: messages.py, constants.py) -----------
cdef int32_t KIND_STOP = WireMessageKind.STOP
cdef int32_t KIND_STATE_IMPORT = WireMessageKind.STATE_IMPORT
cdef int32_t KIND_LIMIT = max(WireMessageKind) + 1  # kinds are looked up in [0, KIND_LIMIT)
# Bit k set: kind k never carries activation (reader list, 4.5 step 7; writer list, 4.4 step 5).
cdef uint64_t ACTIVATIONLESS_READ = sum(1 << int(k) for k in ACTIVATIONLESS_READ_KINDS)
cdef uint64_t ACTIVATIONLESS_WRITE = sum(1 << int(k) for k in ACTIVATIONLESS_WRITE_KINDS)
cdef tuple _KINDS = tuple(
    WireMessageKind(i) if i in WireMessageKind._value2member_map_ else None for i in range(KIND_LIMIT)
)
cdef tuple _REPLY_KINDS = tuple(
    WireReplyKind(i) if i in WireReplyKind._value2member_map_ else None for i in range(max(WireReplyKind) + 1)
)
cdef tuple _CODECS = tuple(
    ActivationCodec(i) if i in ActivationCodec._value2member_map_ else None for i in range(MAX_CODEC + 1)
)


cdef inline bint kind_in(uint64_t mask, int64_t kind) noexcept nogil:
    return 0 <= kind < 64 and (mask >> kind) & 1


cdef int raise_current() except -1:
    return -1  # returning the error value with the exception set propagates it


cdef tuple _NO_ARGS = ()
cdef object _tuple_new = tuple.__new__
# Attribute-dict templates: copying a full-sized dict and overwriting its values avoids
# the resizes of growing a fresh dict field by field (the dominant cost of a read).
cdef dict _SAMPLING_KEYS = dict.fromkeys([name for name, _ in SAMPLING_WIRE_ORDER])
cdef dict _MESSAGE_KEYS = dict.fromkeys(["kind", "pos_start", "token_count", "state", "request_id", "session_id",
                                         "sampling", "chat_sampling_metadata", "tokens", "positions",
                                         "activation", "raw_bytes"])
cdef dict _STATE_KEYS = dict.fromkeys(["version", "seq_id", "phase", "flags", "checkpoint_generation",
                                       "prompt_token_count", "decode_step", "current_token",
                                       "source_stage_index", "activation_codec"])
cdef dict _REPLY_KEYS = dict.fromkeys(["kind", "predicted", "predicted_tokens", "window", "native_mtp_draft", "stats"])
cdef dict _WINDOW_KEYS = dict.fromkeys(["window_id"])
cdef tuple _STATS_NAMES = STATS_FIELDS
cdef dict _STATS_KEYS = dict.fromkeys(_STATS_NAMES)


cdef inline object _instance(type cls, dict values):
    """A plain-class instance with ``values`` as its attribute dict, built without running
    the dataclass ``__init__`` (fields arrive already validated and converted)."""
    cdef PyObject* raw = (<PyTypeObject*>cls).tp_new(<PyTypeObject*>cls, <PyObject*>_NO_ARGS, NULL)
    if raw == NULL:  # tp_new set the exception
        raise_current()
    obj = <object>raw  # takes a second reference ...
    Py_DECREF(obj)     # ... and drops the one tp_new returned
    # through the type's __dict__ descriptor: CPython 3.13 keeps a plain instance's attributes
    # inline, and PyObject_GenericSetDict left them there (every attribute missing)
    obj.__dict__ = values
    return obj


cdef inline object f32_obj(uint32_t bits):
    """A float for an f32 bit pattern; NaNs keep their exact bits as messages.F32."""
    cdef float f
    if (bits & 0x7F800000u) == 0x7F800000u and (bits & 0x007FFFFFu):
        return F32(bits)
    memcpy(&f, &bits, 4)
    return PyFloat_FromDouble(<double>f)


cdef uint32_t f32_bits_of(object value) except? 0xFFFFFFFF:
    """The binary32 pattern a value is written as: what ``struct.pack("<f")`` accepts
    (``__float__`` / ``__index__``, never strings), finite values beyond f32::MAX and ints
    beyond the double range rounding to infinity."""
    cdef float f
    cdef uint32_t bits
    cdef double d
    if type(value) is F32:
        return <uint32_t>(<object>value).bits
    try:
        d = PyFloat_AsDouble(value)
    except OverflowError:  # an int beyond the double range
        return 0xFF800000u if value < 0 else 0x7F800000u
    f = <float>d  # IEEE RNE; finite values beyond f32::MAX round to infinity
    memcpy(&bits, &f, 4)
    return bits


cdef object _eof(Py_ssize_t needed):
    error = UnexpectedEofError()
    error.needed = needed
    return error


include "_frame_read.pxi"
include "_frame_write.pxi"
include "_frame_reply.pxi"
