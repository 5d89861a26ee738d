/* A whole decode step of a llama-family model's layers in one call, for one sequence and one token on a CPU, fp32
 * activations (kernels/cpu_decode.py has the Python side; the reference is the model's own per-layer code in
 * model/llama.py, which the tests compare against).
 *
 * Why: with the quantized linear kernels and the decode attention kernel in C, a step of the default model at 4K
 * context still spent about a third of its time in the ~40 small torch operations and Python calls around them in
 * each of its 30 layers (RMSNorm, RoPE, cache writes, dtype conversions, SiLU, residual adds). Here those run in
 * plain C between the kernels, which are called through the function pointers the caller passes (the kernels live
 * in their own libraries, cpu_linear.c, gguf_blocks.c and cpu_attention.c, each with its own tests). A linear is
 * either a decode copy (cpu_linear's int4/int8 layouts) or a GGUF file's own blocks (gguf_blocks.c: each thread
 * rounds its copy of the layer's input to int8 blocks, then computes its share of each run of matrices).
 *
 * Per layer, as model/llama.py's Block does it:
 *   h = rms_norm(x) * attention_norm;  qkv = wqkv(h);  q, k rotated (rotate-half RoPE at `position`);
 *   k, v written into the layer's cache row `position` (rounded to bf16 for a bf16 cache, q too: the decode
 *   kernel reads q in the cache's dtype); x += wo(attention(q, cache rows 0..position));
 *   h = rms_norm(x) * ffn_norm;  gate, up = w13(h);  x += w2(silu(gate) * up).
 */
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Matrices of one GGUF block type (or F16) whose output rows follow one another, as gguf_blocks.c takes them. */
typedef struct {
    const uint8_t *const *parts;
    const int64_t *part_rows;
    const int64_t *columns;  /* output row n goes to column columns[n]; NULL: column n */
    int64_t type, n_parts, rows;
} block_run;

/* One linear layer: a decode copy (kernels/cpu_linear.py's layouts) or the file's blocks. */
typedef struct {
    const void *weight;   /* int4: packed rows; int8: int8 rows; blocks: `runs` block_runs */
    const float *scales;  /* int8: one per output row; else NULL (int4: the scales sit in the rows) */
    const float *bias;    /* or NULL; by output column */
    int64_t out_features, in_features;
    int64_t bits;         /* 4 or 8; 0: the file's blocks */
    int64_t runs;
} linear_weights;

typedef struct {
    const float *attention_norm, *ffn_norm;
    linear_weights wqkv, wo, w13, w2;
} layer_weights;

#define MAX_THREADS 64

typedef int (*linear_int4_fn)(const float *, int64_t, int64_t, const uint8_t *, int64_t, int64_t, int64_t, float *,
                              int64_t);
typedef int (*linear_int8_fn)(const float *, int64_t, int64_t, const int8_t *, const float *, int64_t, int64_t,
                              int64_t, float *, int64_t);
typedef int (*decode_attention_fn)(const void *, const void *, const void *, const float *, void *, float *, int, int,
                                   int, int, int, int64_t, int64_t, int64_t, int64_t, float, const int64_t *,
                                   const float *, const float *, int64_t, float *);

typedef int (*gguf_linear_fn)(int, const int8_t *, const float *, const float *, const float *, int64_t, int64_t,
                              const uint8_t *const *, const int64_t *, int64_t, int64_t, int64_t, void *, int64_t,
                              int, const int64_t *, int);
typedef int (*gguf_linear_f16_fn)(const float *, int64_t, int64_t, int64_t, const uint8_t *const *, const int64_t *,
                                  int64_t, int64_t, int64_t, void *, int64_t, int, const int64_t *, int);
typedef int (*gguf_quantize_fn)(const float *, int64_t, int64_t, int64_t, int8_t *, float *, float *, float *);

typedef struct { /* NULL where a library did not build: the caller passes no layer that needs it */
    linear_int4_fn linear_int4;
    linear_int8_fn linear_int8;
    decode_attention_fn decode_attention;
    gguf_linear_fn gguf_linear;
    gguf_linear_f16_fn gguf_linear_f16;
    gguf_quantize_fn gguf_quantize;
} kernels;

#define GGUF_F16 1 /* ggml's type number of F16; the others are block types */
#define GGUF_BLOCK 32

