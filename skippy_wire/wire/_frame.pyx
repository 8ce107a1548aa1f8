# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled stage-message framing (the twin of ``skippy_wire.wire._reference.frame``).

Same kernel functions and semantics as the reference; the difference is how: fields are
loaded byte-wise as little-endian straight from the caller's buffer (no ``struct``, no
intermediate copies), objects are built from C, the writer sizes the output once and
fills one ``bytes`` object, and the activation payload is decoded by the compiled codec
(``skippy_wire.wire._codec``) directly from a view of the input: the decode is the only copy.

Layout and check order: wire-format.md sections 4.4 (writer), 4.5 (reader), 11.2 (replies).
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
    int PyObject_GenericSetDict(object, object, void*) except -1
    double PyFloat_AS_DOUBLE(object)
    bint PyFloat_CheckExact(object)
    bint PyLong_Check(object)
    object PyNumber_Index(object)

from .constants import ActivationCodec, CodecPolicy, LOSSLESS_CODECS
from ..errors import InvalidDataError, InvalidInputError, UnexpectedEofError, WireError
from . import messages as _m
from .messages import (
    F32,
    LogitBias,
    NativeMtpDraft,
    SamplingConfig,
    StageReply,
    StageReplyStats,
    StageReplyWindow,
    StageStateHeader,
    StageWireMessage,
    WireMessageKind,
    WireReplyKind,
    out_of_range_error,
    reply_out_of_range_error,
)

# --- limits (wire-format.md section 1) ---------------------------------------------------
cdef enum:
    STATE_VERSION = 15
    MAX_LOGIT_BIAS = 256
    MAX_SAMPLERS = 16
    MAX_BREAKERS = 8
    MAX_STRING = 64
    MAX_PREDICTED = 262144
    MAX_SIDEBAND = 1048576
    MAX_METADATA = 8388608
    MAX_STATE_IMPORT = 536870912
    MAX_ACTIVATION = 536870912
    MAX_DECODED = 536870912
    F_SAMPLING = 0x08
    F_CHAT = 0x20
    F_DOUBLING = 0x140
    # F_DOUBLING = RWKV7_V_FIRST | INKLING_MTP_EMBD (GEMMA3N never doubles)

cdef tuple _KINDS = tuple(
    WireMessageKind(i) if i in WireMessageKind._value2member_map_ else None for i in range(23)
)
cdef tuple _REPLY_KINDS = (None, WireReplyKind.ACK, WireReplyKind.PREDICTED_TOKEN, WireReplyKind.PREDICTED_TOKENS)
cdef tuple _CODECS = (None,) + tuple(ActivationCodec(i) for i in range(1, 5))
cdef object _STOP = WireMessageKind.STOP
cdef object _STATE_IMPORT = WireMessageKind.STATE_IMPORT
cdef int raise_current() except -1:
    return -1  # returning the error value with the exception set propagates it


cdef tuple _NO_ARGS = ()
cdef object _tuple_new = tuple.__new__
# Attribute-dict templates: copying a full-sized dict and overwriting its values avoids
# the resizes of growing a fresh dict field by field (the dominant cost of a read).
cdef dict _SAMPLING_KEYS = dict.fromkeys([name for name, _ in _m.SAMPLING_WIRE_ORDER])
cdef dict _MESSAGE_KEYS = dict.fromkeys(["kind", "pos_start", "token_count", "state", "request_id", "session_id",
                                         "sampling", "chat_sampling_metadata", "tokens", "positions",
                                         "activation", "raw_bytes"])
cdef dict _STATE_KEYS = dict.fromkeys(["version", "seq_id", "phase", "flags", "checkpoint_generation",
                                       "prompt_token_count", "decode_step", "current_token",
                                       "source_stage_index", "activation_codec"])


cdef inline object _instance(type cls, dict values):
    """A plain-class instance with ``values`` as its attribute dict, built without running
    the dataclass ``__init__`` (fields arrive already validated and converted)."""
    cdef PyObject* raw = (<PyTypeObject*>cls).tp_new(<PyTypeObject*>cls, <PyObject*>_NO_ARGS, NULL)
    if raw == NULL:  # tp_new set the exception
        raise_current()
    obj = <object>raw  # takes a second reference ...
    Py_DECREF(obj)     # ... and drops the one tp_new returned
    PyObject_GenericSetDict(obj, values, NULL)
    return obj

_codec_module = None


cdef object _codec():
    # Imported on first use so that the framing module loads even before the compiled
    # codec is built (its absence is then reported when an activation is decoded).
    global _codec_module
    if _codec_module is None:
        from . import _codec as module
        _codec_module = module
    return _codec_module


# --- little-endian loads/stores (byte-wise: payloads are unaligned, STYLE) -------------------
cdef inline uint32_t ld_u32(const uint8_t* p) noexcept nogil:
    return <uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16) | (<uint32_t>p[3] << 24)

cdef inline int32_t ld_i32(const uint8_t* p) noexcept nogil:
    return <int32_t>ld_u32(p)

