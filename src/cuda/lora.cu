// lora.cu: LoRA's column pieces and dropout (kernels.h, src/kernels/lora.c),
// grid-stride loops. The products and sums are rounded separately
// (__fmul_rn, __fadd_rn: no contraction into an FMA), as the cpu rounds
// them, and dropout draws the cpu's keyed bits (fl_sr_bits), so the masks
// and values match it bit for bit.
#include "common.cuh"

// fl_sr_bits (src/core/dtype.c): splitmix64's output `index` of stream `seed`
__device__ __forceinline__ uint64_t sr_bits(uint64_t seed, uint64_t index) {
    uint64_t z = seed + (index + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__global__ void lora_add_columns_kernel(fl_dtype dt, void *out, int ld, const void *x, float scale,
                                        int N, int cols) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)N * cols;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t o = i / cols * ld + i % cols;
        fl_d_store(dt, out, o,
                   __fadd_rn(fl_d_load(dt, out, o), __fmul_rn(scale, fl_d_load(dt, x, i))));
    }
}

__global__ void lora_gather_columns_kernel(fl_dtype dt, void *x, const void *src, int ld,
                                           float scale, int N, int cols) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (size_t)N * cols;
         i += (size_t)gridDim.x * blockDim.x)
        fl_d_store(dt, x, i, __fmul_rn(scale, fl_d_load(dt, src, i / cols * ld + i % cols)));
}

// out may alias inp: each element is read and written by one thread
__global__ void dropout_kernel(fl_dtype dt, void *out, const void *inp, size_t n, float p,
                               float keep, uint64_t key) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float u = __fmul_rn((float)(sr_bits(key, i) >> 40), 1.0f / 16777216.0f);
        fl_d_store(dt, out, i, u < p ? 0.0f : __fmul_rn(fl_d_load(dt, inp, i), keep));
    }
}

extern "C" void fl_cuda_lora_add_columns(fl_dtype dt, void *out, int ld, const void *x, float scale,
                                         int N, int cols) {
    size_t n = (size_t)N * cols;
    if (!n) return;
    lora_add_columns_kernel<<<fl_cuda_blocks(n, 256), 256, 0, fl_cuda_stream()>>>(dt, out, ld, x,
                                                                                  scale, N, cols);
    FL_CUDA_LAUNCHED("lora_add_columns");
}

extern "C" void fl_cuda_lora_gather_columns(fl_dtype dt, void *x, const void *src, int ld,
                                            float scale, int N, int cols) {
    size_t n = (size_t)N * cols;
    if (!n) return;
    lora_gather_columns_kernel<<<fl_cuda_blocks(n, 256), 256, 0, fl_cuda_stream()>>>(
        dt, x, src, ld, scale, N, cols);
    FL_CUDA_LAUNCHED("lora_gather_columns");
}

extern "C" void fl_cuda_dropout_apply(fl_dtype dt, void *out, const void *inp, size_t n, float p,
                                      uint64_t key) {
    if (!n) return;
    float keep = 1.0f / (1.0f - p); // the cpu's factor, rounded on the host as there
    dropout_kernel<<<fl_cuda_blocks(n, 256), 256, 0, fl_cuda_stream()>>>(dt, out, inp, n, p, keep,
                                                                         key);
    FL_CUDA_LAUNCHED("dropout_apply");
}
