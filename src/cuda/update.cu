// update.cu: fl_optim_update on device memory: AdamW, SGD, LOMO and
// AdaLomo. The rule's struct stays on the host (its step constants, set by
// begin_step); its state (m, v, the momentum, AdaLomo's row, column and
// vector statistics) and the weights, master and gradients are on the
// device. The arithmetic is src/optim/'s operation for operation (their
// FMAs written out, no other contraction: --fmad=false), so the fp32
// weights, the state and a 16-bit copy rounded to nearest even come out as
// the cpu's bits. LOMO and AdaLomo keep no master: their 16-bit weights are
// updated in place and stored back by stochastic rounding with the random
// bits of fl_sr_bits(sr_seed, flat element index) (src/core/dtype.c's
// fl_store_f32_stochastic, ported), the cpu's bits too.
//
// AdaLomo's sums are in double, in fixed orders of the device's own: a
// row's mean by a block over its values, the columns' by a block per 32
// columns (a warp per row stride, coalesced), the RMSs by a block per
// adalomo.c's chunk and then the chunks in order. The same run gives the
// same bits; against the cpu (adalomo.c's orders) a double's rounding apart.
// The scalars the weights' pass needs (the row statistics' mean, the RMSs'
// step size and divisor) stay on the device, formed by a one-thread kernel.
// Tensor parallelism (fl_update_args.tp) is not run on a device.
#include "common.cuh"

extern "C" {
#include "../optim/update.h"
}
#include "../optim/gate.h"

// Up to FL_UPDATE_ROWS rows of one AdamW or SGD launch, passed by value
// (the kernel's parameters: no upload): row r's weights p, gradient g,
// state s0 (m, or SGD's buffer or NULL) and s1 (v), 16-bit copy p16 (or
// NULL), n[r] elements, its decay factor (AdamW's keep, SGD's wd), and its
// blocks first[r] to first[r + 1] - 1.
typedef struct {
    float *p[FL_UPDATE_ROWS], *s0[FL_UPDATE_ROWS], *s1[FL_UPDATE_ROWS];
    const void *g[FL_UPDATE_ROWS];
    void *p16[FL_UPDATE_ROWS];
    size_t n[FL_UPDATE_ROWS];
    float decay[FL_UPDATE_ROWS];
    unsigned first[FL_UPDATE_ROWS + 1];
    int count;
} update_table;

// the block's row and its place among the row's blocks
__device__ __forceinline__ int update_row(const update_table &t, size_t *b, size_t *blocks) {
    int r = 0;
    while (r + 1 < t.count && t.first[r + 1] <= blockIdx.x) r++;
    *b = blockIdx.x - t.first[r], *blocks = t.first[r + 1] - t.first[r];
    return r;
}

// AdamW on each row of t (src/optim/adamw.c's arithmetic), FL_D_VEC
// elements a thread at a time (common.cuh's vector accesses: an element's
// bits do not depend on them)
__global__ void adamw_rows_kernel(update_table t, fl_dtype gdt, fl_dtype pdt, float gscale,
                                  const fl_step_gate *gate, float b1, float b2, float eps,
                                  float bc1, float bc2, float lr) {
    if (gate && gate->skip) return;
    if (gate) gscale = gate->grad_scale;
    size_t b, blocks;
    int r = update_row(t, &b, &blocks);
    float *p = t.p[r], *m = t.s0[r], *v = t.s1[r], keep = t.decay[r];
    const void *g = t.g[r];
    void *p16 = t.p16[r];
    size_t n = t.n[r];
    for (size_t i = (b * blockDim.x + threadIdx.x) * FL_D_VEC; i < n;
         i += blocks * blockDim.x * FL_D_VEC) {
        float gi[FL_D_VEC], mi[FL_D_VEC], vi[FL_D_VEC], pi[FL_D_VEC];
        fl_d_load_vec(gdt, g, i, n, gi);
        fl_d_load_vec(FL_F32, m, i, n, mi);
        fl_d_load_vec(FL_F32, v, i, n, vi);
        fl_d_load_vec(FL_F32, p, i, n, pi);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) {
            float gk = gi[k] * gscale;
            mi[k] = fmaf(b1, mi[k], (1.0f - b1) * gk);
            vi[k] = fmaf(b2, vi[k], (1.0f - b2) * gk * gk);
            float mhat = mi[k] / bc1, vhat = vi[k] / bc2;
            pi[k] = fmaf(pi[k], keep, -(lr * mhat / (sqrtf(vhat) + eps)));
        }
        fl_d_store_vec(FL_F32, m, i, n, mi);
        fl_d_store_vec(FL_F32, v, i, n, vi);
        fl_d_store_vec(FL_F32, p, i, n, pi);
        if (p16) fl_d_store_vec(pdt, p16, i, n, pi);
    }
}

