// rope.c: rotary position embedding (RoPE) in Hugging Face's rotate-half
// convention, in place on the q and k heads of a fused qkv buffer
// (B,T,(NH+2*NKV)*HS): the first NH+NKV heads of each position are rotated,
// the NKV value heads after them are left alone. Each pair (x_i, x_{i+h}),
// h = HS/2, turns by the angle t * inv_freq_i:
//   forward  (x_i, x_{i+h}) <- (x_i c - x_{i+h} s, x_{i+h} c + x_i s)
//   backward (g_i, g_{i+h}) <- (g_i c + g_{i+h} s, g_{i+h} c - g_i s)
// (the transpose: the rotation by minus the angle). Elementwise per position,
// so the fast and reference versions do the same arithmetic; the fast one
// runs positions in parallel and on any storage dtype.
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include "simd.h"
#include <math.h>

// Rotates one head of HS = 2h fp32 values in place by the angles whose
// {cos, sin} pairs are cs[0..2h); sign +1 forward, -1 for the transpose.
static inline __attribute__((always_inline)) void rope_head_body(float *x, const float *cs, int h,
                                                                 float sign) {
    for (int i = 0; i < h; i++) {
        float c = cs[2 * i], s = sign * cs[2 * i + 1], x0 = x[i], x1 = x[i + h];
        x[i] = x0 * c - x1 * s;
        x[i + h] = x1 * c + x0 * s;
    }
}
FL_ISA_COPIES(rope_head, (float *x, const float *cs, int h, float sign), (x, cs, h, sign))

static void check_shape(int NH, int NKV, int HS) {
    FL_ASSERT(NH > 0 && NKV > 0 && HS > 0 && HS % 2 == 0);
}

// inv_freq = 1.0 / (theta ** (arange(0, HS, 2).float() / HS)) and the angle
// t.float() * inv_freq, all float32 as in HF; pow, cos and sin in double,
// rounded once to float (correctly rounded but for rare double-rounding ties)
void rope_table(float *cos_sin, int T, int HS, float theta) {
    FL_ASSERT(T >= 0 && HS > 0 && HS % 2 == 0 && theta > 0.0f);
    int h = HS / 2;
#pragma omp parallel for
    for (int t = 0; t < T; t++) {
        for (int i = 0; i < h; i++) {
            float e = (float)(2 * i) / (float)HS;
            float inv_freq = 1.0f / (float)pow((double)theta, (double)e);
            float angle = (float)t * inv_freq;
            cos_sin[((size_t)t * h + i) * 2] = (float)cos((double)angle);
            cos_sin[((size_t)t * h + i) * 2 + 1] = (float)sin((double)angle);
        }
    }
}

static void rope_apply(fl_dtype dt, void *qkv, const float *cos_sin, int B, int T, int NH, int NKV,
                       int HS, float sign) {
    check_shape(NH, NKV, HS);
    int W = (NH + 2 * NKV) * HS, nrot = NH + NKV, h = HS / 2;
    __typeof__(rope_head_portable) *rope_head = rope_head_for(fl_cpu_isa());
#pragma omp parallel if ((size_t)B * T * nrot * HS >= FL_PAR_MIN_VALUES)
    {
        // a position's rotated heads are contiguous: 16-bit ones are
        // converted together, not head by head
        float x32[nrot * HS];
#pragma omp for nowait
        for (int bt = 0; bt < B * T; bt++) {
            const float *cs = cos_sin + (size_t)(bt % T) * HS; // h pairs at position t
            void *x = fl_at(dt, qkv, (size_t)bt * W);
            float *xf = fp32_rmw(dt, x, (size_t)nrot * HS, x32);
            for (int hd = 0; hd < nrot; hd++) rope_head(xf + (size_t)hd * HS, cs, h, sign);
            fp32_flush(dt, x, xf, (size_t)nrot * HS);
        }
    }
}

void rope_forward(fl_dtype dt, void *qkv, const float *cos_sin, int B, int T, int NH, int NKV,
                  int HS) {
    rope_apply(dt, qkv, cos_sin, B, T, NH, NKV, HS, 1.0f);
}

void rope_backward(fl_dtype dt, void *dqkv, const float *cos_sin, int B, int T, int NH, int NKV,
                   int HS) {
    rope_apply(dt, dqkv, cos_sin, B, T, NH, NKV, HS, -1.0f);
}

void rope_forward_ref(float *qkv, const float *cos_sin, int B, int T, int NH, int NKV, int HS) {
    check_shape(NH, NKV, HS);
    int W = (NH + 2 * NKV) * HS, h = HS / 2;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int hd = 0; hd < NH + NKV; hd++) {
                float *x = qkv + ((size_t)b * T + t) * W + (size_t)hd * HS;
                const float *cs = cos_sin + (size_t)t * HS;
                for (int i = 0; i < h; i++) {
                    float c = cs[2 * i], s = cs[2 * i + 1], x0 = x[i], x1 = x[i + h];
                    x[i] = x0 * c - x1 * s;
                    x[i + h] = x1 * c + x0 * s;
                }
            }
}

void rope_backward_ref(float *dqkv, const float *cos_sin, int B, int T, int NH, int NKV, int HS) {
    check_shape(NH, NKV, HS);
    int W = (NH + 2 * NKV) * HS, h = HS / 2;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++)
            for (int hd = 0; hd < NH + NKV; hd++) {
                float *g = dqkv + ((size_t)b * T + t) * W + (size_t)hd * HS;
                const float *cs = cos_sin + (size_t)t * HS;
                for (int i = 0; i < h; i++) {
                    float c = cs[2 * i], s = cs[2 * i + 1], g0 = g[i], g1 = g[i + h];
                    g[i] = g0 * c + g1 * s;
                    g[i + h] = g1 * c - g0 * s;
                }
            }
}
