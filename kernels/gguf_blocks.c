/* Linear layers computed on a GGUF file's own quantized blocks (kernels/gguf_blocks.py has the Python side and the
 * torch reference). The weights are read where they lie, in the memory-mapped file.
 *
 * The block formats, a row of the matrix being its blocks one after another along the input (k); 32 weights each:
 *   Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles;                  w = d * (u - 8),  u in 0..15
 *   Q4_1 (20 bytes): fp16 d, fp16 m, 16 bytes of nibbles;          w = d * u + m,    u in 0..15
 *   Q5_0 (22 bytes): fp16 d, 32 high bits, 16 bytes of nibbles;    w = d * (u - 16), u in 0..31
 *   Q5_1 (24 bytes): fp16 d, fp16 m, 32 high bits, 16 nibbles;     w = d * u + m,    u in 0..31
 *   Q8_0 (34 bytes): fp16 d, 32 int8;                              w = d * q
 * Byte j of the nibbles holds weight j in its low half and weight j + 16 in its high half; bit j of the high bits
 * (a little-endian 32-bit word) is bit 4 of weight j. The K-quants hold 256 weights (a super-block), in groups of
 * 16 or 32 with their own scales; below, "weight 128c + 32s + l" (l < 32) names where a weight's bits are:
 *   Q2_K (84 bytes): 16 bytes of scales, 64 of 2-bit levels, fp16 d, fp16 dmin; weight 128c + 32s + l is bits
 *     2s, 2s + 1 of byte 32c + l; group g of 16 weights: w = d * (b_g & 15) * u - dmin * (b_g >> 4), b_g its byte.
 *   Q3_K (110 bytes): 32 bytes of high bits, 64 of 2-bit levels, 12 of 6-bit scales, fp16 d; the 2 low bits as in
 *     Q2_K (after the high bits), the third, bit 4c + s of byte l of the high bits, adds 4; w = d * (sc_g - 32) *
 *     (u - 4), u in 0..7, for group g of 16: sc_g's low 4 bits the low (g < 8) or high half of byte g % 8, its top
 *     2 bits bits 2 (g / 4), 2 (g / 4) + 1 of byte 8 + g % 4.
 *   Q4_K (144 bytes): fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles; sub-block j of
 *     32: w = d * sc_j * u - dmin * m_j, u in 0..15; weight 64i + 32h + l the low (h = 0) or high half of byte
 *     32i + l; sc_j, m_j: j < 4: bytes j and j + 4, low 6 bits; j >= 4: the halves of byte j + 4 with the top 2
 *     bits of bytes j - 4 and j.
 *   Q5_K (176 bytes): fp16 d, fp16 dmin, the 12 bytes of scales and mins as Q4_K, 32 bytes of high bits, 128 of
 *     nibbles as Q4_K; bit j of byte l of the high bits is bit 4 of weight 32j + l; u in 0..31.
 *   Q6_K (210 bytes): 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (one per 16 weights), fp16 d;
 *     w = d * sc * (u - 32), u in 0..63; weight 128h + 32i + l: low bits the low (i < 2) or high half of byte
 *     64h + 32 (i % 2) + l, high bits bits 2i, 2i + 1 of byte 128 + 32h + l.
 * Every format is thus w = scale * u + offset with u a small unsigned level and a scale and offset per 16 or 32
 * weights (Q8_0 with VNNI: u = q + 128, offset -128 d; else the signed q).
 *
 * gguf_quantize_rows: activations as llama.cpp's engines take them, a block of 32 at a time: d = max |x| / 127,
 *   q = x / d rounded to the nearest integer (ties to even), s = d * sum(q) (what a block's offset multiplies) and
 *   s16 = d * sum(q) over each 16 (the K-quants' offsets are per 16 or 32 weights).
 * gguf_linear: y[r][n] = sum over blocks of (scale * d_x) * sum(u * q) + offset * s for rows r < rows and outputs
 *   n in [n_begin, n_end), the output rows being those of one or more matrices of the same type one after another
 *   (a fused layer), split between `threads` threads (below). The integer sums are exact (AVX-512 VNNI, 64 weights
 *   an instruction, where the CPU has it, else AVX2); each 4-byte lane's sum is scaled in fp32 and accumulated in
 *   lanes (two chains), the offsets' products in other lanes; up to 4 rows share each weight vector as it is
 *   decoded. With AVX-512 the 32-weight formats are read 8 blocks at a time (their scales gathered into one
 *   vector), and bit fields are cut by GF(2) bit-matrix transforms (GFNI) where the CPU has them.
 * gguf_linear_x: the same from rows of activations (fp32 or bf16) quantized in the call. Both write their outputs
 *   in fp32 or bf16, each output in its column: a decode step's layer in one call, its dtype and its reordering of
 *   Q and K rows done where the outputs are stored.
 * gguf_linear_f16: fp16 weights (the file's F16 tensors) against fp32 activations, widened exactly.
 * gguf_dequantize: rows [row_begin, row_end) of a matrix to fp32 or bf16 (prefill multiplies them in torch; an
 *   embedding takes its tokens' rows), each weight scale * u + offset rounded once (fma; then to bf16).
 * gguf_prompt_linear: gguf_linear's products for a prompt's many rows (the quantized formats), 8 weight rows laid
 *   out side by side at a time (a model in fp32: GEMMs of dequantized rows are slower there).
 */
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#include <sched.h>
#endif

#if !(defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#error "the GGUF block kernels need AVX2, FMA and F16C; the engine dequantizes the weights instead"
#endif

#include <immintrin.h>

enum { F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13,
       Q6_K = 14 }; /* ggml's type numbers */
#define BLOCK 32
#define SUPER 256
#ifndef MAX_ROWS /* activation rows a pass over the weights takes (1 to 4; the tests build other CPUs' code with 1, 2) */
#define MAX_ROWS 4
#endif
#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* Bytes per block of a type (0 where the kernels do not take it). */
static int block_bytes(int type) {
    switch (type) {
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q5_0: return 22;
        case Q5_1: return 24;
        case Q8_0: return 34;
        case Q2_K: return 84;
        case Q3_K: return 110;
        case Q4_K: return 144;
        case Q5_K: return 176;
        case Q6_K: return 210;
        default: return 0;
    }
}

static inline int is_k_quant(int type) { return type >= Q2_K && type <= Q6_K; }
static int block_weights(int type) { return is_k_quant(type) ? SUPER : BLOCK; }
static int64_t row_size(int type, int64_t K) { return K / block_weights(type) * block_bytes(type); }

ALWAYS_INLINE float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

ALWAYS_INLINE uint32_t word(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ------------------------------------------------------------------------------------------------------------
 * 64 bytes of levels (Bytes: two blocks of 32, or 64 weights of a super-block) and 16 floats (Floats: one per 4
 * bytes, the lanes of an integer dot product), in one AVX-512 register each, or two AVX2 registers. The formats
 * below are written once on these. */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define WIDE 1
#define VNNI 1
typedef __m512i Bytes;
typedef __m512 Floats;

ALWAYS_INLINE Bytes load64(const uint8_t *p) { return _mm512_loadu_si512(p); }
ALWAYS_INLINE Bytes load32_twice(const uint8_t *p) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}
ALWAYS_INLINE Bytes load32_pair(const uint8_t *a, const uint8_t *b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
/* The 8x8 bit matrix (GF2P8AFFINEQB's) that moves bits [from, from + count) of a byte to [to, to + count). */
ALWAYS_INLINE long long bit_matrix(int from, int count, int to) {
    uint64_t m = 0;
    for (int i = 0; i < count; i++) m |= (uint64_t)(1u << (from + i)) << (8 * (7 - (to + i)));
    return (long long)m;
}
/* Bits [f, f + count) of each byte moved to bits [to, to + count), the others 0, with f = f0 .. f3 in each 16
 * bytes (constants once inlined): one instruction with GFNI (a bit matrix per 8 bytes), else a shift and a mask. */
ALWAYS_INLINE Bytes bit_field4(Bytes v, int f0, int f1, int f2, int f3, int count, int to) {
#ifdef __GFNI__
    const long long m0 = bit_matrix(f0, count, to), m1 = bit_matrix(f1, count, to), m2 = bit_matrix(f2, count, to),
                    m3 = bit_matrix(f3, count, to);
    return _mm512_gf2p8affine_epi64_epi8(v, _mm512_setr_epi64(m0, m0, m1, m1, m2, m2, m3, m3), 0);
#else
    const __m512i mask = _mm512_set1_epi8((char)(((1 << count) - 1) << to));
    if (f0 >= to) /* the callers' fields all move the same way */
        return _mm512_and_si512(_mm512_srlv_epi64(v, _mm512_setr_epi64(f0 - to, f0 - to, f1 - to, f1 - to, f2 - to,
                                                                         f2 - to, f3 - to, f3 - to)), mask);
    return _mm512_and_si512(_mm512_sllv_epi64(v, _mm512_setr_epi64(to - f0, to - f0, to - f1, to - f1, to - f2,
                                                                     to - f2, to - f3, to - f3)), mask);
#endif
}
/* the same with `lo` in the first 32 bytes and `hi` in the last 32 */
ALWAYS_INLINE Bytes bit_field(Bytes v, int lo, int hi, int count, int to) {
    return bit_field4(v, lo, lo, hi, hi, count, to);
}
/* 16 bytes of nibbles at a and at b -> the 32 weights of each: byte j of a block, weight j (each 16 bytes read
 * into two 16-byte lanes, then the low halves of one and the high halves of the other kept). */
ALWAYS_INLINE Bytes nibbles_pair(const uint8_t *a, const uint8_t *b) {
    const __m256i twice_a = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)a));
    const __m256i twice_b = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)b));
    return bit_field4(_mm512_inserti64x4(_mm512_castsi256_si512(twice_a), twice_b, 1), 0, 4, 0, 4, 4, 0);
}
ALWAYS_INLINE Bytes or_bytes(Bytes a, Bytes b) { return _mm512_or_si512(a, b); }
ALWAYS_INLINE Bytes xor_bytes(Bytes v, int c) { return _mm512_xor_si512(v, _mm512_set1_epi8((char)c)); }
/* `value` in byte i where bit i of `bits` is set */
ALWAYS_INLINE Bytes where_set(uint64_t bits, int value) {
    return _mm512_maskz_mov_epi8(_cvtu64_mask64(bits), _mm512_set1_epi8((char)value));
}
/* lane i: the sum of u * q over bytes 4i .. 4i + 3, u unsigned, q signed: exact */
ALWAYS_INLINE Floats dot(Bytes u, const int8_t *q) {
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(q)));
}
/* the same over the first 32 bytes only (a row's last block when it has an odd number) */
ALWAYS_INLINE Floats dot_first(Bytes u, const int8_t *q) {
    return _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_maskz_loadu_epi8(0xffffffffu, q)));
}
ALWAYS_INLINE Floats fzero(void) { return _mm512_setzero_ps(); }
ALWAYS_INLINE Floats fset1(float v) { return _mm512_set1_ps(v); }
ALWAYS_INLINE Floats fadd(Floats a, Floats b) { return _mm512_add_ps(a, b); }
ALWAYS_INLINE Floats fmul(Floats a, Floats b) { return _mm512_mul_ps(a, b); }
ALWAYS_INLINE Floats fmadd(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
ALWAYS_INLINE Floats fload(const float *p) { return _mm512_loadu_ps(p); }
ALWAYS_INLINE float fsum(Floats v) { return _mm512_reduce_add_ps(v); }
/* 16 bytes, unsigned or signed, to floats */
ALWAYS_INLINE Floats widen(__m128i v, int is_signed) {
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
}
/* 16 fp16 values to floats */
ALWAYS_INLINE Floats halves16(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
/* 8 floats, each twice: p[0], p[0], p[1], p[1], ... */
ALWAYS_INLINE Floats dup8(const float *p) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                                 _mm512_castps256_ps512(_mm256_loadu_ps(p)));
}
/* f[4p] in lanes 0-3, f[4p + 1] in 4-7, f[4p + 2] in 8-11, f[4p + 3] in 12-15 (p a constant once inlined) */
ALWAYS_INLINE Floats spread(Floats f, int p) {
    const int b = 4 * p;
    return _mm512_permutexvar_ps(_mm512_setr_epi32(b, b, b, b, b + 1, b + 1, b + 1, b + 1, b + 2, b + 2, b + 2,
                                                   b + 2, b + 3, b + 3, b + 3, b + 3), f);
}
/* f[0] in lanes 0-7, f[1] in 8-15 */
ALWAYS_INLINE Floats spread2(__m128 f) {
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                 _mm512_castps128_ps512(f));
}
/* f[2p] in lanes 0-7, f[2p + 1] in 8-15 */
ALWAYS_INLINE Floats spread_pair(Floats f, int p) {
    const __m512i lanes = _mm512_mask_blend_epi32(0xff00, _mm512_set1_epi32(2 * p), _mm512_set1_epi32(2 * p + 1));
    return _mm512_permutexvar_ps(lanes, f);
}
/* 8 floats at lo, then 8 at hi */
ALWAYS_INLINE Floats fload8x2(const float *lo, const float *hi) {
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(lo)), _mm256_loadu_ps(hi), 1);
}
/* acc with f's lanes 8-15 added to its own */
ALWAYS_INLINE Floats fadd_upper(Floats acc, Floats f) { return _mm512_mask_add_ps(acc, 0xff00, acc, f); }
/* bytes 16g .. 16g + 15 */
ALWAYS_INLINE __m128i bytes16(Bytes v, int g) {
    switch (g) {
        case 0: return _mm512_castsi512_si128(v);
        case 1: return _mm512_extracti32x4_epi32(v, 1);
        case 2: return _mm512_extracti32x4_epi32(v, 2);
        default: return _mm512_extracti32x4_epi32(v, 3);
    }
}