// SGD on each row of t (s0: the momentum buffers, or NULL; first: the step
// that starts them), FL_D_VEC elements a thread at a time
__global__ void sgd_rows_kernel(update_table t, fl_dtype gdt, fl_dtype pdt, float gscale,
                                const fl_step_gate *gate, float lr, float mu, int first) {
    if (gate && gate->skip) return;
    if (gate) gscale = gate->grad_scale;
    size_t b, blocks;
    int r = update_row(t, &b, &blocks);
    float *p = t.p[r], *buf = t.s0[r], wd = t.decay[r];
    const void *g = t.g[r];
    void *p16 = t.p16[r];
    size_t n = t.n[r];
    for (size_t i = (b * blockDim.x + threadIdx.x) * FL_D_VEC; i < n;
         i += blocks * blockDim.x * FL_D_VEC) {
        float gi[FL_D_VEC], pi[FL_D_VEC], bi[FL_D_VEC];
        fl_d_load_vec(gdt, g, i, n, gi);
        fl_d_load_vec(FL_F32, p, i, n, pi);
        if (buf) fl_d_load_vec(FL_F32, buf, i, n, bi);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) {
            float d = gi[k] * gscale + wd * pi[k];
            if (buf) {
                d = first ? d : mu * bi[k] + d;
                bi[k] = d;
            }
            pi[k] = pi[k] - lr * d;
        }
        if (buf) fl_d_store_vec(FL_F32, buf, i, n, bi);
        fl_d_store_vec(FL_F32, p, i, n, pi);
        if (p16) fl_d_store_vec(pdt, p16, i, n, pi);
    }
}

// ---- stochastic rounding: src/core/dtype.c's, bit for bit

__device__ __forceinline__ uint64_t sr_bits(uint64_t seed, uint64_t index) {
    uint64_t z = seed + (index + 1) * 0x9e3779b97f4a7c15ull; // splitmix64, output `index`
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ uint16_t bf16_stochastic(float x, uint64_t bits) {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); // quiet NaN
    if ((u & 0x7fffffffu) == 0x7f800000u) return (uint16_t)(u >> 16);         // inf
    return (uint16_t)((u + (uint32_t)(bits & 0xffffu)) >> 16);
}

