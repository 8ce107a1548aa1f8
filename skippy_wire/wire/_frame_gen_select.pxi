# Lossless codec selection for v16/v17 frames (A.6.4); included by _frame_gen.pyx.


def select_frame_codec(desc, payload, permitted):
    cdef Desc d
    _from_object(desc, &d)
    cdef _Buffer buf = _Buffer(payload)
    _validate(&d, buf.view.len)
    allowed = {_codec_id(x) for x in permitted}
    if RAW not in allowed:
        _raise(E_NO_RAW)
    cdef int best = RAW, c
    cdef uint64_t best_size = _frame_size(RAW, &d), size
    for c in [x for x in (BF16, F16, S8, RAW) if x in allowed]:
        try:
            size = _frame_size(c, &d)
        except InvalidDataError as err:
            if _lossless(c, &d, buf):
                raise err  # upstream sizes every lossless codec's frame, and that error propagates
            continue
        if size < best_size and _lossless(c, &d, buf):
            best, best_size = c, size
    return best


cdef bint _lossless(int c, const Desc* d, _Buffer payload) except -1:
    """A.6.4 step 4 as upstream tests it, part by part: every F32 part encodes under its own
    (v15) limits and decodes back to the same bytes.  The frame's size is not part of it."""
    cdef uint32_t i
    cdef const Part* p
    cdef const uint8_t* src
    cdef const float[::1] back
    for i in range(d.count):
        p = &d.parts[i]
        if p.ggml_type != 0:
            continue
        src = <const uint8_t*>payload.view.buf + p.offset
        rows = <int64_t>(p.nbytes // 4) // p.dims[0]
        try:
            back = _codec.decode_activation(c, rows, p.dims[0],
                                            _codec.encode_activation(c, rows, p.dims[0], _slice(src, p.nbytes), 0), 0)
        except InvalidDataError:
            return False
        if memcmp(&back[0], src, p.nbytes) != 0:
            return False
    return True

