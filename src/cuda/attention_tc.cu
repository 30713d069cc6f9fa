// attention_tc.cu: attention.cu's algorithm for bf16 and fp16 heads on the
// tensor cores (the WMMA API: 16 x 16 x 16 products of 16-bit operands
// summed in fp32), in the manner of FlashAttention-2; the version
// FITLM_CUDA_ATTENTION=wmma selects (attention_mma.cu's, the default, keeps
// the strips below in registers).
// A block is 4 warps over a tile of 64 rows (query rows, or keys in the
// dK/dV kernel), a warp owning 16 of them; the other side streams through
// shared memory 64 rows at a time (attention.cuh's tiles).
// Each warp multiplies its strip: scores S (16 x 64) into a fp32 strip of
// its own, which its lanes (two a row, every other column each) turn into
// probabilities, rounded to the 16-bit type for the next product as
// FlashAttention does, then P V (or P^T dO, dS^T Q, dS K) summed in fp32
// fragments. The online softmax rescales the forward's output rows, which
// the lanes hold in shared memory (a fragment's layout is opaque).
// Deterministic: every sum in a fixed order, no atomics; no workspace.
#include "attention.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>
#include <mma.h>

using namespace nvcuda;

enum {
    TC_LDP = TC_TILE + 8,      // a 16-bit strip's row (P, dS)
    TC_FRAGS = TC_MAX_HS / 16, // accumulator fragments across a head
};

typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> tc_acc;

// Where a kernel's arrays lie in its dynamic shared memory (byte offsets,
// each 128-byte aligned): the 64-row tiles of 16-bit values (HS + 8 a
// row), the warps' fp32 strips (16 rows of max(64, HS) + 4 each), their
// 16-bit strips, and a tile's per-row lse and D. The forward has three
// tiles (Q, K, V), two fp32 strips (scores, output) and one 16-bit (P);
// the backward four tiles (K, V, Q, dO), two of each strip (scores and
// dO V^T; P and dS) and the rows.
typedef struct {
    size_t tile[4], strip32[2], strip16[2], rows[2], total;
} tc_layout;

__host__ __device__ inline int tc_lds(int HS) {
    return (HS > TC_TILE ? HS : TC_TILE) + 4;
}

__host__ __device__ inline size_t tc_take(size_t *o, size_t bytes) {
    size_t at = *o;
    *o += (bytes + 127) / 128 * 128;
    return at;
}

__host__ __device__ inline tc_layout tc_layout_of(int HS, int backward) {
    tc_layout l = {{0}, {0}, {0}, {0}, 0};
    const size_t tile = (size_t)TC_TILE * (HS + 8) * 2, s32 = (size_t)TC_TILE * tc_lds(HS) * 4,
                 s16 = (size_t)TC_TILE * TC_LDP * 2, rows = TC_TILE * 4;
    size_t o = 0;
    for (int i = 0; i < 3 + backward; i++) l.tile[i] = tc_take(&o, tile);
    for (int i = 0; i < 2; i++) l.strip32[i] = tc_take(&o, s32);
    for (int i = 0; i < 1 + backward; i++) l.strip16[i] = tc_take(&o, s16);
    for (int i = 0; i < 2 * backward; i++) l.rows[i] = tc_take(&o, rows);
    l.total = o;
    return l;
}

// S (16, 64; lds apart) = X Y^T over HS: X the warp's 16 rows, Y a tile's
// 64 (both 16-bit, ldh apart)
template <class E>
__device__ void tc_strip_dots(float *S, int lds, const uint16_t *X, const uint16_t *Y, int ldh,
                              int HS) {
    tc_acc acc[TC_TILE / 16];
#pragma unroll
    for (int n = 0; n < TC_TILE / 16; n++) wmma::fill_fragment(acc[n], 0.0f);
    for (int k = 0; k < HS; k += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, E, wmma::row_major> x;
        wmma::load_matrix_sync(x, (const E *)(X + k), ldh);
#pragma unroll
        for (int n = 0; n < TC_TILE / 16; n++) {
            wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::col_major> y; // Y^T
            wmma::load_matrix_sync(y, (const E *)(Y + n * 16 * ldh + k), ldh);
            wmma::mma_sync(acc[n], x, y, acc[n]);
        }
    }
#pragma unroll
    for (int n = 0; n < TC_TILE / 16; n++)
        wmma::store_matrix_sync(S + n * 16, acc[n], lds, wmma::mem_row_major);
}