__device__ __forceinline__ uint16_t f16_stochastic(float x, uint64_t bits) {
    uint32_t u = __float_as_uint(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return fl_d_f32_to_f16(x);          // NaN: as rounded to nearest
    if (a >= 0x47800000u) return (uint16_t)(sign | 0x7c00u); // >= 65536 (and inf): inf
    if (a < 0x38800000u) {
        float f = __uint_as_float(a) * 16777216.0f, lo = floorf(f);
        double frac = (double)(f - lo);
        uint32_t h = (uint32_t)lo + ((double)(uint32_t)bits < frac * 4294967296.0);
        return (uint16_t)(sign | h);
    }
    uint32_t r = a - (112u << 23) + (uint32_t)(bits & 0x1fffu);
    return (uint16_t)(sign | (r >> 13));
}

// What a fused rule's kernel reads of fl_update_args: its weights (fp32,
// or 16-bit in place), the gradients and how to store back.
struct fused_args {
    float *p32;
    void *p16;
    fl_dtype pdt, gdt;
    const void *g;
    float gscale, clip, coef;
    int stochastic;
    uint64_t seed, first;
    const fl_step_gate *gate; // NULL, or the step's verdict: its skip and factors rule
};

static fused_args fused_of(const fl_update_args *a, float clip) {
    fused_args f = {
        a->params,     a->params_lowp, a->lowp_dtype,  a->grads_dtype,
        a->grads,      a->grad_scale,  clip,           a->clip_coef > 0.0f ? a->clip_coef : 1.0f,
        a->stochastic, a->sr_seed,     a->first_index, a->gate};
    return f;
}

// the step's verdict said to skip (every kernel that writes state or
// weights returns at once, the whole grid alike)
__device__ __forceinline__ bool fused_skip(const fused_args &f) {
    return f.gate && f.gate->skip;
}

__device__ __forceinline__ float fused_load(const fused_args &f, size_t i) {
    return f.p32 ? f.p32[i] : fl_d_load(f.pdt, f.p16, i);
}

// fl_update_store_params: the fp32 weights in place, a 16-bit copy to
// nearest even, or (no fp32 weights) the 16-bit ones stochastically
__device__ __forceinline__ void fused_store(const fused_args &f, size_t i, float p) {
    if (f.p32) f.p32[i] = p;
    if (!f.p16) return;
    if (!f.p32 && f.stochastic && f.pdt != FL_F32) {
        uint64_t bits = sr_bits(f.seed, f.first + i);
        ((uint16_t *)f.p16)[i] =
            f.pdt == FL_BF16 ? bf16_stochastic(p, bits) : f16_stochastic(p, bits);
    } else {
        fl_d_store(f.pdt, f.p16, i, p);
    }
}

// the processed gradient: unscaled, clamped to +-clip (NaN stays NaN), times coef
__device__ __forceinline__ float fused_grad(const fused_args &f, size_t i) {
    float gscale = f.gscale, coef = f.coef;
    if (f.gate) fl_gate_factors(f.gate, 1, &gscale, &coef);
    float d = fl_d_load(f.gdt, f.g, i) * gscale;
    if (f.clip > 0.0f) d = d < -f.clip ? -f.clip : d > f.clip ? f.clip : d;
    return d * coef;
}

// LOMO (lomo.c): p = p * keep - lr * clamp(g * gscale) * coef
__global__ void lomo_kernel(fused_args f, size_t n, float lr, float keep) {
    if (fused_skip(f)) return;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        fused_store(f, i, fused_load(f, i) * keep - lr * fused_grad(f, i));
}

// ---- AdaLomo (adalomo.c's passes A, B, C)

#define ADALOMO_BLOCK      4096 // FL_UPDATE_BLOCK: the chunks are whole blocks of it
#define ADALOMO_MAX_CHUNKS 4096

// the step's scalars: [0] the row statistics' mean, [1] lr_t, [2] keep, [3] denom
__device__ float adalomo_scalars[4];
__device__ double adalomo_chunks[2][ADALOMO_MAX_CHUNKS];

// The statistics' sums are in double, each in a fixed order of the
// device's own (not adalomo.c's): a block's threads stride the values, then
// fl_d_block_sum_double's tree. The same launch gives the same bits; against
// the cpu they differ by a double's rounding, far below fp32.
#define ADA_THREADS 256

// A: a matrix's row statistics, a block per row: out[r] = b2 * out[r] +
// (1 - b2) * the mean of g^2 + eps1 over the row's K values
__global__ void adalomo_rows_kernel(fused_args f, float *out, size_t R, size_t K, double w,
                                    float eps1, float b2, float one_b2) {
    if (fused_skip(f)) return;
    __shared__ double warps[ADA_THREADS / 32];
    for (size_t r = blockIdx.x; r < R; r += gridDim.x) {
        double s = 0.0;
        for (size_t k = threadIdx.x; k < K; k += blockDim.x) {
            float g = fused_grad(f, r * K + k);
            s += (double)(g * g + eps1);
        }
        s = fl_d_block_sum_double(s, warps);
        if (threadIdx.x == 0) out[r] = b2 * out[r] + one_b2 * (float)(s / w);
    }
}

// A: the column statistics over the live rows, a block per 32 columns: lane
// l of warp w sums column c0 + l over rows w, w + 8, ... (coalesced), the
// block's 8 warps then added in order
__global__ void adalomo_columns_kernel(fused_args f, float *out, size_t K, size_t live, double w,
                                       float eps1, float b2, float one_b2) {
    if (fused_skip(f)) return;
    __shared__ double part[ADA_THREADS / 32][32];
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    for (size_t c0 = (size_t)blockIdx.x * 32; c0 < K; c0 += (size_t)gridDim.x * 32) {
        size_t c = c0 + lane;
        double s = 0.0;
        if (c < K)
            for (size_t r = warp; r < live; r += nw) {
                float g = fused_grad(f, r * K + c);
                s += (double)(g * g + eps1);
            }
        part[warp][lane] = s;
        __syncthreads();
        if (warp == 0 && c < K) {
            double t = 0.0;
            for (int k = 0; k < nw; k++) t += part[k][lane];
            out[c] = b2 * out[c] + one_b2 * (float)(t / w);
        }
        __syncthreads(); // part is reused by the next columns
    }
}

// A: the mean of the live rows' statistics (one thread)
__global__ void adalomo_mean_kernel(const float *rs, size_t live, double Rw) {
    double s = 0.0;
    for (size_t r = 0; r < live; r++) s += rs[r];
    adalomo_scalars[0] = (float)(s / Rw);
}

// A: a vector's elementwise v
__global__ void adalomo_vec_kernel(fused_args f, float *v, size_t n, float eps1, float b2,
                                   float one_b2) {
    if (fused_skip(f)) return;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float g = fused_grad(f, i);
        v[i] = b2 * v[i] + one_b2 * (g * g + eps1);
    }
}

