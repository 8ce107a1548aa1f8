// matmul_rows.h — the kernels that keep each activation row in its own 256-bit register
// (q4_1_rows, q8_0_rows), included by matmul.cpp once per instruction set, inside its
// namespace: ROWS_TARGET is the functions' target and ROWS_VNNI picks the integer dot
// product of a block, AVX2's maddubs + madd or AVX-512 VNNI's dpbusd on 256 bits.  Both
// give the same int32 sums (pair sums stay far from int16 saturation: |x| <= 128, |y| <= 127
// for Q8_0, 15 x 128 for Q4_1's nibbles), so the results are bit for bit ggml's either way.

// A block's scale products d_x * d_y for a group's NC rows (exact: two fp16 values), from
// d_x in lane 0 of `dx` and the rows' scales `yd` (their [group][block][COLS] entries): one
// 128-bit product for the group, from which row_scale() spreads row j's over 8 lanes with a
// permute, leaving Zen 4's multiply ports to the dot products' fused adds (twenty-fourth
// session: batches 5-11% faster than a 256-bit product per row).  A lone row: one product.
template <int NC> __attribute__((target(ROWS_TARGET))) inline __m256 group_scales(__m128 dx, const float * yd) {
    if constexpr (NC == 1) return _mm256_mul_ps(_mm256_broadcastss_ps(dx), _mm256_broadcast_ss(yd));
    return _mm256_castps128_ps256(_mm_mul_ps(_mm_broadcastss_ps(dx), _mm_loadu_ps(yd)));
}

template <int NC> __attribute__((target(ROWS_TARGET))) inline __m256 row_scale(__m256 scales, int j) {
    if constexpr (NC == 1) return scales;
    return _mm256_permutevar8x32_ps(scales, _mm256_set1_epi32(j));
}

// Output rows [r0, r1) of activation rows c0 .. c0 + NC - 1 (c0 a multiple of COLS): dst =
// w x q (see q4_1_product), ggml's AVX2 arithmetic per output element.
template <int NC>
__attribute__((target(ROWS_TARGET))) void q4_1_rows(ggml_tensor * dst, int64_t r0, int64_t r1, int64_t c0,
                                                    const paired_rows & p) {
    const ggml_tensor * w = dst->src[0];
    const ggml_tensor * q = dst->src[1];
    const int64_t nb = w->ne[0] / QK;
    const __m256i low = _mm256_set1_epi8(0xF);
#if ROWS_VNNI
    const __m256i high_half = _mm256_set_epi64x(0x0004000400040004, 0x0004000400040004, 0, 0);  // shift counts
#else
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    const block_q8_1_view * y[NC];
    for (int j = 0; j < NC; j++) {
        y[j] = reinterpret_cast<const block_q8_1_view *>(static_cast<const char *>(q->data) + (c0 + j) * q->nb[1]);
    }
    const float * yd = p.group_scales_from(c0, nb);
    const float * ys = p.group_sums_from(c0, nb);
    for (int64_t r = r0; r < r1; r++) {
        const auto * x = reinterpret_cast<const block_q4_1_view *>(static_cast<const char *>(w->data) + r * w->nb[1]);
        __m256 acc[NC];
        for (int j = 0; j < NC; j++) acc[j] = _mm256_setzero_ps();
        __m128 summs = _mm_setzero_ps();
        prefetch_ahead(x, w->nb[1]);
        for (int64_t b = 0; b < nb; b++) {
            const __m128 dm = scale_and_min(x[b]);
            const __m256 scales = group_scales<NC>(dm, yd + b * COLS);
            // one rounding per row, as ggml's contracted m * s + summs
            summs = _mm_fmadd_ps(_mm_shuffle_ps(dm, dm, 0x55), _mm_loadu_ps(ys + b * COLS), summs);
            const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i *>(x[b].qs));
#if ROWS_VNNI  // low nibbles in the low 128 bits, high ones in the high: one shift of both halves
            const __m256i qx = _mm256_and_si256(low, _mm256_srlv_epi16(_mm256_broadcastsi128_si256(packed), high_half));
#else
            const __m256i qx = _mm256_and_si256(low, _mm256_set_m128i(_mm_srli_epi16(packed, 4), packed));
#endif
            for (int j = 0; j < NC; j++) {
                const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(y[j][b].qs));
#if ROWS_VNNI
                const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), qx, qy);
