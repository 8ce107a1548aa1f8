/* skippy_wire/wire/_codec_kernels.h -- C kernels behind skippy_wire.wire._codec.
 *
 * Contract (wire-format.md 6.5-6.7, 8.1; docs/numerics.md):
 *   - Inputs are raw little-endian byte buffers that may be misaligned: every word is
 *     loaded with memcpy (never through a float * cast) and byte-swapped on big-endian
 *     hosts.  Outputs to the wire are little-endian too; decoded f32 values are written
 *     in host order into the caller's float32 array.
 *   - Conversions work on integer bit patterns (round to nearest, ties to even), so the
 *     result never depends on the floating-point environment.  The only float operations
 *     are exact ones (small int -> float, products of an int8 and an f32 in double) and
 *     the S8 quotients, which upstream defines in f64 arithmetic.
 *   - Kernels never allocate, never touch Python objects and may run without the GIL.
 *     They trust their caller for lengths.  A kernel that can fail returns a flag
 *     ("something is wrong somewhere": the caller then locates and classifies the first
 *     bad element with a skw_find_* function) or the index of the first bad element,
 *     -1 when every element is fine (status-then-raise).
 *   - Every fast loop exists twice: a portable body written so that the compiler can
 *     auto-vectorise it (branch-free, check flags OR-accumulated and tested after the
 *     loop), and on x86 an AVX2(+F16C) variant chosen at run time by CPU feature.  The
 *     portable body is the "scalar" path that tests compare the SIMD path against
 *     (skw_set_simd(0) forces it).  AVX-512 BF16 conversion instructions are not used:
 *     they flush subnormals and are not byte-exact.
 *
 * Bit layouts:
 *   f32  [s|eeeeeeee|mmmmmmmmmmmmmmmmmmmmmmm]   bias 127
 *   f16  [s|eeeee|mmmmmmmmmm]                   bias 15
 *   bf16 [s|eeeeeeee|mmmmmmm]                   the top half of an f32
 */
#ifndef SKIPPY_WIRE_CODEC_KERNELS_H
#define SKIPPY_WIRE_CODEC_KERNELS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#define SKW_X86_DISPATCH 1
#include <immintrin.h>
#endif

#if defined(__GNUC__)
#define SKW_INLINE static inline __attribute__((always_inline))
#else
#define SKW_INLINE static inline
#endif

/* ------------------------------------------------------------------ byte order */

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define SKW_LE32(x) __builtin_bswap32(x)
#define SKW_LE16(x) __builtin_bswap16(x)
#else
#define SKW_LE32(x) (x)
#define SKW_LE16(x) (x)
#endif

SKW_INLINE uint32_t skw_ld32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return SKW_LE32(v); }
SKW_INLINE uint16_t skw_ld16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return (uint16_t)SKW_LE16(v); }
SKW_INLINE void skw_st32(uint8_t *p, uint32_t v) { v = SKW_LE32(v); memcpy(p, &v, 4); }
SKW_INLINE void skw_st16(uint8_t *p, uint32_t v) { uint16_t h = (uint16_t)SKW_LE16((uint16_t)v); memcpy(p, &h, 2); }
/* decoded values go to a host-order float32 array */
SKW_INLINE void skw_st32_host(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }

SKW_INLINE uint32_t skw_non_finite32(uint32_t b) { return (b & 0x7f800000u) == 0x7f800000u; }

/* usize checked_mul on 64 bits (upstream sizes are 64-bit usize). */
static inline int skw_mul_u64(uint64_t a, uint64_t b, uint64_t *r)
{
    if (a != 0 && b > UINT64_MAX / a) return 1;
    *r = a * b;
    return 0;
}

/* ------------------------------------------------------------------ run-time dispatch */

static int skw_simd_enabled = 1;

static int skw_cpu_has_avx2_f16c(void)
{
#ifdef SKW_X86_DISPATCH
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    }
    return cached;
#else
    return 0;
#endif
}

SKW_INLINE int skw_use_avx2(void) { return skw_simd_enabled && skw_cpu_has_avx2_f16c(); }

/* ------------------------------------------------------------------ scalar conversions */

