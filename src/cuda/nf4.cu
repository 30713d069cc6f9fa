// nf4.cu: NF4 dequantisation (kernels.h, src/kernels/nf4.c): out[i] =
// codebook[code_i] * absmax[i / block], one fp32 product rounded once to dt,
// so it matches the cpu bit for bit. Two codes per byte, the first element
// in the high nibble. And the absmax's double quantisation undone:
// absmax[i] = map[q_i] * nested[i / block] + offset, the product and the
// sum each rounded to fp32 as the cpu does.
#include "common.cuh"

extern "C" {
#include "fitlm/kernels.h" // nf4_codebook, dq8_map
}

__constant__ float nf4_table[16];
__constant__ float dq8_table[256];

// A thread takes code bytes (two elements each) FL_D_ILP at a time, read
// before any element is written (common.cuh). The codebook is read from
// shared memory: a warp's codes differ, and __constant__ memory serves
// differing addresses one at a time.
__global__ void nf4_dequantize_kernel(fl_dtype dt, void *out, const uint8_t *codes,
                                      const float *absmax, size_t n, int block) {
    __shared__ float table[16];
    if (threadIdx.x < 16) table[threadIdx.x] = nf4_table[threadIdx.x];
    __syncthreads();
    size_t bytes = (n + 1) / 2, w = fl_d_width();
    for (size_t b = fl_d_first(); b < bytes; b += FL_D_ILP * w) {
        uint8_t q[FL_D_ILP];
#pragma unroll
        for (int k = 0; k < FL_D_ILP; k++) q[k] = b + k * w < bytes ? codes[b + k * w] : 0;
#pragma unroll
        for (int k = 0; k < FL_D_ILP; k++) {
            size_t i = 2 * (b + k * w); // the high nibble's element, then the low's
            if (i >= n) break;
            fl_d_store(dt, out, i, __fmul_rn(table[q[k] >> 4], absmax[i / block]));
            if (i + 1 < n)
                fl_d_store(dt, out, i + 1, __fmul_rn(table[q[k] & 15], absmax[(i + 1) / block]));
        }
    }
}

extern "C" void fl_cuda_nf4_dequantize(fl_dtype dt, void *out, const uint8_t *codes,
                                       const float *absmax, size_t n, int block) {
    static int loaded; // the table is the cpu's (nf4_codebook), copied once
    if (!loaded) {
        cudaError_t e = cudaMemcpyToSymbol(nf4_table, nf4_codebook, sizeof nf4_table);
        if (e != cudaSuccess) fl_die("cuda: nf4 codebook: %s", cudaGetErrorString(e));
        loaded = 1;
    }
    if (!n) return;
    nf4_dequantize_kernel<<<fl_cuda_blocks_ilp((n + 1) / 2, 256), 256, 0, fl_cuda_stream()>>>(
        dt, out, codes, absmax, n, block);
    FL_CUDA_LAUNCHED("nf4_dequantize");
}

__global__ void dq8_dequantize_kernel(float *absmax, const uint8_t *q, const float *nested,
                                      float offset, size_t n, int block) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x)
        absmax[i] = __fadd_rn(__fmul_rn(dq8_table[q[i]], nested[i / block]), offset);
}

extern "C" void fl_cuda_dq8_dequantize(float *absmax, const uint8_t *q, const float *nested,
                                       float offset, size_t n, int block) {
    static int loaded; // the cpu's map (dq8_map), copied once
    if (!loaded) {
        cudaError_t e = cudaMemcpyToSymbol(dq8_table, dq8_map, sizeof dq8_table);
        if (e != cudaSuccess) fl_die("cuda: dq8 map: %s", cudaGetErrorString(e));
        loaded = 1;
    }
    if (!n) return;
    dq8_dequantize_kernel<<<fl_cuda_blocks(n, 256), 256, 0, fl_cuda_stream()>>>(absmax, q, nested,
                                                                                offset, n, block);
    FL_CUDA_LAUNCHED("dq8_dequantize");
}
