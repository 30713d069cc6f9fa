// attention_mma.cuh: what the mma.sync attention kernels share
// (attention_mma.cu: the forward, and the backward's order;
// attention_mma_dkdv.cu and attention_mma_dq.cu: its two kernels, each
// family in a file of its own so that nvcc builds them side by side).
//
// attention.cu's algorithm for bf16 and fp16 heads on the tensor cores
// through PTX's mma.sync (mma.cuh), as FlashAttention-2 does it: shared
// memory holds only the tiles of Q, K, V (and dO) that a block's 4 warps
// share, and each warp keeps its rows' scores, probabilities and sums in
// registers (32 rows a warp, or 16: MT below). A product's fp32
// accumulators, rounded to the 16-bit type, are the next product's A
// operand where they lie (S's become P's for P V), so no strip goes
// through shared memory (attention_tc.cu's WMMA version stores each strip
// and loads it back). The softmax works in units of log2, so that a
// probability costs one multiply-add and one exp2 (FlashAttention-2's
// form); only the tiles on the diagonal or past T are masked; the online
// softmax rescales the output accumulators in place. Deterministic: every
// sum in a fixed order, no atomics; no workspace but the backward's
// per-query-head dK and dV under grouped-query attention (the partials:
// attention_dkdv_mma's SPLIT), which a second kernel adds in head order.
//
// A lane holds, of each 16 x 8 accumulator tile, rows g = lane / 4 and
// g + 8 at columns 2t and 2t + 1 (t = lane % 4): a row's values are spread
// over the 4 lanes of its quad, whose row max and sum take two shuffles.
#ifndef FITLM_CUDA_ATTENTION_MMA_CUH
#define FITLM_CUDA_ATTENTION_MMA_CUH

#include "attention.cuh"
#include "mma.cuh"

#include <math.h>

enum {
    MMA_NT = TC_TILE / 8,   // 8-column accumulator tiles across a 64-key tile
    MMA_CHUNK = 32,         // the backward's keys (or queries) per register pass
    MMA_CT = MMA_CHUNK / 8, // its accumulator tiles
};

// A block's own rows (the forward's and dQ's queries, dK and dV's keys):
// MT 16-row m-tiles a warp, MT * 64 rows a block, the warp's m-tile m its
// rows m * 64 + 16 warp .. + 15 (interleaved, so that the causal mask's
// skipped work falls on every warp alike). MT 2 (FITLM_CUDA_ATTENTION=mma,
// heads of up to 64 values) is FlashAttention-2's shape: each K, V (or Q,
// dO) operand a warp loads from shared memory feeds two products, where
// with MT 1 (mma16) the loads, not the tensor cores, bound the kernels.
// live: bit m set where the warp's m-tile m has work in a pass (a tile all
// past the causal mask is skipped).

// The block's tiles in dynamic shared memory: `rows` 16-bit rows of HS + 8
// values, then `stats` floats (the backward's lse and D).
__host__ __device__ inline size_t mma_smem(int HS, int rows, int stats) {
    return (size_t)rows * (HS + 8) * 2 + (size_t)stats * 4;
}

// tc_load_rows through cp.async where vec (rows past T zero-filled; the
// caller commits, waits and synchronises before reading), else as it is:
// a thread's copies are all in flight at once, where a loop of loads and
// stores waits out each load's latency in turn.
__device__ __forceinline__ void mma_copy_rows(uint16_t *s, const uint16_t *base, size_t ld, int r0,
                                              int rows, int T, int HS, int vec) {
    if (!vec) {
        tc_load_rows(s, base, ld, r0, rows, T, HS, 0);
        return;
    }
    int ldh = HS + 8, per = HS / 8;
    for (int idx = threadIdx.x; idx < rows * per; idx += blockDim.x) {
        int r = idx / per, c = idx % per * 8, full = r0 + r < T;
        fl_d_cp_async16(s + r * ldh + c, full ? base + (size_t)(r0 + r) * ld + c : base, full);
    }
}

// Accumulator tiles n and n + 1 (a 16 x 16 block) rounded to E's 16 bits
// as an A operand.
template <class E> __device__ __forceinline__ void mma_as_a(uint32_t a[4], const float (*acc)[4]) {
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const float *x = acc[r / 2] + 2 * (r % 2);
        a[r] = fl_d_pack<E>(x[0], x[1]);
    }
}

// The A operands of 16 accumulator columns from c (a multiple of 16) of
// the live m-tiles.
template <class E, int MT, int NT>
__device__ __forceinline__ void mma_as_a_mt(uint32_t (&a)[MT][4], const float (&acc)[MT][NT][4],
                                            int c, int live) {
#pragma unroll
    for (int m = 0; m < MT; m++)
        if (live >> m & 1) mma_as_a<E>(a[m], acc[m] + c / 8);
}