cdef inline uint64_t ld_u64(const uint8_t* p) noexcept nogil:
    return <uint64_t>ld_u32(p) | (<uint64_t>ld_u32(p + 4) << 32)

cdef inline void st_u32(uint8_t* p, uint32_t v) noexcept nogil:
    p[0] = v & 0xff
    p[1] = (v >> 8) & 0xff
    p[2] = (v >> 16) & 0xff
    p[3] = (v >> 24) & 0xff

cdef inline void st_u64(uint8_t* p, uint64_t v) noexcept nogil:
    st_u32(p, <uint32_t>(v & 0xffffffffu))
    st_u32(p + 4, <uint32_t>(v >> 32))


cdef inline object f32_obj(uint32_t bits):
    """A float for an f32 bit pattern; NaNs keep their exact bits as messages.F32."""
    cdef float f
    if (bits & 0x7F800000u) == 0x7F800000u and (bits & 0x007FFFFFu):
        return F32(bits)
    memcpy(&f, &bits, 4)
    return PyFloat_FromDouble(<double>f)


cdef uint32_t f32_bits_of(object value) except? 0xFFFFFFFF:
    cdef float f
    cdef uint32_t bits
    cdef double d
    if type(value) is F32:
        return <uint32_t>(<object>value).bits
    try:
        d = PyFloat_AS_DOUBLE(value) if PyFloat_CheckExact(value) else float(value)
    except OverflowError:  # an int beyond the double range: RNE to infinity like the twin
        return 0xFF800000u if value < 0 else 0x7F800000u
    f = <float>d  # IEEE RNE; finite values beyond f32::MAX round to infinity
    memcpy(&bits, &f, 4)
    return bits


cdef object _eof(Py_ssize_t needed):
    error = UnexpectedEofError()
    error.needed = needed
    return error


# --- the f32 payload exporter -------------------------------------------------------------
cdef class _ReadOnlyBytes:
    """Exports an owned array's memory as a read-only flat byte buffer (format "B"), so
    that the message's activation is a read-only memoryview with no extra copy."""

    cdef object owner
    cdef Py_buffer src
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]

    def __cinit__(self, owner):
        PyObject_GetBuffer(owner, &self.src, PyBUF_SIMPLE)
        self.owner = owner
        self.shape[0] = self.src.len
        self.strides[0] = 1

    def __dealloc__(self):
        if self.owner is not None:
            PyBuffer_Release(&self.src)

    def __getbuffer__(self, Py_buffer* view, int flags):
        if flags & 0x0001:  # PyBUF_WRITABLE
            raise BufferError("the decoded activation is read-only")
        view.buf = self.src.buf
        view.obj = self
        view.len = self.src.len
        view.readonly = 1
        view.itemsize = 1
        view.format = "B"
        view.ndim = 1
        view.shape = self.shape
        view.strides = self.strides
        view.suboffsets = NULL
        view.internal = NULL

    def __releasebuffer__(self, Py_buffer* view):
        pass


cdef object _readonly_view(object values):
    cdef _ReadOnlyBytes exporter = _ReadOnlyBytes.__new__(_ReadOnlyBytes, values)
    return PyMemoryView_FromObject(exporter)


# --- activation sizes (sections 5.1-5.3), inline to keep the header walk call-free ---------
cdef uint64_t _elements(int32_t token_count, int32_t n_embd, int32_t flags, uint64_t* rows) except? 0:
    if token_count < 0 or n_embd <= 0:
        raise InvalidDataError("negative activation dimensions")
    rows[0] = <uint64_t>token_count * (2 if flags & F_DOUBLING else 1)
    return rows[0] * <uint64_t>n_embd  # < 2**63 for i32 inputs: no overflow possible


cdef uint64_t _wire_bytes(int codec, int32_t token_count, int32_t n_embd, int32_t flags) except? 0:
    cdef uint64_t rows = 0
    cdef uint64_t elements = _elements(token_count, n_embd, flags, &rows)
    cdef uint64_t size
    if codec == 1:
        if elements > (<uint64_t>0xFFFFFFFFFFFFFFFF) // 4:
            raise InvalidDataError("activation wire byte count overflow")
        size = elements * 4
    elif codec == 2 or codec == 3:
        size = elements * 2
    else:
        size = rows * (<uint64_t>n_embd + 4)
    if size > MAX_ACTIVATION:
        raise InvalidDataError("activation payload byte count exceeds maximum")
    return size


# --- reading --------------------------------------------------------------------------------
cdef struct Cur:
    const uint8_t* p
    Py_ssize_t pos
    Py_ssize_t start
    Py_ssize_t end


cdef inline int need(Cur* c, Py_ssize_t n) except -1:
    # Every length is checked against the bytes actually present before it is used.
    if n > c.end - c.pos:
        raise _eof(c.pos - c.start + n)
    return 0


cdef inline int32_t rd_i32(Cur* c) except? -1:
    need(c, 4)
    cdef int32_t v = ld_i32(c.p + c.pos)
    c.pos += 4
    return v


cdef inline uint32_t rd_u32(Cur* c) except? 0xFFFFFFFF:
    need(c, 4)
    cdef uint32_t v = ld_u32(c.p + c.pos)
    c.pos += 4
    return v