#else /* AVX2: each a pair of 256-bit registers */
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define VNNI 1
#endif
typedef struct { __m256i lo, hi; } Bytes;
typedef struct { __m256 lo, hi; } Floats;

ALWAYS_INLINE __m256i load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
ALWAYS_INLINE Bytes load64(const uint8_t *p) { return (Bytes){load32(p), load32(p + 32)}; }
ALWAYS_INLINE Bytes load32_twice(const uint8_t *p) { const __m256i v = load32(p); return (Bytes){v, v}; }
ALWAYS_INLINE Bytes load32_pair(const uint8_t *a, const uint8_t *b) { return (Bytes){load32(a), load32(b)}; }
ALWAYS_INLINE __m256i nibbles(const uint8_t *qs) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs), low = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
}
ALWAYS_INLINE Bytes nibbles_pair(const uint8_t *a, const uint8_t *b) { return (Bytes){nibbles(a), nibbles(b)}; }
ALWAYS_INLINE Bytes or_bytes(Bytes a, Bytes b) {
    return (Bytes){_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)};
}
ALWAYS_INLINE Bytes xor_bytes(Bytes v, int c) {
    const __m256i m = _mm256_set1_epi8((char)c);
    return (Bytes){_mm256_xor_si256(v.lo, m), _mm256_xor_si256(v.hi, m)};
}
ALWAYS_INLINE __m256i bit_field32(__m256i v, int from, int count, int to) {
    const __m256i mask = _mm256_set1_epi8((char)(((1 << count) - 1) << to));
    if (from == to) return _mm256_and_si256(v, mask);
    return _mm256_and_si256(from > to ? _mm256_srl_epi16(v, _mm_cvtsi32_si128(from - to))
                                      : _mm256_sll_epi16(v, _mm_cvtsi32_si128(to - from)), mask);
}
/* Bits [f, f + count) of each byte moved to bits [to, to + count), the others 0, f = lo in the first 32 bytes and
 * hi in the last 32 */
ALWAYS_INLINE Bytes bit_field(Bytes v, int lo, int hi, int count, int to) {
    return (Bytes){bit_field32(v.lo, lo, count, to), bit_field32(v.hi, hi, count, to)};
}
/* 32 bits -> 32 bytes, `value` where the bit is set */
ALWAYS_INLINE __m256i where_set32(uint32_t bits, int value) {
    const __m256i which_byte = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i which_bit = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i spread = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), which_byte), which_bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(spread, which_bit), _mm256_set1_epi8((char)value));
}
ALWAYS_INLINE Bytes where_set(uint64_t bits, int value) {
    return (Bytes){where_set32((uint32_t)bits, value), where_set32((uint32_t)(bits >> 32), value)};
}
ALWAYS_INLINE __m256i dot32(__m256i u, __m256i q) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, q);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, q);
#else
    /* pairs of products fit int16 for levels up to 128: 2 * 128 * 127 < 32768 */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, q), _mm256_set1_epi16(1));
