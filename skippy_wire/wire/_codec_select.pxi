# Included by _codec.pyx: the lossless codec selection (wire-format.md 8.1).

# --------------------------------------------------------------------------- selection (8.1)


cdef int _permitted_mask(object permitted) except -1:
    cdef int mask = 0
    for codec in permitted:
        mask |= 1 << _codec_id(codec)
    return mask


cdef int _scan(int which, const uint8_t *src, uint8_t *dst, size_t n, bint nogil_) noexcept:
    """Exactness of the whole buffer for BF16 or F16 (``which``); writes the 16-bit
    patterns to dst when dst is not NULL."""
    return <int>_run(K_EXACT_BF16 if which == BF16_RNE_V1 else K_EXACT_F16, src, dst, n, nogil_)


cdef size_t _selection_elements(token_count, n_embd, state_flags, int mask, Py_buffer *view, Shape *s) except? 0:
    """The checks of 7.3 in upstream order, then 8.1 step 1; the element count of the frame."""
    cdef Dims d
    _dims(token_count, n_embd, state_flags, &d)
    cdef int st = _f32_input(&d, view.len, s)
    if st:
        raise_status(st)
    if not mask & (1 << RAW_F32_V1):
        raise_status(E_NO_RAW)
    return <size_t>s.elements


cdef int _pick_exact(int mask, const uint8_t *src, uint8_t *dst, size_t n, bint nogil_) except -1:
    """8.1 steps 2-4 for a non-empty frame: BF16 wins when both are exact, else F16, else raw.
    With ``dst`` the scan also writes the 16-bit patterns (the wire bytes of an exact frame)."""
    if mask & (1 << BF16_RNE_V1) and _scan(BF16_RNE_V1, src, dst, n, nogil_):
        return BF16_RNE_V1
    if mask & (1 << F16_RNE_V1) and _scan(F16_RNE_V1, src, dst, n, nogil_):
        return F16_RNE_V1
    return RAW_F32_V1


def select_lossless_codec(token_count, n_embd, payload, state_flags, permitted):
    """The smallest codec that carries the whole frame bit-exactly (7.3 and 8.1)."""
    cdef int mask = _permitted_mask(permitted)
    cdef Py_buffer view
    cdef Shape s = Shape(0, 0, 0)
    cdef size_t n
    _acquire_f32(payload, &view)
    try:
        n = _selection_elements(token_count, n_embd, state_flags, mask, &view, &s)
        if n == 0:
            return RAW_F32_V1  # 0 < 0 is false: an empty frame is never compact
        return _pick_exact(mask, <const uint8_t *>view.buf, NULL, n, <size_t>view.len >= _nogil_threshold)
    finally:
        PyBuffer_Release(&view)


def select_and_encode_lossless(token_count, n_embd, payload, state_flags, permitted):
    """``select_lossless_codec`` then ``encode_activation``, fused: the exactness scan
    writes the 16-bit patterns as it goes, which for an exact frame are the wire bytes."""
    cdef int mask = _permitted_mask(permitted)
    cdef Py_buffer view
    cdef Shape s = Shape(0, 0, 0)
    cdef size_t n
    cdef int codec
    cdef bytes out
    cdef const uint8_t *src
    _acquire_f32(payload, &view)
    try:
        n = _selection_elements(token_count, n_embd, state_flags, mask, &view, &s)
        src = <const uint8_t *>view.buf
        if n:
            # elements x 2 <= 512 MiB here: the f32 size passed the decoded cap.
            out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>(2 * n))
            codec = _pick_exact(mask, src, <uint8_t *>PyBytes_AS_STRING(out), n, <size_t>view.len >= _nogil_threshold)
            if codec != RAW_F32_V1:
                return codec, out
        return RAW_F32_V1, _encode_checked(RAW_F32_V1, &s, src, view.len)
    finally:
        PyBuffer_Release(&view)


cdef object _whole_buffer_exact(object payload, int which):
    cdef Py_buffer view
    _acquire_f32(payload, &view)
    try:
        if view.len % 4:
            raise_status(E_F32_SIZE)
        return bool(_scan(which, <const uint8_t *>view.buf, NULL, <size_t>(view.len // 4),
                          <size_t>view.len >= _nogil_threshold))
    finally:
        PyBuffer_Release(&view)


def is_bf16_exact(payload):
    """Whether every f32 of the buffer survives a bf16 round trip bit for bit (8.1)."""
    return _whole_buffer_exact(payload, BF16_RNE_V1)


def is_f16_exact(payload):
    """Whether every f32 of the buffer survives an f16 round trip bit for bit (8.1)."""
    return _whole_buffer_exact(payload, F16_RNE_V1)
