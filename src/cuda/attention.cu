// attention.cu: causal grouped-query attention, flash style (kernels.h,
// src/kernels/attention.c, scale 1/sqrt(HS)). Tiles of `tile` query rows and
// `tile` keys in shared memory (fp32, rows padded by one float so a warp's
// lanes reading different rows hit different banks); no (T,T) buffer.
// Forward: a block per (query tile, b, query head) streams the key tiles up
// to the diagonal (the tiles above it are skipped, only the diagonal one is
// masked), keeps each row's running max and sum and rescales its output
// accumulator (online softmax), and saves lse = max + log(sum) (B,NH,T).
// Backward, deterministic without atomics, in two launches that own
// disjoint columns of dqkv:
// - dK, dV: a block per (key tile, b, kv head) walks its group's query heads
//   in order and, for each, the query tiles from the diagonal down, and
//   accumulates dV += P^T dO and dK += dS^T Q in shared memory (fp32);
// - dQ: a block per (query tile, b, query head) walks the key tiles up to
//   the diagonal and accumulates dQ += dS K.
// Grids are (heads, tiles), the costliest tiles first (the last query
// tiles, the first key tiles: the most work under the causal mask), so the
// short ones fill in at the end. Both backward kernels rebuild P = exp(S -
// lse) and dS = P (dO V^T - D), D = rowsum(dO O) per tile from out, so they
// need no workspace. Each gradient is written to dqkv once, rounded once
// (dqkv is overwritten: device.h). Every sum runs in a fixed order: two runs
// give the same bits.
// This file's kernels compute in fp32 (CUDA cores): fp32 heads, and 16-bit
// heads the tensor-core kernels (the same algorithm on 64-row tiles:
// attention_mma.cu, or attention_tc.cu's WMMA version) do not take (HS not
// a multiple of 16, or over 128).
#include "attention.cuh"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { ATT_THREADS = 128, ATT_MAX_HS = 256 };

// query rows and keys per tile: 32, or 16 for heads over 128 values (the
// backward's six (tile, HS) arrays stay under 100 KB of shared memory)
static int att_tile(int HS) {
    return HS <= 128 ? 32 : 16;
}

// rows [r0, r0 + tile) of a head (ld elements apart) into s (tile, HS + 1);
// rows past T are zero
__device__ void load_rows(float *s, fl_dtype dt, const void *base, size_t ld, int r0, int T,
                          int tile, int HS) {
    for (int idx = threadIdx.x; idx < tile * HS; idx += blockDim.x) {
        int r = idx / HS, d = idx % HS;
        s[r * (HS + 1) + d] = r0 + r < T ? fl_d_load(dt, base, (size_t)(r0 + r) * ld + d) : 0.0f;
    }
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int off = 16; off; off /= 2) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int off = 16; off; off /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// The tile products, each thread keeping its outputs in registers so that
// a value read from shared memory serves several multiply-adds.
//
// tile_dots: the thread's entries (r_j, c) of a (tile, tile) block of dot
// products X[r] . Y[c] over HS values, c = tid % tile and r_j = tid / tile
// + j * (threads / tile) for j < tile * tile / threads (at most 8): a warp
// reads one X row (a broadcast) and 32 Y rows one float apart (the padded
// stride: no bank conflicts).
enum { DOTS_MAX = 8, MM_MAX = 32 };

__device__ __forceinline__ int dots_count(int tile) {
    return tile * tile / (int)blockDim.x;
}

__device__ __forceinline__ int dots_row(int tile, int j) {
    return (int)threadIdx.x / tile + j * ((int)blockDim.x / tile);
}

__device__ __forceinline__ void tile_dots(float acc[DOTS_MAX], const float *X, const float *Y,
                                          int tile, int HS) {
    int hp = HS + 1, c = threadIdx.x % tile, n = dots_count(tile);
#pragma unroll
    for (int j = 0; j < DOTS_MAX; j++) acc[j] = 0.0f;
    for (int d = 0; d < HS; d++) {
        float y = Y[c * hp + d];
#pragma unroll
        for (int j = 0; j < DOTS_MAX; j++)
            if (j < n) acc[j] += X[dots_row(tile, j) * hp + d] * y;
    }
}

