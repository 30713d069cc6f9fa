// softmax_xent.c: fused softmax + cross-entropy over the first V of Vp logits.
// Fusing means the (N,Vp) probabilities never exist: the forward keeps only
// each row's log-sum-exp, and the backward turns logits into their gradient
// in place.
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include <math.h>

// Stable log-sum-exp of one row: subtract the max, sum in double (V is
// ~50k terms, too many for a float accumulator to stay exact to 1e-7).
static float row_lse(const float *x, int V) {
    float maxval = -INFINITY;
    for (int j = 0; j < V; j++) maxval = fmaxf(maxval, x[j]);
    double sum = 0.0;
    for (int j = 0; j < V; j++) sum += expf(x[j] - maxval);
    return maxval + (float)log(sum);
}

// Reads each logit before writing the same index, so dlogits may be logits.
static void row_grad(float *dx, const float *x, float lse, int target, float dloss, int V, int Vp) {
    if (target < 0) {
        for (int j = 0; j < Vp; j++) dx[j] = 0.0f;
        return;
    }
    for (int j = 0; j < V; j++) dx[j] = dloss * (expf(x[j] - lse) - (j == target ? 1.0f : 0.0f));
    for (int j = V; j < Vp; j++) dx[j] = 0.0f; // padding takes no part
}

void softmax_xent_forward(float *losses, float *lse, const float *logits, const int *targets, int N,
                          int V, int Vp) {
    // losses, lse (N); logits (N,Vp); targets (N)
#pragma omp parallel for
    for (int i = 0; i < N; i++) {
        const float *x = logits + (size_t)i * Vp;
        FL_ASSERT(targets[i] >= -1 && targets[i] < V);
        lse[i] = row_lse(x, V);
        losses[i] = targets[i] < 0 ? 0.0f : lse[i] - x[targets[i]];
    }
}

void softmax_xent_backward(float *dlogits, const float *logits, const float *lse,
                           const int *targets, const float *dlosses, int N, int V, int Vp) {
#pragma omp parallel for
    for (int i = 0; i < N; i++)
        row_grad(dlogits + (size_t)i * Vp, logits + (size_t)i * Vp, lse[i], targets[i], dlosses[i],
                 V, Vp);
}

void softmax_xent_forward_ref(float *losses, float *lse, const float *logits, const int *targets,
                              int N, int V, int Vp) {
    for (int i = 0; i < N; i++) {
        const float *x = logits + (size_t)i * Vp;
        FL_ASSERT(targets[i] >= -1 && targets[i] < V);
        lse[i] = row_lse(x, V);
        losses[i] = targets[i] < 0 ? 0.0f : lse[i] - x[targets[i]];
    }
}

void softmax_xent_backward_ref(float *dlogits, const float *logits, const float *lse,
                               const int *targets, const float *dlosses, int N, int V, int Vp) {
    for (int i = 0; i < N; i++)
        row_grad(dlogits + (size_t)i * Vp, logits + (size_t)i * Vp, lse[i], targets[i], dlosses[i],
                 V, Vp);
}
