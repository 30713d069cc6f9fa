// swiglu.c: LLaMA's MLP gate. Each row of inp (N,2IC) is [gate | up], the
// outputs of gate_proj and up_proj side by side (one fused GEMM):
//   out = silu(gate) * up, silu(x) = x sigmoid(x)
//   dgate += dout * up * sigmoid(x) (1 + x (1 - sigmoid(x))),  dup += dout * silu(gate)
// sigmoid(x) and 1 - sigmoid(x) both come from e = exp(-|x|) in (0, 1]:
// 1 / (1 + e) and e / (1 + e), so nothing overflows and neither cancels.
// Elementwise: the fast version runs the reference's arithmetic on chunks of
// rows in parallel (chunking changes nothing in the result: deterministic);
// 16-bit chunks pass through fp32 buffers on the stack.
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include "simd.h"
#include <math.h>

#define SWIGLU_CHUNK 1024 // columns per parallel work item and fp32 buffer

// s = sigmoid(x), s1 = 1 - sigmoid(x)
static inline void sigmoid2(float x, float *s, float *s1) {
    float e = expf(-fabsf(x));
    float r = 1.0f / (1.0f + e);
    *s = x >= 0.0f ? r : e * r;
    *s1 = x >= 0.0f ? e * r : r;
}

static void swiglu_fwd_row(float *out, const float *gate, const float *up, int n) {
    for (int i = 0; i < n; i++) {
        float s, s1;
        sigmoid2(gate[i], &s, &s1);
        out[i] = gate[i] * s * up[i];
    }
}

static void swiglu_bwd_row(float *dgate, float *dup, const float *gate, const float *up,
                           const float *dout, int n) {
    for (int i = 0; i < n; i++) {
        float x = gate[i], s, s1;
        sigmoid2(x, &s, &s1);
        dgate[i] += dout[i] * up[i] * (s * (1.0f + x * s1));
        dup[i] += dout[i] * (x * s);
    }
}

void swiglu_forward(fl_dtype dt, void *out, const void *inp, int N, int IC) {
    FL_ASSERT(N >= 0 && IC > 0);
    int per_row = (IC + SWIGLU_CHUNK - 1) / SWIGLU_CHUNK;
    long long items = (long long)N * per_row;
#pragma omp parallel for
    for (long long it = 0; it < items; it++) {
        int n = (int)(it / per_row), i0 = (int)(it % per_row) * SWIGLU_CHUNK;
        int nc = IC - i0 < SWIGLU_CHUNK ? IC - i0 : SWIGLU_CHUNK;
        float g32[SWIGLU_CHUNK], u32[SWIGLU_CHUNK], y32[SWIGLU_CHUNK];
        size_t row = (size_t)n * 2 * IC + i0;
        const float *g = fl_load_f32(dt, fl_at_const(dt, inp, row), nc, g32);
        const float *u = fl_load_f32(dt, fl_at_const(dt, inp, row + IC), nc, u32);
        void *y = fl_at(dt, out, (size_t)n * IC + i0);
        float *y_f = fp32_out(dt, y, y32);
        swiglu_fwd_row(y_f, g, u, nc);
        fp32_flush(dt, y, y_f, nc);
    }
}

void swiglu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout, int N, int IC) {
    FL_ASSERT(N >= 0 && IC > 0);
    int per_row = (IC + SWIGLU_CHUNK - 1) / SWIGLU_CHUNK;
    long long items = (long long)N * per_row;
#pragma omp parallel for
    for (long long it = 0; it < items; it++) {
        int n = (int)(it / per_row), i0 = (int)(it % per_row) * SWIGLU_CHUNK;
        int nc = IC - i0 < SWIGLU_CHUNK ? IC - i0 : SWIGLU_CHUNK;
        float g32[SWIGLU_CHUNK], u32[SWIGLU_CHUNK], dy32[SWIGLU_CHUNK];
        float dg32[SWIGLU_CHUNK], du32[SWIGLU_CHUNK];
        size_t row = (size_t)n * 2 * IC + i0;
        const float *g = fl_load_f32(dt, fl_at_const(dt, inp, row), nc, g32);
        const float *u = fl_load_f32(dt, fl_at_const(dt, inp, row + IC), nc, u32);
        const float *dy = fl_load_f32(dt, fl_at_const(dt, dout, (size_t)n * IC + i0), nc, dy32);
        float *dg = fp32_rmw(dt, fl_at(dt, dinp, row), nc, dg32);
        float *du = fp32_rmw(dt, fl_at(dt, dinp, row + IC), nc, du32);
        swiglu_bwd_row(dg, du, g, u, dy, nc);
        fp32_flush(dt, fl_at(dt, dinp, row), dg, nc);
        fp32_flush(dt, fl_at(dt, dinp, row + IC), du, nc);
    }
}

void swiglu_forward_ref(float *out, const float *inp, int N, int IC) {
    for (int n = 0; n < N; n++) {
        const float *gate = inp + (size_t)n * 2 * IC, *up = gate + IC;
        float *y = out + (size_t)n * IC;
        for (int i = 0; i < IC; i++) {
            float x = gate[i], e = expf(-fabsf(x)), r = 1.0f / (1.0f + e);
            float s = x >= 0.0f ? r : e * r;
            y[i] = x * s * up[i];
        }
    }
}

void swiglu_backward_ref(float *dinp, const float *inp, const float *dout, int N, int IC) {
    for (int n = 0; n < N; n++) {
        const float *gate = inp + (size_t)n * 2 * IC, *up = gate + IC, *dy = dout + (size_t)n * IC;
        float *dgate = dinp + (size_t)n * 2 * IC, *dup = dgate + IC;
        for (int i = 0; i < IC; i++) {
            float x = gate[i], e = expf(-fabsf(x)), r = 1.0f / (1.0f + e);
            float s = x >= 0.0f ? r : e * r, s1 = x >= 0.0f ? e * r : r;
            dgate[i] += dy[i] * up[i] * (s * (1.0f + x * s1));
            dup[i] += dy[i] * (x * s);
        }
    }
}
