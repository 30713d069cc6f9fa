// norm.cuh: what layernorm.cu and rmsnorm.cu share: a warp per row, the
// rows' rstd, and the weight gradients' column sums (columns.cuh).
#ifndef FITLM_CUDA_NORM_CUH
#define FITLM_CUDA_NORM_CUH

#include "columns.cuh"

// Rows per block of the row kernels: a warp per row.
#define NORM_ROWS 8

// A norm's 1/sqrt(var), as src/kernels/simd.h's norm_rstd: NaN for a row
// whose squares overflowed (it then shows in the loss).
__device__ __forceinline__ float norm_rstd(float var) {
    return var <= 3.4028235e38f ? 1.0f / sqrtf(var) : __int_as_float(0x7fc00000);
}

// A row's columns as a warp takes them: lane l the FL_D_VEC consecutive
// columns from c = l FL_D_VEC, then from c + 32 FL_D_VEC, ... (common.cuh's
// vector accesses); each lane's sums run in that order, then the warp's tree.
#define NORM_STRIDE (32 * FL_D_VEC)

// Columns c .. c + FL_D_VEC - 1 of a row of a norm's input as the norm
// reads them into x (0 past C); with a skip, the residual add fused with
// the norm first: the row = round(skip + row), stored (the first pass over
// a row; the later passes read the row).
__device__ __forceinline__ void norm_input(fl_dtype dt, void *row, const void *skip, int c, int C,
                                           float *x) {
    if (skip) {
        float s[FL_D_VEC];
        fl_d_load_vec(dt, skip, c, C, s);
        fl_d_load_vec(dt, row, c, C, x);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) x[k] = s[k] + x[k];
        fl_d_store_vec(dt, row, c, C, x);
    }
    fl_d_load_vec(dt, row, c, C, x);
}

// Columns c .. c + FL_D_VEC - 1 of a row's input x, of the weight w and of
// the row's output gradient dy (0 past C): what each backward pass reads.
__device__ __forceinline__ void norm_grad_inputs(fl_dtype dt, const void *xr, const void *weight,
                                                 const void *dyr, int c, int C, float *x, float *w,
                                                 float *dy) {
    fl_d_load_vec(dt, xr, c, C, x);
    fl_d_load_vec(dt, weight, c, C, w);
    fl_d_load_vec(dt, dyr, c, C, dy);
}

// A norm's dinp pass over the row at `base`, the lane's columns:
// dinp += (w dy - dm - norm dnm) rstd, norm = (x - mean) rstd. RMSNorm
// passes mean and dm 0: x - 0 and a - 0 are x and a exactly, so its own
// expression's bits.
__device__ __forceinline__ void norm_dinp_pass(fl_dtype dt, void *dinp, const void *dout,
                                               const void *inp, const void *weight, size_t base,
                                               int lane, int C, float mean, float rstd, float dm,
                                               float dnm) {
    const void *xr = fl_d_at(dt, inp, base), *dyr = fl_d_at(dt, dout, base);
    void *dxr = fl_d_at(dt, dinp, base);
    for (int c = lane * FL_D_VEC; c < C; c += NORM_STRIDE) {
        float x[FL_D_VEC], w[FL_D_VEC], dy[FL_D_VEC], dx[FL_D_VEC];
        norm_grad_inputs(dt, xr, weight, dyr, c, C, x, w, dy);
        fl_d_load_vec(dt, dxr, c, C, dx);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) {
            float norm = (x[k] - mean) * rstd;
            float dnorm = w[k] * dy[k];
            dx[k] = dx[k] + (dnorm - dm - norm * dnm) * rstd;
        }
        fl_d_store_vec(dt, dxr, c, C, dx);
    }
}

// A norm's weight and bias gradients' partials (columns.cuh), FL_D_VEC
// columns a thread: chunk blockIdx.y of the rows, columns c .. c + FL_D_VEC
// - 1 from c = (blockIdx.x COL_THREADS + tx) FL_D_VEC; each thread sums
// rows r0 + ty, r0 + ty + COL_WARPS, ... of norm dy (dw, at
// partial[chunk][c]; norm = (x - mean) rstd, RMSNorm's mean NULL: x rstd)
// and of dy (db, at partial[chunks + chunk][c]), then the block's
// COL_WARPS sums are added in order (through the kernel's __shared__ sw
// and sb). Either may be skipped.
typedef float (*norm_partials)[COL_THREADS * FL_D_VEC];
__device__ __forceinline__ void norm_columns(fl_dtype dt, float *partial, int want_dw, int want_db,
                                             const void *dout, const void *inp, const float *mean,
                                             const float *rstd, int N, int C, norm_partials sw,
                                             norm_partials sb) {
    int tx = threadIdx.x % COL_THREADS, ty = threadIdx.x / COL_THREADS;
    int c = (blockIdx.x * COL_THREADS + tx) * FL_D_VEC, chunk = blockIdx.y, chunks = gridDim.y;
    int per = (N + chunks - 1) / chunks, r0 = chunk * per, r1 = min(N, r0 + per);
    float dw[FL_D_VEC] = {0.0f}, db[FL_D_VEC] = {0.0f};
    if (c < C)
#pragma unroll 4
        for (int n = r0 + ty; n < r1; n += COL_WARPS) {
            float x[FL_D_VEC], dy[FL_D_VEC], m = mean ? mean[n] : 0.0f, r = rstd[n];
            size_t row = (size_t)n * C;
            fl_d_load_vec(dt, inp, row + c, row + C, x);
            fl_d_load_vec(dt, dout, row + c, row + C, dy);
#pragma unroll
            for (int k = 0; k < FL_D_VEC; k++) {
                db[k] += dy[k];
                dw[k] += (x[k] - m) * r * dy[k];
            }
        }
#pragma unroll
    for (int k = 0; k < FL_D_VEC; k++) {
        sw[ty][tx * FL_D_VEC + k] = dw[k];
        sb[ty][tx * FL_D_VEC + k] = db[k];
    }
    __syncthreads();
    if (ty != 0) return;
    for (int k = 0; k < FL_D_VEC && c + k < C; k++) {
        float sdw = 0.0f, sdb = 0.0f;
        for (int w = 0; w < COL_WARPS; w++) {
            sdw += sw[w][tx * FL_D_VEC + k];
            sdb += sb[w][tx * FL_D_VEC + k];
        }
        if (want_dw) partial[(size_t)chunk * C + c + k] = sdw;
        if (want_db) partial[((size_t)chunks + chunk) * C + c + k] = sdb;
    }
}

// the grid of norm_columns over C columns in `chunks` row chunks
static inline dim3 norm_columns_grid(int C, int chunks) {
    int per_block = COL_THREADS * FL_D_VEC;
    return dim3((unsigned)((C + per_block - 1) / per_block), (unsigned)chunks);
}

#endif
