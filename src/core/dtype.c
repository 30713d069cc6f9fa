// dtype.c: bf16 and fp16 conversions, scalar and vectorised.
#include "fitlm/dtype.h"

#include <math.h>
#include <string.h>

#include "fitlm/core.h"

size_t fl_dtype_size(fl_dtype dt) {
    return dt == FL_F32 ? 4 : 2;
}

const char *fl_dtype_name(fl_dtype dt) {
    return dt == FL_F32 ? "fp32" : dt == FL_BF16 ? "bf16" : "fp16";
}

static uint32_t bits_of(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}

static float float_of(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}

uint16_t fl_f32_to_bf16(float x) {
    uint32_t u = bits_of(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1); // round to nearest, ties to even
    return (uint16_t)(u >> 16);
}

float fl_bf16_to_f32(uint16_t h) {
    return float_of((uint32_t)h << 16);
}

uint16_t fl_f32_to_f16(float x) {
    uint32_t u = bits_of(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu)); // quiet NaN
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); // rounds to >= 65520: inf
    if (a < 0x38800000u) {
        // subnormal or zero in fp16: scale into the integer range and let the
        // FPU round to nearest even (0.5 is 2^-25 relative to the unit 2^-24)
        float f = float_of(a) * 16777216.0f; // * 2^24: units of 2^-24
        return (uint16_t)(sign | (uint32_t)nearbyintf(f));
    }
    // normal: rebias the exponent (127 -> 15) and round 13 dropped bits
    uint32_t r = a + 0xc8000fffu + ((a >> 13) & 1); // -(112 << 23) + 0xfff + lsb
    return (uint16_t)(sign | (r >> 13));
}

float fl_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
    if (exp == 0) { // zero or subnormal: man * 2^-24, exact in fp32
        float f = (float)man * (1.0f / 16777216.0f);
        return float_of(bits_of(f) | sign);
    }
    if (exp == 31)
        return float_of(sign | 0x7f800000u | (man ? 0x400000u | man << 13 : 0)); // inf, quiet NaN
    return float_of(sign | ((exp + 112) << 23) | (man << 13));
}

// ----------------------------------------------------------------------------
// vectorised conversions, bit for bit the scalar ones above (the lanes'
// arithmetic, shared with the kernels, is in dtype_simd.h). Tails (n mod 8
// or 16) take the scalar functions.

#if defined(__x86_64__)
#include "dtype_simd.h"

__attribute__((target("avx2"))) static void bf16_to_f32_avx2(float *dst, const uint16_t *src,
                                                             size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128((const __m128i *)(src + i));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    for (; i < n; i++) dst[i] = fl_bf16_to_f32(src[i]);
}

__attribute__((target("avx2"))) static void f32_to_bf16_avx2(uint16_t *dst, const float *src,
                                                             size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i a = bf16_round_avx2(_mm256_loadu_ps(src + i));
        __m256i b = bf16_round_avx2(_mm256_loadu_ps(src + i + 8));
        // packus works per 128-bit half: a0-3 b0-3 a4-7 b4-7, reordered
        __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8);
        _mm256_storeu_si256((__m256i *)(dst + i), h);
    }
    for (; i < n; i++) dst[i] = fl_f32_to_bf16(src[i]);
}

// F16C ships with every AVX2 CPU (Intel Haswell, AMD Zen and later), so the
// AVX2 path uses it without a probe of its own.
__attribute__((target("avx2,f16c"))) static void f16_to_f32_avx2(float *dst, const uint16_t *src,
                                                                 size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
    for (; i < n; i++) dst[i] = fl_f16_to_f32(src[i]);
}

__attribute__((target("avx2,f16c"))) static void f32_to_f16_avx2(uint16_t *dst, const float *src,
                                                                 size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = fl_f32_to_f16(src[i]);
}

__attribute__((target("avx512f"))) static void bf16_to_f32_avx512(float *dst, const uint16_t *src,
                                                                  size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)(src + i));
        __m512i w = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
        _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(w));
    }
    for (; i < n; i++) dst[i] = fl_bf16_to_f32(src[i]);
}

__attribute__((target("avx512f"))) static void f32_to_bf16_avx512(uint16_t *dst, const float *src,
                                                                  size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512i h = bf16_round_avx512(_mm512_loadu_ps(src + i));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm512_cvtepi32_epi16(h));
    }
    for (; i < n; i++) dst[i] = fl_f32_to_bf16(src[i]);
}

