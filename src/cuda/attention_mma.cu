// attention_mma.cu: attention.cu's algorithm for bf16 and fp16 heads on the
// tensor cores through PTX's mma.sync (mma.cuh), as FlashAttention-2 does
// it: shared memory holds only the 64-row tiles of Q, K, V (and dO) that a
// block's 4 warps share, and each warp keeps its 16 rows' scores,
// probabilities and sums in registers. A product's fp32 accumulators,
// rounded to the 16-bit type, are the next product's A operand where they
// lie (S's become P's for P V), so no strip goes through shared memory
// (attention_tc.cu's WMMA version stores each strip and loads it back).
// The softmax works in units of log2, so that a probability costs one
// multiply-add and one exp2 (FlashAttention-2's form); only the tiles on
// the diagonal or past T are masked; the online softmax rescales the
// output accumulators in place. Deterministic:
// every sum in a fixed order, no atomics; no workspace but the backward's
// per-query-head dK and dV under grouped-query attention (the partials:
// attention_dkdv_mma's SPLIT), which a second kernel adds in head order.
//
// A lane holds, of each 16 x 8 accumulator tile, rows g = lane / 4 and
// g + 8 at columns 2t and 2t + 1 (t = lane % 4): a row's values are spread
// over the 4 lanes of its quad, whose row max and sum take two shuffles.
#include "attention.cuh"
#include "mma.cuh"

#include <math.h>

enum {
    MMA_NT = TC_TILE / 8,   // 8-column accumulator tiles across a 64-key tile
    MMA_CHUNK = 32,         // the backward's keys (or queries) per register pass
    MMA_CT = MMA_CHUNK / 8, // its accumulator tiles
};

// The block's tiles in dynamic shared memory: n tiles of (64, HS + 8)
// 16-bit values, then (backward) a query tile's lse and D.
__host__ __device__ inline size_t mma_smem(int HS, int tiles, int rows) {
    return (size_t)tiles * TC_TILE * (HS + 8) * 2 + (size_t)rows * TC_TILE * 4;
}

