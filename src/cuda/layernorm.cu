// layernorm.cu: LayerNorm over the last dim C, biased variance, eps 1e-5
// (src/kernels/layernorm.c): a warp per row, statistics in fp32, the
// cpu's formulas operation for operation (no contraction). The weight and
// bias gradients are column sums in two deterministic passes (columns.cuh).
#include "norm.cuh"

#define LN_EPS 1e-5f

// inp is written only with a skip (the fused residual add: norm_input)
__global__ void layernorm_forward_kernel(fl_dtype dt, void *out, float *mean, float *rstd,
                                         void *inp, const void *skip, const void *weight,
                                         const void *bias, int N, int C) {
    int row = blockIdx.x * NORM_ROWS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return; // the whole warp
    size_t base = (size_t)row * C;
    void *xr = fl_d_at(dt, inp, base);
    const void *sr = skip ? fl_d_at(dt, skip, base) : NULL;
    float s = 0.0f;
    for (int c = lane * FL_D_VEC; c < C; c += NORM_STRIDE) {
        float x[FL_D_VEC];
        norm_input(dt, xr, sr, c, C, x);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++)
            if (c + k < C) s += x[k];
    }
    float m = __shfl_sync(0xffffffffu, fl_d_warp_sum(s), 0) / C;
    float v = 0.0f;
#pragma unroll 4 // loads only: several chunks' in flight
    for (int c = lane * FL_D_VEC; c < C; c += NORM_STRIDE) {
        float x[FL_D_VEC];
        fl_d_load_vec(dt, xr, c, C, x);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) {
            float d = x[k] - m;
            if (c + k < C) v += d * d;
        }
    }
    float r = norm_rstd(__shfl_sync(0xffffffffu, fl_d_warp_sum(v), 0) / C + LN_EPS);
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
    for (int c = lane * FL_D_VEC; c < C; c += NORM_STRIDE) {
        float x[FL_D_VEC], w[FL_D_VEC], b[FL_D_VEC];
        fl_d_load_vec(dt, xr, c, C, x);
        fl_d_load_vec(dt, weight, c, C, w);
        fl_d_load_vec(dt, bias, c, C, b);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) x[k] = (x[k] - m) * r * w[k] + b[k];
        fl_d_store_vec(dt, fl_d_at(dt, out, base), c, C, x);
    }
}

// dinp += ((w dy - mean(w dy)) - norm mean(w dy norm)) rstd, a warp per row
__global__ void layernorm_dinp_kernel(fl_dtype dt, void *dinp, const void *dout, const void *inp,
                                      const void *weight, const float *mean, const float *rstd,
                                      int N, int C) {
    int row = blockIdx.x * NORM_ROWS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    size_t base = (size_t)row * C;
    const void *xr = fl_d_at(dt, inp, base), *dyr = fl_d_at(dt, dout, base);
    float m = mean[row], r = rstd[row], dm = 0.0f, dnm = 0.0f;
#pragma unroll 4 // loads only: several chunks' in flight
    for (int c = lane * FL_D_VEC; c < C; c += NORM_STRIDE) {
        float x[FL_D_VEC], w[FL_D_VEC], dy[FL_D_VEC];
        norm_grad_inputs(dt, xr, weight, dyr, c, C, x, w, dy);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) {
            if (c + k >= C) break;
            float dnorm = w[k] * dy[k];
            dm += dnorm;
            dnm += dnorm * (x[k] - m) * r;
        }
    }
    dm = __shfl_sync(0xffffffffu, fl_d_warp_sum(dm), 0) / C;
    dnm = __shfl_sync(0xffffffffu, fl_d_warp_sum(dnm), 0) / C;
    norm_dinp_pass(dt, dinp, dout, inp, weight, base, lane, C, m, r, dm, dnm);
}

// the weight and bias gradients' partials (norm.cuh)
__global__ void layernorm_columns_kernel(fl_dtype dt, float *partial, int want_dw, int want_db,
                                         const void *dout, const void *inp, const float *mean,
                                         const float *rstd, int N, int C) {
    __shared__ float sw[COL_WARPS][COL_THREADS * FL_D_VEC], sb[COL_WARPS][COL_THREADS * FL_D_VEC];
    norm_columns(dt, partial, want_dw, want_db, dout, inp, mean, rstd, N, C, sw, sb);
}

extern "C" void fl_cuda_layernorm_forward(fl_dtype dt, void *out, float *mean, float *rstd,
                                          const void *inp, const void *weight, const void *bias,
                                          int N, int C) {
    if (N <= 0) return;
    layernorm_forward_kernel<<<(N + NORM_ROWS - 1) / NORM_ROWS, NORM_ROWS * 32, 0,
                               fl_cuda_stream()>>>(dt, out, mean, rstd, (void *)inp, NULL, weight,
                                                   bias, N, C);
    FL_CUDA_LAUNCHED("layernorm_forward_kernel");
}

extern "C" void fl_cuda_residual_layernorm_forward(fl_dtype dt, void *res, void *out, float *mean,
                                                   float *rstd, const void *skip,
                                                   const void *weight, const void *bias, int N,
                                                   int C) {
    if (N <= 0) return;
    layernorm_forward_kernel<<<(N + NORM_ROWS - 1) / NORM_ROWS, NORM_ROWS * 32, 0,
                               fl_cuda_stream()>>>(dt, out, mean, rstd, res, skip, weight, bias, N,
                                                   C);
    FL_CUDA_LAUNCHED("layernorm_forward_kernel (residual)");
}

extern "C" void fl_cuda_layernorm_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias,
                                           const void *dout, const void *inp, const void *weight,
                                           const float *mean, const float *rstd, int N, int C) {
    if (N <= 0) return;
    layernorm_dinp_kernel<<<(N + NORM_ROWS - 1) / NORM_ROWS, NORM_ROWS * 32, 0, fl_cuda_stream()>>>(
        dt, dinp, dout, inp, weight, mean, rstd, N, C);
    FL_CUDA_LAUNCHED("layernorm_dinp_kernel");
    if (!dweight && !dbias) return; // frozen
    int chunks = column_chunks(N);
    float *partial = (float *)fl_cuda_scratch(2 * (size_t)chunks * C * sizeof(float));
    layernorm_columns_kernel<<<norm_columns_grid(C, chunks), COL_THREADS * COL_WARPS, 0,
                               fl_cuda_stream()>>>(dt, partial, dweight != NULL, dbias != NULL,
                                                   dout, inp, mean, rstd, N, C);
    FL_CUDA_LAUNCHED("layernorm_columns_kernel");
    if (dweight) fl_cuda_column_finish(dt, dweight, partial, chunks, C);
    if (dbias) fl_cuda_column_finish(dt, dbias, partial + (size_t)chunks * C, chunks, C);
}
