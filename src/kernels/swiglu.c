// swiglu.c: LLaMA's MLP gate. Each row of inp (N,2IC) is [gate | up], the
// outputs of gate_proj and up_proj side by side (one fused GEMM):
//   out = silu(gate) * up, silu(x) = x sigmoid(x)
//   dgate += dout * up * sigmoid(x) (1 + x (1 - sigmoid(x))),  dup += dout * silu(gate)
// sigmoid(x) and 1 - sigmoid(x) both come from e = exp(-|x|) in (0, 1]:
// 1 / (1 + e) and e / (1 + e), so nothing overflows and neither cancels.
// Elementwise: the fast version runs on chunks of rows in parallel (chunking
// changes nothing in the result: deterministic); 16-bit chunks pass through
// fp32 buffers on the stack. The AVX-512 and AVX2 paths take e from the shared
// vector exp (exp512, exp256): one exp and division per 16 (8) values instead
// of 16 (8) libm expf calls.
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include "simd.h"
#include <math.h>
#include <string.h>

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

typedef void (*swiglu_fwd_fn)(float *out, const float *gate, const float *up, int n);
typedef void (*swiglu_bwd_fn)(float *dgate, float *dup, const float *gate, const float *up,
                              const float *dout, int n);

#if FL_HAVE_X86_SIMD
// s = sigmoid(x) and s1 = 1 - sigmoid(x), as sigmoid2 but with exp512
__attribute__((target("avx512f"))) static inline void swiglu_sigmoid(__m512 x, __m512 *s,
                                                                     __m512 *s1) {
    __m512 e = exp512(_mm512_mul_ps(_mm512_set1_ps(-1.0f), _mm512_abs_ps(x)));
    __m512 r = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    __m512 er = _mm512_mul_ps(e, r);
    __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    *s = _mm512_mask_blend_ps(neg, r, er);
    *s1 = _mm512_mask_blend_ps(neg, er, r);
}

__attribute__((target("avx512f"))) static void swiglu_fwd_avx512(float *out, const float *gate,
                                                                 const float *up, int n) {
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask((size_t)(n - i));
        __m512 x = _mm512_maskz_loadu_ps(m, gate + i), s, s1;
        swiglu_sigmoid(x, &s, &s1);
        _mm512_mask_storeu_ps(out + i, m,
                              _mm512_mul_ps(_mm512_mul_ps(x, s), _mm512_maskz_loadu_ps(m, up + i)));
    }
}

// dgate += (dout up) s (1 + x s1),  dup += dout (x s)
__attribute__((target("avx512f"))) static void swiglu_bwd_avx512(float *dgate, float *dup,
                                                                 const float *gate, const float *up,
                                                                 const float *dout, int n) {
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask((size_t)(n - i));
        __m512 x = _mm512_maskz_loadu_ps(m, gate + i), s, s1;
        swiglu_sigmoid(x, &s, &s1);
        __m512 dy = _mm512_maskz_loadu_ps(m, dout + i);
        __m512 ds = _mm512_mul_ps(s, _mm512_fmadd_ps(x, s1, _mm512_set1_ps(1.0f)));
        __m512 dg = _mm512_fmadd_ps(_mm512_mul_ps(dy, _mm512_maskz_loadu_ps(m, up + i)), ds,
                                    _mm512_maskz_loadu_ps(m, dgate + i));
        __m512 du = _mm512_fmadd_ps(dy, _mm512_mul_ps(x, s), _mm512_maskz_loadu_ps(m, dup + i));
        _mm512_mask_storeu_ps(dgate + i, m, dg);
        _mm512_mask_storeu_ps(dup + i, m, du);
    }
}

// The AVX2 + FMA twins: the same operations in the same order on 8 lanes
// (exp256 equals exp512 lane for lane), so both paths give the same bits.
__attribute__((target("avx2,fma"))) static inline void swiglu_sigmoid8(__m256 x, __m256 *s,
                                                                       __m256 *s1) {
    __m256 abs_x = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x);
    __m256 e = exp256(_mm256_mul_ps(_mm256_set1_ps(-1.0f), abs_x));
    __m256 r = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    __m256 er = _mm256_mul_ps(e, r);
    __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
    *s = _mm256_blendv_ps(r, er, neg);
    *s1 = _mm256_blendv_ps(er, r, neg);
}

// a ragged end (n not a multiple of 8) goes through zero-padded 8-lane buffers
__attribute__((target("avx2,fma"))) static inline void swiglu_fwd8(float *out, const float *gate,
                                                                   const float *up) {
    __m256 x = _mm256_loadu_ps(gate), s, s1;
    swiglu_sigmoid8(x, &s, &s1);
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_mul_ps(x, s), _mm256_loadu_ps(up)));
}

