# Little-endian loads and stores, byte-wise (payloads are unaligned, STYLE), shared by the
# compiled framing modules (``_frame.pyx`` and ``_frame_gen.pyx`` cimport them).

from libc.stdint cimport int32_t, uint8_t, uint32_t, uint64_t


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
