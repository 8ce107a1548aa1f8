// matmul.cpp — products of Q4_1 and Q8_0 weight matrices with activation rows
// (docs/backend.md "The weight product kernels").
//
// ggml's CPU backend multiplies a Q4_1 matrix by a batch one (weight row, activation row)
// pair at a time (ggml_vec_dot_q4_1_q8_1 on x86: no multi-row kernel), so every pair pays
// again for unpacking the weight nibbles and converting the block scales, and a decode
// step streams each weight matrix from memory with no prefetch ahead of the dot products.
// Here each weight block is loaded once for up to COLS activation rows (prefill chunks,
// multi-session decode batches), and the weight rows PREFETCH_ROWS ahead are requested
// while the current one is multiplied.  Where the CPU has AVX-512 VNNI, the integer dot
// product of a block is one dpbusd, and where it also computes 512 bits at once two
// activation rows share each 512-bit register from two rows on (paired_rows): one integer
// dot product, one scale product and one fused multiply-add serve both (kernels_for()
// chooses per product).  Per output element the arithmetic is exactly
// ggml's AVX2 dot product (the same integer sums, the same fused multiply-adds in the same
// order, the same horizontal sum), so results are bit for bit those of ggml_mul_mat:
// skippy_weight_product_check() compares the two.

#include "stage_internal.h"

#include <immintrin.h>

#include <random>
#include <string>
#include <type_traits>

namespace skippy_stage {

namespace {

constexpr int QK = 32;   // values per Q4_1 / Q8_1 block
constexpr int COLS = 4;  // activation rows per pass over a weight row
constexpr int PREFETCH_ROWS = 8;  // 8 x 360 bytes for SmolLM2's rows: far enough to arrive in time

struct block_q4_1_view { ggml_fp16_t d, m; uint8_t qs[QK / 2]; };
struct block_q8_1_view { ggml_fp16_t d, s; int8_t qs[QK]; };
struct block_q8_0_view { ggml_fp16_t d; int8_t qs[QK]; };
static_assert(sizeof(block_q4_1_view) == 20 && sizeof(block_q8_1_view) == 36 && sizeof(block_q8_0_view) == 34,
              "ggml's block layouts");

// fp16 -> fp32 is exact, like ggml's table lookup.
__attribute__((target("f16c"))) inline float f16_to_f32(ggml_fp16_t h) { return _cvtsh_ss(h); }

// The activation rows in the form ggml_mul_mat quantizes them to for the weight's type
// (its vec_dot_type, passed as userdata), with ggml's own from_float.
void quantize_rows(ggml_tensor * dst, int ith, int nth, void * type) {
    const ggml_tensor * x = dst->src[0];
    const auto from_float = ggml_get_type_traits_cpu((ggml_type) (intptr_t) type)->from_float;
    for (int64_t r = ith; r < x->ne[1]; r += nth) {
        from_float(reinterpret_cast<const float *>(static_cast<const char *>(x->data) + r * x->nb[1]),
                   static_cast<char *>(dst->data) + r * dst->nb[1], x->ne[0]);
    }
}

// Asks for the weight row PREFETCH_ROWS ahead of `row` while `row` is multiplied, as
// non-temporal: a step's weights (over 100 MB) outgrow every cache and are not read again
// before the next step, so they should not evict what the step and the hop after it reuse
// (the KV cache, the interpreter's and the sockets' data: a hop with two stages 0.13-0.16 ms against
// 0.17-0.20, twenty-fourth session).
__attribute__((target("avx2"))) inline void prefetch_ahead(const void * row, size_t row_bytes) {
    const char * ahead = static_cast<const char *>(row) + PREFETCH_ROWS * row_bytes;
    for (size_t line = 0; line < row_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_NTA);
}

// ggml's hsum_float_8 (arch/x86/quants.c): the same additions in the same order.
__attribute__((target("avx2,fma"))) inline float hsum8(__m256 x) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

// The activation rows prepared once per product for the kernels: per group of COLS rows
// and block the rows' block scales and Q8_1 sums side by side, so that a block's scale
// products and sums take one vector operation instead of one scalar operation per row.
// For the 512-bit kernels (side_by_side), per pair of rows (the last row of an odd count
// paired with itself) and block, the two rows' block scales, each repeated over its 8
// lanes, and their 32 values each (64 bytes); for Q8_0 under VNNI (with_fix) per pair and
// block -128 x each lane's sum of 4 values.
static_assert(COLS == 4, "a group's Q8_1 sums fill one 128-bit register");

struct paired_rows {
    std::vector<float> d;      // side by side: [pair][block][16]
    std::vector<float> dg;     // [group][block][COLS]
    std::vector<float> s;      // Q8_1: [group][block][COLS]
    std::vector<int8_t> qs;    // side by side: [pair][block][64]
    std::vector<int32_t> fix;  // VNNI, Q8_0: [pair][block][16]