// tc_load_rows through cp.async where vec (rows past T zero-filled; the
// caller commits, waits and synchronises before reading), else as it is:
// a thread's copies are all in flight at once, where a loop of loads and
// stores waits out each load's latency in turn.
__device__ __forceinline__ void mma_copy_rows(uint16_t *s, const uint16_t *base, size_t ld, int r0,
                                              int T, int HS, int vec) {
    if (!vec) {
        tc_load_rows(s, base, ld, r0, T, HS, 0);
        return;
    }
    int ldh = HS + 8, per = HS / 8;
    for (int idx = threadIdx.x; idx < TC_TILE * per; idx += blockDim.x) {
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

// acc (16 x 8 cols tiles) += X Y^T over HS: X the warp's 16 rows (A
// operands from rows ldh apart), Y `cols` rows of a tile (B operands, a row
// per column).
template <class E, int COLS>
__device__ __forceinline__ void mma_dots(float (*acc)[4], const uint16_t *X, const uint16_t *Y,
                                         int ldh, int HS) {
    for (int k = 0; k < HS; k += 16) {
        uint32_t x[4];
        fl_d_mma_load_a(x, X + k, ldh);
#pragma unroll
        for (int n = 0; n < COLS / 8; n += 2) {
            uint32_t y[4];
            fl_d_mma_load_b_rows(y, Y + (size_t)n * 8 * ldh + k, ldh);
            fl_d_mma<E>(acc[n], x, y[0], y[1]);
            fl_d_mma<E>(acc[n + 1], x, y[2], y[3]);
        }
    }
}

// out (16 x HS, its 8-column tiles, HT of them for the widest head the
// kernel takes) += A M: A the 16 x 16 block given as an operand, M 16 rows
// of a tile (ldh apart; B operands, a row per k).
template <class E, int HT>
__device__ __forceinline__ void mma_times(float (*out)[4], const uint32_t A[4], const uint16_t *M,
                                          int ldh, int HS) {
#pragma unroll
    for (int n = 0; n < HT; n += 2)
        if (n * 8 < HS) {
            uint32_t m[4];
            fl_d_mma_load_b_cols(m, M + n * 8, ldh);
            fl_d_mma<E>(out[n], A, m[0], m[1]);
            fl_d_mma<E>(out[n + 1], A, m[2], m[3]);
        }
}

__device__ __forceinline__ void mma_zero(float (*acc)[4], int tiles) {
#pragma unroll
    for (int n = 0; n < tiles; n++) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
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

template <class E, int HT>
__global__ void __launch_bounds__(TC_THREADS)
    attention_forward_mma(fl_dtype dt, void *out, float *lse, const void *qkv, att_shape a,
                          int vec) {
    extern __shared__ __align__(128) unsigned char smem[];
    int HS = a.HS, ldh = HS + 8, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint16_t *Q = (uint16_t *)smem, *K = Q + TC_TILE * ldh, *V = K + TC_TILE * ldh;
    int i0 = (gridDim.y - 1 - blockIdx.y) * TC_TILE;
    int b = blockIdx.x / a.NH, h = blockIdx.x % a.NH, g = h / a.group;
    const uint16_t *row0 = (const uint16_t *)qkv + (size_t)b * a.T * a.W;
    const uint16_t *kbase = row0 + (size_t)a.C + (size_t)g * HS,
                   *vbase = kbase + (size_t)a.NKV * HS;
    // K and V in separate groups, each tile's copy issued as soon as the
    // last is used (FlashAttention-2's order): the next K comes while the
    // softmax and P V run, the next V while the next scores do
    mma_copy_rows(Q, row0 + (size_t)h * HS, a.W, i0, a.T, HS, vec);
    mma_copy_rows(K, kbase, a.W, 0, a.T, HS, vec);
    fl_d_cp_async_commit();
    mma_copy_rows(V, vbase, a.W, 0, a.T, HS, vec);
    fl_d_cp_async_commit();
    // the lane's rows (i, i + 8) and its columns' offset in each tile
    int i = i0 + warp * 16 + lane / 4, c2 = 2 * (lane % 4);
    // m: each row's running max of the scores in units of log2 (scale
    // log2(e) s), as exp2 takes them; l: the lane's part of its row's sum
    // (the quad's parts are added at the end)
    const float sl2 = a.scale * 1.4426950408889634f;
    float o[HT][4], m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    mma_zero(o, HT);
    int keys = min(a.T, i0 + TC_TILE); // the block's last row sees keys 0..keys-1
    for (int j0 = 0; j0 < keys; j0 += TC_TILE) {
        int next = j0 + TC_TILE < keys;
        fl_d_cp_async_wait<1>(); // this K (and Q), not necessarily this V
        __syncthreads();
        float s[MMA_NT][4];
        mma_zero(s, MMA_NT);
        mma_dots<E, TC_TILE>(s, Q + warp * 16 * ldh, K, ldh, HS);
        __syncthreads(); // every warp is done with K
        if (next) mma_copy_rows(K, kbase, a.W, j0 + TC_TILE, a.T, HS, vec);
        fl_d_cp_async_commit();
        // masked only on the diagonal tile and the one past T; each row's
        // max over the tile (finite: key 0 is in every row's first tile)
        int edge = j0 + TC_TILE > i0 || j0 + TC_TILE > a.T;
        float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < MMA_NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int j = j0 + n * 8 + c2 + e % 2;
                if (edge && (j > i + 8 * (e / 2) || j >= a.T)) s[n][e] = -INFINITY;
                mt[e / 2] = fmaxf(mt[e / 2], s[n][e]);
            }
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 1));
            mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 2));
            float mnew = fmaxf(m[r], mt[r] * sl2); // scale > 0: the max of the scaled
            alpha[r] = exp2f(m[r] - mnew);         // 0 on the first tile
            m[r] = mnew;
            l[r] *= alpha[r];
        }
        // p = e^(scale s - max): one multiply-add and one exp2 a score
#pragma unroll
        for (int n = 0; n < MMA_NT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[n][e] = exp2f(__fmaf_rn(s[n][e], sl2, -m[e / 2]));
                l[e / 2] += s[n][e];
            }