// u for element i (update_block): rs, cs for a matrix (K columns), else v
__device__ __forceinline__ float adalomo_u(const fused_args &f, size_t i, const float *rs,
                                           const float *cs, const float *v, size_t K) {
    float g = fused_grad(f, i);
    if (!rs) return (1.0f / sqrtf(v[i])) * g;
    float rf = 1.0f / sqrtf(rs[i / K] / adalomo_scalars[0]);
    return (rf * (1.0f / sqrtf(cs[i % K]))) * g;
}

// B: each chunk's sums of squares of u and of the weights, a block per chunk
__global__ void adalomo_chunks_kernel(fused_args f, const float *rs, const float *cs,
                                      const float *v, size_t K, size_t n, size_t chunk,
                                      size_t nchunks) {
    if (fused_skip(f)) return;
    __shared__ double warps[2][ADA_THREADS / 32];
    for (size_t ch = blockIdx.x; ch < nchunks; ch += gridDim.x) {
        size_t end = (ch + 1) * chunk < n ? (ch + 1) * chunk : n;
        double u2 = 0.0, p2 = 0.0;
        for (size_t i = ch * chunk + threadIdx.x; i < end; i += blockDim.x) {
            float u = adalomo_u(f, i, rs, cs, v, K), p = fused_load(f, i);
            u2 += (double)u * u;
            p2 += (double)p * p;
        }
        u2 = fl_d_block_sum_double(u2, warps[0]);
        p2 = fl_d_block_sum_double(p2, warps[1]);
        if (threadIdx.x == 0) {
            adalomo_chunks[0][ch] = u2;
            adalomo_chunks[1][ch] = p2;
        }
    }
}

// B: the chunks in order, the RMSs and the step's size (one thread)
__global__ void adalomo_scale_kernel(size_t nchunks, double nw, float lr, float eps2,
                                     float clip_threshold, int decay, float wd) {
    double su = 0.0, sp = 0.0;
    for (size_t ch = 0; ch < nchunks; ch++) {
        su += adalomo_chunks[0][ch];
        sp += adalomo_chunks[1][ch];
    }
    float rms_u = (float)sqrt(su / nw), rms_p = (float)sqrt(sp / nw);
    float lr_t = lr * fmaxf(eps2, rms_p);
    adalomo_scalars[1] = lr_t;
    adalomo_scalars[2] = decay ? 1.0f - lr_t * wd : 1.0f;
    adalomo_scalars[3] = fmaxf(rms_u / clip_threshold, 1.0f);
}

// C: the weights
__global__ void adalomo_weights_kernel(fused_args f, const float *rs, const float *cs,
                                       const float *v, size_t K, size_t n) {
    if (fused_skip(f)) return;
    float lr = adalomo_scalars[1], keep = adalomo_scalars[2], denom = adalomo_scalars[3];
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float u = adalomo_u(f, i, rs, cs, v, K);
        fused_store(f, i, fused_load(f, i) * keep - lr * (u / denom));
    }
}

