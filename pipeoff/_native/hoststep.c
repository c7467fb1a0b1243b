/* pipeoff's host-step kernels: one pass over memory for each element-wise job of
 * full offload. Plain C99 with no torch headers, called through ctypes on
 * data_ptr() (ctypes releases the GIL), so it survives torch upgrades and needs
 * only a C compiler at first use (pipeoff/_native/__init__.py builds it).
 *
 *   pipeoff_adam_step   the AdamW/Adam update of master, m, v from an FP32 gradient
 *                       (optionally scaled by the clip coefficient), and the cast
 *                       of the new master into the compute dtype, in one pass;
 *   pipeoff_adam_fold_step  the same with the last micro-step's BF16 gradient folded
 *                       into the FP32 sum (or taken alone) inside the pass: the
 *                       final micro-step of full offload in one pass over memory;
 *   pipeoff_adam_step_norm  either of those, also taking the sum of squares of the
 *                       gradient inside the pass (the norm a one-pass step logs);
 *   pipeoff_sgd_step    torch's for-loop SGD step (momentum, dampening, Nesterov,
 *                       weight decay, maximize) in one pass: DiLoCo's outer step;
 *   pipeoff_adam_moments, pipeoff_adam_apply  torch's for-loop Adam/AdamW step in two
 *                       passes around torch's own sqrt: DiLoCo's outer Adam;
 *   pipeoff_fold        acc = grad (widened) or acc += grad, BF16 or FP32 grad;
 *   pipeoff_fold_norm   the same, taking torch's 2-norm of the sum as it goes (the
 *                       final fold, whose norm clipping needs before the step);
 *   pipeoff_scale       a[i] *= s in place (the benchmarks' bandwidth floor).
 *
 * Bitwise equality with torch's fused CPU Adam (aten FusedAdamKernel) rests on
 * using the same IEEE operations in the same order, with the fused multiply-adds
 * exactly where torch's binary has them and nowhere else (this file is built with
 * -ffp-contract=off; every fma is an explicit fmaf). Which fma placement torch's
 * binary has depends on its dispatch level, so the placement is an argument
 * (`fma`, a bit set of FMA_*), and pipeoff checks it against torch at first use.
 * The last `n % vec` elements of a tensor run torch's scalar tail loop, which
 * its compiler contracted differently from the vector body (`tail_fma`).
 *
 * Threads: each call is one parallel region over its tensor (never one per small
 * piece) whose chunks the threads claim one at a time, and nobody spins: a busy
 * host slows it, it does not stall it (see `parallel`).
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FMA_LERP 1      /* m = fma(coeff, g - m, base) */
#define FMA_SQ_V 2      /* v = fma(v, beta2, (c2 * g) * g) */
#define FMA_SQ_G 4      /* v = fma(c2 * g, g, v * beta2) */
#define FMA_WD 8        /* Adam's g = fma(p, wd, g) */

#define MIN_PER_THREAD (1 << 16)
#define CHUNK_MIN (1 << 14)
#define ALIGN 64
#define MAX_THREADS 256

typedef void (*range_fn)(void *arg, int64_t begin, int64_t end);

/* One parallel region: [0, n) in chunks that the caller and up to threads - 1
 * helpers claim one at a time. The caller returns once every chunk is done, not
 * once every helper has run: a helper the OS has not scheduled yet (a busy host)
 * finds no chunk left and exits, and the caller never waits for it. So a
 * descheduled thread costs at most the chunk it holds, not its whole share. The
 * region's bookkeeping is on the heap, freed by whoever leaves it last; `arg` is
 * the caller's and is touched only inside a claimed chunk. */
typedef struct {
    range_fn fn;
    void *arg;
    int64_t n, chunk, chunks;
    int64_t next;  /* atomic: the next chunk to claim */
    int64_t done;  /* atomic: chunks finished */
    int refs;      /* atomic: the caller and the helpers still inside */
    pthread_mutex_t lock;
    pthread_cond_t all_done;
} region_t;

static void region_leave(region_t *r) {
    if (__atomic_sub_fetch(&r->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        pthread_mutex_destroy(&r->lock);
        pthread_cond_destroy(&r->all_done);
        free(r);
    }
}

static void region_work(region_t *r) {
    for (;;) {
        int64_t c = __atomic_fetch_add(&r->next, 1, __ATOMIC_RELAXED);
        if (c >= r->chunks) return;
        int64_t b = c * r->chunk, e = b + r->chunk < r->n ? b + r->chunk : r->n;
        r->fn(r->arg, b, e);
        if (__atomic_add_fetch(&r->done, 1, __ATOMIC_ACQ_REL) == r->chunks) {
            pthread_mutex_lock(&r->lock);
            pthread_cond_broadcast(&r->all_done);
            pthread_mutex_unlock(&r->lock);
        }
    }
}

/* Start k - 1 detached helpers running helper(r); a helper that cannot be had is
 * given up through leave(r) (its share is done by the others). */
static void spawn_helpers(int k, void *(*helper)(void *), void *r, void (*leave)(void *)) {
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    for (int t = 1; t < k; t++) {
        pthread_t tid;
        if (pthread_create(&tid, &attr, helper, r) != 0) leave(r);
    }
    pthread_attr_destroy(&attr);
}

static void region_leave_any(void *r) { region_leave((region_t *)r); }

static void *region_helper(void *p) {
    region_t *r = (region_t *)p;
    region_work(r);
    region_leave(r);
    return NULL;
}

/* The threads a region of n elements uses (the caller is one of them). */
static int region_threads(int64_t n, int threads) {
    int k = threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads);
    int64_t most = n / MIN_PER_THREAD;
    if (most < k) k = most < 1 ? 1 : (int)most;
    return k;
}

/* Elements per chunk of a region of n elements over k > 1 threads: about 8 chunks
 * per thread, whole cache lines, at least CHUNK_MIN elements. */
