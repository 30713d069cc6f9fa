// rmsnorm.cu: RMSNorm over the last dim C, as Hugging Face's LlamaRMSNorm
// (src/kernels/rmsnorm.c): y = x rstd w, rstd = rsqrt(mean(x^2) + eps); a
// warp per row, the cpu's formulas operation for operation. The weight
// gradient is a column sum in two deterministic passes (columns.cuh).
#include "norm.cuh"

// inp is written only with a skip (the fused residual add: norm_input)
__global__ void rmsnorm_forward_kernel(fl_dtype dt, void *out, float *rstd, void *inp,
                                       const void *skip, const void *weight, int N, int C,
                                       float eps) {
    int row = blockIdx.x * NORM_ROWS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return; // the whole warp
    size_t base = (size_t)row * C;
    void *xr = fl_d_at(dt, inp, base);
    const void *sr = skip ? fl_d_at(dt, skip, base) : NULL;
    float ss = 0.0f;
    for (int c = lane * FL_D_VEC; c < C; c += NORM_STRIDE) {
        float x[FL_D_VEC];
        norm_input(dt, xr, sr, c, C, x);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++)
            if (c + k < C) ss += x[k] * x[k];
    }
    float r = norm_rstd(__shfl_sync(0xffffffffu, fl_d_warp_sum(ss), 0) / C + eps);
    if (lane == 0) rstd[row] = r;
    for (int c = lane * FL_D_VEC; c < C; c += NORM_STRIDE) {
        float x[FL_D_VEC], w[FL_D_VEC];
        fl_d_load_vec(dt, xr, c, C, x);
        fl_d_load_vec(dt, weight, c, C, w);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) x[k] = x[k] * r * w[k];
        fl_d_store_vec(dt, fl_d_at(dt, out, base), c, C, x);
    }
}

// dinp += (w dy - norm mean(w dy norm)) rstd, norm = x rstd
__global__ void rmsnorm_dinp_kernel(fl_dtype dt, void *dinp, const void *dout, const void *inp,
                                    const void *weight, const float *rstd, int N, int C) {
    int row = blockIdx.x * NORM_ROWS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    size_t base = (size_t)row * C;
    const void *xr = fl_d_at(dt, inp, base), *dyr = fl_d_at(dt, dout, base);
    float r = rstd[row], dnm = 0.0f;
#pragma unroll 4 // loads only: several chunks' in flight
    for (int c = lane * FL_D_VEC; c < C; c += NORM_STRIDE) {
        float x[FL_D_VEC], w[FL_D_VEC], dy[FL_D_VEC];
        norm_grad_inputs(dt, xr, weight, dyr, c, C, x, w, dy);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++)
            if (c + k < C) dnm += w[k] * dy[k] * (x[k] * r);
    }
    dnm = __shfl_sync(0xffffffffu, fl_d_warp_sum(dnm), 0) / C;
    norm_dinp_pass(dt, dinp, dout, inp, weight, base, lane, C, 0.0f, r, 0.0f, dnm);
}

// the weight gradient's partials (norm.cuh; no mean: x rstd dy)
__global__ void rmsnorm_columns_kernel(fl_dtype dt, float *partial, const void *dout,
                                       const void *inp, const float *rstd, int N, int C) {
    __shared__ float sw[COL_WARPS][COL_THREADS * FL_D_VEC], sb[COL_WARPS][COL_THREADS * FL_D_VEC];
    norm_columns(dt, partial, 1, 0, dout, inp, NULL, rstd, N, C, sw, sb);
}

extern "C" void fl_cuda_rmsnorm_forward(fl_dtype dt, void *out, float *rstd, const void *inp,
                                        const void *weight, int N, int C, float eps) {
    if (N <= 0) return;
    rmsnorm_forward_kernel<<<(N + NORM_ROWS - 1) / NORM_ROWS, NORM_ROWS * 32, 0,
                             fl_cuda_stream()>>>(dt, out, rstd, (void *)inp, NULL, weight, N, C,
                                                 eps);
    FL_CUDA_LAUNCHED("rmsnorm_forward_kernel");
}

extern "C" void fl_cuda_residual_rmsnorm_forward(fl_dtype dt, void *res, void *out, float *rstd,
                                                 const void *skip, const void *weight, int N, int C,
                                                 float eps) {
    if (N <= 0) return;
    rmsnorm_forward_kernel<<<(N + NORM_ROWS - 1) / NORM_ROWS, NORM_ROWS * 32, 0,
                             fl_cuda_stream()>>>(dt, out, rstd, res, skip, weight, N, C, eps);
    FL_CUDA_LAUNCHED("rmsnorm_forward_kernel (residual)");
}

extern "C" void fl_cuda_rmsnorm_backward(fl_dtype dt, void *dinp, void *dweight, const void *dout,
                                         const void *inp, const void *weight, const float *rstd,
                                         int N, int C) {
    if (N <= 0) return;
    rmsnorm_dinp_kernel<<<(N + NORM_ROWS - 1) / NORM_ROWS, NORM_ROWS * 32, 0, fl_cuda_stream()>>>(
        dt, dinp, dout, inp, weight, rstd, N, C);
    FL_CUDA_LAUNCHED("rmsnorm_dinp_kernel");
    if (!dweight) return; // frozen
    int chunks = column_chunks(N);
    float *partial = (float *)fl_cuda_scratch((size_t)chunks * C * sizeof(float));
    rmsnorm_columns_kernel<<<norm_columns_grid(C, chunks), COL_THREADS * COL_WARPS, 0,
                             fl_cuda_stream()>>>(dt, partial, dout, inp, rstd, N, C);
    FL_CUDA_LAUNCHED("rmsnorm_columns_kernel");
    fl_cuda_column_finish(dt, dweight, partial, chunks, C);
}