#pragma unroll
        for (int n = 0; n < HT; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[n][e] *= alpha[e / 2];
        // O += P V, P rounded to the 16-bit type as FlashAttention does
        fl_d_cp_async_wait<1>(); // this V, not necessarily the next K
        __syncthreads();
#pragma unroll
        for (int k = 0; k < MMA_NT; k += 2) {
            uint32_t p[4];
            mma_as_a<E>(p, s + k);
            mma_times<E, HT>(o, p, V + k * 8 * ldh, ldh, HS);
        }
        __syncthreads(); // every warp is done with V
        if (next) mma_copy_rows(V, vbase, a.W, j0 + TC_TILE, a.T, HS, vec);
        fl_d_cp_async_commit();
    }
    fl_d_cp_async_wait<0>(); // the last, empty groups
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    void *obase = (char *)out + ((size_t)b * a.T * a.C + (size_t)h * HS) * 2;
    mma_store<HT>(dt, obase, a.C, o, 1.0f / l[0], 1.0f / l[1], i, a.T, HS);
    if (lane % 4 == 0)
        for (int r = 0; r < 2; r++)
            if (i + 8 * r < a.T)
                lse[((size_t)b * a.NH + h) * a.T + i + 8 * r] =
                    m[r] * 0.6931471805599453f + logf(l[r]);
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

// The backward kernels' shared tiles: K, V (keys), Q, dO (queries), and the
// query tile's lse and D.
typedef struct {
    uint16_t *K, *V, *Q, *dO;
    float *L, *D;
} mma_bwd_tiles;