cdef list rd_i32_list(Cur* c, Py_ssize_t n):
    need(c, 4 * n)
    cdef list out = PyList_New(n)
    cdef Py_ssize_t i
    cdef object v
    cdef const uint8_t* q = c.p + c.pos
    for i in range(n):
        v = ld_i32(q + 4 * i)
        Py_INCREF(v)
        PyList_SET_ITEM(out, i, v)
    c.pos += 4 * n
    return out


# The last string list read at each of the two places of the sampling block, as one
# (wire bytes, values) tuple: senders repeat the same sampler chain, so a byte compare
# replaces the UTF-8 decodes (the returned list is always a fresh copy).
cdef list _string_caches = [None, None]


cdef list rd_strings_cached(Cur* c, uint32_t maximum, int slot):
    cdef tuple entry = _string_caches[slot]
    cdef bytes raw
    cdef Py_ssize_t start = c.pos, n
    cdef list values
    if entry is not None:
        raw = <bytes>entry[0]
        n = len(raw)
        if n <= c.end - c.pos and memcmp(c.p + c.pos, PyBytes_AS_STRING(raw), n) == 0:
            c.pos += n
            return list(<list>entry[1])
    values = rd_strings(c, maximum)
    if c.pos - start <= 1024:
        _string_caches[slot] = (PyBytes_FromStringAndSize(<const char*>(c.p + start), c.pos - start), list(values))
    return values


cdef list rd_strings(Cur* c, uint32_t maximum):
    cdef uint32_t count = rd_u32(c)
    cdef uint32_t i, length
    if count > maximum:
        raise InvalidDataError("sampling string count exceeds maximum")
    cdef list out = []
    for i in range(count):
        length = rd_u32(c)
        if length > MAX_STRING:
            raise InvalidDataError("sampling string exceeds maximum length")
        need(c, length)
        try:
            s = PyUnicode_DecodeUTF8(<const char*>(c.p + c.pos), length, "strict")
        except UnicodeDecodeError:
            raise InvalidDataError("sampling string is not UTF-8") from None
        c.pos += length
        out.append(s)
    return out


cdef object rd_sampling(Cur* c):
    """Section 4.3 in wire order, straight into the instance dict."""
    cdef dict d = PyDict_Copy(_SAMPLING_KEYS)
    cdef uint32_t count, i
    cdef int32_t token
    d["flags"] = rd_u32(c)
    d["seed"] = rd_u32(c)
    d["temperature"] = f32_obj(rd_u32(c))
    d["top_p"] = f32_obj(rd_u32(c))
    d["top_k"] = rd_i32(c)
    d["min_p"] = f32_obj(rd_u32(c))
    d["presence_penalty"] = f32_obj(rd_u32(c))
    d["frequency_penalty"] = f32_obj(rd_u32(c))
    d["repeat_penalty"] = f32_obj(rd_u32(c))
    d["penalty_last_n"] = rd_i32(c)
    count = rd_u32(c)
    if count > MAX_LOGIT_BIAS:
        raise InvalidDataError("logit bias count exceeds maximum")
    need(c, 8 * count)  # entries carry no checks: wait for all of them at once
    biases = PyList_New(count)
    for i in range(count):
        pair = _tuple_new(LogitBias, (ld_i32(c.p + c.pos), f32_obj(ld_u32(c.p + c.pos + 4))))
        Py_INCREF(pair)
        PyList_SET_ITEM(biases, i, pair)
        c.pos += 8
    d["logit_bias"] = biases
    d["typical_p"] = f32_obj(rd_u32(c))
    d["top_nsigma"] = f32_obj(rd_u32(c))
    d["dynatemp_range"] = f32_obj(rd_u32(c))
    d["dynatemp_exponent"] = f32_obj(rd_u32(c))
    d["dry_multiplier"] = f32_obj(rd_u32(c))
    d["dry_base"] = f32_obj(rd_u32(c))
    d["dry_allowed_length"] = rd_i32(c)
    d["dry_penalty_last_n"] = rd_i32(c)
    d["dry_sequence_breakers"] = rd_strings_cached(c, MAX_BREAKERS, 0)
    d["xtc_probability"] = f32_obj(rd_u32(c))
    d["xtc_threshold"] = f32_obj(rd_u32(c))
    d["mirostat_mode"] = rd_i32(c)
    d["mirostat_entropy"] = f32_obj(rd_u32(c))
    d["mirostat_learning_rate"] = f32_obj(rd_u32(c))
    d["samplers"] = rd_strings_cached(c, MAX_SAMPLERS, 1)
    d["ignore_eos"] = rd_u32(c) != 0
    return _instance(SamplingConfig, d)


# The last sampling block read, as one (wire bytes, field values) tuple replaced atomically
# (threads never see a mismatched pair).  A session repeats the same block in every
# message, so a byte compare replaces the field walk; the result is a fresh instance with
# fresh lists (the values themselves are immutable).
cdef tuple _sampling_cache = None


