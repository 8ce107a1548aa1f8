# Stage messages of state versions 16 and 17 (wire-v16-v17.md A.7, B.7); included by
# _frame_gen.pyx.

cdef frozenset _KNOWN_KINDS = frozenset(list(range(1, 10)) + list(range(13, 24)))
cdef frozenset _ACTIVATIONLESS = frozenset({3, 7, 15, 16, 17})
cdef tuple _CODECS = (None,) + tuple(ActivationCodec(i) for i in range(1, 5))
cdef uint32_t MAX_SIDEBAND = 1048576
E_NO_AGREEMENT = "activation requires an established agreement"
E_TOKENS = "activation frame token count does not match stage message"
E_PRODUCER = "activation frame producer does not match stage message"


cdef struct Cur:
    const uint8_t* buf
    Py_ssize_t pos
    Py_ssize_t start
    Py_ssize_t end


cdef inline int _need(Cur* c, Py_ssize_t n) except -1:
    if n > c.end - c.pos:
        raise UnexpectedEofError(needed=c.pos - c.start + n)
    return 0


cdef inline uint32_t _u32(Cur* c) except? 0xFFFFFFFF:
    _need(c, 4)
    c.pos += 4
    return ld_u32(c.buf + c.pos - 4)


cdef object _text(Cur* c, uint32_t length, str bad):
    _need(c, length)
    c.pos += length
    try:
        return (c.buf + c.pos - length)[:length].decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidDataError(bad) from None


cdef tuple _NO_ARGS = ()
cdef dict _MESSAGE_KEYS = dict.fromkeys(["kind", "pos_start", "token_count", "state", "request_id", "session_id",
                                         "sampling", "chat_sampling_metadata", "tokens", "positions",
                                         "activation", "raw_bytes"])
cdef tuple _STATE_FIELDS = ("version", "seq_id", "phase", "flags", "checkpoint_generation", "prompt_token_count",
                            "decode_step", "current_token", "source_stage_index")
cdef tuple _LIST_FIELDS = ("logit_bias", "dry_sequence_breakers", "samplers")


cdef object _instance(type cls, dict values):
    """An instance with ``values`` as its attribute dict, without the dataclass ``__init__``
    (the fields arrive checked and converted)."""
    cdef PyObject* raw = (<PyTypeObject*>cls).tp_new(<PyTypeObject*>cls, <PyObject*>_NO_ARGS, NULL)
    if raw == NULL:
        raise MemoryError()
    obj = <object>raw
    Py_DECREF(obj)
    obj.__dict__ = values  # as _frame's _instance (CPython 3.13's inline attributes)
    return obj


cdef object _state(const uint8_t* h, object codec):
    cdef dict d = {}
    cdef int i
    for i in range(9):
        d[_STATE_FIELDS[i]] = <int32_t>ld_u32(h + 4 * i)
    d["activation_codec"] = codec
    return _instance(StageStateHeader, d)


# The last sampling block read: (wire bytes, field values), replaced as one tuple.  A
# session repeats its block in every message, so a byte compare replaces the walk; the
# result is a fresh instance with fresh lists.
cdef tuple _sampling_cache = None


cdef object _fresh_sampling(dict values):
    cdef dict d = PyDict_Copy(values)
    for name in _LIST_FIELDS:
        d[name] = list(<list>values[name])
    return _instance(SamplingConfig, d)


cdef object _sampling_cached(Cur* c):
    global _sampling_cache
    cdef tuple entry = _sampling_cache
    cdef bytes raw
    cdef Py_ssize_t start = c.pos
    if entry is not None:
        raw = <bytes>entry[0]
        if len(raw) <= c.end - c.pos and memcmp(c.buf + c.pos, PyBytes_AS_STRING(raw), len(raw)) == 0:
            c.pos += len(raw)
            return _fresh_sampling(<dict>entry[1])
    sampling = _sampling(c)
    if c.pos - start <= 4096:
        values = PyDict_Copy(sampling.__dict__)
        for name in _LIST_FIELDS:
            values[name] = list(values[name])
        _sampling_cache = (_slice(c.buf + start, c.pos - start), values)
    return sampling


cdef list _strings(Cur* c, uint32_t maximum):
    cdef uint32_t count = _u32(c), i, length
    if count > maximum:
        _raise("sampling string count exceeds maximum")
    out = []
    for i in range(count):
        length = _u32(c)
        if length > MAX_STAGE_SAMPLING_STRING_BYTES:
            _raise("sampling string exceeds maximum length")
        out.append(_text(c, length, "sampling string is not UTF-8"))
    return out


