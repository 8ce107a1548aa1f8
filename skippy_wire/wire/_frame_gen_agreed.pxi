# Agreements and agreement-framed activations (wire-v16-v17.md B.5-B.6); included by
# _frame_gen.pyx.  Profiles are the Python objects of ``skippy_wire.wire.agreement``;
# frames are the C descriptors of _frame_gen.pyx.

cdef int64_t I64_MAX = 9223372036854775807
E_AGREEMENT = "invalid activation agreement"
E_PROFILE_ID = "duplicate or zero activation profile ID"
E_PROFILE = "invalid activation profile"
E_PART_PROFILE = "invalid activation part profile"
E_DIMENSION = "invalid admitted activation dimension"
E_NO_MATCH = "activation does not match an admitted profile"
E_FRAME_TOO_BIG = "activation frame exceeds maximum"
E_STALE = "stale activation agreement"
E_UNKNOWN_PROFILE = "unknown activation profile"
E_COUNTS = "activation counts or presence outside agreement"
E_ABSENT = "required activation part absent"
E_BOUNDS = "dynamic activation dimension outside bounds"
E_LAYOUT_OVERFLOW = "activation layout overflow"
E_WIRE_OVERFLOW = "activation wire size overflow"


cdef bint _admitted(object dim, int axis, object rank, object token_axis):
    if dim is TOKENS:
        return axis == token_axis
    if isinstance(dim, Fixed):
        return 0 < dim.value <= I64_MAX and axis != token_axis and (axis < rank or dim.value == 1)
    if isinstance(dim, Dynamic):
        return 0 < dim.min <= dim.max <= I64_MAX and axis < rank and axis != token_axis
    return False


cdef int _int_field(object value, object low, object high, str name) except -1:
    try:
        value = wire_int(value)
    except TypeError:
        value = None
    if value is None or not low <= value <= high:
        raise InvalidInputError(f"{AGREEMENT_RANGE_TEXT}: {name}")
    return 0


cdef int _bytes_field(object value, Py_ssize_t length, str name) except -1:
    cdef bint ok
    try:  # a buffer (bytes(n) of an int would be zeros, bytes(list) a copy of small ints)
        ok = memoryview(value).nbytes == length
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise InvalidInputError(f"{AGREEMENT_RANGE_TEXT}: {name}")
    return 0


cdef int _bool_field(object value, str name) except -1:
    if type(value) is bool:
        return 0
    try:  # a bool (Python's or numpy's) or 0 / 1, as a wire boolean (field_checks.wire_bool)
        wire_bool(value)
    except TypeError:
        raise InvalidInputError(f"{AGREEMENT_RANGE_TEXT}: {name}") from None
    return 0


cdef int _list_field(object value, str name) except -1:
    """A list (or tuple) of profiles or parts: a dict, a set or None is none."""
    if type(value) is not list and not isinstance(value, (list, tuple)):
        raise InvalidInputError(f"{AGREEMENT_RANGE_TEXT}: {name}")
    return 0


cdef inline bytes _generation(object agreement):
    """The generation's 16 bytes: the buffer's bytes, whatever its shape or element type."""
    generation = agreement.generation
    return generation if type(generation) is bytes else bytes(memoryview(generation))


