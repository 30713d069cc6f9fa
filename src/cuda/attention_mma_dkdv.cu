// attention_mma_dkdv.cu: the mma.sync attention backward's dK and dV
// (attention_mma.cuh).
#include "attention_mma.cuh"

// SPLIT 0: a block per kv head and MT * 64 keys, its group's query heads in
// turn, dK and dV written to dqkv. SPLIT 1 (grouped-query attention): a
// block per query head and MT * 64 keys, its head's dK and dV (dK
// unscaled) written in fp32 to the partials (K's, then V's: (B, NH, T, HS)
// each), which attention_group_sum adds over the group: a kv head's work
// spread over `group` times the blocks, as FlashAttention-2 spreads it.
// Heads of up to 64 values: MT 1 at most 128 registers (4 blocks a
// multiprocessor), or 168 split (3: under 4 ptxas spills); MT 2 at most 255
// (2 blocks); no spill (nvcc 13, sm_90a).
template <class E, int HT, int MT, int SPLIT>
__global__ void __launch_bounds__(TC_THREADS, HT == 8 ? (MT == 2 ? 2
                                                         : SPLIT ? 3
                                                                 : 4)
                                                      : 1)
    attention_dkdv_mma(fl_dtype dt, void *dqkv, float *partials, const void *dout, const void *qkv,
                       const float *Dg, const float *lse, att_shape a, int vec) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int krows = MT * TC_TILE;
    int HS = a.HS, ldh = HS + 8, warp = threadIdx.x / 32;
    mma_bwd_tiles sh = mma_bwd_tiles_of(smem, HS, krows, TC_TILE);
    int heads = SPLIT ? a.NH : a.NKV, hx = blockIdx.x % heads;
    int j0 = blockIdx.y * krows, b = blockIdx.x / heads, g = SPLIT ? hx / a.group : hx;
    int h_first = SPLIT ? hx : g * a.group, h_end = SPLIT ? hx + 1 : (g + 1) * a.group;
    size_t row0 = (size_t)b * a.T * a.W, koff = row0 + (size_t)a.C + (size_t)g * HS;
    size_t voff = koff + (size_t)a.NKV * HS;
    mma_copy_rows(sh.K, (const uint16_t *)qkv + koff, a.W, j0, krows, a.T, HS, vec);
    mma_copy_rows(sh.V, (const uint16_t *)qkv + voff, a.W, j0, krows, a.T, HS, vec);
    // the warp's m-tiles of 16 keys are the rows of its products (S^T =
    // K Q^T and dP^T = V dO^T), 32 queries a pass
    int j = j0 + warp * 16;
    const float sl2 = a.scale * 1.4426950408889634f;
    float dK[MT][HT][4], dV[MT][HT][4];
    mma_zero(dK);
    mma_zero(dV);
    for (int h = h_first; h < h_end; h++)            // the group's query heads, in order
        for (int i0 = j0; i0 < a.T; i0 += TC_TILE) { // rows at or below the diagonal
            __syncthreads();
            size_t orow0 = (size_t)b * a.T * a.C + (size_t)h * HS;
            mma_copy_rows(sh.Q, (const uint16_t *)qkv + row0 + (size_t)h * HS, a.W, i0, TC_TILE,
                          a.T, HS, vec);
            mma_copy_rows(sh.dO, (const uint16_t *)dout + orow0, a.C, i0, TC_TILE, a.T, HS, vec);
            fl_d_cp_async_commit();
            tc_row_stats(sh.L, sh.D, lse, Dg, b, h, i0, TC_TILE, a, 1.4426950408889634f);
            fl_d_cp_async_wait<0>();
            __syncthreads();
            // the diagonal's tiles, queries or keys past T: masked
            int edge = i0 < j0 + krows || i0 + TC_TILE > a.T || j0 + krows > a.T;
            for (int q0 = 0; q0 < TC_TILE; q0 += MMA_CHUNK) {
                // the key m-tiles some query of the pass sees
                int live = 0;
#pragma unroll
                for (int m = 0; m < MT; m++)
                    if (j + m * TC_TILE <= i0 + q0 + MMA_CHUNK - 1) live |= 1 << m;
                if (!live) continue;
                float st[MT][MMA_CT][4], dpt[MT][MMA_CT][4];
                mma_zero(st);
                mma_zero(dpt);
                mma_dots<E, MT, MMA_CT>(st, sh.K + warp * 16 * ldh, sh.Q + q0 * ldh, ldh, HS, live);
                mma_dots<E, MT, MMA_CT>(dpt, sh.V + warp * 16 * ldh, sh.dO + q0 * ldh, ldh, HS,
                                        live);
#pragma unroll
                for (int m = 0; m < MT; m++)
                    if (live >> m & 1)
                        mma_probs<0>(st[m], dpt[m], j + m * TC_TILE, i0 + q0, edge, sh.L + q0,
                                     sh.D + q0, NULL, NULL, sl2, a.T);
#pragma unroll
                for (int k = 0; k < MMA_CT; k += 2) { // 16 queries a step
                    uint32_t p[MT][4], ds[MT][4];
                    mma_as_a_mt<E>(p, st, k * 8, live);
                    mma_as_a_mt<E>(ds, dpt, k * 8, live);
                    mma_times<E, HT, MT>(dV, p, sh.dO + (q0 + k * 8) * ldh, ldh, HS,
                                         live); // P^T dO
                    mma_times<E, HT, MT>(dK, ds, sh.Q + (q0 + k * 8) * ldh, ldh, HS,
                                         live); // dS^T Q
                }
            }
        }
