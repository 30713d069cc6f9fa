// softmax_xent.cu: the fused classifier and the vocabulary-parallel pieces
// (kernels.h, src/kernels/softmax_xent.c). One block per row (token): each
// thread keeps a running max and exp-sum over its strided columns (online,
// fp32), the block merges the threads' pairs in a fixed order (the same
// bits on every run), and a second pass writes the gradient in place: each
// element is read and overwritten by the same thread, so dlogits may alias
// logits. The target's gradient is dloss * (p - 1), not dloss * p - dloss,
// as on the cpu; a row without loss (target -1) and the padding V..Vp-1 get
// exact zeros (in a shard, a -1 target is another rank's: dloss * p).
#include "common.cuh"

#include <math.h>

enum { XENT_THREADS = 512 };

// (max, sum of exp(x - max)) pairs merged: the smaller max's sum rescaled
__device__ __forceinline__ void merge(float *m, float *s, float m2, float s2) {
    float mx = fmaxf(*m, m2);
    if (mx == -INFINITY) return; // both empty
    *s = *s * expf(*m - mx) + s2 * expf(m2 - mx);
    *m = mx;
}

// The block's (max, sum) over the row's first V logits: per thread online,
// then across the warp by shuffles and across warps through shared memory,
// always in the same order. Every thread returns the row's pair.
__device__ void row_max_sum(fl_dtype dt, const void *row, int V, float *m_out, float *s_out) {
    __shared__ float wm[XENT_THREADS / 32], ws[XENT_THREADS / 32];
    float m = -INFINITY, s = 0.0f;
    int bd = blockDim.x;
    // a thread's FL_D_VEC columns at a time, in order (common.cuh)
    for (int j = threadIdx.x * FL_D_VEC; j < V; j += FL_D_VEC * bd) {
        float x[FL_D_VEC];
        fl_d_load_vec(dt, row, j, V, x);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) {
            if (j + k >= V) break;
            if (x[k] > m) {
                s = s * expf(m - x[k]) + 1.0f;
                m = x[k];
            } else {
                s += expf(x[k] - m);
            }
        }
    }
    for (int off = 16; off; off /= 2) {
        float m2 = __shfl_down_sync(0xffffffffu, m, off),
              s2 = __shfl_down_sync(0xffffffffu, s, off);
        merge(&m, &s, m2, s2);
    }
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, nw = blockDim.x / 32;
    if (lane == 0) wm[warp] = m, ws[warp] = s;
    __syncthreads();
    m = wm[0], s = ws[0];
    for (int w = 1; w < nw; w++) merge(&m, &s, wm[w], ws[w]);
    __syncthreads(); // wm, ws are reused by the row's next call
    *m_out = m, *s_out = s;
}

// dlogits row = dloss * (softmax - onehot) for j < V, 0 for the padding
// (and for the whole row when it has no loss, outside a shard); FL_D_VEC
// columns a thread at a time, read before any is written (common.cuh)
__device__ void backward_row(fl_dtype dt, void *drow, const void *row, float lse, int target,
                             float dloss, int V, int Vp, int shard) {
    int live = target >= 0 || shard, bd = blockDim.x;
    for (int j = threadIdx.x * FL_D_VEC; j < Vp; j += FL_D_VEC * bd) {
        float x[FL_D_VEC];
        fl_d_load_vec(dt, row, j, live ? V : 0, x);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) {
            int c = j + k;
            float g = 0.0f;
            if (live && c < V) {
                float p = expf(x[k] - lse);
                g = c == target ? dloss * (p - 1.0f) : dloss * p;
            }
            x[k] = g;
        }
        fl_d_store_vec(dt, drow, j, Vp, x);
    }
}

__global__ void xent_forward_kernel(fl_dtype dt, float *losses, float *lse, void *logits,
                                    const int *targets, const float *dlosses, int V, int Vp,
                                    int fused) {
    size_t i = blockIdx.x;
    void *row = fl_d_at(dt, logits, i * Vp);
    int target = targets[i];
    float m, s;
    row_max_sum(dt, row, V, &m, &s);
    float l = m + logf(s);
    // the target's logit is read before any thread overwrites the row: the
    // barriers in row_max_sum came after every thread's last read of it
    if (threadIdx.x == 0) {
        lse[i] = l;
        losses[i] = target < 0 ? 0.0f : l - fl_d_load(dt, row, target);
    }
    if (!fused) return;
    __syncthreads();
    backward_row(dt, row, row, l, target, dlosses[i], V, Vp, 0);
}