// acc[m] (16 x 8 NT tiles) += x[m] Y^T over 16 of k for the live m-tiles:
// x[m] their A operands, Y NT * 8 rows of a tile at the k offset (B
// operands, a row per column), each loaded once for every m-tile.
template <class E, int MT, int NT>
__device__ __forceinline__ void mma_row_products(float (&acc)[MT][NT][4],
                                                 const uint32_t (&x)[MT][4], const uint16_t *Y,
                                                 int ldh, int live) {
#pragma unroll
    for (int n = 0; n < NT; n += 2) {
        uint32_t y[4];
        fl_d_mma_load_b_rows(y, Y + (size_t)n * 8 * ldh, ldh);
#pragma unroll
        for (int m = 0; m < MT; m++)
            if (live >> m & 1) {
                fl_d_mma<E>(acc[m][n], x[m], y[0], y[1]);
                fl_d_mma<E>(acc[m][n + 1], x[m], y[2], y[3]);
            }
    }
}

// acc[m] += X_m Y^T over HS: X_m the warp's m-tile m of a tile whose first
// m-tile is at X (A operands from rows ldh apart), Y NT * 8 rows of a tile.
template <class E, int MT, int NT>
__device__ __forceinline__ void mma_dots(float (&acc)[MT][NT][4], const uint16_t *X,
                                         const uint16_t *Y, int ldh, int HS, int live) {
    for (int k = 0; k < HS; k += 16) {
        uint32_t x[MT][4];
#pragma unroll
        for (int m = 0; m < MT; m++)
            if (live >> m & 1) fl_d_mma_load_a(x[m], X + (size_t)m * TC_TILE * ldh + k, ldh);
        mma_row_products<E, MT, NT>(acc, x, Y + k, ldh, live);
    }
}

// out[m] (16 x HS, its 8-column tiles, HT of them for the widest head the
// kernel takes) += A[m] M for the live m-tiles: A[m] a 16 x 16 block given
// as an operand, M 16 rows of a tile (ldh apart; B operands, a row per k),
// each loaded once for every m-tile.
template <class E, int HT, int MT>
__device__ __forceinline__ void mma_times(float (&out)[MT][HT][4], const uint32_t (&A)[MT][4],
                                          const uint16_t *M, int ldh, int HS, int live) {
#pragma unroll
    for (int n = 0; n < HT; n += 2)
        if (n * 8 < HS) {
            uint32_t b[4];
            fl_d_mma_load_b_cols(b, M + n * 8, ldh);
#pragma unroll
            for (int m = 0; m < MT; m++)
                if (live >> m & 1) {
                    fl_d_mma<E>(out[m][n], A[m], b[0], b[1]);
                    fl_d_mma<E>(out[m][n + 1], A[m], b[2], b[3]);
                }
        }
}

template <int MT, int NT> __device__ __forceinline__ void mma_zero(float (&acc)[MT][NT][4]) {
#pragma unroll
    for (int m = 0; m < MT; m++)
#pragma unroll
        for (int n = 0; n < NT; n++) acc[m][n][0] = acc[m][n][1] = acc[m][n][2] = acc[m][n][3] = 0;
}

// Which of the warp's m-tiles (rows from `first`, 64 apart, 16 each) hold
// a row at or past `from`: the ones a causal pass over later columns
// reaches.
template <int MT> __device__ __forceinline__ int mma_live(int first, int from) {
    int live = 0;
#pragma unroll
    for (int m = 0; m < MT; m++)
        if (first + m * TC_TILE + 15 >= from) live |= 1 << m;
    return live;
}

// Rows g and g + 8 of the warp's 16 x HS accumulators, times f, into rows
// i and i + 8 of a head (ld values apart; rows at or past T left alone):
// dqkv is overwritten (device.h), out written once. A lane's two columns
// of a row go in one 4-byte store where the head's rows are 4-byte aligned
// (an odd offset into dqkv is not: two 2-byte stores).
template <int HT>
__device__ __forceinline__ void mma_store(fl_dtype dt, void *base, size_t ld, const float (*acc)[4],
                                          float f0, float f1, int i, int T, int HS) {
    int c2 = 2 * (threadIdx.x % 4), pair = (uintptr_t)base % 4 == 0 && ld % 2 == 0;
#pragma unroll
    for (int n = 0; n < HT; n++)
        if (n * 8 < HS)
#pragma unroll
            for (int r = 0; r < 2; r++) {
                int row = i + 8 * r;
                if (row >= T) continue;
                float f = r ? f1 : f0, x0 = f * acc[n][2 * r], x1 = f * acc[n][2 * r + 1];
                size_t at = (size_t)row * ld + n * 8 + c2;
                if (pair)
                    *(uint32_t *)((uint16_t *)base + at) =
                        tc_bits(dt, x0) | (uint32_t)tc_bits(dt, x1) << 16;
                else
                    fl_d_store(dt, base, at, x0), fl_d_store(dt, base, at + 1, x1);
            }
}