__attribute__((target("avx2,fma"))) static void swiglu_fwd_avx2(float *out, const float *gate,
                                                                const float *up, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) swiglu_fwd8(out + i, gate + i, up + i);
    if (i < n) {
        float g8[8] = {0}, u8[8] = {0}, y8[8];
        memcpy(g8, gate + i, (size_t)(n - i) * sizeof *g8);
        memcpy(u8, up + i, (size_t)(n - i) * sizeof *u8);
        swiglu_fwd8(y8, g8, u8);
        memcpy(out + i, y8, (size_t)(n - i) * sizeof *y8);
    }
}

__attribute__((target("avx2,fma"))) static inline void
swiglu_bwd8(float *dgate, float *dup, const float *gate, const float *up, const float *dout) {
    __m256 x = _mm256_loadu_ps(gate), s, s1;
    swiglu_sigmoid8(x, &s, &s1);
    __m256 dy = _mm256_loadu_ps(dout);
    __m256 ds = _mm256_mul_ps(s, _mm256_fmadd_ps(x, s1, _mm256_set1_ps(1.0f)));
    __m256 dg = _mm256_fmadd_ps(_mm256_mul_ps(dy, _mm256_loadu_ps(up)), ds, _mm256_loadu_ps(dgate));
    __m256 du = _mm256_fmadd_ps(dy, _mm256_mul_ps(x, s), _mm256_loadu_ps(dup));
    _mm256_storeu_ps(dgate, dg);
    _mm256_storeu_ps(dup, du);
}

__attribute__((target("avx2,fma"))) static void swiglu_bwd_avx2(float *dgate, float *dup,
                                                                const float *gate, const float *up,
                                                                const float *dout, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) swiglu_bwd8(dgate + i, dup + i, gate + i, up + i, dout + i);
    if (i < n) {
        size_t tail = (size_t)(n - i) * sizeof(float);
        float g8[8] = {0}, u8[8] = {0}, dy8[8] = {0}, dg8[8] = {0}, du8[8] = {0};
        memcpy(g8, gate + i, tail);
        memcpy(u8, up + i, tail);
        memcpy(dy8, dout + i, tail);
        memcpy(dg8, dgate + i, tail);
        memcpy(du8, dup + i, tail);
        swiglu_bwd8(dg8, du8, g8, u8, dy8);
        memcpy(dgate + i, dg8, tail);
        memcpy(dup + i, du8, tail);
    }
}
#endif

// the widest path fl_cpu() allows (FITLM_ISA caps it)
static swiglu_fwd_fn swiglu_fwd_path(void) {
#if FL_HAVE_X86_SIMD
    if (fl_cpu()->avx512f) return swiglu_fwd_avx512;
    if (fl_cpu()->avx2 && fl_cpu()->fma) return swiglu_fwd_avx2;
#endif
    return swiglu_fwd_row;
}

static swiglu_bwd_fn swiglu_bwd_path(void) {
#if FL_HAVE_X86_SIMD
    if (fl_cpu()->avx512f) return swiglu_bwd_avx512;
    if (fl_cpu()->avx2 && fl_cpu()->fma) return swiglu_bwd_avx2;
#endif
    return swiglu_bwd_row;
}

void swiglu_forward(fl_dtype dt, void *out, const void *inp, int N, int IC) {
    FL_ASSERT(N >= 0 && IC > 0);
    int per_row = (IC + SWIGLU_CHUNK - 1) / SWIGLU_CHUNK;
    long long items = (long long)N * per_row;
    swiglu_fwd_fn fwd_row = swiglu_fwd_path();
#pragma omp parallel for if ((size_t)N * IC >= FL_PAR_MIN_VALUES)
    for (long long it = 0; it < items; it++) {
        int n = (int)(it / per_row), i0 = (int)(it % per_row) * SWIGLU_CHUNK;
        int nc = IC - i0 < SWIGLU_CHUNK ? IC - i0 : SWIGLU_CHUNK;
        float g32[SWIGLU_CHUNK], u32[SWIGLU_CHUNK], y32[SWIGLU_CHUNK];
        size_t row = (size_t)n * 2 * IC + i0;
        const float *g = fl_load_f32(dt, fl_at_const(dt, inp, row), nc, g32);
        const float *u = fl_load_f32(dt, fl_at_const(dt, inp, row + IC), nc, u32);
        void *y = fl_at(dt, out, (size_t)n * IC + i0);
        float *y_f = fp32_out(dt, y, y32);
        fwd_row(y_f, g, u, nc);
        fp32_flush(dt, y, y_f, nc);
    }
}

void swiglu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout, int N, int IC) {
    FL_ASSERT(N >= 0 && IC > 0);
    int per_row = (IC + SWIGLU_CHUNK - 1) / SWIGLU_CHUNK;
    long long items = (long long)N * per_row;
    swiglu_bwd_fn bwd_row = swiglu_bwd_path();
#pragma omp parallel for if ((size_t)N * IC >= FL_PAR_MIN_VALUES)
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
        bwd_row(dg, du, g, u, dy, nc);
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