static void count_rows(void *ctx, size_t local, size_t first, size_t run, size_t stride,
                       size_t count) {
    (void)local, (void)first, (void)run, (void)stride;
    *(size_t *)ctx += count;
}

static void adalomo_update(const fl_adalomo *o, const fl_param_view *row, size_t offset, size_t n,
                           const fl_update_args *a) {
    FL_ASSERT(offset == row->offset && n == row->numel); // whole rows only
    if (a->tp && a->tp->size > 1)
        fl_die("cuda: AdaLomo under tensor parallelism is not supported on a device");
    int at = (int)(row - o->table->views);
    FL_ASSERT(at >= o->first_row && at < o->end_row);
    fused_args f = fused_of(a, o->clip_value);
    float b2 = o->beta2t, one_b2 = 1.0f - o->beta2t;
    cudaStream_t s = fl_cuda_stream();
    int matrix = row->ndim >= 2;
    size_t K = matrix ? row->shape[row->ndim - 1] : 0;
    float *rs = NULL, *cs = NULL, *v = NULL;
    if (matrix) { // A: the row and column statistics (no tensor parallelism: whole sizes)
        size_t R = n / K, live = 0;
        fl_params_blocks(o->table, at, 0, n, count_rows, &live);
        live /= K;
        rs = fl_optim_state_ptr((fl_optim_rule *)&o->rule, 0, offset);
        cs = rs + R;
        adalomo_rows_kernel<<<fl_cuda_blocks(R, 1), ADA_THREADS, 0, s>>>(f, rs, R, K, (double)K,
                                                                         o->eps1, b2, one_b2);
        FL_CUDA_LAUNCHED("adalomo_rows_kernel");
        adalomo_columns_kernel<<<fl_cuda_blocks(K, 32), ADA_THREADS, 0, s>>>(
            f, cs, K, live, (double)R, o->eps1, b2, one_b2);
        FL_CUDA_LAUNCHED("adalomo_columns_kernel");
        adalomo_mean_kernel<<<1, 1, 0, s>>>(rs, live, (double)R);
        FL_CUDA_LAUNCHED("adalomo_mean_kernel");
    } else {
        v = fl_optim_state_ptr((fl_optim_rule *)&o->rule, 2, offset);
        adalomo_vec_kernel<<<fl_cuda_blocks(n, 256), 256, 0, s>>>(f, v, n, o->eps1, b2, one_b2);
        FL_CUDA_LAUNCHED("adalomo_vec_kernel");
    }
    // B: adalomo.c's chunk_size
    size_t chunk = n / ADALOMO_MAX_CHUNKS + 1;
    if (chunk < 4 * ADALOMO_BLOCK) chunk = 4 * ADALOMO_BLOCK;
    chunk = (chunk + ADALOMO_BLOCK - 1) / ADALOMO_BLOCK * ADALOMO_BLOCK;
    size_t nchunks = (n + chunk - 1) / chunk;
    adalomo_chunks_kernel<<<fl_cuda_blocks(nchunks, 1), ADA_THREADS, 0, s>>>(f, rs, cs, v, K, n,
                                                                             chunk, nchunks);
    FL_CUDA_LAUNCHED("adalomo_chunks_kernel");
    adalomo_scale_kernel<<<1, 1, 0, s>>>(nchunks, (double)fl_params_whole_numel(o->table, at),
                                         o->lr, o->eps2, o->clip_threshold,
                                         (row->flags & FL_PARAM_DECAY) != 0, o->weight_decay);
    FL_CUDA_LAUNCHED("adalomo_scale_kernel");
    // C
    adalomo_weights_kernel<<<fl_cuda_blocks(n, 256), 256, 0, s>>>(f, rs, cs, v, K, n);
    FL_CUDA_LAUNCHED("adalomo_weights_kernel");
}

