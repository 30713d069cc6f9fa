// gelu.c: GELU, tanh approximation (GPT-2's "gelu_new"):
// gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
#include "fitlm/kernels.h"

#include <math.h>

#define GELU_SCALING_FACTOR 0.7978845608028654f // sqrt(2/pi)
#define GELU_CUBIC 0.044715f

static inline float gelu_value(float x) {
    float u = GELU_SCALING_FACTOR * (x + GELU_CUBIC * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}

// d/dx with sech^2 = 1 - tanh^2 (as PyTorch does): one transcendental, and no
// coshf overflow for large |x|.
static inline float gelu_grad(float x) {
    float u = GELU_SCALING_FACTOR * (x + GELU_CUBIC * x * x * x);
    float th = tanhf(u);
    float du = GELU_SCALING_FACTOR * (1.0f + 3.0f * GELU_CUBIC * x * x);
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du;
}

void gelu_forward(float *out, const float *inp, size_t N) {
#pragma omp parallel for
    for (size_t i = 0; i < N; i++) out[i] = gelu_value(inp[i]);
}

void gelu_backward(float *dinp, const float *inp, const float *dout, size_t N) {
#pragma omp parallel for
    for (size_t i = 0; i < N; i++) dinp[i] += gelu_grad(inp[i]) * dout[i];
}

void gelu_forward_ref(float *out, const float *inp, size_t N) {
    for (size_t i = 0; i < N; i++) out[i] = gelu_value(inp[i]);
}

void gelu_backward_ref(float *dinp, const float *inp, const float *dout, size_t N) {
    for (size_t i = 0; i < N; i++) dinp[i] += gelu_grad(inp[i]) * dout[i];
}
