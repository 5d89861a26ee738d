/* Weight-only quantized linear layers with fp32 activations, for decode steps on CPUs without native bf16
 * (kernels/cpu_linear.py has the layouts, the torch reference and the Python side).
 *
 * y[r][n] = sum_k x[r][k] * w[n][k] for r < rows (any number; taken 8 at a time, each weight block read once for
 * those 8) and n in [n_begin, n_end), the output columns of this call (a thread's share).
 *
 * linear_int4: w = q * scale + min, q in 0..15, in groups (blocks) of 32 along k. Output row n is
 *   ceil(K / 64) pairs of blocks of 48 bytes each, one after another: the fp32 scale and min of its first block, of
 *   its second block (zeros past K), then 8 little-endian 32-bit words, word i holding q[8j + i] of the pair's 64 k
 *   in its nibble j (bits 4j .. 4j + 3). A shift and a mask then give the 8 weights k = 8j .. 8j + 7 in 8 lanes,
 *   without shuffles; the scales sit just before their nibbles.
 * linear_int8: w = q * scales[n], q int8, row n at w + n * K.
 * linear_bf16: w bf16 (the upper half of an fp32: widened by a shift, exactly), row n at w + n * w_stride; up to
 *   12 rows a pass (IndexPool's pool scores: 9 query heads against every pooled key, read once for all of them).
 *
 * Summation order, per output (the bounds in tests/test_cpu_linear.py follow from it): each weight is dequantized
 * to fp32 (one fma: q * scale + min, rounded once); products are accumulated by fma into 8-lane partial sums, one
 * chain per lane per accumulator (1 row: 4 accumulators, 2-4 rows: 2, 5-12 rows: 1), which are then added together
 * and across lanes. For int8 the sum of q * x is multiplied by the row's scale at the end; for int8 and bf16, k
 * past the last multiple of 8 is added in scalar code.
 */
#include <stddef.h>
#include <stdint.h>

#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "the quantized linear kernel needs AVX2, FMA and F16C; the engine decodes with fp32 weights instead"
#endif

#include <immintrin.h>

#define GROUP 32
#define MAX_ROWS 8       /* rows a pass for int4 and int8 */
#define MAX_BF16_ROWS 12 /* and for bf16: 12 accumulators and 4 weight vectors fill the 16 registers */
#define PAIR_BYTES 48 /* 4 fp32 (scale, min of two blocks) and 32 bytes of nibbles */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

static inline float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Accumulators per row: enough independent fma chains to cover the fma latency, few enough for 16 registers. */
#define ACCUMULATORS(R) ((R) == 1 ? 4 : (R) <= 4 ? 2 : 1)

ALWAYS_INLINE void int4_rows(const float *x, int64_t x_stride, const uint8_t *w, int64_t n_begin, int64_t n_end,
                             int64_t K, float *y, int64_t y_stride, const int R) {
    const int A = ACCUMULATORS(R);
    const int64_t pairs = (K + 2 * GROUP - 1) / (2 * GROUP), row_bytes = pairs * PAIR_BYTES;
    const __m256i nibble = _mm256_set1_epi32(0x0f);
    for (int64_t n = n_begin; n < n_end; n++) {
        const uint8_t *row = w + n * row_bytes;
        __m256 acc[MAX_ROWS][4];
#pragma GCC unroll 8
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int a = 0; a < A; a++) acc[r][a] = _mm256_setzero_ps();
        for (int64_t p = 0; p < pairs; p++) {
            const uint8_t *pair = row + p * PAIR_BYTES;
            const float *head = (const float *)pair;
            const __m256i words = _mm256_loadu_si256((const __m256i *)(pair + 16));
            const float *xp = x + p * 2 * GROUP;
            const int halves = 2 * GROUP * (p + 1) <= K ? 2 : 1;  /* K % 64 == 32: the last pair has one block */
#pragma GCC unroll 2
            for (int half = 0; half < halves; half++) {
                const __m256 scale = _mm256_broadcast_ss(head + 2 * half), min = _mm256_broadcast_ss(head + 2 * half + 1);
#pragma GCC unroll 4
                for (int s = 0; s < 4; s++) {
                    const int j = 4 * half + s;  /* k = 8j .. 8j + 7 of the pair: nibble j of each word */
                    const __m256i q = _mm256_and_si256(j ? _mm256_srli_epi32(words, 4 * j) : words, nibble);
                    const __m256 wv = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale, min);
#pragma GCC unroll 8
                    for (int r = 0; r < R; r++)
                        acc[r][s % A] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp + r * x_stride + 8 * j), acc[r][s % A]);
                }
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            __m256 total = acc[r][0];
#pragma GCC unroll 4
            for (int a = 1; a < A; a++) total = _mm256_add_ps(total, acc[r][a]);
            y[r * y_stride + n] = sum_lanes(total);
        }
    }
}

enum { INT8_WEIGHTS, BF16_WEIGHTS };

/* 8 weights from k on as fp32. */
ALWAYS_INLINE __m256 load_weights(const void *row, int64_t k, const int kind) {
    if (kind == INT8_WEIGHTS)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)row + k))));
    const __m128i halves = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

ALWAYS_INLINE float weight_at(const void *row, int64_t k, const int kind) {
    if (kind == INT8_WEIGHTS) return (float)((const int8_t *)row)[k];
    union { uint32_t bits; float value; } wide = {(uint32_t)((const uint16_t *)row)[k] << 16};
    return wide.value;
}

