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

// Elements c, c + 32, ... (FL_D_ILP of them, below C) of a row of a norm's
// input as the norm reads them into x (0 past C); with a skip, the residual
// add fused with the norm first: the row = round(skip + row), stored (the
// first pass over a row; the later passes read the row). Lane by lane the
// rows are read FL_D_ILP loads at a time (common.cuh).
__device__ __forceinline__ void norm_input(fl_dtype dt, void *row, const void *skip, int c, int C,
                                           float *x) {
    if (skip) {
        float s[FL_D_ILP];
        fl_d_load_ilp(dt, skip, c, 32, C, s);
        fl_d_load_ilp(dt, row, c, 32, C, x);
#pragma unroll
        for (int k = 0; k < FL_D_ILP; k++) x[k] = s[k] + x[k];
        fl_d_store_ilp(dt, row, c, 32, C, x);
    }
    fl_d_load_ilp(dt, row, c, 32, C, x);
}

// A norm's dinp pass over the row at `base`, the lane's columns c, c + 32,
// ... FL_D_ILP at a time: dinp += (w dy - dm - norm dnm) rstd, norm =
// (x - mean) rstd. RMSNorm passes mean and dm 0: x - 0 and a - 0 are x and
// a exactly, so its own expression's bits.
__device__ __forceinline__ void norm_dinp_pass(fl_dtype dt, void *dinp, const void *dout,
                                               const void *inp, const void *weight, size_t base,
                                               int lane, int C, float mean, float rstd, float dm,
                                               float dnm) {
    const void *xr = fl_d_at(dt, inp, base), *dyr = fl_d_at(dt, dout, base);
    void *dxr = fl_d_at(dt, dinp, base);
    for (int c = lane; c < C; c += FL_D_ILP * 32) {
        float x[FL_D_ILP], w[FL_D_ILP], dy[FL_D_ILP], dx[FL_D_ILP];
        fl_d_load_ilp(dt, xr, c, 32, C, x);
        fl_d_load_ilp(dt, weight, c, 32, C, w);
        fl_d_load_ilp(dt, dyr, c, 32, C, dy);
        fl_d_load_ilp(dt, dxr, c, 32, C, dx);
#pragma unroll
        for (int k = 0; k < FL_D_ILP; k++) {
            float norm = (x[k] - mean) * rstd;
            float dnorm = w[k] * dy[k];
            dx[k] = dx[k] + (dnorm - dm - norm * dnm) * rstd;
        }
        fl_d_store_ilp(dt, dxr, c, 32, C, dx);
    }
}

#endif
