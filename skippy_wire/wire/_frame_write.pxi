# Included by _frame.pyx: writing stage messages (wire-format.md 4.4).
#
# The walk is the reference's, step for step, so that every failure is the reference's:
# the same WireError with the same ``partial`` bytes, or, for a value the wire cannot
# represent (a conversion error at the step that packs it), the same field-naming
# InvalidInputError.  Sizing the output first is only an optimisation: when a size cannot
# be computed the walk starts with a small buffer that grows, and meets the failing field
# in order.

cdef class _Out:
    """The output: one bytes object, sized up front when possible and grown otherwise;
    ``partial()`` is what upstream would have emitted when a check fails part-way."""

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

    cdef int grow(self, Py_ssize_t n) except -1:
        cdef Py_ssize_t cap = max(2 * self.cap, self.pos + n, 256)
        data = PyBytes_FromStringAndSize(NULL, cap)
        memcpy(PyBytes_AS_STRING(data), self.p, self.pos)
        self.data = data
        self.p = <uint8_t*>PyBytes_AS_STRING(data)
        self.cap = cap
        return 0

    cdef inline int u32(self, uint32_t v) except -1:
        if self.pos + 4 > self.cap:
            self.grow(4)
        st_u32(self.p + self.pos, v)
        self.pos += 4
        return 0

    cdef inline int u64(self, uint64_t v) except -1:
        if self.pos + 8 > self.cap:
            self.grow(8)
        st_u64(self.p + self.pos, v)
        self.pos += 8
        return 0

    cdef inline int raw(self, const void* src, Py_ssize_t n) except -1:
        if self.pos + n > self.cap:
            self.grow(n)
        memcpy(self.p + self.pos, src, n)
        self.pos += n
        return 0

    cdef object partial(self):
        if self.data is None:
            return b""
        return PyBytes_FromStringAndSize(<char*>self.p, self.pos)

    cdef object finish(self):
        if self.pos == self.cap:  # the sized case: the bytes object is the result
            result = self.data
        else:
            result = PyBytes_FromStringAndSize(<char*>self.p, self.pos)
        self.data = None
        return result


from cpython.bool cimport PyBool_Check

from .field_checks import BOOL_TYPES, NOT_INT_LISTS, wire_bool

# Wire integers accept ints and integer-likes (``__index__``: IntEnum, numpy ints), never
# floats or bools (constants.wire_int); a value outside the wire type raises OverflowError,
# one of the wrong type TypeError (the caller names the field).
cdef inline object _idx(object v):
    if PyLong_Check(v):  # ints and IntEnums as they are
        if PyBool_Check(v):
            raise TypeError("a bool is not a wire integer")
        return v
    return PyNumber_Index(v)


cdef inline uint32_t as_bool(object v) except? 0xFFFFFFFF:
    """A wire boolean (field_checks.wire_bool): a bool, or an integer 0 or 1."""
    if v is True:
        return 1
    if v is False:
        return 0
    return wire_bool(v)


cdef inline uint32_t as_f32(object v) except? 0xFFFFFFFF:
    """An f32 field's bits (field_checks.wire_f32): never a bool."""
    if type(v) is not float and isinstance(v, BOOL_TYPES):
        raise TypeError("a bool is not a wire f32")
    try:
        return f32_bits_of(v)
    except Exception as exc:  # any error of its __float__ (a tensor's RuntimeError): as the twin's struct.pack
        raise TypeError(f"not a wire f32: {exc}") from None


cdef inline Py_ssize_t _seq_len(object seq) except -1:
    """The length of a list of wire integers; text and raw bytes are none (TypeError)."""
    if type(seq) is not list and isinstance(seq, NOT_INT_LISTS):
        raise TypeError("not a list of wire integers")
    return len(seq)


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
    """The ``n`` items of ``seq`` (its length when the count was written) as i32s."""
    cdef Py_ssize_t i = 0
    cdef tuple items
    if type(seq) is list or type(seq) is tuple:
        # a snapshot: converting an item may run code that changes the list, which is indexed unchecked
        items = tuple(seq)
        if len(items) != n:
            raise InvalidInputError(SEQUENCE_CHANGED_TEXT)
        for i in range(n):
            out.u32(as_i32(items[i]))
    else:
        if isinstance(seq, NOT_INT_LISTS):
            raise TypeError("not a list of wire integers")
        for v in seq:
            if i >= n:
                break
            out.u32(as_i32(v))
            i += 1
        if i != n:
            raise InvalidInputError(SEQUENCE_CHANGED_TEXT)
    return 0