// acc (16, HS) += A M: A the warp's 16-bit strip (16, 64; TC_LDP apart),
// M a tile (64, HS; ldh apart)
template <class E>
__device__ void tc_strip_mm(tc_acc acc[TC_FRAGS], const uint16_t *A, const uint16_t *M, int ldh,
                            int HS) {
    for (int k = 0; k < TC_TILE; k += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, E, wmma::row_major> x;
        wmma::load_matrix_sync(x, (const E *)(A + k), TC_LDP);
#pragma unroll
        for (int n = 0; n < TC_FRAGS; n++)
            if (n * 16 < HS) {
                wmma::fragment<wmma::matrix_b, 16, 16, 16, E, wmma::row_major> y;
                wmma::load_matrix_sync(y, (const E *)(M + k * ldh + n * 16), ldh);
                wmma::mma_sync(acc[n], x, y, acc[n]);
            }
    }
}

// The fragments into the warp's fp32 strip (16, HS; lds apart).
__device__ void tc_store_acc(float *S, int lds, const tc_acc acc[TC_FRAGS], int HS) {
#pragma unroll
    for (int n = 0; n < TC_FRAGS; n++)
        if (n * 16 < HS) wmma::store_matrix_sync(S + n * 16, acc[n], lds, wmma::mem_row_major);
}

__device__ void tc_zero_acc(tc_acc acc[TC_FRAGS]) {
#pragma unroll
    for (int n = 0; n < TC_FRAGS; n++) wmma::fill_fragment(acc[n], 0.0f);
}

// dst (row i of a head, ld apart; its values odd, odd + 2, ...: a lane's,
// its twin the others) = round(f * acc row): dqkv is overwritten (device.h)
__device__ void tc_store_row(fl_dtype dt, void *base, size_t ld, const float *acc, float f, int i,
                             int odd, int HS) {
    for (int d = odd; d < HS; d += 2) fl_d_store(dt, base, (size_t)i * ld + d, f * acc[d]);
}

template <class E>
__global__ void attention_forward_tc(fl_dtype dt, void *out, float *lse, const void *qkv,
                                     att_shape a, int vec) {
    extern __shared__ __align__(128) unsigned char smem[];
    int HS = a.HS, ldh = HS + 8, lds = tc_lds(HS), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    tc_layout ly = tc_layout_of(HS, 0);
    uint16_t *Q = (uint16_t *)(smem + ly.tile[0]), *K = (uint16_t *)(smem + ly.tile[1]);
    uint16_t *V = (uint16_t *)(smem + ly.tile[2]);
    float *S = (float *)(smem + ly.strip32[0]) + warp * 16 * lds; // scores, then P V
    float *O = (float *)(smem + ly.strip32[1]) + warp * 16 * lds; // the output rows
    uint16_t *P = (uint16_t *)(smem + ly.strip16[0]) + warp * 16 * TC_LDP;
    int i0 = (gridDim.y - 1 - blockIdx.y) * TC_TILE;
    int b = blockIdx.x / a.NH, h = blockIdx.x % a.NH, g = h / a.group;
    const uint16_t *row0 = (const uint16_t *)qkv + (size_t)b * a.T * a.W;
    tc_load_rows(Q, row0 + (size_t)h * HS, a.W, i0, a.T, HS, vec);
    // the lane's row of the warp's strip; it takes every other column, its
    // twin (the next lane) the others: the two read different banks
    int r = lane / 2, odd = lane % 2, i = i0 + warp * 16 + r;
    float *orow = O + r * lds, *srow = S + r * lds;
    for (int d = odd; d < HS; d += 2) orow[d] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    int keys = min(a.T, i0 + TC_TILE); // the block's last row sees keys 0..keys-1
    for (int j0 = 0; j0 < keys; j0 += TC_TILE) {
        __syncthreads(); // every warp is done with the last K and V
        tc_load_rows(K, row0 + (size_t)a.C + (size_t)g * HS, a.W, j0, a.T, HS, vec);
        tc_load_rows(V, row0 + (size_t)a.C + (size_t)(a.NKV + g) * HS, a.W, j0, a.T, HS, vec);
        __syncthreads();
        tc_strip_dots<E>(S, lds, Q + warp * 16 * ldh, K, ldh, HS);
        __syncwarp();
        // the row's max and sum over the tile: the lane's 32 keys and its
        // twin's (the scaled and masked score formed on each read, not
        // stored back: one pass over the strip less)
        float mt = -INFINITY;
        for (int c = odd; c < TC_TILE; c += 2) mt = fmaxf(mt, tc_score(srow[c], j0 + c, i, a));
        // finite: key 0 is in every row's first tile
        float mnew = fmaxf(m, fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1))), sum = 0.0f;
        uint16_t *p = P + r * TC_LDP;
        for (int c = odd; c < TC_TILE; c += 2) {
            float s = tc_score(srow[c], j0 + c, i, a);
            float e = s == -INFINITY ? 0.0f : expf(s - mnew);
            sum += e;
            p[c] = tc_bits(dt, e);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        float alpha = expf(m - mnew); // 0 on the first tile
        l = l * alpha + sum, m = mnew;
        __syncwarp(); // P whole, S read
        tc_acc pv[TC_FRAGS];
        tc_zero_acc(pv);
        tc_strip_mm<E>(pv, P, V, ldh, HS);
        tc_store_acc(S, lds, pv, HS);
        __syncwarp();
        for (int d = odd; d < HS; d += 2) orow[d] = orow[d] * alpha + srow[d];
    }
    if (i < a.T) {
        for (int d = odd; d < HS; d += 2)
            fl_d_store(dt, out, ((size_t)b * a.T + i) * a.C + (size_t)h * HS + d, orow[d] / l);
        if (odd == 0) lse[((size_t)b * a.NH + h) * a.T + i] = m + logf(l);
    }
}

