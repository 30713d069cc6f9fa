// attention.cuh: what attention.cu (the launchers, the fp32 kernels) and
// attention_tc.cu (the tensor-core kernels for 16-bit heads) share.
#ifndef FITLM_CUDA_ATTENTION_CUH
#define FITLM_CUDA_ATTENTION_CUH

#include "common.cuh"

#include <math.h>

// One call's shape: W the qkv row (NH + 2 NKV heads), C the output row.
typedef struct {
    int T, NH, NKV, HS, group, W, C, tile;
    float scale;
} att_shape;

// Whether the tensor-core kernels take heads of HS values in dtype dt:
// bf16 and fp16 (fp32 stays in fp32 arithmetic: no TF32 unasked), HS a
// multiple of the 16-wide matrix tiles, at most 128.
static inline int fl_cuda_attention_tc(fl_dtype dt, int HS) {
    return dt != FL_F32 && HS % 16 == 0 && HS <= 128;
}

// The tensor-core forward and backward, with kernels.h's contract, on the
// compute stream: through PTX's mma.sync with the tiles' products in
// registers (attention_mma.cu, the default), or through the WMMA API with
// them staged in shared memory (attention_tc.cu; FITLM_CUDA_ATTENTION=wmma).
void fl_cuda_attention_mma_forward(fl_dtype dt, void *out, float *lse, const void *qkv, int B,
                                   const att_shape &a);
// (partials: fl_cuda_attention_mma_partials floats, or NULL: under
// grouped-query attention dK and dV summed per query head there and then
// over the group, in a grid of every query head; else a kv head's blocks
// run its group's heads in turn)
void fl_cuda_attention_mma_backward(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                                    const void *out, const float *lse, float *partials, int B,
                                    const att_shape &a);
// The floats of the per-query-head fp32 dK and dV of B x T positions.
size_t fl_cuda_attention_mma_partials(int B, int T, int NH, int HS);
void fl_cuda_attention_tc_forward(fl_dtype dt, void *out, float *lse, const void *qkv, int B,
                                  const att_shape &a);
void fl_cuda_attention_tc_backward(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                                   const void *out, const float *lse, int B, const att_shape &a);

// What both tensor-core versions share: 64-row tiles of the raw 16-bit
// values (rows padded by 8 values: 16 bytes, so that the tensor cores' row
// loads spread over the banks), a block of 4 warps, 16 rows each.
enum {
    TC_TILE = 64,
    TC_WARPS = 4,
    TC_THREADS = TC_WARPS * 32,
    TC_MAX_HS = 128, // fl_cuda_attention_tc's bound
};

// 16-byte copies of a row's values
struct alignas(16) tc_vec {
    uint32_t w[4];
};

// x rounded to dt's 16 bits (src/core/dtype.c's rounding)
__device__ __forceinline__ uint16_t tc_bits(fl_dtype dt, float x) {
    return dt == FL_BF16 ? fl_d_f32_to_bf16(x) : fl_d_f32_to_f16(x);
}

// rows [r0, r0 + 64) of a head (ld values apart) into s (64, HS + 8) as
// they are; rows past T zero. vec: the head's rows start 16-byte aligned.
__device__ __forceinline__ void tc_load_rows(uint16_t *s, const uint16_t *base, size_t ld, int r0,
                                             int T, int HS, int vec) {
    int ldh = HS + 8;
    if (vec) {
        int per = HS / 8;
        for (int idx = threadIdx.x; idx < TC_TILE * per; idx += blockDim.x) {
            int r = idx / per, c = idx % per * 8;
            tc_vec v = {{0, 0, 0, 0}};
            if (r0 + r < T) v = *(const tc_vec *)(base + (size_t)(r0 + r) * ld + c);
            *(tc_vec *)(s + r * ldh + c) = v;
        }
        return;
    }
    for (int idx = threadIdx.x; idx < TC_TILE * HS; idx += blockDim.x) {
        int r = idx / HS, d = idx % HS;
        s[r * ldh + d] = r0 + r < T ? base[(size_t)(r0 + r) * ld + d] : (uint16_t)0;
    }
}

// A query tile's lse (times lmul) and D (rows past T: 0).
__device__ __forceinline__ void tc_row_stats(float *L, float *D, const float *lse, const float *Dg,
                                             int b, int h, int i0, const att_shape &a, float lmul) {
    for (int r = threadIdx.x; r < TC_TILE; r += blockDim.x) {
        int i = i0 + r;
        size_t at = ((size_t)b * a.NH + h) * a.T + i;
        L[r] = i < a.T ? lse[at] * lmul : 0.0f;
        D[r] = i < a.T ? Dg[at] : 0.0f;
    }
}

// Query i's scaled score for key j from its product s: -inf where i may
// not see j (j > i, or j past T).
__device__ __forceinline__ float tc_score(float s, int j, int i, const att_shape &a) {
    return j <= i && j < a.T ? a.scale * s : -INFINITY;
}

// Whether every row a kernel copies starts 16-byte aligned (the rows' and
// heads' offsets are multiples of 16 values; the bases decide).
static inline int tc_vec_ok(const void *p, const void *q) {
    return ((uintptr_t)p | (uintptr_t)q) % 16 == 0;
}

// D = rowsum(dO O) of every (b, h, i) row, in lse's order, into the
// backend's scratch (the model's lends it: scratch_bytes), once for both
// backward kernels, as FlashAttention-2's preprocessing does; returns it.
float *fl_cuda_attention_rows_d(fl_dtype dt, const void *out, const void *dout, int B,
                                const att_shape &a);

// Raises a kernel's dynamic shared-memory limit to `bytes` (over the default 48 KB).
void fl_cuda_attention_allow_smem(const void *kernel, size_t bytes, const char *what);

#endif
