/* Linear layers computed on a GGUF file's own quantized blocks (kernels/gguf_blocks.py has the formats, the torch
 * reference and the Python side). The weights are read where they lie, in the memory-mapped file.
 *
 * The block formats, a row of the matrix being its blocks one after another along the input (k); 32 weights each:
 *   Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles;                  w = d * (u - 8),  u in 0..15
 *   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles;          w = d * u + m,    u in 0..15
 *   Q5_0 (22 bytes): fp16 d, 32 high bits, 16 bytes of nibbles;    w = d * (u - 16), u in 0..31
 *   Q5_1 (24 bytes): fp16 d, fp16 m, 32 high bits, 16 nibbles;     w = d * u + m,    u in 0..31
 *   Q8_0 (34 bytes): fp16 d, 32 int8;                              w = d * q
 * Byte j of the nibbles holds weight j in its low half and weight j + 16 in its high half; bit j of the high bits
 * (a little-endian 32-bit word) is bit 4 of weight j. And the K-quants, 256 weights (8 sub-blocks of 32) each:
 *   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles; sub-block j:
 *     w = d * sc_j * u - dmin * m_j, u in 0..15 (sub-blocks 2i and 2i + 1: the low and high halves of bytes
 *     32i .. 32i + 31); sc_j, m_j: j < 4: bytes j and j + 4, low 6 bits; j >= 4: the halves of byte j + 4 with
 *     the top 2 bits of bytes j - 4 and j.
 *   Q6_K (210 bytes): 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (one per 16 weights), fp16 d;
 *     w = d * sc * (q - 32), q in 0..63: each half of 128 weights reads 64 low bytes and 32 high bytes, its
 *     weights 32i + l (i = 0..3) the low (i even) or high (i odd) half of low byte l + 32 (i & 1) and bits 2i,
 *     2i + 1 of high byte l, with scale 2i + l / 16 of the half's 8.
 *
 * gguf_quantize_rows: activations as llama.cpp's engines take them, a block of 32 at a time: d = max |x| / 127,
 *   q = x / d rounded to the nearest integer (ties to even), and s = d * sum(q) (what a block's offset multiplies).
 * gguf_linear: y[r][n] = sum over blocks b of d_w * d_x * sum(u * q_x) + o_w * s_x for rows r < rows and outputs n
 *   in [n_begin, n_end) (a thread's share), where o_w is the block's offset (-8 d, -16 d, m, or 0), the output
 *   rows being those of one or more matrices of the same type one after another (a fused layer). The integer
 *   sums are exact (AVX-512 VNNI where the CPU has it, else AVX2's pairwise multiply-add); up to 4 rows share each
 *   weight block as it is read.
 * gguf_dequantize: rows [row_begin, row_end) of a matrix to fp32 (prefill multiplies them in torch; an embedding
 *   takes its tokens' rows), each weight d * u + o rounded once (fma).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "the GGUF block kernels need AVX2, FMA and F16C; the engine dequantizes the weights instead"
#endif

#include <immintrin.h>

enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q6_K = 14 }; /* ggml's type numbers */
#define BLOCK 32
#define MAX_ROWS 4
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Bytes per block and weights per block of a type (0 where the kernels do not take it). */
static int block_bytes(int type) {
    switch (type) {
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q5_0: return 22;
        case Q5_1: return 24;
        case Q8_0: return 34;
        case Q4_K: return 144;
        case Q6_K: return 210;
        default: return 0;
    }
}

static int block_weights(int type) { return type == Q4_K || type == Q6_K ? 256 : BLOCK; }

static int64_t row_size(int type, int64_t K) { return K / block_weights(type) * block_bytes(type); }

ALWAYS_INLINE float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* 16 bytes of nibbles -> 32 bytes: weight j in byte j. */
ALWAYS_INLINE __m256i nibbles(const uint8_t *qs) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
}

/* 32 bits -> 32 bytes, 16 where the bit is set, 0 where not. */
ALWAYS_INLINE __m256i fifth_bits(const uint8_t *qh) {
    uint32_t bits;
    memcpy(&bits, qh, 4);
    const __m256i which_byte = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i which_bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i spread = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), which_byte), which_bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(spread, which_bit), _mm256_set1_epi8(16));
}

