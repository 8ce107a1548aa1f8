# The C kernels of ``_codec_kernels.h`` as Cython sees them, declared once for the modules
# that compile them (``_codec.pyx`` and ``_frame_gen.pyx`` cimport them; their extensions
# put this folder on the include path).

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t

cdef extern from "_codec_kernels.h" nogil:
    int skw_simd_enabled
    int skw_cpu_has_avx2_f16c()
    int skw_mul_u64(uint64_t a, uint64_t b, uint64_t *r)
    int skw_encode_bf16(const uint8_t *s, uint8_t *d, size_t n)
    int skw_encode_f16(const uint8_t *s, uint8_t *d, size_t n)
    int skw_decode_bf16(const uint8_t *s, uint8_t *d, size_t n)
    int skw_decode_f16(const uint8_t *s, uint8_t *d, size_t n)
    int skw_exact_bf16(const uint8_t *s, uint8_t *d, size_t n)
    int skw_exact_f16(const uint8_t *s, uint8_t *d, size_t n)
    Py_ssize_t skw_find_non_finite32(const uint8_t *s, size_t n)
    Py_ssize_t skw_find_bf16_overflow(const uint8_t *s, size_t n)
    Py_ssize_t skw_find_f16_overflow(const uint8_t *s, size_t n)
    Py_ssize_t skw_find_non_finite_half(const uint8_t *s, size_t n, int is_f16)
    Py_ssize_t skw_encode_s8(const uint8_t *s, uint8_t *d, size_t rows, size_t cols, int *kind)
    Py_ssize_t skw_decode_s8(const uint8_t *s, uint8_t *d, size_t rows, size_t cols, int *kind)
    void skw_copy_le32_to_host(const uint8_t *s, uint8_t *d, size_t n)
    void skw_u32_to_bf16_array(const uint32_t *s, uint16_t *d, size_t n)
    void skw_u32_to_f16_array(const uint32_t *s, uint16_t *d, size_t n)
    void skw_bf16_to_u32_array(const uint16_t *s, uint32_t *d, size_t n)
    void skw_f16_to_u32_array(const uint16_t *s, uint32_t *d, size_t n)
    enum:
        SKW_S8_BAD_SCALE
        SKW_S8_VALUE_RANGE
        SKW_S8_RESERVED
        SKW_S8_NON_FINITE