__attribute__((target("avx512f"))) static void f16_to_f32_avx512(float *dst, const uint16_t *src,
                                                                 size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src + i))));
    for (; i < n; i++) dst[i] = fl_f16_to_f32(src[i]);
}

__attribute__((target("avx512f"))) static void f32_to_f16_avx512(uint16_t *dst, const float *src,
                                                                 size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++) dst[i] = fl_f32_to_f16(src[i]);
}
#endif

// The widest path fl_cpu() (capped by FITLM_ISA) allows.
static int best_isa(void) {
    const fl_cpu_features *cpu = fl_cpu();
    return cpu->avx512f ? FL_ISA_AVX512 : cpu->avx2 ? FL_ISA_AVX2 : FL_ISA_PORTABLE;
}

static void to_f32(int isa, float *dst, fl_dtype src_dt, const void *src, size_t n) {
    const uint16_t *h = src;
#if defined(__x86_64__)
    if (isa == FL_ISA_AVX512)
        return src_dt == FL_BF16 ? bf16_to_f32_avx512(dst, h, n) : f16_to_f32_avx512(dst, h, n);
    if (isa == FL_ISA_AVX2)
        return src_dt == FL_BF16 ? bf16_to_f32_avx2(dst, h, n) : f16_to_f32_avx2(dst, h, n);
#endif
    (void)isa;
    if (src_dt == FL_BF16)
        for (size_t i = 0; i < n; i++) dst[i] = fl_bf16_to_f32(h[i]);
    else
        for (size_t i = 0; i < n; i++) dst[i] = fl_f16_to_f32(h[i]);
}

static void from_f32(int isa, fl_dtype dst_dt, void *dst, const float *src, size_t n) {
    uint16_t *h = dst;
#if defined(__x86_64__)
    if (isa == FL_ISA_AVX512)
        return dst_dt == FL_BF16 ? f32_to_bf16_avx512(h, src, n) : f32_to_f16_avx512(h, src, n);
    if (isa == FL_ISA_AVX2)
        return dst_dt == FL_BF16 ? f32_to_bf16_avx2(h, src, n) : f32_to_f16_avx2(h, src, n);
#endif
    (void)isa;
    if (dst_dt == FL_BF16)
        for (size_t i = 0; i < n; i++) h[i] = fl_f32_to_bf16(src[i]);
    else
        for (size_t i = 0; i < n; i++) h[i] = fl_f32_to_f16(src[i]);
}

static void convert(int isa, fl_dtype dst_dt, void *dst, fl_dtype src_dt, const void *src,
                    size_t n) {
    if (dst_dt == src_dt) {
        memmove(dst, src, n * fl_dtype_size(dst_dt));
    } else if (src_dt == FL_F32) {
        from_f32(isa, dst_dt, dst, src, n);
    } else if (dst_dt == FL_F32) {
        to_f32(isa, dst, src_dt, src, n);
    } else { // bf16 <-> fp16 through fp32, in blocks
        float tmp[256];
        for (size_t i = 0; i < n; i += 256) {
            size_t m = n - i < 256 ? n - i : 256;
            to_f32(isa, tmp, src_dt, (const uint16_t *)src + i, m);
            from_f32(isa, dst_dt, (uint16_t *)dst + i, tmp, m);
        }
    }
}

void fl_convert(fl_dtype dst_dt, void *dst, fl_dtype src_dt, const void *src, size_t n) {
    convert(best_isa(), dst_dt, dst, src_dt, src, n);
}

// Rows a page or more apart (a head in a fused qkv buffer) defeat the
// hardware prefetcher, which follows a stream within a page: each row would
// wait on memory. The source rows a few ahead are fetched in software.
#define CONVERT_ROWS_AHEAD 8

void fl_convert_rows(fl_dtype dst_dt, void *dst, size_t ld_dst, fl_dtype src_dt, const void *src,
                     size_t ld_src, size_t rows, size_t cols) {
    int isa = best_isa();
    size_t row_bytes = cols * fl_dtype_size(src_dt);
    for (size_t r = 0; r < rows; r++) {
        if (r + CONVERT_ROWS_AHEAD < rows) {
            const char *ahead = fl_at_const(src_dt, src, (r + CONVERT_ROWS_AHEAD) * ld_src);
            for (size_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b);
        }
        convert(isa, dst_dt, fl_at(dst_dt, dst, r * ld_dst), src_dt,
                fl_at_const(src_dt, src, r * ld_src), cols);
    }
}