/* f32 -> bf16 (6.6): add 0x7fff + L and keep the top half.
 *
 *   bits: [ s eeeeeeee mmmmmmm | L ] [ R ssssssssssssss ]
 *          kept 16 bits      ^lsb      dropped 16 bits (R = round bit, s = sticky)
 *   0x7fff + L carries into the kept half iff R and (sticky or L): round half to even.
 *   A carry out of the mantissa bumps the exponent; out of the largest exponent it gives
 *   +-inf (0x7f80), which encode reports as out of range.
 */
SKW_INLINE uint32_t skw_bf16_rne(uint32_t b) { return (b + 0x7fffu + ((b >> 16) & 1u)) >> 16; }

/* The raw conversion with the project NaN policy: the bias trick could carry a NaN into
 * infinity (0x7f800001) or into the sign (0x7fffffff), so a NaN keeps its top 16 bits
 * and gets the quiet bit set. */
SKW_INLINE uint32_t skw_f32_to_bf16_bits(uint32_t b)
{
    uint32_t is_nan = (b & 0x7fffffffu) > 0x7f800000u;
    return is_nan ? ((b >> 16) | 0x0040u) : (skw_bf16_rne(b) & 0xffffu);
}

/* f32 -> f16 (6.5), branch-free so that loops over it vectorise.
 *
 * Normal f16 range (|x| >= 2^-14): rebias the exponent (-112 = -127 + 15) and round away
 * the 13 low mantissa bits with the same bias trick as bf16:
 *     [ s eeeee mmmmmmmmmm | L ] [ R ssssssssssss ]   add 0xfff + L, shift right 13
 * A mantissa carry bumps the exponent; |x| >= 65520 reaches 0x7c00 (infinity) and larger
 * values are clamped there.
 * Subnormal f16 range: shift the significand with its implicit bit right by 126 - e
 * (14..24; clamped to 25, where everything rounds to zero) and round half to even on
 * the remainder; q may carry into 0x400, the smallest normal, which is correct.
 * NaN -> 0x7c01 | sign (payload dropped, quiet bit not set), as upstream.
 */
SKW_INLINE uint32_t skw_f32_to_f16_bits(uint32_t b)
{
    uint32_t sign = (b >> 16) & 0x8000u;
    uint32_t a = b & 0x7fffffffu;
    uint32_t nrm = (a - (112u << 23) + 0x0fffu + ((a >> 13) & 1u)) >> 13;
    nrm = nrm > 0x7c00u ? 0x7c00u : nrm;
    int32_t sh = 126 - (int32_t)(a >> 23);
    sh = sh < 14 ? 14 : sh;
    sh = sh > 25 ? 25 : sh;
    uint32_t mm = (a & 0x7fffffu) | 0x800000u;
    uint32_t q = mm >> sh;
    uint32_t rem = mm & ((1u << sh) - 1u);
    uint32_t half = 1u << (sh - 1);
    q += (rem > half) | ((rem == half) & q & 1u);
    uint32_t r = a < 0x38800000u ? q : nrm;
    r = a > 0x7f800000u ? 0x7c01u : r;
    return sign | r;
}

/* f16 -> f32 (6.5), exact.  A subnormal h = m * 2^-24 is normalised through the exact
 * int -> float conversion of m (m < 2^10), then rescaled by subtracting 24 from the
 * exponent field: integer work on an exact bit pattern, so no rounding mode or
 * flush-to-zero setting can change it. */
SKW_INLINE uint32_t skw_f16_to_f32_bits(uint32_t h)
{
    uint32_t sign = (h & 0x8000u) << 16;
    uint32_t a = h & 0x7fffu;
    uint32_t nrm = (a << 13) + (112u << 23);
    float fm = (float)(int32_t)a;
    uint32_t fb;
    memcpy(&fb, &fm, 4);
    uint32_t sub = a == 0 ? 0u : fb - (24u << 23);
    uint32_t r = a >= 0x400u ? nrm : sub;
    r = a >= 0x7c00u ? (0x7f800000u | ((a & 0x3ffu) << 13)) : r;
    return sign | r;
}

SKW_INLINE uint32_t skw_non_finite16(uint32_t h) { return (h & 0x7c00u) == 0x7c00u; }
SKW_INLINE uint32_t skw_non_finite_bf16(uint32_t h) { return (h & 0x7f80u) == 0x7f80u; }

/* ------------------------------------------------------------------ portable loop bodies */