#endif
}
ALWAYS_INLINE Floats dot(Bytes u, const int8_t *q) {
    return (Floats){_mm256_cvtepi32_ps(dot32(u.lo, load32((const uint8_t *)q))),
                    _mm256_cvtepi32_ps(dot32(u.hi, load32((const uint8_t *)q + 32)))};
}
ALWAYS_INLINE Floats dot_first(Bytes u, const int8_t *q) {
    return (Floats){_mm256_cvtepi32_ps(dot32(u.lo, load32((const uint8_t *)q))), _mm256_setzero_ps()};
}
ALWAYS_INLINE Floats fzero(void) { return (Floats){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
ALWAYS_INLINE Floats fset1(float v) { return (Floats){_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
ALWAYS_INLINE Floats fadd(Floats a, Floats b) { return (Floats){_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
ALWAYS_INLINE Floats fmul(Floats a, Floats b) { return (Floats){_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
ALWAYS_INLINE Floats fmadd(Floats a, Floats b, Floats c) {
    return (Floats){_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
ALWAYS_INLINE Floats fload(const float *p) { return (Floats){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
ALWAYS_INLINE float fsum(Floats v) {
    const __m256 t = _mm256_add_ps(v.lo, v.hi);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
ALWAYS_INLINE Floats widen(__m128i v, int is_signed) {
    const __m128i upper = _mm_srli_si128(v, 8);
    if (is_signed)
        return (Floats){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(upper))};
    return (Floats){_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(upper))};
}
ALWAYS_INLINE Floats halves16(const uint8_t *p) {
    return (Floats){_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)),
                    _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)))};
}
ALWAYS_INLINE Floats dup8(const float *p) {
    const __m256 v = _mm256_loadu_ps(p);
    return (Floats){_mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)),
                    _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7))};
}
ALWAYS_INLINE Floats spread(Floats f, int p) {
    const __m256 source = p < 2 ? f.lo : f.hi;
    const int b = 4 * (p % 2);
    return (Floats){_mm256_permutevar8x32_ps(source, _mm256_setr_epi32(b, b, b, b, b + 1, b + 1, b + 1, b + 1)),
                    _mm256_permutevar8x32_ps(source, _mm256_setr_epi32(b + 2, b + 2, b + 2, b + 2, b + 3, b + 3,
                                                                       b + 3, b + 3))};
}
ALWAYS_INLINE Floats spread2(__m128 f) {
    const __m256 wide = _mm256_castps128_ps256(f);
    return (Floats){_mm256_permutevar8x32_ps(wide, _mm256_set1_epi32(0)),
                    _mm256_permutevar8x32_ps(wide, _mm256_set1_epi32(1))};
}
ALWAYS_INLINE Floats spread_pair(Floats f, int p) {
    return (Floats){_mm256_permutevar8x32_ps(f.lo, _mm256_set1_epi32(2 * p)),
                    _mm256_permutevar8x32_ps(f.lo, _mm256_set1_epi32(2 * p + 1))};
}
ALWAYS_INLINE Floats fload8x2(const float *lo, const float *hi) {
    return (Floats){_mm256_loadu_ps(lo), _mm256_loadu_ps(hi)};
}
ALWAYS_INLINE Floats fadd_upper(Floats acc, Floats f) { return (Floats){acc.lo, _mm256_add_ps(acc.hi, f.hi)}; }
ALWAYS_INLINE __m128i bytes16(Bytes v, int g) {
    const __m256i h = g < 2 ? v.lo : v.hi;
    return g % 2 ? _mm256_extracti128_si256(h, 1) : _mm256_castsi256_si128(h);
}
#endif

/* ------------------------------------------------------------------------------------------------ the formats */

#ifdef VNNI
#define Q8_SHIFT 128 /* Q8_0's levels q + 128 (the dot product takes them unsigned), its offset -128 d */
#else
#define Q8_SHIFT 0 /* maddubs' pairs would overflow on q + 128: the levels stay signed (level_dot) */
#endif

/* Q4_K's and Q5_K's scales and mins, per sub-block of 32: d * sc_j in lanes 0-7, dmin * m_j in 8-15
 * (w = d * sc_j * u - dmin * m_j). */
ALWAYS_INLINE Floats k_scales32(const uint8_t *block) {
    /* bytes 0-3: sc 0-3 and bits 6, 7 of sc 4-7; 4-7: m 0-3 and those of m 4-7; 8-11: sc 4-7 and m 4-7's low 4
     * bits -> sc 0-7 in bytes 0-7, m 0-7 in bytes 8-15 */
    const __m128i packed = _mm_loadu_si128((const __m128i *)(block + 4));
    const __m128i a = _mm_shuffle_epi8(packed, _mm_setr_epi32(0x03020100, 0x0b0a0908, 0x07060504, 0x0b0a0908));
    const __m128i b = _mm_shuffle_epi8(packed, _mm_setr_epi32(-1, 0x03020100, -1, 0x07060504)); /* -1: zeros */
    const __m128i sc_m = _mm_or_si128(
        _mm_or_si128(_mm_and_si128(a, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0)),
                     _mm_and_si128(_mm_srli_epi16(a, 4), _mm_setr_epi32(0, 0, 0, 0x0f0f0f0f))),
        _mm_and_si128(_mm_srli_epi16(b, 2), _mm_set1_epi8(0x30)));
    return fmul(widen(sc_m, 0), spread2(_mm_cvtph_ps(_mm_cvtsi32_si128((int)word(block))))); /* d, dmin */
}

/* The other K-quants' scale and offset for each of a super-block's 16 groups of 16 weights: w = scale * u +
 * offset. */
typedef struct {
    Floats scale, offset;
} GroupScales;

ALWAYS_INLINE GroupScales k_scales(int type, const uint8_t *block) {
    GroupScales g;
    switch (type) {
        case Q2_K: {
            const __m128i bytes = _mm_loadu_si128((const __m128i *)block), low = _mm_set1_epi8(15);
            g.scale = fmul(widen(_mm_and_si128(bytes, low), 0), fset1(half(block + 80)));
            g.offset = fmul(widen(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), 0), fset1(-half(block + 82)));
            break;
        }
        case Q3_K: { /* the 12 bytes of 6-bit scales read without going past the block's 110 */
            const __m128i packed = _mm_insert_epi32(_mm_loadl_epi64((const __m128i *)(block + 96)),
                                                    (int)word(block + 104), 2);
            const __m128i low = _mm_shuffle_epi8(packed, _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7));
            const __m128i top = _mm_shuffle_epi8(packed, _mm_set1_epi32(0x0b0a0908));
            /* group g: low 4 bits from byte g % 8 (its high half for g >= 8), top 2 from bits 2 (g / 4) of byte
             * 8 + g % 4: shifted to bits 4, 5 by 32-bit lane (g / 4) */
            const __m128i nibble = _mm_set1_epi8(15);
            const __m128i low4 = _mm_blend_epi32(_mm_and_si128(low, nibble),
                                                 _mm_and_si128(_mm_srli_epi16(low, 4), nibble), 12);
            const __m128i top2 = _mm_srlv_epi32(_mm_sllv_epi32(top, _mm_setr_epi32(4, 2, 0, 0)),
                                                _mm_setr_epi32(0, 0, 0, 2));
            const __m128i sc = _mm_or_si128(low4, _mm_and_si128(top2, _mm_set1_epi8(0x30)));
            g.scale = fmul(widen(_mm_sub_epi8(sc, _mm_set1_epi8(32)), 1), fset1(half(block + 108)));
            g.offset = fmul(g.scale, fset1(-4.0f));
            break;
        }
        default: /* Q6_K */
            g.scale = fmul(widen(_mm_loadu_si128((const __m128i *)(block + 192)), 1), fset1(half(block + 208)));
            g.offset = fmul(g.scale, fset1(-32.0f));
            break;
    }
    return g;
}

/* Weights 64p .. 64p + 63 of a K-quant super-block (p a constant once inlined): their levels u. */
ALWAYS_INLINE Bytes k_levels(int type, const uint8_t *block, int p) {
    const int c = p / 2, odd = p % 2;
    switch (type) {
        case Q2_K:
        case Q3_K: { /* weights 128c + 32s + l, s = 2 odd and 2 odd + 1 */
            const uint8_t *twos = block + (type == Q2_K ? 16 : 32) + 32 * c;
            const Bytes low = bit_field(load32_twice(twos), 4 * odd, 4 * odd + 2, 2, 0);
            return type == Q2_K ? low : or_bytes(low, bit_field(load32_twice(block), 2 * p, 2 * p + 1, 1, 2));
        }
        case Q4_K:
        case Q5_K: { /* sub-blocks 2p and 2p + 1 */
            const Bytes low = bit_field(load32_twice(block + (type == Q4_K ? 16 : 48) + 32 * p), 0, 4, 4, 0);
            return type == Q4_K ? low : or_bytes(low, bit_field(load32_twice(block + 16), 2 * p, 2 * p + 1, 1, 4));
        }
        default: /* Q6_K: weights 128c + 32i + l, i = 2 odd and 2 odd + 1 */
            return or_bytes(bit_field(load64(block + 64 * c), 4 * odd, 4 * odd, 4, 0),
                            bit_field(load32_twice(block + 128 + 32 * c), 4 * odd, 4 * odd + 2, 2, 4));
    }
}

/* Blocks a and b of a 32-weight format: their levels (Q8_0: q + Q8_SHIFT, with offset -Q8_SHIFT d). */
ALWAYS_INLINE Bytes pair_levels(int type, const uint8_t *a, const uint8_t *b) {
    switch (type) {
        case Q4_0: return nibbles_pair(a + 2, b + 2);
        case Q4_1: return nibbles_pair(a + 4, b + 4);
        case Q5_0:
            return or_bytes(nibbles_pair(a + 6, b + 6), where_set(word(a + 2) | (uint64_t)word(b + 2) << 32, 16));
        case Q5_1:
            return or_bytes(nibbles_pair(a + 8, b + 8), where_set(word(a + 4) | (uint64_t)word(b + 4) << 32, 16));
        default: return Q8_SHIFT ? xor_bytes(load32_pair(a + 2, b + 2), 0x80) : load32_pair(a + 2, b + 2);
    }
}

#ifndef WIDE
/* Blocks a and b of a 4- or 5-bit format with AVX2 registers, unpacked as they lie: the low nibbles of both blocks
 * (weights 0-15 of a, then of b) in .lo, the high nibbles (weights 16-31 of a, then b) in .hi. Half the unpacking
 * of pair_levels' natural order, and the two halves' products add up before they are widened (nibble_pair_dot). */
ALWAYS_INLINE Bytes nibble_pair_levels(int type, const uint8_t *a, const uint8_t *b) {
    const int at = type == Q4_0 ? 2 : type == Q4_1 ? 4 : type == Q5_0 ? 6 : 8;
    const __m256i bytes = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(a + at))),
                                                  _mm_loadu_si128((const __m128i *)(b + at)), 1);
    const __m256i low = _mm256_set1_epi8(0x0f);
    Bytes u = {_mm256_and_si256(bytes, low), _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low)};
    if (type == Q5_0 || type == Q5_1) { /* bit i of a block's 32: weight i's fifth bit */
        const uint32_t ha = word(a + (type == Q5_0 ? 2 : 4)), hb = word(b + (type == Q5_0 ? 2 : 4));
        u.lo = _mm256_or_si256(u.lo, where_set32((ha & 0xffff) | hb << 16, 16));
        u.hi = _mm256_or_si256(u.hi, where_set32(ha >> 16 | (hb & 0xffff0000u), 16));
    }
    return u;
}

/* nibble_pair_levels' u against the blocks' activations q (a's 32 levels, then b's; a's again where `single`, whose
 * second scale is 0): sum(u * q) of block a in lanes 0-3, of b in 4-7. Without VNNI the two halves' maddubs pairs
 * add as int16 (4 products of at most 31 * 127 each) before one madd widens them. */
ALWAYS_INLINE __m256 nibble_pair_dot(Bytes u, const int8_t *q, int single) {
    const int8_t *qb = single ? q : q + 32;
    const __m256i ql = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)q)),
                                               _mm_loadu_si128((const __m128i *)qb), 1);
    const __m256i qh = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(q + 16))),
                                               _mm_loadu_si128((const __m128i *)(qb + 16)), 1);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const __m256i sums = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u.lo, ql), u.hi, qh);
#elif defined(__AVXVNNI__)
    const __m256i sums = _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u.lo, ql), u.hi, qh);
#else
    const __m256i sums = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(u.lo, ql),
                                                            _mm256_maddubs_epi16(u.hi, qh)), _mm256_set1_epi16(1));
#endif
    return _mm256_cvtepi32_ps(sums);
}

/* acc + nibble_pair_dot's sums times their factors: lanes `first`, `first + 1` of f (block a's, b's d * d_x). */
ALWAYS_INLINE __m256 nibble_pair_madd(__m256 acc, Bytes u, const int8_t *q, int single, __m256 f, const int first) {
    const __m256i lanes = _mm256_setr_epi32(first, first, first, first, first + 1, first + 1, first + 1, first + 1);
    return _mm256_fmadd_ps(nibble_pair_dot(u, q, single), _mm256_permutevar8x32_ps(f, lanes), acc);
}
#endif

#if !defined(WIDE) && !defined(VNNI)
/* 64 weights of a K-quant super-block (k_levels' u: their first 32 in u.lo, the next in u.hi) against their
 * activations q: sum(u * q) of weights 0-15 in lanes 0, 1, of 32-47 in 2, 3, of 16-31 in 4, 5, of 48-63 in 6, 7.
 * The maddubs pairs are summed in pairs as int16 (4 products of at most 63 * 127: Q6_K's levels) before one
 * madd. */
