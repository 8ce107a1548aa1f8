# The writer's check-only frame decode (A.7.2 step 5.2); included by _frame_gen.pyx.


cdef Py_ssize_t _any_non_finite_half(const uint8_t* s, size_t n, bint is_f16) noexcept nogil:
    """0 when some 16-bit pattern is infinite or NaN (exponent all ones), else -1.
    Four lanes at a time: a lane hits when (lane & mask) == mask, i.e. when the lane of
    (x & M) ^ M is zero (the classic has-zero-lane test; exact for "any")."""
    cdef uint64_t M = 0x7C007C007C007C00ULL if is_f16 else 0x7F807F807F807F80ULL
    cdef uint64_t x, y, hit = 0
    cdef size_t i, words = n // 4
    cdef uint16_t mask = <uint16_t>(M & 0xFFFF), h
    for i in range(words):
        memcpy(&x, s + 8 * i, 8)
        y = (x & M) ^ M
        hit |= (y - 0x0001000100010001ULL) & ~y & 0x8000800080008000ULL
    for i in range(4 * words, n):
        h = <uint16_t>(s[2 * i] | (s[2 * i + 1] << 8))
        hit |= (h & mask) == mask
    return 0 if hit else -1


cdef int _check_parts(int codec, const Desc* d, const uint8_t* wire) except -1:
    """Only the value checks of decoding (the writer's frame decode, A.7.2 step 5.2):
    F16/BF16 parts are scanned for non-finite patterns without being widened."""
    cdef uint32_t i
    cdef const Part* p
    cdef uint64_t size
    cdef size_t n
    cdef Py_ssize_t bad
    for i in range(d.count):
        p = &d.parts[i]
        size = _part_wire(codec, p, False)
        n = <size_t>(p.nbytes // 4)
        if p.ggml_type == 0 and codec != RAW:
            if codec == S8:
                bad = 0
            else:
                with nogil:
                    bad = _any_non_finite_half(wire, n, codec == F16)
            if bad >= 0:  # S8 always, else only to raise the exact error
                _codec.decode_activation(codec, n // <size_t>p.dims[0], p.dims[0], _slice(wire, size), 0)
        wire += size
    return 0


cdef int _check_frame(int c, Desc* d, const uint8_t* b, Py_ssize_t n, int version) except -1:
    _read_desc(b, n, d)
    _validate(d, -1)
    _check_frame_size(c, d, n, version)
    _check_parts(c, d, b + HEADER + PART * d.count)
    return 0