#pragma unroll
    for (int m = 0; m < MT; m++) {
        int i = j + m * TC_TILE + threadIdx.x % 32 / 4;
        if (SPLIT) {
            size_t at = ((size_t)b * a.NH + hx) * a.T * HS, plane = (size_t)gridDim.x * a.T * HS;
            mma_store_f32<HT>(partials + at, dK[m], i, a.T, HS);
            mma_store_f32<HT>(partials + plane + at, dV[m], i, a.T, HS);
        } else {
            mma_store<HT>(dt, (char *)dqkv + koff * 2, a.W, dK[m], a.scale, a.scale, i, a.T, HS);
            mma_store<HT>(dt, (char *)dqkv + voff * 2, a.W, dV[m], 1.0f, 1.0f, i, a.T, HS);
        }
    }
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

template <class E, int HT, int MT>
static void mma_dkdv(fl_dtype dt, void *dqkv, float *partials, const void *dout, const void *qkv,
                     const float *D, const float *lse, int B, const att_shape &a) {
    const int rows = MT * TC_TILE;
    size_t smem = mma_bwd_smem(a.HS, rows, TC_TILE);
    int split = partials && a.group > 1;
    const void *kernel = split ? (const void *)attention_dkdv_mma<E, HT, MT, 1>
                               : (const void *)attention_dkdv_mma<E, HT, MT, 0>;
    fl_cuda_attention_allow_smem(kernel, smem, "attention_backward");
    int tiles = (a.T + rows - 1) / rows, vec = tc_vec_ok(qkv, dout);
    if (split) {
        attention_dkdv_mma<E, HT, MT, 1>
            <<<dim3(B * a.NH, tiles), TC_THREADS, smem, fl_cuda_stream()>>>(
                dt, dqkv, partials, dout, qkv, D, lse, a, vec);
        FL_CUDA_LAUNCHED("attention_backward (dk, dv per query head; mma)");
        size_t n = (size_t)B * a.T * a.NKV * a.HS;
        attention_group_sum<<<fl_cuda_blocks(n, 256), 256, 0, fl_cuda_stream()>>>(dt, dqkv,
                                                                                  partials, B, a);
        FL_CUDA_LAUNCHED("attention_backward (dk, dv over the group)");
    } else {
        attention_dkdv_mma<E, HT, MT, 0>
            <<<dim3(B * a.NKV, tiles), TC_THREADS, smem, fl_cuda_stream()>>>(dt, dqkv, NULL, dout,
                                                                             qkv, D, lse, a, vec);
        FL_CUDA_LAUNCHED("attention_backward (dk, dv; mma)");
    }
}

void fl_cuda_attention_mma_dkdv(fl_dtype dt, void *dqkv, float *partials, const void *dout,
                                const void *qkv, const float *D, const float *lse, int B,
                                const att_shape &a, int wide) {
    MMA_DISPATCH(mma_dkdv, dt, dqkv, partials, dout, qkv, D, lse, B, a);
}
