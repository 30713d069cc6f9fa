// gelu.c: GELU, tanh approximation (GPT-2's "gelu_new"):
// gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
// The AVX-512 and AVX2 paths use the identity 0.5 (1 + tanh(u)) =
// 1 / (1 + exp(-2u)): one vector exp and division per 16 (8) values instead
// of 16 (8) libm tanhf calls; they convert 16-bit data in registers.
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include "simd.h"
#include <math.h>

#define GELU_SCALING_FACTOR 0.7978845608028654f // sqrt(2/pi)
#define GELU_CUBIC          0.044715f
#define GELU_CHUNK          2048 // values per parallel work item (and portable fp32 buffer)

// A path computes n <= GELU_CHUNK values at out, inp, dinp, dout (dtype dt).
typedef void (*gelu_fwd_fn)(fl_dtype dt, void *out, const void *inp, size_t n);
typedef void (*gelu_bwd_fn)(fl_dtype dt, void *dinp, const void *inp, const void *dout, size_t n);

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

// 16-bit chunks through fp32 buffers on the stack
static void gelu_forward_portable(fl_dtype dt, void *out, const void *inp, size_t n) {
    float inp32[GELU_CHUNK], out32[GELU_CHUNK];
    float *y = fp32_out(dt, out, out32);
    gelu_forward_ref(y, fl_load_f32(dt, inp, n, inp32), n);
    fp32_flush(dt, out, y, n);
}

static void gelu_backward_portable(fl_dtype dt, void *dinp, const void *inp, const void *dout,
                                   size_t n) {
    float inp32[GELU_CHUNK], dout32[GELU_CHUNK], dinp32[GELU_CHUNK];
    float *dx = fp32_rmw(dt, dinp, n, dinp32);
    gelu_backward_ref(dx, fl_load_f32(dt, inp, n, inp32), fl_load_f32(dt, dout, n, dout32), n);
    fp32_flush(dt, dinp, dx, n);
}

#if FL_HAVE_X86_SIMD
// The vector paths convert 16-bit data in registers as they load and store
// it (the bits of fl_load_f32 and fl_store_f32): no conversion pass.

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

__attribute__((target("avx512f,avx512bw,avx512vl"))) static void
gelu_forward_avx512(fl_dtype dt, void *out, const void *inp, size_t n) {
    for (size_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 x = load16_f32(dt, inp, i, m), s, s1s;
        gelu_sigmoid(x, &s, &s1s);
        store16_f32(dt, out, i, m, _mm512_mul_ps(x, s));
    }
}