/* int8 (times scales[n]) or bf16 (scales NULL) weights, row n at w + n * w_stride elements. */
ALWAYS_INLINE void plain_rows(const float *x, int64_t x_stride, const void *w, int64_t w_stride, const float *scales,
                              int64_t n_begin, int64_t n_end, int64_t K, float *y, int64_t y_stride, const int R,
                              const int kind) {
    const int A = ACCUMULATORS(R);
    const int64_t row_bytes = w_stride * (kind == INT8_WEIGHTS ? 1 : 2);
    for (int64_t n = n_begin; n < n_end; n++) {
        const void *row = (const char *)w + n * row_bytes;
        __m256 acc[MAX_BF16_ROWS][4];
#pragma GCC unroll 12
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int a = 0; a < A; a++) acc[r][a] = _mm256_setzero_ps();
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) {
            __m256 wv[4];
#pragma GCC unroll 4
            for (int s = 0; s < 4; s++) wv[s] = load_weights(row, k + 8 * s, kind);
#pragma GCC unroll 12
            for (int r = 0; r < R; r++)
#pragma GCC unroll 4
                for (int s = 0; s < 4; s++)
                    acc[r][s % A] = _mm256_fmadd_ps(wv[s], _mm256_loadu_ps(x + r * x_stride + k + 8 * s), acc[r][s % A]);
        }
        for (; k + 8 <= K; k += 8) {
            const __m256 wv = load_weights(row, k, kind);
#pragma GCC unroll 12
            for (int r = 0; r < R; r++) acc[r][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * x_stride + k), acc[r][0]);
        }
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) {
            __m256 total = acc[r][0];
#pragma GCC unroll 4
            for (int a = 1; a < A; a++) total = _mm256_add_ps(total, acc[r][a]);
            float sum = sum_lanes(total);
            for (int64_t j = k; j < K; j++) sum += weight_at(row, j, kind) * x[r * x_stride + j];
            y[r * y_stride + n] = scales ? sum * scales[n] : sum;
        }
    }
}

/* One function per row count and scale size, so that each inner loop is unrolled with its accumulators in
 * registers. */
#define INT4_CASE(R)                                                                                              \
    case R:                                                                                                       \
        int4_rows(x, x_stride, w, n_begin, n_end, K, y, y_stride, R);                                             \
        break;

/* Returns 0, or -1 for arguments it does not take (K not a multiple of 32). w: rows of K / 32 blocks, padded to
 * pairs (above). */
int linear_int4(const float *x, int64_t rows, int64_t x_stride, const uint8_t *w,
                int64_t n_begin, int64_t n_end, int64_t K, float *y, int64_t y_stride) {
    if (K % GROUP || rows < 0) return -1;
    for (int64_t first = 0; first < rows; first += MAX_ROWS) {
        const int64_t R = rows - first < MAX_ROWS ? rows - first : MAX_ROWS;
        switch (R) {
            INT4_CASE(1) INT4_CASE(2) INT4_CASE(3) INT4_CASE(4) INT4_CASE(5) INT4_CASE(6) INT4_CASE(7) INT4_CASE(8)
        }
        x += MAX_ROWS * x_stride;
        y += MAX_ROWS * y_stride;
    }
    return 0;
}

#define INT8_CASE(R)                                                                                              \
    case R:                                                                                                       \
        plain_rows(x, x_stride, w, K, scales, n_begin, n_end, K, y, y_stride, R, INT8_WEIGHTS);                   \
        break;

int linear_int8(const float *x, int64_t rows, int64_t x_stride, const int8_t *w, const float *scales,
                int64_t n_begin, int64_t n_end, int64_t K, float *y, int64_t y_stride) {
    if (rows < 0) return -1;
    for (int64_t first = 0; first < rows; first += MAX_ROWS) {
        const int64_t R = rows - first < MAX_ROWS ? rows - first : MAX_ROWS;
        switch (R) {
            INT8_CASE(1) INT8_CASE(2) INT8_CASE(3) INT8_CASE(4) INT8_CASE(5) INT8_CASE(6) INT8_CASE(7) INT8_CASE(8)
        }
        x += MAX_ROWS * x_stride;
        y += MAX_ROWS * y_stride;
    }
    return 0;
}

#define BF16_CASE(R)                                                                                              \
    case R:                                                                                                       \
        plain_rows(x, x_stride, w, w_stride, NULL, n_begin, n_end, K, y, y_stride, R, BF16_WEIGHTS);              \
        break;

int linear_bf16(const float *x, int64_t rows, int64_t x_stride, const uint16_t *w, int64_t w_stride,
                int64_t n_begin, int64_t n_end, int64_t K, float *y, int64_t y_stride) {
    if (rows < 0 || w_stride < K) return -1;
    for (int64_t first = 0; first < rows; first += MAX_BF16_ROWS) {
        const int64_t R = rows - first < MAX_BF16_ROWS ? rows - first : MAX_BF16_ROWS;
        switch (R) {
            BF16_CASE(1) BF16_CASE(2) BF16_CASE(3) BF16_CASE(4) BF16_CASE(5) BF16_CASE(6) BF16_CASE(7) BF16_CASE(8)
            BF16_CASE(9) BF16_CASE(10) BF16_CASE(11) BF16_CASE(12)
        }
        x += MAX_BF16_ROWS * x_stride;
        y += MAX_BF16_ROWS * y_stride;
    }
    return 0;
}
