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

// A grid-stride loop's thread: its index and the grid's width.
__device__ __forceinline__ size_t fl_d_first(void) {
    return blockIdx.x * (size_t)blockDim.x + threadIdx.x;
}
__device__ __forceinline__ size_t fl_d_width(void) {
    return (size_t)gridDim.x * blockDim.x;
}

// Row kernels (the norms, the classifier) and the streaming kernels (a
// grid-stride loop over n elements, a few operations each) take FL_D_VEC
// consecutive elements at a time: one 16-byte load or store (two for fp32)
// moves them where they start 16-byte aligned and lie below n, else they
// go one by one. One 2-byte element at a time, a thread had one small load
// in flight (the stores between its loads may alias them): a few KiB in
// flight an SM, where an H100's memory needs several times that to stay
// busy (latency x bandwidth). Either way the same values, so a kernel's
// arithmetic, and its bits, do not depend on where its buffers start (a
// weight offloaded into a ring lands elsewhere than in the flat buffer).
#define FL_D_VEC 8

// whether elements i .. i + FL_D_VEC - 1 of p go in one vector access
__device__ __forceinline__ int fl_d_vec_ok(fl_dtype dt, const void *p, size_t i, size_t n) {
    return i + FL_D_VEC <= n && ((uintptr_t)fl_d_at(dt, p, i) & 15u) == 0;
}

// x[k] = element i + k of p as fp32, k < FL_D_VEC (0 at and past n)
__device__ __forceinline__ void fl_d_load_vec(fl_dtype dt, const void *p, size_t i, size_t n,
                                              float *x) {
    if (!fl_d_vec_ok(dt, p, i, n)) {
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) x[k] = i + k < n ? fl_d_load(dt, p, i + k) : 0.0f;
        return;
    }
    if (dt == FL_F32) {
        const float4 *q = (const float4 *)fl_d_at(dt, p, i);
        float4 a = q[0], b = q[1];
        x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z,
        x[7] = b.w;
        return;
    }
    uint4 v = *(const uint4 *)fl_d_at(dt, p, i);
    uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; k++) { // little-endian: element 2k in the low half
        uint16_t lo = (uint16_t)(w[k] & 0xffffu), hi = (uint16_t)(w[k] >> 16);
        x[2 * k] = dt == FL_BF16 ? fl_d_bf16_to_f32(lo) : fl_d_f16_to_f32(lo);
        x[2 * k + 1] = dt == FL_BF16 ? fl_d_bf16_to_f32(hi) : fl_d_f16_to_f32(hi);
    }
}

// x[k] rounded into element i + k of p, k < FL_D_VEC, for those below n
__device__ __forceinline__ void fl_d_store_vec(fl_dtype dt, void *p, size_t i, size_t n,
                                               const float *x) {
    if (!fl_d_vec_ok(dt, p, i, n)) {
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++)
            if (i + k < n) fl_d_store(dt, p, i + k, x[k]);
        return;
    }
    if (dt == FL_F32) {
        float4 *q = (float4 *)fl_d_at(dt, p, i);
        q[0] = make_float4(x[0], x[1], x[2], x[3]);
        q[1] = make_float4(x[4], x[5], x[6], x[7]);
        return;
    }
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        uint32_t lo = dt == FL_BF16 ? fl_d_f32_to_bf16(x[2 * k]) : fl_d_f32_to_f16(x[2 * k]);
        uint32_t hi =
            dt == FL_BF16 ? fl_d_f32_to_bf16(x[2 * k + 1]) : fl_d_f32_to_f16(x[2 * k + 1]);
        w[k] = lo | hi << 16;
    }
    *(uint4 *)fl_d_at(dt, p, i) = make_uint4(w[0], w[1], w[2], w[3]);
}

// A vector streaming kernel's pass: this thread's FL_D_VEC consecutive
// elements from fl_d_first_vec(), the next pass fl_d_width_vec() on.
__device__ __forceinline__ size_t fl_d_first_vec(void) {
    return fl_d_first() * FL_D_VEC;
}
__device__ __forceinline__ size_t fl_d_width_vec(void) {
    return fl_d_width() * FL_D_VEC;
}

// elements i .. i + FL_D_VEC - 1 of out = those of a + y[k] (below n)
__device__ __forceinline__ void fl_d_add_vec(fl_dtype dt, void *out, const void *a, const float *y,
                                             size_t i, size_t n) {
    float x[FL_D_VEC];
    fl_d_load_vec(dt, a, i, n, x);
#pragma unroll
    for (int k = 0; k < FL_D_VEC; k++) x[k] += y[k];
    fl_d_store_vec(dt, out, i, n, x);
}

// Blocks of `threads` for a vector streaming kernel over n elements:
// FL_D_VEC a thread in its first pass where n allows.
static inline unsigned fl_cuda_blocks_vec(size_t n, int threads) {
    return fl_cuda_blocks((n + FL_D_VEC - 1) / FL_D_VEC, threads);
}

#endif