SKW_INLINE uint32_t skw_bf16_to_f32_bits(uint32_t h) { return h << 16; }

/* Encode n f32 -> 16-bit patterns.  Returns nonzero when some input is non-finite or some
 * result overflowed to infinity (the caller then finds out which, in upstream order). */
#define SKW_BODY_ENCODE(name, to_half, half_non_finite)                      \
    SKW_INLINE int name(const uint8_t *src, uint8_t *dst, size_t n)         \
    {                                                                        \
        uint32_t bad = 0;                                                    \
        for (size_t i = 0; i < n; i++) {                                     \
            uint32_t b = skw_ld32(src + 4 * i);                              \
            uint32_t h = to_half(b);                                         \
            bad |= skw_non_finite32(b) | half_non_finite(h);                 \
            skw_st16(dst + 2 * i, h);                                        \
        }                                                                    \
        return bad != 0;                                                     \
    }

/* Decode n 16-bit patterns -> f32: nonzero when some half is inf/NaN. */
#define SKW_BODY_DECODE(name, to_f32, half_non_finite)                       \
    SKW_INLINE int name(const uint8_t *src, uint8_t *dst, size_t n)         \
    {                                                                        \
        uint32_t bad = 0;                                                    \
        for (size_t i = 0; i < n; i++) {                                     \
            uint32_t h = skw_ld16(src + 2 * i);                              \
            bad |= half_non_finite(h);                                       \
            skw_st32_host(dst + 4 * i, to_f32(h));                           \
        }                                                                    \
        return bad != 0;                                                     \
    }

SKW_BODY_ENCODE(skw_body_encode_bf16, skw_bf16_rne, skw_non_finite_bf16)
SKW_BODY_ENCODE(skw_body_encode_f16, skw_f32_to_f16_bits, skw_non_finite16)
SKW_BODY_DECODE(skw_body_decode_bf16, skw_bf16_to_f32_bits, skw_non_finite_bf16)
SKW_BODY_DECODE(skw_body_decode_f16, skw_f16_to_f32_bits, skw_non_finite16)

/* Exactness (8.1 step 3) fused with writing the 16-bit patterns: returns 1 when every
 * value is finite and survives the round trip bit for bit; the written halves are then
 * exactly the wire payload of that codec. */
SKW_INLINE int skw_body_exact_bf16(const uint8_t *src, uint8_t *dst, size_t n)
{
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t b = skw_ld32(src + 4 * i);
        bad |= skw_non_finite32(b) | (b & 0xffffu);
        if (dst) skw_st16(dst + 2 * i, b >> 16);
    }
    return bad == 0;
}

SKW_INLINE int skw_body_exact_f16(const uint8_t *src, uint8_t *dst, size_t n)
{
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t b = skw_ld32(src + 4 * i);
        uint32_t h = skw_f32_to_f16_bits(b);
        bad |= skw_non_finite32(b) | (skw_f16_to_f32_bits(h) != b);
        if (dst) skw_st16(dst + 2 * i, h);
    }
    return bad == 0;
}

/* Portable instantiations ("scalar" path: whatever the baseline ISA auto-vectorises). */
static int skw_encode_bf16_portable(const uint8_t *s, uint8_t *d, size_t n) { return skw_body_encode_bf16(s, d, n); }
static int skw_encode_f16_portable(const uint8_t *s, uint8_t *d, size_t n) { return skw_body_encode_f16(s, d, n); }
static int skw_decode_bf16_portable(const uint8_t *s, uint8_t *d, size_t n) { return skw_body_decode_bf16(s, d, n); }
static int skw_decode_f16_portable(const uint8_t *s, uint8_t *d, size_t n) { return skw_body_decode_f16(s, d, n); }
static int skw_exact_bf16_portable(const uint8_t *s, uint8_t *d, size_t n)
{
    return d ? skw_body_exact_bf16(s, d, n) : skw_body_exact_bf16(s, NULL, n);
}
static int skw_exact_f16_portable(const uint8_t *s, uint8_t *d, size_t n)
{
    return d ? skw_body_exact_f16(s, d, n) : skw_body_exact_f16(s, NULL, n);
}

/* ------------------------------------------------------------------ x86 AVX2 + F16C */
#ifdef SKW_X86_DISPATCH

#define SKW_AVX2 __attribute__((target("avx2,f16c")))