ALWAYS_INLINE __m256 sub_block_pair_dot(Bytes u, const int8_t *q) {
    const __m256i first = _mm256_maddubs_epi16(u.lo, load32((const uint8_t *)q));
    const __m256i second = _mm256_maddubs_epi16(u.hi, load32((const uint8_t *)q + 32));
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_hadd_epi16(first, second), _mm256_set1_epi16(1)));
}
#endif

/* Their scales and offsets, in lanes 0 and 1. */
ALWAYS_INLINE void pair_scales(int type, const uint8_t *a, const uint8_t *b, __m128 *scale, __m128 *offset) {
    uint16_t da, db;
    memcpy(&da, a, 2);
    memcpy(&db, b, 2);
    *scale = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(da | (uint32_t)db << 16)));
    switch (type) {
        case Q4_0: *offset = _mm_mul_ps(*scale, _mm_set1_ps(-8.0f)); break;
        case Q5_0: *offset = _mm_mul_ps(*scale, _mm_set1_ps(-16.0f)); break;
        case Q4_1:
        case Q5_1: {
            uint16_t ma, mb;
            memcpy(&ma, a + 2, 2);
            memcpy(&mb, b + 2, 2);
            *offset = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(ma | (uint32_t)mb << 16)));
            break;
        }
        default: *offset = _mm_mul_ps(*scale, _mm_set1_ps(-(float)Q8_SHIFT)); break;
    }
}

/* sum(u * q) per lane (of the first block only: a row's odd last one) */
ALWAYS_INLINE Floats level_dot(int type, Bytes u, const int8_t *q, int first_only) {
#ifndef VNNI
    if (type == Q8_0) { /* signed levels: |w| against q with w's sign (w = -128 stays -128: 128 as unsigned) */
        const __m256i upper = first_only ? _mm256_setzero_si256() : load32((const uint8_t *)q + 32);
        const Bytes qx = {load32((const uint8_t *)q), upper};
        return (Floats){_mm256_cvtepi32_ps(dot32(_mm256_sign_epi8(u.lo, u.lo), _mm256_sign_epi8(qx.lo, u.lo))),
                        _mm256_cvtepi32_ps(dot32(_mm256_sign_epi8(u.hi, u.hi), _mm256_sign_epi8(qx.hi, u.hi)))};
    }
#endif
    (void)type;
    return first_only ? dot_first(u, q) : dot(u, q);
}

/* ------------------------------------------------------------------------------------------------ activations */

/* One block of 32 activations: its levels, its d, s and the s of its two 16s. */
ALWAYS_INLINE void quantize_block(const float *xb, int8_t *qb, float *d, float *s, float *s16) {
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int i = 0; i < BLOCK; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xb + i)));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float scale = _mm_cvtss_f32(m) / 127.0f, inverse = scale > 0.0f ? 1.0f / scale : 0.0f;
    int sums[2] = {0, 0};
    for (int i = 0; i < BLOCK; i += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xb + i), _mm256_set1_ps(inverse));
        const __m256i n = _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, n);
        for (int j = 0; j < 8; j++) {
            qb[i + j] = (int8_t)lanes[j];
            sums[i / 16] += lanes[j];
        }
    }
    *d = scale;
    *s = scale * (float)(sums[0] + sums[1]);
    s16[0] = scale * (float)sums[0];
    s16[1] = scale * (float)sums[1];
}

/* Rows of x (fp32, or bf16 where x_bf16; x_stride elements apart) to int8 blocks. */
static void quantize_rows(const void *x, int x_bf16, int64_t rows, int64_t x_stride, int64_t K, int8_t *q, float *d,
                          float *s, float *s16) {
    const int64_t blocks = K / BLOCK;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t at = r * x_stride + b * BLOCK, i = r * blocks + b;
            float widened[BLOCK];
            if (x_bf16) /* bf16 is the upper half of an fp32 */
                for (int j = 0; j < BLOCK; j += 8) {
                    const __m128i bits = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + at + j));
                    _mm256_storeu_si256((__m256i *)(widened + j), _mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
                }
            quantize_block(x_bf16 ? widened : (const float *)x + at, q + i * BLOCK, d + i, s + i, s16 + 2 * i);
        }
}

int gguf_quantize_rows(const float *x, int64_t rows, int64_t x_stride, int64_t K, int8_t *q, float *d, float *s,
                       float *s16) {
    if (K % BLOCK) return 1;
    quantize_rows(x, 0, rows, x_stride, K, q, d, s, s16);
    return 0;
}

/* ------------------------------------------------------------------------------------------------ linear */

/* A decode step streams each matrix from memory once: ask for the bytes 4 KiB ahead of those being read (the 1B
 * model's layers, one thread, Q4_K: 46 -> 41 ms a token; Q8_0 131 -> 101 ms, and with AVX2 code only, 2 threads,
 * 86 -> 55 ms; the hardware's prefetch alone leaves the loop waiting; 2 or 8 KiB ahead measured the same). */
#define AHEAD 4096
ALWAYS_INLINE void prefetch_ahead(const uint8_t *p, int bytes) {
    for (int i = 0; i < bytes; i += 64) _mm_prefetch((const char *)p + AHEAD + i, _MM_HINT_T0);
}

typedef struct { /* R rows of activations in int8 blocks (gguf_quantize_rows) */
    const int8_t *q;
    const float *d, *s, *s16;
    int64_t K;
} Activations;

typedef struct { /* where outputs go: fp32 or bf16 rows `stride` elements apart, output n in column columns[n] */
    void *y;
    int64_t stride;
    int bf16;
    const int64_t *columns; /* NULL: column n */
} Output;

/* Output n of row r (a decode step's model dtype, and its order of Q and K rows, written in place: the torch
 * operations that would do it after cost more than the kernel's stores). bf16 rounded as torch rounds it. */
ALWAYS_INLINE void put(const Output *o, int64_t r, int64_t n, float v) {
    const int64_t at = r * o->stride + (o->columns ? o->columns[n] : n);
    if (!o->bf16) {
        ((float *)o->y)[at] = v;
        return;
    }
    uint32_t bits;
    memcpy(&bits, &v, 4);
    ((uint16_t *)o->y)[at] = (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

/* Output rows [n_begin, n_end) of a K-quant matrix (row n at w + n * row_bytes) for R activation rows. Each
 * super-block's scales times the activations' d_x make a factor per 32 (Q4_K, Q5_K: 8 lanes, the mins' products
 * with s beside them) or per 16 weights (16 lanes), spread over the lanes of each 64's dot product. */
ALWAYS_INLINE void k_quant_rows(const int type, const Activations a, const uint8_t *w, int64_t row_bytes,
                                int64_t n_begin, int64_t n_end, const Output *o, int64_t r0, const int R) {
    const int64_t K = a.K, supers = K / SUPER, blocks = K / BLOCK;
    const int per_32 = type == Q4_K || type == Q5_K;
    for (int64_t n = n_begin; n < n_end; n++) {
        const uint8_t *row = w + n * row_bytes;
        Floats acc[MAX_ROWS][2], offsets[MAX_ROWS]; /* two chains per row: even and odd 64s */
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = offsets[r] = fzero();
        for (int64_t k = 0; k < supers; k++) {
            const uint8_t *block = row + k * block_bytes(type);
            prefetch_ahead(block, block_bytes(type));
            Floats factor[MAX_ROWS];
            if (per_32) {
                const Floats g = k_scales32(block);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    factor[r] = fmul(g, fload8x2(a.d + r * blocks + 8 * k, a.s + r * blocks + 8 * k));
                    offsets[r] = fadd_upper(offsets[r], factor[r]); /* dmin * m_j * s_j, subtracted below */
                }
            } else {
                const GroupScales g = k_scales(type, block);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    factor[r] = fmul(g.scale, dup8(a.d + r * blocks + 8 * k));
                    offsets[r] = fmadd(g.offset, fload(a.s16 + r * 2 * blocks + 16 * k), offsets[r]);
                }
            }
#pragma GCC unroll 4
            for (int p = 0; p < 4; p++) {
                const Bytes u = k_levels(type, block, p);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
#if !defined(WIDE) && !defined(VNNI)
                    /* one widening, conversion and multiply-add for the 64 weights: the factors in the lanes of
                     * sub_block_pair_dot (per 32: the two sub-blocks 2p, 2p + 1; per 16: groups b .. b + 3) */
                    const int b = 4 * (p % 2);
                    const __m256i lanes = per_32 ? _mm256_setr_epi32(2 * p, 2 * p, 2 * p + 1, 2 * p + 1, 2 * p, 2 * p,
                                                                     2 * p + 1, 2 * p + 1)
                                                 : _mm256_setr_epi32(b, b, b + 2, b + 2, b + 1, b + 1, b + 3, b + 3);
                    const __m256 f = _mm256_permutevar8x32_ps(per_32 || p < 2 ? factor[r].lo : factor[r].hi, lanes);
                    acc[r][p & 1].lo = _mm256_fmadd_ps(sub_block_pair_dot(u, a.q + r * K + k * SUPER + 64 * p), f,
                                                       acc[r][p & 1].lo);
#else
                    acc[r][p & 1] = fmadd(dot(u, a.q + r * K + k * SUPER + 64 * p),
                                          per_32 ? spread_pair(factor[r], p) : spread(factor[r], p), acc[r][p & 1]);
#endif
                }
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            put(o, r0 + r, n, fsum(fadd(acc[r][0], acc[r][1])) + (per_32 ? -fsum(offsets[r]) : fsum(offsets[r])));
    }
}

/* Blocks b and b + 1 of a row of a 32-weight format (only b where `single`: a row's odd last block, its levels
 * read twice and the second's scale 0) against R activation rows, into the accumulators `acc`. */
ALWAYS_INLINE void pair_step(const int type, const Activations a, const uint8_t *row, int64_t b, Floats *acc,
                             __m128 *offsets, const int R, const int single) {
    const int64_t blocks = a.K / BLOCK;
    const uint8_t *first = row + b * block_bytes(type), *second = single ? first : first + block_bytes(type);
    __m128 scale, offset;
    pair_scales(type, first, second, &scale, &offset);
#ifndef WIDE
    if (type != Q8_0) {
        const Bytes u = nibble_pair_levels(type, first, second);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const float *d = a.d + r * blocks + b, *s = a.s + r * blocks + b;
            const __m128 dx = single ? _mm_load_ss(d) : _mm_castpd_ps(_mm_load_sd((const double *)d));
            const __m128 sx = single ? _mm_load_ss(s) : _mm_castpd_ps(_mm_load_sd((const double *)s));
            const __m256 f = _mm256_castps128_ps256(_mm_mul_ps(scale, dx));
            acc[r].lo = nibble_pair_madd(acc[r].lo, u, a.q + r * a.K + b * BLOCK, single, f, 0);
            offsets[r] = _mm_fmadd_ps(offset, sx, offsets[r]);
        }
        return;
    }
#endif
    const Bytes u = pair_levels(type, first, second);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const float *d = a.d + r * blocks + b, *s = a.s + r * blocks + b;
        const __m128 dx = single ? _mm_load_ss(d) : _mm_castpd_ps(_mm_load_sd((const double *)d));
        const __m128 sx = single ? _mm_load_ss(s) : _mm_castpd_ps(_mm_load_sd((const double *)s));
        acc[r] = fmadd(level_dot(type, u, a.q + r * a.K + b * BLOCK, single), spread2(_mm_mul_ps(scale, dx)), acc[r]);
        offsets[r] = _mm_fmadd_ps(offset, sx, offsets[r]);
    }
}