cdef int _agreement_fields(object agreement) except -1:
    """Every field has its setup type (B.3), before any rule of B.5 (the twin's
    ``check_agreement_fields``): the generation copied into headers is 16 bytes, ids and
    counts fit their u32, the dimension bounds are integers."""
    _bytes_field(agreement.generation, 16, "generation")
    _list_field(agreement.profiles, "profiles")
    for i, p in enumerate(agreement.profiles):
        at = f"profiles[{i}]"
        if type(p) is not ActivationProfile and not isinstance(p, ActivationProfile):
            raise InvalidInputError(f"{AGREEMENT_RANGE_TEXT}: {at}")
        _int_field(p.id, 0, U32_MAX, f"{at}.id")
        for name in ("producer_stage_index", "layer_start", "layer_end"):
            _int_field(getattr(p, name), I32_MIN, I32_MAX, f"{at}.{name}")
        _bytes_field(p.frontier_identity, 32, f"{at}.frontier_identity")
        for name in ("max_tokens", "max_sequences"):
            _int_field(getattr(p, name), 0, U32_MAX, f"{at}.{name}")
        _list_field(p.parts, f"{at}.parts")
        for j, part in enumerate(p.parts):
            where = f"{at}.parts[{j}]"
            if type(part) is not ActivationPartProfile and not isinstance(part, ActivationPartProfile):
                raise InvalidInputError(f"{AGREEMENT_RANGE_TEXT}: {where}")
            _bytes_field(part.identity, 32, f"{where}.identity")
            for name in ("ggml_type", "rank", "token_axis"):
                _int_field(getattr(part, name), 0, U32_MAX, f"{where}.{name}")
            _bool_field(part.optional, f"{where}.optional")
            if not isinstance(part.dimensions, (tuple, list)):  # read more than once: no iterator
                raise InvalidInputError(f"{AGREEMENT_RANGE_TEXT}: {where}.dimensions")
            for k, d in enumerate(part.dimensions):
                if isinstance(d, Fixed):
                    _int_field(d.value, 0, U64_MAX, f"{where}.dimensions[{k}]")
                elif isinstance(d, Dynamic):
                    _int_field(d.min, 0, U64_MAX, f"{where}.dimensions[{k}]")
                    _int_field(d.max, 0, U64_MAX, f"{where}.dimensions[{k}]")
    return 0


def validate_agreement(agreement):
    cdef int axis
    _agreement_fields(agreement)
    generation = _generation(agreement)
    if generation.count(0) == len(generation) or len(agreement.profiles) > MAX_PARTS:
        _raise(E_AGREEMENT)
    ids = set()
    for profile in agreement.profiles:
        profile_id = wire_int(profile.id)  # a 0-d array is an index but no set member
        if profile_id == 0 or profile_id in ids:
            _raise(E_PROFILE_ID)
        ids.add(profile_id)
        if (profile.producer_stage_index < 0 or profile.layer_start < 0 or profile.layer_end < profile.layer_start
                or profile.max_tokens == 0 or profile.max_sequences == 0 or not 1 <= len(profile.parts) <= MAX_PARTS):
            _raise(E_PROFILE)
        identities = set()
        for part in profile.parts:
            ggml_type = wire_int(part.ggml_type)
            if not (0 <= ggml_type <= 0xFFFFFFFF) or _element_bytes(ggml_type) == 0:
                _raise(E_GGML_TYPE)
            identity = bytes(part.identity)
            if not 1 <= part.rank <= 4 or part.token_axis >= part.rank or identity in identities:
                _raise(E_PART_PROFILE)
            identities.add(identity)
            dims = tuple(part.dimensions)  # indexed unchecked below: four admitted dimensions or none
            if len(dims) != 4:
                _raise(E_DIMENSION)
            for axis in range(4):
                if not _admitted(dims[axis], axis, part.rank, part.token_axis):
                    _raise(E_DIMENSION)


cdef object _match(object profile, const Desc* d):
    """B.6.2: ``(mask, dynamic values)`` when the frame matches ``profile``, else None."""
    cdef uint32_t cursor = 0, k
    cdef int mask = 0, i = 0
    cdef const Part* fp
    if (d.producer != profile.producer_stage_index or d.layer_start != profile.layer_start
            or d.layer_end != profile.layer_end
            or PyBytes_FromStringAndSize(<const char*>d.frontier, 32) != bytes(profile.frontier_identity)):
        return None
    dynamic = []
    for pp in profile.parts:
        fp = &d.parts[cursor] if cursor < d.count else NULL
        if fp != NULL and PyBytes_FromStringAndSize(<const char*>fp.identity, 32) == bytes(pp.identity):
            if (fp.ggml_type != pp.ggml_type or fp.rank != pp.rank or fp.token_axis != pp.token_axis
                    or fp.flags != (OPTIONAL if pp.optional else 0)):
                return None
            dims = tuple(pp.dimensions)
            if len(dims) < fp.rank:  # a profile changed since it was validated
                return None
            for k in range(fp.rank):
                dim = dims[k]
                if dim is TOKENS:
                    if fp.dims[k] != <int64_t>d.tokens:
                        return None
                elif isinstance(dim, Fixed):
                    if fp.dims[k] != dim.value:
                        return None
                elif dim.min <= fp.dims[k] <= dim.max:
                    dynamic.append(fp.dims[k])
                else:
                    return None
            mask |= 1 << i
            cursor += 1
        elif not pp.optional:
            return None
        i += 1
    if cursor != d.count or mask == 0:
        return None
    if not (1 <= d.tokens <= profile.max_tokens and 1 <= d.sequences <= profile.max_sequences):
        return None
    return mask, dynamic