// Column c of a warp's P and dS strips' row (query i, key j) from its score
// and dO V^T product (S, dP rows): P = exp(scale S - lse), zero where the
// query may not see the key (j > i, or i past T); dS = P (dP - D).
__device__ __forceinline__ void tc_probs(uint16_t *P, uint16_t *dS, const float *S, const float *dP,
                                         fl_dtype dt, int i, int j, float L, float D, float scale,
                                         int T, int c) {
    float p = 0.0f, ds = 0.0f;
    if (i < T && j <= i) {
        p = expf(scale * S[c] - L);
        ds = p * (dP[c] - D);
    }
    P[c] = tc_bits(dt, p);
    dS[c] = tc_bits(dt, ds);
}

// The backward kernels' shared arrays: the tiles K, V, Q, dO (16-bit);
// the warp's strips S and dP (fp32: the scores and the dO V^T products,
// transposed in the dK/dV kernel), P and dS (16-bit); the query tile's L
// (lse) and D.
typedef struct {
    uint16_t *K, *V, *Q, *dO, *P, *dS;
    float *S, *dP, *L, *D;
} tc_bwd_arrays;

__device__ tc_bwd_arrays tc_bwd_arrays_of(unsigned char *smem, int HS, int warp) {
    tc_layout ly = tc_layout_of(HS, 1);
    int lds = tc_lds(HS);
    tc_bwd_arrays r;
    r.K = (uint16_t *)(smem + ly.tile[0]), r.V = (uint16_t *)(smem + ly.tile[1]);
    r.Q = (uint16_t *)(smem + ly.tile[2]), r.dO = (uint16_t *)(smem + ly.tile[3]);
    r.S = (float *)(smem + ly.strip32[0]) + warp * 16 * lds;
    r.dP = (float *)(smem + ly.strip32[1]) + warp * 16 * lds;
    r.P = (uint16_t *)(smem + ly.strip16[0]) + warp * 16 * TC_LDP;
    r.dS = (uint16_t *)(smem + ly.strip16[1]) + warp * 16 * TC_LDP;
    r.L = (float *)(smem + ly.rows[0]), r.D = (float *)(smem + ly.rows[1]);
    return r;
}

