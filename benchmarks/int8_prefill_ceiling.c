/* What int8 activations could give a prefill on an AVX2 CPU (benchmarks/int8_prefill_ceiling.py runs it).
 *
 * The engine's fp32 prefill multiplies by its Q4_1 weights dequantized to fp32 (MKL, near the FMA peak). llama.cpp
 * instead quantizes a prompt's activations to int8 in blocks of 32 and multiplies integers with vpmaddubsw, which
 * does 32 multiply-adds where an fma does 8. This is a measuring kernel, not the engine's: it shows how far that
 * road goes here before anyone builds it into the engine (which would make the prefill inexact).
 *
 * fma_peak / maddubs_peak: n iterations of 10 independent fmas / 8 independent (vpmaddubsw, vpaddw) pairs, in
 * registers: the instruction mix's ceiling on this core.
 *
 * quantize_rows_q8: x (rows, K) fp32 -> q int8 (rows, K), per block of 32 along K: d = max|x| / 127,
 * q = round(x / d) (0 where d is 0), s = d * sum(q) (llama.cpp's Q8_1, computed here in fp32).
 *
 * gemm_q4_q8: y (rows, 16 * tiles) = dequantized x times the Q4_1 weights, w = q * scale + min per block of 32:
 *   y[r][n] = sum_b (d[r][b] * scale[n][b]) * (sum_k qx * qw) + s[r][b] * min[n][b].
 * Weights in tiles of 16 outputs; per tile and block 640 bytes: 16 vectors of 32 levels (0..15), vector 2j + g
 * holding k = 4j .. 4j + 3 of outputs 8g .. 8g + 7 (byte 4c + i: output 8g + c, k = 4j + i), then the 16 fp32
 * scales, then the 16 mins. One vpmaddubsw multiplies a vector by 4 activations broadcast: 16 int16 sums of two
 * products (each at most 15 * 127 * 2); the 8 steps of a block add up to at most 30480, inside int16.
 */
#include <stdint.h>

#if !(defined(__AVX2__) && defined(__FMA__))
#error "the int8 prefill measure needs AVX2 and FMA"
#endif

#include <immintrin.h>

#define GROUP 32
#define TILE 16
#define TILE_BLOCK_BYTES 640
#define ROWS 4 /* rows a pass: 8 int16 and 8 fp32 accumulators */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

double fma_peak(int64_t n) {
    __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-9f);
    __m256 f0 = _mm256_setzero_ps(), f1 = f0, f2 = f0, f3 = f0, f4 = f0, f5 = f0, f6 = f0, f7 = f0, f8 = f0, f9 = f0;
    for (int64_t i = 0; i < n; i++)
        __asm__ volatile("vfmadd231ps %[a], %[b], %[f0]\n vfmadd231ps %[a], %[b], %[f1]\n"
                         "vfmadd231ps %[a], %[b], %[f2]\n vfmadd231ps %[a], %[b], %[f3]\n"
                         "vfmadd231ps %[a], %[b], %[f4]\n vfmadd231ps %[a], %[b], %[f5]\n"
                         "vfmadd231ps %[a], %[b], %[f6]\n vfmadd231ps %[a], %[b], %[f7]\n"
                         "vfmadd231ps %[a], %[b], %[f8]\n vfmadd231ps %[a], %[b], %[f9]\n"
                         : [f0] "+x"(f0), [f1] "+x"(f1), [f2] "+x"(f2), [f3] "+x"(f3), [f4] "+x"(f4),
                           [f5] "+x"(f5), [f6] "+x"(f6), [f7] "+x"(f7), [f8] "+x"(f8), [f9] "+x"(f9)
                         : [a] "x"(a), [b] "x"(b));
    __m256 t = _mm256_add_ps(_mm256_add_ps(f0, f9), _mm256_add_ps(f4, f5));
    return _mm256_cvtss_f32(t);
}

double maddubs_peak(int64_t n) {
    __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(1), t;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t i = 0; i < n; i++)
        __asm__ volatile("vpmaddubsw %[w], %[x], %[t]\n vpaddw %[t], %[a0], %[a0]\n"
                         "vpmaddubsw %[w], %[x], %[t]\n vpaddw %[t], %[a1], %[a1]\n"
                         "vpmaddubsw %[w], %[x], %[t]\n vpaddw %[t], %[a2], %[a2]\n"
                         "vpmaddubsw %[w], %[x], %[t]\n vpaddw %[t], %[a3], %[a3]\n"
                         "vpmaddubsw %[w], %[x], %[t]\n vpaddw %[t], %[a4], %[a4]\n"
                         "vpmaddubsw %[w], %[x], %[t]\n vpaddw %[t], %[a5], %[a5]\n"
                         "vpmaddubsw %[w], %[x], %[t]\n vpaddw %[t], %[a6], %[a6]\n"
                         "vpmaddubsw %[w], %[x], %[t]\n vpaddw %[t], %[a7], %[a7]\n"
                         : [a0] "+x"(a0), [a1] "+x"(a1), [a2] "+x"(a2), [a3] "+x"(a3), [a4] "+x"(a4),
                           [a5] "+x"(a5), [a6] "+x"(a6), [a7] "+x"(a7), [t] "=&x"(t)
                         : [w] "x"(w), [x] "x"(x));
    return _mm256_extract_epi16(_mm256_add_epi16(a0, a7), 0);
}