/* bf16: the portable body compiled for AVX2 vectorises 8 lanes wide. */
SKW_AVX2 static int skw_encode_bf16_avx2(const uint8_t *s, uint8_t *d, size_t n) { return skw_body_encode_bf16(s, d, n); }
SKW_AVX2 static int skw_decode_bf16_avx2(const uint8_t *s, uint8_t *d, size_t n) { return skw_body_decode_bf16(s, d, n); }
SKW_AVX2 static int skw_exact_bf16_avx2(const uint8_t *s, uint8_t *d, size_t n)
{
    return d ? skw_body_exact_bf16(s, d, n) : skw_body_exact_bf16(s, NULL, n);
}

/* The 8-lane pieces of the f16 kernels: unaligned loads/stores and the lanes whose
 * exponent field is all ones (inf or NaN). */
SKW_AVX2 static inline __m256i skw_avx2_ld_f32x8(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)(const void *)p); }
SKW_AVX2 static inline __m128i skw_avx2_ld_f16x8(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)(const void *)p); }
SKW_AVX2 static inline void skw_avx2_st_f16x8(uint8_t *p, __m128i h) { _mm_storeu_si128((__m128i *)(void *)p, h); }
SKW_AVX2 static inline __m256i skw_avx2_non_finite32(__m256i b)
{
    const __m256i exp32 = _mm256_set1_epi32(0x7f800000);
    return _mm256_cmpeq_epi32(_mm256_and_si256(b, exp32), exp32);
}
SKW_AVX2 static inline __m128i skw_avx2_non_finite16(__m128i h)
{
    const __m128i exp16 = _mm_set1_epi16(0x7c00);
    return _mm_cmpeq_epi16(_mm_and_si128(h, exp16), exp16);
}

/* f16 with F16C.  vcvtps2ph with imm 0 rounds to nearest even from the integer
 * representation of the operands, exactly as 6.5 for every finite input (f32 subnormals
 * become signed zeros either way); it would quieten NaN payloads, but non-finite inputs
 * are flagged and rejected, so no hardware NaN ever reaches the wire. */
SKW_AVX2 static int skw_encode_f16_avx2(const uint8_t *src, uint8_t *dst, size_t n)
{
    __m256i bad32 = _mm256_setzero_si256();
    __m128i bad16 = _mm_setzero_si128();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i b = skw_avx2_ld_f32x8(src + 4 * i);
        __m128i h = _mm256_cvtps_ph(_mm256_castsi256_ps(b), 0);
        bad32 = _mm256_or_si256(bad32, skw_avx2_non_finite32(b));
        bad16 = _mm_or_si128(bad16, skw_avx2_non_finite16(h));
        skw_avx2_st_f16x8(dst + 2 * i, h);
    }
    int bad = !_mm256_testz_si256(bad32, bad32) || !_mm_testz_si128(bad16, bad16);
    return skw_body_encode_f16(src + 4 * i, dst + 2 * i, n - i) | bad;
}

/* vcvtph2ps is exact for every finite half (subnormals included). */
SKW_AVX2 static int skw_decode_f16_avx2(const uint8_t *src, uint8_t *dst, size_t n)
{
    __m128i bad16 = _mm_setzero_si128();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = skw_avx2_ld_f16x8(src + 2 * i);
        bad16 = _mm_or_si128(bad16, skw_avx2_non_finite16(h));
        _mm256_storeu_ps((float *)(void *)(dst + 4 * i), _mm256_cvtph_ps(h));
    }
    int bad = !_mm_testz_si128(bad16, bad16);
    return skw_body_decode_f16(src + 2 * i, dst + 4 * i, n - i) | bad;
}

/* f16 exactness: round trip through F16C and compare bit patterns; inf survives the
 * round trip, so non-finite inputs are excluded explicitly (8.1 step 3). */
SKW_AVX2 static int skw_exact_f16_avx2(const uint8_t *src, uint8_t *dst, size_t n)
{
    __m256i bad = _mm256_setzero_si256();
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i b = skw_avx2_ld_f32x8(src + 4 * i);
        __m128i h = _mm256_cvtps_ph(_mm256_castsi256_ps(b), 0);
        __m256i back = _mm256_castps_si256(_mm256_cvtph_ps(h));
        bad = _mm256_or_si256(bad, skw_avx2_non_finite32(b));
        bad = _mm256_or_si256(bad, _mm256_xor_si256(back, b));
        if (dst) skw_avx2_st_f16x8(dst + 2 * i, h);
    }
    if (!_mm256_testz_si256(bad, bad)) return 0;
    return skw_body_exact_f16(src + 4 * i, dst ? dst + 2 * i : NULL, n - i);
}