    // The repeated block scales from row c0 (even) on, and likewise the Q8_0 starting sums.
    const float * scales_from(int64_t c0, int64_t nb) const { return d.data() + (c0 / 2) * nb * 16; }
    // A group's block scales from row c0 (a multiple of COLS) on, likewise its Q8_1 sums.
    const float * group_scales_from(int64_t c0, int64_t nb) const { return dg.data() + (c0 / COLS) * nb * COLS; }
    const float * group_sums_from(int64_t c0, int64_t nb) const { return s.data() + (c0 / COLS) * nb * COLS; }
    const int32_t * fix_from(int64_t c0, int64_t nb) const { return fix.data() + (c0 / 2) * nb * 16; }
};

template <typename QBlock>
paired_rows pair_rows(const ggml_tensor * q, int64_t n, int64_t nb, bool side_by_side, bool with_fix) {
    constexpr bool q8_1 = std::is_same_v<QBlock, block_q8_1_view>;
    const int64_t pairs = (n + 1) / 2, groups = (n + COLS - 1) / COLS;
    paired_rows p;
    if (side_by_side) p.d.resize((size_t) (pairs * nb * 16));
    p.dg.assign((size_t) (groups * nb * COLS), 0.0f);
    if constexpr (q8_1) p.s.assign((size_t) (groups * nb * COLS), 0.0f);
    with_fix = with_fix && !q8_1;
    if (side_by_side) p.qs.resize((size_t) (pairs * nb * 2 * QK));
    if (with_fix) p.fix.resize((size_t) (pairs * nb * 16));
    for (int64_t c = 0; c < 2 * pairs; c++) {
        const int64_t row = std::min(c, n - 1), pair = c / 2, half = c % 2;
        const auto * y = reinterpret_cast<const QBlock *>(static_cast<const char *>(q->data) + row * q->nb[1]);
        for (int64_t b = 0; b < nb; b++) {
            const size_t at = (size_t) ((pair * nb + b) * 16 + half * 8);
            const size_t in_group = (size_t) (((c / COLS) * nb + b) * COLS + c % COLS);
            if (c < n) p.dg[in_group] = f16_to_f32(y[b].d);
            if constexpr (q8_1) {
                if (c < n) p.s[in_group] = f16_to_f32(y[b].s);
            }
            if (side_by_side) {
                std::fill_n(&p.d[at], 8, f16_to_f32(y[b].d));
                memcpy(&p.qs[at * 4], y[b].qs, QK);
            }
            if (with_fix) {
                for (int lane = 0; lane < 8; lane++) {
                    const int8_t * v = y[b].qs + 4 * lane;
                    p.fix[at + lane] = -128 * (v[0] + v[1] + v[2] + v[3]);
                }
            }
        }
    }
    return p;
}

// A Q4_1 block's scale d and minimum m (lanes 0 and 1) in one conversion of their 4 bytes.
__attribute__((target("avx2,f16c"))) inline __m128 scale_and_min(const block_q4_1_view & x) {
    int32_t dm;
    memcpy(&dm, &x.d, sizeof dm);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
}

// Row c's 8 lanes of block b among the prepared rows from c0 (p.fix).
template <typename T> inline const T * row_lanes(const T * d, int64_t nb, int64_t c, int64_t b) {
    return d + ((c / 2) * nb + b) * 16 + (c % 2) * 8;
}

#define SKIPPY_AVX512_VNNI "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"

namespace avx2 {
#define ROWS_TARGET "avx2,fma,f16c"
#define ROWS_VNNI 0
#include "matmul_rows.h"
#undef ROWS_TARGET
#undef ROWS_VNNI
}  // namespace avx2

namespace vnni {
#define ROWS_TARGET SKIPPY_AVX512_VNNI
#define ROWS_VNNI 1
#include "matmul_rows.h"
#undef ROWS_TARGET
#undef ROWS_VNNI
}  // namespace vnni

// ggml's hsum of each 256-bit half of `acc`: rows 2k and 2k + 1 of a pair.
__attribute__((target("avx512f,avx2,fma"))) inline void store_pair(ggml_tensor * dst, int64_t r, int64_t c, int nc,
                                                                    __m512 acc, const float * extra) {
    const __m256 halves[2] = {_mm512_castps512_ps256(acc),
                              _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1))};
    for (int h = 0; h < 2 && h < nc; h++) {
        float * out = reinterpret_cast<float *>(static_cast<char *>(dst->data) + (c + h) * dst->nb[1]);
        out[r] = extra ? hsum8(halves[h]) + extra[h] : hsum8(halves[h]);  // no + 0.0f: it would turn -0 into +0
    }
}