// tile_mm: Cm (rows, HS; rows HS + 1 apart) += sum over k < kn of A(r, k)
// Bm[k] (Bm rows HS + 1 apart), A(r, k) = A[r * lda + k], or with trans
// A[k * lda + r]; with rowscale, C's rows are first multiplied by it. When
// HS divides the block's threads each thread owns one column d = tid % HS
// and rows tid / HS + j * (threads / HS) (at most 32): one Bm value serves
// all of them, and a warp's A reads are broadcasts. Otherwise (HS 160,
// 256, ...) one output per step of a strided loop.
__device__ void tile_mm(float *Cm, const float *A, int lda, bool trans, const float *Bm, int rows,
                        int kn, int HS, const float *rowscale) {
    int hp = HS + 1, nt = blockDim.x;
    if (nt % HS == 0 && rows * HS / nt <= MM_MAX) {
        int d = threadIdx.x % HS, r0 = threadIdx.x / HS, step = nt / HS, n = rows * HS / nt;
        float acc[MM_MAX];
#pragma unroll
        for (int j = 0; j < MM_MAX; j++)
            if (j < n) {
                int r = r0 + j * step;
                acc[j] = Cm[r * hp + d] * (rowscale ? rowscale[r] : 1.0f);
            }
        for (int k = 0; k < kn; k++) {
            float b = Bm[k * hp + d];
#pragma unroll
            for (int j = 0; j < MM_MAX; j++)
                if (j < n) {
                    int r = r0 + j * step;
                    acc[j] += (trans ? A[k * lda + r] : A[r * lda + k]) * b;
                }
        }
#pragma unroll
        for (int j = 0; j < MM_MAX; j++)
            if (j < n) Cm[(r0 + j * step) * hp + d] = acc[j];
        return;
    }
    for (int idx = threadIdx.x; idx < rows * HS; idx += nt) {
        int r = idx / HS, d = idx % HS;
        float acc = Cm[r * hp + d] * (rowscale ? rowscale[r] : 1.0f);
        for (int k = 0; k < kn; k++)
            acc += (trans ? A[k * lda + r] : A[r * lda + k]) * Bm[k * hp + d];
        Cm[r * hp + d] = acc;
    }
}