cdef object rd_sampling_cached(Cur* c):
    global _sampling_cache
    cdef tuple entry = _sampling_cache
    cdef bytes raw
    cdef dict values, d
    cdef Py_ssize_t n, start = c.pos
    if entry is not None:
        raw = <bytes>entry[0]
        values = <dict>entry[1]
        n = len(raw)
        if n <= c.end - c.pos and memcmp(c.p + c.pos, PyBytes_AS_STRING(raw), n) == 0:
            # identical bytes parse identically (the block is self-delimiting)
            c.pos += n
            d = PyDict_Copy(values)
            d["logit_bias"] = list(<list>values["logit_bias"])
            d["dry_sequence_breakers"] = list(<list>values["dry_sequence_breakers"])
            d["samplers"] = list(<list>values["samplers"])
            return _instance(SamplingConfig, d)
    sampling = rd_sampling(c)
    if c.pos - start <= 4096:
        d = PyDict_Copy(sampling.__dict__)
        d["logit_bias"] = list(d["logit_bias"])
        d["dry_sequence_breakers"] = list(d["dry_sequence_breakers"])
        d["samplers"] = list(d["samplers"])
        _sampling_cache = (PyBytes_FromStringAndSize(<const char*>(c.p + start), c.pos - start), d)
    return sampling


cdef object _message(object kind, int32_t pos_start, int32_t token_count, object state,
                     uint64_t request_id, uint64_t session_id, object sampling, object metadata,
                     object tokens, object positions, object activation, object raw_bytes):
    cdef dict d = PyDict_Copy(_MESSAGE_KEYS)
    d["kind"] = kind
    d["pos_start"] = pos_start
    d["token_count"] = token_count
    d["state"] = state
    d["request_id"] = request_id
    d["session_id"] = session_id
    d["sampling"] = sampling
    d["chat_sampling_metadata"] = metadata
    d["tokens"] = tokens
    d["positions"] = positions
    d["activation"] = activation
    d["raw_bytes"] = raw_bytes
    return _instance(StageWireMessage, d)


def read_stage_message_from_buffer(data, n_embd_obj, expected_codec=None, int policy=0, Py_ssize_t offset=0):
    """Parse one stage message at ``offset`` of a bytes-like object -> (message, consumed).

    Same contract as the reference twin; a short buffer raises UnexpectedEofError whose
    ``needed`` is the byte count (from ``offset``) required at that point.
    """
    cdef long long n_embd_ll = n_embd_obj
    if n_embd_ll < -2147483648 or n_embd_ll > 2147483647:
        raise InvalidInputError("n_embd does not fit in i32")
    cdef Py_buffer view
    if PyBytes_CheckExact(data):  # common case: no buffer export needed
        if offset < 0 or offset > PyBytes_GET_SIZE(data):
            raise ValueError("offset outside the buffer")
        return _read_message(<const uint8_t*>PyBytes_AS_STRING(data), PyBytes_GET_SIZE(data),
                             <int32_t>n_embd_ll, expected_codec, policy, offset)
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if offset < 0 or offset > view.len:
            raise ValueError("offset outside the buffer")
        return _read_message(<const uint8_t*>view.buf, view.len, <int32_t>n_embd_ll, expected_codec, policy, offset)
    finally:
        PyBuffer_Release(&view)