extern "C" void fl_cuda_update(fl_optim_rule *r, const fl_param_view *row, size_t offset,
                               size_t count, const fl_update_args *a) {
    FL_ASSERT(*fl_optim_step_count(r) >= 1); // inside a step
    FL_ASSERT(offset >= row->offset && offset + count <= row->offset + row->numel);
    FL_ASSERT(offset >= r->state_begin && offset + count <= r->state_end);
    if ((row->flags & FL_PARAM_FROZEN) || !count) return;
    if (r->ops->kind == FL_OPT_LOMO) {
        const fl_lomo *o = (const fl_lomo *)r;
        float keep = (row->flags & FL_PARAM_DECAY) ? o->keep : 1.0f;
        lomo_kernel<<<fl_cuda_blocks(count, 256), 256, 0, fl_cuda_stream()>>>(
            fused_of(a, o->clip_value), count, o->lr, keep);
        FL_CUDA_LAUNCHED("lomo_kernel");
        return;
    }
    if (r->ops->kind == FL_OPT_ADALOMO) {
        adalomo_update((const fl_adalomo *)r, row, offset, count, a);
        return;
    }
    fl_cuda_update_rows(r, 1, &row, &offset, &count, a); // AdamW, SGD: a table of one row
}

// The rows' AdamW or SGD in one launch (an element's arithmetic does not
// depend on the rows beside it: the same bits however the rows are
// batched; fl_cuda_update's AdamW and SGD are a batch of one); LOMO and
// AdaLomo row by row.
extern "C" void fl_cuda_update_rows(fl_optim_rule *r, int n, const fl_param_view *const *rows,
                                    const size_t *offset, const size_t *count,
                                    const fl_update_args *args) {
    FL_ASSERT(n >= 0 && n <= FL_UPDATE_ROWS);
    int adamw = r->ops->kind == FL_OPT_ADAMW;
    if (!adamw && r->ops->kind != FL_OPT_SGD) {
        for (int i = 0; i < n; i++) fl_cuda_update(r, rows[i], offset[i], count[i], &args[i]);
        return;
    }
    FL_ASSERT(*fl_optim_step_count(r) >= 1); // inside a step
    update_table t;
    t.count = 0;
    t.first[0] = 0;
    for (int i = 0; i < n; i++) {
        const fl_param_view *row = rows[i];
        const fl_update_args *a = &args[i];
        FL_ASSERT(offset[i] >= row->offset && offset[i] + count[i] <= row->offset + row->numel);
        FL_ASSERT(offset[i] >= r->state_begin && offset[i] + count[i] <= r->state_end);
        FL_ASSERT(a->grad_scale == args[0].grad_scale && a->grads_dtype == args[0].grads_dtype &&
                  a->lowp_dtype == args[0].lowp_dtype && a->gate == args[0].gate);
        if ((row->flags & FL_PARAM_FROZEN) || !count[i]) continue;
        if (!a->params)
            fl_die("cuda: an update without fp32 weights (no master copy) is not supported on a "
                   "device");
        size_t s = offset[i] - r->window_begin; // the state's element
        int k = t.count++, decays = (row->flags & FL_PARAM_DECAY) != 0;
        t.p[k] = a->params, t.g[k] = a->grads, t.p16[k] = a->params_lowp, t.n[k] = count[i];
        if (adamw) {
            const fl_adamw *o = (const fl_adamw *)r;
            t.s0[k] = o->m + s, t.s1[k] = o->v + s, t.decay[k] = decays ? o->keep : 1.0f;
        } else {
            const fl_sgd *o = (const fl_sgd *)r;
            t.s0[k] = o->buf ? o->buf + s : NULL, t.s1[k] = NULL;
            t.decay[k] = decays ? o->weight_decay : 0.0f;
        }
        t.first[k + 1] = t.first[k] + fl_cuda_blocks_vec(count[i], 256);
    }
    if (!t.count) return;
    const fl_update_args *a = &args[0];
    if (adamw) {
        const fl_adamw *o = (const fl_adamw *)r;
        adamw_rows_kernel<<<t.first[t.count], 256, 0, fl_cuda_stream()>>>(
            t, a->grads_dtype, a->lowp_dtype, a->grad_scale, a->gate, o->beta1, o->beta2, o->eps,
            o->bc1, o->bc2, o->lr);
        FL_CUDA_LAUNCHED("adamw_rows_kernel");
        return;
    }
    const fl_sgd *o = (const fl_sgd *)r;
    sgd_rows_kernel<<<t.first[t.count], 256, 0, fl_cuda_stream()>>>(
        t, a->grads_dtype, a->lowp_dtype, a->grad_scale, a->gate, o->lr, o->momentum, o->t == 1);
    FL_CUDA_LAUNCHED("sgd_rows_kernel");
}
