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
    for (int c = lane; c < C; c += FL_D_ILP * 32) {
        float x[FL_D_ILP];
        norm_input(dt, xr, sr, c, C, x);
#pragma unroll
        for (int k = 0; k < FL_D_ILP; k++)
            if (c + 32 * k < C) s += x[k];
    }
    float m = __shfl_sync(0xffffffffu, fl_d_warp_sum(s), 0) / C;
    float v = 0.0f;
    for (int c = lane; c < C; c += 32) {
        float d = fl_d_load(dt, xr, c) - m;
        v += d * d;
    }
    float r = norm_rstd(__shfl_sync(0xffffffffu, fl_d_warp_sum(v), 0) / C + LN_EPS);
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
    for (int c = lane; c < C; c += FL_D_ILP * 32) {
        float x[FL_D_ILP], w[FL_D_ILP], b[FL_D_ILP];
        fl_d_load_ilp(dt, xr, c, 32, C, x);
        fl_d_load_ilp(dt, weight, c, 32, C, w);
        fl_d_load_ilp(dt, bias, c, 32, C, b);
#pragma unroll
        for (int k = 0; k < FL_D_ILP; k++) x[k] = (x[k] - m) * r * w[k] + b[k];
        fl_d_store_ilp(dt, fl_d_at(dt, out, base), c, 32, C, x);
    }
}

// dinp += ((w dy - mean(w dy)) - norm mean(w dy norm)) rstd, a warp per row
__global__ void layernorm_dinp_kernel(fl_dtype dt, void *dinp, const void *dout, const void *inp,
                                      const void *weight, const float *mean, const float *rstd,
                                      int N, int C) {
    int row = blockIdx.x * NORM_ROWS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;
    size_t base = (size_t)row * C;
    float m = mean[row], r = rstd[row], dm = 0.0f, dnm = 0.0f;
    for (int c = lane; c < C; c += 32) {
        float dnorm = fl_d_load(dt, weight, c) * fl_d_load(dt, dout, base + c);
        dm += dnorm;
        dnm += dnorm * (fl_d_load(dt, inp, base + c) - m) * r;
    }
    dm = __shfl_sync(0xffffffffu, fl_d_warp_sum(dm), 0) / C;
    dnm = __shfl_sync(0xffffffffu, fl_d_warp_sum(dnm), 0) / C;
    norm_dinp_pass(dt, dinp, dout, inp, weight, base, lane, C, m, r, dm, dnm);
}

// Chunk blockIdx.y of the rows, columns blockIdx.x * 32 ..: dw partial
// sums of norm * dy at partial[chunk][c], db's of dy at partial[chunks +
// chunk][c] (either may be skipped).
__global__ void layernorm_columns_kernel(fl_dtype dt, float *partial, int want_dw, int want_db,
                                         const void *dout, const void *inp, const float *mean,
                                         const float *rstd, int N, int C) {
    __shared__ float sw[COL_WARPS][COL_THREADS], sb[COL_WARPS][COL_THREADS];
    int tx = threadIdx.x % COL_THREADS, ty = threadIdx.x / COL_THREADS;
    int c = blockIdx.x * COL_THREADS + tx, chunk = blockIdx.y, chunks = gridDim.y;
    int per = (N + chunks - 1) / chunks, r0 = chunk * per, r1 = min(N, r0 + per);
    float dw = 0.0f, db = 0.0f;
    if (c < C)
        for (int n = r0 + ty; n < r1; n += COL_WARPS) {
            size_t at = (size_t)n * C + c;
            float dy = fl_d_load(dt, dout, at);
            db += dy;
            dw += (fl_d_load(dt, inp, at) - mean[n]) * rstd[n] * dy;
        }
    sw[ty][tx] = dw;
    sb[ty][tx] = db;
    __syncthreads();
    if (ty != 0 || c >= C) return;
    dw = 0.0f, db = 0.0f;
    for (int w = 0; w < COL_WARPS; w++) {
        dw += sw[w][tx];
        db += sb[w][tx];
    }
    if (want_dw) partial[(size_t)chunk * C + c] = dw;
    if (want_db) partial[((size_t)chunks + chunk) * C + c] = db;
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
    dim3 grid((unsigned)((C + COL_THREADS - 1) / COL_THREADS), (unsigned)chunks);
    layernorm_columns_kernel<<<grid, COL_THREADS * COL_WARPS, 0, fl_cuda_stream()>>>(
        dt, partial, dweight != NULL, dbias != NULL, dout, inp, mean, rstd, N, C);
    FL_CUDA_LAUNCHED("layernorm_columns_kernel");
    unsigned blocks = (unsigned)((C + 255) / 256);
    if (dweight) {
        column_finish<<<blocks, 256, 0, fl_cuda_stream()>>>(dt, dweight, partial, chunks, C);
        FL_CUDA_LAUNCHED("column_finish");
    }
    if (dbias) {
        column_finish<<<blocks, 256, 0, fl_cuda_stream()>>>(dt, dbias, partial + (size_t)chunks * C,
                                                            chunks, C);
        FL_CUDA_LAUNCHED("column_finish");
    }
}
