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

// Element i of a norm's input x as the norm reads it; with a skip, the
// residual add fused with the norm first: x = round(skip + x), stored (the
// first pass over a row; the later passes read x).
__device__ __forceinline__ float norm_input(fl_dtype dt, void *x, const void *skip, size_t i) {
    if (skip) fl_d_store(dt, x, i, fl_d_load(dt, skip, i) + fl_d_load(dt, x, i));
    return fl_d_load(dt, x, i);
}

#endif
