// simd.h: private helpers shared by the kernels: fp32 views of data of any
// storage dtype, and the AVX-512 and AVX2 paths' vector helpers. The latter carry
// target attributes, so the file compiles in a baseline x86-64 build; callers
// pick those paths only when fl_cpu() reports the ISA.
#ifndef FITLM_KERNELS_SIMD_H
#define FITLM_KERNELS_SIMD_H

#include <math.h>
#include <omp.h>
#include <stddef.h>

#include "fitlm/core.h" // FL_ISA_COPIES
#include "fitlm/dtype.h"

// Kernels compute in fp32 on n values at a time. An output is computed in
// fp32_out(...) and written with fp32_flush(...); a gradient that accumulates
// is read with fp32_rmw(...), added to in fp32 and flushed, so it is rounded
// once however many terms it received. For fp32 data all of them work on dst
// itself (no copy, and fp32_flush does nothing); otherwise on scratch.
static inline float *fp32_out(fl_dtype dt, void *dst, float *scratch) {
    return dt == FL_F32 ? (float *)dst : scratch;
}

static inline float *fp32_rmw(fl_dtype dt, void *dst, size_t n, float *scratch) {
    return (float *)fl_load_f32(dt, dst, n, scratch);
}

static inline void fp32_flush(fl_dtype dt, void *dst, const float *x, size_t n) {
    if (dt != FL_F32) fl_store_f32(dt, dst, x, n);
}

// A norm's 1/sqrt(var): a row whose squares overflowed (var inf, from
// finite but huge inputs) has no scale, and 1/sqrt(inf) = 0 would silently
// reduce the row to its bias; NaN carries the overflow on to the loss, where
// it is reported (a non-finite result is an error). Finite rows unchanged.
static inline float norm_rstd(float var) {
    return var <= 3.4028235e38f ? 1.0f / sqrtf(var) : NAN;
}

// element i of src as fp32
static inline float fp32_at(fl_dtype dt, const void *src, size_t i) {
    float x;
    return *fl_load_f32(dt, fl_at_const(dt, src, i), 1, &x);
}

// Kernels that make a pass or two over their data (norms, residual adds, RoPE,
// activations, embeddings) run on one thread when a call's main tensor has
// fewer values than this. Waking a passively waiting OpenMP thread cost 40-80
// us on a 2-core Zen 4 VM (a halted vCPU, or a core another process holds),
// so two threads paid off only above ~150 us of one core's work: from ~2^18.5
// values (layernorm, GELU, SwiGLU) to ~2^20 (residual add, RoPE).
#define FL_PAR_MIN_VALUES ((size_t)1 << 19)

// The calling thread's part of n values split into contiguous ranges of
// whole blocks of `block` (the last one ragged), one range per thread of the
// enclosing parallel region: [*lo, *hi), empty when there are more threads
// than blocks. The norms' weight gradients sum their rows channel range by
// channel range, so no sum crosses threads.
static inline void thread_block_range(int n, int block, int *lo, int *hi) {
    int blocks = (n + block - 1) / block, threads = omp_get_num_threads();
    int t = omp_get_thread_num();
    *lo = blocks * t / threads * block;
    *hi = blocks * (t + 1) / threads * block;
    if (*hi > n) *hi = n;
}

#if defined(__x86_64__)
#include <immintrin.h>
#define FL_HAVE_X86_SIMD 1

// load8_f32/store8_f32 and load16_f32/store16_f32: data of any storage dtype
// in fp32 registers, rounded as fl_store_f32 rounds
#include "../core/dtype_simd.h"

// exp(x) on 16 lanes: Cephes' expf (range reduction by ln 2, degree-6
// polynomial, ~1 ulp), inf above ~88.72. Results below e^-80 (~2e-35) are
// flushed to 0 so nothing downstream touches denormals, which cost ~100
// cycles each. NaN propagates (it is max/min's second operand).
__attribute__((target("avx512f"))) static inline __m512 exp512(__m512 x) {
    __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-80.0f), _CMP_NLT_UQ);
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-80.0f), x));
    __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_maskz_scalef_ps(keep, p, k); // p * 2^k
}

// exp512's algorithm on 8 lanes with AVX2 + FMA (no scalef or masked
// moves: 2^k is built in the exponent bits), for CPUs without AVX-512.
// Same constants and operation order, so each lane equals exp512's.
__attribute__((target("avx2,fma"))) static inline __m256 exp256(__m256 x) {
    __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-80.0f), _CMP_NLT_UQ);
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-80.0f), x));
    __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    // p * 2^k in two steps (k up to 128 would overflow one exponent field);
    // k >= -116 here, so neither factor is subnormal
    __m256i ki = _mm256_cvtps_epi32(k), half = _mm256_srai_epi32(ki, 1);
    __m256 a =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(half, _mm256_set1_epi32(127)), 23));
    __m256 b = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_sub_epi32(ki, half), _mm256_set1_epi32(127)), 23));
    return _mm256_and_ps(keep, _mm256_mul_ps(_mm256_mul_ps(p, a), b));
}

// lanes [0, n) of an 8-lane block, for maskload/maskstore
__attribute__((target("avx2"))) static inline __m256i tail_mask8(size_t n) {
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n >= 8 ? 8 : (int)n), lane);
}

// lanes [0, n) of a 16-lane block: the ragged end of a row
static inline __mmask16 tail_mask(size_t n) {
    return n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
}

#else
#define FL_HAVE_X86_SIMD 0
#endif

#endif