cdef tuple _first_match(object agreement, const Desc* d):
    for profile in agreement.profiles:
        m = _match(profile, d)
        if m is not None:
            return profile, m[0], m[1]
    _raise(E_NO_MATCH)


cdef bytes _agreed_header(object agreement, object profile, const Desc* d, int mask, list dynamic):
    cdef Py_ssize_t n = 30 + 8 * len(dynamic), i
    cdef bytes out = PyBytes_FromStringAndSize(NULL, n)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    cdef bytes generation = _generation(agreement)
    memcpy(o, <const char*>generation, 16)
    st_u32(o + 16, profile.id)
    st_u32(o + 20, d.tokens)
    st_u32(o + 24, d.sequences)
    o[28] = mask & 0xFF
    o[29] = (mask >> 8) & 0xFF
    for i in range(len(dynamic)):
        st_u64(o + 30 + 8 * i, <uint64_t>dynamic[i])
    return out


cdef uint64_t _agreed_size(object agreement, int codec, const Desc* d) except? 0xFFFFFFFFFFFFFFFF:
    validate_agreement(agreement)
    _validate(d, -1)
    cdef uint64_t size = _frame_size(codec, d)
    _profile, _mask, dynamic = _first_match(agreement, d)
    return 30 + 8 * len(dynamic) + size - HEADER - PART * d.count


def agreed_wire_bytes(agreement, codec, desc):
    cdef int c = _codec_id(codec)
    cdef Desc d
    validate_agreement(agreement)
    _from_object(desc, &d)
    return _agreed_size(agreement, c, &d)


def agreed_encode(agreement, codec, desc, payload):
    cdef int c = _codec_id(codec)
    cdef Desc d
    validate_agreement(agreement)
    _from_object(desc, &d)
    cdef _Buffer buf = _Buffer(payload)
    _validate(&d, buf.view.len)
    profile, mask, dynamic = _first_match(agreement, &d)
    cdef bytes head = _agreed_header(agreement, profile, &d, mask, dynamic)
    cdef uint64_t total = len(head)
    cdef uint32_t i
    cdef const Part* p
    cdef const uint8_t* src = <const uint8_t*>buf.view.buf
    for i in range(d.count):  # no v16 frame size here (B.6.2): only the result is capped
        total += _part_wire(c, &d.parts[i], False)
    if total > MAX_BYTES:
        # the parts are still encoded in order first: a value error, or an S8 part's own
        # size error, precedes "activation frame exceeds maximum"
        for i in range(d.count):
            p = &d.parts[i]
            if p.ggml_type == 0 and c != RAW:
                _codec.encode_activation(c, (p.nbytes // 4) // <uint64_t>p.dims[0], p.dims[0],
                                         _slice(src + p.offset, p.nbytes), 0)
        _raise(E_FRAME_TOO_BIG)
    cdef bytes out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>total)
    cdef uint8_t* o = <uint8_t*>PyBytes_AS_STRING(out)
    memcpy(o, PyBytes_AS_STRING(head), len(head))
    _code_parts(c, &d, src, o + len(head), True)
    return out


cdef bytes _agreed_reframe(object agreement, const Desc* d, _Buffer frame):
    validate_agreement(agreement)
    profile, mask, dynamic = _first_match(agreement, d)
    cdef Py_ssize_t start = HEADER + PART * d.count
    if frame.view.len < start:  # a caller's frame shorter than its descriptor's headers
        _raise(E_FRAME_SIZE)
    return _agreed_header(agreement, profile, d, mask, dynamic) + PyBytes_FromStringAndSize(
        <const char*>frame.view.buf + start, frame.view.len - start)