__global__ void attention_forward_kernel(fl_dtype dt, void *out, float *lse, const void *qkv,
                                         att_shape a) {
    extern __shared__ float sm[];
    int tile = a.tile, HS = a.HS, hp = HS + 1, i0 = (gridDim.y - 1 - blockIdx.y) * tile;
    int b = blockIdx.x / a.NH, h = blockIdx.x % a.NH, g = h / a.group;
    float *Q = sm, *K = Q + tile * hp, *V = K + tile * hp, *O = V + tile * hp;
    float *S = O + tile * hp, *m = S + tile * (tile + 1), *l = m + tile, *alpha = l + tile;
    const void *row0 = fl_d_at(dt, qkv, (size_t)b * a.T * a.W);
    load_rows(Q, dt, fl_d_at(dt, row0, (size_t)h * HS), a.W, i0, a.T, tile, HS);
    for (int idx = threadIdx.x; idx < tile * hp; idx += blockDim.x) O[idx] = 0.0f;
    for (int r = threadIdx.x; r < tile; r += blockDim.x) m[r] = -INFINITY, l[r] = 0.0f;
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    int keys = min(a.T, i0 + tile); // the block's last row sees keys 0..keys-1
    for (int j0 = 0; j0 < keys; j0 += tile) {
        __syncthreads();
        load_rows(K, dt, fl_d_at(dt, row0, (size_t)a.C + g * HS), a.W, j0, a.T, tile, HS);
        load_rows(V, dt, fl_d_at(dt, row0, (size_t)a.C + (a.NKV + g) * HS), a.W, j0, a.T, tile, HS);
        __syncthreads();
        float acc[DOTS_MAX];
        tile_dots(acc, Q, K, tile, HS);
        int c = threadIdx.x % tile, j = j0 + c;
#pragma unroll
        for (int k = 0; k < DOTS_MAX; k++)
            if (k < dots_count(tile)) {
                int r = dots_row(tile, k), i = i0 + r;
                S[r * (tile + 1) + c] = j <= i && j < a.T ? a.scale * acc[k] : -INFINITY;
            }
        __syncthreads();
        // a warp per row, a lane per key: the tile's max and sum, rescaled
        for (int r = warp; r < tile; r += nw) {
            float s = lane < tile ? S[r * (tile + 1) + lane] : -INFINITY;
            float mnew = fmaxf(m[r], warp_max(s)); // finite: key 0 is in every row's first tile
            float p = s == -INFINITY ? 0.0f : expf(s - mnew);
            float sum = warp_sum(p);
            if (lane < tile) S[r * (tile + 1) + lane] = p;
            if (lane == 0) {
                float c = expf(m[r] - mnew); // 0 on the first tile
                l[r] = l[r] * c + sum, m[r] = mnew, alpha[r] = c;
            }
        }
        __syncthreads();
        tile_mm(O, S, tile + 1, false, V, tile, tile, HS, alpha);
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < tile * HS; idx += blockDim.x) {
        int r = idx / HS, d = idx % HS, i = i0 + r;
        if (i < a.T)
            fl_d_store(dt, out, ((size_t)b * a.T + i) * a.C + (size_t)h * HS + d,
                       O[r * hp + d] / l[r]);
    }
    for (int r = threadIdx.x; r < tile; r += blockDim.x)
        if (i0 + r < a.T) lse[((size_t)b * a.NH + h) * a.T + i0 + r] = m[r] + logf(l[r]);
}

// A query tile's rows of head h: Q, dO (tile, HS + 1), lse and D = rowsum(dO
// O) (tile); rows past T are zero.
__device__ void load_query_tile(float *Q, float *dO, float *L, float *D, fl_dtype dt,
                                const void *qkv, const void *out, const void *dout,
                                const float *lse, int b, int h, int i0, const att_shape &a) {
    int tile = a.tile, HS = a.HS, hp = HS + 1;
    size_t orow0 = (size_t)b * a.T * a.C + (size_t)h * HS;
    load_rows(Q, dt, fl_d_at(dt, qkv, (size_t)b * a.T * a.W + (size_t)h * HS), a.W, i0, a.T, tile,
              HS);
    load_rows(dO, dt, fl_d_at(dt, dout, orow0), a.C, i0, a.T, tile, HS);
    __syncthreads();
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    for (int r = warp; r < tile; r += nw) {
        int i = i0 + r;
        float s = 0.0f;
        if (i < a.T)
            for (int d = lane; d < HS; d += 32)
                s += dO[r * hp + d] * fl_d_load(dt, out, orow0 + (size_t)i * a.C + d);
        s = warp_sum(s);
        if (lane == 0) {
            D[r] = s;
            L[r] = i < a.T ? lse[((size_t)b * a.NH + h) * a.T + i] : 0.0f;
        }
    }
}

