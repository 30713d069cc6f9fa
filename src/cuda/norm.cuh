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

#endif