#ifdef WIDE
/* 8 blocks (256 weights) of a 32-weight format at once: their scales (and mins) gathered into one vector, each
 * pair's levels read as pair_step reads them. (Picking the levels out of the chunk's bytes by byte permutes was
 * slower: vpermt2b costs more than the loads it saves.) */

/* The 8 blocks' fp16 values at byte `at` of each (their d, or m) as floats: Q4_0's d in one word permute of the
 * chunk's first 128 bytes, the others' loaded one by one. */
ALWAYS_INLINE __m256 chunk_halves(const int type, const uint8_t *block, int at) {
    const int bb = block_bytes(type);
    if (at + 7 * bb + 2 <= 128) {
        const __m128i words = _mm_setr_epi16((short)(at / 2), (short)((at + bb) / 2), (short)((at + 2 * bb) / 2),
                                             (short)((at + 3 * bb) / 2), (short)((at + 4 * bb) / 2),
                                             (short)((at + 5 * bb) / 2), (short)((at + 6 * bb) / 2),
                                             (short)((at + 7 * bb) / 2));
        const __m512i picked = _mm512_permutex2var_epi16(_mm512_loadu_si512(block), _mm512_zextsi128_si512(words),
                                                         _mm512_loadu_si512(block + 64));
        return _mm256_cvtph_ps(_mm512_castsi512_si128(picked));
    }
    uint16_t h[8];
    for (int i = 0; i < 8; i++) memcpy(&h[i], block + at + i * bb, 2);
    return _mm256_cvtph_ps(_mm_setr_epi16((short)h[0], (short)h[1], (short)h[2], (short)h[3], (short)h[4],
                                          (short)h[5], (short)h[6], (short)h[7]));
}

/* Blocks b .. b + 7 of a row against R activation rows, into the accumulators (two chains, pairs of blocks
 * alternating) and the offsets' products. */
ALWAYS_INLINE void chunk_step(const int type, const Activations a, const uint8_t *row, int64_t b,
                              Floats acc[2][MAX_ROWS], __m256 *offsets, const int R) {
    const int64_t blocks = a.K / BLOCK;
    const int bb = block_bytes(type);
    const uint8_t *block = row + b * bb;
    prefetch_ahead(block, 8 * bb);
    const __m256 scale = chunk_halves(type, block, 0);
    const float shift = type == Q4_0 ? -8.0f : type == Q5_0 ? -16.0f : -128.0f; /* the offset in steps of d */
    const __m256 offset = type == Q4_1 || type == Q5_1 ? chunk_halves(type, block, 2)
                                                       : _mm256_mul_ps(scale, _mm256_set1_ps(shift));
    Floats factor[MAX_ROWS]; /* lanes 0-7: the blocks' d * d_x */
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        factor[r] = _mm512_castps256_ps512(_mm256_mul_ps(scale, _mm256_loadu_ps(a.d + r * blocks + b)));
        offsets[r] = _mm256_fmadd_ps(offset, _mm256_loadu_ps(a.s + r * blocks + b), offsets[r]);
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const Bytes u = pair_levels(type, block + 2 * j * bb, block + (2 * j + 1) * bb);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc[j & 1][r] = fmadd(dot(u, a.q + r * a.K + (b + 2 * j) * BLOCK), spread_pair(factor[r], j),
                                  acc[j & 1][r]);
    }
}
#endif

#ifndef WIDE
/* Blocks b .. b + 3 of a 4- or 5-bit format with AVX2 registers: pair_step's work for two pairs, the blocks'
 * scales and the activations' d and s taken 4 at a time. */
ALWAYS_INLINE void quad_step(const int type, const Activations a, const uint8_t *row, int64_t b,
                             Floats acc[2][MAX_ROWS], __m128 *offsets, const int R) {
    const int64_t blocks = a.K / BLOCK;
    const int bb = block_bytes(type), has_min = type == Q4_1 || type == Q5_1;
    const uint8_t *block = row + b * bb;
    uint16_t d[4], m[4];
    for (int i = 0; i < 4; i++) memcpy(&d[i], block + i * bb, 2), memcpy(&m[i], block + i * bb + 2, 2);
    const __m128 scale = _mm_cvtph_ps(_mm_setr_epi16((short)d[0], (short)d[1], (short)d[2], (short)d[3], 0, 0, 0, 0));
    const __m128 offset = has_min ? _mm_cvtph_ps(_mm_setr_epi16((short)m[0], (short)m[1], (short)m[2], (short)m[3],
                                                                0, 0, 0, 0))
                                  : _mm_mul_ps(scale, _mm_set1_ps(type == Q4_0 ? -8.0f : -16.0f));
    const Bytes u0 = nibble_pair_levels(type, block, block + bb), u1 = nibble_pair_levels(type, block + 2 * bb,
                                                                                         block + 3 * bb);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const __m256 f = _mm256_castps128_ps256(_mm_mul_ps(scale, _mm_loadu_ps(a.d + r * blocks + b)));
        const int8_t *q = a.q + r * a.K + b * BLOCK;
        offsets[r] = _mm_fmadd_ps(offset, _mm_loadu_ps(a.s + r * blocks + b), offsets[r]);
        acc[0][r].lo = nibble_pair_madd(acc[0][r].lo, u0, q, 0, f, 0);
        acc[1][r].lo = nibble_pair_madd(acc[1][r].lo, u1, q + 2 * BLOCK, 0, f, 2);
    }
}
#endif

/* The same as k_quant_rows for a 32-weight format: 8 blocks at a time with AVX-512, else two. */
ALWAYS_INLINE void pair_rows(const int type, const Activations a, const uint8_t *w, int64_t row_bytes,
                             int64_t n_begin, int64_t n_end, const Output *o, int64_t r0, const int R) {
    const int64_t blocks = a.K / BLOCK;
    for (int64_t n = n_begin; n < n_end; n++) {
        const uint8_t *row = w + n * row_bytes;
        Floats acc[2][MAX_ROWS]; /* two chains per row */
        __m128 offsets[MAX_ROWS];
        __m256 chunk_offsets[MAX_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            acc[0][r] = acc[1][r] = fzero();
            offsets[r] = _mm_setzero_ps();
            chunk_offsets[r] = _mm256_setzero_ps();
        }
        int64_t b = 0;
#ifdef WIDE
        for (; b + 8 <= blocks; b += 8) chunk_step(type, a, row, b, acc, chunk_offsets, R);
#endif
        for (; b + 4 <= blocks; b += 4) {
            prefetch_ahead(row + b * block_bytes(type), 4 * block_bytes(type));
#ifndef WIDE
            if (type != Q8_0) {
                quad_step(type, a, row, b, acc, offsets, R);
                continue;
            }
#endif
            pair_step(type, a, row, b, acc[0], offsets, R, 0);
            pair_step(type, a, row, b + 2, acc[1], offsets, R, 0);
        }
        if (b + 2 <= blocks) pair_step(type, a, row, b, acc[0], offsets, R, 0), b += 2;
        if (b < blocks) pair_step(type, a, row, b, acc[1], offsets, R, 1);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m128 sum = _mm_add_ps(_mm_add_ps(offsets[r], _mm256_castps256_ps128(chunk_offsets[r])),
                                          _mm256_extractf128_ps(chunk_offsets[r], 1));
            const float offset = _mm_cvtss_f32(_mm_hadd_ps(_mm_hadd_ps(sum, sum), sum));
            put(o, r0 + r, n, fsum(fadd(acc[0][r], acc[1][r])) + offset);
        }
    }
}

/* The rows [begin, end) of part p of a fused layer that fall in [n_begin, n_end), and where its row n (numbered
 * in the whole output) lies; 0 where none fall. */
static int part_span(const uint8_t *const *parts, const int64_t *part_rows, int64_t p, int64_t first, int64_t row_bytes,
                     int64_t n_begin, int64_t n_end, int64_t *begin, int64_t *end, const uint8_t **w) {
    *begin = n_begin > first ? n_begin : first;
    *end = n_end < first + part_rows[p] ? n_end : first + part_rows[p];
    *w = parts[p] - first * row_bytes;
    return *begin < *end;
}

/* ------------------------------------------------------------------------------------------------ threads */

/* A decode step calls these kernels about 4 times a layer for each token, each call worth 0.1 to 1 ms on 2 cores;
 * handing shares of one to a Python thread pool cost ~30 us (the GIL's hand-offs). So the shares run here: the
 * caller takes the first, workers sleeping on a futex the others. They do not spin between calls: on a busy
 * machine a spinning thread took the core its partner needed (a 2-thread call went from ~25 to ~200 us). */
#define MAX_THREADS 64

typedef int (*ShareFn)(const void *args, int64_t begin, int64_t end);

static struct {
    pthread_mutex_t call; /* one job at a time */
    int workers, shares, fork_handler;
    _Atomic uint32_t generation, finished; /* jobs posted; workers done with this one */
    _Atomic int failed;
    ShareFn fn;
    const void *args;
    int64_t begin, end;
} pool = {.call = PTHREAD_MUTEX_INITIALIZER};