// q4_1_rows for NC >= 2 rows with the rows in pairs (p: pair_rows<block_q8_1_view>): a
// block's nibbles are unpacked once into both 256-bit halves, and VNNI's dpbusd gives
// the same int32 sums of 4 (nibble x byte) products as maddubs + madd.
template <int NC>
__attribute__((target(SKIPPY_AVX512_VNNI))) void q4_1_rows_paired(ggml_tensor * dst, int64_t r0, int64_t r1,
                                                                  int64_t c0, const paired_rows & p) {
    constexpr int NP = (NC + 1) / 2;
    const ggml_tensor * w = dst->src[0];
    const int64_t nb = w->ne[0] / QK;
    const __m512i low = _mm512_set1_epi8(0xF);
    // the 16 packed bytes in all four 128-bit lanes; lanes 1 and 3 take the high nibbles
    const __m512i shifts = _mm512_set_epi32(0x40004, 0x40004, 0x40004, 0x40004, 0, 0, 0, 0,
                                            0x40004, 0x40004, 0x40004, 0x40004, 0, 0, 0, 0);
    const int8_t * qs = p.qs.data() + (c0 / 2) * nb * 2 * QK;
    const float * yd = p.scales_from(c0, nb);
    const float * ys = p.group_sums_from(c0, nb);
    for (int64_t r = r0; r < r1; r++) {
        const auto * x = reinterpret_cast<const block_q4_1_view *>(static_cast<const char *>(w->data) + r * w->nb[1]);
        __m512 acc[NP];
        for (int k = 0; k < NP; k++) acc[k] = _mm512_setzero_ps();
        __m128 summs = _mm_setzero_ps();
        prefetch_ahead(x, w->nb[1]);
        for (int64_t b = 0; b < nb; b++) {
            const __m512 d0 = _mm512_set1_ps(_cvtsh_ss(x[b].d));
            summs = _mm_fmadd_ps(_mm_set1_ps(_cvtsh_ss(x[b].m)), _mm_loadu_ps(ys + b * COLS), summs);
            const __m512i packed = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i *>(x[b].qs)));
            const __m512i qx = _mm512_and_si512(low, _mm512_srlv_epi16(packed, shifts));
            for (int k = 0; k < NP; k++) {
                const size_t at = (size_t) ((k * nb + b) * 16);
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qx, _mm512_loadu_si512(qs + at * 4));
                acc[k] = _mm512_fmadd_ps(_mm512_mul_ps(d0, _mm512_loadu_ps(yd + at)), _mm512_cvtepi32_ps(dot), acc[k]);
            }
        }
        float sums[4];
        _mm_storeu_ps(sums, summs);
        for (int k = 0; k < NP; k++) store_pair(dst, r, c0 + 2 * k, NC - 2 * k, acc[k], sums + 2 * k);
    }
}

