// gelu.cu: GELU, tanh approximation (GPT-2's "gelu_new"), as the vector
// paths of src/kernels/gelu.c compute it: 0.5 (1 + tanh u) = 1 / (1 + exp(-2u))
// with u = sqrt(2/pi) x (1 + 0.044715 x^2), both tails from a = exp(-2|u|)
// (nothing overflows, nothing cancels), the same operations and FMAs in the
// same order; expf is CUDA's (within 2 ulp) where the cpu's is Cephes'.
#include "common.cuh"

#define GELU_SCALING_FACTOR 0.7978845608028654f // sqrt(2/pi)
#define GELU_CUBIC          0.044715f

// s = 0.5 (1 + tanh u), s1s = s (1 - s)
__device__ __forceinline__ void gelu_sigmoid(float x, float *s, float *s1s) {
    float u = (x * GELU_SCALING_FACTOR) * fmaf(x * x, GELU_CUBIC, 1.0f);
    float a = expf(-2.0f * fabsf(u));
    float r = 1.0f / (1.0f + a), ar = a * r;
    *s = u < 0.0f ? ar : r;
    *s1s = ar * r;
}

__global__ void gelu_forward_kernel(fl_dtype dt, void *out, const void *inp, size_t n) {
    for (size_t i = fl_d_first_vec(); i < n; i += fl_d_width_vec()) {
        float x[FL_D_VEC], y[FL_D_VEC];
        fl_d_load_vec(dt, inp, i, n, x);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) {
            float s, s1s;
            gelu_sigmoid(x[k], &s, &s1s);
            y[k] = x[k] * s;
        }
        fl_d_store_vec(dt, out, i, n, y);
    }
}

// d/dx = s + x s (1 - s) 2 du/dx; dinp is overwritten (device.h)
__global__ void gelu_backward_kernel(fl_dtype dt, void *dinp, const void *inp, const void *dout,
                                     size_t n) {
    for (size_t i = fl_d_first_vec(); i < n; i += fl_d_width_vec()) {
        float x[FL_D_VEC], dy[FL_D_VEC], dx[FL_D_VEC];
        fl_d_load_vec(dt, inp, i, n, x);
        fl_d_load_vec(dt, dout, i, n, dy);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) {
            float s, s1s;
            gelu_sigmoid(x[k], &s, &s1s);
            float du2 = fmaf(x[k] * x[k], 6.0f * GELU_CUBIC * GELU_SCALING_FACTOR,
                             2.0f * GELU_SCALING_FACTOR);
            dx[k] = fmaf(x[k] * s1s, du2, s) * dy[k];
        }
        fl_d_store_vec(dt, dinp, i, n, dx);
    }
}

extern "C" void fl_cuda_gelu_forward(fl_dtype dt, void *out, const void *inp, size_t N) {
    if (!N) return;
    gelu_forward_kernel<<<fl_cuda_blocks_vec(N, 256), 256, 0, fl_cuda_stream()>>>(dt, out, inp, N);
    FL_CUDA_LAUNCHED("gelu_forward_kernel");
}

extern "C" void fl_cuda_gelu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout,
                                      size_t N) {
    if (!N) return;
    gelu_backward_kernel<<<fl_cuda_blocks_vec(N, 256), 256, 0, fl_cuda_stream()>>>(dt, dinp, inp,
                                                                                   dout, N);
    FL_CUDA_LAUNCHED("gelu_backward_kernel");
}