void fl_convert_isa(int isa, fl_dtype dst_dt, void *dst, fl_dtype src_dt, const void *src,
                    size_t n) {
    if (isa > best_isa()) fl_die("fl_convert: this CPU has no %s", fl_isa_name((fl_isa)isa));
    convert(isa, dst_dt, dst, src_dt, src, n);
}

const float *fl_load_f32(fl_dtype dt, const void *src, size_t n, float *scratch) {
    if (dt == FL_F32) return src;
    to_f32(best_isa(), scratch, dt, src, n);
    return scratch;
}

void fl_store_f32(fl_dtype dt, void *dst, const float *src, size_t n) {
    fl_convert(dt, dst, FL_F32, src, n);
}

// ----------------------------------------------------------------------------
// stochastic rounding

uint64_t fl_sr_bits(uint64_t seed, uint64_t index) {
    uint64_t z = seed + (index + 1) * 0x9e3779b97f4a7c15ull; // splitmix64, output `index`
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// bf16: adding 16 random bits below the kept ones carries into them with
// probability (dropped bits) / 2^16, then truncation. inf (dropped bits 0)
// stays inf; the largest finite values may carry into inf.
static uint16_t bf16_stochastic(float x, uint64_t bits) {
    uint32_t u = bits_of(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); // quiet NaN
    if ((u & 0x7fffffffu) == 0x7f800000u) return (uint16_t)(u >> 16);         // inf
    return (uint16_t)((u + (uint32_t)(bits & 0xffffu)) >> 16);
}

// fp16: the magnitude truncated to fp16 and the next fp16 value up; up with
// probability (|x| - below) / (above - below).
static uint16_t f16_stochastic(float x, uint64_t bits) {
    uint32_t u = bits_of(x), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return fl_f32_to_f16(x);            // NaN: as rounded to nearest
    if (a >= 0x47800000u) return (uint16_t)(sign | 0x7c00u); // >= 65536 (and inf): inf
    if (a < 0x38800000u) {
        // subnormal or zero in fp16: units of 2^-24 (exact), the fraction
        // above the lower neighbour against 32 random bits
        float f = float_of(a) * 16777216.0f, lo = floorf(f);
        double frac = (double)(f - lo); // exact: f < 2^10
        uint32_t h = (uint32_t)lo + ((double)(uint32_t)bits < frac * 4294967296.0);
        return (uint16_t)(sign | h);
    }
    // normal: rebias the exponent (127 -> 15), add 13 random bits under the
    // 13 dropped ones and truncate (65504 < |x| < 65536 may carry into inf)
    uint32_t r = a - (112u << 23) + (uint32_t)(bits & 0x1fffu);
    return (uint16_t)(sign | (r >> 13));
}

void fl_store_f32_stochastic(fl_dtype dt, void *dst, const float *src, size_t n, uint64_t seed,
                             uint64_t first_index) {
    uint16_t *h = dst;
    if (dt == FL_F32)
        memmove(dst, src, n * sizeof(float));
    else if (dt == FL_BF16)
        for (size_t i = 0; i < n; i++)
            h[i] = bf16_stochastic(src[i], fl_sr_bits(seed, first_index + i));
    else
        for (size_t i = 0; i < n; i++)
            h[i] = f16_stochastic(src[i], fl_sr_bits(seed, first_index + i));
}

void fl_accumulate_f32(fl_dtype dt, void *dst, const float *src, size_t n) {
    if (dt == FL_F32) {
        float *d = dst;
        for (size_t i = 0; i < n; i++) d[i] += src[i];
        return;
    }
    float tmp[256];
    int isa = best_isa();
    for (size_t i = 0; i < n; i += 256) {
        size_t m = n - i < 256 ? n - i : 256;
        uint16_t *d = (uint16_t *)dst + i;
        to_f32(isa, tmp, dt, d, m);
        for (size_t k = 0; k < m; k++) tmp[k] += src[i + k];
        from_f32(isa, dt, d, tmp, m);
    }
}

int fl_has_inf_or_nan(fl_dtype dt, const void *x, size_t n) {
    int bad = 0;
    if (dt == FL_F32) {
        const uint32_t *u = x;
#pragma omp parallel for reduction(| : bad) schedule(static)
        for (size_t i = 0; i < n; i++) bad |= (u[i] & 0x7f800000u) == 0x7f800000u;
    } else {
        const uint16_t *h = x;
        uint16_t mask = dt == FL_BF16 ? 0x7f80u : 0x7c00u;
#pragma omp parallel for reduction(| : bad) schedule(static)
        for (size_t i = 0; i < n; i++) bad |= (h[i] & mask) == mask;
    }
    return bad;
}