// P = exp(scale S - lse) and dS = P (dP - D) of a 16 x 32 chunk, in place
// of its scores s and dO V^T products dp, its rows from r0 and columns
// from c0 in the sequence: rows are queries and columns keys (dQ, BY_ROW:
// the lane's rows' lse and D in Lr, Dr), or the other way round (dK/dV:
// the columns' in L, D); lse in units of log2 (as exp2 takes it). Zero
// where the query may not see the key (j > i, or i past T): only an edge
// chunk (the diagonal's, or one past T) has such pairs.
template <int BY_ROW>
__device__ __forceinline__ void mma_probs(float (*s)[4], float (*dp)[4], int r0, int c0, int edge,
                                          const float *L, const float *D, const float *Lr,
                                          const float *Dr, float sl2, int T) {
    int g = threadIdx.x % 32 / 4, c2 = 2 * (threadIdx.x % 4);
#pragma unroll
    for (int n = 0; n < MMA_CT; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int r = r0 + g + 8 * (e / 2), c = c0 + n * 8 + c2 + e % 2;
            int q = BY_ROW ? r : c, k = BY_ROW ? c : r; // positions in the sequence
            float Lq = BY_ROW ? Lr[e / 2] : L[c - c0], Dq = BY_ROW ? Dr[e / 2] : D[c - c0];
            float p = exp2f(__fmaf_rn(s[n][e], sl2, -Lq));
            if (edge && (q >= T || k > q)) p = 0.0f;
            s[n][e] = p, dp[n][e] = p * (dp[n][e] - Dq);
        }
}

// The backward kernels' shared tiles: K, V (krows keys), Q, dO (qrows
// queries), and the query rows' lse and D.
typedef struct {
    uint16_t *K, *V, *Q, *dO;
    float *L, *D;
} mma_bwd_tiles;

__device__ __forceinline__ mma_bwd_tiles mma_bwd_tiles_of(unsigned char *smem, int HS, int krows,
                                                          int qrows) {
    mma_bwd_tiles t;
    size_t ktile = (size_t)krows * (HS + 8), qtile = (size_t)qrows * (HS + 8);
    t.K = (uint16_t *)smem, t.V = t.K + ktile, t.Q = t.V + ktile, t.dO = t.Q + qtile;
    t.L = (float *)(t.dO + qtile), t.D = t.L + qrows;
    return t;
}

// The shared memory of mma_bwd_tiles_of's tiles.
static inline size_t mma_bwd_smem(int HS, int krows, int qrows) {
    return mma_smem(HS, 2 * krows + 2 * qrows, 2 * qrows);
}

// Rows g and g + 8 of the warp's 16 x HS accumulators into rows i and
// i + 8 of fp32 rows HS apart (rows at or past T left alone), two columns
// a store.
template <int HT>
__device__ __forceinline__ void mma_store_f32(float *base, const float (*acc)[4], int i, int T,
                                              int HS) {
    int c2 = 2 * (threadIdx.x % 4);
#pragma unroll
    for (int n = 0; n < HT; n++)
        if (n * 8 < HS)
#pragma unroll
            for (int r = 0; r < 2; r++)
                if (i + 8 * r < T)
                    *(float2 *)(base + (size_t)(i + 8 * r) * HS + n * 8 + c2) =
                        make_float2(acc[n][2 * r], acc[n][2 * r + 1]);
}

// The backward's kernels on the compute stream, D its rows' rowsum(dO O)
// (fl_cuda_attention_rows_d): dK and dV (attention_mma_dkdv.cu; with
// partials under grouped-query attention, a block per query head and the
// group's sum after) and dQ (attention_mma_dq.cu).
void fl_cuda_attention_mma_dkdv(fl_dtype dt, void *dqkv, float *partials, const void *dout,
                                const void *qkv, const float *D, const float *lse, int B,
                                const att_shape &a, int wide);
void fl_cuda_attention_mma_dq(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                              const float *D, const float *lse, int B, const att_shape &a,
                              int wide);

// Heads of up to 64 values (GPT-2's, SmolLM's, TinyLlama's) get kernels
// whose accumulators span 64 columns, not 128: half the registers, so
// that a warp holds two m-tiles (wide) or a multiprocessor twice the blocks.
#define MMA_DISPATCH(call, ...)                                                                    \
    do {                                                                                           \
        if (dt == FL_BF16 && a.HS <= 64 && wide)                                                   \
            call<__nv_bfloat16, 8, 2>(__VA_ARGS__);                                                \
        else if (dt == FL_BF16 && a.HS <= 64)                                                      \
            call<__nv_bfloat16, 8, 1>(__VA_ARGS__);                                                \
        else if (dt == FL_BF16)                                                                    \
            call<__nv_bfloat16, 16, 1>(__VA_ARGS__);                                               \
        else if (a.HS <= 64 && wide)                                                               \
            call<__half, 8, 2>(__VA_ARGS__);                                                       \
        else if (a.HS <= 64)                                                                       \
            call<__half, 8, 1>(__VA_ARGS__);                                                       \
        else                                                                                       \
            call<__half, 16, 1>(__VA_ARGS__);                                                      \
    } while (0)

#endif