static int64_t region_chunk(int64_t n, int k) {
    int64_t chunk = (n / (8 * (int64_t)k) + ALIGN - 1) / ALIGN * ALIGN;
    return chunk < CHUNK_MIN ? CHUNK_MIN : chunk;
}

/* fn over [0, n), with up to `threads` threads (the caller is one of them). */
static void parallel(range_fn fn, void *arg, int64_t n, int threads) {
    int k = region_threads(n, threads);
    region_t *r = k > 1 ? (region_t *)malloc(sizeof(region_t)) : NULL;
    if (r == NULL) {
        fn(arg, 0, n);
        return;
    }
    r->fn = fn;
    r->arg = arg;
    r->n = n;
    r->chunk = region_chunk(n, k);
    r->chunks = (n + r->chunk - 1) / r->chunk;
    r->next = 0;
    r->done = 0;
    r->refs = k;
    pthread_mutex_init(&r->lock, NULL);
    pthread_cond_init(&r->all_done, NULL);
    spawn_helpers(k, region_helper, r, region_leave_any);
    region_work(r);
    pthread_mutex_lock(&r->lock);
    while (__atomic_load_n(&r->done, __ATOMIC_ACQUIRE) < r->chunks)
        pthread_cond_wait(&r->all_done, &r->lock);
    pthread_mutex_unlock(&r->lock);
    region_leave(r);
}

/* FP32 -> BF16, round to nearest even; a NaN becomes `nan_bits`. */
static inline uint16_t to_bf16(float x, uint16_t nan_bits) {
    uint32_t u;
    memcpy(&u, &x, 4);
    uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return x != x ? nan_bits : r;
}