/* Weights come out as 32 bytes of levels (unsigned, or signed for Q8_0 and Q6_K: `is_signed`), the scales of the
 * two halves of 16 (equal but for Q6_K) and an offset: w = scale * level + offset. */
static inline int is_signed(int type) { return type == Q8_0 || type == Q6_K; }
static inline int is_k_quant(int type) { return type == Q4_K || type == Q6_K; }

/* A K-quant super-block's 8 sub-blocks of 32: the scales of their halves of 16 and their offsets, decoded once. */
typedef struct {
    float scale0[8], scale1[8], offset[8];
} SubScales;

ALWAYS_INLINE void k_scales(int type, const uint8_t *block, SubScales *out) {
    if (type == Q4_K) {
        const uint8_t *packed = block + 4;
        const float d = half(block), dmin = half(block + 2);
        for (int j = 0; j < 8; j++) {
            const int sc = j < 4 ? packed[j] & 63 : (packed[j + 4] & 0x0f) | ((packed[j - 4] >> 6) << 4);
            const int m = j < 4 ? packed[j + 4] & 63 : (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4);
            out->scale0[j] = out->scale1[j] = d * (float)sc;
            out->offset[j] = -dmin * (float)m;
        }
    } else { /* Q6_K */
        const int8_t *scales = (const int8_t *)(block + 192);
        const float d = half(block + 208);
        for (int j = 0; j < 8; j++) {
            out->scale0[j] = d * scales[8 * (j / 4) + 2 * (j % 4)];
            out->scale1[j] = d * scales[8 * (j / 4) + 2 * (j % 4) + 1];
            out->offset[j] = 0.0f;
        }
    }
}

/* Sub-block j's 32 levels of a K-quant super-block. */
ALWAYS_INLINE __m256i k_levels(int type, const uint8_t *block, int j) {
    if (type == Q4_K) {
        const __m256i bytes = _mm256_loadu_si256((const __m256i *)(block + 16 + (j / 2) * 32));
        return _mm256_and_si256(j & 1 ? _mm256_srli_epi16(bytes, 4) : bytes, _mm256_set1_epi8(0x0f));
    }
    const int half_index = j / 4, i = j % 4;
    const __m256i lows = _mm256_loadu_si256((const __m256i *)(block + 64 * half_index + 32 * (i & 1)));
    const __m256i highs = _mm256_loadu_si256((const __m256i *)(block + 128 + 32 * half_index));
    const __m256i l4 = _mm256_and_si256(i >= 2 ? _mm256_srli_epi16(lows, 4) : lows, _mm256_set1_epi8(0x0f));
    const __m256i h2 = _mm256_and_si256(_mm256_srli_epi16(highs, 2 * i), _mm256_set1_epi8(0x03));
    return _mm256_sub_epi8(_mm256_or_si256(l4, _mm256_slli_epi16(h2, 4)), _mm256_set1_epi8(32));
}

/* The b-th block of 32 of a row in a 32-weight format: its levels, its scale (for both halves) and offset. */
ALWAYS_INLINE __m256i levels(int type, const uint8_t *row, int64_t b, float *scale0, float *scale1, float *offset) {
    const uint8_t *block = row + b * block_bytes(type);
    const float d = half(block);
    *scale0 = *scale1 = d;
    switch (type) {
        case Q4_0: *offset = -8.0f * d; return nibbles(block + 2);
        case Q4_1: *offset = half(block + 2); return nibbles(block + 4);
        case Q5_0: *offset = -16.0f * d; return _mm256_or_si256(nibbles(block + 6), fifth_bits(block + 2));
        case Q5_1: *offset = half(block + 2); return _mm256_or_si256(nibbles(block + 8), fifth_bits(block + 4));
        default: *offset = 0.0f; return _mm256_loadu_si256((const __m256i *)(block + 2));
    }
}

