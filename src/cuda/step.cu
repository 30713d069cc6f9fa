// step.cu: the step's conversions and reductions on device buffers:
// convert (fp32 master weights from 16-bit ones, a row for the host),
// accumulate (fp32 gradient accumulation), sumsq and sumsq_rows (the
// gradient norm), sum and sum_to (the losses), fill (the losses' weights)
// and the step's gate (src/optim/gate.h, one thread).
//
// The reductions cannot take the cpu's order (fl_grad_sumsq's chunks and
// lanes, the losses' index order): they are fixed instead, so that a run
// repeats bitwise on any GPU. reduce_blocks(n) blocks (a function of n
// alone, not of the GPU's multiprocessors: at least REDUCE_PER_THREAD values
// a thread, at most REDUCE_BLOCKS blocks, so a small tensor's sum is one
// block rather than 1024 mostly idle ones) each sum a grid stride of the
// values in double (threads, then a warp tree, then the warps in order);
// then one thread per range adds its blocks' sums in order, on the device,
// into the range's result: nothing comes back to the host unless asked
// (sumsq, sum). Against the cpu the result differs by the rounding of a
// double sum in another order: relative 1e-16 or so per value, far below
// fp32.
#include "common.cuh"

#include "../optim/gate.h"

#define REDUCE_BLOCKS     FL_CUDA_REDUCE_BLOCKS
#define REDUCE_THREADS    256
#define REDUCE_PER_THREAD 8

static unsigned reduce_blocks(size_t n) {
    size_t per_block = (size_t)REDUCE_THREADS * REDUCE_PER_THREAD;
    size_t b = (n + per_block - 1) / per_block;
    return (unsigned)(b > REDUCE_BLOCKS ? REDUCE_BLOCKS : b);
}

// streaming kernels (common.cuh's vector accesses)
__global__ void convert_kernel(fl_dtype dst_dt, void *dst, fl_dtype src_dt, const void *src,
                               size_t n) {
    for (size_t i = fl_d_first_vec(); i < n; i += fl_d_width_vec()) {
        float x[FL_D_VEC];
        fl_d_load_vec(src_dt, src, i, n, x);
        fl_d_store_vec(dst_dt, dst, i, n, x);
    }
}

__global__ void accumulate_kernel(float *dst, fl_dtype dt, const void *src, size_t n) {
    for (size_t i = fl_d_first_vec(); i < n; i += fl_d_width_vec()) {
        float y[FL_D_VEC];
        fl_d_load_vec(dt, src, i, n, y);
        fl_d_add_vec(FL_F32, dst, dst, y, i, n);
    }
}

// Up to REDUCE_RANGES ranges of one reduction launch, passed by value (the
// kernel's parameters: no upload): range r's values x[r] (n[r] of them)
// and its blocks, partial sums first[r] to first[r + 1] - 1.
enum { REDUCE_RANGES = 64 };
typedef struct {
    const void *x[REDUCE_RANGES];
    size_t n[REDUCE_RANGES];
    unsigned first[REDUCE_RANGES + 1];
    int count;
} reduce_table;

