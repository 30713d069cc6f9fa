// residual.cu: the residual add, out = a + b, its gradient into both
// branches, and a row-parallel linear's bias added to each row in place
// (src/kernels/residual.c). Streaming kernels (common.cuh's vector accesses), fp32
// math, one rounding per store.
#include "common.cuh"

__global__ void residual_forward_kernel(fl_dtype dt, void *out, const void *a, const void *b,
                                        size_t n) {
    for (size_t i = fl_d_first_vec(); i < n; i += fl_d_width_vec()) {
        float y[FL_D_VEC];
        fl_d_load_vec(dt, b, i, n, y);
        fl_d_add_vec(dt, out, a, y, i, n);
    }
}

// da's elements first, then db's, by the same thread: da may be db (the
// sum added twice), so db is read after da is stored
__global__ void residual_backward_kernel(fl_dtype dt, void *da, void *db, const void *dout,
                                         size_t n) {
    for (size_t i = fl_d_first_vec(); i < n; i += fl_d_width_vec()) {
        float d[FL_D_VEC];
        fl_d_load_vec(dt, dout, i, n, d);
        fl_d_add_vec(dt, da, da, d, i, n);
        fl_d_add_vec(dt, db, db, d, i, n);
    }
}

__global__ void bias_forward_kernel(fl_dtype dt, void *out, const void *bias, size_t n, int OC) {
    for (size_t i = fl_d_first_vec(); i < n; i += fl_d_width_vec()) {
        float x[FL_D_VEC];
        fl_d_load_vec(dt, out, i, n, x);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++)
            if (i + k < n) x[k] += fl_d_load(dt, bias, (i + k) % (size_t)OC);
        fl_d_store_vec(dt, out, i, n, x);
    }
}

extern "C" void fl_cuda_residual_forward(fl_dtype dt, void *out, const void *a, const void *b,
                                         size_t N) {
    if (!N) return;
    residual_forward_kernel<<<fl_cuda_blocks_vec(N, 256), 256, 0, fl_cuda_stream()>>>(dt, out, a, b,
                                                                                      N);
    FL_CUDA_LAUNCHED("residual_forward_kernel");
}

extern "C" void fl_cuda_residual_backward(fl_dtype dt, void *da, void *db, const void *dout,
                                          size_t N) {
    if (!N) return;
    residual_backward_kernel<<<fl_cuda_blocks_vec(N, 256), 256, 0, fl_cuda_stream()>>>(dt, da, db,
                                                                                       dout, N);
    FL_CUDA_LAUNCHED("residual_backward_kernel");
}

extern "C" void fl_cuda_bias_forward(fl_dtype dt, void *out, const void *bias, int N, int OC) {
    size_t n = (size_t)N * OC;
    if (!n) return;
    bias_forward_kernel<<<fl_cuda_blocks_vec(n, 256), 256, 0, fl_cuda_stream()>>>(dt, out, bias, n,
                                                                                  OC);
    FL_CUDA_LAUNCHED("bias_forward_kernel");
}