/* sum over the 32 lanes of u * q in 8 int32 lanes: u unsigned (0..31 here; up to 128 for |Q8_0|), q signed. */
ALWAYS_INLINE __m256i dot_unsigned_signed(__m256i u, __m256i q) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, q);
#else
    /* pairs of products fit int16: 2 * 128 * 127 < 32768 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1));
#endif
}

ALWAYS_INLINE float sum_lanes(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

int gguf_quantize_rows(const float *x, int64_t rows, int64_t x_stride, int64_t K, int8_t *q, float *d, float *s) {
    if (K % BLOCK) return 1;
    const int64_t blocks = K / BLOCK;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t b = 0; b < blocks; b++) {
            const float *xb = x + r * x_stride + b * BLOCK;
            int8_t *qb = q + (r * blocks + b) * BLOCK;
            float amax = 0.0f;
            for (int i = 0; i < BLOCK; i++) {
                const float a = xb[i] < 0 ? -xb[i] : xb[i];
                amax = a > amax ? a : amax;
            }
            const float scale = amax / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
            int sum = 0;
            for (int i = 0; i < BLOCK; i += 8) {
                const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xb + i), _mm256_set1_ps(inverse));
                const __m256i n = _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                int32_t lanes[8];
                _mm256_storeu_si256((__m256i *)lanes, n);
                for (int j = 0; j < 8; j++) {
                    qb[i + j] = (int8_t)lanes[j];
                    sum += lanes[j];
                }
            }
            d[r * blocks + b] = scale;
            s[r * blocks + b] = scale * (float)sum;
        }
    }
    return 0;
}

ALWAYS_INLINE void block_step(int type, __m256i u, float scale0, float scale1, float ow, const int8_t *q,
                             const float *d, const float *s, int64_t blocks, int64_t b, __m256 *acc, float *offsets,
                             const int R) {
    const __m256i sign = u;
    if (is_signed(type)) u = _mm256_sign_epi8(u, u); /* |w|, and q takes w's sign below */
    /* the dot's lane i sums bytes 4i .. 4i + 3: lanes 0-3 are the first half of 16, 4-7 the second */
    const __m256 scales = _mm256_setr_m128(_mm_set1_ps(scale0), _mm_set1_ps(scale1));
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        __m256i qx = _mm256_loadu_si256((const __m256i *)(q + (r * blocks + b) * BLOCK));
        if (is_signed(type)) qx = _mm256_sign_epi8(qx, sign);
        const __m256 sums = _mm256_cvtepi32_ps(dot_unsigned_signed(u, qx));
        acc[r] = _mm256_fmadd_ps(sums, _mm256_mul_ps(scales, _mm256_set1_ps(d[r * blocks + b])), acc[r]);
        offsets[r] += ow * s[r * blocks + b];
    }
}

ALWAYS_INLINE void plain_step(int type, const uint8_t *row, const int8_t *q, const float *d, const float *s,
                              int64_t blocks, int64_t b, __m256 *acc, float *offsets, const int R) {
    float scale0, scale1, ow;
    const __m256i u = levels(type, row, b, &scale0, &scale1, &ow);
    block_step(type, u, scale0, scale1, ow, q, d, s, blocks, b, acc, offsets, R);
}

ALWAYS_INLINE void linear_rows(int type, const int8_t *q, const float *d, const float *s, int64_t K,
                               const uint8_t *w, int64_t row_bytes, int64_t n_begin, int64_t n_end, float *y,
                               int64_t y_stride, const int R) {
    const int64_t blocks = K / BLOCK;
    for (int64_t n = n_begin; n < n_end; n++) {
        const uint8_t *row = w + n * row_bytes;
        __m256 acc[MAX_ROWS], second[MAX_ROWS]; /* two chains per row (even and odd blocks) */
        float offsets[MAX_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            acc[r] = second[r] = _mm256_setzero_ps();
            offsets[r] = 0.0f;
        }
        if (is_k_quant(type)) {
            for (int64_t k = 0; k < blocks / 8; k++) {
                const uint8_t *block = row + k * block_bytes(type);
                SubScales sub;
                k_scales(type, block, &sub);
#pragma GCC unroll 8
                for (int j = 0; j < 8; j++)
                    block_step(type, k_levels(type, block, j), sub.scale0[j], sub.scale1[j], sub.offset[j], q, d, s,
                               blocks, 8 * k + j, j & 1 ? second : acc, offsets, R);
            }
        } else {
            int64_t b = 0;
            for (; b + 2 <= blocks; b += 2) {
                plain_step(type, row, q, d, s, blocks, b, acc, offsets, R);
                plain_step(type, row, q, d, s, blocks, b + 1, second, offsets, R);
            }
            if (b < blocks) plain_step(type, row, q, d, s, blocks, b, acc, offsets, R);
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[r] = _mm256_add_ps(acc[r], second[r]);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) y[r * y_stride + n] = sum_lanes(acc[r]) + offsets[r];
    }
}

