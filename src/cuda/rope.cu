// rope.cu: rotary position embedding, Hugging Face's rotate-half convention,
// in place on the q and k heads of a fused qkv buffer (src/kernels/rope.c).
// One thread per pair (x_i, x_{i+h}) of a rotated head; the {cos, sin}
// table (T, HS/2, 2) is the model's, on the device. The backward rotates by
// minus the angle (sign -1), as the cpu does.
#include "common.cuh"

__global__ void rope_kernel(fl_dtype dt, void *qkv, const float *cos_sin, int T, int nrot, int W,
                            int HS, size_t n, float sign) {
    int h = HS / 2;
    for (size_t p = blockIdx.x * (size_t)blockDim.x + threadIdx.x; p < n;
         p += (size_t)gridDim.x * blockDim.x) {
        int i = (int)(p % (size_t)h);
        size_t head = p / (size_t)h, bt = head / (size_t)nrot;
        int hd = (int)(head % (size_t)nrot), t = (int)(bt % (size_t)T);
        const float *cs = cos_sin + ((size_t)t * h + i) * 2;
        float c = cs[0], s = sign * cs[1];
        size_t a = bt * W + (size_t)hd * HS + i, b = a + h;
        float x0 = fl_d_load(dt, qkv, a), x1 = fl_d_load(dt, qkv, b);
        fl_d_store(dt, qkv, a, x0 * c - x1 * s);
        fl_d_store(dt, qkv, b, x1 * c + x0 * s);
    }
}

static void rope_apply(fl_dtype dt, void *qkv, const float *cos_sin, int B, int T, int NH, int NKV,
                       int HS, float sign) {
    FL_ASSERT(NH > 0 && NKV > 0 && HS > 0 && HS % 2 == 0);
    int nrot = NH + NKV, W = (NH + 2 * NKV) * HS;
    size_t n = (size_t)B * T * nrot * (HS / 2);
    if (!n) return;
    rope_kernel<<<fl_cuda_blocks(n, 256), 256, 0, fl_cuda_stream()>>>(dt, qkv, cos_sin, T, nrot, W,
                                                                      HS, n, sign);
    FL_CUDA_LAUNCHED("rope_kernel");
}

extern "C" void fl_cuda_rope_forward(fl_dtype dt, void *qkv, const float *cos_sin, int B, int T,
                                     int NH, int NKV, int HS) {
    rope_apply(dt, qkv, cos_sin, B, T, NH, NKV, HS, 1.0f);
}

extern "C" void fl_cuda_rope_backward(fl_dtype dt, void *dqkv, const float *cos_sin, int B, int T,
                                      int NH, int NKV, int HS) {
    rope_apply(dt, dqkv, cos_sin, B, T, NH, NKV, HS, -1.0f);
}
