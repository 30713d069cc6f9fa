// attention_mma_dq.cu: the mma.sync attention backward's dQ
// (attention_mma.cuh).
#include "attention_mma.cuh"

// A block per query head and MT * 64 queries; 64 keys a tile, 32 a pass.
template <class E, int HT, int MT>
__global__ void __launch_bounds__(TC_THREADS, MT == 2 ? 2 : 1)
    attention_dq_mma(fl_dtype dt, void *dqkv, const void *dout, const void *qkv, const float *Dg,
                     const float *lse, att_shape a, int vec) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int qrows = MT * TC_TILE;
    int HS = a.HS, ldh = HS + 8, warp = threadIdx.x / 32;
    mma_bwd_tiles sh = mma_bwd_tiles_of(smem, HS, TC_TILE, qrows);
    int i0 = (gridDim.y - 1 - blockIdx.y) * qrows;
    int b = blockIdx.x / a.NH, h = blockIdx.x % a.NH, g = h / a.group;
    size_t row0 = (size_t)b * a.T * a.W, koff = row0 + (size_t)a.C + (size_t)g * HS;
    size_t voff = koff + (size_t)a.NKV * HS, qoff = row0 + (size_t)h * HS;
    mma_copy_rows(sh.Q, (const uint16_t *)qkv + qoff, a.W, i0, qrows, a.T, HS, vec);
    mma_copy_rows(sh.dO, (const uint16_t *)dout + (size_t)b * a.T * a.C + (size_t)h * HS, a.C, i0,
                  qrows, a.T, HS, vec);
    tc_row_stats(sh.L, sh.D, lse, Dg, b, h, i0, qrows, a, 1.4426950408889634f);
    const float sl2 = a.scale * 1.4426950408889634f;
    // the warp's m-tiles of 16 queries are the rows of its products, 32
    // keys a pass
    int q = warp * 16 + threadIdx.x % 32 / 4, i = i0 + warp * 16;
    float dQ[MT][HT][4];
    mma_zero(dQ);
    int keys = min(a.T, i0 + qrows);
    float Lr[MT][2], Dr[MT][2];
    for (int j0 = 0; j0 < keys; j0 += TC_TILE) {
        if (j0) __syncthreads(); // every warp is done with the last K and V
        mma_copy_rows(sh.K, (const uint16_t *)qkv + koff, a.W, j0, TC_TILE, a.T, HS, vec);
        mma_copy_rows(sh.V, (const uint16_t *)qkv + voff, a.W, j0, TC_TILE, a.T, HS, vec);
        fl_d_cp_async_commit();
        fl_d_cp_async_wait<0>(); // with the first, Q and dO
        __syncthreads();
        if (!j0)
#pragma unroll
            for (int m = 0; m < MT; m++)
#pragma unroll
                for (int r = 0; r < 2; r++) {
                    Lr[m][r] = sh.L[q + m * TC_TILE + 8 * r];
                    Dr[m][r] = sh.D[q + m * TC_TILE + 8 * r];
                }
        // the diagonal tile, queries or keys past T: masked
        int edge = j0 + TC_TILE > i0 || i0 + qrows > a.T || j0 + TC_TILE > a.T;
        for (int k0 = 0; k0 < TC_TILE; k0 += MMA_CHUNK) {
            int live = mma_live<MT>(i, j0 + k0);
            if (!live) continue;
            float s[MT][MMA_CT][4], dp[MT][MMA_CT][4];
            mma_zero(s);
            mma_zero(dp);
            mma_dots<E, MT, MMA_CT>(s, sh.Q + warp * 16 * ldh, sh.K + k0 * ldh, ldh, HS, live);
            mma_dots<E, MT, MMA_CT>(dp, sh.dO + warp * 16 * ldh, sh.V + k0 * ldh, ldh, HS, live);
#pragma unroll
            for (int m = 0; m < MT; m++)
                if (live >> m & 1)
                    mma_probs<1>(s[m], dp[m], i + m * TC_TILE, j0 + k0, edge, NULL, NULL, Lr[m],
                                 Dr[m], sl2, a.T);
#pragma unroll
            for (int k = 0; k < MMA_CT; k += 2) { // 16 keys a step
                uint32_t ds[MT][4];
                mma_as_a_mt<E>(ds, dp, k * 8, live);
                mma_times<E, HT, MT>(dQ, ds, sh.K + (k0 + k * 8) * ldh, ldh, HS, live); // dS K
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MT; m++)
        mma_store<HT>(dt, (char *)dqkv + qoff * 2, a.W, dQ[m], a.scale, a.scale,
                      i + m * TC_TILE + threadIdx.x % 32 / 4, a.T, HS);
}

template <class E, int HT, int MT>
static void mma_dq(fl_dtype dt, void *dqkv, const void *dout, const void *qkv, const float *D,
                   const float *lse, int B, const att_shape &a) {
    const int rows = MT * TC_TILE;
    size_t smem = mma_bwd_smem(a.HS, TC_TILE, rows);
    fl_cuda_attention_allow_smem((const void *)attention_dq_mma<E, HT, MT>, smem,
                                 "attention_backward");
    int tiles = (a.T + rows - 1) / rows;
    attention_dq_mma<E, HT, MT><<<dim3(B * a.NH, tiles), TC_THREADS, smem, fl_cuda_stream()>>>(
        dt, dqkv, dout, qkv, D, lse, a, tc_vec_ok(qkv, dout));
    FL_CUDA_LAUNCHED("attention_backward (dq; mma)");
}

void fl_cuda_attention_mma_dq(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                              const float *D, const float *lse, int B, const att_shape &a,
                              int wide) {
    MMA_DISPATCH(mma_dq, dt, dqkv, dout, qkv, D, lse, B, a);
}