#endif /* SKW_X86_DISPATCH */

/* ------------------------------------------------------------------ dispatchers */

typedef int (*skw_kernel)(const uint8_t *, uint8_t *, size_t);

#ifdef SKW_X86_DISPATCH
#define SKW_PICK(name) (skw_use_avx2() ? name##_avx2 : name##_portable)
#else
#define SKW_PICK(name) (name##_portable)
#endif

static int skw_encode_bf16(const uint8_t *s, uint8_t *d, size_t n) { return SKW_PICK(skw_encode_bf16)(s, d, n); }
static int skw_encode_f16(const uint8_t *s, uint8_t *d, size_t n) { return SKW_PICK(skw_encode_f16)(s, d, n); }
static int skw_decode_bf16(const uint8_t *s, uint8_t *d, size_t n) { return SKW_PICK(skw_decode_bf16)(s, d, n); }
static int skw_decode_f16(const uint8_t *s, uint8_t *d, size_t n) { return SKW_PICK(skw_decode_f16)(s, d, n); }

/* Exactness over the whole buffer in blocks, stopping at the first block that fails
 * (dst may be NULL for a pure scan). */
#define SKW_EXACT_BLOCK 8192
static int skw_exact_blocks(skw_kernel k, const uint8_t *src, uint8_t *dst, size_t n)
{
    for (size_t i = 0; i < n; i += SKW_EXACT_BLOCK) {
        size_t m = n - i < SKW_EXACT_BLOCK ? n - i : SKW_EXACT_BLOCK;
        if (!k(src + 4 * i, dst ? dst + 2 * i : NULL, m)) return 0;
    }
    return 1;
}
static int skw_exact_bf16(const uint8_t *s, uint8_t *d, size_t n) { return skw_exact_blocks(SKW_PICK(skw_exact_bf16), s, d, n); }
static int skw_exact_f16(const uint8_t *s, uint8_t *d, size_t n) { return skw_exact_blocks(SKW_PICK(skw_exact_f16), s, d, n); }

/* ------------------------------------------------------------------ locating errors */

/* Index of the first non-finite f32, or -1. */
static ptrdiff_t skw_find_non_finite32(const uint8_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (skw_non_finite32(skw_ld32(src + 4 * i))) return (ptrdiff_t)i;
    return -1;
}

/* Index of the first finite f32 whose bf16 / f16 rounding overflows to infinity, or -1. */
static ptrdiff_t skw_find_bf16_overflow(const uint8_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (skw_non_finite_bf16(skw_bf16_rne(skw_ld32(src + 4 * i)))) return (ptrdiff_t)i;
    return -1;
}

static ptrdiff_t skw_find_f16_overflow(const uint8_t *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (skw_non_finite16(skw_f32_to_f16_bits(skw_ld32(src + 4 * i)))) return (ptrdiff_t)i;
    return -1;
}

/* ------------------------------------------------------------------ S8RowF32RneV1 (6.7) */

enum { SKW_S8_OK = 0, SKW_S8_BAD_SCALE = 1, SKW_S8_VALUE_RANGE = 2, SKW_S8_RESERVED = 3, SKW_S8_NON_FINITE = 4 };

