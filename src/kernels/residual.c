// residual.c: the residual stream's add, out = a + b.
#include "fitlm/kernels.h"

// No `omp simd` here: callers may alias out with a, or da with db, and the
// compiler's own vectoriser keeps exact sequential semantics with a run-time
// overlap check.
void residual_forward(float *out, const float *a, const float *b, size_t N) {
#pragma omp parallel for
    for (size_t i = 0; i < N; i++) out[i] = a[i] + b[i];
}

// the sum's gradient flows unchanged into both branches
void residual_backward(float *da, float *db, const float *dout, size_t N) {
#pragma omp parallel for
    for (size_t i = 0; i < N; i++) {
        da[i] += dout[i];
        db[i] += dout[i];
    }
}

void residual_forward_ref(float *out, const float *a, const float *b, size_t N) {
    for (size_t i = 0; i < N; i++) out[i] = a[i] + b[i];
}

void residual_backward_ref(float *da, float *db, const float *dout, size_t N) {
    for (size_t i = 0; i < N; i++) {
        da[i] += dout[i];
        db[i] += dout[i];
    }
}