cdef tuple _read_message(const uint8_t* buf, Py_ssize_t length, int32_t n_embd, object expected_codec,
                         int policy, Py_ssize_t offset):
    cdef Cur c
    c.p = buf
    c.pos = offset
    c.start = offset
    c.end = length
    cdef int32_t kind_id, pos_start, token_count, tsc, psc, codec_id, wire_count, flags, source
    cdef int32_t h[9]
    cdef uint64_t request_id, session_id, expected_bytes = 0
    cdef uint32_t meta_len
    cdef int i
    cdef Py_ssize_t body
    # 1. kind
    kind_id = rd_i32(&c)
    kind = _KINDS[kind_id] if 0 <= kind_id < 23 else None
    if kind is None:
        raise InvalidDataError("unknown stage message kind")
    # 2. counts (validated in steps 11-12)
    # (nothing is checked before the codec id: wait for all 56 bytes at once)
    need(&c, 56)
    pos_start = ld_i32(c.p + c.pos)
    token_count = ld_i32(c.p + c.pos + 4)
    tsc = ld_i32(c.p + c.pos + 8)
    psc = ld_i32(c.p + c.pos + 12)
    c.pos += 16
    # 3. header: nine words, then the codec id (checked before the version, 3.1)
    for i in range(9):
        h[i] = ld_i32(c.p + c.pos + 4 * i)
    c.pos += 36
    codec_id = rd_i32(&c)
    if codec_id < 1 or codec_id > 4:
        raise InvalidDataError("unknown stage activation codec")
    codec = _CODECS[codec_id]
    # 4.
    if h[0] != STATE_VERSION:
        raise InvalidDataError("unsupported stage state version")
    # 5.
    wire_count = rd_i32(&c)
    if wire_count < 0:
        raise InvalidDataError("negative activation payload byte count")
    if wire_count > MAX_ACTIVATION:
        raise InvalidDataError("activation payload byte count exceeds maximum")
    # 6.
    need(&c, 16)
    request_id = ld_u64(c.p + c.pos)
    session_id = ld_u64(c.p + c.pos + 8)
    c.pos += 16
    flags = h[3]
    source = h[8]
    # 7. activation admission before any variable-length part
    if kind_id == 3 or kind_id == 7 or 15 <= kind_id <= 17 or source < 0:
        if wire_count != 0:
            raise InvalidDataError("activationless stage message contains activation payload")
    else:
        if expected_codec is not None and not _permits(policy, expected_codec, codec_id):
            raise InvalidDataError("stage activation codec mismatch")
        expected_bytes = _wire_bytes(codec_id, token_count, n_embd, flags)
        if <uint64_t>wire_count != expected_bytes:
            raise InvalidDataError("activation payload size mismatch")
        # 7d: the decoded f32 size; shape already validated, no overflow possible
        if <uint64_t>token_count * (2 if flags & F_DOUBLING else 1) * <uint64_t>n_embd * 4 > MAX_DECODED:
            raise InvalidDataError("decoded activation payload byte count exceeds maximum")
    cdef dict sd = PyDict_Copy(_STATE_KEYS)
    sd["version"] = h[0]
    sd["seq_id"] = h[1]
    sd["phase"] = h[2]
    sd["flags"] = flags
    sd["checkpoint_generation"] = h[4]
    sd["prompt_token_count"] = h[5]
    sd["decode_step"] = h[6]
    sd["current_token"] = h[7]
    sd["source_stage_index"] = source
    sd["activation_codec"] = codec
    state = _instance(StageStateHeader, sd)
    # 8.
    sampling = rd_sampling_cached(&c) if flags & F_SAMPLING else None
    # 9.
    metadata = None
    if flags & F_CHAT:
        meta_len = rd_u32(&c)
        if meta_len > MAX_METADATA:
            raise InvalidDataError("chat sampling metadata length exceeds maximum")
        need(&c, meta_len)
        try:
            metadata = PyUnicode_DecodeUTF8(<const char*>(c.p + c.pos), meta_len, "strict")
        except UnicodeDecodeError:
            raise InvalidDataError("chat sampling metadata is not UTF-8") from None
        c.pos += meta_len
    # 10. Stop ends after the metadata; counts neither validated nor consumed
    if kind_id == 3:
        return _message(kind, pos_start, token_count, state, request_id, session_id, sampling, metadata,
                        [], [], b"", b""), c.pos - c.start
    # 11.-12.
    if token_count < 0 or tsc < 0 or psc < 0:
        raise InvalidDataError("negative wire count")
    if tsc > MAX_SIDEBAND:
        raise InvalidDataError("token sideband count exceeds maximum")
    if psc > MAX_SIDEBAND:
        raise InvalidDataError("position sideband count exceeds maximum")
    # 13. StateImport: raw bytes only
    if kind_id == 7:
        if token_count > MAX_STATE_IMPORT:
            raise InvalidDataError("state import byte count exceeds maximum")
        need(&c, token_count)
        raw = PyBytes_FromStringAndSize(<const char*>(c.p + c.pos), token_count)
        c.pos += token_count
        return _message(kind, pos_start, token_count, state, request_id, session_id, sampling, metadata,
                        [], [], b"", raw), c.pos - c.start
    # Nothing after this point can fail but a short read: require the whole body at once.
    body = 4 * <Py_ssize_t>tsc + 4 * <Py_ssize_t>psc + <Py_ssize_t>expected_bytes
    need(&c, body)
    # 14.
    tokens = rd_i32_list(&c, tsc)
    positions = rd_i32_list(&c, psc)
    # 15. decode from a view of the input: the only copy of the payload
    activation = b""
    if expected_bytes:
        # A view of the caller's buffer, valid while this call holds that buffer; released
        # right after the decode, which returns an array owning its memory.
        wire = PyMemoryView_FromMemory(<char*>(c.p + c.pos), <Py_ssize_t>expected_bytes, PyBUF_READ)
        try:
            values = _codec().decode_activation(codec_id, token_count, n_embd, wire, flags)
        finally:
            if Py_REFCNT(wire) > 1:  # something kept the view: invalidate it
                wire.release()
        activation = _readonly_view(values)
        c.pos += <Py_ssize_t>expected_bytes
    return _message(kind, pos_start, token_count, state, request_id, session_id, sampling, metadata,
                    tokens, positions, activation, b""), c.pos - c.start


cdef bint _permits(int policy, object configured, int frame_codec):
    cdef int conf = configured
    if policy == 0:  # Fixed: exactly the configured codec
        return conf == frame_codec
    # AutoLosslessV1: configured RawF32V1, frame codec in {Raw, BF16, F16} (S8 excluded)
    return conf == 1 and 1 <= frame_codec <= 3


