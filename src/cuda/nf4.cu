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

// A thread takes FL_D_VEC / 2 code bytes (FL_D_VEC elements) at a time,
// read before any element is written, and stores the elements through
// common.cuh's vector accesses. The codebook is read from shared memory: a
// warp's codes differ, and __constant__ memory serves differing addresses
// one at a time.
__global__ void nf4_dequantize_kernel(fl_dtype dt, void *out, const uint8_t *codes,
                                      const float *absmax, size_t n, int block) {
    __shared__ float table[16];
    if (threadIdx.x < 16) table[threadIdx.x] = nf4_table[threadIdx.x];
    __syncthreads();
    size_t bytes = (n + 1) / 2;
    for (size_t i = fl_d_first_vec(); i < n; i += fl_d_width_vec()) {
        uint8_t q[FL_D_VEC / 2];
        float y[FL_D_VEC];
#pragma unroll
        for (int k = 0; k < FL_D_VEC / 2; k++) q[k] = i / 2 + k < bytes ? codes[i / 2 + k] : 0;
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) { // the high nibble's element, then the low's
            size_t e = i + k;
            int code = k % 2 ? q[k / 2] & 15 : q[k / 2] >> 4;
            y[k] = e < n ? __fmul_rn(table[code], absmax[e / block]) : 0.0f;
        }
        fl_d_store_vec(dt, out, i, n, y);
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
    nf4_dequantize_kernel<<<fl_cuda_blocks_vec(n, 256), 256, 0, fl_cuda_stream()>>>(
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