// partial[blockIdx.x] = the block's sum of x^2 (squares 1) or of x, in
// double, over its range's grid stride: the bits one launch per range gives
__global__ void reduce_kernel(double *partial, fl_dtype dt, reduce_table t, int squares) {
    __shared__ double warps[REDUCE_THREADS / 32];
    int r = 0;
    while (r + 1 < t.count && t.first[r + 1] <= blockIdx.x) r++;
    size_t b = blockIdx.x - t.first[r], blocks = t.first[r + 1] - t.first[r], n = t.n[r];
    const void *x = t.x[r];
    double s = 0.0;
    for (size_t i = b * blockDim.x + threadIdx.x; i < n; i += blocks * blockDim.x) {
        double v = (double)fl_d_load(dt, x, i);
        s += squares ? v * v : v; // a float's square is exact in double
    }
    s = fl_d_block_sum_double(s, warps);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// Up to REDUCE_RANGES results of one finishing launch: out[at[k]] = the
// sum, in order, of partial[from[k]] and the blocks[k] - 1 after it (0.0
// for an empty range).
typedef struct {
    unsigned from[REDUCE_RANGES], blocks[REDUCE_RANGES];
    int at[REDUCE_RANGES];
    int count;
} finish_table;

__global__ void finish_kernel(double *out, const double *partial, finish_table f) {
    int k = threadIdx.x;
    if (k >= f.count) return;
    double total = 0.0;
    for (unsigned b = 0; b < f.blocks[k]; b++) total += partial[f.from[k] + b];
    out[f.at[k]] = total;
}

// out[i] (device memory) = the sum (of squares) of the counts[i] values from
// x + offsets[i], for n ranges: up to REDUCE_RANGES ranges a launch (a
// GPT-2's ~150 tensors in 3, where a launch each left the GPU waiting on
// the host's launches) into one buffer of partial sums, each range's then
// added in order by a finishing launch, so a range's sum is the same bits
// however many ranges come with it. The buffer is reused once full: its
// next reader comes after the finishing launch on the stream.
static void reduce_ranges(fl_dtype dt, const void *x, int n, const size_t *offsets,
                          const size_t *counts, int squares, double *out) {
    size_t want = 0; // the scratch this call fills, at most
    for (int i = 0; i < n && want < FL_CUDA_REDUCE_PARTIALS; i++) want += reduce_blocks(counts[i]);
    if (want > FL_CUDA_REDUCE_PARTIALS) want = FL_CUDA_REDUCE_PARTIALS;
    double *partial = (double *)fl_cuda_scratch((want ? want : 1) * sizeof(double));
    reduce_table t;
    finish_table f;
    t.count = f.count = 0;
    t.first[0] = 0;
    size_t base = 0, used = 0; // the reduce table's first partial; the partials filled
    cudaStream_t s = fl_cuda_stream();
    for (int i = 0; i <= n; i++) {
        unsigned blocks = i < n ? reduce_blocks(counts[i]) : 0;
        // launch what is gathered: at the end, when a table is full or the
        // next range's partials would not fit
        if (i == n || t.count == REDUCE_RANGES || f.count == REDUCE_RANGES ||
            used + blocks > want) {
            if (t.count) {
                reduce_kernel<<<t.first[t.count], REDUCE_THREADS, 0, s>>>(partial + base, dt, t,
                                                                          squares);
                FL_CUDA_LAUNCHED("reduce_kernel");
            }
            if (f.count) {
                finish_kernel<<<1, REDUCE_RANGES, 0, s>>>(out, partial, f);
                FL_CUDA_LAUNCHED("finish_kernel");
            }
            if (used + blocks > want) used = 0;
            t.count = f.count = 0;
            base = used;
        }
        if (i == n) break;
        if (blocks) {
            t.x[t.count] = fl_at_const(dt, x, offsets[i]);
            t.n[t.count] = counts[i];
            t.first[t.count + 1] = t.first[t.count] + blocks;
            t.count++;
        }
        f.from[f.count] = (unsigned)used, f.blocks[f.count] = blocks, f.at[f.count] = i;
        f.count++;
        used += blocks;
    }
}

// One range's sum (of squares), brought to the host: its result lies past
// the range's partial sums in the scratch.
static double reduce(fl_dtype dt, const void *x, size_t n, int squares) {
    size_t offset = 0;
    double *out = (double *)fl_cuda_scratch((REDUCE_BLOCKS + 1) * sizeof(double)) + REDUCE_BLOCKS;
    reduce_ranges(dt, x, 1, &offset, &n, squares, out);
    double total;
    fl_cuda_waited();
    FL_CUDA_CHECK(
        cudaMemcpyAsync(&total, out, sizeof total, cudaMemcpyDeviceToHost, fl_cuda_stream()));
    FL_CUDA_CHECK(cudaStreamSynchronize(fl_cuda_stream()));
    return total;
}

extern "C" void fl_cuda_convert(fl_dtype dst_dt, void *dst, fl_dtype src_dt, const void *src,
                                size_t n) {
    if (!n) return;
    if (dst_dt == src_dt) { // identical bits, NaN payloads included
        fl_cuda_issued();
        FL_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * fl_dtype_size(src_dt), cudaMemcpyDeviceToDevice,
                                      fl_cuda_stream()));
        return;
    }
    convert_kernel<<<fl_cuda_blocks_vec(n, 256), 256, 0, fl_cuda_stream()>>>(dst_dt, dst, src_dt,
                                                                             src, n);
    FL_CUDA_LAUNCHED("convert_kernel");
}

extern "C" void fl_cuda_accumulate(float *dst, fl_dtype dt, const void *src, size_t n) {
    if (!n) return;
    accumulate_kernel<<<fl_cuda_blocks_vec(n, 256), 256, 0, fl_cuda_stream()>>>(dst, dt, src, n);
    FL_CUDA_LAUNCHED("accumulate_kernel");
}

extern "C" double fl_cuda_sumsq(fl_dtype dt, const void *x, size_t n) {
    return reduce(dt, x, n, 1);
}

extern "C" void fl_cuda_sumsq_rows(fl_dtype dt, const void *x, int n, const size_t *offsets,
                                   const size_t *counts, double *out) {
    reduce_ranges(dt, x, n, offsets, counts, 1, out);
}

extern "C" double fl_cuda_sum(const float *x, size_t n) {
    return reduce(FL_F32, x, n, 0);
}

extern "C" void fl_cuda_sum_to(double *out, const float *x, size_t n) {
    size_t offset = 0;
    reduce_ranges(FL_F32, x, 1, &offset, &n, 0, out);
}

__global__ void fill_kernel(float *x, float v, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] = v;
}

extern "C" void fl_cuda_fill(float *x, float v, size_t n) {
    if (!n) return;
    fill_kernel<<<fl_cuda_blocks(n, 256), 256, 0, fl_cuda_stream()>>>(x, v, n);
    FL_CUDA_LAUNCHED("fill_kernel");
}

// the step's verdict: the host's arithmetic in one thread (gate.h)
__global__ void gate_kernel(fl_step_gate *g, fl_gate_op op) {
    fl_gate_apply(g, &op);
}

extern "C" void fl_cuda_gate(fl_step_gate *g, const fl_gate_op *op) {
    gate_kernel<<<1, 1, 0, fl_cuda_stream()>>>(g, *op);
    FL_CUDA_LAUNCHED("gate_kernel");
}
