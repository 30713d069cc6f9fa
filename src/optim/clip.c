// clip.c: global gradient-norm clipping, as torch.nn.utils.clip_grad_norm_.
// The norm is summed in double per chunk, then over chunks in a fixed order,
// so it is bitwise the same for any thread count.
#include "fitlm/optim.h"

#include <math.h>

#define MAX_CHUNKS 4096

// Sum of squares of one chunk in double. The simd reduction lets the
// compiler keep one partial sum per lane: a fixed order for a given clone.
FL_TARGET_CLONES
static double sum_squares(const float *x, size_t n) {
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (size_t i = 0; i < n; i++) s += (double)x[i] * x[i];
    return s;
}

FL_TARGET_CLONES
static void scale(float *x, size_t n, float factor) {
#pragma omp simd
    for (size_t i = 0; i < n; i++) x[i] *= factor;
}

float fl_grad_norm(const float *grads, size_t n) {
    double partial[MAX_CHUNKS];
    size_t chunk = n / MAX_CHUNKS + 1;
    if (chunk < 16384) chunk = 16384;
    size_t nchunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
    for (size_t c = 0; c < nchunks; c++) {
        size_t end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
        partial[c] = sum_squares(grads + c * chunk, end - c * chunk);
    }
    double total = 0.0;
    for (size_t c = 0; c < nchunks; c++) total += partial[c];
    return (float)sqrt(total);
}

float fl_clip_grad_norm(float *grads, size_t n, float max_norm) {
    float norm = fl_grad_norm(grads, n);
    if (max_norm > 0.0f && norm > max_norm) {
        float factor = max_norm / (norm + 1e-6f);
        size_t chunk = 65536, nchunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
        for (size_t c = 0; c < nchunks; c++)
            scale(grads + c * chunk, (c + 1) * chunk < n ? chunk : n - c * chunk, factor);
    }
    return norm;
}