#ifdef __linux__
static void futex_wake(_Atomic uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }
static void futex_wait(_Atomic uint32_t *word, uint32_t seen) {
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
}
#else /* no futex: the waiting thread yields until the word changes */
static void futex_wake(_Atomic uint32_t *word) { (void)word; }
static void futex_wait(_Atomic uint32_t *word, uint32_t seen) { (void)word, (void)seen, sched_yield(); }
#endif

/* Waits until *word is no longer `seen` and returns it. */
static uint32_t await_change(_Atomic uint32_t *word, uint32_t seen) {
    uint32_t value;
    while ((value = atomic_load(word)) == seen) futex_wait(word, seen);
    return value;
}

static int64_t share_begin(int i) { /* share i of the job's rows: from here to share i + 1's (multiples of 8) */
    return i >= pool.shares ? pool.end : pool.begin + (pool.end - pool.begin) * i / pool.shares / 8 * 8;
}

static void *worker(void *start) { /* start: its index (upper 32 bits) and the job count when it was made */
    const int index = (int)((uintptr_t)start >> 32);
    uint32_t seen = (uint32_t)(uintptr_t)start;
    for (;;) {
        seen = await_change(&pool.generation, seen);
        if (index < pool.shares && pool.fn(pool.args, share_begin(index), share_begin(index + 1))) pool.failed = 1;
        if (atomic_fetch_add(&pool.finished, 1) + 1 == (uint32_t)pool.workers) futex_wake(&pool.finished);
    }
    return NULL;
}

static void forget_workers(void) { /* in a forked child, which has none of them */
    pool.workers = 0;
    pthread_mutex_init(&pool.call, NULL);
}

/* fn(args, begin, end) over [begin, end) in `shares` (at most MAX_THREADS, fewer where threads fail to start);
 * nonzero where a share returned nonzero. */
static int run_shares(ShareFn fn, const void *args, int64_t begin, int64_t end, int shares) {
    if (shares <= 1 || end - begin < 16) return fn(args, begin, end);
    pthread_mutex_lock(&pool.call);
    if (!pool.fork_handler) pool.fork_handler = !pthread_atfork(NULL, NULL, forget_workers);
    shares = shares < MAX_THREADS ? shares : MAX_THREADS;
    while (pool.workers < shares - 1) { /* worker i (from 1) takes share i; share 0 is the caller's */
        const uintptr_t start = (uintptr_t)(pool.workers + 1) << 32 | atomic_load(&pool.generation);
        pthread_t thread;
        if (pthread_create(&thread, NULL, worker, (void *)start)) break;
        pthread_detach(thread);
        pool.workers++;
    }
    pool.fn = fn, pool.args = args, pool.begin = begin, pool.end = end;
    pool.shares = shares < pool.workers + 1 ? shares : pool.workers + 1;
    pool.failed = 0;
    atomic_store(&pool.finished, 0);
    atomic_fetch_add(&pool.generation, 1);
    futex_wake(&pool.generation);
    int status = fn(args, share_begin(0), share_begin(1));
    for (uint32_t done; (done = atomic_load(&pool.finished)) != (uint32_t)pool.workers;)
        await_change(&pool.finished, done);
    status |= pool.failed;
    pthread_mutex_unlock(&pool.call);
    return status;
}

typedef struct { /* a call's arguments, for its shares */
    int type;
    const int8_t *q;
    const float *d, *s, *s16, *x;
    int64_t rows, K, x_stride, n_parts;
    const uint8_t *const *parts;
    const int64_t *part_rows;
    Output out;
} Linear;

static int linear_share(const void *args, int64_t n_begin, int64_t n_end) {
    const Linear *l = args;
    const int type = l->type;
    const int8_t *q = l->q;
    const float *d = l->d, *s = l->s, *s16 = l->s16;
    const int64_t rows = l->rows, K = l->K, n_parts = l->n_parts;
    const uint8_t *const *parts = l->parts;
    const int64_t *part_rows = l->part_rows;
    const Output *o = &l->out;
    const int64_t row_bytes = row_size(type, K), blocks = K / BLOCK;
    int64_t first = 0; /* the output index of the part's first row */
    for (int64_t p = 0; p < n_parts; first += part_rows[p], p++) {
        int64_t begin, end;
        const uint8_t *w;
        if (!part_span(parts, part_rows, p, first, row_bytes, n_begin, n_end, &begin, &end, &w)) continue;
        for (int64_t r = 0; r < rows; r += MAX_ROWS) {
            const Activations a = {q + r * K, d + r * blocks, s + r * blocks, s16 + r * 2 * blocks, K};
            const int64_t take = rows - r < MAX_ROWS ? rows - r : MAX_ROWS; /* this pass's rows */
#define CASE(T, R) (is_k_quant(T) ? k_quant_rows(T, a, w, row_bytes, begin, end, o, r, R) \
                                  : pair_rows(T, a, w, row_bytes, begin, end, o, r, R))
#define ROWS(T)                                                                                                   \
    do {                                                                                                          \
        if (MAX_ROWS >= 4 && take == 4) CASE(T, 4);                                                               \
        else if (MAX_ROWS >= 3 && take == 3) CASE(T, 3);                                                          \
        else if (MAX_ROWS >= 2 && take == 2) CASE(T, 2);                                                          \
        else CASE(T, 1);                                                                                          \
    } while (0)
            switch (type) { /* the type a constant in each copy: the block's decoding folds into straight code */
                case Q4_0: ROWS(Q4_0); break;
                case Q4_1: ROWS(Q4_1); break;
                case Q5_0: ROWS(Q5_0); break;
                case Q5_1: ROWS(Q5_1); break;
                case Q8_0: ROWS(Q8_0); break;
                case Q2_K: ROWS(Q2_K); break;
                case Q3_K: ROWS(Q3_K); break;
                case Q4_K: ROWS(Q4_K); break;
                case Q5_K: ROWS(Q5_K); break;
                default: ROWS(Q6_K); break;
            }
#undef ROWS
#undef CASE
        }
    }
    return 0;
}

/* y: fp32 rows, or bf16 where y_bf16, y_stride elements apart; output n in column columns[n] (NULL: n). */
int gguf_linear(int type, const int8_t *q, const float *d, const float *s, const float *s16, int64_t rows,
                int64_t K, const uint8_t *const *parts, const int64_t *part_rows, int64_t n_parts, int64_t n_begin,
                int64_t n_end, void *y, int64_t y_stride, int y_bf16, const int64_t *columns, int threads) {
    if (!block_bytes(type) || K % block_weights(type)) return 1;
    const Linear l = {.type = type, .q = q, .d = d, .s = s, .s16 = s16, .rows = rows, .K = K, .parts = parts,
                      .part_rows = part_rows, .n_parts = n_parts, .out = {y, y_stride, y_bf16 != 0, columns}};
    return run_shares(linear_share, &l, n_begin, n_end, threads);
}

/* gguf_linear on rows of x (fp32, or bf16 where x_bf16), quantized here first: a decode step's layer in one call. */
int gguf_linear_x(int type, const void *x, int x_bf16, int64_t x_stride, int64_t rows, int64_t K,
                  const uint8_t *const *parts, const int64_t *part_rows, int64_t n_parts, int64_t n_begin,
                  int64_t n_end, void *y, int64_t y_stride, int y_bf16, const int64_t *columns, int threads) {
    if (!block_bytes(type) || K % block_weights(type)) return 1;
    const int64_t blocks = rows * (K / BLOCK);
    char *scratch = malloc(blocks * (BLOCK + 4 * sizeof(float)));
    if (!scratch) return 1;
    float *d = (float *)scratch, *s = d + blocks, *s16 = s + blocks;
    int8_t *q = (int8_t *)(s16 + 2 * blocks);
    quantize_rows(x, x_bf16, rows, x_stride, K, q, d, s, s16);
    const int status = gguf_linear(type, q, d, s, s16, rows, K, parts, part_rows, n_parts, n_begin, n_end, y,
                                   y_stride, y_bf16, columns, threads);
    free(scratch);
    return status;
}

/* fp16 weights (row n at w + n * 2K bytes) against fp32 rows of x. */
ALWAYS_INLINE void f16_rows(const float *x, int64_t x_stride, int64_t K, const uint8_t *w, int64_t n_begin,
                            int64_t n_end, const Output *o, int64_t r0, const int R) {
    for (int64_t n = n_begin; n < n_end; n++) {
        const uint8_t *row = w + n * 2 * K;
        Floats acc[MAX_ROWS][2];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = fzero();
        int64_t k = 0;
        for (; k + 32 <= K; k += 32) {
            const Floats w0 = halves16(row + 2 * k), w1 = halves16(row + 2 * k + 32);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) {
                acc[r][0] = fmadd(w0, fload(x + r * x_stride + k), acc[r][0]);
                acc[r][1] = fmadd(w1, fload(x + r * x_stride + k + 16), acc[r][1]);
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            float sum = fsum(fadd(acc[r][0], acc[r][1]));
            for (int64_t j = k; j < K; j++) sum += half(row + 2 * j) * x[r * x_stride + j];
            put(o, r0 + r, n, sum);
        }
    }
}

static int f16_share(const void *args, int64_t n_begin, int64_t n_end) {
    const Linear *l = args;
    const int64_t K = l->K;
    int64_t first = 0;
    for (int64_t p = 0; p < l->n_parts; first += l->part_rows[p], p++) {
        int64_t begin, end;
        const uint8_t *w;
        if (!part_span(l->parts, l->part_rows, p, first, 2 * K, n_begin, n_end, &begin, &end, &w)) continue;
        for (int64_t r = 0; r < l->rows; r += MAX_ROWS) {
            const int64_t take = l->rows - r < MAX_ROWS ? l->rows - r : MAX_ROWS, x_stride = l->x_stride;
            const float *xr = l->x + r * x_stride;
            const Output *o = &l->out;
            if (MAX_ROWS >= 4 && take == 4) f16_rows(xr, x_stride, K, w, begin, end, o, r, 4);
            else if (MAX_ROWS >= 3 && take == 3) f16_rows(xr, x_stride, K, w, begin, end, o, r, 3);
            else if (MAX_ROWS >= 2 && take == 2) f16_rows(xr, x_stride, K, w, begin, end, o, r, 2);
            else f16_rows(xr, x_stride, K, w, begin, end, o, r, 1);
        }
    }
    return 0;
}