cdef Py_ssize_t _strings_size(object values, Py_ssize_t maximum) except -1:
    cdef Py_ssize_t size = 4, i = 0, n
    if not isinstance(values, (list, tuple)):  # measuring an iterator would use it up before its write
        raise TypeError("not a list")
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
        if <size_t>n > MAX_STRING:
            # InvalidData even on the writer side (section 4.3).
            raise InvalidDataError(_wc.SAMPLING_STRING_LENGTH_TEXT)
        out.u32(<uint32_t>n)
        out.raw(s, n)
    return 0


cdef Py_ssize_t _sampling_size(object s) except -1:
    cdef Py_ssize_t n = SAMPLING_BASE_BYTES + LOGIT_BIAS_BYTES * min(len(s.logit_bias), MAX_LOGIT_BIAS)
    n += _strings_size(s.dry_sequence_breakers, MAX_BREAKERS) - 4
    n += _strings_size(s.samplers, MAX_SAMPLERS) - 4
    return n


cdef int _write_sampling(_Out out, object s) except -1:
    cdef dict d = s.__dict__ if type(s) is SamplingConfig else None
    if d is None or len(d) != len(_SAMPLING_KEYS):
        d = {name: getattr(s, name) for name in _SAMPLING_KEYS}
    out.u32(as_u32(d["flags"]))
    out.u32(as_u32(d["seed"]))
    out.u32(as_f32(d["temperature"]))
    out.u32(as_f32(d["top_p"]))
    out.u32(as_i32(d["top_k"]))
    out.u32(as_f32(d["min_p"]))
    out.u32(as_f32(d["presence_penalty"]))
    out.u32(as_f32(d["frequency_penalty"]))
    out.u32(as_f32(d["repeat_penalty"]))
    out.u32(as_i32(d["penalty_last_n"]))
    cdef list biases = list(d["logit_bias"])[:MAX_LOGIT_BIAS]
    out.u32(len(biases))
    for pair in biases:
        if type(pair) is not tuple and isinstance(pair, NOT_INT_LISTS):  # b"\x05\x02" is no (5, 2.0)
            raise TypeError("a logit bias pair is no text or raw bytes")
        token, bias = pair
        out.u32(as_i32(token))
        out.u32(as_f32(bias))
    out.u32(as_f32(d["typical_p"]))
    out.u32(as_f32(d["top_nsigma"]))
    out.u32(as_f32(d["dynatemp_range"]))
    out.u32(as_f32(d["dynatemp_exponent"]))
    out.u32(as_f32(d["dry_multiplier"]))
    out.u32(as_f32(d["dry_base"]))
    out.u32(as_i32(d["dry_allowed_length"]))
    out.u32(as_i32(d["dry_penalty_last_n"]))
    _write_strings(out, d["dry_sequence_breakers"], MAX_BREAKERS)
    out.u32(as_f32(d["xtc_probability"]))
    out.u32(as_f32(d["xtc_threshold"]))
    out.u32(as_i32(d["mirostat_mode"]))
    out.u32(as_f32(d["mirostat_entropy"]))
    out.u32(as_f32(d["mirostat_learning_rate"]))
    _write_strings(out, d["samplers"], MAX_SAMPLERS)
    out.u32(as_bool(d["ignore_eos"]))
    return 0


#: What a value the wire cannot represent raises while it is converted.
_CONVERSION_ERRORS = (OverflowError, TypeError, ValueError, AttributeError)


def write_stage_message(msg):
    """Serialize a stage message (section 4.4); on a failed check the exception's
    ``partial`` holds the bytes upstream would already have emitted."""
    cdef _Out out = _Out.__new__(_Out)
    try:
        return _write_message(out, msg)
    except WireError as error:
        error.partial = out.partial()
        raise
    except _CONVERSION_ERRORS:
        # A value the wire cannot represent: no partial output is defined for it.
        raise out_of_range_error(msg) from None


cdef Py_ssize_t _message_size(object msg, int32_t kind, Py_ssize_t payload) except -2:
    """The byte count of a successful write, or -1 when it cannot be computed up front
    (a value that cannot be written: the walk meets it at its own step)."""
    cdef Py_ssize_t cap = HEADER_BYTES, n = 0
    try:
        sampling = msg.sampling
        metadata = msg.chat_sampling_metadata
        if sampling is not None:
            cap += _sampling_size(sampling)
        if metadata is not None:
            PyUnicode_AsUTF8AndSize(metadata, &n)
            cap += 4 + n
        if kind != KIND_STATE_IMPORT:
            cap += 4 * len(msg.tokens) + 4 * len(msg.positions)
    except _CONVERSION_ERRORS:
        return -1
    return cap + payload


