// softmax_xent.c: fused softmax + cross-entropy over the first V of Vp logits,
// and its vocabulary-parallel pieces (one rank's columns: max, sums, gradient).
// Fusing means the (N,Vp) probabilities never exist: the forward keeps only
// each row's log-sum-exp, and the backward turns logits into their gradient
// in place. Rows are independent; the AVX-512 and AVX2 paths only change the
// per-row loops.
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include "simd.h"
#include <math.h>
#include <string.h>

// 16-bit rows are converted to fp32 in blocks of this many logits on the
// stack; fp32 rows are used whole and in place.
#define XENT_BLOCK 2048

// The per-row loops, scalar, AVX-512 or AVX2. The lse is max + log(sum_exp) with
// the sum in double (V is ~50k terms, too many for a float accumulator to
// stay exact to 1e-7).
typedef struct {
    float (*max)(const float *x, int n);
    double (*sum_exp)(const float *x, int n, float maxval); // sum of exp(x - maxval)
    void (*probs)(float *dx, const float *x, float lse, float dloss, int n); // dloss exp(x - lse)
} row_ops;

static float row_max(const float *x, int n) {
    float maxval = -INFINITY;
    for (int j = 0; j < n; j++) maxval = fmaxf(maxval, x[j]);
    return maxval;
}

static double row_sum_exp(const float *x, int n, float maxval) {
    double sum = 0.0;
    for (int j = 0; j < n; j++) sum += expf(x[j] - maxval);
    return sum;
}

// dx may be x
static void row_probs(float *dx, const float *x, float lse, float dloss, int n) {
    for (int j = 0; j < n; j++) dx[j] = dloss * expf(x[j] - lse);
}

static const row_ops scalar_ops = {row_max, row_sum_exp, row_probs};

#if FL_HAVE_X86_SIMD
__attribute__((target("avx512f"))) static float row_max_avx512(const float *x, int n) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < n; j += 16)
        vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail_mask(n - j), x + j));
    return _mm512_reduce_max_ps(vmax);
}

// the 16 lanes' float exps are summed in two double vectors
__attribute__((target("avx512f"))) static double row_sum_exp_avx512(const float *x, int n,
                                                                    float maxval) {
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (int j = 0; j < n; j += 16) {
        __mmask16 m = tail_mask(n - j);
        __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), _mm512_set1_ps(maxval));
        __m512 e = _mm512_maskz_mov_ps(m, exp512(d));
        lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        hi = _mm512_add_pd(
            hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    }
    return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
}

__attribute__((target("avx512f"))) static void row_probs_avx512(float *dx, const float *x,
                                                                float lse, float dloss, int n) {
    for (int j = 0; j < n; j += 16) {
        __mmask16 m = tail_mask(n - j);
        __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), _mm512_set1_ps(lse));
        _mm512_mask_storeu_ps(dx + j, m, _mm512_mul_ps(_mm512_set1_ps(dloss), exp512(d)));
    }
}

static const row_ops avx512_ops = {row_max_avx512, row_sum_exp_avx512, row_probs_avx512};

// The AVX2 + FMA twins. exp256 equals exp512 lane for lane, and the sum
// keeps the AVX-512 path's 16 lanes and its order of double additions, so
// both paths give the same bits (the max is exact in any order).

__attribute__((target("avx2,fma"))) static float row_max_avx2(const float *x, int n) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    int j = 0;
    for (; j + 8 <= n; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + j));
    if (j < n) {
        __m256i m = tail_mask8((size_t)(n - j));
        __m256 t = _mm256_maskload_ps(x + j, m);
        vmax = _mm256_max_ps(vmax, _mm256_blendv_ps(vmax, t, _mm256_castsi256_ps(m)));
    }
    __m128 v = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    v = _mm_max_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_max_ss(v, _mm_movehdup_ps(v)));
}