int gguf_linear_f16(const float *x, int64_t rows, int64_t x_stride, int64_t K, const uint8_t *const *parts,
                    const int64_t *part_rows, int64_t n_parts, int64_t n_begin, int64_t n_end, void *y,
                    int64_t y_stride, int y_bf16, const int64_t *columns, int threads) {
    const Linear l = {.x = x, .rows = rows, .x_stride = x_stride, .K = K, .parts = parts, .part_rows = part_rows,
                      .n_parts = n_parts, .out = {y, y_stride, y_bf16 != 0, columns}};
    return run_shares(f16_share, &l, n_begin, n_end, threads);
}

/* ------------------------------------------------------------------------------------------------ dequantize */

ALWAYS_INLINE void store16(float *out, Floats v) {
#ifdef WIDE
    _mm512_storeu_ps(out, v);
#else
    _mm256_storeu_ps(out, v.lo);
    _mm256_storeu_ps(out + 8, v.hi);
#endif
}

/* fp32 -> the upper 16 bits rounded to nearest, ties to even: bf16 as torch rounds it (the weights are finite) */
#ifdef WIDE
ALWAYS_INLINE void store16_bf16(uint16_t *out, Floats v) {
    const __m512i bits = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one); /* the kept part's last bit */
    const __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd);
    _mm256_storeu_si256((__m256i *)out, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16)));
}
#else
ALWAYS_INLINE __m256i bf16_bits(__m256 v) {
    const __m256i bits = _mm256_castps_si256(v), one = _mm256_set1_epi32(1);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    const __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd);
    return _mm256_srli_epi32(_mm256_add_epi32(bits, bias), 16);
}
ALWAYS_INLINE void store16_bf16(uint16_t *out, Floats v) { /* packus interleaves the halves' 128-bit lanes */
    const __m256i packed = _mm256_packus_epi32(bf16_bits(v.lo), bf16_bits(v.hi));
    _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(packed, 0xd8));
}
#endif

/* 64 levels to fp32 (or bf16 from it), 16 at a time with their group's scale and offset: scale * u + offset,
 * rounded once. out: the first weight's place. */
ALWAYS_INLINE void store_levels(Bytes u, const float *scale, const float *offset, void *out, const int bf16) {
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) {
        const Floats v = fmadd(widen(bytes16(u, g), 0), fset1(scale[g]), fset1(offset[g]));
        if (bf16) store16_bf16((uint16_t *)out + 16 * g, v);
        else store16((float *)out + 16 * g, v);
    }
}

/* A K-quant super-block's scale and offset for each of its 16 groups of 16 weights: w = scale * u + offset. */
ALWAYS_INLINE void super_block_scales(int type, const uint8_t *block, float *scale, float *offset) {
    if (type == Q4_K || type == Q5_K) { /* d * sc_j, dmin * m_j per sub-block of 32, each to its two 16s */
        float g[16];
        store16(g, k_scales32(block));
        for (int i = 0; i < 16; i++) scale[i] = g[i / 2], offset[i] = -g[8 + i / 2];
    } else {
        const GroupScales g = k_scales(type, block);
        store16(scale, g.scale);
        store16(offset, g.offset);
    }
}

/* Blocks a and b of a 32-weight format: the scale and offset of each 16 weights (a's twice, then b's twice). */
ALWAYS_INLINE void pair_group_scales(int type, const uint8_t *a, const uint8_t *b, float *scale, float *offset) {
    __m128 s, o;
    pair_scales(type, a, b, &s, &o);
    _mm_storeu_ps(scale, _mm_unpacklo_ps(s, s));
    _mm_storeu_ps(offset, _mm_unpacklo_ps(o, o));
}

ALWAYS_INLINE void dequantize_rows(const int type, const uint8_t *w, int64_t row_bytes, int64_t row_begin,
                                   int64_t row_end, int64_t K, void *out, int64_t out_stride, const int bf16) {
    const int bytes = block_bytes(type), size = bf16 ? 2 : 4;
    for (int64_t n = row_begin; n < row_end; n++) {
        const uint8_t *row = w + n * row_bytes;
        char *o = (char *)out + (n - row_begin) * out_stride * size;
        if (is_k_quant(type)) {
            for (int64_t k = 0; k < K / SUPER; k++) {
                const uint8_t *block = row + k * bytes;
                float scale[16], offset[16];
                super_block_scales(type, block, scale, offset);
#pragma GCC unroll 4
                for (int p = 0; p < 4; p++)
                    store_levels(k_levels(type, block, p), scale + 4 * p, offset + 4 * p,
                                 o + (k * SUPER + 64 * p) * size, bf16);
            }
        } else {
            const int64_t blocks = K / BLOCK;
            for (int64_t b = 0; b < blocks; b += 2) {
                const uint8_t *first = row + b * bytes, *second = b + 1 < blocks ? first + bytes : first;
                float scale[4], offset[4];
                pair_group_scales(type, first, second, scale, offset);
                Bytes u = pair_levels(type, first, second);
                if (type == Q8_0 && !Q8_SHIFT) { /* signed levels: shifted here, to widen them as the others */
                    u = xor_bytes(u, 0x80);
                    for (int i = 0; i < 4; i++) offset[i] = -128.0f * scale[i];
                }
                if (b + 1 < blocks) {
                    store_levels(u, scale, offset, o + b * BLOCK * size, bf16);
                } else { /* a row's odd last block */
                    float tail[64];
                    store_levels(u, scale, offset, tail, bf16);
                    memcpy(o + b * BLOCK * size, tail, BLOCK * size);
                }
            }
        }
    }
}

typedef struct {
    int type, bf16;
    const uint8_t *w;
    int64_t row_bytes, row_begin, K, out_stride;
    void *out;
} Dequantize;

static int dequantize_share(const void *args, int64_t begin, int64_t end) {
    const Dequantize *a = args;
    char *out = (char *)a->out + (begin - a->row_begin) * a->out_stride * (a->bf16 ? 2 : 4);
#define DEQUANTIZE(T)                                                                                             \
    (a->bf16 ? dequantize_rows(T, a->w, a->row_bytes, begin, end, a->K, out, a->out_stride, 1)                   \
             : dequantize_rows(T, a->w, a->row_bytes, begin, end, a->K, out, a->out_stride, 0))
    switch (a->type) {
        case Q4_0: DEQUANTIZE(Q4_0); break;
        case Q4_1: DEQUANTIZE(Q4_1); break;
        case Q5_0: DEQUANTIZE(Q5_0); break;
        case Q5_1: DEQUANTIZE(Q5_1); break;
        case Q8_0: DEQUANTIZE(Q8_0); break;
        case Q2_K: DEQUANTIZE(Q2_K); break;
        case Q3_K: DEQUANTIZE(Q3_K); break;
        case Q4_K: DEQUANTIZE(Q4_K); break;
        case Q5_K: DEQUANTIZE(Q5_K); break;
        default: DEQUANTIZE(Q6_K); break;
    }
#undef DEQUANTIZE
    return 0;
}

/* out: fp32, or bf16 where out_bf16 (the fp32 value rounded to nearest even), rows out_stride elements apart. */
int gguf_dequantize(int type, const uint8_t *w, int64_t row_bytes, int64_t row_begin, int64_t row_end, int64_t K,
                    void *out, int64_t out_stride, int out_bf16, int threads) {
    if (!block_bytes(type) || K % block_weights(type) || row_bytes != row_size(type, K)) return 1;
    const Dequantize a = {.type = type, .bf16 = out_bf16 != 0, .w = w, .row_bytes = row_bytes, .row_begin = row_begin,
                          .K = K, .out_stride = out_stride, .out = out};
    return run_shares(dequantize_share, &a, row_begin, row_end, threads);
}

/* ------------------------------------------------------------------------------------------------ prompts */

/* Many rows (a prompt's) against a matrix of a quantized format. In fp32 the
 * dequantized slices' GEMM runs at the core's fp32 peak, which is below int8 products' (llama.cpp's prompts). So 8
 * weight rows at a time are laid out as a tile: per block of 32, register j holds weights 4j .. 4j + 3 of each of
 * the 8 rows, and 4 int8 activations broadcast against it give all 8 rows' partial sums in one maddubs (the
 * unpacking paid once for all the prompt's rows), widened and scaled once a block, or once a group of 16 for the
 * formats with a scale per 16 (Q2_K, Q3_K, Q6_K). The same products as gguf_linear's: the activations' int8
 * blocks. One thread of an AVX-512 EPYC, 512 rows, the 1B shape's three matrix shapes: 160-180 G products a second
 * built for AVX2 (Q4_0, Q4_K, Q5_K), 200-230 G with VNNI, against MKL's fp32 GEMM's 90-97 G either way. */
#define TILE 8   /* weight rows a tile */
#define TILE_X 4 /* activation rows a pass over a tile */

typedef struct { /* a block of 32 weights of 8 rows (lanes past the matrix's end: not read out) */
    uint8_t u[8][32]; /* [j][4r + i]: level of weight 4j + i of row r */
    float scale[2][TILE], offset[2][TILE]; /* row r's weights 16h .. 16h + 15: scale[h][r] * u + offset[h][r] */
} TileBlock;

static int per_16(int type) { return type == Q2_K || type == Q3_K || type == Q6_K; }

ALWAYS_INLINE void store_bytes(uint8_t *p, Bytes v) {
#ifdef WIDE
    _mm512_storeu_si512(p, v);
#else
    _mm256_storeu_si256((__m256i *)p, v.lo);
    _mm256_storeu_si256((__m256i *)(p + 32), v.hi);
#endif
}

/* Row r of a tile's block: its 32 levels in their places, the scale and offset of each 16. */
ALWAYS_INLINE void tile_place(TileBlock *t, int r, const uint8_t *levels, const float *scale, const float *offset) {
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) memcpy(&t->u[j][4 * r], levels + 4 * j, 4);
    t->scale[0][r] = scale[0], t->scale[1][r] = scale[1], t->offset[0][r] = offset[0], t->offset[1][r] = offset[1];
}

