// simd.h: private vector helpers shared by the kernels' AVX-512 paths.
// Functions carry target attributes, so the file compiles in a baseline
// x86-64 build; callers pick these paths only when fl_cpu() reports the ISA.
#ifndef FITLM_KERNELS_SIMD_H
#define FITLM_KERNELS_SIMD_H

#include <stddef.h>

#if defined(__x86_64__)
#include <immintrin.h>
#define FL_HAVE_X86_SIMD 1

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

// lanes [0, n) of a 16-lane block: the ragged end of a row
static inline __mmask16 tail_mask(size_t n) {
    return n >= 16 ? 0xffff : (__mmask16)((1u << n) - 1);
}

#else
#define FL_HAVE_X86_SIMD 0
#endif

#endif