int gguf_linear(int type, const int8_t *q, const float *d, const float *s, int64_t rows, int64_t K,
                const uint8_t *const *parts, const int64_t *part_rows, int64_t n_parts, int64_t n_begin,
                int64_t n_end, float *y, int64_t y_stride) {
    if (!block_bytes(type) || K % block_weights(type)) return 1;
    const int64_t row_bytes = row_size(type, K);
    int64_t first = 0; /* the output index of the part's first row */
    for (int64_t p = 0; p < n_parts; first += part_rows[p], p++) {
        const int64_t begin = n_begin > first ? n_begin : first;
        const int64_t end = n_end < first + part_rows[p] ? n_end : first + part_rows[p];
        if (begin >= end) continue;
        const uint8_t *w = parts[p] - first * row_bytes; /* row n of the whole output at w + n * row_bytes */
        for (int64_t r = 0; r < rows; r += MAX_ROWS) {
            const int64_t at = r * (K / BLOCK), left = rows - r;
#define CASE(T, R) linear_rows(T, q + at * BLOCK, d + at, s + at, K, w, row_bytes, begin, end, y + r * y_stride, y_stride, R)
#define ROWS(T) do { if (left >= 4) CASE(T, 4); else if (left == 3) CASE(T, 3); else if (left == 2) CASE(T, 2); else CASE(T, 1); } while (0)
            switch (type) { /* the type a constant in each copy: the block's decoding folds into straight code */
                case Q4_0: ROWS(Q4_0); break;
                case Q4_1: ROWS(Q4_1); break;
                case Q5_0: ROWS(Q5_0); break;
                case Q5_1: ROWS(Q5_1); break;
                case Q4_K: ROWS(Q4_K); break;
                case Q6_K: ROWS(Q6_K); break;
                default: ROWS(Q8_0); break;
            }
#undef ROWS
#undef CASE
        }
    }
    return 0;
}

int gguf_dequantize(int type, const uint8_t *w, int64_t row_bytes, int64_t row_begin, int64_t row_end, int64_t K,
                    float *out, int64_t out_stride) {
    if (!block_bytes(type) || K % block_weights(type) || row_bytes != row_size(type, K)) return 1;
    const int64_t blocks = K / BLOCK;
    for (int64_t n = row_begin; n < row_end; n++) {
        const uint8_t *row = w + n * row_bytes;
        float *o = out + (n - row_begin) * out_stride;
        SubScales sub;
        for (int64_t b = 0; b < blocks; b++) {
            float scale0, scale1, ow;
            __m256i u;
            if (is_k_quant(type)) {
                const uint8_t *block = row + (b / 8) * block_bytes(type);
                if (b % 8 == 0) k_scales(type, block, &sub);
                u = k_levels(type, block, (int)(b % 8));
                scale0 = sub.scale0[b % 8], scale1 = sub.scale1[b % 8], ow = sub.offset[b % 8];
            } else {
                u = levels(type, row, b, &scale0, &scale1, &ow);
            }
            const __m256 offset = _mm256_set1_ps(ow);
            const __m128i halves[2] = {_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1)};
            for (int h = 0; h < 2; h++) {
                const __m256 scale = _mm256_set1_ps(h ? scale1 : scale0);
                const __m128i bytes16 = halves[h], upper = _mm_srli_si128(bytes16, 8);
                const __m256i lo = is_signed(type) ? _mm256_cvtepi8_epi32(bytes16) : _mm256_cvtepu8_epi32(bytes16);
                const __m256i hi = is_signed(type) ? _mm256_cvtepi8_epi32(upper) : _mm256_cvtepu8_epi32(upper);
                _mm256_storeu_ps(o + b * BLOCK + 16 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), scale, offset));
                _mm256_storeu_ps(o + b * BLOCK + 16 * h + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), scale, offset));
            }
        }
    }
    return 0;
}
