/* Attention on the CPU: a decode kernel (`decode_attention`: one query per sequence, a few query rows per KV
   head) and a prefill kernel (`prefill_attention`: a prompt segment's many rows). The decode kernel is built for
   AVX-512 or, on CPUs without it, for AVX2 with FMA (the same structure with 8-lane vectors: see the AVX2 section);
   the prefill kernel runs on bf16 with AVX512-BF16 and on fp32 with AVX2 (prefill_attention_supports says where).

   Built on first use by kernels/cpu_attention.py (cc -O3 -march=native) and called through ctypes; the torch
   reference sits next to it there.

   Decode: every cached key and value is read from memory once per step for all the query rows of its KV head. Two
   passes per head: scores, 16 keys at a time (AVX2: 8; their dot products reduced together, not one horizontal sum per
   key), then softmax weights and the weighted sum of values, a block of keys at a time so that the block stays in
   L1 while each query row uses it.
   - bf16 caches (CPUs with AVX512-BF16): products of bf16 pairs summed in fp32 by vdpbf16ps, q . k exactly as fp32
     arithmetic on the bf16 values would give it; the softmax weights are rounded to bf16 for the sum of values, as
     torch's CPU flash attention does for bf16 inputs.
   - fp32 caches: fp32 FMAs.
   Prefill: see the comments before the two prefill_tile (fp32 in the AVX2 section, bf16 after it). */

#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16        /* fp32 values per vector; also keys per block of scores */
#define MAX_CHUNKS 16   /* head_dim / LANES: head_dim up to 256 */
#elif defined(__AVX2__) && defined(__FMA__)
#define LANES 8         /* fp32 values per vector; also keys per block of scores */
#define MAX_CHUNKS 32   /* head_dim / LANES: head_dim up to 256 */
#else
#error "the decode attention kernel needs AVX-512, or AVX2 with FMA; the engine uses its torch path instead"
#endif
#define VALUE_BLOCK 64  /* keys per block of values (16 KB at head_dim 64, fp32) */
#define MAX_ROWS 16     /* query heads per KV head */
#define MAX_PREFILL_THREADS 64 /* threads a prefill call starts at most (the rest of a larger count: none) */
#define PREFETCH_AHEAD 64 /* rows, into L2: without it a DRAM-resident cache was read 40% slower (docs/benchmarks.md) */

#define INLINE static inline __attribute__((always_inline))

INLINE void prefetch_row(const char *row, int bytes) {
    for (int byte = 0; byte < bytes; byte += 64) _mm_prefetch(row + byte, _MM_HINT_T2);
}

/* The keys and values one KV head attends to. */
typedef struct {
    const void *keys, *values;        /* the head's row 0 */
    int64_t stride;                   /* elements from one row to the next */
    int64_t length;                   /* keys attended */
    const int64_t *index;             /* the rows attended (gathered from a store), or NULL: rows 0 .. length-1 */
    const float *rope_cos, *rope_sin; /* length x dim: key j is rotated at its own angles (rotate), or NULL */
    const float *mask;                /* additive, one per key, or NULL */
} head_keys;

typedef struct {
    float *scores;     /* rows x padded: logits, then softmax weights */
    uint16_t *weights; /* rows x padded: the weights in bf16 (bf16 caches) */
    int64_t padded;    /* length rounded up to LANES */
} scratch;

INLINE const char *row_address(const head_keys *h, const void *base, int64_t j, int element_size) {
    return (const char *)base + (h->index ? h->index[j] : j) * h->stride * element_size;
}

INLINE void prefetch_key(const head_keys *h, const void *base, int64_t j, int bytes, int element_size) {
    if (j < h->length) prefetch_row(row_address(h, base, j, element_size), bytes);
}

#if defined(__AVX512F__)
/* Lane i of the result is the sum of the 16 lanes of v[i]: pairs are interleaved and added, 8 + 4 + 2 + 2 steps. */
INLINE __m512 sum_lanes16(const __m512 v[LANES]) {
    __m512 pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: that lane's sums of v[4i..4i+3] */
        __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    for (int i = 0; i < 2; i++) /* 128-bit lanes 0+1 and 2+3 of quads[2i], then of quads[2i+1] */
        halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                  _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                         _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

/* exp(x) for x <= 0 (scores minus their maximum): x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to
   r^7 (relative error under 2e-7), times 2^n. Below -87 (masked keys: -inf) the weight is exactly 0. */
INLINE __m512 exp_nonpositive(__m512 x) {
    const __m512 floor_x = _mm512_set1_ps(-87.0f);
    __mmask16 live = _mm512_cmp_ps_mask(x, floor_x, _CMP_GE_OQ);
    x = _mm512_max_ps(x, floor_x);
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x); /* ln2 split in two */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723e-6f), r);
    static const float taylor[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    __m512 p = _mm512_set1_ps(taylor[0]);
    for (int i = 1; i < 8; i++) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(taylor[i]));
    return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

/* Stores one block of 16 scores (lanes past `valid` set to -inf, so that they weigh 0). */
INLINE void store_scores(float *scores, __m512 dots, float scale, const float *mask, __mmask16 valid) {
    __m512 s = _mm512_mul_ps(dots, _mm512_set1_ps(scale));
    if (mask) s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(valid, mask));
    _mm512_storeu_ps(scores, _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), s));
}

/* Scores (rows x padded, padded a multiple of LANES) become softmax weights in place; each row's sum goes to total
   and its log-sum-exp to lse (when not NULL), its probabilities (weights / sum, rows x length) to probs (when not
   NULL). A row whose keys are all masked gets weights 0 (so the output 0) and a log-sum-exp of -inf. */
static void softmax_rows(float *scores, int64_t padded, int64_t length, int rows, float *total, float *lse,
                         float *probs) {
    for (int r = 0; r < rows; r++) {
        float *s = scores + r * padded;
        __m512 top = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < padded; j += LANES) top = _mm512_max_ps(top, _mm512_loadu_ps(s + j));
        float top1 = _mm512_reduce_max_ps(top);
        __m512 shift = _mm512_set1_ps(top1 == -INFINITY ? 0.0f : top1);
        for (int64_t j = 0; j < padded; j += LANES) {
            __m512 w = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + j), shift));
            _mm512_storeu_ps(s + j, w);
            sum = _mm512_add_ps(sum, w);
        }
        total[r] = _mm512_reduce_add_ps(sum);
        if (lse) lse[r] = top1 == -INFINITY ? -INFINITY : top1 + logf(total[r]);
        if (probs) {
            float inverse = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
            for (int64_t j = 0; j < length; j++) probs[r * length + j] = s[j] * inverse;
        }
    }
}