cdef object _sampling(Cur* c):
    cdef uint32_t count, i
    values = {}
    for name, code in SAMPLING_WIRE_ORDER:
        if code == "I":
            values[name] = _u32(c)
        elif code == "i":
            values[name] = <int32_t>_u32(c)
        elif code == "B":
            values[name] = _u32(c) != 0
        elif code == "f":
            values[name] = f32_from_bits(_u32(c))
        elif code == "L":
            count = _u32(c)
            if count > MAX_STAGE_LOGIT_BIAS:
                _raise("logit bias count exceeds maximum")
            _need(c, 8 * count)
            biases = []
            for i in range(count):
                token = <int32_t>_u32(c)
                biases.append(LogitBias(token, f32_from_bits(_u32(c))))
            values[name] = biases
        else:
            values[name] = _strings(c, MAX_STAGE_DRY_SEQUENCE_BREAKERS if name == "dry_sequence_breakers"
                                    else MAX_STAGE_SAMPLERS)
    return SamplingConfig(**values)


cdef list _i32_list(Cur* c, int32_t n):
    cdef int32_t i
    out = [None] * n
    for i in range(n):
        out[i] = <int32_t>ld_u32(c.buf + c.pos + 4 * i)
    c.pos += 4 * n
    return out


cdef bint _permits(int policy, object configured, int frame_codec) except -1:
    """Receiver admission (v15 8.2): Fixed needs the same codec; AutoLosslessV1 (configured
    RawF32V1) admits RawF32V1, BF16 and F16."""
    cdef int want = _codec_id(configured)
    if policy == 0:
        return want == frame_codec
    return want == RAW and (frame_codec == RAW or frame_codec == BF16 or frame_codec == F16)


cdef int _stage_checks(const Desc* d, object token_count, object source) except -1:
    """A.7.3, writer and reader."""
    if token_count < 0 or d.tokens != token_count:
        _raise(E_TOKENS)
    if d.producer != source:
        _raise(E_PRODUCER)
    return 0


def read_stage_message_from_buffer(int version, data, expected_codec=None, int policy=0, Py_ssize_t offset=0,
                                   agreement=None):
    if version != 16 and version != 17:
        raise ValueError(f"state version {version} is not 16 or 17")
    if not (policy == 0 or policy == 1) or (expected_codec is not None and expected_codec not in _CODECS):
        check_admission(expected_codec, policy)  # (a per-message call: the enums only when off the known ids)
    cdef _Buffer buf = _Buffer(data)
    if offset < 0 or offset > buf.view.len:
        raise ValueError("offset outside the buffer")
    cdef Cur c = Cur(<const uint8_t*>buf.view.buf, offset, offset, buf.view.len)
    cdef int32_t kind = <int32_t>_u32(&c)
    if kind not in _KNOWN_KINDS:
        _raise("unknown stage message kind")
    _need(&c, 56)
    cdef const uint8_t* h = c.buf + c.pos
    cdef int32_t pos_start = <int32_t>ld_u32(h), token_count = <int32_t>ld_u32(h + 4)
    cdef int32_t n_tokens = <int32_t>ld_u32(h + 8), n_positions = <int32_t>ld_u32(h + 12)
    cdef int32_t codec_raw = <int32_t>ld_u32(h + 52)
    if codec_raw < 1 or codec_raw > 4:
        _raise(E_CODEC)
    codec = _CODECS[codec_raw]
    state = _state(h + 16, codec)
    if <int32_t>ld_u32(h + 16) != version:
        _raise("unsupported stage state version")
    c.pos += 56
    cdef int32_t count = <int32_t>_u32(&c)
    if count < 0:
        _raise("negative activation payload byte count")
    if <uint64_t>count > MAX_BYTES:
        _raise(E_WIRE_MAX)
    _need(&c, 16)
    request_id, session_id = ld_u64(c.buf + c.pos), ld_u64(c.buf + c.pos + 8)
    c.pos += 16
    cdef int32_t flags = <int32_t>ld_u32(h + 28), source = <int32_t>ld_u32(h + 48)
    if kind in _ACTIVATIONLESS or source < 0:
        if count != 0:
            _raise("activationless stage message contains activation payload")
    elif expected_codec is not None and not _permits(policy, expected_codec, codec_raw):
        _raise("stage activation codec mismatch")
    sampling = _sampling_cached(&c) if flags & 0x08 else None
    metadata = None
    cdef uint32_t length
    if flags & 0x20:
        length = _u32(&c)
        if length > MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES:
            _raise("chat sampling metadata length exceeds maximum")
        metadata = _text(&c, length, "chat sampling metadata is not UTF-8")
    cdef dict md = PyDict_Copy(_MESSAGE_KEYS)
    md["kind"], md["pos_start"], md["token_count"], md["state"] = kind, pos_start, token_count, state
    md["request_id"], md["session_id"], md["sampling"] = request_id, session_id, sampling
    md["chat_sampling_metadata"], md["tokens"], md["positions"] = metadata, [], []
    md["activation"], md["raw_bytes"] = b"", b""
    msg = _instance(StageWireMessage, md)
    if kind == 3:
        return msg, c.pos - c.start
    if token_count < 0 or n_tokens < 0 or n_positions < 0:
        _raise("negative wire count")
    if <uint32_t>n_tokens > MAX_SIDEBAND:
        _raise("token sideband count exceeds maximum")
    if <uint32_t>n_positions > MAX_SIDEBAND:
        _raise("position sideband count exceeds maximum")
    if kind == 7:
        if token_count > MAX_STAGE_STATE_IMPORT_BYTES:
            _raise("state import byte count exceeds maximum")
        _need(&c, token_count)
        msg.raw_bytes = _slice(c.buf + c.pos, token_count)
        c.pos += token_count
        return msg, c.pos - c.start
    _need(&c, 4 * <Py_ssize_t>n_tokens + 4 * <Py_ssize_t>n_positions + count)
    msg.tokens = _i32_list(&c, n_tokens)
    msg.positions = _i32_list(&c, n_positions)
    cdef Desc d
    if count:
        c.pos += count
        if version == 16:
            frame = _decode_ptr(codec_raw, &d, c.buf + c.pos - count, count, 16, True)
        else:
            if agreement is None:
                _raise(E_NO_AGREEMENT)
            frame = _agreed_decode_ptr(agreement, codec_raw, c.buf + c.pos - count, count, &d, True)
        _stage_checks(&d, token_count, source)
        if HEADER + PART * d.count + d.payload > MAX_BYTES:  # the RawF32V1 re-encode's own A.6.1 limit
            _raise(E_FRAME_MAX)
        msg.activation = frame
    return msg, c.pos - c.start