__device__ __forceinline__ mma_bwd_tiles mma_bwd_tiles_of(unsigned char *smem, int HS) {
    mma_bwd_tiles t;
    size_t tile = (size_t)TC_TILE * (HS + 8);
    t.K = (uint16_t *)smem, t.V = t.K + tile, t.Q = t.V + tile, t.dO = t.Q + tile;
    t.L = (float *)(t.dO + tile), t.D = t.L + TC_TILE;
    return t;
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

// SPLIT 0: a block per kv head and key tile, its group's query heads in
// turn, dK and dV written to dqkv. SPLIT 1 (grouped-query attention): a
// block per query head and key tile, its head's dK and dV (dK unscaled)
// written in fp32 to the partials (K's, then V's: (B, NH, T, HS) each),
// which attention_group_sum adds over the group: a kv head's work spread
// over `group` times the blocks, as FlashAttention-2 spreads it. Heads of
// up to 64 values: at most 128 registers (4 blocks a multiprocessor), or
// 168 split (3: under 4 ptxas spills), and no spill (nvcc 13, sm_90a).
template <class E, int HT, int SPLIT>
__global__ void __launch_bounds__(TC_THREADS, HT == 8 ? (SPLIT ? 3 : 4) : 1)
    attention_dkdv_mma(fl_dtype dt, void *dqkv, float *partials, const void *dout, const void *qkv,
                       const float *Dg, const float *lse, att_shape a, int vec) {
    extern __shared__ __align__(128) unsigned char smem[];
    int HS = a.HS, ldh = HS + 8, warp = threadIdx.x / 32;
    mma_bwd_tiles sh = mma_bwd_tiles_of(smem, HS);
    int heads = SPLIT ? a.NH : a.NKV, hx = blockIdx.x % heads;
    int j0 = blockIdx.y * TC_TILE, b = blockIdx.x / heads, g = SPLIT ? hx / a.group : hx;
    int h_first = SPLIT ? hx : g * a.group, h_end = SPLIT ? hx + 1 : (g + 1) * a.group;
    size_t row0 = (size_t)b * a.T * a.W, koff = row0 + (size_t)a.C + (size_t)g * HS;
    size_t voff = koff + (size_t)a.NKV * HS;
    mma_copy_rows(sh.K, (const uint16_t *)qkv + koff, a.W, j0, a.T, HS, vec);
    mma_copy_rows(sh.V, (const uint16_t *)qkv + voff, a.W, j0, a.T, HS, vec);
    // the warp's 16 keys are the rows of its products (S^T = K Q^T and
    // dP^T = V dO^T), 32 queries a pass
    int j = j0 + warp * 16;
    const float sl2 = a.scale * 1.4426950408889634f;
    float dK[HT][4], dV[HT][4];
    mma_zero(dK, HT);
    mma_zero(dV, HT);
    for (int h = h_first; h < h_end; h++)            // the group's query heads, in order
        for (int i0 = j0; i0 < a.T; i0 += TC_TILE) { // rows at or below the diagonal
            __syncthreads();
            size_t orow0 = (size_t)b * a.T * a.C + (size_t)h * HS;
            mma_copy_rows(sh.Q, (const uint16_t *)qkv + row0 + (size_t)h * HS, a.W, i0, a.T, HS,
                          vec);
            mma_copy_rows(sh.dO, (const uint16_t *)dout + orow0, a.C, i0, a.T, HS, vec);
            fl_d_cp_async_commit();
            tc_row_stats(sh.L, sh.D, lse, Dg, b, h, i0, a, 1.4426950408889634f);
            fl_d_cp_async_wait<0>();
            __syncthreads();
            // the diagonal tile, queries or keys past T: masked
            int edge = i0 < j0 + TC_TILE || i0 + TC_TILE > a.T || j0 + TC_TILE > a.T;
            for (int q0 = 0; q0 < TC_TILE; q0 += MMA_CHUNK) {
                float st[MMA_CT][4], dpt[MMA_CT][4];
                mma_zero(st, MMA_CT);
                mma_zero(dpt, MMA_CT);
                mma_dots<E, MMA_CHUNK>(st, sh.K + warp * 16 * ldh, sh.Q + q0 * ldh, ldh, HS);
                mma_dots<E, MMA_CHUNK>(dpt, sh.V + warp * 16 * ldh, sh.dO + q0 * ldh, ldh, HS);
                mma_probs<0>(st, dpt, j, i0 + q0, edge, sh.L + q0, sh.D + q0, NULL, NULL, sl2, a.T);
#pragma unroll
                for (int k = 0; k < MMA_CT; k += 2) { // 16 queries a step
                    uint32_t p[4], ds[4];
                    mma_as_a<E>(p, st + k);
                    mma_as_a<E>(ds, dpt + k);
                    mma_times<E, HT>(dV, p, sh.dO + (q0 + k * 8) * ldh, ldh, HS); // P^T dO
                    mma_times<E, HT>(dK, ds, sh.Q + (q0 + k * 8) * ldh, ldh, HS); // dS^T Q
                }
            }
        }
    int i = j + threadIdx.x % 32 / 4;
    if (SPLIT) {
        size_t at = ((size_t)b * a.NH + hx) * a.T * HS, plane = (size_t)gridDim.x * a.T * HS;
        mma_store_f32<HT>(partials + at, dK, i, a.T, HS);
        mma_store_f32<HT>(partials + plane + at, dV, i, a.T, HS);
        return;
    }
    mma_store<HT>(dt, (char *)dqkv + koff * 2, a.W, dK, a.scale, a.scale, i, a.T, HS);
    mma_store<HT>(dt, (char *)dqkv + voff * 2, a.W, dV, 1.0f, 1.0f, i, a.T, HS);
}

// dK and dV of every (b, key j, kv head g) from the split kernel's
// partials: the group's query heads added in head order (a fixed order:
// deterministic), dK times the scale, each rounded once into dqkv.
__global__ void attention_group_sum(fl_dtype dt, void *dqkv, const float *partials, int B,
                                    att_shape a) {
    size_t per = (size_t)a.NKV * a.HS, n = (size_t)B * a.T * per,
           plane = (size_t)B * a.NH * a.T * a.HS;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (size_t)gridDim.x * blockDim.x) {
        size_t d = idx % a.HS, g = idx / a.HS % a.NKV, j = idx / per % a.T, b = idx / per / a.T;
        float k = 0.0f, v = 0.0f;
        for (int m = 0; m < a.group; m++) {
            size_t at = ((b * a.NH + g * a.group + m) * a.T + j) * a.HS + d;
            k += partials[at];
            v += partials[plane + at];
        }
        size_t kat = (b * a.T + j) * a.W + a.C + g * a.HS + d;
        fl_d_store(dt, dqkv, kat, k * a.scale);
        fl_d_store(dt, dqkv, kat + per, v); // V's heads follow K's
    }
}