INLINE __m512 bf16x16_to_float(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Rotary embedding in the rotate-half layout: x * cos + roll(x, dim / 2) * sin, with sin's first half negated by
   the caller (the layout IndexPool keeps its placed positions' tables in). chunks: dim / LANES, even. */
INLINE void rotate(__m512 *x, int chunks, const float *cos, const float *sin) {
    __m512 rolled[MAX_CHUNKS];
    for (int c = 0; c < chunks; c++) rolled[c] = x[(c + chunks / 2) % chunks];
    for (int c = 0; c < chunks; c++)
        x[c] = _mm512_fmadd_ps(x[c], _mm512_loadu_ps(cos + c * LANES),
                               _mm512_mul_ps(rolled[c], _mm512_loadu_ps(sin + c * LANES)));
}

/* Key j as fp32 vectors, rotated when the head has tables. */
INLINE void load_key_f32(const head_keys *h, int64_t j, int chunks, int bf16, __m512 *x) {
    const char *row = row_address(h, h->keys, j, bf16 ? 2 : 4);
    for (int c = 0; c < chunks; c++)
        x[c] = bf16 ? bf16x16_to_float((const uint16_t *)row + c * LANES) : _mm512_loadu_ps((const float *)row + c * LANES);
    if (h->rope_cos) rotate(x, chunks, h->rope_cos + j * chunks * LANES, h->rope_sin + j * chunks * LANES);
}

/* One KV head of an fp32 cache. q: rows x dim fp32; out: rows x dim fp32; lse: rows, or NULL. */
INLINE void head_f32(const float *q, const head_keys *h, int chunks, int rows, float scale, scratch s, float *out,
                     float *lse, float *probs) {
    __m512 keys[LANES][MAX_CHUNKS], partial[LANES], acc[MAX_CHUNKS], odd[MAX_CHUNKS];
    float total[MAX_ROWS];
    const int64_t length = h->length, padded = s.padded;
    for (int64_t j0 = 0; j0 < length; j0 += LANES) {
        int n = length - j0 < LANES ? (int)(length - j0) : LANES;
        for (int j = 0; j < n; j++) {
            prefetch_key(h, h->keys, j0 + j + PREFETCH_AHEAD, chunks * 64, 4);
            load_key_f32(h, j0 + j, chunks, 0, keys[j]);
        }
        for (int r = 0; r < rows; r++) {
            for (int j = 0; j < LANES; j++) {
                __m512 dot = _mm512_setzero_ps();
                if (j < n)
                    for (int c = 0; c < chunks; c++)
                        dot = _mm512_fmadd_ps(_mm512_loadu_ps(q + (r * chunks + c) * LANES), keys[j][c], dot);
                partial[j] = dot;
            }
            store_scores(s.scores + r * padded + j0, sum_lanes16(partial), scale, h->mask ? h->mask + j0 : NULL,
                         (__mmask16)((1u << n) - 1));
        }
    }
    softmax_rows(s.scores, padded, length, rows, total, lse, probs);
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < chunks; c++) _mm512_storeu_ps(out + (r * chunks + c) * LANES, _mm512_setzero_ps());
    for (int64_t j0 = 0; j0 < length; j0 += VALUE_BLOCK) {
        int n = length - j0 < VALUE_BLOCK ? (int)(length - j0) : VALUE_BLOCK;
        const float *rows_of[VALUE_BLOCK];
        for (int j = 0; j < n; j++) {
            prefetch_key(h, h->values, j0 + j + PREFETCH_AHEAD, chunks * 64, 4);
            rows_of[j] = (const float *)row_address(h, h->values, j0 + j, 4);
        }
        for (int r = 0; r < rows; r++) {
            float *o = out + r * chunks * LANES;
            const float *w = s.scores + r * padded + j0;
            for (int c = 0; c < chunks; c++) acc[c] = _mm512_loadu_ps(o + c * LANES), odd[c] = _mm512_setzero_ps();
            int j = 0;
            for (; j + 1 < n; j += 2) /* two chains of sums: one FMA's latency would otherwise bound the loop */
                for (int c = 0; c < chunks; c++) {
                    acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), _mm512_loadu_ps(rows_of[j] + c * LANES), acc[c]);
                    odd[c] = _mm512_fmadd_ps(_mm512_set1_ps(w[j + 1]), _mm512_loadu_ps(rows_of[j + 1] + c * LANES),
                                             odd[c]);
                }
            if (j < n)
                for (int c = 0; c < chunks; c++)
                    acc[c] = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), _mm512_loadu_ps(rows_of[j] + c * LANES), acc[c]);
            for (int c = 0; c < chunks; c++) _mm512_storeu_ps(o + c * LANES, _mm512_add_ps(acc[c], odd[c]));
        }
    }
    for (int r = 0; r < rows; r++) {
        __m512 inverse = _mm512_set1_ps(total[r] > 0.0f ? 1.0f / total[r] : 0.0f);
        for (int c = 0; c < chunks; c++)
            _mm512_storeu_ps(out + (r * chunks + c) * LANES,
                             _mm512_mul_ps(_mm512_loadu_ps(out + (r * chunks + c) * LANES), inverse));
    }
}

#ifdef __AVX512BF16__
/* One KV head of a bf16 cache; as head_f32, with q bf16 (uint16 bit patterns) and `pairs` = dim / 32 vectors of
   bf16 per row. A rotated key is rotated in fp32 and rounded to bf16 once, like the torch path's rotated keys. */
INLINE void head_bf16(const uint16_t *q, const head_keys *h, int pairs, int rows, float scale, scratch s,
                      float *out, float *lse, float *probs) {
    __m512i keys[LANES][MAX_CHUNKS / 2];
    __m512i interleaved[VALUE_BLOCK / 2][MAX_CHUNKS]; /* two keys' values, element by element (32 KB) */
    __m512 partial[LANES], acc[MAX_CHUNKS];
    float total[MAX_ROWS];
    const int64_t length = h->length, padded = s.padded;
    for (int64_t j0 = 0; j0 < length; j0 += LANES) {
        int n = length - j0 < LANES ? (int)(length - j0) : LANES;
        for (int j = 0; j < n; j++) {
            prefetch_key(h, h->keys, j0 + j + PREFETCH_AHEAD, pairs * 64, 2);
            if (h->rope_cos) {
                __m512 x[MAX_CHUNKS];
                load_key_f32(h, j0 + j, 2 * pairs, 1, x);
                for (int c = 0; c < pairs; c++) keys[j][c] = (__m512i)_mm512_cvtne2ps_pbh(x[2 * c + 1], x[2 * c]);
            } else {
                const uint16_t *row = (const uint16_t *)row_address(h, h->keys, j0 + j, 2);
                for (int c = 0; c < pairs; c++) keys[j][c] = _mm512_loadu_si512(row + c * 32);
            }
        }
        for (int r = 0; r < rows; r++) {
            for (int j = 0; j < LANES; j++) {
                __m512 dot = _mm512_setzero_ps();
                if (j < n)
                    for (int c = 0; c < pairs; c++)
                        dot = _mm512_dpbf16_ps(dot, (__m512bh)_mm512_loadu_si512(q + (r * pairs + c) * 32),
                                               (__m512bh)keys[j][c]);
                partial[j] = dot;
            }
            store_scores(s.scores + r * padded + j0, sum_lanes16(partial), scale, h->mask ? h->mask + j0 : NULL,
                         (__mmask16)((1u << n) - 1));
        }
    }
    softmax_rows(s.scores, padded, length, rows, total, lse, probs);
    for (int r = 0; r < rows; r++) /* weights to bf16; padded lanes are 0, so an odd length's last pair is whole */
        for (int64_t j = 0; j < padded; j += LANES)
            _mm256_storeu_si256((__m256i *)(s.weights + r * padded + j),
                                (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s.scores + r * padded + j)));
    memset(out, 0, sizeof(float) * rows * pairs * 32);
    for (int64_t j0 = 0; j0 < length; j0 += VALUE_BLOCK) {
        int n = length - j0 < VALUE_BLOCK ? (int)(length - j0) : VALUE_BLOCK;
        for (int j = 0; j < n; j += 2) { /* lo/hi: each 128-bit lane's first/last 4 elements of both rows */
            prefetch_key(h, h->values, j0 + j + PREFETCH_AHEAD, pairs * 64, 2);
            prefetch_key(h, h->values, j0 + j + 1 + PREFETCH_AHEAD, pairs * 64, 2);
            const uint16_t *even_row = (const uint16_t *)row_address(h, h->values, j0 + j, 2);
            const uint16_t *odd_row = j + 1 < n ? (const uint16_t *)row_address(h, h->values, j0 + j + 1, 2) : NULL;
            for (int c = 0; c < pairs; c++) {
                __m512i even = _mm512_loadu_si512(even_row + c * 32);
                __m512i odd = odd_row ? _mm512_loadu_si512(odd_row + c * 32) : _mm512_setzero_si512();
                interleaved[j / 2][2 * c] = _mm512_unpacklo_epi16(even, odd);
                interleaved[j / 2][2 * c + 1] = _mm512_unpackhi_epi16(even, odd);
            }
        }
        for (int r = 0; r < rows; r++) {
            const uint16_t *w = s.weights + r * padded + j0;
            for (int c = 0; c < 2 * pairs; c++) acc[c] = _mm512_setzero_ps();
            for (int j = 0; j < n; j += 2) {
                uint32_t two;
                memcpy(&two, w + j, sizeof two);
                __m512bh weight = (__m512bh)_mm512_set1_epi32((int)two);
                for (int c = 0; c < 2 * pairs; c++)
                    acc[c] = _mm512_dpbf16_ps(acc[c], weight, (__m512bh)interleaved[j / 2][c]);
            }
            /* acc[2c] lane 4L+i holds element 32c + 8L + i, acc[2c+1] element 32c + 8L + 4 + i */
            float *o = out + r * pairs * 32, lanes[2 * LANES];
            for (int c = 0; c < pairs; c++) {
                _mm512_storeu_ps(lanes, acc[2 * c]);
                _mm512_storeu_ps(lanes + LANES, acc[2 * c + 1]);
                for (int lane = 0; lane < 4; lane++)
                    for (int i = 0; i < 4; i++) {
                        o[c * 32 + 8 * lane + i] += lanes[4 * lane + i];
                        o[c * 32 + 8 * lane + 4 + i] += lanes[LANES + 4 * lane + i];
                    }
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float inverse = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
        for (int d = 0; d < pairs * 32; d++) out[r * pairs * 32 + d] *= inverse;
    }
}
#endif

#ifdef __AVX512BF16__
#define DECODE_BF16 /* bf16 caches: vdpbf16ps */
#endif
#elif defined(__AVX2__) && defined(__FMA__)
/* AVX2 with FMA: the same two passes with 8-lane vectors, for fp32 and bf16 caches. There are no bf16 dot products
   here: bf16 keys, values and queries are widened to fp32 (a 16-bit shift) and multiplied by fp32 FMAs, so q . k is
   again exactly what fp32 arithmetic on the bf16 values gives (a product of two bf16 values is exact in fp32); the
   softmax weights stay fp32 for the sum of values (the AVX-512 path rounds them to bf16 because vdpbf16ps takes
   only bf16; here that would only add an error). A rotated bf16 key is rounded to bf16 once, as there. */

/* Lane i of the result is the sum of the 8 lanes of v[i]: pairs interleaved and added, then quads, then the two
   128-bit halves: 4 + 2 + 1 steps. */
INLINE __m256 sum_lanes8(const __m256 v[LANES]) {
    __m256 pairs[4], quads[2];
    for (int i = 0; i < 4; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) { /* per 128-bit lane: that lane's sums of v[4i..4i+3] */
        __m256d a = _mm256_castps_pd(pairs[2 * i]), b = _mm256_castps_pd(pairs[2 * i + 1]);
        quads[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)),
                                 _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                         _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}

INLINE float reduce_add8(__m256 v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

INLINE float reduce_max8(__m256 v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

/* exp(x) for x <= 0, as the AVX-512 exp_nonpositive (the same reduction and polynomial, so the same values): 2^n
   is built in the exponent field (n >= -126 above the floor: a normal number, so the product rounds as scalef's). */
INLINE __m256 exp_nonpositive(__m256 x) {
    const __m256 floor_x = _mm256_set1_ps(-87.0f);
    __m256 live = _mm256_cmp_ps(x, floor_x, _CMP_GE_OQ);
    x = _mm256_max_ps(x, floor_x); /* a NaN gives the floor, and is not live: weight 0, as there */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x); /* ln2 split in two */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860682030941723e-6f), r);
    static const float taylor[] = {1.0f / 5040, 1.0f / 720, 1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f};
    __m256 p = _mm256_set1_ps(taylor[0]);
    for (int i = 1; i < 8; i++) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(taylor[i]));
    __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(live, _mm256_mul_ps(p, _mm256_castsi256_ps(exponent)));
}

