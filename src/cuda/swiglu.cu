// swiglu.cu: LLaMA's MLP gate, as the vector paths of src/kernels/swiglu.c:
// each row of inp (N,2IC) is [gate | up], out (N,IC) = silu(gate) * up;
// sigmoid(x) and 1 - sigmoid(x) both from e = exp(-|x|), the same operations
// and FMAs in the same order. A streaming kernel (common.cuh's FL_D_ILP).
#include "common.cuh"

// s = sigmoid(x), s1 = 1 - sigmoid(x)
__device__ __forceinline__ void swiglu_sigmoid(float x, float *s, float *s1) {
    float e = expf(-fabsf(x));
    float r = 1.0f / (1.0f + e), er = e * r;
    *s = x < 0.0f ? er : r;
    *s1 = x < 0.0f ? r : er;
}

// element i of out (N,IC): its gate's index in inp (N,2IC); the up is IC on
__device__ __forceinline__ size_t swiglu_gate(size_t i, int IC) {
    return i / (size_t)IC * 2 * IC + i % (size_t)IC;
}

__global__ void swiglu_forward_kernel(fl_dtype dt, void *out, const void *inp, size_t n, int IC) {
    size_t w = fl_d_width();
    for (size_t i = fl_d_first(); i < n; i += FL_D_ILP * w) {
        float x[FL_D_ILP], up[FL_D_ILP], y[FL_D_ILP];
#pragma unroll
        for (int k = 0; k < FL_D_ILP; k++) {
            size_t g = swiglu_gate(i + k * w, IC);
            x[k] = i + k * w < n ? fl_d_load(dt, inp, g) : 0.0f;
            up[k] = i + k * w < n ? fl_d_load(dt, inp, g + IC) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < FL_D_ILP; k++) {
            float s, s1;
            swiglu_sigmoid(x[k], &s, &s1);
            y[k] = (x[k] * s) * up[k];
        }
        fl_d_store_ilp(dt, out, i, w, n, y);
    }
}

// dgate = (dout up) s (1 + x s1),  dup = dout (x s): dinp is overwritten
// (device.h)
__global__ void swiglu_backward_kernel(fl_dtype dt, void *dinp, const void *inp, const void *dout,
                                       size_t n, int IC) {
    size_t w = fl_d_width();
    for (size_t i = fl_d_first(); i < n; i += FL_D_ILP * w) {
        float x[FL_D_ILP], up[FL_D_ILP], dy[FL_D_ILP];
        fl_d_load_ilp(dt, dout, i, w, n, dy);
#pragma unroll
        for (int k = 0; k < FL_D_ILP; k++) {
            int live = i + k * w < n;
            size_t g = swiglu_gate(i + k * w, IC);
            x[k] = live ? fl_d_load(dt, inp, g) : 0.0f;
            up[k] = live ? fl_d_load(dt, inp, g + IC) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < FL_D_ILP; k++) {
            float s, s1;
            swiglu_sigmoid(x[k], &s, &s1);
            float ds = s * fmaf(x[k], s1, 1.0f);
            if (i + k * w >= n) continue;
            size_t g = swiglu_gate(i + k * w, IC);
            fl_d_store(dt, dinp, g, dy[k] * up[k] * ds);
            fl_d_store(dt, dinp, g + IC, dy[k] * (x[k] * s));
        }
    }
}

extern "C" void fl_cuda_swiglu_forward(fl_dtype dt, void *out, const void *inp, int N, int IC) {
    size_t n = (size_t)N * IC;
    if (!n) return;
    swiglu_forward_kernel<<<fl_cuda_blocks_ilp(n, 256), 256, 0, fl_cuda_stream()>>>(dt, out, inp, n,
                                                                                    IC);
    FL_CUDA_LAUNCHED("swiglu_forward_kernel");
}

extern "C" void fl_cuda_swiglu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout,
                                        int N, int IC) {
    size_t n = (size_t)N * IC;
    if (!n) return;
    swiglu_backward_kernel<<<fl_cuda_blocks_ilp(n, 256), 256, 0, fl_cuda_stream()>>>(dt, dinp, inp,
                                                                                     dout, n, IC);
    FL_CUDA_LAUNCHED("swiglu_backward_kernel");
}