size_t fl_cuda_attention_mma_partials(int B, int T, int NH, int HS) {
    return 2 * (size_t)B * T * NH * HS;
}

template <class E, int HT>
__global__ void __launch_bounds__(TC_THREADS)
    attention_dq_mma(fl_dtype dt, void *dqkv, const void *dout, const void *qkv, const float *Dg,
                     const float *lse, att_shape a, int vec) {
    extern __shared__ __align__(128) unsigned char smem[];
    int HS = a.HS, ldh = HS + 8, warp = threadIdx.x / 32;
    mma_bwd_tiles sh = mma_bwd_tiles_of(smem, HS);
    int i0 = (gridDim.y - 1 - blockIdx.y) * TC_TILE;
    int b = blockIdx.x / a.NH, h = blockIdx.x % a.NH, g = h / a.group;
    size_t row0 = (size_t)b * a.T * a.W, koff = row0 + (size_t)a.C + (size_t)g * HS;
    size_t voff = koff + (size_t)a.NKV * HS, qoff = row0 + (size_t)h * HS;
    mma_copy_rows(sh.Q, (const uint16_t *)qkv + qoff, a.W, i0, a.T, HS, vec);
    mma_copy_rows(sh.dO, (const uint16_t *)dout + (size_t)b * a.T * a.C + (size_t)h * HS, a.C, i0,
                  a.T, HS, vec);
    tc_row_stats(sh.L, sh.D, lse, Dg, b, h, i0, a, 1.4426950408889634f);
    const float sl2 = a.scale * 1.4426950408889634f;
    // the warp's 16 queries are the rows of its products, 32 keys a pass
    int q = warp * 16 + threadIdx.x % 32 / 4, i = i0 + warp * 16;
    float dQ[HT][4];
    mma_zero(dQ, HT);
    int keys = min(a.T, i0 + TC_TILE);
    float Lr[2], Dr[2];
    for (int j0 = 0; j0 < keys; j0 += TC_TILE) {
        if (j0) __syncthreads(); // every warp is done with the last K and V
        mma_copy_rows(sh.K, (const uint16_t *)qkv + koff, a.W, j0, a.T, HS, vec);
        mma_copy_rows(sh.V, (const uint16_t *)qkv + voff, a.W, j0, a.T, HS, vec);
        fl_d_cp_async_commit();
        fl_d_cp_async_wait<0>(); // with the first, Q and dO
        __syncthreads();
        if (!j0) Lr[0] = sh.L[q], Lr[1] = sh.L[q + 8], Dr[0] = sh.D[q], Dr[1] = sh.D[q + 8];
        // the diagonal tile, queries or keys past T: masked
        int edge = j0 + TC_TILE > i0 || i0 + TC_TILE > a.T || j0 + TC_TILE > a.T;
        for (int k0 = 0; k0 < TC_TILE; k0 += MMA_CHUNK) {
            float s[MMA_CT][4], dp[MMA_CT][4];
            mma_zero(s, MMA_CT);
            mma_zero(dp, MMA_CT);
            mma_dots<E, MMA_CHUNK>(s, sh.Q + warp * 16 * ldh, sh.K + k0 * ldh, ldh, HS);
            mma_dots<E, MMA_CHUNK>(dp, sh.dO + warp * 16 * ldh, sh.V + k0 * ldh, ldh, HS);
            mma_probs<1>(s, dp, i, j0 + k0, edge, NULL, NULL, Lr, Dr, sl2, a.T);
#pragma unroll
            for (int k = 0; k < MMA_CT; k += 2) { // 16 keys a step
                uint32_t ds[4];
                mma_as_a<E>(ds, dp + k);
                mma_times<E, HT>(dQ, ds, sh.K + (k0 + k * 8) * ldh, ldh, HS); // dS K
            }
        }
    }
    mma_store<HT>(dt, (char *)dqkv + qoff * 2, a.W, dQ, a.scale, a.scale, i + threadIdx.x % 32 / 4,
                  a.T, HS);
}