static inline __attribute__((always_inline)) void cast_bf16(const float *restrict x,
                                                            uint16_t *restrict out, int64_t n,
                                                            uint16_t nan_bits) {
    for (int64_t i = 0; i < n; i++) out[i] = to_bf16(x[i], nan_bits);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* ---------------------------------------------------------------- Adam/AdamW */

typedef struct {
    float *restrict p, *restrict m, *restrict v;
    const float *restrict g;
    const uint16_t *restrict g16;  /* the last BF16 gradient (gmode 1, 2) */
    int gmode;           /* the gradient: 0 g; 1 g16 widened; 2 g + g16 widened */
    void *restrict out;
    int out_kind;        /* 0 none, 1 BF16, 2 FP32 */
    uint16_t nan_bits;   /* BF16 bits of a NaN weight */
    int adam_wd;         /* Adam (not AdamW) with weight_decay != 0 */
    float scale;         /* g = g * scale: the clip coefficient, 1 without */
    float sign;          /* g = g * sign: -1 to maximize, 1 without */
    float wd;            /* Adam: float(weight_decay) */
    float decay;         /* AdamW: float(1 - lr * weight_decay), 1 without */
    float w1;            /* float(1 - beta1), the lerp weight */
    float beta2, c2;     /* float(beta2), float(1 - beta2) */
    float bc2_sqrt, eps, step_size;
    int fma, tail_fma;
    int64_t tail;        /* first element of torch's scalar tail loop */
} adam_args;

/* Elements [b, e). Multiplying by 1 is exact (signed zeros, infinities and NaNs
 * included), so the clip, maximize and AdamW-decay factors need no branch; the
 * arguments that change the instructions are compile-time constants in each
 * instance (ADAM_CASES), so that each is one vectorized loop. */
static inline __attribute__((always_inline)) void adam_loop(const adam_args *a, int64_t b,
                                                             int64_t e, int fma, int adam_wd,
                                                             int out_kind, int small,
                                                             int gmode) {
    float *restrict P = a->p, *restrict M = a->m, *restrict V = a->v;
    const float *restrict G = a->g;
    const uint16_t *restrict G16 = a->g16;
    uint16_t *restrict O16 = (uint16_t *)a->out;
    float *restrict O32 = (float *)a->out;
    const float scale = a->scale, sign = a->sign, wd = a->wd, decay = a->decay;
    const float beta2 = a->beta2, c2 = a->c2, bc2_sqrt = a->bc2_sqrt, eps = a->eps;
    const float step_size = a->step_size;
    const uint16_t nan_bits = a->nan_bits;
    /* torch's lerp: weight w below 0.5, m + w (g - m) (small == 1); else its vector
     * body's g + (w - 1)(g - m) (small == 0), or its scalar tail's g - (g - m)(1 - w)
     * (small == 2), which differ in the sign of a zero product when w is 1. */
    const float c = small == 1 ? a->w1 : (small == 2 ? -(1.0f - a->w1) : a->w1 - 1.0f);
    for (int64_t i = b; i < e; i++) {
        /* gmode 2 is the fold's acc + widen(grad), the same IEEE add */
        float g0 = gmode == 0 ? G[i] : (gmode == 1 ? from_bf16(G16[i])
                                                    : G[i] + from_bf16(G16[i]));
        float g = g0 * scale * sign;
        float p0 = P[i];
        float p = p0 * decay;
        float m = M[i];
        float v = V[i];
        if (adam_wd) g = (fma & FMA_WD) ? fmaf(p0, wd, g) : g + p0 * wd;
        float base = small == 1 ? m : g;
        m = (fma & FMA_LERP) ? fmaf(c, g - m, base) : base + c * (g - m);
        float cg = c2 * g;
        if (fma & FMA_SQ_V)
            v = fmaf(v, beta2, cg * g);
        else if (fma & FMA_SQ_G)
            v = fmaf(cg, g, v * beta2);
        else
            v = v * beta2 + cg * g;
        float denom = sqrtf(v) / bc2_sqrt + eps;
        p = p - (step_size * m) / denom;
        M[i] = m;
        V[i] = v;
        P[i] = p;
        if (out_kind == 1)
            O16[i] = to_bf16(p, nan_bits);
        else if (out_kind == 2)
            O32[i] = p;
    }
}

#define ADAM_LOOP(F, WD, OUT, SMALL, GM) adam_loop(a, b, e, F, WD, OUT, SMALL, GM)

/* BF16 weights: the step and the cast in tiles that stay in L1, so that each loop
 * vectorizes at its full width (a loop mixing 32- and 16-bit stores does not). */
#define TILE 2048
#define ADAM_BF16(F, WD, SMALL, GM)                                          \
    for (int64_t t0 = b, b0 = b, e0 = e; t0 < e0; t0 += TILE) {              \
        int64_t t1 = t0 + TILE < e0 ? t0 + TILE : e0;                        \
        adam_loop(a, t0, t1, F, WD, 0, SMALL, GM);                           \
        cast_bf16(a->p + t0, (uint16_t *)a->out + t0, t1 - t0, a->nan_bits); \
        (void)b0;                                                            \
    }

#define ADAM_OUTS_G(F, WD, SMALL, GM)                   \
    switch (a->out_kind) {                              \
    case 0: ADAM_LOOP(F, WD, 0, SMALL, GM); break;      \
    case 1: ADAM_BF16(F, WD, SMALL, GM); break;         \
    default: ADAM_LOOP(F, WD, 2, SMALL, GM); break;     \
    }

#define ADAM_OUTS(F, WD, SMALL)                         \
    switch (a->gmode) {                                 \
    case 0: ADAM_OUTS_G(F, WD, SMALL, 0) break;         \
    case 1: ADAM_OUTS_G(F, WD, SMALL, 1) break;         \
    default: ADAM_OUTS_G(F, WD, SMALL, 2) break;        \
    }

#define ADAM_CASES(F)                                   \
    do {                                                \
        int small = fabsf(a->w1) < 0.5f;                \
        if (a->adam_wd) {                               \
            if (small) { ADAM_OUTS(F, 1, 1) }           \
            else { ADAM_OUTS(F, 1, 0) }                 \
        } else {                                        \
            if (small) { ADAM_OUTS(F, 0, 1) }           \
            else { ADAM_OUTS(F, 0, 0) }                 \
        }                                               \
    } while (0)

/* torch's AVX2/AVX512 binary: the vector body's contractions. */
#define BODY_FUSED (FMA_LERP | FMA_SQ_G | FMA_WD)

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_X86_FMA 1
__attribute__((target("avx2,fma"))) static void adam_body_fused(const adam_args *a, int64_t b,
                                                                  int64_t e) {
    ADAM_CASES(BODY_FUSED);
}

/* The same math, 16 lanes wide (the bits do not depend on the width). */
#ifdef __clang__
#define WIDE512 __attribute__((target("avx512f,avx2,fma"), min_vector_width(512)))
#else
#define WIDE512 __attribute__((target("avx512f,avx2,fma,prefer-vector-width=512")))
#endif
WIDE512 static void adam_body_fused512(const adam_args *a, int64_t b, int64_t e) {
    ADAM_CASES(BODY_FUSED);
}
#endif

static void adam_body_plain(const adam_args *a, int64_t b, int64_t e) { ADAM_CASES(0); }

/* Any contraction set, branching per element (slow): the tail, and a body whose
 * contractions have no vectorized instance above. */
static void adam_generic(const adam_args *a, int64_t b, int64_t e, int f, int tail) {
    if (fabsf(a->w1) < 0.5f)
        ADAM_OUTS(f, a->adam_wd, 1)
    else if (tail)
        ADAM_OUTS(f, a->adam_wd, 2)
    else
        ADAM_OUTS(f, a->adam_wd, 0)
}

static int have_fma(void) {
#ifdef HAVE_X86_FMA
    return __builtin_cpu_supports("fma") && __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

static int have_avx512(void) {
#ifdef HAVE_X86_FMA
    return have_fma() && __builtin_cpu_supports("avx512f");
#else
    return 0;
#endif
}

static void adam_range(void *arg, int64_t b, int64_t e) {
    const adam_args *a = (const adam_args *)arg;
    int64_t mid = e < a->tail ? e : (b > a->tail ? b : a->tail);
    if (a->fma == 0) {
        adam_body_plain(a, b, mid);
#ifdef HAVE_X86_FMA
    } else if (a->fma == BODY_FUSED && have_avx512()) {
        adam_body_fused512(a, b, mid);
    } else if (a->fma == BODY_FUSED && have_fma()) {
        adam_body_fused(a, b, mid);
#endif
    } else {
        adam_generic(a, b, mid, a->fma, 0);
    }
    adam_generic(a, mid, e, a->tail_fma, 1);
}

/* One Adam/AdamW step of n elements (see adam_args for the scalars, which the
 * caller rounds from double as torch does). Returns 0, or -1 for arguments it
 * does not take. The tensors must not overlap. */
int pipeoff_adam_step(float *p, const float *g, float *m, float *v, void *out, int out_kind,
                      int64_t n, int adam_wd, float wd, float decay, float sign, float scale,
                      float w1, float beta2, float c2, float bc2_sqrt, float eps,
                      float step_size, int fma, int tail_fma, int64_t vec, int nan_bf16,
                      int threads) {
    if (n < 0 || vec < 1 || out_kind < 0 || out_kind > 2) return -1;
    adam_args a = {p, m, v, g, NULL, 0, out, out_kind, (uint16_t)nan_bf16, adam_wd, scale,
                   sign, wd, decay, w1, beta2, c2, bc2_sqrt, eps, step_size, fma, tail_fma,
                   n - n % vec};
    parallel(adam_range, &a, n, threads);
    return 0;
}

/* pipeoff_adam_step whose gradient is the FP32 sum `g` plus the last micro-step's
 * BF16 gradient `g16` (or `g16` alone when `g` is NULL), widened and added as
 * pipeoff_fold does, then scaled: the bits of the fold followed by the step. */
int pipeoff_adam_fold_step(float *p, const float *g, const uint16_t *g16, float *m, float *v,
                           void *out, int out_kind, int64_t n, int adam_wd, float wd,
                           float decay, float sign, float scale, float w1, float beta2,
                           float c2, float bc2_sqrt, float eps, float step_size, int fma,
                           int tail_fma, int64_t vec, int nan_bf16, int threads) {
    if (n < 0 || vec < 1 || out_kind < 0 || out_kind > 2 || g16 == NULL) return -1;
    adam_args a = {p, m, v, g, g16, g == NULL ? 1 : 2, out, out_kind, (uint16_t)nan_bf16,
                   adam_wd, scale, sign, wd, decay, w1, beta2, c2, bc2_sqrt, eps, step_size,
                   fma, tail_fma, n - n % vec};
    parallel(adam_range, &a, n, threads);
    return 0;
}

/* The sum of squares of the gradient a step read, taken inside its pass: the
 * logged gradient norm of a one-pass final micro-step (not torch's bits, never a
 * clip coefficient). Each range of a region steps tile by tile, and squares each
 * tile's gradient while it is in cache (no second pass over memory): 16 float lanes
 * per tile, then the tile's lanes in double, in order, then the tiles in order; one
 * partial per chunk of the region, which the caller adds in chunk order. So the result
 * depends on the region's chunks (the thread count), never on which thread ran
 * which chunk. */
#define NORM_TILE 512

typedef struct {
    adam_args a;
    double *partials;  /* one per chunk of the region */
    int64_t chunk;     /* elements per chunk */
} adam_norm_args;

/* 16 float lanes per tile (a tile's 512 elements, in L1: 32 per lane), then the lanes in
 * double: one vector register of squares, at the vector width of the step's body. */
static inline __attribute__((always_inline)) double tile_sumsq_impl(const adam_args *a,
                                                                    int64_t b, int64_t e,
                                                                    int gmode) {
    const float *restrict G = a->g;
    const uint16_t *restrict G16 = a->g16;
    float L[16] = {0};
    int64_t i = b;
    for (; i + 16 <= e; i += 16)
        for (int l = 0; l < 16; l++) {
            float x = gmode == 0 ? G[i + l]
                      : (gmode == 1 ? from_bf16(G16[i + l]) : G[i + l] + from_bf16(G16[i + l]));
            L[l] = L[l] + x * x;
        }
    double s = 0.0;
    for (int l = 0; l < 16; l++) s += (double)L[l];
    for (; i < e; i++) {
        float x = gmode == 0 ? G[i]
                  : (gmode == 1 ? from_bf16(G16[i]) : G[i] + from_bf16(G16[i]));
        s += (double)x * (double)x;
    }
    return s;
}

#define TILE_SUMSQ(a, b, e)                                           \
    ((a)->gmode == 0   ? tile_sumsq_impl(a, b, e, 0)                  \
     : (a)->gmode == 1 ? tile_sumsq_impl(a, b, e, 1)                  \
                       : tile_sumsq_impl(a, b, e, 2))

#ifdef HAVE_X86_FMA
WIDE512 static double tile_sumsq512(const adam_args *a, int64_t b, int64_t e) {
    return TILE_SUMSQ(a, b, e);
}
__attribute__((target("avx2,fma"))) static double tile_sumsq256(const adam_args *a, int64_t b,
                                                                  int64_t e) {
    return TILE_SUMSQ(a, b, e);
}
#endif

static double tile_sumsq(const adam_args *a, int64_t b, int64_t e) {
#ifdef HAVE_X86_FMA
    if (have_avx512()) return tile_sumsq512(a, b, e);
    if (have_fma()) return tile_sumsq256(a, b, e);
#endif
    return TILE_SUMSQ(a, b, e);
}

static void adam_norm_range(void *arg, int64_t b, int64_t e) {
    adam_norm_args *na = (adam_norm_args *)arg;
    double s = 0.0;
    for (int64_t t0 = b; t0 < e; t0 += NORM_TILE) {
        int64_t t1 = t0 + NORM_TILE < e ? t0 + NORM_TILE : e;
        s += tile_sumsq(&na->a, t0, t1);  /* reads the gradient into cache */
        adam_range(&na->a, t0, t1);       /* and the step reads it from there */
    }
    na->partials[b / na->chunk] = s;
}

/* pipeoff_adam_step (g16 NULL), or pipeoff_adam_fold_step (g16 given, g NULL or not),
 * that also writes the sum of squares of the gradient (before the clip scale and
 * the sign: the norm of the folded sum) to *sumsq. Returns 0, or -1 for arguments it
 * does not take (or no memory for its partials; nothing is written then). */
int pipeoff_adam_step_norm(float *p, const float *g, const uint16_t *g16, float *m, float *v,
                           void *out, int out_kind, int64_t n,
                           int adam_wd, float wd, float decay, float sign, float scale,
                           float w1, float beta2, float c2, float bc2_sqrt, float eps,
                           float step_size, int fma, int tail_fma, int64_t vec, int nan_bf16,
                           int threads, double *sumsq) {
    if (n < 0 || vec < 1 || out_kind < 0 || out_kind > 2 || (g == NULL && g16 == NULL)
        || sumsq == NULL)
        return -1;
    int k = region_threads(n, threads);
    int64_t chunk = k > 1 ? region_chunk(n, k) : (n > 0 ? n : 1);
    int64_t chunks = n > 0 ? (n + chunk - 1) / chunk : 1;
    double *partials = (double *)calloc((size_t)chunks, sizeof(double));
    if (partials == NULL) return -1;
    adam_norm_args na = {{p, m, v, g, g16, g16 == NULL ? 0 : (g == NULL ? 1 : 2), out,
                          out_kind, (uint16_t)nan_bf16, adam_wd, scale, sign, wd, decay, w1,
                          beta2, c2, bc2_sqrt, eps, step_size, fma, tail_fma, n - n % vec},
                         partials, chunk};
    parallel(adam_norm_range, &na, n, k);
    double s = 0.0;
    for (int64_t c = 0; c < chunks; c++) s += partials[c];
    free(partials);
    *sumsq = s;
    return 0;
}

/* Which instances run here (a bit set: 1 plain, 2 fused AVX2, 4 fused AVX-512). */
int pipeoff_adam_fast(void) { return 1 | (have_fma() ? 2 : 0) | (have_avx512() ? 4 : 0); }

/* ---------------------------------------------------------------- SGD */

/* torch's for-loop SGD (torch.optim.sgd._single_tensor_sgd), which its CPU
 * optimizers run by default, is four or five element-wise ops, each a pass over
 * memory: g + wd p, buf * momentum, + (1 - dampening) g, g + momentum buf,
 * p + (-lr) g. Each `a.add(b, alpha=x)` is aten's ufunc add, whose vector body
 * is fmadd(b, x, a) and whose scalar loop `a + x * b` its compiler contracts on
 * x86 FMA builds: one fma each (`fma` 1), or none at the DEFAULT level (`fma` 0).
 * The multiply by momentum is a plain multiply. Here they are one pass: 16 bytes
 * per element with momentum (read g, p, buf; write p, buf), 12 without. */
typedef struct {
    float *restrict p, *restrict buf;
    const float *restrict g;
    float sign;       /* -1 to maximize (torch negates the gradient), else 1 */
    float wd;         /* float(weight_decay) */
    float momentum;   /* float(momentum) */
    float c;          /* float(1 - dampening) */
    float neg_lr;     /* float(-lr) */
    int has_wd;       /* weight_decay != 0 */
    int mode;         /* 0 no momentum; 1 the first step (buf = g); 2 buf = buf m + c g */
    int nesterov;
    int fma;
} sgd_args;

static inline __attribute__((always_inline)) float sgd_add(float a, float b, float x, int fma) {
    return fma ? fmaf(b, x, a) : a + x * b;  /* aten's a.add(b, alpha=x) */
}

static inline __attribute__((always_inline)) void sgd_loop(const sgd_args *a, int64_t b,
                                                            int64_t e, int fma, int has_wd,
                                                            int mode, int nesterov) {
    float *restrict P = a->p, *restrict B = a->buf;
    const float *restrict G = a->g;
    const float wd = a->wd, mom = a->momentum, c = a->c, neg_lr = a->neg_lr;
    /* torch negates (maximize) or takes the gradient as it is: a sign flip of its
     * bits, never a multiply (which would quiet a signalling NaN that torch's
     * clone into the first momentum buffer keeps) */
    const uint32_t flip = a->sign < 0 ? 0x80000000u : 0u;
    for (int64_t i = b; i < e; i++) {
        uint32_t gbits;
        memcpy(&gbits, &G[i], 4);
        gbits ^= flip;
        float g;
        memcpy(&g, &gbits, 4);
        float p = P[i];
        if (has_wd) g = sgd_add(g, p, wd, fma);
        if (mode) {
            float bb = mode == 1 ? g : sgd_add(B[i] * mom, g, c, fma);
            B[i] = bb;
            g = nesterov ? sgd_add(g, bb, mom, fma) : bb;
        }
        P[i] = sgd_add(p, g, neg_lr, fma);
    }
}

#define SGD_NEST(F, WD, MODE)                                            \
    do {                                                                 \
        if (a->nesterov) sgd_loop(a, b, e, F, WD, MODE, 1);              \
        else sgd_loop(a, b, e, F, WD, MODE, 0);                          \
    } while (0)
#define SGD_MODE(F, WD)                                                  \
    do {                                                                 \
        if (a->mode == 0) sgd_loop(a, b, e, F, WD, 0, 0);                \
        else if (a->mode == 1) SGD_NEST(F, WD, 1);                       \
        else SGD_NEST(F, WD, 2);                                         \
    } while (0)
#define SGD_CASES(F)                                                     \
    do {                                                                 \
        if (a->has_wd) SGD_MODE(F, 1);                                   \
        else SGD_MODE(F, 0);                                             \
    } while (0)

#ifdef HAVE_X86_FMA
__attribute__((target("avx2,fma"))) static void sgd_fused(const sgd_args *a, int64_t b,
                                                            int64_t e) {
    SGD_CASES(1);
}
WIDE512 static void sgd_fused512(const sgd_args *a, int64_t b, int64_t e) { SGD_CASES(1); }
#endif

static void sgd_plain(const sgd_args *a, int64_t b, int64_t e) { SGD_CASES(0); }

/* fmaf without the instruction: correctly rounded in software (slow, but the bits). */
static void sgd_soft(const sgd_args *a, int64_t b, int64_t e) { SGD_CASES(1); }

static void sgd_range(void *arg, int64_t b, int64_t e) {
    const sgd_args *a = (const sgd_args *)arg;
    if (a->fma == 0) {
        sgd_plain(a, b, e);
#ifdef HAVE_X86_FMA
    } else if (have_avx512()) {
        sgd_fused512(a, b, e);
    } else if (have_fma()) {
        sgd_fused(a, b, e);
#endif
    } else {
        sgd_soft(a, b, e);
    }
}

/* One torch SGD step of n elements: p, and buf with momentum (NULL without), in
 * place from g (not written). `mode` 1 is the first step (buf is written, not
 * read). Returns 0, or -1 for arguments it does not take. */
int pipeoff_sgd_step(float *p, float *buf, const float *g, int64_t n, float sign, float wd,
                     float momentum, float c, float neg_lr, int has_wd, int mode, int nesterov,
                     int fma, int threads) {
    if (n < 0 || mode < 0 || mode > 2 || (mode != 0 && buf == NULL)) return -1;
    sgd_args a = {p, buf, g, sign, wd, momentum, c, neg_lr, has_wd, mode, nesterov != 0,
                  fma != 0};
    parallel(sgd_range, &a, n, threads);
    return 0;
}

/* ---------------------------------------------------------------- outer Adam */

/* torch's for-loop Adam/AdamW (torch.optim.adam._single_tensor_adam), what a CPU
 * Adam runs by default, is seven or eight element-wise ops, each a pass over
 * memory (about 80 bytes per element for AdamW). Its square root is torch's own
 * `sqrt`, which on torch's MKL builds is MKL's vsSqrt and not correctly rounded
 * (1 ulp apart from sqrtf in about a fifth of the elements), so it cannot be
 * redone here bit for bit: the step is two passes with torch's sqrt between,
 *   pipeoff_adam_moments  g = -g (maximize), g = g + wd p (Adam), m = lerp(m, g, w),
 *                         v = v b2 + (c2 g) g                     20 bytes (24 Adam wd)
 *   torch.sqrt(v, out=s)                                          8 bytes
 *   pipeoff_adam_apply    p = p decay + (-step_size m) / (s / bc2_sqrt + eps)  16 bytes
 * The fused multiply-adds are aten's: lerp's vector body is fmadd(w, g - m, m)
 * (its scalar loop `m + w (g - m)` contracted alike on FMA builds), addcmul's
 * `v + (c2 g) g` and add's `g + wd p` contracted; the caller takes only a lerp
 * weight below 0.5 (beta1 above 0.5), where torch's body and scalar loops agree,
 * since torch's threads give each chunk a scalar tail of its own. */
typedef struct {
    float *restrict m, *restrict v;
    const float *restrict g, *restrict p;
    uint32_t flip;   /* 0x80000000 to maximize: torch negates the gradient's bits */
    int adam_wd;
    float wd, w, beta2, c2;
} moments_args;

static inline __attribute__((always_inline)) void moments_loop(const moments_args *a,
                                                                int64_t b, int64_t e, int fma,
                                                                int adam_wd) {
    float *restrict M = a->m, *restrict V = a->v;
    const float *restrict G = a->g, *restrict P = a->p;
    const float wd = a->wd, w = a->w, beta2 = a->beta2, c2 = a->c2;
    const uint32_t flip = a->flip;
    for (int64_t i = b; i < e; i++) {
        uint32_t gbits;
        memcpy(&gbits, &G[i], 4);
        gbits ^= flip;
        float g;
        memcpy(&g, &gbits, 4);
        if (adam_wd) g = fma ? fmaf(P[i], wd, g) : g + wd * P[i];
        float m = M[i];
        M[i] = fma ? fmaf(w, g - m, m) : m + w * (g - m);
        float vb = V[i] * beta2;
        float cg = c2 * g;
        V[i] = fma ? fmaf(cg, g, vb) : vb + cg * g;
    }
}

#define MOMENTS_CASES(F)                                 \
    do {                                                 \
        if (a->adam_wd) moments_loop(a, b, e, F, 1);     \
        else moments_loop(a, b, e, F, 0);                \
    } while (0)

typedef struct {
    moments_args args;
    int fma;
} moments_job;

#ifdef HAVE_X86_FMA
__attribute__((target("avx2,fma"))) static void moments_fused(const moments_args *a,
                                                                int64_t b, int64_t e) {
    MOMENTS_CASES(1);
}
WIDE512 static void moments_fused512(const moments_args *a, int64_t b, int64_t e) {
    MOMENTS_CASES(1);
}
#endif
static void moments_plain(const moments_args *a, int64_t b, int64_t e) { MOMENTS_CASES(0); }
static void moments_soft(const moments_args *a, int64_t b, int64_t e) { MOMENTS_CASES(1); }

static void moments_range(void *arg, int64_t b, int64_t e) {
    const moments_job *j = (const moments_job *)arg;
    if (j->fma == 0) {
        moments_plain(&j->args, b, e);
#ifdef HAVE_X86_FMA
    } else if (have_avx512()) {
        moments_fused512(&j->args, b, e);
    } else if (have_fma()) {
        moments_fused(&j->args, b, e);
#endif
    } else {
        moments_soft(&j->args, b, e);
    }
}

/* Adam's moments of n elements in place from g (not written); p is read for Adam's
 * L2 term only (adam_wd), else it may be NULL. Returns 0, or -1. */
int pipeoff_adam_moments(float *m, float *v, const float *g, const float *p, int64_t n,
                         int maximize, int adam_wd, float wd, float w, float beta2, float c2,
                         int fma, int threads) {
    if (n < 0 || (adam_wd && p == NULL)) return -1;
    moments_job j = {{m, v, g, p, maximize ? 0x80000000u : 0u, adam_wd != 0, wd, w, beta2, c2},
                     fma != 0};
    parallel(moments_range, &j, n, threads);
    return 0;
}

typedef struct {
    float *restrict p;
    const float *restrict m, *restrict s;
    int has_decay;
    float decay, bc2_sqrt, eps, neg_step_size;
} apply_args;

static inline __attribute__((always_inline)) void apply_loop(const apply_args *a, int64_t b,
                                                              int64_t e, int has_decay) {
    float *restrict P = a->p;
    const float *restrict M = a->m, *restrict S = a->s;
    const float decay = a->decay, bc2_sqrt = a->bc2_sqrt, eps = a->eps;
    const float c = a->neg_step_size;
    for (int64_t i = b; i < e; i++) {
        float p = has_decay ? P[i] * decay : P[i];
        float denom = S[i] / bc2_sqrt + eps;
        P[i] = p + (c * M[i]) / denom; /* aten's addcdiv: self + (value t1) / t2 */
    }
}

#ifdef HAVE_X86_FMA
WIDE512 static void apply_wide(const apply_args *a, int64_t b, int64_t e) {
    if (a->has_decay) apply_loop(a, b, e, 1);
    else apply_loop(a, b, e, 0);
}
__attribute__((target("avx2"))) static void apply_avx2(const apply_args *a, int64_t b,
                                                         int64_t e) {
    if (a->has_decay) apply_loop(a, b, e, 1);
    else apply_loop(a, b, e, 0);
}
#endif

static void apply_range(void *arg, int64_t b, int64_t e) {
    const apply_args *a = (const apply_args *)arg;
#ifdef HAVE_X86_FMA
    if (have_avx512()) {
        apply_wide(a, b, e);
        return;
    }
    if (have_fma()) {
        apply_avx2(a, b, e);
        return;
    }
#endif
    if (a->has_decay) apply_loop(a, b, e, 1);
    else apply_loop(a, b, e, 0);
}

/* Adam's update of p (n elements) from m and s = torch.sqrt(v), neither written. */
int pipeoff_adam_apply(float *p, const float *m, const float *s, int64_t n, int has_decay,
                       float decay, float bc2_sqrt, float eps, float neg_step_size,
                       int threads) {
    if (n < 0) return -1;
    apply_args a = {p, m, s, has_decay != 0, decay, bc2_sqrt, eps, neg_step_size};
    parallel(apply_range, &a, n, threads);
    return 0;
}

/* ---------------------------------------------------------------- the fold */

typedef struct {
    float *acc;
    const void *g;
    int kind;  /* 1 BF16, 2 FP32 */
    int first;
} fold_args;

static inline __attribute__((always_inline)) void fold_loop(const fold_args *f, int64_t b,
                                                             int64_t e) {
    float *restrict acc = f->acc;
    if (f->kind == 1) {
        const uint16_t *restrict g = (const uint16_t *)f->g;
        if (f->first)
            for (int64_t i = b; i < e; i++) acc[i] = from_bf16(g[i]);
        else
            for (int64_t i = b; i < e; i++) acc[i] = acc[i] + from_bf16(g[i]);
    } else {
        const float *restrict g = (const float *)f->g;
        if (f->first)
            memcpy(acc + b, g + b, (size_t)(e - b) * 4);
        else
            for (int64_t i = b; i < e; i++) acc[i] = acc[i] + g[i];
    }
}

#ifdef HAVE_X86_FMA
WIDE512 static void fold_range512(const fold_args *f, int64_t b, int64_t e) {
    fold_loop(f, b, e);
}
#endif

static void fold_range(void *arg, int64_t b, int64_t e) {
    const fold_args *f = (const fold_args *)arg;
#ifdef HAVE_X86_FMA
    if (have_avx512()) {
        fold_range512(f, b, e);
        return;
    }
#endif
    fold_loop(f, b, e);
}

int pipeoff_fold(float *acc, const void *g, int kind, int64_t n, int first, int threads) {
    if (n < 0 || (kind != 1 && kind != 2)) return -1;
    fold_args f = {acc, g, kind, first};
    parallel(fold_range, &f, n, threads);
    return 0;
}

/* ------------------------------------------------------ the fold and torch's norm */

/* The final fold of a gradient piece with the norm of the finished sum taken while
 * each chunk of it is in cache (no second pass over memory), to torch's bits:
 * torch's 2-norm of a contiguous FP32 tensor (at::native's norm_two_reduce_step over
 * Vectorized<float>) sums the squares in 8 lanes, lane l taking the elements at
 * l mod 8 in order, with no fused multiply-add; then adds the lanes in order, then
 * the last n % 8 squares one by one (see pipeoff_fold_norm for their contractions),
 * and takes sqrtf (of one element, its absolute value: nothing is reduced). That order is sequential, so
 * the norm runs on the calling thread, chunk after chunk in order, while the helpers
 * fold the chunks ahead of it (the caller folds one itself when the next is not
 * ready). pipeoff checks the order against torch at first use. */
#define NORM_CHUNK (1 << 15)

/* Elements [b, e) of x, which are elements off + b... of the whole tensor, all in
 * its 8-lane body, into the running lane sums. */
static void lanes_add(float *lanes, const float *restrict x, int64_t b, int64_t e,
                      int64_t off) {
    float L[8];
    for (int l = 0; l < 8; l++) L[l] = lanes[l];
    int64_t i = b;
    for (; i < e && ((off + i) & 7); i++) L[(off + i) & 7] = L[(off + i) & 7] + x[i] * x[i];
    for (; i + 8 <= e; i += 8)
        for (int l = 0; l < 8; l++) L[l] = L[l] + x[i + l] * x[i + l];
    for (; i < e; i++) L[(off + i) & 7] = L[(off + i) & 7] + x[i] * x[i];
    for (int l = 0; l < 8; l++) lanes[l] = L[l];
}

typedef struct {
    fold_args f;
    float *lanes;
    int64_t off, body;
} fold_norm_args;

static void fold_norm_after(void *arg, int64_t b, int64_t e) {
    fold_norm_args *a = (fold_norm_args *)arg;
    int64_t stop = a->body - a->off;  /* the piece's elements in the lanes' body */
    if (e > stop) e = stop;
    if (e > b) lanes_add(a->lanes, a->f.acc, b, e, a->off);
}

/* An ordered region: fn over chunks of [0, n) by the caller and up to threads - 1
 * helpers, and after(c) on the caller only, for c = 0, 1, ... in order, each once fn
 * has finished chunk c (whichever thread ran it). */
typedef struct {
    range_fn fn;
    void *arg;
    int64_t n, chunk, chunks;
    int64_t next;          /* atomic: the next chunk to claim */
    unsigned char *ready;  /* atomic, per chunk: fn has finished it */
    int refs;              /* atomic: the caller and the helpers still inside */
    pthread_mutex_t lock;
    pthread_cond_t readied;
} ordered_t;

static void ordered_leave(ordered_t *r) {
    if (__atomic_sub_fetch(&r->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        pthread_mutex_destroy(&r->lock);
        pthread_cond_destroy(&r->readied);
        free(r->ready);
        free(r);
    }
}

static void ordered_leave_any(void *r) { ordered_leave((ordered_t *)r); }

static void ordered_run(ordered_t *r, int64_t c) {
    int64_t b = c * r->chunk, e = b + r->chunk < r->n ? b + r->chunk : r->n;
    r->fn(r->arg, b, e);
    __atomic_store_n(&r->ready[c], 1, __ATOMIC_RELEASE);
    /* Under the mutex: the caller checks `ready` holding it before it waits, so the
     * broadcast cannot fall between its check and its wait. */
    pthread_mutex_lock(&r->lock);
    pthread_cond_broadcast(&r->readied);
    pthread_mutex_unlock(&r->lock);
}

static void *ordered_helper(void *p) {
    ordered_t *r = (ordered_t *)p;
    for (;;) {
        int64_t c = __atomic_fetch_add(&r->next, 1, __ATOMIC_RELAXED);
        if (c >= r->chunks) break;
        ordered_run(r, c);
    }
    ordered_leave(r);
    return NULL;
}

static void parallel_ordered(range_fn fn, range_fn after, void *arg, int64_t n,
                             int threads) {
    int k = region_threads(n, threads);
    int64_t chunks = (n + NORM_CHUNK - 1) / NORM_CHUNK;
    ordered_t *r = k > 1 && chunks > 1 ? (ordered_t *)malloc(sizeof(ordered_t)) : NULL;
    unsigned char *ready = r != NULL ? (unsigned char *)calloc((size_t)chunks, 1) : NULL;
    if (r == NULL || ready == NULL) {
        free(r);
        for (int64_t b = 0; b < n; b += NORM_CHUNK) {
            int64_t e = b + NORM_CHUNK < n ? b + NORM_CHUNK : n;
            fn(arg, b, e);
            after(arg, b, e);
        }
        return;
    }
    r->fn = fn;
    r->arg = arg;
    r->n = n;
    r->chunk = NORM_CHUNK;
    r->chunks = chunks;
    r->next = 0;
    r->ready = ready;
    r->refs = k;
    pthread_mutex_init(&r->lock, NULL);
    pthread_cond_init(&r->readied, NULL);
    spawn_helpers(k, ordered_helper, r, ordered_leave_any);  /* (the caller claims a
                                                                missing one's chunks) */
    for (int64_t c = 0; c < chunks; c++) {
        while (!__atomic_load_n(&r->ready[c], __ATOMIC_ACQUIRE)) {
            int64_t mine = __atomic_fetch_add(&r->next, 1, __ATOMIC_RELAXED);
            if (mine < chunks) {
                ordered_run(r, mine);  /* c is a helper's, still running: fold ahead */
                continue;
            }
            pthread_mutex_lock(&r->lock);
            while (!__atomic_load_n(&r->ready[c], __ATOMIC_ACQUIRE))
                pthread_cond_wait(&r->readied, &r->lock);
            pthread_mutex_unlock(&r->lock);
        }
        int64_t b = c * NORM_CHUNK, e = b + NORM_CHUNK < n ? b + NORM_CHUNK : n;
        after(arg, b, e);
    }
    ordered_leave(r);
}

/* pipeoff_fold of a piece of n elements that starts at element `offset` of a tensor of
 * `total`, adding the squares of the folded sum to the running `lanes` (8 floats, zero
 * at the tensor's first piece). With `norm` (the tensor's last piece), also writes
 * torch's 2-norm of the whole sum there: the lanes added in order, the squares of the
 * last total % 8 elements (acc + total - total % 8 - offset: they may reach back into
 * the piece before, in the same tensor), sqrtf. torch's scalar loop over those was
 * compiled with an in-order 4-wide step and contracted its remainder: with `tail_fma`,
 * the squares of the first (total % 8) / 4 * 4 of them are added plainly and the rest
 * with fmaf (the AVX2/AVX-512 builds; DEFAULT adds them all plainly). Returns 0, or -1
 * for arguments it does not take. */
int pipeoff_fold_norm(float *acc, const void *g, int kind, int64_t n, int first, int threads,
                      float *lanes, int64_t offset, int64_t total, int tail_fma, float *norm) {
    if (n < 0 || offset < 0 || offset + n > total || (kind != 1 && kind != 2)
        || lanes == NULL)
        return -1;
    fold_norm_args a = {{acc, g, kind, first}, lanes, offset, total - total % 8};
    parallel_ordered(fold_range, fold_norm_after, &a, n, threads);
    if (norm != NULL) {
        if (offset + n != total) return -1;
        float s = lanes[0];
        for (int l = 1; l < 8; l++) s = s + lanes[l];
        const float *tail = acc + (a.body - offset);
        int64_t t = total - a.body, plain = tail_fma ? t / 4 * 4 : t;
        for (int64_t i = 0; i < plain; i++) s = s + tail[i] * tail[i];
        for (int64_t i = plain; i < t; i++) s = fmaf(tail[i], tail[i], s);
        /* torch reduces nothing for one element: its norm is its absolute value */
        *norm = total == 1 ? fabsf(tail[0]) : sqrtf(s);
    }
    return 0;
}

/* ---------------------------------------------------------------- the floor */

typedef struct {
    float *a;
    float s;
} scale_args;

static void scale_range(void *arg, int64_t b, int64_t e) {
    const scale_args *s = (const scale_args *)arg;
    for (int64_t i = b; i < e; i++) s->a[i] = s->a[i] * s->s;
}

int pipeoff_scale(float *a, int64_t n, float s, int threads) {
    if (n < 0) return -1;
    scale_args x = {a, s};
    parallel(scale_range, &x, n, threads);
    return 0;
}

int pipeoff_abi_version(void) { return 5; }
