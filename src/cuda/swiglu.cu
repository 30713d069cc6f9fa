// swiglu.cu: LLaMA's MLP gate, as the vector paths of src/kernels/swiglu.c:
// each row of inp (N,2IC) is [gate | up], out (N,IC) = silu(gate) * up;
// sigmoid(x) and 1 - sigmoid(x) both from e = exp(-|x|), the same operations
// and FMAs in the same order. Streaming kernels (common.cuh's vector accesses).
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

// whether elements i .. i + FL_D_VEC - 1 of out lie in one row (below n):
// then their gates, and their ups, are FL_D_VEC consecutive elements of inp
__device__ __forceinline__ bool swiglu_in_row(size_t i, size_t n, int IC) {
    return i % (size_t)IC + FL_D_VEC <= (size_t)IC && i + FL_D_VEC <= n;
}

// the gates and ups of elements i .. i + FL_D_VEC - 1 of out (0 past n):
// vector loads where they lie in one row, else one by one
__device__ __forceinline__ void swiglu_load(fl_dtype dt, const void *inp, size_t i, size_t n,
                                            int IC, float *x, float *up) {
    size_t g = swiglu_gate(i, IC);
    if (swiglu_in_row(i, n, IC)) {
        fl_d_load_vec(dt, inp, g, g + FL_D_VEC, x);
        fl_d_load_vec(dt, inp, g + IC, g + IC + FL_D_VEC, up);
        return;
    }
#pragma unroll
    for (int k = 0; k < FL_D_VEC; k++) {
        int live = i + k < n;
        g = swiglu_gate(i + k, IC);
        x[k] = live ? fl_d_load(dt, inp, g) : 0.0f;
        up[k] = live ? fl_d_load(dt, inp, g + IC) : 0.0f;
    }
}

// swiglu_load's twin: dg and du into the gates' and ups' places in dinp
__device__ __forceinline__ void swiglu_store(fl_dtype dt, void *dinp, size_t i, size_t n, int IC,
                                             const float *dg, const float *du) {
    size_t g = swiglu_gate(i, IC);
    if (swiglu_in_row(i, n, IC)) {
        fl_d_store_vec(dt, dinp, g, g + FL_D_VEC, dg);
        fl_d_store_vec(dt, dinp, g + IC, g + IC + FL_D_VEC, du);
        return;
    }
    for (int k = 0; k < FL_D_VEC && i + k < n; k++) {
        g = swiglu_gate(i + k, IC);
        fl_d_store(dt, dinp, g, dg[k]);
        fl_d_store(dt, dinp, g + IC, du[k]);
    }
}

__global__ void swiglu_forward_kernel(fl_dtype dt, void *out, const void *inp, size_t n, int IC) {
    for (size_t i = fl_d_first_vec(); i < n; i += fl_d_width_vec()) {
        float x[FL_D_VEC], up[FL_D_VEC], y[FL_D_VEC];
        swiglu_load(dt, inp, i, n, IC, x, up);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) {
            float s, s1;
            swiglu_sigmoid(x[k], &s, &s1);
            y[k] = (x[k] * s) * up[k];
        }
        fl_d_store_vec(dt, out, i, n, y);
    }
}

// dgate = (dout up) s (1 + x s1),  dup = dout (x s): dinp is overwritten
// (device.h)
__global__ void swiglu_backward_kernel(fl_dtype dt, void *dinp, const void *inp, const void *dout,
                                       size_t n, int IC) {
    for (size_t i = fl_d_first_vec(); i < n; i += fl_d_width_vec()) {
        float x[FL_D_VEC], up[FL_D_VEC], dy[FL_D_VEC], dg[FL_D_VEC], du[FL_D_VEC];
        fl_d_load_vec(dt, dout, i, n, dy);
        swiglu_load(dt, inp, i, n, IC, x, up);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) {
            float s, s1;
            swiglu_sigmoid(x[k], &s, &s1);
            float ds = s * fmaf(x[k], s1, 1.0f);
            dg[k] = dy[k] * up[k] * ds;
            du[k] = dy[k] * (x[k] * s);
        }
        swiglu_store(dt, dinp, i, n, IC, dg, du);
    }
}

extern "C" void fl_cuda_swiglu_forward(fl_dtype dt, void *out, const void *inp, int N, int IC) {
    size_t n = (size_t)N * IC;
    if (!n) return;
    swiglu_forward_kernel<<<fl_cuda_blocks_vec(n, 256), 256, 0, fl_cuda_stream()>>>(dt, out, inp, n,
                                                                                    IC);
    FL_CUDA_LAUNCHED("swiglu_forward_kernel");
}

extern "C" void fl_cuda_swiglu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout,
                                        int N, int IC) {
    size_t n = (size_t)N * IC;
    if (!n) return;
    swiglu_backward_kernel<<<fl_cuda_blocks_vec(n, 256), 256, 0, fl_cuda_stream()>>>(dt, dinp, inp,
                                                                                     dout, n, IC);
    FL_CUDA_LAUNCHED("swiglu_backward_kernel");
}
