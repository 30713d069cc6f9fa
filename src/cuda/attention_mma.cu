// attention_mma.cu: the mma.sync attention's forward (attention_mma.cuh)
// and the order of its backward's launches.
#include "attention_mma.cuh"

template <class E, int HT, int MT>
__global__ void __launch_bounds__(TC_THREADS)
    attention_forward_mma(fl_dtype dt, void *out, float *lse, const void *qkv, att_shape a,
                          int vec) {
    extern __shared__ __align__(128) unsigned char smem[];
    const int rows = MT * TC_TILE;
    int HS = a.HS, ldh = HS + 8, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint16_t *Q = (uint16_t *)smem, *K = Q + rows * ldh, *V = K + TC_TILE * ldh;
    int i0 = (gridDim.y - 1 - blockIdx.y) * rows;
    int b = blockIdx.x / a.NH, h = blockIdx.x % a.NH, g = h / a.group;
    const uint16_t *row0 = (const uint16_t *)qkv + (size_t)b * a.T * a.W;
    const uint16_t *kbase = row0 + (size_t)a.C + (size_t)g * HS,
                   *vbase = kbase + (size_t)a.NKV * HS;
    // K and V in separate groups, each tile's copy issued as soon as the
    // last is used (FlashAttention-2's order): the next K comes while the
    // softmax and P V run, the next V while the next scores do
    mma_copy_rows(Q, row0 + (size_t)h * HS, a.W, i0, rows, a.T, HS, vec);
    mma_copy_rows(K, kbase, a.W, 0, TC_TILE, a.T, HS, vec);
    fl_d_cp_async_commit();
    mma_copy_rows(V, vbase, a.W, 0, TC_TILE, a.T, HS, vec);
    fl_d_cp_async_commit();
    // the lane's rows (i + 64 m, i + 64 m + 8) and its columns' offset in
    // each tile
    int i = i0 + warp * 16 + lane / 4, c2 = 2 * (lane % 4);
    // Q's A operands, in registers for every key tile
    fl_d_cp_async_wait<1>();
    __syncthreads();
    uint32_t q[HT / 2][MT][4];
#pragma unroll
    for (int k = 0; k < HT / 2; k++)
        if (k * 16 < HS)
#pragma unroll
            for (int m = 0; m < MT; m++)
                fl_d_mma_load_a(q[k][m], Q + (size_t)(m * TC_TILE + warp * 16) * ldh + k * 16, ldh);
    // mx: each row's running max of the scores in units of log2 (scale
    // log2(e) s), as exp2 takes them; l: the lane's part of its row's sum
    // (the quad's parts are added at the end)
    const float sl2 = a.scale * 1.4426950408889634f;
    float o[MT][HT][4], mx[MT][2], l[MT][2];
    mma_zero(o);
#pragma unroll
    for (int m = 0; m < MT; m++) mx[m][0] = mx[m][1] = -INFINITY, l[m][0] = l[m][1] = 0.0f;
    int keys = min(a.T, i0 + rows); // the block's last row sees keys 0..keys-1
    for (int j0 = 0; j0 < keys; j0 += TC_TILE) {
        int next = j0 + TC_TILE < keys, live = mma_live<MT>(i0 + warp * 16, j0);
        fl_d_cp_async_wait<1>(); // this K, not necessarily this V
        __syncthreads();
        float s[MT][MMA_NT][4];
        mma_zero(s);
#pragma unroll
        for (int k = 0; k < HT / 2; k++)
            if (k * 16 < HS) mma_row_products<E, MT, MMA_NT>(s, q[k], K + k * 16, ldh, live);
        __syncthreads(); // every warp is done with K
        if (next) mma_copy_rows(K, kbase, a.W, j0 + TC_TILE, TC_TILE, a.T, HS, vec);
        fl_d_cp_async_commit();
        // masked only on the diagonal tile and the one past T
        int edge = j0 + TC_TILE > i0 || j0 + TC_TILE > a.T;
#pragma unroll
        for (int m = 0; m < MT; m++) {
            if (!(live >> m & 1)) continue;
            // each row's max over the tile (-inf where the mask covers the
            // row's part: its max stays, finite from key 0 in the first tile)
            float mt[2] = {-INFINITY, -INFINITY};
            int im = i + m * TC_TILE;
#pragma unroll
            for (int n = 0; n < MMA_NT; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int j = j0 + n * 8 + c2 + e % 2;
                    if (edge && (j > im + 8 * (e / 2) || j >= a.T)) s[m][n][e] = -INFINITY;
                    mt[e / 2] = fmaxf(mt[e / 2], s[m][n][e]);
                }
            float alpha[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 1));
                mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 2));
                float mnew = fmaxf(mx[m][r], mt[r] * sl2); // scale > 0: the max of the scaled
                alpha[r] = exp2f(mx[m][r] - mnew);         // 0 on the first tile
                mx[m][r] = mnew;
                l[m][r] *= alpha[r];
            }
            // p = e^(scale s - max): one multiply-add and one exp2 a score
