// swiglu.c: LLaMA's MLP gate. Each row of inp (N,2IC) is [gate | up], the
// outputs of gate_proj and up_proj side by side (one fused GEMM):
//   out = silu(gate) * up, silu(x) = x sigmoid(x)
//   dgate += dout * up * sigmoid(x) (1 + x (1 - sigmoid(x))),  dup += dout * silu(gate)
// sigmoid(x) and 1 - sigmoid(x) both come from e = exp(-|x|) in (0, 1]:
// 1 / (1 + e) and e / (1 + e), so nothing overflows and neither cancels.
// Elementwise: the fast version runs on chunks of rows in parallel (chunking
// changes nothing in the result: deterministic). The AVX-512 and AVX2 paths
// take e from the shared vector exp (exp512, exp256): one exp and division
// per 16 (8) values instead of 16 (8) libm expf calls; they convert 16-bit
// data in registers, the portable path through fp32 buffers on the stack.
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include "simd.h"
#include <math.h>

#define SWIGLU_CHUNK 1024 // columns per parallel work item (and portable fp32 buffer)

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

// A path computes n <= SWIGLU_CHUNK values of a row; gate, up, out, dout,
// dgate and dup point at the chunk's first value in dtype dt.
typedef void (*swiglu_fwd_fn)(fl_dtype dt, void *out, const void *gate, const void *up, int n);
typedef void (*swiglu_bwd_fn)(fl_dtype dt, void *dgate, void *dup, const void *gate, const void *up,
                              const void *dout, int n);

// 16-bit chunks through fp32 buffers on the stack
static void swiglu_fwd_portable(fl_dtype dt, void *out, const void *gate, const void *up, int n) {
    float g32[SWIGLU_CHUNK], u32[SWIGLU_CHUNK], y32[SWIGLU_CHUNK];
    const float *g = fl_load_f32(dt, gate, n, g32), *u = fl_load_f32(dt, up, n, u32);
    float *y = fp32_out(dt, out, y32);
    swiglu_fwd_row(y, g, u, n);
    fp32_flush(dt, out, y, n);
}

static void swiglu_bwd_portable(fl_dtype dt, void *dgate, void *dup, const void *gate,
                                const void *up, const void *dout, int n) {
    float g32[SWIGLU_CHUNK], u32[SWIGLU_CHUNK], dy32[SWIGLU_CHUNK];
    float dg32[SWIGLU_CHUNK], du32[SWIGLU_CHUNK];
    const float *g = fl_load_f32(dt, gate, n, g32), *u = fl_load_f32(dt, up, n, u32);
    const float *dy = fl_load_f32(dt, dout, n, dy32);
    float *dg = fp32_rmw(dt, dgate, n, dg32), *du = fp32_rmw(dt, dup, n, du32);
    swiglu_bwd_row(dg, du, g, u, dy, n);
    fp32_flush(dt, dgate, dg, n);
    fp32_flush(dt, dup, du, n);
}

#if FL_HAVE_X86_SIMD
// The vector paths convert 16-bit data in registers as they load and store
// it (the bits of fl_load_f32 and fl_store_f32), so that memory is read once,
// overlapped with the arithmetic, instead of in a conversion pass of its own.

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

__attribute__((target("avx512f,avx512bw,avx512vl"))) static void
swiglu_fwd_avx512(fl_dtype dt, void *out, const void *gate, const void *up, int n) {
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask((size_t)(n - i));
        __m512 x = load16_f32(dt, gate, i, m), s, s1;
        swiglu_sigmoid(x, &s, &s1);
        store16_f32(dt, out, i, m, _mm512_mul_ps(_mm512_mul_ps(x, s), load16_f32(dt, up, i, m)));
    }
}

