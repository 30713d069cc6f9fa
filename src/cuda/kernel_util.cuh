// kernel_util.cuh: what every CUDA kernel file shares: fp32 loads and
// round-to-nearest-even stores of the storage dtypes (kernels.h's contract:
// fp32 math, each output rounded once), the stream launches go on, and the
// launch check.
#ifndef FITLM_CUDA_KERNEL_UTIL_CUH
#define FITLM_CUDA_KERNEL_UTIL_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

extern "C" {
#include "fitlm/core.h"
#include "fitlm/dtype.h"
}

// The legacy default stream: every launch of this backend is issued on it,
// in call order, and it is ordered against the blocking streams the table
// creates (its copies).
static inline cudaStream_t fl_cuda_compute_stream(void) {
    return 0;
}

// Dies naming the kernel when its launch failed (bad configuration, no
// kernel image for this GPU, a fault of an earlier launch).
static inline void fl_cuda_launched(const char *what) {
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) fl_die("cuda: %s: %s", what, cudaGetErrorString(e));
}

__device__ __forceinline__ float fl_ld(fl_dtype dt, const void *p, size_t i) {
    if (dt == FL_F32) return ((const float *)p)[i];
    if (dt == FL_BF16) return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    return __half2float(((const __half *)p)[i]);
}

__device__ __forceinline__ void fl_st(fl_dtype dt, void *p, size_t i, float v) {
    if (dt == FL_F32)
        ((float *)p)[i] = v;
    else if (dt == FL_BF16)
        ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(v);
    else
        ((__half *)p)[i] = __float2half_rn(v);
}

// Element i of a buffer of dtype dt (fl_at and fl_at_const for device code).
__device__ __forceinline__ void *fl_dat(fl_dtype dt, void *base, size_t i) {
    return (char *)base + i * (dt == FL_F32 ? 4 : 2);
}
__device__ __forceinline__ const void *fl_dat(fl_dtype dt, const void *base, size_t i) {
    return (const char *)base + i * (dt == FL_F32 ? 4 : 2);
}

// Grid size for n elements at `threads` per block, one element per thread.
static inline unsigned fl_cuda_blocks(size_t n, int threads) {
    return (unsigned)((n + (size_t)threads - 1) / (size_t)threads);
}

#endif