/* All ones in the lanes below n (0 <= n <= 8). */
INLINE __m256i lanes_below(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* Stores one block of 8 scores (lanes from n on set to -inf, so that they weigh 0). */
INLINE void store_scores(float *scores, __m256 dots, float scale, const float *mask, int n) {
    __m256i valid = lanes_below(n);
    __m256 s = _mm256_mul_ps(dots, _mm256_set1_ps(scale));
    if (mask) s = _mm256_add_ps(s, _mm256_maskload_ps(mask, valid));
    _mm256_storeu_ps(scores, _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s, _mm256_castsi256_ps(valid)));
}

/* As the AVX-512 softmax_rows (padded a multiple of 8 here). */
static void softmax_rows(float *scores, int64_t padded, int64_t length, int rows, float *total, float *lse,
                         float *probs) {
    for (int r = 0; r < rows; r++) {
        float *s = scores + r * padded;
        __m256 top = _mm256_set1_ps(-INFINITY), sum = _mm256_setzero_ps();
        for (int64_t j = 0; j < padded; j += LANES) top = _mm256_max_ps(top, _mm256_loadu_ps(s + j));
        float top1 = reduce_max8(top);
        __m256 shift = _mm256_set1_ps(top1 == -INFINITY ? 0.0f : top1);
        for (int64_t j = 0; j < padded; j += LANES) {
            __m256 w = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
            _mm256_storeu_ps(s + j, w);
            sum = _mm256_add_ps(sum, w);
        }
        total[r] = reduce_add8(sum);
        if (lse) lse[r] = top1 == -INFINITY ? -INFINITY : top1 + logf(total[r]);
        if (probs) {
            float inverse = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
            for (int64_t j = 0; j < length; j++) probs[r * length + j] = s[j] * inverse;
        }
    }
}

INLINE __m256 bf16x8_to_float(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 elements of a row of the cache as fp32. */
INLINE __m256 load_f32(const void *row, int c, int bf16) {
    return bf16 ? bf16x8_to_float((const uint16_t *)row + c * LANES) : _mm256_loadu_ps((const float *)row + c * LANES);
}

/* fp32 rounded to the nearest bf16 (ties to even; NaN stays NaN), kept as fp32. */
INLINE __m256 round_to_bf16(__m256 x) {
    __m256i bits = _mm256_castps_si256(x);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    __m256 rounded = _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32((int)0xffff0000u)));
    return _mm256_blendv_ps(rounded, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

/* Rotary embedding in the rotate-half layout, as the AVX-512 rotate (the same operations: the same fp32 keys).
   chunks: dim / 8, even. */
INLINE void rotate(__m256 *x, int chunks, const float *cos, const float *sin) {
    __m256 rolled[MAX_CHUNKS];
    for (int c = 0; c < chunks; c++) rolled[c] = x[(c + chunks / 2) % chunks];
    for (int c = 0; c < chunks; c++)
        x[c] = _mm256_fmadd_ps(x[c], _mm256_loadu_ps(cos + c * LANES),
                               _mm256_mul_ps(rolled[c], _mm256_loadu_ps(sin + c * LANES)));
}

/* The fp32 values of key j, rotated when the head has tables: the cache row itself where it is fp32 and not
   rotated, else `buffer` (dim floats) filled with them. */
INLINE const float *key_f32(const head_keys *h, int64_t j, int chunks, int bf16, float *buffer) {
    const char *row = row_address(h, h->keys, j, bf16 ? 2 : 4);
    if (!bf16 && !h->rope_cos) return (const float *)row;
    __m256 x[MAX_CHUNKS];
    for (int c = 0; c < chunks; c++) x[c] = load_f32(row, c, bf16);
    if (h->rope_cos) {
        rotate(x, chunks, h->rope_cos + j * chunks * LANES, h->rope_sin + j * chunks * LANES);
        if (bf16)
            for (int c = 0; c < chunks; c++) x[c] = round_to_bf16(x[c]);
    }
    for (int c = 0; c < chunks; c++) _mm256_storeu_ps(buffer + c * LANES, x[c]);
    return buffer;
}

/* o[c0 .. c0+G) (G vectors of one output row) += the weighted sum of n value rows: two chains of sums (even and odd
   keys), 2G accumulators, so that the FMAs' latency does not bound the loop and no accumulator leaves a register. */
INLINE void add_values(float *o, const float *w, const void *const *rows_of, int n, int c0, int G, int bf16) {
    __m256 acc[4], odd[4];
    for (int c = 0; c < G; c++) acc[c] = _mm256_loadu_ps(o + (c0 + c) * LANES), odd[c] = _mm256_setzero_ps();
    int j = 0;
    for (; j + 1 < n; j += 2) {
        __m256 even_weight = _mm256_set1_ps(w[j]), odd_weight = _mm256_set1_ps(w[j + 1]);
        for (int c = 0; c < G; c++) {
            acc[c] = _mm256_fmadd_ps(even_weight, load_f32(rows_of[j], c0 + c, bf16), acc[c]);
            odd[c] = _mm256_fmadd_ps(odd_weight, load_f32(rows_of[j + 1], c0 + c, bf16), odd[c]);
        }
    }
    if (j < n)
        for (int c = 0; c < G; c++)
            acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), load_f32(rows_of[j], c0 + c, bf16), acc[c]);
    for (int c = 0; c < G; c++) _mm256_storeu_ps(o + (c0 + c) * LANES, _mm256_add_ps(acc[c], odd[c]));
}