# --- writing --------------------------------------------------------------------------------
cdef class _Out:
    """One bytes object sized up front and filled in order; ``partial()`` is what upstream
    would have emitted when a check fails part-way."""

    cdef object data
    cdef uint8_t* p
    cdef Py_ssize_t pos
    cdef Py_ssize_t cap

    cdef int init(self, Py_ssize_t cap) except -1:
        self.data = PyBytes_FromStringAndSize(NULL, cap)
        self.p = <uint8_t*>PyBytes_AS_STRING(self.data)
        self.pos = 0
        self.cap = cap
        return 0

    cdef inline int u32(self, uint32_t v) except -1:
        if self.pos + 4 > self.cap:
            raise AssertionError("framing size estimate too small")
        st_u32(self.p + self.pos, v)
        self.pos += 4
        return 0

    cdef inline int u64(self, uint64_t v) except -1:
        if self.pos + 8 > self.cap:
            raise AssertionError("framing size estimate too small")
        st_u64(self.p + self.pos, v)
        self.pos += 8
        return 0

    cdef inline int raw(self, const void* src, Py_ssize_t n) except -1:
        if self.pos + n > self.cap:
            raise AssertionError("framing size estimate too small")
        memcpy(self.p + self.pos, src, n)
        self.pos += n
        return 0

    cdef object partial(self):
        return PyBytes_FromStringAndSize(<char*>self.p, self.pos)

    cdef object finish(self):
        if self.pos != self.cap:  # cannot happen: the size is computed from the same fields
            raise AssertionError("framing size estimate mismatch")
        result = self.data
        self.data = None
        return result


# Wire integers accept ints and integer-likes (``__index__``: IntEnum, numpy ints), never
# floats; anything else falls back to the twin, which names the field (see write_*).
cdef inline object _idx(object v):
    return v if PyLong_Check(v) else PyNumber_Index(v)


cdef inline uint32_t as_i32(object v) except? 0xFFFFFFFF:
    cdef int32_t x = _idx(v)
    return <uint32_t>x


cdef inline uint32_t as_u32(object v) except? 0xFFFFFFFF:
    cdef uint32_t x = _idx(v)
    return x


cdef inline uint64_t as_u64(object v) except? 0xFFFFFFFFFFFFFFFF:
    cdef uint64_t x = _idx(v)
    return x


cdef inline uint64_t as_i64(object v) except? 0xFFFFFFFFFFFFFFFF:
    cdef int64_t x = _idx(v)
    return <uint64_t>x


cdef int _write_i32_seq(_Out out, object seq, Py_ssize_t n) except -1:
    cdef Py_ssize_t i
    cdef list lst
    if type(seq) is list:
        lst = <list>seq
        for i in range(n):
            out.u32(as_i32(lst[i]))
    else:
        i = 0
        for v in seq:
            if i >= n:
                break
            out.u32(as_i32(v))
            i += 1
    return 0


cdef Py_ssize_t _strings_size(object values, Py_ssize_t maximum) except -1:
    cdef Py_ssize_t size = 4, i = 0, n
    for s in values:
        if i >= maximum:
            break
        PyUnicode_AsUTF8AndSize(s, &n)
        size += 4 + n
        i += 1
    return size


cdef int _write_strings(_Out out, object values, Py_ssize_t maximum) except -1:
    cdef list chosen = list(values)[:maximum]  # silently truncated (4.3)
    cdef Py_ssize_t n
    cdef const char* s
    out.u32(len(chosen))
    for value in chosen:
        s = PyUnicode_AsUTF8AndSize(value, &n)
        if n > MAX_STRING:
            # InvalidData even on the writer side (section 4.3).
            raise InvalidDataError("sampling string exceeds maximum length")
        out.u32(<uint32_t>n)
        out.raw(s, n)
    return 0


cdef Py_ssize_t _sampling_size(object s) except -1:
    cdef Py_ssize_t n = 108 + 8 * min(len(s.logit_bias), MAX_LOGIT_BIAS)
    n += _strings_size(s.dry_sequence_breakers, MAX_BREAKERS) - 4
    n += _strings_size(s.samplers, MAX_SAMPLERS) - 4
    return n


cdef int _write_sampling(_Out out, object s) except -1:
    cdef dict d = s.__dict__ if hasattr(s, "__dict__") else None
    if d is None or len(d) != 27:
        d = {name: getattr(s, name) for name, _ in _m.SAMPLING_WIRE_ORDER}
    out.u32(as_u32(d["flags"]))
    out.u32(as_u32(d["seed"]))
    out.u32(f32_bits_of(d["temperature"]))
    out.u32(f32_bits_of(d["top_p"]))
    out.u32(as_i32(d["top_k"]))
    out.u32(f32_bits_of(d["min_p"]))
    out.u32(f32_bits_of(d["presence_penalty"]))
    out.u32(f32_bits_of(d["frequency_penalty"]))
    out.u32(f32_bits_of(d["repeat_penalty"]))
    out.u32(as_i32(d["penalty_last_n"]))
    cdef list biases = list(d["logit_bias"])[:MAX_LOGIT_BIAS]
    out.u32(len(biases))
    for token, bias in biases:
        out.u32(as_i32(token))
        out.u32(f32_bits_of(bias))
    out.u32(f32_bits_of(d["typical_p"]))
    out.u32(f32_bits_of(d["top_nsigma"]))
    out.u32(f32_bits_of(d["dynatemp_range"]))
    out.u32(f32_bits_of(d["dynatemp_exponent"]))
    out.u32(f32_bits_of(d["dry_multiplier"]))
    out.u32(f32_bits_of(d["dry_base"]))
    out.u32(as_i32(d["dry_allowed_length"]))
    out.u32(as_i32(d["dry_penalty_last_n"]))
    _write_strings(out, d["dry_sequence_breakers"], MAX_BREAKERS)
    out.u32(f32_bits_of(d["xtc_probability"]))
    out.u32(f32_bits_of(d["xtc_threshold"]))
    out.u32(as_i32(d["mirostat_mode"]))
    out.u32(f32_bits_of(d["mirostat_entropy"]))
    out.u32(f32_bits_of(d["mirostat_learning_rate"]))
    _write_strings(out, d["samplers"], MAX_SAMPLERS)
    out.u32(1 if d["ignore_eos"] else 0)
    return 0