template <class E, int HT>
static void mma_forward(fl_dtype dt, void *out, float *lse, const void *qkv, int B,
                        const att_shape &a) {
    size_t smem = mma_smem(a.HS, 3, 0);
    fl_cuda_attention_allow_smem((const void *)attention_forward_mma<E, HT>, smem,
                                 "attention_forward");
    dim3 grid(B * a.NH, (a.T + TC_TILE - 1) / TC_TILE);
    attention_forward_mma<E, HT>
        <<<grid, TC_THREADS, smem, fl_cuda_stream()>>>(dt, out, lse, qkv, a, tc_vec_ok(qkv, qkv));
    FL_CUDA_LAUNCHED("attention_forward (mma)");
}

template <class E, int HT>
static void mma_backward(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                         const void *out, const float *lse, float *partials, int B,
                         const att_shape &a) {
    size_t smem = mma_smem(a.HS, 4, 2);
    int split = partials && a.group > 1;
    const void *dkdv = split ? (const void *)attention_dkdv_mma<E, HT, 1>
                             : (const void *)attention_dkdv_mma<E, HT, 0>;
    fl_cuda_attention_allow_smem(dkdv, smem, "attention_backward");
    fl_cuda_attention_allow_smem((const void *)attention_dq_mma<E, HT>, smem, "attention_backward");
    int tiles = (a.T + TC_TILE - 1) / TC_TILE, vec = tc_vec_ok(qkv, dout);
    float *D = fl_cuda_attention_rows_d(dt, out, dout, B, a);
    if (split) {
        attention_dkdv_mma<E, HT, 1><<<dim3(B * a.NH, tiles), TC_THREADS, smem, fl_cuda_stream()>>>(
            dt, dqkv, partials, dout, qkv, D, lse, a, vec);
        FL_CUDA_LAUNCHED("attention_backward (dk, dv per query head; mma)");
        size_t n = (size_t)B * a.T * a.NKV * a.HS;
        attention_group_sum<<<fl_cuda_blocks(n, 256), 256, 0, fl_cuda_stream()>>>(dt, dqkv,
                                                                                  partials, B, a);
        FL_CUDA_LAUNCHED("attention_backward (dk, dv over the group)");
    } else {
        attention_dkdv_mma<E, HT, 0>
            <<<dim3(B * a.NKV, tiles), TC_THREADS, smem, fl_cuda_stream()>>>(dt, dqkv, NULL, dout,
                                                                             qkv, D, lse, a, vec);
        FL_CUDA_LAUNCHED("attention_backward (dk, dv; mma)");
    }
    attention_dq_mma<E, HT><<<dim3(B * a.NH, tiles), TC_THREADS, smem, fl_cuda_stream()>>>(
        dt, dqkv, dout, qkv, D, lse, a, vec);
    FL_CUDA_LAUNCHED("attention_backward (dq; mma)");
}

// Heads of up to 64 values (GPT-2's, SmolLM's, TinyLlama's) get kernels
// whose accumulators span 64 columns, not 128: half the registers, twice
// the blocks a multiprocessor holds.
void fl_cuda_attention_mma_forward(fl_dtype dt, void *out, float *lse, const void *qkv, int B,
                                   const att_shape &a) {
    if (dt == FL_BF16 && a.HS <= 64)
        mma_forward<__nv_bfloat16, 8>(dt, out, lse, qkv, B, a);
    else if (dt == FL_BF16)
        mma_forward<__nv_bfloat16, 16>(dt, out, lse, qkv, B, a);
    else if (a.HS <= 64)
        mma_forward<__half, 8>(dt, out, lse, qkv, B, a);
    else
        mma_forward<__half, 16>(dt, out, lse, qkv, B, a);
}

void fl_cuda_attention_mma_backward(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                                    const void *out, const float *lse, float *partials, int B,
                                    const att_shape &a) {
    if (dt == FL_BF16 && a.HS <= 64)
        mma_backward<__nv_bfloat16, 8>(dt, dqkv, dout, qkv, out, lse, partials, B, a);
    else if (dt == FL_BF16)
        mma_backward<__nv_bfloat16, 16>(dt, dqkv, dout, qkv, out, lse, partials, B, a);
    else if (a.HS <= 64)
        mma_backward<__half, 8>(dt, dqkv, dout, qkv, out, lse, partials, B, a);
    else
        mma_backward<__half, 16>(dt, dqkv, dout, qkv, out, lse, partials, B, a);
}