// adds lanes 0-3 and 4-7 of 8 float exps to two double accumulators
__attribute__((target("avx2,fma"))) static inline void add_pd8(__m256d *a, __m256d *b, __m256 e) {
    *a = _mm256_add_pd(*a, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    *b = _mm256_add_pd(*b, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
}

// acc[q] holds lanes 4q..4q+3 of the AVX-512 path's 16; its lo is acc[0..1],
// its hi acc[2..3], and _mm512_reduce_add_pd(lo + hi) halves 8 -> 4 -> 2 -> 1
// (GCC's order, redone here)
__attribute__((target("avx2,fma"))) static double row_sum_exp_avx2(const float *x, int n,
                                                                   float maxval) {
    __m256d acc[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(),
                      _mm256_setzero_pd()};
    __m256 vmaxval = _mm256_set1_ps(maxval);
    int j = 0;
    for (; j + 16 <= n; j += 16) {
        add_pd8(&acc[0], &acc[1], exp256(_mm256_sub_ps(_mm256_loadu_ps(x + j), vmaxval)));
        add_pd8(&acc[2], &acc[3], exp256(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8), vmaxval)));
    }
    // the ragged end: lanes past n add +0.0 (or nothing), as the AVX-512
    // path's masked lanes do, which leaves each sum as it is
    for (int h = 0; h < 2 && j + 8 * h < n; h++) {
        __m256i m = tail_mask8((size_t)(n - j - 8 * h));
        __m256 d = _mm256_sub_ps(_mm256_maskload_ps(x + j + 8 * h, m), vmaxval);
        add_pd8(&acc[2 * h], &acc[2 * h + 1], _mm256_and_ps(_mm256_castsi256_ps(m), exp256(d)));
    }
    __m256d s = _mm256_add_pd(_mm256_add_pd(acc[1], acc[3]), _mm256_add_pd(acc[0], acc[2]));
    __m128d t = _mm_add_pd(_mm256_extractf128_pd(s, 1), _mm256_castpd256_pd128(s));
    return _mm_cvtsd_f64(_mm_add_sd(t, _mm_unpackhi_pd(t, t)));
}

__attribute__((target("avx2,fma"))) static void row_probs_avx2(float *dx, const float *x, float lse,
                                                               float dloss, int n) {
    __m256 vlse = _mm256_set1_ps(lse), vdloss = _mm256_set1_ps(dloss);
    int j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(
            dx + j, _mm256_mul_ps(vdloss, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + j), vlse))));
    if (j < n) {
        __m256i m = tail_mask8((size_t)(n - j));
        __m256 d = _mm256_sub_ps(_mm256_maskload_ps(x + j, m), vlse);
        _mm256_maskstore_ps(dx + j, m, _mm256_mul_ps(vdloss, exp256(d)));
    }
}

static const row_ops avx2_ops = {row_max_avx2, row_sum_exp_avx2, row_probs_avx2};
#endif

static const row_ops *fast_ops(void) {
#if FL_HAVE_X86_SIMD
    if (fl_cpu()->avx512f) return &avx512_ops;
    if (fl_cpu()->avx2 && fl_cpu()->fma) return &avx2_ops;
#endif
    return &scalar_ops;
}

// The max over a row's first V logits (-INFINITY for V = 0), in blocks.
static float max_row(fl_dtype dt, const void *row, int V, const row_ops *ops) {
    int blk = dt == FL_F32 ? V : XENT_BLOCK;
    float x32[XENT_BLOCK], maxval = -INFINITY;
    for (int j0 = 0; j0 < V; j0 += blk) {
        int n = V - j0 < blk ? V - j0 : blk;
        maxval = fmaxf(maxval, ops->max(fl_load_f32(dt, fl_at_const(dt, row, j0), n, x32), n));
    }
    return maxval;
}

