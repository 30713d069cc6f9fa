// softmax_xent.c: fused softmax + cross-entropy over the first V of Vp logits.
// Fusing means the (N,Vp) probabilities never exist: the forward keeps only
// each row's log-sum-exp, and the backward turns logits into their gradient
// in place. Rows are independent; the AVX-512 path only changes the per-row
// exp loops.
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include "simd.h"
#include <math.h>

typedef float (*row_lse_fn)(const float *x, int V);
typedef void (*row_grad_fn)(float *dx, const float *x, float lse, int target, float dloss, int V);

// Stable log-sum-exp of one row: subtract the max, sum in double (V is
// ~50k terms, too many for a float accumulator to stay exact to 1e-7).
static float row_lse(const float *x, int V) {
    float maxval = -INFINITY;
    for (int j = 0; j < V; j++) maxval = fmaxf(maxval, x[j]);
    double sum = 0.0;
    for (int j = 0; j < V; j++) sum += expf(x[j] - maxval);
    // cppcheck-suppress invalidFunctionArg ; V >= 1, so sum >= 1
    return maxval + (float)log(sum);
}

// dx[j] = dloss * (softmax_j - [j == target]) for j < V; reads each logit
// before writing the same index, so dx may be x
static void row_grad(float *dx, const float *x, float lse, int target, float dloss, int V) {
    for (int j = 0; j < V; j++) dx[j] = dloss * (expf(x[j] - lse) - (j == target ? 1.0f : 0.0f));
}

#if FL_HAVE_X86_SIMD
// as row_lse; the 16 lanes' float exps are summed in two double vectors
__attribute__((target("avx512f"))) static float row_lse_avx512(const float *x, int V) {
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int j = 0; j < V; j += 16)
        vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, tail_mask(V - j), x + j));
    float maxval = _mm512_reduce_max_ps(vmax);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (int j = 0; j < V; j += 16) {
        __mmask16 m = tail_mask(V - j);
        __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), _mm512_set1_ps(maxval));
        __m512 e = _mm512_maskz_mov_ps(m, exp512(d));
        lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        hi = _mm512_add_pd(
            hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    }
    return maxval + (float)log(_mm512_reduce_add_pd(_mm512_add_pd(lo, hi)));
}

// as row_grad; the target's entry is redone in scalar from its saved logit,
// as dloss * (p - 1) rather than dloss * p - dloss, which would cancel
__attribute__((target("avx512f"))) static void row_grad_avx512(float *dx, const float *x, float lse,
                                                               int target, float dloss, int V) {
    float x_target = x[target];
    for (int j = 0; j < V; j += 16) {
        __mmask16 m = tail_mask(V - j);
        __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), _mm512_set1_ps(lse));
        _mm512_mask_storeu_ps(dx + j, m, _mm512_mul_ps(_mm512_set1_ps(dloss), exp512(d)));
    }
    dx[target] = dloss * (expf(x_target - lse) - 1.0f);
}

#endif

static row_lse_fn fast_row_lse(void) {
#if FL_HAVE_X86_SIMD
    if (fl_cpu()->avx512f) return row_lse_avx512;
#endif
    return row_lse;
}

static row_grad_fn fast_row_grad(void) {
#if FL_HAVE_X86_SIMD
    if (fl_cpu()->avx512f) return row_grad_avx512;
#endif
    return row_grad;
}

static void forward(float *losses, float *lse, const float *logits, const int *targets, int N,
                    int V, int Vp, row_lse_fn row_lse_f, int parallel) {
#pragma omp parallel for if (parallel)
    for (int i = 0; i < N; i++) {
        const float *x = logits + (size_t)i * Vp;
        FL_ASSERT(targets[i] >= -1 && targets[i] < V);
        lse[i] = row_lse_f(x, V);
        losses[i] = targets[i] < 0 ? 0.0f : lse[i] - x[targets[i]];
    }
}

// ignored rows and the vocabulary padding get exact zeros
static void backward(float *dlogits, const float *logits, const float *lse, const int *targets,
                     const float *dlosses, int N, int V, int Vp, row_grad_fn row_grad_f,
                     int parallel) {
#pragma omp parallel for if (parallel)
    for (int i = 0; i < N; i++) {
        float *dx = dlogits + (size_t)i * Vp;
        FL_ASSERT(targets[i] >= -1 && targets[i] < V);
        int j0 = 0;
        if (targets[i] >= 0) {
            row_grad_f(dx, logits + (size_t)i * Vp, lse[i], targets[i], dlosses[i], V);
            j0 = V;
        }
        for (int j = j0; j < Vp; j++) dx[j] = 0.0f;
    }
}

void softmax_xent_forward(float *losses, float *lse, const float *logits, const int *targets, int N,
                          int V, int Vp) {
    forward(losses, lse, logits, targets, N, V, Vp, fast_row_lse(), 1);
}

void softmax_xent_backward(float *dlogits, const float *logits, const float *lse,
                           const int *targets, const float *dlosses, int N, int V, int Vp) {
    backward(dlogits, logits, lse, targets, dlosses, N, V, Vp, fast_row_grad(), 1);
}

void softmax_xent_forward_ref(float *losses, float *lse, const float *logits, const int *targets,
                              int N, int V, int Vp) {
    forward(losses, lse, logits, targets, N, V, Vp, row_lse, 0);
}

void softmax_xent_backward_ref(float *dlogits, const float *logits, const float *lse,
                               const int *targets, const float *dlosses, int N, int V, int Vp) {
    backward(dlogits, logits, lse, targets, dlosses, N, V, Vp, row_grad, 0);
}