// P (tile, tile + 1) = exp(scale Q K^T - lse), zero where row i may not see
// key j (j > i, or i past T), and dS = P (dO V^T - D)
__device__ void probs_and_dscores(float *P, float *dS, const float *Q, const float *dO,
                                  const float *K, const float *V, const float *L, const float *D,
                                  int i0, int j0, const att_shape &a) {
    int tile = a.tile, HS = a.HS, c = threadIdx.x % tile, j = j0 + c;
    float s[DOTS_MAX], dp[DOTS_MAX];
    tile_dots(s, Q, K, tile, HS);
    tile_dots(dp, dO, V, tile, HS);
#pragma unroll
    for (int k = 0; k < DOTS_MAX; k++)
        if (k < dots_count(tile)) {
            int r = dots_row(tile, k), i = i0 + r;
            float p = 0.0f, ds = 0.0f;
            if (i < a.T && j <= i) {
                p = expf(a.scale * s[k] - L[r]);
                ds = p * (dp[k] - D[r]);
            }
            P[r * (tile + 1) + c] = p;
            dS[r * (tile + 1) + c] = ds;
        }
}

// dst (rows [r0, r0 + tile) of a head, ld apart) = round(f * acc): dqkv is
// overwritten (device.h), each value by one block
__device__ void store_rows(fl_dtype dt, void *base, size_t ld, const float *acc, float f, int r0,
                           int T, int tile, int HS) {
    for (int idx = threadIdx.x; idx < tile * HS; idx += blockDim.x) {
        int r = idx / HS, d = idx % HS;
        if (r0 + r < T) fl_d_store(dt, base, (size_t)(r0 + r) * ld + d, f * acc[r * (HS + 1) + d]);
    }
}

__global__ void attention_dkdv_kernel(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                                      const void *out, const float *lse, att_shape a) {
    extern __shared__ float sm[];
    int tile = a.tile, HS = a.HS, hp = HS + 1, j0 = blockIdx.y * tile;
    int b = blockIdx.x / a.NKV, g = blockIdx.x % a.NKV;
    float *K = sm, *V = K + tile * hp, *dK = V + tile * hp, *dV = dK + tile * hp;
    float *Q = dV + tile * hp, *dO = Q + tile * hp, *P = dO + tile * hp;
    float *dS = P + tile * (tile + 1), *L = dS + tile * (tile + 1), *D = L + tile;
    size_t row0 = (size_t)b * a.T * a.W, koff = row0 + (size_t)a.C + (size_t)g * HS;
    size_t voff = koff + (size_t)a.NKV * HS;
    load_rows(K, dt, fl_d_at(dt, qkv, koff), a.W, j0, a.T, tile, HS);
    load_rows(V, dt, fl_d_at(dt, qkv, voff), a.W, j0, a.T, tile, HS);
    for (int idx = threadIdx.x; idx < tile * hp; idx += blockDim.x) dK[idx] = dV[idx] = 0.0f;
    for (int h = g * a.group; h < (g + 1) * a.group; h++) // the group's query heads, in order
        for (int i0 = j0; i0 < a.T; i0 += tile) {         // rows at or below the diagonal
            __syncthreads();
            load_query_tile(Q, dO, L, D, dt, qkv, out, dout, lse, b, h, i0, a);
            __syncthreads();
            probs_and_dscores(P, dS, Q, dO, K, V, L, D, i0, j0, a);
            __syncthreads();
            tile_mm(dV, P, tile + 1, true, dO, tile, tile, HS, NULL);
            tile_mm(dK, dS, tile + 1, true, Q, tile, tile, HS, NULL);
        }
    __syncthreads();
    store_rows(dt, fl_d_at(dt, dqkv, koff), a.W, dK, a.scale, j0, a.T, tile, HS);
    store_rows(dt, fl_d_at(dt, dqkv, voff), a.W, dV, 1.0f, j0, a.T, tile, HS);
}