template <class E>
__global__ void attention_dkdv_tc(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                                  const float *Dg, const float *lse, att_shape a, int vec) {
    extern __shared__ __align__(128) unsigned char smem[];
    int HS = a.HS, ldh = HS + 8, lds = tc_lds(HS), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    tc_bwd_arrays sh = tc_bwd_arrays_of(smem, HS, warp);
    int j0 = blockIdx.y * TC_TILE, b = blockIdx.x / a.NKV, g = blockIdx.x % a.NKV;
    size_t row0 = (size_t)b * a.T * a.W, koff = row0 + (size_t)a.C + (size_t)g * HS;
    size_t voff = koff + (size_t)a.NKV * HS;
    tc_load_rows(sh.K, (const uint16_t *)qkv + koff, a.W, j0, a.T, HS, vec);
    tc_load_rows(sh.V, (const uint16_t *)qkv + voff, a.W, j0, a.T, HS, vec);
    // the lane's key (a row of the warp's strips) and every other query
    int r = lane / 2, odd = lane % 2, j = j0 + warp * 16 + r;
    tc_acc dK[TC_FRAGS], dV[TC_FRAGS];
    tc_zero_acc(dK);
    tc_zero_acc(dV);
    for (int h = g * a.group; h < (g + 1) * a.group; h++) // the group's query heads, in order
        for (int i0 = j0; i0 < a.T; i0 += TC_TILE) {      // rows at or below the diagonal
            __syncthreads();
            size_t orow0 = (size_t)b * a.T * a.C + (size_t)h * HS;
            tc_load_rows(sh.Q, (const uint16_t *)qkv + row0 + (size_t)h * HS, a.W, i0, a.T, HS,
                         vec);
            tc_load_rows(sh.dO, (const uint16_t *)dout + orow0, a.C, i0, a.T, HS, vec);
            tc_row_stats(sh.L, sh.D, lse, Dg, b, h, i0, a, 1.0f);
            __syncthreads();
            tc_strip_dots<E>(sh.S, lds, sh.K + warp * 16 * ldh, sh.Q, ldh, HS);
            tc_strip_dots<E>(sh.dP, lds, sh.V + warp * 16 * ldh, sh.dO, ldh, HS);
            __syncwarp();
            for (int c = odd; c < TC_TILE; c += 2)
                tc_probs(sh.P + r * TC_LDP, sh.dS + r * TC_LDP, sh.S + r * lds, sh.dP + r * lds, dt,
                         i0 + c, j, sh.L[c], sh.D[c], a.scale, a.T, c);
            __syncwarp();
            tc_strip_mm<E>(dV, sh.P, sh.dO, ldh, HS); // P^T dO
            tc_strip_mm<E>(dK, sh.dS, sh.Q, ldh, HS); // dS^T Q
        }
    // dK and dV through the score strip into dqkv, each rounded once
    __syncwarp();
    tc_store_acc(sh.S, lds, dK, HS);
    __syncwarp();
    if (j < a.T)
        tc_store_row(dt, (char *)dqkv + koff * 2, a.W, sh.S + r * lds, a.scale, j, odd, HS);
    __syncwarp();
    tc_store_acc(sh.S, lds, dV, HS);
    __syncwarp();
    if (j < a.T) tc_store_row(dt, (char *)dqkv + voff * 2, a.W, sh.S + r * lds, 1.0f, j, odd, HS);
}