SKW_INLINE float skw_f32_from_bits(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
SKW_INLINE uint32_t skw_bits_from_f32(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }

/* Largest |v| of a row as a bit pattern: for non-negative floats the integer order is
 * the float order, so an integer max (which vectorises) finds max_abs exactly. */
SKW_INLINE uint32_t skw_body_s8_max_abs(const uint8_t *in, size_t cols)
{
    uint32_t m = 0;
    for (size_t c = 0; c < cols; c++) {
        uint32_t a = skw_ld32(in + 4 * c) & 0x7fffffffu;
        m = a > m ? a : m;
    }
    return m;
}

/* Quantise one row with its scale; nonzero when some f32(q) * scale overflows.  Written
 * without early exits so that it vectorises; the caller locates the first failure. */
SKW_INLINE int skw_body_s8_quantize(const uint8_t *in, uint8_t *out, size_t cols, double scale)
{
    uint32_t bad = 0;
    for (size_t c = 0; c < cols; c++) {
        double x = (double)skw_f32_from_bits(skw_ld32(in + 4 * c)) / scale;
        double fl = floor(x);
        double fr = x - fl; /* exact */
        double half = fl * 0.5;
        double up = fl + 1.0;
        double r = fr < 0.5 ? fl : (fr > 0.5 ? up : (floor(half) == half ? fl : up)); /* ties to even */
        r = r < -127.0 ? -127.0 : r;
        r = r > 127.0 ? 127.0 : r;
        int32_t q = (int32_t)r;
        bad |= skw_non_finite32(skw_bits_from_f32((float)((double)q * scale))); /* f32(q) * scale, rounded once */
        out[c] = (uint8_t)(int8_t)q;
    }
    return bad != 0;
}

static uint32_t skw_s8_max_abs_portable(const uint8_t *in, size_t cols) { return skw_body_s8_max_abs(in, cols); }
static int skw_s8_quantize_portable(const uint8_t *in, uint8_t *out, size_t cols, double scale)
{
    return skw_body_s8_quantize(in, out, cols, scale);
}
#ifdef SKW_X86_DISPATCH
SKW_AVX2 static uint32_t skw_s8_max_abs_avx2(const uint8_t *in, size_t cols)
{
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    __m256i m = _mm256_setzero_si256();
    size_t c = 0;
    for (; c + 8 <= cols; c += 8)
        m = _mm256_max_epu32(m, _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(const void *)(in + 4 * c)), abs_mask));
    uint32_t lanes[8];
    _mm256_storeu_si256((__m256i *)(void *)lanes, m);
    uint32_t best = skw_body_s8_max_abs(in + 4 * c, cols - c);
    for (int i = 0; i < 8; i++) best = lanes[i] > best ? lanes[i] : best;
    return best;
}

/* Four values at a time in double: the f64 quotient, vroundpd with an explicit
 * round-to-nearest-even immediate (ties to even, independent of MXCSR, the same result
 * as the floor/fraction rule), clamp, and the overflow check on f32(q) * scale. */