// The sum of exp(x - maxval) over a row's first V logits, in blocks.
static double sum_exp_row(fl_dtype dt, const void *row, int V, float maxval, const row_ops *ops) {
    int blk = dt == FL_F32 ? V : XENT_BLOCK;
    float x32[XENT_BLOCK];
    double sum = 0.0;
    for (int j0 = 0; j0 < V; j0 += blk) {
        int n = V - j0 < blk ? V - j0 : blk;
        sum += ops->sum_exp(fl_load_f32(dt, fl_at_const(dt, row, j0), n, x32), n, maxval);
    }
    return sum;
}

// One row's lse and loss.
static void forward_row(fl_dtype dt, float *loss, float *lse, const void *row, int target, int V,
                        const row_ops *ops) {
    FL_ASSERT(target >= -1 && target < V);
    float maxval = max_row(dt, row, V, ops);
    double sum = sum_exp_row(dt, row, V, maxval, ops);
    // cppcheck-suppress invalidFunctionArg ; V >= 1, so sum >= 1
    *lse = maxval + (float)log(sum);
    *loss = target < 0 ? 0.0f : *lse - fp32_at(dt, row, target);
}

// One row's gradient: dx[j] = dloss * (softmax_j - [j == target]) for j < V.
// Each block of logits is read before the same block of dx is written, so
// drow may be row. The target's entry is redone from its saved logit as
// dloss * (p - 1), not dloss * p - dloss, which would cancel. An ignored
// row and the vocabulary padding get exact zeros. shard: the row is one
// rank's part of the vocabulary, where a -1 target is another rank's, so
// the row still takes dloss * p (0 where the position has no loss).
static void backward_row(fl_dtype dt, void *drow, const void *row, float lse, int target,
                         float dloss, int V, int Vp, const row_ops *ops, int shard) {
    int blk = dt == FL_F32 ? V : XENT_BLOCK, zero_from = 0;
    FL_ASSERT(target >= -1 && target < V);
    if (target >= 0 || shard) {
        float x_target = target >= 0 ? fp32_at(dt, row, target) : 0.0f;
        for (int j0 = 0; j0 < V; j0 += blk) {
            int n = V - j0 < blk ? V - j0 : blk;
            float x32[XENT_BLOCK];
            const float *x = fl_load_f32(dt, fl_at_const(dt, row, j0), n, x32);
            float *dx = fp32_out(dt, fl_at(dt, drow, j0), x32);
            ops->probs(dx, x, lse, dloss, n);
            fp32_flush(dt, fl_at(dt, drow, j0), dx, n);
        }
        if (target >= 0) {
            float g = dloss * (expf(x_target - lse) - 1.0f);
            fl_store_f32(dt, fl_at(dt, drow, target), &g, 1);
        }
        zero_from = V;
    }
    memset(fl_at(dt, drow, zero_from), 0, (size_t)(Vp - zero_from) * fl_dtype_size(dt));
}

static void forward(fl_dtype dt, float *losses, float *lse, const void *logits, const int *targets,
                    int N, int V, int Vp, const row_ops *ops, int parallel) {
#pragma omp parallel for if (parallel)
    for (int i = 0; i < N; i++)
        forward_row(dt, &losses[i], &lse[i], fl_at_const(dt, logits, (size_t)i * Vp), targets[i], V,
                    ops);
}

static void backward(fl_dtype dt, void *dlogits, const void *logits, const float *lse,
                     const int *targets, const float *dlosses, int N, int V, int Vp,
                     const row_ops *ops, int parallel, int shard) {
#pragma omp parallel for if (parallel)
    for (int i = 0; i < N; i++)
        backward_row(dt, fl_at(dt, dlogits, (size_t)i * Vp),
                     fl_at_const(dt, logits, (size_t)i * Vp), lse[i], targets[i], dlosses[i], V, Vp,
                     ops, shard);
}

void softmax_xent_forward(fl_dtype dt, float *losses, float *lse, const void *logits,
                          const int *targets, int N, int V, int Vp) {
    forward(dt, losses, lse, logits, targets, N, V, Vp, fast_ops(), 1);
}

