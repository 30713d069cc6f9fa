// kernel_util.cuh: what the kernels of attention.cu, softmax_xent.cu,
// lora.cu and nf4.cu share, under the names of the backend's common.cuh and
// cuda.h (branch dev-cuda1), which replace this file when the two meet:
// fp32 loads and round-to-nearest-even stores of the storage dtypes
// (kernels.h: fp32 math, each output rounded once), the compute stream and
// the launch check.
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

// The stream every launch is issued on, in call order: the legacy default
// stream (cuda.h's fl_cuda_stream is the device's compute stream).
static inline cudaStream_t fl_cuda_stream(void) {
    return 0;
}

// Dies naming the kernel when its launch failed (bad configuration, no
// kernel image for this GPU, a fault of an earlier launch).
static inline void fl_cuda_launched(const char *kernel, const char *file, int line) {
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) fl_die("cuda: %s (%s:%d): %s", kernel, file, line, cudaGetErrorString(e));
}
#define FL_CUDA_LAUNCHED(kernel) fl_cuda_launched(kernel, __FILE__, __LINE__)

// element i of p (dtype dt) as fp32
__device__ __forceinline__ float fl_d_load(fl_dtype dt, const void *p, size_t i) {
    if (dt == FL_F32) return ((const float *)p)[i];
    if (dt == FL_BF16) return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    return __half2float(((const __half *)p)[i]);
}

// x rounded into element i of p (dtype dt)
__device__ __forceinline__ void fl_d_store(fl_dtype dt, void *p, size_t i, float x) {
    if (dt == FL_F32)
        ((float *)p)[i] = x;
    else if (dt == FL_BF16)
        ((__nv_bfloat16 *)p)[i] = __float2bfloat16_rn(x);
    else
        ((__half *)p)[i] = __float2half_rn(x);
}

// Element i of a buffer of dtype dt (fl_at and fl_at_const of dtype.h, for
// device code).
__device__ __forceinline__ void *fl_dat(fl_dtype dt, void *base, size_t i) {
    return (char *)base + i * (dt == FL_F32 ? 4 : 2);
}
__device__ __forceinline__ const void *fl_dat(fl_dtype dt, const void *base, size_t i) {
    return (const char *)base + i * (dt == FL_F32 ? 4 : 2);
}

// Blocks of `threads` for n work items (the kernels loop grid-stride, so
// any count covers them).
static inline unsigned fl_cuda_blocks(size_t n, int threads) {
    size_t b = (n + (size_t)threads - 1) / (size_t)threads;
    return (unsigned)(b < 65536 ? (b ? b : 1) : 65536);
}

#endif