def write_stage_message(msg):
    """Serialize a stage message (section 4.4); on a failed check the exception's
    ``partial`` holds the bytes upstream would already have emitted."""
    cdef _Out out = _Out.__new__(_Out)
    try:
        return _write_message(out, msg)
    except WireError as error:
        error.partial = out.partial() if out.data is not None else b""
        raise
    except (OverflowError, TypeError, ValueError, AttributeError):
        # A value the wire cannot represent: let the twin walk the message so that the
        # error (class, text, and which check comes first) is exactly the reference's.
        from ._reference import frame as twin
        return twin.write_stage_message(msg)


cdef object _write_message(_Out out, object msg):
    cdef Py_buffer act
    cdef Py_buffer raw
    cdef bint have_act = False, have_raw = False
    cdef Py_ssize_t ntok, npos, cap, meta_n = 0
    cdef const char* meta_p = NULL
    cdef uint32_t flags
    cdef int32_t kind = <int32_t>as_i32(msg.kind)
    cdef int32_t pos_start = <int32_t>as_i32(msg.pos_start)
    cdef int32_t token_count = <int32_t>as_i32(msg.token_count)
    tokens = msg.tokens
    positions = msg.positions
    ntok = len(tokens)
    npos = len(positions)
    state = msg.state
    sampling = msg.sampling
    metadata = msg.chat_sampling_metadata
    try:
        # Acquire the payload buffers first (their errors are raised at their step below)
        # and size the output of a successful write once.
        try:
            PyObject_GetBuffer(msg.activation, &act, PyBUF_C_CONTIGUOUS)
            have_act = True
        except (TypeError, ValueError, BufferError):
            pass
        if kind == 7:
            try:
                PyObject_GetBuffer(msg.raw_bytes, &raw, PyBUF_C_CONTIGUOUS)
                have_raw = True
            except (TypeError, ValueError, BufferError):
                pass
        cap = 80
        if sampling is not None:
            cap += _sampling_size(sampling)
        if metadata is not None:
            meta_p = PyUnicode_AsUTF8AndSize(metadata, &meta_n)
            cap += 4 + meta_n
        if kind == 7:
            cap += raw.len if have_raw else 0
        else:
            cap += 4 * ntok + 4 * npos + (act.len if have_act else 0)
        out.init(cap)
        # 1.
        out.u32(<uint32_t>kind)
        out.u32(<uint32_t>pos_start)
        out.u32(<uint32_t>token_count)
        # 2.-3.
        if ntok > MAX_SIDEBAND:
            raise InvalidInputError("too many tokens")
        out.u32(<uint32_t>ntok)
        if npos > MAX_SIDEBAND:
            raise InvalidInputError("too many position sideband values")
        out.u32(<uint32_t>npos)
        sd = state.__dict__
        # 5. activation count; Stop is not in the writer's activation-less list (4.6)
        if not have_act:
            raise InvalidInputError("activation must be a C-contiguous bytes-like object")
        if kind == 7 or 15 <= kind <= 17 or sd["source_stage_index"] < 0:
            if act.len:
                raise InvalidInputError("activationless stage message contains activation payload")
            count = 0
        else:
            if act.len > MAX_ACTIVATION:
                raise InvalidInputError("activation payload byte count exceeds maximum")
            count = act.len
        # 4. + 6. the writer owns the SAMPLING / CHAT_SAMPLING_METADATA bits
        flags = as_i32(sd["flags"]) & ~(<uint32_t>(F_SAMPLING | F_CHAT))
        if sampling is not None:
            flags |= F_SAMPLING
        if metadata is not None:
            flags |= F_CHAT
        out.u32(as_i32(sd["version"]))
        out.u32(as_i32(sd["seq_id"]))
        out.u32(as_i32(sd["phase"]))
        out.u32(flags)
        out.u32(as_i32(sd["checkpoint_generation"]))
        out.u32(as_i32(sd["prompt_token_count"]))
        out.u32(as_i32(sd["decode_step"]))
        out.u32(as_i32(sd["current_token"]))
        out.u32(as_i32(sd["source_stage_index"]))
        out.u32(as_i32(sd["activation_codec"]))
        out.u32(<uint32_t>count)
        out.u64(as_u64(msg.request_id))
        out.u64(as_u64(msg.session_id))
        # 7.
        if sampling is not None:
            _write_sampling(out, sampling)
        # 8.
        if metadata is not None:
            if meta_n > MAX_METADATA:
                raise InvalidInputError("chat sampling metadata is too large")
            out.u32(<uint32_t>meta_n)
            out.raw(meta_p, meta_n)
        # 9.
        if kind == 7:
            if not have_raw:
                raise InvalidInputError("raw_bytes must be a C-contiguous bytes-like object")
            if token_count < 0 or token_count != raw.len:
                raise InvalidInputError("state import raw byte count mismatch")
            if token_count > MAX_STATE_IMPORT:
                raise InvalidInputError("state import raw byte count exceeds maximum")
            out.raw(raw.buf, raw.len)
            return out.finish()
        # 10.
        _write_i32_seq(out, tokens, ntok)
        _write_i32_seq(out, positions, npos)
        out.raw(act.buf, act.len)
        return out.finish()
    finally:
        if have_act:
            PyBuffer_Release(&act)
        if have_raw:
            PyBuffer_Release(&raw)


