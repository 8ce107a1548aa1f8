# The C-level size checks of the compiled codec (wire-format.md 5.1-5.3), shared with the
# compiled framing (``_frame.pyx`` cimports them) so that the sizes and their error
# statuses are written once.

from libc.stdint cimport int64_t, uint64_t

# Status codes of the size and value checks; raise_status maps each to its upstream text.
cdef enum Status:
    OK = 0
    E_NEGATIVE_DIMENSIONS
    E_TOKEN_OVERFLOW
    E_ROW_OVERFLOW
    E_COLUMNS
    E_ELEMENT_OVERFLOW
    E_BYTE_OVERFLOW
    E_DECODED_OVERFLOW
    E_DECODED_MAX
    E_F32_SIZE
    E_WIRE_OVERFLOW
    E_S8_ROW_OVERFLOW
    E_WIRE_MAX
    E_WIRE_SIZE
    E_NOT_FINITE
    E_F16_RANGE
    E_BF16_RANGE
    E_S8_SCALE
    E_S8_RANGE
    E_S8_RESERVED
    E_DECODED_NON_FINITE
    E_NO_RAW
    E_UNKNOWN_CODEC


cdef struct Dims:
    int64_t token_count
    int64_t n_embd
    bint doubled  # RWKV7_V_FIRST or INKLING_MTP_EMBD sideband present (2.4)


cdef struct Shape:
    uint64_t rows
    uint64_t columns
    uint64_t elements


cdef int raise_status(int status) except -1
cdef int frame_shape(const Dims *d, Shape *s) noexcept nogil
cdef int encoded_size(int codec, const Shape *s, uint64_t *size) noexcept nogil