__global__ void attention_dq_kernel(fl_dtype dt, void *dqkv, const void *dout, const void *qkv,
                                    const void *out, const float *lse, att_shape a) {
    extern __shared__ float sm[];
    int tile = a.tile, HS = a.HS, hp = HS + 1, i0 = (gridDim.y - 1 - blockIdx.y) * tile;
    int b = blockIdx.x / a.NH, h = blockIdx.x % a.NH, g = h / a.group;
    float *K = sm, *V = K + tile * hp, *dQ = V + tile * hp, *Q = dQ + tile * hp;
    float *dO = Q + tile * hp, *P = dO + tile * hp, *dS = P + tile * (tile + 1);
    float *L = dS + tile * (tile + 1), *D = L + tile;
    size_t row0 = (size_t)b * a.T * a.W, koff = row0 + (size_t)a.C + (size_t)g * HS;
    size_t voff = koff + (size_t)a.NKV * HS;
    for (int idx = threadIdx.x; idx < tile * hp; idx += blockDim.x) dQ[idx] = 0.0f;
    load_query_tile(Q, dO, L, D, dt, qkv, out, dout, lse, b, h, i0, a);
    int keys = min(a.T, i0 + tile);
    for (int j0 = 0; j0 < keys; j0 += tile) {
        __syncthreads();
        load_rows(K, dt, fl_d_at(dt, qkv, koff), a.W, j0, a.T, tile, HS);
        load_rows(V, dt, fl_d_at(dt, qkv, voff), a.W, j0, a.T, tile, HS);
        __syncthreads();
        probs_and_dscores(P, dS, Q, dO, K, V, L, D, i0, j0, a);
        __syncthreads();
        tile_mm(dQ, dS, tile + 1, false, K, tile, tile, HS, NULL);
    }
    __syncthreads();
    store_rows(dt, fl_d_at(dt, dqkv, row0 + (size_t)h * HS), a.W, dQ, a.scale, i0, a.T, tile, HS);
}

static att_shape shape_of(int T, int NH, int NKV, int HS) {
    if (NH <= 0 || NKV <= 0 || NH % NKV || HS <= 0 || HS > ATT_MAX_HS)
        fl_die("cuda attention: %d query heads over %d kv heads of %d values: NKV must divide NH "
               "and heads hold at most %d values",
               NH, NKV, HS, ATT_MAX_HS);
    att_shape a = {T,       NH,           NKV,
                   HS,      NH / NKV,     (NH + 2 * NKV) * HS,
                   NH * HS, att_tile(HS), 1.0f / sqrtf((float)HS)};
    return a;
}

void fl_cuda_attention_allow_smem(const void *kernel, size_t bytes, const char *what) {
    cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes);
    if (e != cudaSuccess)
        fl_die("cuda: %s: %zu bytes of shared memory: %s", what, bytes, cudaGetErrorString(e));
}

// Which tensor-core kernels take 16-bit heads: FITLM_CUDA_ATTENTION=mma
// (the default: attention_mma.cu) or wmma (attention_tc.cu), read at each
// call so that a test can run both.
static int use_wmma(void) {
    const char *v = getenv("FITLM_CUDA_ATTENTION");
    if (!v || !*v || !strcmp(v, "mma")) return 0;
    if (!strcmp(v, "wmma")) return 1;
    fl_die("FITLM_CUDA_ATTENTION=%s: the tensor-core attention kernels are mma or wmma", v);
}

// A warp a row (D's rows in lse's order).
__global__ void attention_rows_d(fl_dtype dt, float *Dg, const void *out, const void *dout, int B,
                                 att_shape a) {
    int lane = threadIdx.x % 32;
    size_t rows = (size_t)B * a.NH * a.T;
    for (size_t row = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; row < rows;
         row += (size_t)gridDim.x * blockDim.x / 32) {
        size_t i = row % a.T, h = row / a.T % a.NH, b = row / ((size_t)a.T * a.NH);
        size_t orow = (b * a.T + i) * a.C + h * a.HS;
        float s = 0.0f;
        for (int d = lane; d < a.HS; d += 32)
            s += fl_d_load(dt, dout, orow + d) * fl_d_load(dt, out, orow + d);
        s = fl_d_warp_sum(s);
        if (lane == 0) Dg[row] = s;
    }
}