__global__ void xent_backward_kernel(fl_dtype dt, void *dlogits, const void *logits,
                                     const float *lse, const int *targets, const float *dlosses,
                                     int V, int Vp, int shard) {
    size_t i = blockIdx.x;
    backward_row(dt, fl_d_at(dt, dlogits, i * Vp), fl_d_at(dt, logits, i * Vp), lse[i], targets[i],
                 dlosses[i], V, Vp, shard);
}

__global__ void xent_shard_max_kernel(fl_dtype dt, float *mx, const void *logits, int V, int Vp) {
    __shared__ float wm[XENT_THREADS / 32];
    size_t i = blockIdx.x;
    const void *row = fl_d_at(dt, logits, i * Vp);
    float m = -INFINITY;
    for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, fl_d_load(dt, row, j));
    for (int off = 16; off; off /= 2) m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, off));
    if (threadIdx.x % 32 == 0) wm[threadIdx.x / 32] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)blockDim.x / 32; w++) m = fmaxf(m, wm[w]);
        mx[i] = m;
    }
}

// sums[2i] = sum of exp(x - mx[i]) in double (kernels.h), stored in fp32
__global__ void xent_shard_sums_kernel(fl_dtype dt, float *sums, const void *logits,
                                       const float *mx, const int *targets, int V, int Vp) {
    __shared__ double wsum[XENT_THREADS / 32];
    size_t i = blockIdx.x;
    const void *row = fl_d_at(dt, logits, i * Vp);
    float m = mx[i];
    double s = 0.0;
    for (int j = threadIdx.x; j < V; j += blockDim.x) s += (double)expf(fl_d_load(dt, row, j) - m);
    s = fl_d_block_sum_double(s, wsum);
    if (threadIdx.x == 0) {
        int target = targets[i];
        sums[2 * i] = (float)s;
        sums[2 * i + 1] = target < 0 ? 0.0f : fl_d_load(dt, row, target);
    }
}

extern "C" void fl_cuda_softmax_xent_forward(fl_dtype dt, float *losses, float *lse,
                                             const void *logits, const int *targets, int N, int V,
                                             int Vp) {
    if (N <= 0) return;
    xent_forward_kernel<<<N, XENT_THREADS, 0, fl_cuda_stream()>>>(dt, losses, lse, (void *)logits,
                                                                  targets, NULL, V, Vp, 0);
    FL_CUDA_LAUNCHED("softmax_xent_forward");
}

extern "C" void fl_cuda_softmax_xent_backward(fl_dtype dt, void *dlogits, const void *logits,
                                              const float *lse, const int *targets,
                                              const float *dlosses, int N, int V, int Vp) {
    if (N <= 0) return;
    xent_backward_kernel<<<N, XENT_THREADS, 0, fl_cuda_stream()>>>(dt, dlogits, logits, lse,
                                                                   targets, dlosses, V, Vp, 0);
    FL_CUDA_LAUNCHED("softmax_xent_backward");
}

extern "C" void fl_cuda_softmax_xent_forward_backward(fl_dtype dt, float *losses, float *lse,
                                                      void *logits, const int *targets,
                                                      const float *dlosses, int N, int V, int Vp) {
    if (N <= 0) return;
    xent_forward_kernel<<<N, XENT_THREADS, 0, fl_cuda_stream()>>>(dt, losses, lse, logits, targets,
                                                                  dlosses, V, Vp, 1);
    FL_CUDA_LAUNCHED("softmax_xent_forward_backward");
}

extern "C" void fl_cuda_xent_shard_max(fl_dtype dt, float *mx, const void *logits, int N, int V,
                                       int Vp) {
    if (N <= 0) return;
    xent_shard_max_kernel<<<N, XENT_THREADS, 0, fl_cuda_stream()>>>(dt, mx, logits, V, Vp);
    FL_CUDA_LAUNCHED("xent_shard_max");
}

extern "C" void fl_cuda_xent_shard_sums(fl_dtype dt, float *sums, const void *logits,
                                        const float *mx, const int *targets, int N, int V, int Vp) {
    if (N <= 0) return;
    xent_shard_sums_kernel<<<N, XENT_THREADS, 0, fl_cuda_stream()>>>(dt, sums, logits, mx, targets,
                                                                     V, Vp);
    FL_CUDA_LAUNCHED("xent_shard_sums");
}

extern "C" void fl_cuda_xent_shard_backward(fl_dtype dt, void *dlogits, const void *logits,
                                            const float *lse, const int *targets,
                                            const float *dlosses, int N, int V, int Vp) {
    if (N <= 0) return;
    xent_backward_kernel<<<N, XENT_THREADS, 0, fl_cuda_stream()>>>(dt, dlogits, logits, lse,
                                                                   targets, dlosses, V, Vp, 1);
    FL_CUDA_LAUNCHED("xent_shard_backward");
}
