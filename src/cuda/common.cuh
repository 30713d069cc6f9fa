// common.cuh: device helpers the kernels share. Storage dtypes load to fp32
// and store from it with the bits of src/core/dtype.c (bf16 and fp16 round
// to nearest even, NaN quieted with its top payload bits kept, fp16
// subnormals kept), so a kernel that does the cpu's arithmetic stores the
// cpu's bits. Reductions go through fixed trees (no atomics): the same
// launch gives the same bits.
#ifndef FITLM_CUDA_COMMON_CUH
#define FITLM_CUDA_COMMON_CUH

#include <stdint.h>

#include "cuda.h"

__device__ __forceinline__ float fl_d_bf16_to_f32(uint16_t h) {
    return __uint_as_float((uint32_t)h << 16);
}

__device__ __forceinline__ uint16_t fl_d_f32_to_bf16(float x) {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1); // round to nearest, ties to even
    return (uint16_t)(u >> 16);
}

__device__ __forceinline__ float fl_d_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1f, man = h & 0x3ffu;
    if (e == 0) return __uint_as_float(__float_as_uint((float)man * (1.0f / 16777216.0f)) | sign);
    if (e == 31) return __uint_as_float(sign | 0x7f800000u | (man ? 0x400000u | man << 13 : 0));
    return __uint_as_float(sign | ((e + 112) << 23) | (man << 13));
}

__device__ __forceinline__ uint16_t fl_d_f32_to_f16(float x) {
    uint32_t u = __float_as_uint(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); // quiet NaN
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); // rounds to >= 65520: inf
    if (a < 0x38800000u) // subnormal or zero: units of 2^-24, rounded to nearest even
        return (uint16_t)(sign | (uint32_t)rintf(__uint_as_float(a) * 16777216.0f));
    uint32_t r = a + 0xc8000fffu + ((a >> 13) & 1); // rebias 127 -> 15, round 13 bits
    return (uint16_t)(sign | (r >> 13));
}

// the address of element i of p (dtype dt): fl_at and fl_at_const for device code
__device__ __forceinline__ void *fl_d_at(fl_dtype dt, void *p, size_t i) {
    return (char *)p + i * (dt == FL_F32 ? 4 : 2);
}
__device__ __forceinline__ const void *fl_d_at(fl_dtype dt, const void *p, size_t i) {
    return (const char *)p + i * (dt == FL_F32 ? 4 : 2);
}

// element i of p (dtype dt) as fp32
__device__ __forceinline__ float fl_d_load(fl_dtype dt, const void *p, size_t i) {
    if (dt == FL_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return dt == FL_BF16 ? fl_d_bf16_to_f32(h) : fl_d_f16_to_f32(h);
}

// x rounded into element i of p (dtype dt)
__device__ __forceinline__ void fl_d_store(fl_dtype dt, void *p, size_t i, float x) {
    if (dt == FL_F32)
        ((float *)p)[i] = x;
    else
        ((uint16_t *)p)[i] = dt == FL_BF16 ? fl_d_f32_to_bf16(x) : fl_d_f32_to_f16(x);
}

// The sum of v over a warp, in lane 0 (a fixed tree: the same bits each time).
__device__ __forceinline__ float fl_d_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double fl_d_warp_sum_double(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

// The sum of v over the block, in thread 0 (blockDim.x a multiple of 32):
// each warp's tree, then the warps in order; `warps` a __shared__ array of
// blockDim.x / 32. Every thread of the block calls it.
__device__ __forceinline__ double fl_d_block_sum_double(double v, double *warps) {
    v = fl_d_warp_sum_double(v);
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = v;
    __syncthreads();
    double s = 0.0;
    if (threadIdx.x == 0)
        for (unsigned w = 0; w < blockDim.x / 32; w++) s += warps[w];
    __syncthreads(); // warps is free again
    return s;
}

// Blocks of `threads` for n work items, capped for grid-stride loops.
static inline unsigned fl_cuda_blocks(size_t n, int threads) {
    size_t b = (n + (size_t)threads - 1) / (size_t)threads, cap = (size_t)fl_cuda_sm_count() * 32;
    if (b > cap) b = cap;
    return (unsigned)(b ? b : 1);
}

// Streaming kernels (a grid-stride loop over n elements, a few operations
// each) take FL_D_ILP elements a thread per pass, the grid's width apart
// (each of a warp's loads coalesced), and load them all before using any.
// One element at a time, a thread has one load in flight, as the stores
// between its loads may alias them: with bf16 that is about 4 KiB in
// flight an SM, where an H100's memory needs several times that to stay
// busy (latency x bandwidth). Each element's arithmetic is unchanged.
#define FL_D_ILP 4

// This thread's first element, and the grid's width: a pass takes elements
// i, i + w, ..., i + (FL_D_ILP - 1) w, the next pass starts FL_D_ILP w on.
__device__ __forceinline__ size_t fl_d_first(void) {
    return blockIdx.x * (size_t)blockDim.x + threadIdx.x;
}
__device__ __forceinline__ size_t fl_d_width(void) {
    return (size_t)gridDim.x * blockDim.x;
}

// x[k] = element i + k w of p (dtype dt) as fp32, 0 past n
__device__ __forceinline__ void fl_d_load_ilp(fl_dtype dt, const void *p, size_t i, size_t w,
                                              size_t n, float *x) {
#pragma unroll
    for (int k = 0; k < FL_D_ILP; k++) x[k] = i + k * w < n ? fl_d_load(dt, p, i + k * w) : 0.0f;
}

// x[k] rounded into element i + k w of p, for those below n
__device__ __forceinline__ void fl_d_store_ilp(fl_dtype dt, void *p, size_t i, size_t w, size_t n,
                                               const float *x) {
#pragma unroll
    for (int k = 0; k < FL_D_ILP; k++)
        if (i + k * w < n) fl_d_store(dt, p, i + k * w, x[k]);
}

// elements i + k w of out = those of a + y[k] (FL_D_ILP of them, below n)
__device__ __forceinline__ void fl_d_add_ilp(fl_dtype dt, void *out, const void *a, const float *y,
                                             size_t i, size_t w, size_t n) {
    float x[FL_D_ILP];
    fl_d_load_ilp(dt, a, i, w, n, x);
#pragma unroll
    for (int k = 0; k < FL_D_ILP; k++) x[k] += y[k];
    fl_d_store_ilp(dt, out, i, w, n, x);
}

// Blocks of `threads` for a streaming kernel over n elements: FL_D_ILP a
// thread in its first pass where n allows.
static inline unsigned fl_cuda_blocks_ilp(size_t n, int threads) {
    return fl_cuda_blocks((n + FL_D_ILP - 1) / FL_D_ILP, threads);
}

#endif