#pragma unroll
            for (int n = 0; n < MMA_NT; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    s[m][n][e] = exp2f(__fmaf_rn(s[m][n][e], sl2, -mx[m][e / 2]));
                    l[m][e / 2] += s[m][n][e];
                }
#pragma unroll
            for (int n = 0; n < HT; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) o[m][n][e] *= alpha[e / 2];
        }
        // O += P V, P rounded to the 16-bit type as FlashAttention does
        fl_d_cp_async_wait<1>(); // this V, not necessarily the next K
        __syncthreads();
#pragma unroll
        for (int k = 0; k < MMA_NT; k += 2) {
            uint32_t p[MT][4];
            mma_as_a_mt<E>(p, s, k * 8, live);
            mma_times<E, HT, MT>(o, p, V + k * 8 * ldh, ldh, HS, live);
        }
        __syncthreads(); // every warp is done with V
        if (next) mma_copy_rows(V, vbase, a.W, j0 + TC_TILE, TC_TILE, a.T, HS, vec);
        fl_d_cp_async_commit();
    }
    fl_d_cp_async_wait<0>(); // the last, empty groups
    void *obase = (char *)out + ((size_t)b * a.T * a.C + (size_t)h * HS) * 2;
#pragma unroll
    for (int m = 0; m < MT; m++) {
#pragma unroll
        for (int r = 0; r < 2; r++) {
            l[m][r] += __shfl_xor_sync(0xffffffffu, l[m][r], 1);
            l[m][r] += __shfl_xor_sync(0xffffffffu, l[m][r], 2);
        }
        int im = i + m * TC_TILE;
        mma_store<HT>(dt, obase, a.C, o[m], 1.0f / l[m][0], 1.0f / l[m][1], im, a.T, HS);
        if (lane % 4 == 0)
            for (int r = 0; r < 2; r++)
                if (im + 8 * r < a.T)
                    lse[((size_t)b * a.NH + h) * a.T + im + 8 * r] =
                        mx[m][r] * 0.6931471805599453f + logf(l[m][r]);
    }
}

template <class E, int HT, int MT>
static void mma_forward(fl_dtype dt, void *out, float *lse, const void *qkv, int B,
                        const att_shape &a) {
    size_t smem = mma_smem(a.HS, (MT + 2) * TC_TILE, 0);
    fl_cuda_attention_allow_smem((const void *)attention_forward_mma<E, HT, MT>, smem,
                                 "attention_forward");
    dim3 grid(B * a.NH, (a.T + MT * TC_TILE - 1) / (MT * TC_TILE));
    attention_forward_mma<E, HT, MT>
        <<<grid, TC_THREADS, smem, fl_cuda_stream()>>>(dt, out, lse, qkv, a, tc_vec_ok(qkv, qkv));
    FL_CUDA_LAUNCHED("attention_forward (mma)");
}

void fl_cuda_attention_mma_forward(fl_dtype dt, void *out, float *lse, const void *qkv, int B,
                                   const att_shape &a, int wide) {
    MMA_DISPATCH(mma_forward, dt, out, lse, qkv, B, a);
}

// D first (both kernels read it), then dK and dV, then dQ: disjoint outputs
void fl_cuda_attention_mma_backward(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                                    const void *out, const float *lse, float *partials, int B,
                                    const att_shape &a, int wide) {
    float *D = fl_cuda_attention_rows_d(dt, out, dout, B, a);
    fl_cuda_attention_mma_dkdv(dt, dqkv, partials, dout, qkv, D, lse, B, a, wide);
    fl_cuda_attention_mma_dq(dt, dqkv, dout, qkv, D, lse, B, a, wide);
}

size_t fl_cuda_attention_mma_partials(int B, int T, int NH, int HS) {
    return 2 * (size_t)B * T * NH * HS;
}
