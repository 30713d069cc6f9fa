// swiglu.cu: LLaMA's MLP gate, as the vector paths of src/kernels/swiglu.c:
// each row of inp (N,2IC) is [gate | up], out (N,IC) = silu(gate) * up;
// sigmoid(x) and 1 - sigmoid(x) both from e = exp(-|x|), the same operations
// and FMAs in the same order. One thread per output value (grid-stride).
#include "common.cuh"

// s = sigmoid(x), s1 = 1 - sigmoid(x)
__device__ __forceinline__ void swiglu_sigmoid(float x, float *s, float *s1) {
    float e = expf(-fabsf(x));
    float r = 1.0f / (1.0f + e), er = e * r;
    *s = x < 0.0f ? er : r;
    *s1 = x < 0.0f ? r : er;
}

__global__ void swiglu_forward_kernel(fl_dtype dt, void *out, const void *inp, size_t n, int IC) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t row = i / (size_t)IC, g = row * 2 * IC + i % (size_t)IC;
        float x = fl_d_load(dt, inp, g), s, s1;
        swiglu_sigmoid(x, &s, &s1);
        fl_d_store(dt, out, i, (x * s) * fl_d_load(dt, inp, g + IC));
    }
}

// dgate += (dout up) s (1 + x s1),  dup += dout (x s)
__global__ void swiglu_backward_kernel(fl_dtype dt, void *dinp, const void *inp, const void *dout,
                                       size_t n, int IC) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t row = i / (size_t)IC, g = row * 2 * IC + i % (size_t)IC, u = g + IC;
        float x = fl_d_load(dt, inp, g), s, s1;
        swiglu_sigmoid(x, &s, &s1);
        float dy = fl_d_load(dt, dout, i);
        float ds = s * fmaf(x, s1, 1.0f);
        fl_d_store(dt, dinp, g, fmaf(dy * fl_d_load(dt, inp, u), ds, fl_d_load(dt, dinp, g)));
        fl_d_store(dt, dinp, u, fmaf(dy, x * s, fl_d_load(dt, dinp, u)));
    }
}

extern "C" void fl_cuda_swiglu_forward(fl_dtype dt, void *out, const void *inp, int N, int IC) {
    size_t n = (size_t)N * IC;
    if (!n) return;
    swiglu_forward_kernel<<<fl_cuda_blocks(n, 256), 256, 0, fl_cuda_stream()>>>(dt, out, inp, n,
                                                                                IC);
    FL_CUDA_LAUNCHED("swiglu_forward_kernel");
}

extern "C" void fl_cuda_swiglu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout,
                                        int N, int IC) {
    size_t n = (size_t)N * IC;
    if (!n) return;
    swiglu_backward_kernel<<<fl_cuda_blocks(n, 256), 256, 0, fl_cuda_stream()>>>(dt, dinp, inp,
                                                                                 dout, n, IC);
    FL_CUDA_LAUNCHED("swiglu_backward_kernel");
}
