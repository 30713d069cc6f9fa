// mma.cuh: the tensor cores at the warp level in PTX (sm_80 and later), for
// kernels that keep their tiles in registers as FlashAttention-2 does:
// ldmatrix (four 8 x 8 matrices of 16-bit values from shared memory, as
// stored or transposed), mma.sync m16n8k16 (16-bit operands, fp32 sums),
// cvt of two floats to a 16-bit pair and cp.async's tile copies, with the
// operand loads the attention kernels need.
//
// The PTX ISA fixes which elements a lane holds (lane l: g = l / 4,
// t = l % 4; element (r, c) of a 16-bit pair: c even in the low half):
//   accumulator (16 x 8, fp32)  d[0], d[1]: (g, 2t), (g, 2t + 1);
//                               d[2], d[3]: (g + 8, 2t), (g + 8, 2t + 1)
//   A (16 x 16, rows x k)       a[0]: (g, 2t..); a[1]: (g + 8, 2t..);
//                               a[2]: (g, 2t + 8..); a[3]: (g + 8, 2t + 8..)
//   B (16 x 8, k x columns)     b[0]: (2t.., g); b[1]: (2t + 8.., g), pairs along k
// so the accumulators of two neighbouring 16 x 8 products, rounded to
// 16-bit pairs, are an A operand over their 16 columns: a product's result
// feeds the next product without leaving the registers. Blocks are 1-D
// (a thread's lane is threadIdx.x % 32).
// On the CUDA emulator (tests/cuda_emu/fl_emu_ptx.h) the same functions
// keep the same layouts on the CPU.
#ifndef FITLM_CUDA_MMA_CUH
#define FITLM_CUDA_MMA_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#ifdef __CUDACC__
// r[i]: matrix i's elements; lanes 8i..8i+7 give its rows' addresses (16
// bytes each, 16-byte aligned, in shared memory). Lane l gets row l / 4,
// columns 2 (l % 4) and the next; transposed, column l / 4, rows 2 (l % 4)
// and the next.
__device__ __forceinline__ void fl_d_ldmatrix_x4(uint32_t r[4], const void *row) {
    uint32_t at = (uint32_t)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at)
                 : "memory");
}
__device__ __forceinline__ void fl_d_ldmatrix_x4_trans(uint32_t r[4], const void *row) {
    uint32_t at = (uint32_t)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at)
                 : "memory");
}

// d (16 x 8) += a (16 x 16) b (16 x 8), E the operands' type
template <class E>
__device__ void fl_d_mma(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void fl_d_mma<__nv_bfloat16>(float d[4], const uint32_t a[4],
                                                        uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void fl_d_mma<__half>(float d[4], const uint32_t a[4], uint32_t b0,
                                                 uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// lo and hi rounded to E's 16 bits (to nearest even) as a pair, lo in the
// low half: one instruction for both (cvt's first source is the high half)
template <class E> __device__ uint32_t fl_d_pack(float lo, float hi);
template <> __device__ __forceinline__ uint32_t fl_d_pack<__nv_bfloat16>(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
template <> __device__ __forceinline__ uint32_t fl_d_pack<__half>(float lo, float hi) {
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// dst (16 bytes of shared memory, 16-byte aligned) = the 16 bytes at src
// (global memory, 16-byte aligned), or zeros where !full (src still a
// valid address, not read), copied asynchronously (cp.async, bypassing L1
// and the registers): the thread's copies since its last commit form a
// group; fl_d_cp_async_wait<n> waits for all but its n newest groups, and
// the bytes are the block's after a barrier.
__device__ __forceinline__ void fl_d_cp_async16(void *dst, const void *src, int full) {
    uint32_t at = (uint32_t)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(at), "l"(src),
                 "r"(full ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void fl_d_cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void fl_d_cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#else
#include <fl_emu_ptx.h>
#endif

// The A operand of the 16 x 16 block at p of a row-major matrix of 16-bit
// values in shared memory (rows ld values apart, ld a multiple of 8).
__device__ __forceinline__ void fl_d_mma_load_a(uint32_t a[4], const uint16_t *p, int ld) {
    int l = threadIdx.x % 32, i = l / 8, r = l % 8;
    fl_d_ldmatrix_x4(a, p + (size_t)(r + 8 * (i & 1)) * ld + 8 * (i >> 1));
}

// The B operands of two neighbouring 8-column products (b[0], b[1]: columns
// 0-7; b[2], b[3]: 8-15) over 16 of k, from a matrix stored a row per
// column (row n at p + n ld holds its k values: K's rows for Q K^T).
__device__ __forceinline__ void fl_d_mma_load_b_rows(uint32_t b[4], const uint16_t *p, int ld) {
    int l = threadIdx.x % 32, i = l / 8, r = l % 8;
    fl_d_ldmatrix_x4(b, p + (size_t)(r + 8 * (i >> 1)) * ld + 8 * (i & 1));
}

// The same from a matrix stored a row per k (row k at p + k ld holds its
// columns: V's rows for P V).
__device__ __forceinline__ void fl_d_mma_load_b_cols(uint32_t b[4], const uint16_t *p, int ld) {
    int l = threadIdx.x % 32, i = l / 8, r = l % 8;
    fl_d_ldmatrix_x4_trans(b, p + (size_t)(r + 8 * (i & 1)) * ld + 8 * (i >> 1));
}

// Two 16-bit values as a pair: lo in the low half.
__device__ __forceinline__ uint32_t fl_d_pair(uint16_t lo, uint16_t hi) {
    return (uint32_t)lo | (uint32_t)hi << 16;
}

#endif