cdef object _checked_activation(int version, object msg, object agreement):
    """A.7.2 step 5 / B.7.2 step 4: the activation the message may carry (reframed for v17)."""
    kind = wire_int(msg.kind)
    state = msg.state
    activation = msg.activation
    cdef _Buffer buf = _Buffer(activation)
    cdef Desc d
    if kind in _ACTIVATIONLESS or state.source_stage_index < 0:
        if buf.view.len:
            raise InvalidInputError("activationless stage message contains activation payload")
        return activation
    if <uint64_t>buf.view.len > MAX_BYTES:
        raise InvalidInputError(E_WIRE_MAX)
    try:
        codec_value = wire_int(state.activation_codec)
    except TypeError:
        raise out_of_range_error(msg) from None
    cdef int codec = _codec_id(codec_value)
    _check_frame(codec, &d, <const uint8_t*>buf.view.buf, buf.view.len, version)
    _stage_checks(&d, msg.token_count, state.source_stage_index)
    if version == 16:
        return activation
    if agreement is None:
        raise InvalidInputError(E_NO_AGREEMENT)
    return _agreed_reframe(agreement, &d, buf)


def write_stage_message(int version, msg, agreement=None):
    if version != 16 and version != 17:
        raise ValueError(f"state version {version} is not 16 or 17")
    cdef Py_ssize_t emitted = 20
    try:  # the first fields on the wire, integers that fit (as the twin packs them first)
        kind, pos_start, token_count = wire_int(msg.kind), wire_int(msg.pos_start), \
            wire_int(msg.token_count)
        struct_prefix(kind, pos_start, token_count, 0, 0)
        len(msg.tokens), len(msg.positions)  # lists (a generator is named by the checks)
        wire_int(msg.state.source_stage_index)  # compared below: a state of the wrong shape is named
    except (OverflowError, TypeError, ValueError, AttributeError):
        raise out_of_range_error(msg) from None
    try:
        if len(msg.tokens) > MAX_STAGE_SIDEBAND_VALUES:
            emitted = 12
            raise InvalidInputError("too many tokens")
        if len(msg.positions) > MAX_STAGE_SIDEBAND_VALUES:
            emitted = 16
            raise InvalidInputError("too many position sideband values")
        activation = _checked_activation(version, msg, agreement)
    except WireError as error:
        if version == 16:
            error.partial = struct_prefix(kind, pos_start, token_count, len(msg.tokens), len(msg.positions))[:emitted]
        else:
            error.partial = b""
        raise
    if activation is not msg.activation:
        msg = dataclasses.replace(msg, activation=activation)
    return _frame.write_stage_message(msg)


cdef bytes struct_prefix(int32_t kind, int32_t pos_start, int32_t token_count, Py_ssize_t n_tokens,
                         Py_ssize_t n_positions):
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 20)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    st_u32(o, <uint32_t>kind)
    st_u32(o + 4, <uint32_t>pos_start)
    st_u32(o + 8, <uint32_t>token_count)
    st_u32(o + 12, <uint32_t>n_tokens)
    st_u32(o + 16, <uint32_t>n_positions)
    return out


def message_wire_bytes(msg, agreement):
    """B.7.4 ``wire_bytes(agreement)``."""
    cdef _Buffer buf = _Buffer(msg.activation)
    cdef Desc d
    try:
        estimated = msg.estimated_wire_bytes()
        codec_field = wire_int(msg.state.activation_codec)
    except (AttributeError, TypeError, ValueError, OverflowError):
        raise out_of_range_error(msg) from None  # a field of the wrong type: named as the writer names it
    if not buf.view.len:
        return estimated
    cdef int codec = _codec_id(codec_field)
    _read_desc(<const uint8_t*>buf.view.buf, buf.view.len, &d)  # the descriptor alone, as upstream reads it
    if agreement is None:
        _raise(E_NO_AGREEMENT)
    return estimated - buf.view.len + _agreed_size(agreement, codec, &d)