/* One KV head of an fp32 (bf16 = 0) or bf16 cache. q: rows x dim fp32 (bf16 caches: the queries widened); out:
   rows x dim fp32; lse: rows, or NULL; probs: rows x length, or NULL. chunks: dim / 8. */
INLINE void head_any(const float *q, const head_keys *h, int chunks, int bf16, int rows, float scale, scratch s,
                     float *out, float *lse, float *probs) {
    float buffers[LANES][MAX_CHUNKS * LANES]; /* converted or rotated keys (8 KB at most) */
    const float *keys[LANES];
    float total[MAX_ROWS];
    const int64_t length = h->length, padded = s.padded;
    const int element_size = bf16 ? 2 : 4, row_bytes = chunks * LANES * element_size;
    for (int64_t j0 = 0; j0 < length; j0 += LANES) {
        int n = length - j0 < LANES ? (int)(length - j0) : LANES;
        for (int j = 0; j < n; j++) {
            prefetch_key(h, h->keys, j0 + j + PREFETCH_AHEAD, row_bytes, element_size);
            keys[j] = key_f32(h, j0 + j, chunks, bf16, buffers[j]);
        }
        for (int j = n; j < LANES; j++) keys[j] = keys[0]; /* read, then masked to -inf */
        for (int r = 0; r < rows; r++) {
            /* the 8 keys' dot products side by side: each query vector loaded once for all of them */
            __m256 partial[LANES];
            for (int j = 0; j < LANES; j++) partial[j] = _mm256_setzero_ps();
            for (int c = 0; c < chunks; c++) {
                __m256 query = _mm256_loadu_ps(q + (r * chunks + c) * LANES);
                for (int j = 0; j < LANES; j++)
                    partial[j] = _mm256_fmadd_ps(query, _mm256_loadu_ps(keys[j] + c * LANES), partial[j]);
            }
            store_scores(s.scores + r * padded + j0, sum_lanes8(partial), scale, h->mask ? h->mask + j0 : NULL, n);
        }
    }
    softmax_rows(s.scores, padded, length, rows, total, lse, probs);
    memset(out, 0, sizeof(float) * rows * chunks * LANES);
    for (int64_t j0 = 0; j0 < length; j0 += VALUE_BLOCK) {
        int n = length - j0 < VALUE_BLOCK ? (int)(length - j0) : VALUE_BLOCK;
        const void *rows_of[VALUE_BLOCK];
        for (int j = 0; j < n; j++) {
            prefetch_key(h, h->values, j0 + j + PREFETCH_AHEAD, row_bytes, element_size);
            rows_of[j] = row_address(h, h->values, j0 + j, element_size);
        }
        for (int r = 0; r < rows; r++) {
            float *o = out + r * chunks * LANES;
            const float *w = s.scores + r * padded + j0;
            int c0 = 0; /* 4 vectors of the row at a time (chunks is even: the last group may have 2) */
            for (; c0 + 4 <= chunks; c0 += 4) add_values(o, w, rows_of, n, c0, 4, bf16);
            if (c0 < chunks) add_values(o, w, rows_of, n, c0, 2, bf16);
        }
    }
    for (int r = 0; r < rows; r++) {
        __m256 inverse = _mm256_set1_ps(total[r] > 0.0f ? 1.0f / total[r] : 0.0f);
        for (int c = 0; c < chunks; c++)
            _mm256_storeu_ps(out + (r * chunks + c) * LANES,
                             _mm256_mul_ps(_mm256_loadu_ps(out + (r * chunks + c) * LANES), inverse));
    }
}

/* One KV head of an fp32 cache. q: rows x dim fp32; out: rows x dim fp32; lse: rows, or NULL. */
INLINE void head_f32(const float *q, const head_keys *h, int chunks, int rows, float scale, scratch s, float *out,
                     float *lse, float *probs) {
    head_any(q, h, chunks, 0, rows, scale, s, out, lse, probs);
}

/* One KV head of a bf16 cache; q bf16 (uint16 bit patterns), `pairs` = dim / 32 (as the AVX-512 head_bf16). */
INLINE void head_bf16(const uint16_t *q, const head_keys *h, int pairs, int rows, float scale, scratch s,
                      float *out, float *lse, float *probs) {
    float wide[MAX_ROWS * MAX_CHUNKS * LANES];
    for (int i = 0; i < rows * pairs * 4; i++) _mm256_storeu_ps(wide + i * LANES, bf16x8_to_float(q + i * LANES));
    head_any(wide, h, pairs * 4, 1, rows, scale, s, out, lse, probs);
}

/* Prefill (fp32; AVX2 CPUs, whose fp32 engine has no bf16 dot products), flash style like the AVX512-BF16 kernel
   below: a prompt segment's query rows in tiles (a token's query heads of one KV head are consecutive rows), keys
   in blocks of KEY_BLOCK with a running softmax. Both products are register tiles of ROW_GROUP rows x 16 columns:
   per element, two vectors of keys (or values) loaded and each row's scalar broadcast against them, 12 FMAs for 8
   loads and no horizontal sums; for that each block's keys are transposed first (element d of its 32 keys
   contiguous). A group of rows skips the blocks past the last key it sees (PyTorch's flash kernel, given a later
   segment's mask, computes them). */
#define PREFILL_ELEMENT 4 /* fp32 */
#define PREFILL_TAKES(dim) ((dim) % 16 == 0 && (dim) <= MAX_CHUNKS * LANES) /* even chunks: 2 vectors a column */
#define TILE_ROWS 48
#define ROW_GROUP 6
#define ROW_MULTIPLE ROW_GROUP /* a tile's rows are padded to this */
#define KEY_BLOCK 32

typedef struct {
    float *kt;      /* per block of KEY_BLOCK keys: dim x KEY_BLOCK, the block's keys transposed */
    float *v;       /* padded x dim: the values */
    int64_t padded; /* keys rounded up to KEY_BLOCK */
} prepared_head;

static int prepared_alloc(prepared_head *p, int dim, int64_t padded) {
    size_t bytes = sizeof(float) * (size_t)dim * (size_t)(padded > 0 ? padded : KEY_BLOCK);
    p->kt = aligned_alloc(64, bytes), p->v = aligned_alloc(64, bytes), p->padded = padded;
    return p->kt && p->v;
}

static void prepared_free(prepared_head *p) {
    free(p->kt);
    free(p->v);
}

/* Keys from rows 0 .. length-1 or the rows `index` lists, rotated when there are RoPE tables; zeros past length. */
static void prepare_head(const head_keys *h, int dim, prepared_head *p) {
    float buffer[MAX_CHUNKS * LANES];
    for (int64_t j = 0; j < p->padded; j++) {
        float *column = p->kt + (j / KEY_BLOCK) * dim * KEY_BLOCK + j % KEY_BLOCK, *value = p->v + j * dim;
        if (j >= h->length) {
            for (int d = 0; d < dim; d++) column[d * KEY_BLOCK] = 0.0f;
            memset(value, 0, sizeof(float) * dim);
            continue;
        }
        const float *key = key_f32(h, j, dim / LANES, 0, buffer);
        for (int d = 0; d < dim; d++) column[d * KEY_BLOCK] = key[d];
        memcpy(value, row_address(h, h->values, j, 4), sizeof(float) * dim);
    }
}

/* One tile: `rows` query rows (q: rows x dim; rows a multiple of ROW_GROUP, the padding rows with limit 0) where
   row r sees keys 0 .. limit[r]-1. Writes rows x dim to out and each row's log-sum-exp of its scaled logits to lse
   (-inf where it sees nothing). */