#else
                const __m256i dot = _mm256_madd_epi16(ones, _mm256_maddubs_epi16(qx, qy));
#endif
                acc[j] = _mm256_fmadd_ps(row_scale<NC>(scales, j), _mm256_cvtepi32_ps(dot), acc[j]);
            }
        }
        float sums[COLS];
        _mm_storeu_ps(sums, summs);
        for (int j = 0; j < NC; j++) {
            float * out = reinterpret_cast<float *>(static_cast<char *>(dst->data) + (c0 + j) * dst->nb[1]);
            out[r] = hsum8(acc[j]) + sums[j];
        }
    }
}

// Output rows [r0, r1) of activation rows c0 .. c0 + NC - 1 for a Q8_0 matrix (SmolLM2's
// tied head): ggml_vec_dot_q8_0_q8_0's AVX2 arithmetic, which for two rows or more is also
// that of ggml's tinyBLAS kernel (the same products, fused adds and horizontal sum).  With
// VNNI the weights are offset by 128 (x ^ 0x80, unsigned for dpbusd) and each lane's sum
// starts at the row's -128 x its 4 values (p.fix): the same int32 as maddubs(|x|, sign(y, x)) + madd.
template <int NC>
__attribute__((target(ROWS_TARGET))) void q8_0_rows(ggml_tensor * dst, int64_t r0, int64_t r1, int64_t c0,
                                                    const paired_rows & p) {
    const ggml_tensor * w = dst->src[0];
    const ggml_tensor * q = dst->src[1];
    const int64_t nb = w->ne[0] / QK;
#if ROWS_VNNI
    const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
    const int32_t * fix = p.fix_from(c0, nb);
#else
    const __m256i ones = _mm256_set1_epi16(1);
#endif
    const block_q8_0_view * y[NC];
    for (int j = 0; j < NC; j++) {
        y[j] = reinterpret_cast<const block_q8_0_view *>(static_cast<const char *>(q->data) + (c0 + j) * q->nb[1]);
    }
    const float * yd = p.group_scales_from(c0, nb);
    for (int64_t r = r0; r < r1; r++) {
        const auto * x = reinterpret_cast<const block_q8_0_view *>(static_cast<const char *>(w->data) + r * w->nb[1]);
        prefetch_ahead(x, w->nb[1]);
        __m256 acc[NC];
        for (int j = 0; j < NC; j++) acc[j] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const __m256 scales = group_scales<NC>(_mm_set_ss(_cvtsh_ss(x[b].d)), yd + b * COLS);
            const __m256i qx = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(x[b].qs));
#if ROWS_VNNI
            const __m256i ux = _mm256_xor_si256(offset, qx);
#else
            const __m256i ax = _mm256_sign_epi8(qx, qx);
#endif
            for (int j = 0; j < NC; j++) {
                const __m256i qy = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(y[j][b].qs));
#if ROWS_VNNI
                const __m256i start = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(row_lanes(fix, nb, j, b)));
                const __m256i dot = _mm256_dpbusd_epi32(start, ux, qy);
#else
                const __m256i dot = _mm256_madd_epi16(ones, _mm256_maddubs_epi16(ax, _mm256_sign_epi8(qy, qx)));
#endif
                acc[j] = _mm256_fmadd_ps(row_scale<NC>(scales, j), _mm256_cvtepi32_ps(dot), acc[j]);
            }
        }
        for (int j = 0; j < NC; j++) {
            float * out = reinterpret_cast<float *>(static_cast<char *>(dst->data) + (c0 + j) * dst->nb[1]);
            out[r] = hsum8(acc[j]);
        }
    }
}
