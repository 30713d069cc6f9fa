// step.cu: the step's conversions and reductions on device buffers:
// convert (fp32 master weights from 16-bit ones, a row for the host),
// accumulate (fp32 gradient accumulation), sumsq (the gradient norm) and sum
// (the losses).
//
// The reductions cannot take the cpu's order (fl_grad_sumsq's chunks and
// lanes, the losses' index order): they are fixed instead, so that a run
// repeats bitwise on any GPU. reduce_blocks(n) blocks (a function of n
// alone, not of the GPU's multiprocessors: at least REDUCE_PER_THREAD values
// a thread, at most REDUCE_BLOCKS blocks, so a small tensor's sum is one
// block rather than 1024 mostly idle ones) each sum a grid stride of the
// values in double (threads, then a warp tree, then the warps in order);
// the host adds the blocks' sums in order. Against the cpu the result differs by the
// rounding of a double sum in another order: relative 1e-16 or so per
// value, far below fp32.
#include "common.cuh"

#define REDUCE_BLOCKS     FL_CUDA_REDUCE_BLOCKS
#define REDUCE_THREADS    256
#define REDUCE_PER_THREAD 8

static unsigned reduce_blocks(size_t n) {
    size_t per_block = (size_t)REDUCE_THREADS * REDUCE_PER_THREAD;
    size_t b = (n + per_block - 1) / per_block;
    return (unsigned)(b > REDUCE_BLOCKS ? REDUCE_BLOCKS : b);
}

__global__ void convert_kernel(fl_dtype dst_dt, void *dst, fl_dtype src_dt, const void *src,
                               size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        fl_d_store(dst_dt, dst, i, fl_d_load(src_dt, src, i));
}

__global__ void accumulate_kernel(float *dst, fl_dtype dt, const void *src, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        dst[i] += fl_d_load(dt, src, i);
}

// partial[blockIdx.x] = the block's sum of x^2 (squares 1) or of x, in double
__global__ void reduce_kernel(double *partial, fl_dtype dt, const void *x, size_t n, int squares) {
    __shared__ double warps[REDUCE_THREADS / 32];
    double s = 0.0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        double v = (double)fl_d_load(dt, x, i);
        s += squares ? v * v : v; // a float's square is exact in double
    }
    s = fl_d_warp_sum_double(s);
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x != 0) return;
    double t = 0.0;
    for (int w = 0; w < REDUCE_THREADS / 32; w++) t += warps[w];
    partial[blockIdx.x] = t;
}

static double reduce(fl_dtype dt, const void *x, size_t n, int squares) {
    if (!n) return 0.0;
    unsigned blocks = reduce_blocks(n);
    double *partial = (double *)fl_cuda_scratch(REDUCE_BLOCKS * sizeof(double));
    reduce_kernel<<<blocks, REDUCE_THREADS, 0, fl_cuda_stream()>>>(partial, dt, x, n, squares);
    FL_CUDA_LAUNCHED("reduce_kernel");
    double host[REDUCE_BLOCKS];
    FL_CUDA_CHECK(cudaMemcpyAsync(host, partial, blocks * sizeof(double), cudaMemcpyDeviceToHost,
                                  fl_cuda_stream()));
    FL_CUDA_CHECK(cudaStreamSynchronize(fl_cuda_stream()));
    double total = 0.0;
    for (unsigned b = 0; b < blocks; b++) total += host[b];
    return total;
}

extern "C" void fl_cuda_convert(fl_dtype dst_dt, void *dst, fl_dtype src_dt, const void *src,
                                size_t n) {
    if (!n) return;
    if (dst_dt == src_dt) { // identical bits, NaN payloads included
        FL_CUDA_CHECK(cudaMemcpyAsync(dst, src, n * fl_dtype_size(src_dt), cudaMemcpyDeviceToDevice,
                                      fl_cuda_stream()));
        return;
    }
    convert_kernel<<<fl_cuda_blocks(n, 256), 256, 0, fl_cuda_stream()>>>(dst_dt, dst, src_dt, src,
                                                                         n);
    FL_CUDA_LAUNCHED("convert_kernel");
}

extern "C" void fl_cuda_accumulate(float *dst, fl_dtype dt, const void *src, size_t n) {
    if (!n) return;
    accumulate_kernel<<<fl_cuda_blocks(n, 256), 256, 0, fl_cuda_stream()>>>(dst, dt, src, n);
    FL_CUDA_LAUNCHED("accumulate_kernel");
}

extern "C" double fl_cuda_sumsq(fl_dtype dt, const void *x, size_t n) {
    return reduce(dt, x, n, 1);
}

extern "C" double fl_cuda_sum(const float *x, size_t n) {
    return reduce(FL_F32, x, n, 0);
}