int quantize_rows_q8(const float *x, int64_t rows, int64_t K, int8_t *q, float *d, float *s) {
    if (K % GROUP) return -1;
    const int64_t blocks = K / GROUP;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + r * K + b * GROUP;
            __m256 v[4], m = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xb + 8 * i);
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[i]));
            }
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            h = _mm_max_ss(h, _mm_movehdup_ps(h));
            const float scale = _mm_cvtss_f32(h) / 127.0f;
            __m256i qi[4];
            for (int i = 0; i < 4; i++)  /* rounds half to even, as torch.round */
                qi[i] = scale > 0 ? _mm256_cvtps_epi32(_mm256_div_ps(v[i], _mm256_set1_ps(scale))) : _mm256_setzero_si256();
            __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
            __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
            s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
            /* the packs interleave 128-bit lanes: 4-byte groups come out as 0 2 4 6 1 3 5 7 */
            __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
            p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i *)(q + r * K + b * GROUP), p);
            d[r * blocks + b] = scale;
            s[r * blocks + b] = scale * (float)_mm_cvtsi128_si32(s4);
        }
    return 0;
}

ALWAYS_INLINE void tile_rows(const int8_t *q, const float *d, const float *s, int64_t K, const uint8_t *w, float *y,
                             int64_t y_stride, const int R) {
    const int64_t blocks = K / GROUP;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[ROWS][2];
    for (int r = 0; r < R; r++)
        for (int g = 0; g < 2; g++) acc[r][g] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *wb = w + b * TILE_BLOCK_BYTES;
        __m256i part[ROWS][2];
        for (int r = 0; r < R; r++)
            for (int g = 0; g < 2; g++) part[r][g] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(wb + 64 * j));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(wb + 64 * j + 32));
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256i a = _mm256_set1_epi32(*(const int32_t *)(q + r * K + b * GROUP + 4 * j));
                part[r][0] = _mm256_add_epi16(part[r][0], _mm256_maddubs_epi16(w0, a));
                part[r][1] = _mm256_add_epi16(part[r][1], _mm256_maddubs_epi16(w1, a));
            }
        }
        const float *scales = (const float *)(wb + 512), *mins = scales + TILE;
#pragma GCC unroll 2
        for (int g = 0; g < 2; g++) {
            const __m256 scale = _mm256_loadu_ps(scales + 8 * g), min = _mm256_loadu_ps(mins + 8 * g);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(part[r][g], ones));
                acc[r][g] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_broadcast_ss(d + r * blocks + b)), acc[r][g]);
                acc[r][g] = _mm256_fmadd_ps(min, _mm256_broadcast_ss(s + r * blocks + b), acc[r][g]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int g = 0; g < 2; g++) _mm256_storeu_ps(y + r * y_stride + 8 * g, acc[r][g]);
}

int gemm_q4_q8(const int8_t *q, const float *d, const float *s, int64_t rows, const uint8_t *w, int64_t tiles,
               int64_t K, float *y) {
    if (K % GROUP) return -1;
    const int64_t blocks = K / GROUP, chunk = 64; /* a chunk's activations stay in L2 while the tiles pass */
    for (int64_t first = 0; first < rows; first += chunk) {
        const int64_t last = first + chunk < rows ? first + chunk : rows;
        for (int64_t t = 0; t < tiles; t++)
            for (int64_t r = first; r < last; r += ROWS) {
                const int8_t *qr = q + r * K;
                const float *dr = d + r * blocks, *sr = s + r * blocks;
                const uint8_t *wt = w + t * blocks * TILE_BLOCK_BYTES;
                float *yr = y + r * tiles * TILE + t * TILE;
                switch (last - r < ROWS ? last - r : ROWS) {
                case 1: tile_rows(qr, dr, sr, K, wt, yr, tiles * TILE, 1); break;
                case 2: tile_rows(qr, dr, sr, K, wt, yr, tiles * TILE, 2); break;
                case 3: tile_rows(qr, dr, sr, K, wt, yr, tiles * TILE, 3); break;
                default: tile_rows(qr, dr, sr, K, wt, yr, tiles * TILE, 4); break;
                }
            }
    }
    return 0;
}