// d/dx = s + x s (1 - s) 2 du/dx, since 0.5 sech^2 u = 2 s (1 - s)
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void
gelu_backward_avx512(fl_dtype dt, void *dinp, const void *inp, const void *dout, size_t n) {
    for (size_t i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask(n - i);
        __m512 x = load16_f32(dt, inp, i, m), s, s1s;
        gelu_sigmoid(x, &s, &s1s);
        __m512 du2 = _mm512_fmadd_ps(_mm512_mul_ps(x, x),
                                     _mm512_set1_ps(6.0f * GELU_CUBIC * GELU_SCALING_FACTOR),
                                     _mm512_set1_ps(2.0f * GELU_SCALING_FACTOR));
        __m512 grad = _mm512_fmadd_ps(_mm512_mul_ps(x, s1s), du2, s);
        __m512 d = _mm512_fmadd_ps(grad, load16_f32(dt, dout, i, m), load16_f32(dt, dinp, i, m));
        store16_f32(dt, dinp, i, m, d);
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

__attribute__((target("avx2,fma,f16c"))) static inline void
gelu_forward8(fl_dtype dt, void *out, const void *inp, size_t i) {
    __m256 x = load8_f32(dt, inp, i), s, s1s;
    gelu_sigmoid8(x, &s, &s1s);
    store8_f32(dt, out, i, _mm256_mul_ps(x, s));
}

// a ragged end (n not a multiple of 8) goes through zero-padded fp32 buffers
__attribute__((target("avx2,fma,f16c"))) static void gelu_forward_avx2(fl_dtype dt, void *out,
                                                                       const void *inp, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) gelu_forward8(dt, out, inp, i);
    if (i < n) {
        float x8[8] = {0}, y8[8];
        fl_convert(FL_F32, x8, dt, fl_at_const(dt, inp, i), n - i);
        gelu_forward8(FL_F32, y8, x8, 0);
        fl_store_f32(dt, fl_at(dt, out, i), y8, n - i);
    }
}

__attribute__((target("avx2,fma,f16c"))) static inline void
gelu_backward8(fl_dtype dt, void *dinp, const void *inp, const void *dout, size_t i) {
    __m256 x = load8_f32(dt, inp, i), s, s1s;
    gelu_sigmoid8(x, &s, &s1s);
    __m256 du2 = _mm256_fmadd_ps(_mm256_mul_ps(x, x),
                                 _mm256_set1_ps(6.0f * GELU_CUBIC * GELU_SCALING_FACTOR),
                                 _mm256_set1_ps(2.0f * GELU_SCALING_FACTOR));
    __m256 grad = _mm256_fmadd_ps(_mm256_mul_ps(x, s1s), du2, s);
    store8_f32(dt, dinp, i, _mm256_fmadd_ps(grad, load8_f32(dt, dout, i), load8_f32(dt, dinp, i)));
}

__attribute__((target("avx2,fma,f16c"))) static void
gelu_backward_avx2(fl_dtype dt, void *dinp, const void *inp, const void *dout, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) gelu_backward8(dt, dinp, inp, dout, i);
    if (i < n) {
        float x8[8] = {0}, dy8[8] = {0}, dx8[8] = {0};
        fl_convert(FL_F32, x8, dt, fl_at_const(dt, inp, i), n - i);
        fl_convert(FL_F32, dy8, dt, fl_at_const(dt, dout, i), n - i);
        fl_convert(FL_F32, dx8, dt, fl_at_const(dt, dinp, i), n - i);
        gelu_backward8(FL_F32, dx8, x8, dy8, 0);
        fl_store_f32(dt, fl_at(dt, dinp, i), dx8, n - i);
    }
}

#endif

// Elementwise, so chunking changes nothing in the result: deterministic.
void gelu_forward(fl_dtype dt, void *out, const void *inp, size_t N) {
    gelu_fwd_fn f = gelu_forward_portable;
#if FL_HAVE_X86_SIMD
    if (fl_cpu_isa() >= FL_ISA_AVX512)
        f = gelu_forward_avx512;
    else if (fl_cpu_isa() >= FL_ISA_AVX2)
        f = gelu_forward_avx2;
#endif
    size_t nchunks = (N + GELU_CHUNK - 1) / GELU_CHUNK;
#pragma omp parallel for if (N >= FL_PAR_MIN_VALUES)
    for (size_t c = 0; c < nchunks; c++) {
        size_t i0 = c * GELU_CHUNK, n = N - i0 < GELU_CHUNK ? N - i0 : GELU_CHUNK;
        f(dt, fl_at(dt, out, i0), fl_at_const(dt, inp, i0), n);
    }
}

void gelu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout, size_t N) {
    gelu_bwd_fn f = gelu_backward_portable;
#if FL_HAVE_X86_SIMD
    if (fl_cpu_isa() >= FL_ISA_AVX512)
        f = gelu_backward_avx512;
    else if (fl_cpu_isa() >= FL_ISA_AVX2)
        f = gelu_backward_avx2;
#endif
    size_t nchunks = (N + GELU_CHUNK - 1) / GELU_CHUNK;
#pragma omp parallel for if (N >= FL_PAR_MIN_VALUES)
    for (size_t c = 0; c < nchunks; c++) {
        size_t i0 = c * GELU_CHUNK, n = N - i0 < GELU_CHUNK ? N - i0 : GELU_CHUNK;
        f(dt, fl_at(dt, dinp, i0), fl_at_const(dt, inp, i0), fl_at_const(dt, dout, i0), n);
    }
}