// q8_0_rows for NC >= 2 rows in pairs (p: pair_rows<block_q8_0_view>): dpbusd multiplies
// unsigned bytes, so the weights are offset by 128 (x ^ 0x80) and each lane's sum starts
// at -128 x the sum of its 4 activation values: the same int32 as maddubs(|x|, sign(y, x)) + madd.
template <int NC>
__attribute__((target(SKIPPY_AVX512_VNNI))) void q8_0_rows_paired(ggml_tensor * dst, int64_t r0, int64_t r1,
                                                                  int64_t c0, const paired_rows & p) {
    constexpr int NP = (NC + 1) / 2;
    const ggml_tensor * w = dst->src[0];
    const int64_t nb = w->ne[0] / QK;
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
    const int8_t * qs = p.qs.data() + (c0 / 2) * nb * 2 * QK;
    const float * yd = p.scales_from(c0, nb);
    const int32_t * fix = p.fix_from(c0, nb);
    for (int64_t r = r0; r < r1; r++) {
        const auto * x = reinterpret_cast<const block_q8_0_view *>(static_cast<const char *>(w->data) + r * w->nb[1]);
        prefetch_ahead(x, w->nb[1]);
        __m512 acc[NP];
        for (int k = 0; k < NP; k++) acc[k] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const __m512 d0 = _mm512_set1_ps(_cvtsh_ss(x[b].d));
            const __m512i ux = _mm512_xor_si512(
                offset, _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i *>(x[b].qs))));
            for (int k = 0; k < NP; k++) {
                const size_t at = (size_t) ((k * nb + b) * 16);
                const __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(fix + at), ux, _mm512_loadu_si512(qs + at * 4));
                acc[k] = _mm512_fmadd_ps(_mm512_mul_ps(d0, _mm512_loadu_ps(yd + at)), _mm512_cvtepi32_ps(dot), acc[k]);
            }
        }
        for (int k = 0; k < NP; k++) store_pair(dst, r, c0 + 2 * k, NC - 2 * k, acc[k], nullptr);
    }
}

// The VNNI kernels run where the CPU (not only the compiler) has AVX-512 VNNI.
bool vnni_usable() {
    static const bool usable = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    return usable;
}

// The kernels a product runs (its graph node's userdata), chosen when the graph is built.
enum class Kernels : intptr_t {
    AVX2,        // a row per 256-bit register, maddubs + madd
    VNNI_ROWS,   // a row per 256-bit register, dpbusd
    VNNI_PAIRS,  // groups of two rows or more: two rows per 512-bit register, dpbusd
};

// SKIPPY_WIRE_MATMUL: "ggml" sends every product through ggml_mul_mat (the reference
// `skippy-wire bench-backend --matmul` measures against); "avx2", "vnni-rows" and
// "vnni-pairs" force those kernels where the CPU has them (tests, measurements); unset,
// the fastest measured.  Read per graph build.
const char * matmul_choice() {
    const char * choice = getenv("SKIPPY_WIRE_MATMUL");
    return choice ? choice : "";
}

// Two rows per 512-bit register pay where the CPU computes 512 bits at once (the Intel
// Xeon of docs/benchmarks.md's ninth session: a pair of rows 1.2x one row, against 1.4x).
// AMD's Zen 4 issues a 512-bit operation as two 256-bit halves, and there the 256-bit VNNI
// rows are faster (twenty-third session).
bool pairs_pay() {
    static const bool full_width = !__builtin_cpu_is("amd");
    return full_width;
}

Kernels kernels_for(int64_t n) {
    const std::string choice = matmul_choice();
    if (!vnni_usable() || choice == "avx2") return Kernels::AVX2;
    if (choice == "vnni-rows") return Kernels::VNNI_ROWS;
    return n > 1 && (choice == "vnni-pairs" || pairs_pay()) ? Kernels::VNNI_PAIRS : Kernels::VNNI_ROWS;
}