INLINE void prefill_tile(const float *q, const int64_t *limit, int rows, const prepared_head *h, int chunks,
                         float scale, float *out, float *lse) {
    const int dim = chunks * LANES, groups = rows / ROW_GROUP;
    float logits[TILE_ROWS][KEY_BLOCK], top[TILE_ROWS], total[TILE_ROWS]; /* logits, then the block's weights */
    float acc[TILE_ROWS * MAX_CHUNKS * LANES]; /* each row's running weighted sum of values */
    int64_t seen[TILE_ROWS / ROW_GROUP], keys = 0; /* keys a group's rows see at most; the tile's */
    for (int g = 0; g < groups; g++) {
        seen[g] = 0;
        for (int r = g * ROW_GROUP; r < (g + 1) * ROW_GROUP; r++) {
            top[r] = -INFINITY, total[r] = 0.0f;
            seen[g] = limit[r] > seen[g] ? limit[r] : seen[g];
        }
        keys = seen[g] > keys ? seen[g] : keys;
    }
    memset(acc, 0, sizeof(float) * rows * dim);
    const __m256 minus = _mm256_set1_ps(-INFINITY), scaled = _mm256_set1_ps(scale);
    for (int64_t j0 = 0; j0 < keys; j0 += KEY_BLOCK) {
        const float *kt = h->kt + (j0 / KEY_BLOCK) * dim * KEY_BLOCK, *values = h->v + j0 * dim;
        for (int g = 0; g < groups; g++) { /* logits: ROW_GROUP rows x 16 keys at a time */
            if (seen[g] <= j0) continue;
            const float *rows_q = q + g * ROW_GROUP * dim;
            for (int half = 0; half < KEY_BLOCK; half += 2 * LANES) {
                __m256 dots[ROW_GROUP][2];
                for (int i = 0; i < ROW_GROUP; i++) dots[i][0] = dots[i][1] = _mm256_setzero_ps();
                for (int d = 0; d < dim; d++) {
                    __m256 k0 = _mm256_loadu_ps(kt + d * KEY_BLOCK + half);
                    __m256 k1 = _mm256_loadu_ps(kt + d * KEY_BLOCK + half + LANES);
                    for (int i = 0; i < ROW_GROUP; i++) {
                        __m256 b = _mm256_broadcast_ss(rows_q + i * dim + d);
                        dots[i][0] = _mm256_fmadd_ps(b, k0, dots[i][0]);
                        dots[i][1] = _mm256_fmadd_ps(b, k1, dots[i][1]);
                    }
                }
                for (int i = 0; i < ROW_GROUP; i++) {
                    _mm256_storeu_ps(logits[g * ROW_GROUP + i] + half, _mm256_mul_ps(dots[i][0], scaled));
                    _mm256_storeu_ps(logits[g * ROW_GROUP + i] + half + LANES, _mm256_mul_ps(dots[i][1], scaled));
                }
            }
        }
        for (int r = 0; r < rows; r++) { /* running softmax: masked keys out, old sums rescaled */
            int64_t visible = limit[r] - j0;
            if (seen[r / ROW_GROUP] <= j0) continue;
            if (visible <= 0) { /* its group computes this block: weights 0 */
                memset(logits[r], 0, sizeof logits[r]);
                continue;
            }
            __m256 s[KEY_BLOCK / LANES], block = minus, sum = _mm256_setzero_ps();
            for (int c = 0; c < KEY_BLOCK / LANES; c++) {
                s[c] = _mm256_loadu_ps(logits[r] + c * LANES);
                if (visible < KEY_BLOCK)
                    s[c] = _mm256_blendv_ps(minus, s[c], _mm256_castsi256_ps(lanes_below((int)visible - c * LANES)));
                block = _mm256_max_ps(block, s[c]);
            }
            float block_top = reduce_max8(block), old_top = top[r];
            float new_top = block_top > old_top ? block_top : old_top;
            __m256 shift = _mm256_set1_ps(new_top);
            for (int c = 0; c < KEY_BLOCK / LANES; c++) {
                __m256 w = exp_nonpositive(_mm256_sub_ps(s[c], shift));
                _mm256_storeu_ps(logits[r] + c * LANES, w);
                sum = _mm256_add_ps(sum, w);
            }
            float correction = old_top == -INFINITY ? 0.0f : new_top == old_top ? 1.0f : expf(old_top - new_top);
            total[r] = total[r] * correction + reduce_add8(sum);
            top[r] = new_top;
            if (correction != 1.0f && old_top != -INFINITY) { /* (nothing summed yet while the top was -inf) */
                __m256 factor = _mm256_set1_ps(correction);
                for (int c = 0; c < chunks; c++)
                    _mm256_storeu_ps(acc + r * dim + c * LANES, _mm256_mul_ps(_mm256_loadu_ps(acc + r * dim + c * LANES), factor));
            }
        }
        for (int g = 0; g < groups; g++) { /* values: ROW_GROUP rows x 16 elements at a time */
            if (seen[g] <= j0) continue;
            for (int c0 = 0; c0 < chunks; c0 += 2) {
                float *a = acc + g * ROW_GROUP * dim + c0 * LANES;
                __m256 sums[ROW_GROUP][2];
                for (int i = 0; i < ROW_GROUP; i++)
                    sums[i][0] = _mm256_loadu_ps(a + i * dim), sums[i][1] = _mm256_loadu_ps(a + i * dim + LANES);
                for (int j = 0; j < KEY_BLOCK; j++) {
                    __m256 v0 = _mm256_loadu_ps(values + j * dim + c0 * LANES);
                    __m256 v1 = _mm256_loadu_ps(values + j * dim + c0 * LANES + LANES);
                    for (int i = 0; i < ROW_GROUP; i++) {
                        __m256 w = _mm256_broadcast_ss(logits[g * ROW_GROUP + i] + j);
                        sums[i][0] = _mm256_fmadd_ps(w, v0, sums[i][0]);
                        sums[i][1] = _mm256_fmadd_ps(w, v1, sums[i][1]);
                    }
                }
                for (int i = 0; i < ROW_GROUP; i++)
                    _mm256_storeu_ps(a + i * dim, sums[i][0]), _mm256_storeu_ps(a + i * dim + LANES, sums[i][1]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        __m256 inverse = _mm256_set1_ps(total[r] > 0.0f ? 1.0f / total[r] : 0.0f);
        lse[r] = total[r] > 0.0f ? top[r] + logf(total[r]) : -INFINITY;
        for (int c = 0; c < chunks; c++)
            _mm256_storeu_ps(out + r * dim + c * LANES, _mm256_mul_ps(_mm256_loadu_ps(acc + r * dim + c * LANES), inverse));
    }
}

/* A tile's result row to the output (fp32: as it is). */
INLINE void store_output_row(void *o, const float *row, int dim) { memcpy(o, row, sizeof(float) * dim); }

#define DECODE_BF16 /* bf16 caches: widened to fp32, no AVX512-BF16 needed */
#endif

/* Head functions with their loop bounds fixed for the head sizes models use (64, 128), and one for any size:
   SIZE is head_dim / LANES (fp32 vectors) or head_dim / 32 (bf16 pairs of vectors). */
#define HEAD_VARIANT(NAME, HEAD, ELEMENT, SIZE)                                                                    \
    static void NAME(const ELEMENT *q, const head_keys *h, int size, int rows, float scale, scratch s,           \
                     float *out, float *lse, float *probs) {                                                     \
        (void)size;                                                                                              \
        HEAD(q, h, SIZE, rows, scale, s, out, lse, probs);                                                       \
    }
typedef void (*f32_head)(const float *, const head_keys *, int, int, float, scratch, float *, float *, float *);
HEAD_VARIANT(head_f32_d64, head_f32, float, 64 / LANES)
HEAD_VARIANT(head_f32_d128, head_f32, float, 128 / LANES)
HEAD_VARIANT(head_f32_any, head_f32, float, size)
#ifdef DECODE_BF16
typedef void (*bf16_head)(const uint16_t *, const head_keys *, int, int, float, scratch, float *, float *,
                          float *);
HEAD_VARIANT(head_bf16_d64, head_bf16, uint16_t, 2)
HEAD_VARIANT(head_bf16_d128, head_bf16, uint16_t, 4)
HEAD_VARIANT(head_bf16_any, head_bf16, uint16_t, size)
#endif

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch does; NaN stays NaN */
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#ifdef __AVX512BF16__
/* Causal attention for a segment of a prompt (prefill), bf16, flash style: queries in tiles of up to TILE_ROWS rows
   (a token's query heads of one KV head are consecutive rows), keys in blocks of 32 with a running softmax. The
   logits are outer products: each query pair of elements broadcast against 16 keys' pairs, so a block's 32 logits
   per row come out as two vectors with no horizontal sums. For that the head's keys are first transposed into
   pairs (pair p of key j at kt[p * padded + j]) and its values interleaved two keys at a time (as in head_bf16). */
#define PREFILL_ELEMENT 2 /* bf16 */
#define PREFILL_TAKES(dim) ((dim) == 32 || (dim) == 64 || (dim) == 128 || (dim) == 256)
#define TILE_ROWS 64
#define ROW_MULTIPLE 8 /* a tile's rows are padded to this */
#define KEY_BLOCK 32

typedef struct {
    uint32_t *kt;     /* pairs x padded: key pairs, transposed */
    __m512i *vint;    /* (padded / 2) x (dim / 16): two keys' values interleaved */
    int64_t padded;   /* keys rounded up to KEY_BLOCK */
} prepared_head;

static int prepared_alloc(prepared_head *p, int dim, int64_t padded) {
    p->kt = aligned_alloc(64, sizeof(uint32_t) * (size_t)(dim / 2) * (padded > 0 ? padded : KEY_BLOCK));
    p->vint = aligned_alloc(64, sizeof(__m512i) * (size_t)(padded / 2 + 1) * (dim / LANES));
    p->padded = padded;
    return p->kt && p->vint;
}

static void prepared_free(prepared_head *p) {
    free(p->kt);
    free(p->vint);
}

/* Transposes a head's keys into pairs and interleaves its values (see above); keys come from rows 0 .. length-1
   or the rows `index` lists, rotated first when there are RoPE tables (rotate; rounded to bf16 once). */
static void prepare_head(const head_keys *h, int dim, prepared_head *prepared) {
    int pairs = dim / 2, chunks = dim / LANES;
    uint32_t *kt = prepared->kt;
    __m512i *vint = prepared->vint;
    int64_t padded = prepared->padded;
    for (int64_t j = 0; j < padded; j++) {
        if (j >= h->length) {
            for (int p = 0; p < pairs; p++) kt[p * padded + j] = 0;
            continue;
        }
        uint32_t row[128];
        if (h->rope_cos) {
            __m512 x[MAX_CHUNKS];
            load_key_f32(h, j, chunks, 1, x);
            for (int c = 0; c < dim / 32; c++) _mm512_storeu_si512(row + c * LANES, (__m512i)_mm512_cvtne2ps_pbh(x[2 * c + 1], x[2 * c]));
        } else {
            memcpy(row, row_address(h, h->keys, j, 2), sizeof(uint16_t) * dim);
        }
        for (int p = 0; p < pairs; p++) kt[p * padded + j] = row[p];
    }
    for (int64_t j = 0; j < padded; j += 2)
        for (int c = 0; c < dim / 32; c++) {
            __m512i even = j < h->length ? _mm512_loadu_si512(row_address(h, h->values, j, 2) + c * 64)
                                         : _mm512_setzero_si512();
            __m512i odd = j + 1 < h->length ? _mm512_loadu_si512(row_address(h, h->values, j + 1, 2) + c * 64)
                                            : _mm512_setzero_si512();
            vint[(j / 2) * chunks + 2 * c] = _mm512_unpacklo_epi16(even, odd);
            vint[(j / 2) * chunks + 2 * c + 1] = _mm512_unpackhi_epi16(even, odd);
        }
}

/* One tile: `rows` query rows (q: rows x pairs, uint32 bf16 pairs; rows a multiple of 8, the padding rows with
   limit 0) where row r sees keys 0 .. limit[r]-1. Writes rows x dim fp32 to out and each row's log-sum-exp of
   its scaled logits to lse (-inf where it sees nothing). */
INLINE void prefill_tile(const uint32_t *q, const int64_t *limit, int rows, const prepared_head *h, int chunks,
                         float scale, float *out, float *lse) {
    /* values: group_rows rows x chunks accumulators at a time (16 registers); a constant where this is inlined */
    int dim = chunks * LANES, pairs = dim / 2, group_rows = LANES / chunks;
    float logits[TILE_ROWS][KEY_BLOCK], top[TILE_ROWS], total[TILE_ROWS];
    uint32_t weights[TILE_ROWS][KEY_BLOCK / 2];
    float acc[TILE_ROWS * MAX_CHUNKS * LANES]; /* each row's running sum of values, in the interleaved order */
    int64_t keys = 0;
    for (int r = 0; r < rows; r++) {
        top[r] = -INFINITY, total[r] = 0.0f;
        keys = limit[r] > keys ? limit[r] : keys;
    }
    memset(acc, 0, sizeof(float) * rows * chunks * LANES);
    for (int64_t j0 = 0; j0 < keys; j0 += KEY_BLOCK) {
        for (int r0 = 0; r0 < rows; r0 += 8) { /* logits of 8 rows x 32 keys: 16 accumulators */
            __m512 dots[8][2];
            for (int r = 0; r < 8; r++) dots[r][0] = dots[r][1] = _mm512_setzero_ps();
            for (int p = 0; p < pairs; p++) {
                __m512bh k0 = (__m512bh)_mm512_loadu_si512(h->kt + p * h->padded + j0);
                __m512bh k1 = (__m512bh)_mm512_loadu_si512(h->kt + p * h->padded + j0 + LANES);
                for (int r = 0; r < 8; r++) {
                    __m512bh b = (__m512bh)_mm512_set1_epi32((int)q[(r0 + r) * pairs + p]);
                    dots[r][0] = _mm512_dpbf16_ps(dots[r][0], b, k0);
                    dots[r][1] = _mm512_dpbf16_ps(dots[r][1], b, k1);
                }
            }
            for (int r = 0; r < 8; r++) {
                _mm512_storeu_ps(logits[r0 + r], _mm512_mul_ps(dots[r][0], _mm512_set1_ps(scale)));
                _mm512_storeu_ps(logits[r0 + r] + LANES, _mm512_mul_ps(dots[r][1], _mm512_set1_ps(scale)));
            }
        }
        for (int r = 0; r < rows; r++) { /* running softmax: masked keys out, weights to bf16, old sums rescaled */
            int64_t visible = limit[r] - j0;
            visible = visible < 0 ? 0 : visible > KEY_BLOCK ? KEY_BLOCK : visible;
            __mmask16 lo = (__mmask16)(visible >= 16 ? 0xffff : (1u << visible) - 1);
            __mmask16 hi = (__mmask16)(visible <= 16 ? 0 : visible >= 32 ? 0xffff : (1u << (visible - 16)) - 1);
            __m512 minus = _mm512_set1_ps(-INFINITY);
            __m512 s0 = _mm512_mask_blend_ps(lo, minus, _mm512_loadu_ps(logits[r]));
            __m512 s1 = _mm512_mask_blend_ps(hi, minus, _mm512_loadu_ps(logits[r] + LANES));
            float block_top = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
            float new_top = block_top > top[r] ? block_top : top[r];
            if (new_top == -INFINITY) { /* nothing visible yet */
                memset(weights[r], 0, sizeof weights[r]);
                continue;
            }
            __m512 shift = _mm512_set1_ps(new_top);
            __m512 w0 = exp_nonpositive(_mm512_sub_ps(s0, shift)), w1 = exp_nonpositive(_mm512_sub_ps(s1, shift));
            _mm512_storeu_si512(weights[r], (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
            float correction = new_top == top[r] ? 1.0f : top[r] == -INFINITY ? 0.0f : expf(top[r] - new_top);
            total[r] = total[r] * correction + _mm512_reduce_add_ps(_mm512_add_ps(w0, w1));
            top[r] = new_top;
            if (correction != 1.0f) {
                __m512 factor = _mm512_set1_ps(correction);
                for (int c = 0; c < chunks; c++) {
                    float *a = acc + (r * chunks + c) * LANES;
                    _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), factor));
                }
            }
        }
        const __m512i *values = h->vint + (j0 / 2) * chunks;
        for (int r0 = 0; r0 < rows; r0 += group_rows) { /* values: group_rows rows x chunks accumulators */
            __m512 sums[LANES];
            int n = group_rows; /* rows is a multiple of 8, group_rows divides 8 */
            for (int r = 0; r < n; r++)
                for (int c = 0; c < chunks; c++) sums[r * chunks + c] = _mm512_loadu_ps(acc + ((r0 + r) * chunks + c) * LANES);
            for (int jp = 0; jp < KEY_BLOCK / 2; jp++)
                for (int r = 0; r < n; r++) {
                    __m512bh w = (__m512bh)_mm512_set1_epi32((int)weights[r0 + r][jp]);
                    for (int c = 0; c < chunks; c++)
                        sums[r * chunks + c] = _mm512_dpbf16_ps(sums[r * chunks + c], w, (__m512bh)values[jp * chunks + c]);
                }
            for (int r = 0; r < n; r++)
                for (int c = 0; c < chunks; c++) _mm512_storeu_ps(acc + ((r0 + r) * chunks + c) * LANES, sums[r * chunks + c]);
        }
    }
    for (int r = 0; r < rows; r++) { /* normalise; acc[2c] lane 4L+i is element 32c+8L+i, acc[2c+1] 32c+8L+4+i */
        float inverse = total[r] > 0.0f ? 1.0f / total[r] : 0.0f;
        lse[r] = total[r] > 0.0f ? top[r] + logf(total[r]) : -INFINITY;
        const float *a = acc + r * chunks * LANES;
        for (int c = 0; c < dim / 32; c++)
            for (int lane = 0; lane < 4; lane++)
                for (int i = 0; i < 4; i++) {
                    out[r * dim + c * 32 + 8 * lane + i] = a[(2 * c) * LANES + 4 * lane + i] * inverse;
                    out[r * dim + c * 32 + 8 * lane + 4 + i] = a[(2 * c + 1) * LANES + 4 * lane + i] * inverse;
                }
    }
}

/* A tile's result row to the output, rounded to bf16. */
INLINE void store_output_row(void *o, const float *row, int dim) {
    for (int d = 0; d < dim; d++) ((uint16_t *)o)[d] = float_to_bf16(row[d]);
}
#endif

#ifdef PREFILL_ELEMENT
/* The tile function with its loop bounds fixed for the head sizes models use (64, 128), and one for any size;
   q: the tile's query rows in the kernel's element type. */
typedef void (*tile_function)(const void *, const int64_t *, int, const prepared_head *, int, float, float *,
                              float *);
#define TILE_VARIANT(NAME, CHUNKS)                                                                                 \
    static void NAME(const void *q, const int64_t *limit, int rows, const prepared_head *h, int chunks,           \
                     float scale, float *out, float *lse) {                                                      \
        (void)chunks;                                                                                            \
        prefill_tile(q, limit, rows, h, CHUNKS, scale, out, lse);                                                \
    }
TILE_VARIANT(prefill_tile_d64, 64 / LANES)
TILE_VARIANT(prefill_tile_d128, 128 / LANES)
TILE_VARIANT(prefill_tile_any, chunks)
#endif

/* Whether prefill_attention runs here for this element size and head size: bf16 with AVX512-BF16, fp32 on CPUs
   with AVX2 but not AVX-512 (where it was measured against PyTorch's flash kernel; an fp32 engine on an AVX-512 CPU
   keeps PyTorch's). A query rather than a trial call: prefill_attention's -1 also means arguments it does not take
   or memory running out, so a failed call could not tell "never here" from "not this time"; and the caller learns
   it before preparing anything. (The symbol itself is always there, returning -1 where it cannot run, for the
   loader to bind.) */
int prefill_attention_supports(int element_size, int dim) {
#ifdef PREFILL_ELEMENT
    return element_size == PREFILL_ELEMENT && PREFILL_TAKES(dim);
#else
    (void)element_size, (void)dim;
    return 0;
#endif
}

#ifdef PREFILL_ELEMENT
/* A prefill call shared by its threads: its arguments (see prefill_attention), every (batch entry, KV head)'s
   prepared keys and values, and the counters the threads take work from. */
typedef struct {
    const void *q, *k, *v;
    void *out;
    float *lse;
    const int64_t *index;
    const float *rope_cos, *rope_sin;
    int batch, kv_heads, group, dim;
    int64_t tokens, keys, causal_start, rope_stride, q_batch, q_kv, q_head, q_token, o_batch, o_kv, o_head, o_token;
    int64_t l_batch, l_kv, l_head, l_token, kv_batch, kv_head, kv_token;
    float scale;
    prepared_head *heads; /* batch x kv_heads */
    int64_t tiles;        /* query tiles per head */
    atomic_long next_head, heads_done, next_tile;
} prefill_work;

/* One thread's part: heads to prepare, then (once all are) query tiles, each taken from a shared counter; the
   tiles late in a causal segment (the costly ones) go first, so that the threads finish together. Counters rather
   than a barrier: any number of threads can take part, however many could be started. */
static void *prefill_worker(void *arg) {
    prefill_work *w = arg;
    const long pairs = (long)w->batch * w->kv_heads;
    for (long i; (i = atomic_fetch_add(&w->next_head, 1)) < pairs;) {
        int b = (int)(i / w->kv_heads), h = (int)(i % w->kv_heads);
        int64_t at = (int64_t)b * w->kv_batch + (int64_t)h * w->kv_head;
        head_keys source = {(const char *)w->k + at * PREFILL_ELEMENT, (const char *)w->v + at * PREFILL_ELEMENT,
                            w->kv_token, w->keys, w->index ? w->index + (int64_t)b * w->keys : NULL,
                            w->rope_cos ? w->rope_cos + b * w->rope_stride : NULL,
                            w->rope_sin ? w->rope_sin + b * w->rope_stride : NULL, NULL};
        prepare_head(&source, w->dim, &w->heads[i]);
        atomic_fetch_add(&w->heads_done, 1);
    }
    while (atomic_load(&w->heads_done) < pairs) sched_yield(); /* another thread's head: about a millisecond */
    const int dim = w->dim, group = w->group, tile_tokens = TILE_ROWS / group;
    const size_t row_bytes = (size_t)PREFILL_ELEMENT * dim;
    tile_function tile = dim == 64 ? prefill_tile_d64 : dim == 128 ? prefill_tile_d128 : prefill_tile_any;
    float query[TILE_ROWS * 256] __attribute__((aligned(64))); /* the tile's rows, in the kernel's element type */
    int64_t limit[TILE_ROWS];
    float result[TILE_ROWS * 256], row_lse[TILE_ROWS];
    for (long i; (i = atomic_fetch_add(&w->next_tile, 1)) < pairs * w->tiles;) {
        long pair = i % pairs;
        int b = (int)(pair / w->kv_heads), h = (int)(pair % w->kv_heads);
        int64_t t0 = (w->tiles - 1 - i / pairs) * tile_tokens;
        int n = w->tokens - t0 < tile_tokens ? (int)(w->tokens - t0) : tile_tokens;
        int rows = (n * group + ROW_MULTIPLE - 1) / ROW_MULTIPLE * ROW_MULTIPLE;
        for (int r = 0; r < rows; r++) {
            int64_t t = t0 + r / group, seen = w->causal_start < 0 ? w->keys : w->causal_start + t + 1;
            char *row = (char *)query + r * row_bytes;
            if (r < n * group) {
                int64_t at = b * w->q_batch + h * w->q_kv + (r % group) * w->q_head + t * w->q_token;
                memcpy(row, (const char *)w->q + at * PREFILL_ELEMENT, row_bytes);
                limit[r] = seen < w->keys ? seen : w->keys;
            } else {
                memset(row, 0, row_bytes);
                limit[r] = 0;
            }
        }
        tile(query, limit, rows, &w->heads[pair], dim / LANES, w->scale, result, row_lse);
        for (int r = 0; r < n * group; r++) {
            int64_t t = t0 + r / group, g = r % group;
            int64_t at = b * w->o_batch + h * w->o_kv + g * w->o_head + t * w->o_token;
            store_output_row((char *)w->out + at * PREFILL_ELEMENT, result + r * dim, dim);
            if (w->lse) w->lse[b * w->l_batch + h * w->l_kv + g * w->l_head + t * w->l_token] = row_lse[r];
        }
    }
    return NULL;
}
#endif

/* Attention of many query rows (a prompt segment), element_size 2 (bf16, AVX512-BF16) or 4 (fp32, AVX2: see
   prefill_attention_supports), on `threads` threads (the caller's and threads - 1 started for the call). For batch
   entry b and KV head h, query t of head g of its group is at q + b*q_batch + h*q_kv + g*q_head + t*q_token
   elements (dim contiguous; out and lse alike, lse may be NULL). The keys: `keys` slots per batch entry, row j of
   k/v (strides kv_batch, kv_head, kv_token) or, with index (batch, keys), the row it lists; rotated by RoPE tables
   (keys x dim per batch entry, rope_stride apart) when given. causal_start >= 0: query t sees slots
   0 .. causal_start + t; else every slot. Returns 0, or -1 for what it does not take or when memory runs out. */
int prefill_attention(const void *q, void *out, float *lse, const void *k, const void *v, const int64_t *index,
                      const float *rope_cos, const float *rope_sin, int element_size, int threads, int batch,
                      int kv_heads, int group, int dim, int64_t tokens, int64_t keys, int64_t causal_start,
                      int64_t rope_stride, int64_t q_batch, int64_t q_kv, int64_t q_head, int64_t q_token,
                      int64_t o_batch, int64_t o_kv, int64_t o_head, int64_t o_token, int64_t l_batch, int64_t l_kv,
                      int64_t l_head, int64_t l_token, int64_t kv_batch, int64_t kv_head, int64_t kv_token,
                      float scale) {
#ifndef PREFILL_ELEMENT
    (void)q, (void)out, (void)lse, (void)k, (void)v, (void)index, (void)rope_cos, (void)rope_sin, (void)element_size;
    (void)threads, (void)batch, (void)kv_heads, (void)group, (void)dim, (void)tokens, (void)keys, (void)causal_start;
    (void)rope_stride, (void)q_batch, (void)q_kv, (void)q_head, (void)q_token, (void)o_batch, (void)o_kv;
    (void)o_head, (void)o_token, (void)l_batch, (void)l_kv, (void)l_head, (void)l_token, (void)kv_batch;
    (void)kv_head, (void)kv_token, (void)scale;
    return -1;
#else
    if (!prefill_attention_supports(element_size, dim) || group < 1 || group > TILE_ROWS || threads < 1 ||
        tokens < 0 || keys < 0 || batch < 0 || kv_heads < 0 || (rope_cos && !rope_sin))
        return -1;
    const int pairs = batch * kv_heads;
    prefill_work w = {q, k, v, out, lse, index, rope_cos, rope_sin, batch, kv_heads, group, dim, tokens, keys,
                      causal_start, rope_stride, q_batch, q_kv, q_head, q_token, o_batch, o_kv, o_head, o_token,
                      l_batch, l_kv, l_head, l_token, kv_batch, kv_head, kv_token, scale,
                      calloc((size_t)(pairs > 0 ? pairs : 1), sizeof(prepared_head)),
                      (tokens + TILE_ROWS / group - 1) / (TILE_ROWS / group), 0, 0, 0};
    int ok = w.heads != NULL;
    for (int i = 0; ok && i < pairs; i++)
        ok = prepared_alloc(&w.heads[i], dim, (keys + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK);
    if (ok) {
        pthread_t helpers[MAX_PREFILL_THREADS];
        int started = 0; /* fewer than asked if one could not start: the others take its share */
        while (started < threads - 1 && started < MAX_PREFILL_THREADS &&
               pthread_create(&helpers[started], NULL, prefill_worker, &w) == 0)
            started++;
        prefill_worker(&w);
        for (int i = 0; i < started; i++) pthread_join(helpers[i], NULL);
    }
    for (int i = 0; w.heads && i < pairs; i++) prepared_free(&w.heads[i]);
    free(w.heads);
    return ok ? 0 : -1;
#endif
}

/* Whether the decode kernel takes a cache of this element size (2: bf16, 4: fp32) and head size: fp32 a multiple
   of 16, bf16 of 32, up to 256, on either instruction set. */
int decode_attention_supports(int element_size, int dim) {
    if (element_size == 4) return dim % 16 == 0 && dim <= MAX_CHUNKS * LANES;
#ifdef DECODE_BF16
    if (element_size == 2) return dim % 32 == 0 && dim <= MAX_CHUNKS * LANES;
#endif
    return 0;
}

/* q: (batch, kv_heads, rows, dim) contiguous; k, v: (batch, kv_heads, tokens, dim) with the given element strides
   for batch, head and token (dim contiguous, the same strides for both); length: the keys attended, tokens
   0 .. length-1, or with index (batch, length) the tokens it lists (a store shared by the batch: batch stride 0);
   rope_cos, rope_sin: (length, dim) fp32 tables to rotate the keys with (see rotate), rope_stride elements from
   one batch entry's tables to the next (0: shared), or NULL; mask: (batch,
   length) fp32 or NULL; out like q; lse: (batch, kv_heads, rows) fp32, the log-sum-exp of the scaled, masked
   logits, or NULL; probs: (batch, kv_heads, rows, length) fp32, each row's attention probabilities (where a
   question looks: IndexPool's evidence), or NULL. Returns 0, or -1 for what it does not take or when its scratch
   memory cannot be allocated (the caller then uses torch). */
int decode_attention(const void *q, const void *k, const void *v, const float *mask, void *out, float *lse,
                     int element_size, int batch, int kv_heads, int rows, int dim, int64_t length,
                     int64_t batch_stride, int64_t head_stride, int64_t token_stride, float scale,
                     const int64_t *index, const float *rope_cos, const float *rope_sin, int64_t rope_stride,
                     float *probs) {
    if (!decode_attention_supports(element_size, dim) || rows < 1 || rows > MAX_ROWS || length < 0 ||
        (rope_cos && (dim % 32 || !rope_sin)))
        return -1;
    scratch s = {NULL, NULL, (length + LANES - 1) / LANES * LANES};
    s.scores = malloc(sizeof(float) * rows * (s.padded + LANES));
    s.weights = malloc(sizeof(uint16_t) * rows * (s.padded + LANES));
    if (!s.scores || !s.weights) {
        free(s.scores);
        free(s.weights);
        return -1;
    }
    float result[MAX_ROWS * MAX_CHUNKS * LANES];
    for (int b = 0; b < batch; b++) {
        for (int h = 0; h < kv_heads; h++) {
            int64_t head = (int64_t)b * batch_stride + (int64_t)h * head_stride;
            int64_t first = ((int64_t)b * kv_heads + h) * rows; /* the head's first query row */
            head_keys keys = {(const char *)k + head * element_size, (const char *)v + head * element_size,
                              token_stride, length, index ? index + (int64_t)b * length : NULL,
                              rope_cos ? rope_cos + b * rope_stride : NULL, rope_sin ? rope_sin + b * rope_stride : NULL,
                              mask ? mask + (int64_t)b * length : NULL};
            float *head_lse = lse ? lse + first : NULL, *head_probs = probs ? probs + first * length : NULL;
            if (element_size == 4) {
                f32_head f32 = dim == 64 ? head_f32_d64 : dim == 128 ? head_f32_d128 : head_f32_any;
                f32((const float *)q + first * dim, &keys, dim / LANES, rows, scale, s, (float *)out + first * dim,
                    head_lse, head_probs);
                continue;
            }
#ifdef DECODE_BF16
            bf16_head bf16 = dim == 64 ? head_bf16_d64 : dim == 128 ? head_bf16_d128 : head_bf16_any;
            bf16((const uint16_t *)q + first * dim, &keys, dim / 32, rows, scale, s, result, head_lse, head_probs);
            for (int i = 0; i < rows * dim; i++) ((uint16_t *)out)[first * dim + i] = float_to_bf16(result[i]);
#endif
        }
    }
    free(s.scores);
    free(s.weights);
    return 0;
}