/* A thread's copy of a linear's input in int8 blocks of 32 (gguf_blocks.c's activations). */
typedef struct {
    int8_t *q;
    float *d, *s, *s16;
} activation_blocks;

static void rms_norm(const float *x, const float *weight, int64_t n, float eps, float *out) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) sum += x[i] * x[i];
    const float scale = 1.0f / sqrtf(sum / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * scale * weight[i];
}

/* x * cos + rotate_half(x) * sin for each of `heads` vectors of `dim`, in place. */
static void rotate(float *x, int heads, int dim, const float *cos, const float *sin) {
    const int half = dim / 2;
    for (int h = 0; h < heads; h++, x += dim) {
        for (int i = 0; i < half; i++) {
            const float a = x[i], b = x[i + half];
            x[i] = a * cos[i] - b * sin[i];
            x[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

/* Round to nearest even, as torch converts; NaN stays NaN. */
static inline uint16_t to_bf16(float value) {
    uint32_t bits;
    memcpy(&bits, &value, 4);
    if ((bits & 0x7fffffff) > 0x7f800000) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

static inline float from_bf16(uint16_t half) {
    uint32_t bits = (uint32_t)half << 16;
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

/* Stores n values into a cache row (element_size 2: bf16, 4: fp32). */
static void store(const float *x, int64_t n, void *row, int element_size) {
    if (element_size == 4) {
        memcpy(row, x, n * sizeof(float));
        return;
    }
    for (int64_t i = 0; i < n; i++) ((uint16_t *)row)[i] = to_bf16(x[i]);
}

/* A barrier for the step's threads: they spin (briefly, then yield), since the phases between barriers take tens
 * of microseconds and a sleep and wake-up would cost as much. */
typedef struct {
    atomic_int arrived, generation;
    int threads;
} barrier;

static void barrier_wait(barrier *b) {
    const int generation = atomic_load_explicit(&b->generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == b->threads - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&b->generation, 1, memory_order_release);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&b->generation, memory_order_acquire) == generation; spins++) {
        if (spins >= 1 << 10)
            sched_yield();
#if defined(__x86_64__) || defined(__i386__)
        else
            __builtin_ia32_pause();
#endif
    }
}

/* What the threads of one call share. Each thread keeps its own copy of the hidden state (all compute the same
 * values in the same order), and writes only its share of the shared buffers between two barriers. */
typedef struct {
    const layer_weights *layers;
    const kernels *f;
    int n_layers, dim, heads, kv_heads, head_dim, element_size, threads;
    int64_t ffn_dim, layer_stride, head_stride, position;
    float eps;
    const float *x_in, *cos, *sin;
    void *k_cache, *v_cache;
    float *x_out;
    float *wide;       /* qkv, then gate and up */
    float *attended;   /* (heads * head_dim,) the attention output, fp32 */
    uint16_t *q_bf16;  /* 2 * heads * head_dim: q, then the output, for a bf16 cache */
    float *y;          /* (dim,) wo's, then w2's output */
    barrier sync;
    atomic_int status, go;  /* go: the threads are all started and `threads` says how many */
} step;

typedef struct {
    step *s;
    int thread;
} worker;

/* This thread's share [first, end) of n outputs, in multiples of 8 (whole vectors). */
static void share(int64_t n, int thread, int threads, int64_t *first, int64_t *end) {
    *first = n * thread / threads / 8 * 8;
    *end = thread == threads - 1 ? n : n * (thread + 1) / threads / 8 * 8;
}

/* This thread's share of each run of a linear on the file's blocks, its input rounded to int8 blocks here. */
static int blocks_share(const kernels *f, const linear_weights *w, const float *x, float *y, int thread, int threads,
                        const activation_blocks *a) {
    const block_run *runs = w->weight;
    const int64_t K = w->in_features;
    int status = 0, quantized = 0;
    for (int64_t r = 0; r < w->runs; r++) {
        const block_run *run = &runs[r];
        int64_t first, end;
        share(run->rows, thread, threads, &first, &end);
        if (first >= end) continue;
        if (run->type == GGUF_F16) {
            status |= f->gguf_linear_f16(x, 1, K, K, run->parts, run->part_rows, run->n_parts, first, end, y, 0, 0,
                                         run->columns, 1);
        } else {
            if (!quantized) {
                status |= f->gguf_quantize(x, 1, K, K, a->q, a->d, a->s, a->s16);
                quantized = 1;
            }
            status |= f->gguf_linear((int)run->type, a->q, a->d, a->s, a->s16, 1, K, run->parts, run->part_rows,
                                     run->n_parts, first, end, y, 0, 0, run->columns, 1);
        }
        if (w->bias)
            for (int64_t n = first; n < end; n++) {
                const int64_t column = run->columns ? run->columns[n] : n;
                y[column] += w->bias[column];
            }
    }
    return status;
}

static int linear_share(const kernels *f, const linear_weights *w, const float *x, float *y, int thread,
                        int threads, const activation_blocks *a) {
    if (w->bits == 0) return blocks_share(f, w, x, y, thread, threads, a);
    int64_t first, end;
    share(w->out_features, thread, threads, &first, &end);
    if (first >= end) return 0;
    int status = w->bits == 4
        ? f->linear_int4(x, 1, w->in_features, (const uint8_t *)w->weight, first, end, w->in_features, y,
                         w->out_features)
        : f->linear_int8(x, 1, w->in_features, (const int8_t *)w->weight, w->scales, first, end, w->in_features, y,
                         w->out_features);
    if (w->bias)
        for (int64_t i = first; i < end; i++) y[i] += w->bias[i];
    return status;
}

/* The layers, as thread `thread` of s->threads runs them: the linears split by output rows, attention by KV head. */
static void *run_layers(void *argument) {
    const worker *me = argument;
    step *s = me->s;
    while (!atomic_load_explicit(&s->go, memory_order_acquire)) sched_yield();
    const int t = me->thread, T = s->threads, D = s->head_dim, group = s->heads / s->kv_heads;
    const int64_t q_dim = (int64_t)s->heads * D, kv_dim = (int64_t)s->kv_heads * D, ffn = s->ffn_dim;
    /* x, h, act, then the widest input in int8 blocks: d, s, s16 (a float per 32, 32, 16 inputs) and q */
    const int64_t wider = ffn > q_dim ? ffn : q_dim, widest = wider > s->dim ? wider : s->dim;
    const int64_t blocks = widest / GGUF_BLOCK;
    float *x = malloc(sizeof(float) * (2 * s->dim + ffn + 4 * blocks) + widest);
    activation_blocks a = {0};
    float *h = NULL, *act = NULL;
    if (x) {
        memcpy(x, s->x_in, sizeof(float) * s->dim);
        h = x + s->dim, act = h + s->dim;
        a = (activation_blocks){(int8_t *)(act + ffn + 4 * blocks), act + ffn, act + ffn + blocks,
                                act + ffn + 2 * blocks};
    } else {
        atomic_store(&s->status, -1);  /* still takes part in every barrier, computing nothing */
    }
    int g0 = (int)((int64_t)s->kv_heads * t / T), g1 = (int)((int64_t)s->kv_heads * (t + 1) / T);
    const float scale = 1.0f / sqrtf((float)D);
    for (int l = 0; l < s->n_layers; l++) {
        const layer_weights *w = &s->layers[l];
        int status = 0;
        if (x) {
            if (l > 0)
                for (int i = 0; i < s->dim; i++) x[i] += s->y[i];  /* the previous layer's w2 */
            rms_norm(x, w->attention_norm, s->dim, s->eps, h);
            status |= linear_share(s->f, &w->wqkv, h, s->wide, t, T, &a);
        }
        barrier_wait(&s->sync);
        if (x && g0 < g1) {  /* this thread's KV heads and their query heads */
            float *q = s->wide + (int64_t)g0 * group * D, *k = s->wide + q_dim, *v = k + kv_dim;
            rotate(q, (g1 - g0) * group, D, s->cos, s->sin);
            rotate(k + (int64_t)g0 * D, g1 - g0, D, s->cos, s->sin);
            const int size = s->element_size;
            char *k_layer = (char *)s->k_cache + l * s->layer_stride * size;
            char *v_layer = (char *)s->v_cache + l * s->layer_stride * size;
            for (int g = g0; g < g1; g++) {
                const int64_t at = (g * s->head_stride + s->position * D) * size;
                store(k + (int64_t)g * D, D, k_layer + at, size);
                store(v + (int64_t)g * D, D, v_layer + at, size);
            }
            const int64_t first = (int64_t)g0 * group * D, count = (int64_t)(g1 - g0) * group * D;
            const void *q_in = q;
            void *out = s->attended + first;
            if (size == 2) {  /* the kernel reads q in the cache's dtype */
                store(q, count, s->q_bf16 + first, 2);
                q_in = s->q_bf16 + first, out = s->q_bf16 + q_dim + first;
            }
            status |= s->f->decode_attention(q_in, k_layer + g0 * s->head_stride * size,
                                             v_layer + g0 * s->head_stride * size, NULL, out, NULL, size, 1, g1 - g0,
                                             group, D, s->position + 1, 0, s->head_stride, D, scale, NULL, NULL, NULL,
                                             0, NULL);
            if (size == 2)
                for (int64_t i = 0; i < count; i++) s->attended[first + i] = from_bf16(s->q_bf16[q_dim + first + i]);
        }
        barrier_wait(&s->sync);
        if (x) status |= linear_share(s->f, &w->wo, s->attended, s->y, t, T, &a);
        barrier_wait(&s->sync);
        if (x) {
            for (int i = 0; i < s->dim; i++) x[i] += s->y[i];
            rms_norm(x, w->ffn_norm, s->dim, s->eps, h);
            status |= linear_share(s->f, &w->w13, h, s->wide, t, T, &a);
        }
        barrier_wait(&s->sync);  /* also: every thread has read y before w2 overwrites it */
        if (x) {
            for (int64_t i = 0; i < ffn; i++) {
                const float gate = s->wide[i];
                act[i] = gate / (1.0f + expf(-gate)) * s->wide[ffn + i];
            }
            status |= linear_share(s->f, &w->w2, act, s->y, t, T, &a);
        }
        barrier_wait(&s->sync);  /* also: every thread has read wide before the next qkv overwrites it */
        if (status) atomic_store(&s->status, -1);
    }
    if (x && t == 0) {
        if (s->n_layers > 0)
            for (int i = 0; i < s->dim; i++) x[i] += s->y[i];
        memcpy(s->x_out, x, sizeof(float) * s->dim);
    }
    free(x);
    return NULL;
}

/* x: (dim,) the token's hidden state, updated in place through all n_layers. cos, sin: (head_dim,) fp32 RoPE at
 * `position`. k_cache, v_cache: the cache's layer 0, batch row 0, element_size bytes per value; layer_stride and
 * head_stride in elements, tokens dim-contiguous (head_dim apart). threads: how many run it (the caller's thread
 * and threads - 1 started here). Returns 0, or -1 when a kernel refused its arguments or memory or threads could
 * not be had (x is then garbage: the caller raises). */
int decode_layers(const layer_weights *layers, int n_layers, const kernels *f, int dim, int heads, int kv_heads,
                  int head_dim, int64_t ffn_dim, float eps, float *x, const float *cos, const float *sin,
                  void *k_cache, void *v_cache, int element_size, int64_t layer_stride, int64_t head_stride,
                  int64_t position, int threads) {
    if (threads < 1 || threads > MAX_THREADS || kv_heads < 1 || heads % kv_heads ||
        (element_size != 2 && element_size != 4))
        return -1;
    const int64_t q_dim = (int64_t)heads * head_dim, kv_dim = (int64_t)kv_heads * head_dim;
    const int64_t widest = 2 * ffn_dim > q_dim + 2 * kv_dim ? 2 * ffn_dim : q_dim + 2 * kv_dim;
    float *shared = malloc(sizeof(float) * (widest + 2 * q_dim + dim));
    if (!shared) return -1;
    step s = {layers, f, n_layers, dim, heads, kv_heads, head_dim, element_size, threads, ffn_dim, layer_stride,
              head_stride, position, eps, x, cos, sin, k_cache, v_cache, x, shared, shared + widest,
              (uint16_t *)(shared + widest + q_dim), shared + widest + 2 * q_dim};
    atomic_init(&s.sync.arrived, 0);
    atomic_init(&s.sync.generation, 0);
    atomic_init(&s.status, 0);
    atomic_init(&s.go, 0);
    worker workers[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started = 1;
    for (; started < threads; started++) {
        workers[started] = (worker){&s, started};
        if (pthread_create(&ids[started], NULL, run_layers, &workers[started])) break;
    }
    s.sync.threads = s.threads = started;  /* fewer than asked if one could not start: the shares follow */
    atomic_store_explicit(&s.go, 1, memory_order_release);
    workers[0] = (worker){&s, 0};
    run_layers(&workers[0]);
    for (int i = 1; i < started; i++) pthread_join(ids[i], NULL);
    free(shared);
    return atomic_load(&s.status);
}
