# Included by _frame.pyx: reading stage messages (wire-format.md 4.5).

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


# --- activation sizes: the codec's own checks (sections 5.1-5.3, cimported) ---------------
cdef uint64_t _wire_bytes(int codec, int32_t token_count, int32_t n_embd, int32_t flags,
                          uint64_t* elements) except? 0:
    """The encoded payload size of a frame; ``elements`` gets its f32 element count."""
    cdef Dims d = Dims(token_count, n_embd, (flags & F_DOUBLING) != 0)
    cdef Shape s = Shape(0, 0, 0)
    cdef uint64_t size = 0
    cdef int st = frame_shape(&d, &s)
    if st == OK:
        st = encoded_size(codec, &s, &size)
    if st:
        raise_status(st)
    elements[0] = s.elements
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
            raise InvalidDataError(_wc.SAMPLING_STRING_LENGTH_TEXT)
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


def read_stage_message_from_buffer(data, n_embd, expected_codec=None, int policy=0, Py_ssize_t offset=0):
    """Parse one stage message at ``offset`` of a bytes-like object -> (message, consumed).

    Same contract as the reference twin; a short buffer raises UnexpectedEofError whose
    ``needed`` is the byte count (from ``offset``) required at that point.
    """
    if not -2147483648 <= n_embd <= 2147483647:  # compared as Python ints: any size is named
        raise InvalidInputError("n_embd does not fit in i32")
    if not (policy == 0 or policy == 1) or (expected_codec is not None and expected_codec not in _CODECS):
        check_admission(expected_codec, policy)  # (a per-message call: the enums only when off the known ids)
    cdef long long n_embd_ll = n_embd
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
    cdef uint64_t request_id, session_id, expected_bytes = 0, elements = 0
    cdef uint32_t meta_len
    cdef int i
    cdef Py_ssize_t body
    # 1. kind
    kind_id = rd_i32(&c)
    kind = _KINDS[kind_id] if 0 <= kind_id < KIND_LIMIT else None
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
    if codec_id < MIN_CODEC or codec_id > MAX_CODEC:
        raise InvalidDataError(_wc.UNKNOWN_CODEC_TEXT)
    codec = _CODECS[codec_id]
    # 4.
    if h[0] != STATE_VERSION:
        raise InvalidDataError("unsupported stage state version")
    # 5.
    wire_count = rd_i32(&c)
    if wire_count < 0:
        raise InvalidDataError("negative activation payload byte count")
    if <uint64_t>wire_count > MAX_ACTIVATION:
        raise InvalidDataError(_wc.WIRE_MAX_TEXT)
    # 6.
    need(&c, 16)
    request_id = ld_u64(c.p + c.pos)
    session_id = ld_u64(c.p + c.pos + 8)
    c.pos += 16
    flags = h[3]
    source = h[8]
    # 7. activation admission before any variable-length part
    if kind_in(ACTIVATIONLESS_READ, kind_id) or source < 0:
        if wire_count != 0:
            raise InvalidDataError(_wc.ACTIVATIONLESS_PAYLOAD_TEXT)
    else:
        if expected_codec is not None and not _permits(policy, expected_codec, codec_id):
            raise InvalidDataError("stage activation codec mismatch")
        expected_bytes = _wire_bytes(codec_id, token_count, n_embd, flags, &elements)
        if <uint64_t>wire_count != expected_bytes:
            raise InvalidDataError(_wc.WIRE_SIZE_TEXT)
        # 7d: the decoded f32 size; elements < 2**63 for i32 dimensions, no overflow possible
        if elements * 4 > MAX_DECODED:
            raise InvalidDataError(_wc.DECODED_MAX_TEXT)
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
    if kind_id == KIND_STOP:
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
    if kind_id == KIND_STATE_IMPORT:
        if <uint64_t>token_count > MAX_STATE_IMPORT:
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
            values = _codec.decode_activation(codec_id, token_count, n_embd, wire, flags)
        finally:
            if Py_REFCNT(wire) > 1:  # something kept the view: invalidate it
                wire.release()
        activation = _readonly_view(values)
        c.pos += <Py_ssize_t>expected_bytes
    return _message(kind, pos_start, token_count, state, request_id, session_id, sampling, metadata,
                    tokens, positions, activation, b""), c.pos - c.start


cdef bint _permits(int policy, object configured, int frame_codec) except -1:
    # Per-message work, so no enum objects: the admission table (8.2) as bit masks.
    cdef int conf = configured
    if policy == POLICY_FIXED:  # exactly the configured codec
        return conf == frame_codec
    # AutoLosslessV1: configured RawF32V1, frame codec lossless (S8 excluded)
    return conf == RAW_F32_V1 and 0 <= frame_codec < 64 and (LOSSLESS_MASK >> frame_codec) & 1


cdef int POLICY_FIXED = _wc.CodecPolicy.FIXED
cdef uint64_t LOSSLESS_MASK = sum(1 << int(c) for c in _wc.LOSSLESS_CODECS)
