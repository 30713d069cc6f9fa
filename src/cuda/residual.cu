// residual.cu: the residual add, out = a + b, its gradient into both
// branches, and a row-parallel linear's bias added to each row in place
// (src/kernels/residual.c). Elementwise: one thread per value in a
// grid-stride loop, fp32 math, one rounding per store.
#include "common.cuh"

__global__ void residual_forward_kernel(fl_dtype dt, void *out, const void *a, const void *b,
                                        size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        fl_d_store(dt, out, i, fl_d_load(dt, a, i) + fl_d_load(dt, b, i));
}

// da first, then db, in the same thread: da may be db (the sum added twice)
__global__ void residual_backward_kernel(fl_dtype dt, void *da, void *db, const void *dout,
                                         size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float d = fl_d_load(dt, dout, i);
        fl_d_store(dt, da, i, fl_d_load(dt, da, i) + d);
        fl_d_store(dt, db, i, fl_d_load(dt, db, i) + d);
    }
}

__global__ void bias_forward_kernel(fl_dtype dt, void *out, const void *bias, size_t n, int OC) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        fl_d_store(dt, out, i, fl_d_load(dt, out, i) + fl_d_load(dt, bias, i % (size_t)OC));
}

extern "C" void fl_cuda_residual_forward(fl_dtype dt, void *out, const void *a, const void *b,
                                         size_t N) {
    if (!N) return;
    residual_forward_kernel<<<fl_cuda_blocks(N, 256), 256, 0, fl_cuda_stream()>>>(dt, out, a, b, N);
    FL_CUDA_LAUNCHED("residual_forward_kernel");
}

extern "C" void fl_cuda_residual_backward(fl_dtype dt, void *da, void *db, const void *dout,
                                          size_t N) {
    if (!N) return;
    residual_backward_kernel<<<fl_cuda_blocks(N, 256), 256, 0, fl_cuda_stream()>>>(dt, da, db, dout,
                                                                                   N);
    FL_CUDA_LAUNCHED("residual_backward_kernel");
}

extern "C" void fl_cuda_bias_forward(fl_dtype dt, void *out, const void *bias, int N, int OC) {
    size_t n = (size_t)N * OC;
    if (!n) return;
    bias_forward_kernel<<<fl_cuda_blocks(n, 256), 256, 0, fl_cuda_stream()>>>(dt, out, bias, n, OC);
    FL_CUDA_LAUNCHED("bias_forward_kernel");
}