float *fl_cuda_attention_rows_d(fl_dtype dt, const void *out, const void *dout, int B,
                                const att_shape &a) {
    size_t rows = (size_t)B * a.NH * a.T;
    float *D = (float *)fl_cuda_scratch(rows * sizeof(float));
    attention_rows_d<<<fl_cuda_blocks(rows * 32, ATT_THREADS), ATT_THREADS, 0, fl_cuda_stream()>>>(
        dt, D, out, dout, B, a);
    FL_CUDA_LAUNCHED("attention_backward (D)");
    return D;
}

// The kernels keep every sum in shared memory or registers (D, once per
// backward, in the backend's scratch): no workspace, but for the mma.sync
// backward under grouped-query attention, whose dK and dV are summed over
// a kv head's query heads from per-head fp32 partials (attention_mma.cu).
extern "C" size_t fl_cuda_attention_workspace_floats(fl_dtype dt, int B, int T, int NH, int HS,
                                                     int group, int threads) {
    (void)threads;
    if (!fl_cuda_attention_tc(dt, HS) || use_wmma() || group < 2) return 0;
    return fl_cuda_attention_mma_partials(B, T, NH, HS);
}

extern "C" void fl_cuda_attention_forward(fl_dtype dt, void *out, float *lse, const void *qkv,
                                          float *workspace, int B, int T, int NH, int NKV, int HS) {
    (void)workspace;
    att_shape a = shape_of(T, NH, NKV, HS);
    if (B <= 0 || T <= 0) return;
    if (fl_cuda_attention_tc(dt, HS)) {
        if (use_wmma())
            fl_cuda_attention_tc_forward(dt, out, lse, qkv, B, a);
        else
            fl_cuda_attention_mma_forward(dt, out, lse, qkv, B, a);
        return;
    }
    int tile = a.tile, hp = HS + 1;
    size_t smem = sizeof(float) * ((size_t)4 * tile * hp + (size_t)tile * (tile + 1) + 3 * tile);
    fl_cuda_attention_allow_smem((const void *)attention_forward_kernel, smem, "attention_forward");
    dim3 grid(B * NH, (T + tile - 1) / tile);
    attention_forward_kernel<<<grid, ATT_THREADS, smem, fl_cuda_stream()>>>(dt, out, lse, qkv, a);
    FL_CUDA_LAUNCHED("attention_forward");
}

extern "C" void fl_cuda_attention_backward(fl_dtype dt, void *dqkv, const void *dout,
                                           const void *qkv, const void *out, const float *lse,
                                           float *workspace, int B, int T, int NH, int NKV,
                                           int HS) {
    att_shape a = shape_of(T, NH, NKV, HS);
    if (B <= 0 || T <= 0) return;
    if (fl_cuda_attention_tc(dt, HS)) {
        if (use_wmma())
            fl_cuda_attention_tc_backward(dt, dqkv, dout, qkv, out, lse, B, a);
        else
            fl_cuda_attention_mma_backward(dt, dqkv, dout, qkv, out, lse, workspace, B, a);
        return;
    }
    int tile = a.tile, hp = HS + 1;
    size_t smem =
        sizeof(float) * ((size_t)6 * tile * hp + (size_t)2 * tile * (tile + 1) + 2 * tile);
    fl_cuda_attention_allow_smem((const void *)attention_dkdv_kernel, smem, "attention_backward");
    fl_cuda_attention_allow_smem((const void *)attention_dq_kernel, smem, "attention_backward");
    int tiles = (T + tile - 1) / tile;
    attention_dkdv_kernel<<<dim3(B * NKV, tiles), ATT_THREADS, smem, fl_cuda_stream()>>>(
        dt, dqkv, dout, qkv, out, lse, a);
    FL_CUDA_LAUNCHED("attention_backward (dk, dv)");
    attention_dq_kernel<<<dim3(B * NH, tiles), ATT_THREADS, smem, fl_cuda_stream()>>>(
        dt, dqkv, dout, qkv, out, lse, a);
    FL_CUDA_LAUNCHED("attention_backward (dq)");
}