# --- replies (section 11.2) -----------------------------------------------------------------
def write_reply(reply):
    """Serialize a reply (``send_reply_message``)."""
    cdef _Out out = _Out.__new__(_Out)
    try:
        return _write_reply(out, reply)
    except WireError as error:
        error.partial = out.partial() if out.data is not None else b""
        raise
    except (OverflowError, TypeError, ValueError, AttributeError):
        from ._reference import frame as twin
        return twin.write_reply(reply)


cdef object _write_reply(_Out out, object reply):
    tokens = reply.predicted_tokens
    cdef Py_ssize_t n = len(tokens), nd = 0
    draft = reply.native_mtp_draft
    if n > MAX_PREDICTED:
        raise InvalidInputError("too many predicted tokens")
    if draft is not None:
        nd = len(draft.token_ids)
    out.init(12 + 4 * n + 8 + (4 + 4 * nd + 8 if draft is not None else 0) + 27 * 8)
    out.u32(as_i32(reply.kind))
    out.u32(as_i32(reply.predicted))
    out.u32(<uint32_t>n)
    _write_i32_seq(out, tokens, n)
    out.u32(as_i32(reply.window.window_id))
    if draft is None:
        out.u32(0)
    else:
        if nd > MAX_PREDICTED:
            raise InvalidInputError("too many native MTP draft tokens")
        out.u32(1)
        out.u32(<uint32_t>nd)
        _write_i32_seq(out, draft.token_ids, nd)
        out.u64(as_i64(draft.proposal_compute_us))
    stats = reply.stats
    for name in _m._STATS_FIELDS:
        out.u64(as_i64(getattr(stats, name)))
    return out.finish()


def read_reply_from_buffer(data, Py_ssize_t offset=0):
    """Parse one reply at ``offset`` -> (reply, consumed) (section 11.2 order)."""
    cdef Py_buffer view
    cdef Cur c
    cdef int32_t kind_id, predicted, count, marker, dcount
    cdef int i
    PyObject_GetBuffer(data, &view, PyBUF_SIMPLE)
    try:
        if offset < 0 or offset > view.len:
            raise ValueError("offset outside the buffer")
        c.p = <const uint8_t*>view.buf
        c.pos = offset
        c.start = offset
        c.end = view.len
        kind_id = rd_i32(&c)
        if kind_id < 1 or kind_id > 3:
            raise InvalidDataError("unknown stage reply kind")
        predicted = rd_i32(&c)
        count = rd_i32(&c)
        if count < 0:
            raise InvalidDataError("negative predicted token count")
        if count > MAX_PREDICTED:
            raise InvalidDataError("predicted token count exceeds maximum")
        tokens = rd_i32_list(&c, count)
        window = StageReplyWindow(rd_i32(&c))
        marker = rd_i32(&c)
        draft = None
        if marker == 1:
            dcount = rd_i32(&c)
            if dcount < 0:
                raise InvalidDataError("negative native MTP draft token count")
            if dcount > MAX_PREDICTED:
                raise InvalidDataError("native MTP draft token count exceeds maximum")
            draft_tokens = rd_i32_list(&c, dcount)
            need(&c, 8)
            draft = NativeMtpDraft(draft_tokens, <int64_t>ld_u64(c.p + c.pos))
            c.pos += 8
        elif marker != 0:
            raise InvalidDataError("unknown native MTP draft reply marker")
        need(&c, 27 * 8)
        values = [<int64_t>ld_u64(c.p + c.pos + 8 * i) for i in range(27)]
        c.pos += 27 * 8
        reply = StageReply(_REPLY_KINDS[kind_id], predicted, tokens, window, draft, StageReplyStats(*values))
        return reply, c.pos - c.start
    finally:
        PyBuffer_Release(&view)