def agreed_reframe(agreement, desc, frame):
    """``encode_existing``: the payload section of the encoded ``frame`` is copied."""
    cdef Desc d
    _from_object(desc, &d)
    return _agreed_reframe(agreement, &d, _Buffer(frame))


cdef bytes _agreed_decode_ptr(object agreement, int codec, const uint8_t* b, Py_ssize_t n, Desc* d, bint with_header):
    """B.6.3 in order; fills ``d`` and returns the payload (or the RawF32V1 frame)."""
    cdef Py_ssize_t pos = 30
    cdef uint64_t total = 0, stride, v, wire = 0, size
    cdef uint32_t tokens, sequences, mask
    cdef int i, k, esize
    cdef Part* p
    if <uint64_t>n > MAX_BYTES:
        _raise(E_FRAME_TOO_BIG)
    validate_agreement(agreement)
    if n < 16:
        raise UnexpectedEofError()
    if PyBytes_FromStringAndSize(<const char*>b, 16) != _generation(agreement):
        _raise(E_STALE)
    if n < 20:
        raise UnexpectedEofError()
    profile = agreement.profile(ld_u32(b + 16))
    if profile is None:
        _raise(E_UNKNOWN_PROFILE)
    if n < 30:
        raise UnexpectedEofError()
    tokens, sequences, mask = ld_u32(b + 20), ld_u32(b + 24), b[28] | (b[29] << 8)
    if (not 1 <= tokens <= profile.max_tokens or not 1 <= sequences <= profile.max_sequences or mask == 0
            or mask >> len(profile.parts)):
        _raise(E_COUNTS)
    d.count = 0
    for i in range(len(profile.parts)):
        pp = profile.parts[i]
        if not mask & (1 << i):
            if not pp.optional:
                _raise(E_ABSENT)
            continue
        p = &d.parts[d.count]
        d.count += 1
        esize = _element_bytes(pp.ggml_type)
        _copy32(p.identity, pp.identity, "identity")
        p.ggml_type, p.rank, p.token_axis = pp.ggml_type, pp.rank, pp.token_axis
        p.flags = OPTIONAL if pp.optional else 0
        stride = esize
        for k in range(4):
            dim = pp.dimensions[k]
            if dim is TOKENS:
                p.dims[k] = tokens
            elif isinstance(dim, Fixed):
                p.dims[k] = dim.value
            else:
                if n < pos + 8:
                    raise UnexpectedEofError()
                v = ld_u64(b + pos)
                pos += 8
                if not dim.min <= v <= dim.max:
                    _raise(E_BOUNDS)
                p.dims[k] = <int64_t>v
            # each axis's stride is checked before the next value is read
            p.strides[k] = stride
            if skw_mul_u64(stride, <uint64_t>p.dims[k], &stride):
                _raise(E_LAYOUT_OVERFLOW)
        p.offset = total
        p.nbytes = stride
        total += stride
        if total < stride:
            _raise(E_LAYOUT_OVERFLOW)
    d.version = FRAME_VERSION
    d.producer, d.layer_start, d.layer_end = profile.producer_stage_index, profile.layer_start, profile.layer_end
    d.tokens, d.sequences, d.payload = tokens, sequences, total
    _copy32(d.frontier, profile.frontier_identity, "frontier_identity")
    _validate(d, -1)
    for i in range(d.count):  # the sum of B.6.5: each F32 part is a v15 encoded size (512 MiB cap)
        size = _part_wire(codec, &d.parts[i], True)
        wire += size
        if wire < size:
            _raise(E_WIRE_OVERFLOW)
    if wire != <uint64_t>(n - pos):
        _raise(E_FRAME_SIZE)
    return _finish(codec, d, NULL, b + pos, with_header)


def agreed_decode(agreement, codec, data):
    cdef int c = _codec_id(codec)
    cdef Desc d
    cdef _Buffer buf = _Buffer(data)
    payload = _agreed_decode_ptr(agreement, c, <const uint8_t*>buf.view.buf, buf.view.len, &d, False)
    return _to_object(&d), payload
