// dtype_simd.h: bf16 and fp16 to and from fp32 in vector registers, 8 lanes
// (AVX2, F16C) or 16 (AVX-512), bit for bit the scalar conversions of
// dtype.c: bf16 rounds to nearest even in integer arithmetic and keeps NaNs
// quiet (vcvtneps2bf16 is faster from L1 but flushes fp32 subnormals to
// zero); fp16 uses vcvtph2ps and vcvtps2ph, which round to nearest even and
// keep fp16 subnormals (F16C ships with every AVX2 CPU, so the 8-lane forms
// use it without a probe of their own). Private to dtype.c and the kernels,
// whose vector loops load and store 16-bit data through these instead of
// through a converted copy (a pass of its own over memory).
#ifndef FITLM_CORE_DTYPE_SIMD_H
#define FITLM_CORE_DTYPE_SIMD_H

#if defined(__x86_64__)
#include <immintrin.h>
#include <stdint.h>

#include "fitlm/dtype.h"

// 8 fp32 -> 8 bf16 in the low halves of the 32-bit lanes (fl_f32_to_bf16).
// A NaN (unordered with itself) is quieted before the one shift: its top
// payload bits kept.
__attribute__((target("avx2"))) static inline __m256i bf16_round_avx2(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x400000));
    return _mm256_srli_epi32(_mm256_blendv_epi8(r, quiet, nan), 16);
}

// the same on 16 lanes
__attribute__((target("avx512f"))) static inline __m512i bf16_round_avx512(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_srli_epi32(_mm512_mask_or_epi32(r, nan, u, _mm512_set1_epi32(0x400000)), 16);
}

// 8 values of dtype dt at element i of p, as fp32
__attribute__((target("avx2,f16c"))) static inline __m256 load8_f32(fl_dtype dt, const void *p,
                                                                    size_t i) {
    if (dt == FL_F32) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dt == FL_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// the same for 4 values, as a 128-bit vector
__attribute__((target("avx2,f16c"))) static inline __m128 load4_f32(fl_dtype dt, const void *p,
                                                                    size_t i) {
    if (dt == FL_F32) return _mm_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadl_epi64((const __m128i *)((const uint16_t *)p + i));
    if (dt == FL_F16) return _mm_cvtph_ps(h);
    return _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(h), 16));
}

// x as 8 values of dtype dt at element i of p
__attribute__((target("avx2,f16c"))) static inline void store8_f32(fl_dtype dt, void *p, size_t i,
                                                                   __m256 x) {
    if (dt == FL_F32) {
        _mm256_storeu_ps((float *)p + i, x);
        return;
    }
    __m128i h;
    if (dt == FL_F16) {
        h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    } else {
        __m256i r = bf16_round_avx2(x); // each value < 2^16: packus keeps it
        h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), h);
}

// lanes m of 16 values of dtype dt at element i of p, as fp32 (the others 0)
__attribute__((target("avx512f,avx512bw,avx512vl"))) static inline __m512
load16_f32(fl_dtype dt, const void *p, size_t i, __mmask16 m) {
    if (dt == FL_F32) return _mm512_maskz_loadu_ps(m, (const float *)p + i);
    __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t *)p + i);
    if (dt == FL_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// lanes m of x as values of dtype dt at element i of p
__attribute__((target("avx512f,avx512bw,avx512vl"))) static inline void
store16_f32(fl_dtype dt, void *p, size_t i, __mmask16 m, __m512 x) {
    if (dt == FL_F32) {
        _mm512_mask_storeu_ps((float *)p + i, m, x);
        return;
    }
    __m256i h = dt == FL_F16 ? _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)
                             : _mm512_cvtepi32_epi16(bf16_round_avx512(x));
    _mm256_mask_storeu_epi16((uint16_t *)p + i, m, h);
}
#endif

#endif