SKW_AVX2 static int skw_s8_quantize_avx2(const uint8_t *in, uint8_t *out, size_t cols, double scale)
{
    const __m256d vs = _mm256_set1_pd(scale);
    const __m256d lo = _mm256_set1_pd(-127.0), hi = _mm256_set1_pd(127.0);
    const __m128i exp32 = _mm_set1_epi32(0x7f800000);
    __m128i bad = _mm_setzero_si128();
    size_t c = 0;
    for (; c + 4 <= cols; c += 4) {
        __m128 v = _mm_castsi128_ps(_mm_loadu_si128((const __m128i *)(const void *)(in + 4 * c)));
        __m256d x = _mm256_div_pd(_mm256_cvtps_pd(v), vs);
        __m256d r = _mm256_round_pd(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        r = _mm256_min_pd(_mm256_max_pd(r, lo), hi);
        __m128 prod = _mm256_cvtpd_ps(_mm256_mul_pd(r, vs)); /* exact product, rounded once */
        bad = _mm_or_si128(bad, _mm_cmpeq_epi32(_mm_and_si128(_mm_castps_si128(prod), exp32), exp32));
        __m128i q = _mm256_cvtpd_epi32(r); /* integral values: exact */
        __m128i q8 = _mm_packs_epi16(_mm_packs_epi32(q, q), q); /* |q| <= 127: no saturation */
        uint32_t w = (uint32_t)_mm_cvtsi128_si32(q8);
        memcpy(out + c, &w, 4);
    }
    int b = !_mm_testz_si128(bad, bad);
    return skw_body_s8_quantize(in + 4 * c, out + c, cols - c, scale) | b;
}
#endif

/* Encode rows x cols finite f32 (the caller has already rejected non-finite input).
 * Returns -1, or the element index of the first failure with *kind set. */
static ptrdiff_t skw_encode_s8(const uint8_t *src, uint8_t *dst, size_t rows, size_t cols, int *kind)
{
    uint32_t (*max_abs_of)(const uint8_t *, size_t) = SKW_PICK(skw_s8_max_abs);
    int (*quantize)(const uint8_t *, uint8_t *, size_t, double) = SKW_PICK(skw_s8_quantize);
    for (size_t r = 0; r < rows; r++) {
        const uint8_t *in = src + 4 * cols * r;
        uint8_t *out = dst + (cols + 4) * r;
        uint32_t max_abs = max_abs_of(in, cols);
        uint32_t scale_bits;
        if (max_abs == 0) {
            scale_bits = 0x3f800000u; /* an all-zero row uses scale 1.0 */
        } else {
            /* f32(RNE of the f64 quotient), then max(scale, smallest positive subnormal) */
            scale_bits = skw_bits_from_f32((float)((double)skw_f32_from_bits(max_abs) / 127.0));
            if ((scale_bits & 0x7fffffffu) == 0) scale_bits = 1u;
        }
        if (skw_non_finite32(scale_bits) || (scale_bits & 0x80000000u) || scale_bits == 0) {
            *kind = SKW_S8_BAD_SCALE;
            return (ptrdiff_t)(cols * r);
        }
        double scale = (double)skw_f32_from_bits(scale_bits);
        skw_st32(out, scale_bits);
        if (quantize(in, out + 4, cols, scale)) {
            for (size_t c = 0; c < cols; c++) { /* locate the first value out of range */
                uint8_t q;
                if (skw_body_s8_quantize(in + 4 * c, &q, 1, scale)) {
                    *kind = SKW_S8_VALUE_RANGE;
                    return (ptrdiff_t)(cols * r + c);
                }
            }
        }
    }
    return -1;
}

/* Decode rows of (4 + cols) bytes into host-order f32.  Returns -1 or the first failing
 * element index (row * cols for a bad scale) with *kind set. */
static ptrdiff_t skw_decode_s8(const uint8_t *src, uint8_t *dst, size_t rows, size_t cols, int *kind)
{
    for (size_t r = 0; r < rows; r++) {
        const uint8_t *in = src + (cols + 4) * r;
        uint32_t scale_bits = skw_ld32(in);
        /* not finite, or <= 0 (+0, -0 and every negative) */
        if (skw_non_finite32(scale_bits) || (scale_bits & 0x80000000u) || scale_bits == 0) {
            *kind = SKW_S8_BAD_SCALE;
            return (ptrdiff_t)(cols * r);
        }
        double scale = (double)skw_f32_from_bits(scale_bits);
        for (size_t c = 0; c < cols; c++) {
            int32_t q = (int8_t)in[4 + c];
            if (q == -128) {
                *kind = SKW_S8_RESERVED;
                return (ptrdiff_t)(cols * r + c);
            }
            uint32_t v = skw_bits_from_f32((float)((double)q * scale));
            if (skw_non_finite32(v)) {
                *kind = SKW_S8_NON_FINITE;
                return (ptrdiff_t)(cols * r + c);
            }
            skw_st32_host(dst + 4 * (cols * r + c), v);
        }
    }
    return -1;
}

/* ------------------------------------------------------------------ raw helpers */

/* Little-endian f32 wire words -> host-order f32 (a plain copy on little-endian hosts). */
static void skw_copy_le32_to_host(const uint8_t *src, uint8_t *dst, size_t n)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (size_t i = 0; i < n; i++) skw_st32_host(dst + 4 * i, skw_ld32(src + 4 * i));
#else
    memcpy(dst, src, 4 * n);
#endif
}

/* Raw element-wise conversions over host-order arrays (no checks, NaN policy above). */
static void skw_u32_to_bf16_array(const uint32_t *src, uint16_t *dst, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = (uint16_t)skw_f32_to_bf16_bits(src[i]);
}
static void skw_u32_to_f16_array(const uint32_t *src, uint16_t *dst, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = (uint16_t)skw_f32_to_f16_bits(src[i]);
}
static void skw_bf16_to_u32_array(const uint16_t *src, uint32_t *dst, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = (uint32_t)src[i] << 16;
}
static void skw_f16_to_u32_array(const uint16_t *src, uint32_t *dst, size_t n)
{
    for (size_t i = 0; i < n; i++) dst[i] = skw_f16_to_f32_bits(src[i]);
}

#endif /* SKIPPY_WIRE_CODEC_KERNELS_H */