template <class E>
__global__ void attention_dq_tc(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                                const float *Dg, const float *lse, att_shape a, int vec) {
    extern __shared__ __align__(128) unsigned char smem[];
    int HS = a.HS, ldh = HS + 8, lds = tc_lds(HS), warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    tc_bwd_arrays sh = tc_bwd_arrays_of(smem, HS, warp);
    int i0 = (gridDim.y - 1 - blockIdx.y) * TC_TILE;
    int b = blockIdx.x / a.NH, h = blockIdx.x % a.NH, g = h / a.group;
    size_t row0 = (size_t)b * a.T * a.W, koff = row0 + (size_t)a.C + (size_t)g * HS;
    size_t voff = koff + (size_t)a.NKV * HS, qoff = row0 + (size_t)h * HS;
    tc_load_rows(sh.Q, (const uint16_t *)qkv + qoff, a.W, i0, a.T, HS, vec);
    tc_load_rows(sh.dO, (const uint16_t *)dout + (size_t)b * a.T * a.C + (size_t)h * HS, a.C, i0,
                 a.T, HS, vec);
    tc_row_stats(sh.L, sh.D, lse, Dg, b, h, i0, a, 1.0f);
    // the lane's query (a row of the warp's strips) and every other key
    int r = lane / 2, odd = lane % 2, q = warp * 16 + r, i = i0 + q;
    tc_acc dQ[TC_FRAGS];
    tc_zero_acc(dQ);
    int keys = min(a.T, i0 + TC_TILE);
    for (int j0 = 0; j0 < keys; j0 += TC_TILE) {
        __syncthreads();
        tc_load_rows(sh.K, (const uint16_t *)qkv + koff, a.W, j0, a.T, HS, vec);
        tc_load_rows(sh.V, (const uint16_t *)qkv + voff, a.W, j0, a.T, HS, vec);
        __syncthreads();
        tc_strip_dots<E>(sh.S, lds, sh.Q + warp * 16 * ldh, sh.K, ldh, HS);
        tc_strip_dots<E>(sh.dP, lds, sh.dO + warp * 16 * ldh, sh.V, ldh, HS);
        __syncwarp();
        for (int c = odd; c < TC_TILE; c += 2)
            tc_probs(sh.P + r * TC_LDP, sh.dS + r * TC_LDP, sh.S + r * lds, sh.dP + r * lds, dt, i,
                     j0 + c, sh.L[q], sh.D[q], a.scale, a.T, c);
        __syncwarp();
        tc_strip_mm<E>(dQ, sh.dS, sh.K, ldh, HS); // dS K
    }
    __syncwarp();
    tc_store_acc(sh.S, lds, dQ, HS);
    __syncwarp();
    if (i < a.T)
        tc_store_row(dt, (char *)dqkv + qoff * 2, a.W, sh.S + r * lds, a.scale, i, odd, HS);
}

template <class E>
static void tc_forward(fl_dtype dt, void *out, float *lse, const void *qkv, int B,
                       const att_shape &a) {
    size_t smem = tc_layout_of(a.HS, 0).total;
    fl_cuda_attention_allow_smem((const void *)attention_forward_tc<E>, smem, "attention_forward");
    dim3 grid(B * a.NH, (a.T + TC_TILE - 1) / TC_TILE);
    attention_forward_tc<E>
        <<<grid, TC_THREADS, smem, fl_cuda_stream()>>>(dt, out, lse, qkv, a, tc_vec_ok(qkv, qkv));
    FL_CUDA_LAUNCHED("attention_forward (tensor cores)");
}

template <class E>
static void tc_backward(fl_dtype dt, void *dqkv, const void *dout, const void *qkv, const void *out,
                        const float *lse, int B, const att_shape &a) {
    size_t smem = tc_layout_of(a.HS, 1).total;
    fl_cuda_attention_allow_smem((const void *)attention_dkdv_tc<E>, smem, "attention_backward");
    fl_cuda_attention_allow_smem((const void *)attention_dq_tc<E>, smem, "attention_backward");
    int tiles = (a.T + TC_TILE - 1) / TC_TILE, vec = tc_vec_ok(qkv, dout);
    float *D = fl_cuda_attention_rows_d(dt, out, dout, B, a);
    attention_dkdv_tc<E><<<dim3(B * a.NKV, tiles), TC_THREADS, smem, fl_cuda_stream()>>>(
        dt, dqkv, dout, qkv, D, lse, a, vec);
    FL_CUDA_LAUNCHED("attention_backward (dk, dv; tensor cores)");
    attention_dq_tc<E><<<dim3(B * a.NH, tiles), TC_THREADS, smem, fl_cuda_stream()>>>(
        dt, dqkv, dout, qkv, D, lse, a, vec);
    FL_CUDA_LAUNCHED("attention_backward (dq; tensor cores)");
}

void fl_cuda_attention_tc_forward(fl_dtype dt, void *out, float *lse, const void *qkv, int B,
                                  const att_shape &a) {
    if (dt == FL_BF16)
        tc_forward<__nv_bfloat16>(dt, out, lse, qkv, B, a);
    else
        tc_forward<__half>(dt, out, lse, qkv, B, a);
}

void fl_cuda_attention_tc_backward(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                                   const void *out, const float *lse, int B, const att_shape &a) {
    if (dt == FL_BF16)
        tc_backward<__nv_bfloat16>(dt, dqkv, dout, qkv, out, lse, B, a);
    else
        tc_backward<__half>(dt, dqkv, dout, qkv, out, lse, B, a);
}
