// gelu.c: GELU, tanh approximation (GPT-2's "gelu_new"):
// gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
// The AVX-512 and AVX2 paths use the identity 0.5 (1 + tanh(u)) =
// 1 / (1 + exp(-2u)): one vector exp and division per 16 (8) values instead
// of 16 (8) libm tanhf calls.
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include "simd.h"
#include <math.h>
#include <string.h>

#define GELU_SCALING_FACTOR 0.7978845608028654f // sqrt(2/pi)
#define GELU_CUBIC          0.044715f
#define GELU_CHUNK          2048 // values per parallel work item and fp32 buffer

typedef void (*gelu_fwd_fn)(float *out, const float *inp, size_t n);
typedef void (*gelu_bwd_fn)(float *dinp, const float *inp, const float *dout, size_t n);

void gelu_forward_ref(float *out, const float *inp, size_t N) {
    for (size_t i = 0; i < N; i++) {
        float x = inp[i];
        float u = GELU_SCALING_FACTOR * (x + GELU_CUBIC * x * x * x);
        out[i] = 0.5f * x * (1.0f + tanhf(u));
    }
}

// d/dx with sech^2 = 1 - tanh^2 (as PyTorch does): one transcendental, and no
// coshf overflow for large |x|
void gelu_backward_ref(float *dinp, const float *inp, const float *dout, size_t N) {
    for (size_t i = 0; i < N; i++) {
        float x = inp[i];
        float u = GELU_SCALING_FACTOR * (x + GELU_CUBIC * x * x * x);
        float th = tanhf(u);
        float du = GELU_SCALING_FACTOR * (1.0f + 3.0f * GELU_CUBIC * x * x);
        dinp[i] += (0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du) * dout[i];
    }
}

#if FL_HAVE_X86_SIMD
// s = 0.5 (1 + tanh u) = 1 / (1 + exp(-2u)) and s (1 - s) = 0.25 sech^2 u,
// both from a = exp(-2|u|) in [0, 1]: nothing overflows, and neither tail
// cancels (1 - tanh^2 does for large u)
__attribute__((target("avx512f"))) static inline void gelu_sigmoid(__m512 x, __m512 *s,
                                                                   __m512 *s1s) {
    __m512 u = _mm512_mul_ps(
        _mm512_mul_ps(x, _mm512_set1_ps(GELU_SCALING_FACTOR)),
        _mm512_fmadd_ps(_mm512_mul_ps(x, x), _mm512_set1_ps(GELU_CUBIC), _mm512_set1_ps(1.0f)));
    __m512 a = exp512(_mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_abs_ps(u)));
    __m512 r = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), a));
    __m512 ar = _mm512_mul_ps(a, r);
    *s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_LT_OQ), r, ar);
    *s1s = _mm512_mul_ps(ar, r);
}

__attribute__((target("avx512f"))) static void gelu_forward_avx512(float *out, const float *inp,
                                                                   size_t n) {
    for (size_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 x = _mm512_maskz_loadu_ps(m, inp + i), s, s1s;
        gelu_sigmoid(x, &s, &s1s);
        _mm512_mask_storeu_ps(out + i, m, _mm512_mul_ps(x, s));
    }
}

// d/dx = s + x s (1 - s) 2 du/dx, since 0.5 sech^2 u = 2 s (1 - s)
__attribute__((target("avx512f"))) static void gelu_backward_avx512(float *dinp, const float *inp,
                                                                    const float *dout, size_t n) {
    for (size_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 x = _mm512_maskz_loadu_ps(m, inp + i), s, s1s;
        gelu_sigmoid(x, &s, &s1s);
        __m512 du2 = _mm512_fmadd_ps(_mm512_mul_ps(x, x),
                                     _mm512_set1_ps(6.0f * GELU_CUBIC * GELU_SCALING_FACTOR),
                                     _mm512_set1_ps(2.0f * GELU_SCALING_FACTOR));
        __m512 grad = _mm512_fmadd_ps(_mm512_mul_ps(x, s1s), du2, s);
        __m512 d = _mm512_fmadd_ps(grad, _mm512_maskz_loadu_ps(m, dout + i),
                                   _mm512_maskz_loadu_ps(m, dinp + i));
        _mm512_mask_storeu_ps(dinp + i, m, d);
    }
}

// The AVX2 + FMA twins: the same operations in the same order on 8 lanes
// (exp256 equals exp512 lane for lane), so both paths give the same bits.
__attribute__((target("avx2,fma"))) static inline void gelu_sigmoid8(__m256 x, __m256 *s,
                                                                     __m256 *s1s) {
    __m256 u = _mm256_mul_ps(
        _mm256_mul_ps(x, _mm256_set1_ps(GELU_SCALING_FACTOR)),
        _mm256_fmadd_ps(_mm256_mul_ps(x, x), _mm256_set1_ps(GELU_CUBIC), _mm256_set1_ps(1.0f)));
    __m256 abs_u = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), u);
    __m256 a = exp256(_mm256_mul_ps(_mm256_set1_ps(-2.0f), abs_u));
    __m256 r = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), a));
    __m256 ar = _mm256_mul_ps(a, r);
    *s = _mm256_blendv_ps(r, ar, _mm256_cmp_ps(u, _mm256_setzero_ps(), _CMP_LT_OQ));
    *s1s = _mm256_mul_ps(ar, r);
}