void softmax_xent_backward(fl_dtype dt, void *dlogits, const void *logits, const float *lse,
                           const int *targets, const float *dlosses, int N, int V, int Vp) {
    backward(dt, dlogits, logits, lse, targets, dlosses, N, V, Vp, fast_ops(), 1, 0);
}

// Row by row, while the row is in cache: the logits come from memory once,
// not once for each pass.
void softmax_xent_forward_backward(fl_dtype dt, float *losses, float *lse, void *logits,
                                   const int *targets, const float *dlosses, int N, int V, int Vp) {
    const row_ops *ops = fast_ops();
#pragma omp parallel for
    for (int i = 0; i < N; i++) {
        void *row = fl_at(dt, logits, (size_t)i * Vp);
        forward_row(dt, &losses[i], &lse[i], row, targets[i], V, ops);
        backward_row(dt, row, row, lse[i], targets[i], dlosses[i], V, Vp, ops, 0);
    }
}

void softmax_xent_forward_ref(float *losses, float *lse, const float *logits, const int *targets,
                              int N, int V, int Vp) {
    forward(FL_F32, losses, lse, logits, targets, N, V, Vp, &scalar_ops, 0);
}

void softmax_xent_backward_ref(float *dlogits, const float *logits, const float *lse,
                               const int *targets, const float *dlosses, int N, int V, int Vp) {
    backward(FL_F32, dlogits, logits, lse, targets, dlosses, N, V, Vp, &scalar_ops, 0, 0);
}

// The vocabulary-parallel pieces: the same row loops on one rank's columns.

static void shard_max(fl_dtype dt, float *mx, const void *logits, int N, int V, int Vp,
                      const row_ops *ops, int parallel) {
#pragma omp parallel for if (parallel)
    for (int i = 0; i < N; i++)
        mx[i] = max_row(dt, fl_at_const(dt, logits, (size_t)i * Vp), V, ops);
}

static void shard_sums(fl_dtype dt, float *sums, const void *logits, const float *mx,
                       const int *targets, int N, int V, int Vp, const row_ops *ops, int parallel) {
#pragma omp parallel for if (parallel)
    for (int i = 0; i < N; i++) {
        const void *row = fl_at_const(dt, logits, (size_t)i * Vp);
        int target = targets[i];
        FL_ASSERT(target >= -1 && target < V);
        sums[2 * i] = (float)sum_exp_row(dt, row, V, mx[i], ops);
        sums[2 * i + 1] = target < 0 ? 0.0f : fp32_at(dt, row, target);
    }
}

void xent_shard_max(fl_dtype dt, float *mx, const void *logits, int N, int V, int Vp) {
    shard_max(dt, mx, logits, N, V, Vp, fast_ops(), 1);
}

void xent_shard_sums(fl_dtype dt, float *sums, const void *logits, const float *mx,
                     const int *targets, int N, int V, int Vp) {
    shard_sums(dt, sums, logits, mx, targets, N, V, Vp, fast_ops(), 1);
}

void xent_shard_backward(fl_dtype dt, void *dlogits, const void *logits, const float *lse,
                         const int *targets, const float *dlosses, int N, int V, int Vp) {
    backward(dt, dlogits, logits, lse, targets, dlosses, N, V, Vp, fast_ops(), 1, 1);
}

void xent_shard_max_ref(float *mx, const float *logits, int N, int V, int Vp) {
    shard_max(FL_F32, mx, logits, N, V, Vp, &scalar_ops, 0);
}

void xent_shard_sums_ref(float *sums, const float *logits, const float *mx, const int *targets,
                         int N, int V, int Vp) {
    shard_sums(FL_F32, sums, logits, mx, targets, N, V, Vp, &scalar_ops, 0);
}

void xent_shard_backward_ref(float *dlogits, const float *logits, const float *lse,
                             const int *targets, const float *dlosses, int N, int V, int Vp) {
    backward(FL_F32, dlogits, logits, lse, targets, dlosses, N, V, Vp, &scalar_ops, 0, 1);
}