/* Rows n .. n + count - 1 (count <= 8) of the matrix as tiles[K / 32]. */
ALWAYS_INLINE void tile_rows(const int type, const uint8_t *w, int64_t row_bytes, int64_t n, int count, int64_t K,
                             TileBlock *tiles) {
    const int64_t blocks = K / BLOCK;
    for (int r = 0; r < count; r++) {
        const uint8_t *row = w + (n + r) * row_bytes;
        uint8_t levels[64];
        if (is_k_quant(type)) {
            for (int64_t k = 0; k < K / SUPER; k++) {
                const uint8_t *block = row + k * block_bytes(type);
                float scale[16], offset[16];
                super_block_scales(type, block, scale, offset);
#pragma GCC unroll 4
                for (int p = 0; p < 4; p++) {
                    store_bytes(levels, k_levels(type, block, p));
                    tile_place(tiles + 8 * k + 2 * p, r, levels, scale + 4 * p, offset + 4 * p);
                    tile_place(tiles + 8 * k + 2 * p + 1, r, levels + 32, scale + 4 * p + 2, offset + 4 * p + 2);
                }
            }
            continue;
        }
        for (int64_t b = 0; b < blocks; b += 2) {
            const uint8_t *first = row + b * block_bytes(type), *second = b + 1 < blocks ? first + block_bytes(type)
                                                                                           : first;
            float scale[4], offset[4];
            pair_group_scales(type, first, second, scale, offset);
            store_bytes(levels, pair_levels(type, first, second));
            tile_place(tiles + b, r, levels, scale, offset);
            if (b + 1 < blocks) tile_place(tiles + b + 1, r, levels + 32, scale + 2, offset + 2);
        }
    }
}

/* sum + u * q over 4-byte groups (int32 lanes), or as int16 pairs where the CPU has no VNNI (the caller widens).
 * Q8_0's levels: with VNNI q + 128 (Q8_SHIFT) in dpbusd's 32-bit sums; without, signed (`signed8`), as maddubs'
 * 16-bit pairs would overflow on q + 128: u = |w|, sign = w, and q takes w's sign (128 * 127 * 2 fits 16 bits,
 * twice that not: the caller widens at every step). Kept to AVX2, one thread, 512 rows: 106-110 G products a
 * second, 1.15x the fp32 GEMM (16-bit levels through madd ran 0.83x). */
ALWAYS_INLINE __m256i tile_dot(__m256i sum, __m256i u, __m256i sign, const int signed8, const int8_t *q) {
    int32_t four;
    memcpy(&four, q, 4);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    (void)sign, (void)signed8;
    return _mm256_dpbusd_epi32(sum, u, _mm256_set1_epi32(four));
#elif defined(__AVXVNNI__)
    (void)sign, (void)signed8;
    return _mm256_dpbusd_avx_epi32(sum, u, _mm256_set1_epi32(four));
#else
    const __m256i qs = signed8 ? _mm256_sign_epi8(_mm256_set1_epi32(four), sign) : _mm256_set1_epi32(four);
    return _mm256_add_epi16(sum, _mm256_maddubs_epi16(u, qs));
#endif
}

/* Activation rows 0 .. X - 1 of `a` against a tile: acc[x] lane r = output of weight row r. `step` j's int16 sums
 * are widened at a time without VNNI: 4 (4 * 2 * 31 * 127 fits; a whole block's fit 4-bit levels only, and ran 10%
 * slower: one longer chain of additions), 2 for 6-bit levels (2 * 2 * 63 * 127), 1 for Q8_0's (`signed8`: its
 * signed levels, tile_dot). Each 16's sums are scaled on their own where `per16`. */
ALWAYS_INLINE void tile_product(const TileBlock *tiles, const Activations a, const int X, const int per16,
                                const int step, const int signed8, __m256 *acc) {
    const int64_t K = a.K, blocks = K / BLOCK;
#pragma GCC unroll 4
    for (int x = 0; x < X; x++) acc[x] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        const TileBlock *t = tiles + b;
        __m256i sums[2][TILE_X]; /* per 16 */
#pragma GCC unroll 2
        for (int h = 0; h < 2; h++) {
#pragma GCC unroll 4
            for (int x = 0; x < X; x++) sums[h][x] = _mm256_setzero_si256();
#pragma GCC unroll 2
            for (int j0 = 4 * h; j0 < 4 * h + 4; j0 += step) {
                __m256i part[TILE_X];
#pragma GCC unroll 4
                for (int x = 0; x < X; x++) part[x] = _mm256_setzero_si256();
#pragma GCC unroll 4
                for (int j = j0; j < j0 + step; j++) {
                    const __m256i w = _mm256_loadu_si256((const __m256i *)t->u[j]);
                    const __m256i u = signed8 ? _mm256_sign_epi8(w, w) : w;
#pragma GCC unroll 4
                    for (int x = 0; x < X; x++)
                        part[x] = tile_dot(part[x], u, w, signed8, a.q + x * K + b * BLOCK + 4 * j);
                }
#pragma GCC unroll 4
                for (int x = 0; x < X; x++)
#ifdef VNNI
                    sums[h][x] = _mm256_add_epi32(sums[h][x], part[x]);
#else
                    sums[h][x] = _mm256_add_epi32(sums[h][x], _mm256_madd_epi16(part[x], _mm256_set1_epi16(1)));
#endif
            }
        }
        for (int h = 0; h < (per16 ? 2 : 1); h++) {
            const __m256 scale = _mm256_loadu_ps(t->scale[h]), offset = _mm256_loadu_ps(t->offset[h]);
#pragma GCC unroll 4
            for (int x = 0; x < X; x++) {
                const __m256i sum = per16 ? sums[h][x] : _mm256_add_epi32(sums[0][x], sums[1][x]);
                const float *s = per16 ? a.s16 + x * 2 * blocks + 2 * b + h : a.s + x * blocks + b;
                const __m256 factor = _mm256_mul_ps(scale, _mm256_broadcast_ss(a.d + x * blocks + b));
                acc[x] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), factor, acc[x]);
                acc[x] = _mm256_fmadd_ps(offset, _mm256_broadcast_ss(s), acc[x]);
            }
        }
    }
}

typedef struct {
    int type;
    Activations a;
    int64_t rows;
    const uint8_t *w;
    Output out;
} Prompt;

static int prompt_share(const void *args, int64_t n_begin, int64_t n_end) {
    const Prompt *p = args;
    const int type = p->type;
    const int64_t K = p->a.K, blocks = K / BLOCK, row_bytes = row_size(type, K);
    /* 10 bytes an input (80 KiB for K = 8192): in L2. Zeros at first: a last tile's unused lanes hold numbers */
    TileBlock *tiles = calloc(blocks, sizeof(TileBlock));
    if (!tiles) return 1;
    const Output *o = &p->out;
    const int direct = !o->bf16 && !o->columns;
    for (int64_t n = n_begin; n < n_end; n += TILE) {
        const int count = n_end - n < TILE ? (int)(n_end - n) : TILE;
        switch (type) { /* the type a constant in each copy */
            case Q8_0: tile_rows(Q8_0, p->w, row_bytes, n, count, K, tiles); break;
            case Q4_0: tile_rows(Q4_0, p->w, row_bytes, n, count, K, tiles); break;
            case Q4_1: tile_rows(Q4_1, p->w, row_bytes, n, count, K, tiles); break;
            case Q5_0: tile_rows(Q5_0, p->w, row_bytes, n, count, K, tiles); break;
            case Q5_1: tile_rows(Q5_1, p->w, row_bytes, n, count, K, tiles); break;
            case Q2_K: tile_rows(Q2_K, p->w, row_bytes, n, count, K, tiles); break;
            case Q3_K: tile_rows(Q3_K, p->w, row_bytes, n, count, K, tiles); break;
            case Q4_K: tile_rows(Q4_K, p->w, row_bytes, n, count, K, tiles); break;
            case Q5_K: tile_rows(Q5_K, p->w, row_bytes, n, count, K, tiles); break;
            default: tile_rows(Q6_K, p->w, row_bytes, n, count, K, tiles); break;
        }
        for (int64_t x = 0; x < p->rows; x += TILE_X) {
            const Activations a = {p->a.q + x * K, p->a.d + x * blocks, p->a.s + x * blocks,
                                   p->a.s16 + x * 2 * blocks, K};
            const int take = p->rows - x < TILE_X ? (int)(p->rows - x) : TILE_X;
            __m256 acc[TILE_X];
#define PRODUCT(X) (type == Q6_K ? tile_product(tiles, a, X, 1, 2, 0, acc)                                       \
                    : type == Q8_0 && !Q8_SHIFT ? tile_product(tiles, a, X, 0, 1, 1, acc)                         \
                    : per_16(type) ? tile_product(tiles, a, X, 1, 4, 0, acc) : tile_product(tiles, a, X, 0, 4, 0, acc))
            if (take == 4) PRODUCT(4);
            else if (take == 3) PRODUCT(3);
            else if (take == 2) PRODUCT(2);
            else PRODUCT(1);
#undef PRODUCT
            for (int i = 0; i < take; i++) {
                if (direct && count == TILE) {
                    _mm256_storeu_ps((float *)o->y + (x + i) * o->stride + n, acc[i]);
                    continue;
                }
                float v[TILE];
                _mm256_storeu_ps(v, acc[i]);
                for (int r = 0; r < count; r++) put(o, x + i, n + r, v[r]);
            }
        }
    }
    free(tiles);
    return 0;
}

/* y = the activations' int8 blocks (gguf_quantize_rows) times the matrix (N rows at w) for a prompt's rows, in
 * fp32 or bf16 rows y_stride elements apart, output n in column columns[n] (NULL: n). Types: the quantized ones. */
int gguf_prompt_linear(int type, const int8_t *q, const float *d, const float *s, const float *s16, int64_t rows,
                       int64_t K, const uint8_t *w, int64_t N, void *y, int64_t y_stride, int y_bf16,
                       const int64_t *columns, int threads) {
    if (!block_bytes(type) || K % block_weights(type) || K <= 0) return 1;
    const Prompt p = {.type = type, .a = {q, d, s, s16, K}, .rows = rows, .w = w,
                      .out = {y, y_stride, y_bf16 != 0, columns}};
    return run_shares(prompt_share, &p, 0, N, threads);
}