// a ragged end (n not a multiple of 8) goes through zero-padded 8-lane buffers
__attribute__((target("avx2,fma"))) static inline void gelu_forward8(float *out, const float *inp) {
    __m256 x = _mm256_loadu_ps(inp), s, s1s;
    gelu_sigmoid8(x, &s, &s1s);
    _mm256_storeu_ps(out, _mm256_mul_ps(x, s));
}

__attribute__((target("avx2,fma"))) static void gelu_forward_avx2(float *out, const float *inp,
                                                                  size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) gelu_forward8(out + i, inp + i);
    if (i < n) {
        float x8[8] = {0}, y8[8];
        memcpy(x8, inp + i, (n - i) * sizeof *x8);
        gelu_forward8(y8, x8);
        memcpy(out + i, y8, (n - i) * sizeof *y8);
    }
}

__attribute__((target("avx2,fma"))) static inline void gelu_backward8(float *dinp, const float *inp,
                                                                      const float *dout) {
    __m256 x = _mm256_loadu_ps(inp), s, s1s;
    gelu_sigmoid8(x, &s, &s1s);
    __m256 du2 = _mm256_fmadd_ps(_mm256_mul_ps(x, x),
                                 _mm256_set1_ps(6.0f * GELU_CUBIC * GELU_SCALING_FACTOR),
                                 _mm256_set1_ps(2.0f * GELU_SCALING_FACTOR));
    __m256 grad = _mm256_fmadd_ps(_mm256_mul_ps(x, s1s), du2, s);
    _mm256_storeu_ps(dinp, _mm256_fmadd_ps(grad, _mm256_loadu_ps(dout), _mm256_loadu_ps(dinp)));
}

__attribute__((target("avx2,fma"))) static void gelu_backward_avx2(float *dinp, const float *inp,
                                                                   const float *dout, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) gelu_backward8(dinp + i, inp + i, dout + i);
    if (i < n) {
        float x8[8] = {0}, dy8[8] = {0}, dx8[8] = {0};
        memcpy(x8, inp + i, (n - i) * sizeof *x8);
        memcpy(dy8, dout + i, (n - i) * sizeof *dy8);
        memcpy(dx8, dinp + i, (n - i) * sizeof *dx8);
        gelu_backward8(dx8, x8, dy8);
        memcpy(dinp + i, dx8, (n - i) * sizeof *dx8);
    }
}

#endif

// Elementwise, so chunking changes nothing in the result: deterministic.
// 16-bit chunks pass through fp32 buffers on the stack; fp32 is used in place.
void gelu_forward(fl_dtype dt, void *out, const void *inp, size_t N) {
    gelu_fwd_fn f = gelu_forward_ref;
#if FL_HAVE_X86_SIMD
    if (fl_cpu()->avx512f)
        f = gelu_forward_avx512;
    else if (fl_cpu()->avx2 && fl_cpu()->fma)
        f = gelu_forward_avx2;
#endif
    size_t nchunks = (N + GELU_CHUNK - 1) / GELU_CHUNK;
#pragma omp parallel for if (N >= FL_PAR_MIN_VALUES)
    for (size_t c = 0; c < nchunks; c++) {
        size_t i0 = c * GELU_CHUNK, n = N - i0 < GELU_CHUNK ? N - i0 : GELU_CHUNK;
        float inp32[GELU_CHUNK], out32[GELU_CHUNK];
        float *y = fp32_out(dt, fl_at(dt, out, i0), out32);
        f(y, fl_load_f32(dt, fl_at_const(dt, inp, i0), n, inp32), n);
        fp32_flush(dt, fl_at(dt, out, i0), y, n);
    }
}

void gelu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout, size_t N) {
    gelu_bwd_fn f = gelu_backward_ref;
#if FL_HAVE_X86_SIMD
    if (fl_cpu()->avx512f)
        f = gelu_backward_avx512;
    else if (fl_cpu()->avx2 && fl_cpu()->fma)
        f = gelu_backward_avx2;
#endif
    size_t nchunks = (N + GELU_CHUNK - 1) / GELU_CHUNK;
#pragma omp parallel for if (N >= FL_PAR_MIN_VALUES)
    for (size_t c = 0; c < nchunks; c++) {
        size_t i0 = c * GELU_CHUNK, n = N - i0 < GELU_CHUNK ? N - i0 : GELU_CHUNK;
        float inp32[GELU_CHUNK], dout32[GELU_CHUNK], dinp32[GELU_CHUNK];
        float *dx = fp32_rmw(dt, fl_at(dt, dinp, i0), n, dinp32);
        f(dx, fl_load_f32(dt, fl_at_const(dt, inp, i0), n, inp32),
          fl_load_f32(dt, fl_at_const(dt, dout, i0), n, dout32), n);
        fp32_flush(dt, fl_at(dt, dinp, i0), dx, n);
    }
}
