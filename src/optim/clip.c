// clip.c: global gradient-norm clipping, as torch.nn.utils.clip_grad_norm_.
// The norm is summed in double per chunk, then over chunks in a fixed order,
// so it is bitwise the same for any thread count.
#include "fitlm/optim.h"

#include <math.h>

#define MAX_CHUNKS 4096

float fl_grad_norm(const float *grads, size_t n) {
    double partial[MAX_CHUNKS];
    size_t chunk = n / MAX_CHUNKS + 1;
    if (chunk < 16384) chunk = 16384;
    size_t nchunks = (n + chunk - 1) / chunk;
#pragma omp parallel for schedule(static)
    for (size_t c = 0; c < nchunks; c++) {
        size_t end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
        double s = 0.0;
        for (size_t i = c * chunk; i < end; i++) s += (double)grads[i] * grads[i];
        partial[c] = s;
    }
    double total = 0.0;
    for (size_t c = 0; c < nchunks; c++) total += partial[c];
    return (float)sqrt(total);
}

float fl_clip_grad_norm(float *grads, size_t n, float max_norm) {
    float norm = fl_grad_norm(grads, n);
    if (max_norm > 0.0f && norm > max_norm) {
        float scale = max_norm / (norm + 1e-6f);
#pragma omp parallel for simd schedule(static)
        for (size_t i = 0; i < n; i++) grads[i] *= scale;
    }
    return norm;
}