// rows(std::integral_constant<int, NC>, c0) for the activation rows in groups of COLS, then the rest.
template <typename Rows> void by_groups(int64_t n, Rows rows) {
    int64_t c0 = 0;
    for (; c0 + COLS <= n; c0 += COLS) rows(std::integral_constant<int, COLS>{}, c0);
    switch (n - c0) {
        case 3: rows(std::integral_constant<int, 3>{}, c0); break;
        case 2: rows(std::integral_constant<int, 2>{}, c0); break;
        case 1: rows(std::integral_constant<int, 1>{}, c0); break;
        default: break;
    }
}

// Thread ith's weight rows (of nth) times the activation rows, prepared once (pair_rows),
// in groups (by_groups): `rows(nc, r0, r1, c0, prepared, kernels)` runs one group.
template <typename QBlock, typename Rows> void product_by_groups(ggml_tensor * dst, int ith, int nth, void * userdata,
                                                                 Rows rows) {
    const auto kernels = static_cast<Kernels>(reinterpret_cast<intptr_t>(userdata));
    const int64_t weight_rows = dst->src[0]->ne[1], n = dst->ne[1];
    const int64_t per = (weight_rows + nth - 1) / nth;
    const int64_t r0 = ith * per, r1 = std::min(weight_rows, r0 + per);
    if (r0 >= r1) return;
    const paired_rows y = pair_rows<QBlock>(dst->src[1], n, dst->src[0]->ne[0] / QK, kernels == Kernels::VNNI_PAIRS,
                                            kernels != Kernels::AVX2);
    by_groups(n, [&](auto nc, int64_t c0) { rows(nc, r0, r1, c0, y, kernels); });
}

// dst [rows, n] = w [k, rows] (Q4_1) x q [k, n] (Q8_1 rows); weight rows split over threads.
void q4_1_product(ggml_tensor * dst, int ith, int nth, void * kernels) {
    product_by_groups<block_q8_1_view>(dst, ith, nth, kernels, [dst](auto nc, int64_t r0, int64_t r1, int64_t c0,
                                                                     const paired_rows & y, Kernels k) {
        constexpr int NC = decltype(nc)::value;
        if constexpr (NC > 1) {
            if (k == Kernels::VNNI_PAIRS) return q4_1_rows_paired<NC>(dst, r0, r1, c0, y);
        }
        if (k == Kernels::AVX2) return avx2::q4_1_rows<NC>(dst, r0, r1, c0, y);
        vnni::q4_1_rows<NC>(dst, r0, r1, c0, y);
    });
}

// dst [rows, n] = w [k, rows] (Q8_0) x q [k, n] (Q8_0 rows); weight rows split over threads.
void q8_0_product(ggml_tensor * dst, int ith, int nth, void * kernels) {
    product_by_groups<block_q8_0_view>(dst, ith, nth, kernels, [dst](auto nc, int64_t r0, int64_t r1, int64_t c0,
                                                                     const paired_rows & y, Kernels k) {
        constexpr int NC = decltype(nc)::value;
        if constexpr (NC > 1) {
            if (k == Kernels::VNNI_PAIRS) return q8_0_rows_paired<NC>(dst, r0, r1, c0, y);
        }
        if (k == Kernels::AVX2) return avx2::q8_0_rows<NC>(dst, r0, r1, c0, y);
        vnni::q8_0_rows<NC>(dst, r0, r1, c0, y);
    });
}

// ggml's own arithmetic is the AVX2 one only where ggml-cpu was built with AVX2 and FMA.
bool kernel_usable() {
    static const bool usable = ggml_cpu_has_avx2() && ggml_cpu_has_fma() && __builtin_cpu_supports("avx2") &&
                               __builtin_cpu_supports("fma");
    return usable;
}

bool kernel_wanted() { return strcmp(matmul_choice(), "ggml") != 0; }