// dgate += (dout up) s (1 + x s1),  dup += dout (x s)
__attribute__((target("avx512f,avx512bw,avx512vl"))) static void
swiglu_bwd_avx512(fl_dtype dt, void *dgate, void *dup, const void *gate, const void *up,
                  const void *dout, int n) {
    for (int i = 0; i < n; i += 16) {
        __mmask16 m = tail_mask((size_t)(n - i));
        __m512 x = load16_f32(dt, gate, i, m), s, s1;
        swiglu_sigmoid(x, &s, &s1);
        __m512 dy = load16_f32(dt, dout, i, m);
        __m512 ds = _mm512_mul_ps(s, _mm512_fmadd_ps(x, s1, _mm512_set1_ps(1.0f)));
        __m512 dg = _mm512_fmadd_ps(_mm512_mul_ps(dy, load16_f32(dt, up, i, m)), ds,
                                    load16_f32(dt, dgate, i, m));
        __m512 du = _mm512_fmadd_ps(dy, _mm512_mul_ps(x, s), load16_f32(dt, dup, i, m));
        store16_f32(dt, dgate, i, m, dg);
        store16_f32(dt, dup, i, m, du);
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

__attribute__((target("avx2,fma,f16c"))) static inline void
swiglu_fwd8(fl_dtype dt, void *out, const void *gate, const void *up, size_t i) {
    __m256 x = load8_f32(dt, gate, i), s, s1;
    swiglu_sigmoid8(x, &s, &s1);
    store8_f32(dt, out, i, _mm256_mul_ps(_mm256_mul_ps(x, s), load8_f32(dt, up, i)));
}

// a ragged end (n not a multiple of 8) goes through zero-padded fp32 buffers
__attribute__((target("avx2,fma,f16c"))) static void
swiglu_fwd_avx2(fl_dtype dt, void *out, const void *gate, const void *up, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) swiglu_fwd8(dt, out, gate, up, (size_t)i);
    if (i < n) {
        float g8[8] = {0}, u8[8] = {0}, y8[8];
        fl_convert(FL_F32, g8, dt, fl_at_const(dt, gate, i), n - i);
        fl_convert(FL_F32, u8, dt, fl_at_const(dt, up, i), n - i);
        swiglu_fwd8(FL_F32, y8, g8, u8, 0);
        fl_store_f32(dt, fl_at(dt, out, i), y8, n - i);
    }
}

__attribute__((target("avx2,fma,f16c"))) static inline void
swiglu_bwd8(fl_dtype dt, void *dgate, void *dup, const void *gate, const void *up, const void *dout,
            size_t i) {
    __m256 x = load8_f32(dt, gate, i), s, s1;
    swiglu_sigmoid8(x, &s, &s1);
    __m256 dy = load8_f32(dt, dout, i);
    __m256 ds = _mm256_mul_ps(s, _mm256_fmadd_ps(x, s1, _mm256_set1_ps(1.0f)));
    __m256 dg =
        _mm256_fmadd_ps(_mm256_mul_ps(dy, load8_f32(dt, up, i)), ds, load8_f32(dt, dgate, i));
    __m256 du = _mm256_fmadd_ps(dy, _mm256_mul_ps(x, s), load8_f32(dt, dup, i));
    store8_f32(dt, dgate, i, dg);
    store8_f32(dt, dup, i, du);
}

__attribute__((target("avx2,fma,f16c"))) static void swiglu_bwd_avx2(fl_dtype dt, void *dgate,
                                                                     void *dup, const void *gate,
                                                                     const void *up,
                                                                     const void *dout, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) swiglu_bwd8(dt, dgate, dup, gate, up, dout, (size_t)i);
    if (i < n) {
        int tail = n - i;
        float g8[8] = {0}, u8[8] = {0}, dy8[8] = {0}, dg8[8] = {0}, du8[8] = {0};
        fl_convert(FL_F32, g8, dt, fl_at_const(dt, gate, i), tail);
        fl_convert(FL_F32, u8, dt, fl_at_const(dt, up, i), tail);
        fl_convert(FL_F32, dy8, dt, fl_at_const(dt, dout, i), tail);
        fl_convert(FL_F32, dg8, dt, fl_at_const(dt, dgate, i), tail);
        fl_convert(FL_F32, du8, dt, fl_at_const(dt, dup, i), tail);
        swiglu_bwd8(FL_F32, dg8, du8, g8, u8, dy8, 0);
        fl_store_f32(dt, fl_at(dt, dgate, i), dg8, tail);
        fl_store_f32(dt, fl_at(dt, dup, i), du8, tail);
    }
}
#endif

// the widest path fl_cpu_isa() allows (FITLM_ISA caps it)
static swiglu_fwd_fn swiglu_fwd_path(void) {
#if FL_HAVE_X86_SIMD
    if (fl_cpu_isa() >= FL_ISA_AVX512) return swiglu_fwd_avx512;
    if (fl_cpu_isa() >= FL_ISA_AVX2) return swiglu_fwd_avx2;
#endif
    return swiglu_fwd_portable;
}

static swiglu_bwd_fn swiglu_bwd_path(void) {
#if FL_HAVE_X86_SIMD
    if (fl_cpu_isa() >= FL_ISA_AVX512) return swiglu_bwd_avx512;
    if (fl_cpu_isa() >= FL_ISA_AVX2) return swiglu_bwd_avx2;
#endif
    return swiglu_bwd_portable;
}

void swiglu_forward(fl_dtype dt, void *out, const void *inp, int N, int IC) {
    FL_ASSERT(N >= 0 && IC > 0);
    int per_row = (IC + SWIGLU_CHUNK - 1) / SWIGLU_CHUNK;
    long long items = (long long)N * per_row;
    swiglu_fwd_fn fwd = swiglu_fwd_path();
#pragma omp parallel for if ((size_t)N * IC >= FL_PAR_MIN_VALUES)
    for (long long it = 0; it < items; it++) {
        int n = (int)(it / per_row), i0 = (int)(it % per_row) * SWIGLU_CHUNK;
        int nc = IC - i0 < SWIGLU_CHUNK ? IC - i0 : SWIGLU_CHUNK;
        size_t row = (size_t)n * 2 * IC + i0;
        fwd(dt, fl_at(dt, out, (size_t)n * IC + i0), fl_at_const(dt, inp, row),
            fl_at_const(dt, inp, row + IC), nc);
    }
}

void swiglu_backward(fl_dtype dt, void *dinp, const void *inp, const void *dout, int N, int IC) {
    FL_ASSERT(N >= 0 && IC > 0);
    int per_row = (IC + SWIGLU_CHUNK - 1) / SWIGLU_CHUNK;
    long long items = (long long)N * per_row;
    swiglu_bwd_fn bwd = swiglu_bwd_path();
    // counted over inp and dinp (N x 2IC): per value it reads and writes
    // about twice what the forward does (the LLaMA of bench/ at 256 tokens,
    // IC 1536: 0.40 ms a call on one thread, 0.25 on two; the forward's
    // 0.15 ms gains nothing)
#pragma omp parallel for if ((size_t)N * 2 * IC >= FL_PAR_MIN_VALUES)
    for (long long it = 0; it < items; it++) {
        int n = (int)(it / per_row), i0 = (int)(it % per_row) * SWIGLU_CHUNK;
        int nc = IC - i0 < SWIGLU_CHUNK ? IC - i0 : SWIGLU_CHUNK;
        size_t row = (size_t)n * 2 * IC + i0;
        bwd(dt, fl_at(dt, dinp, row), fl_at(dt, dinp, row + IC), fl_at_const(dt, inp, row),
            fl_at_const(dt, inp, row + IC), fl_at_const(dt, dout, (size_t)n * IC + i0), nc);
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