cdef bint _get_buffer(object obj, Py_buffer* view):
    """Acquire a C-contiguous buffer; False when ``obj`` is none (the step raises), as an
    array of Python objects is (``field_checks.holds_objects``)."""
    if holds_objects(obj):
        return False
    try:
        PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS)
    except (TypeError, ValueError, BufferError):
        return False
    return True


cdef object _write_message(_Out out, object msg):
    cdef Py_buffer act
    cdef Py_buffer raw
    cdef bint have_act = False, have_raw = False
    cdef Py_ssize_t ntok, npos, cap, meta_n = 0
    cdef const char* meta_p = NULL
    cdef uint32_t count
    cdef int32_t kind = -1, token_count
    kind_obj = _idx(msg.kind)
    if -2**31 <= kind_obj < 2**31:
        kind = kind_obj
    # The size of a successful write needs the payload buffers: acquire them first (an
    # object that is none is reported at its step below).
    try:
        have_act = _get_buffer(getattr(msg, "activation", None), &act)
        if kind == KIND_STATE_IMPORT:
            have_raw = _get_buffer(getattr(msg, "raw_bytes", None), &raw)
        cap = _message_size(msg, kind, raw.len if have_raw else (act.len if have_act else 0))
        out.init(cap if cap >= 0 else 256)
        # 1.
        out.u32(as_i32(kind_obj))
        out.u32(as_i32(msg.pos_start))
        token_count = <int32_t>as_i32(msg.token_count)
        out.u32(<uint32_t>token_count)
        # 2.-3.
        tokens = msg.tokens
        positions = msg.positions
        ntok = _seq_len(tokens)
        if ntok > MAX_SIDEBAND:
            raise InvalidInputError("too many tokens")
        out.u32(<uint32_t>ntok)
        npos = _seq_len(positions)
        if npos > MAX_SIDEBAND:
            raise InvalidInputError("too many position sideband values")
        out.u32(<uint32_t>npos)
        # 4. the writer owns the SAMPLING / CHAT_SAMPLING_METADATA bits
        state = msg.state
        flags = _idx(state.flags) & ~<int64_t>(F_SAMPLING | F_CHAT)
        sampling = msg.sampling
        metadata = msg.chat_sampling_metadata
        if sampling is not None:
            flags |= F_SAMPLING
        if metadata is not None:
            flags |= F_CHAT
        # 5. activation count; Stop is not in the writer's activation-less list (4.6)
        if not have_act:
            msg.activation  # (a missing attribute raises here, as in the reference)
            raise InvalidInputError("activation must be a C-contiguous bytes-like object")
        if kind_in(ACTIVATIONLESS_WRITE, kind) or state.source_stage_index < 0:
            if act.len:
                raise InvalidInputError(_wc.ACTIVATIONLESS_PAYLOAD_TEXT)
            count = 0
        else:
            if <uint64_t>act.len > MAX_ACTIVATION:
                raise InvalidInputError(_wc.WIRE_MAX_TEXT)
            count = <uint32_t>act.len
        # 6.
        out.u32(as_i32(state.version))
        out.u32(as_i32(state.seq_id))
        out.u32(as_i32(state.phase))
        out.u32(as_i32(flags))
        out.u32(as_i32(state.checkpoint_generation))
        out.u32(as_i32(state.prompt_token_count))
        out.u32(as_i32(state.decode_step))
        out.u32(as_i32(state.current_token))
        out.u32(as_i32(state.source_stage_index))
        out.u32(as_i32(state.activation_codec))
        out.u32(count)
        out.u64(as_u64(msg.request_id))
        out.u64(as_u64(msg.session_id))
        # 7.
        if sampling is not None:
            _write_sampling(out, sampling)
        # 8.
        if metadata is not None:
            meta_p = PyUnicode_AsUTF8AndSize(metadata, &meta_n)
            if <size_t>meta_n > MAX_METADATA:
                raise InvalidInputError("chat sampling metadata is too large")
            out.u32(<uint32_t>meta_n)
            out.raw(meta_p, meta_n)
        # 9.
        if kind == KIND_STATE_IMPORT:
            if not have_raw:
                msg.raw_bytes
                raise InvalidInputError("raw_bytes must be a C-contiguous bytes-like object")
            if token_count < 0 or token_count != raw.len:
                raise InvalidInputError("state import raw byte count mismatch")
            if <uint64_t>token_count > MAX_STATE_IMPORT:
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
