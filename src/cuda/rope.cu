// rope.cu: rotary position embedding, Hugging Face's rotate-half convention,
// in place on the q and k heads of a fused qkv buffer (src/kernels/rope.c).
// A thread takes FL_D_VEC consecutive pairs (x_i, x_{i+h}) of a rotated
// head (common.cuh's vector accesses; fewer at a head's end where h is not
// a multiple of FL_D_VEC); the {cos, sin} table (T, HS/2, 2) is the
// model's, on the device. The backward rotates by minus the angle (sign
// -1), as the cpu does.
#include "common.cuh"

// chunks: B T nrot heads of `per` chunks of FL_D_VEC pairs each
__global__ void rope_kernel(fl_dtype dt, void *qkv, const float *cos_sin, int T, int nrot, int W,
                            int HS, int per, size_t chunks, float sign) {
    int h = HS / 2;
    for (size_t q = fl_d_first(); q < chunks; q += fl_d_width()) {
        int i0 = (int)(q % (size_t)per) * FL_D_VEC, cnt = min(FL_D_VEC, h - i0);
        size_t head = q / (size_t)per, bt = head / (size_t)nrot;
        int hd = (int)(head % (size_t)nrot), t = (int)(bt % (size_t)T);
        const float *cs = cos_sin + ((size_t)t * h + i0) * 2;
        size_t a = bt * W + (size_t)hd * HS + i0, b = a + h;
        float x0[FL_D_VEC], x1[FL_D_VEC], y0[FL_D_VEC], y1[FL_D_VEC];
        fl_d_load_vec(dt, qkv, a, a + cnt, x0);
        fl_d_load_vec(dt, qkv, b, b + cnt, x1);
#pragma unroll
        for (int k = 0; k < FL_D_VEC; k++) {
            float c = k < cnt ? cs[2 * k] : 0.0f, s = k < cnt ? sign * cs[2 * k + 1] : 0.0f;
            y0[k] = x0[k] * c - x1[k] * s;
            y1[k] = x1[k] * c + x0[k] * s;
        }
        fl_d_store_vec(dt, qkv, a, a + cnt, y0);
        fl_d_store_vec(dt, qkv, b, b + cnt, y1);
    }
}

static void rope_apply(fl_dtype dt, void *qkv, const float *cos_sin, int B, int T, int NH, int NKV,
                       int HS, float sign) {
    FL_ASSERT(NH > 0 && NKV > 0 && HS > 0 && HS % 2 == 0);
    int nrot = NH + NKV, W = (NH + 2 * NKV) * HS;
    int per = (HS / 2 + FL_D_VEC - 1) / FL_D_VEC;
    size_t chunks = (size_t)B * T * nrot * per;
    if (!chunks) return;
    rope_kernel<<<fl_cuda_blocks(chunks, 256), 256, 0, fl_cuda_stream()>>>(
        dt, qkv, cos_sin, T, nrot, W, HS, per, chunks, sign);
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