bool kernel_applies(const ggml_tensor * w, const ggml_tensor * x) {
    return (w->type == GGML_TYPE_Q4_1 || w->type == GGML_TYPE_Q8_0) && x->type == GGML_TYPE_F32 && x->ne[2] == 1 &&
           x->ne[3] == 1 && ggml_is_contiguous(x) && w->ne[0] % QK == 0 && kernel_usable();
}

// Two graph nodes: the rows quantized as ggml would, then the product.
ggml_tensor * kernel_product(ggml_context * ctx, ggml_tensor * w, ggml_tensor * x) {
    const bool q4_1 = w->type == GGML_TYPE_Q4_1;
    const ggml_type rows_type = ggml_get_type_traits_cpu(w->type)->vec_dot_type;  // Q8_1 / Q8_0
    const int64_t row_bytes = (int64_t) ggml_row_size(rows_type, w->ne[0]);
    ggml_tensor * q = ggml_custom_4d(ctx, GGML_TYPE_I8, row_bytes, x->ne[1], 1, 1, &x, 1, quantize_rows,
                                     GGML_N_TASKS_MAX, (void *) (intptr_t) rows_type);
    ggml_tensor * args[2] = {w, q};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], x->ne[1], 1, 1, args, 2, q4_1 ? q4_1_product : q8_0_product,
                          GGML_N_TASKS_MAX, reinterpret_cast<void *>(static_cast<intptr_t>(kernels_for(x->ne[1]))));
}

}  // namespace

ggml_tensor * weight_product(ggml_context * ctx, ggml_tensor * w, ggml_tensor * x) {
    return kernel_wanted() && kernel_applies(w, x) ? kernel_product(ctx, w, x) : ggml_mul_mat(ctx, w, x);
}

}  // namespace skippy_stage

// For the tests: multiplies a random matrix of ggml type `type` [k, rows] by n random rows
// with ggml_mul_mat and with the kernel in one graph; the number of output elements whose
// bits differ, or -1 where the kernel does not take this product on this machine
// (weight_product then uses ggml_mul_mat), -4 for a k that is no whole number of blocks.
extern "C" int64_t skippy_weight_product_check(int type, int64_t k, int64_t rows, int64_t n, uint32_t seed,
                                               int n_threads) {
    using namespace skippy_stage;
    if (k % QK != 0 || k <= 0 || rows <= 0 || n <= 0) return -4;
    ggml_init_params p = {/*.mem_size =*/(size_t) (k * rows * 8 + k * n * 16 + rows * n * 16) + (16u << 20),
                          /*.mem_buffer =*/nullptr, /*.no_alloc =*/false};
    ggml_context * ctx = ggml_init(p);
    if (!ctx) return -2;
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> wf((size_t) (k * rows));
    for (float & v : wf) v = normal(rng) * 0.05f + 0.01f;
    ggml_tensor * w = ggml_new_tensor_2d(ctx, (ggml_type) type, k, rows);
    ggml_quantize_chunk((ggml_type) type, wf.data(), w->data, 0, rows, k, nullptr);
    ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n);
    for (int64_t i = 0; i < k * n; i++) static_cast<float *>(x->data)[i] = normal(rng);
    int64_t differ = -1;
    if (kernel_applies(w, x)) {
        ggml_tensor * ours = kernel_product(ctx, w, x);
        ggml_tensor * ref = ggml_mul_mat(ctx, w, x);
        ggml_cgraph * gf = ggml_new_graph(ctx);
        ggml_build_forward_expand(gf, ours);
        ggml_build_forward_expand(gf, ref);
        differ = -3;
        if (ggml_graph_compute_with_ctx(ctx, gf, n_threads) == GGML_STATUS_SUCCESS) {
            differ = 0;
            for (int64_t i = 0; i < rows * n; i++) {
                differ += memcmp(static_cast<float *>(ours->data) + i, static_cast<float *>(ref->data) + i, 4) != 0;
            }
        }
    }
    ggml_free(ctx);
    return differ;
}
