// fma_peak.h: the machine's peak fp32 multiply-add rate, measured with
// independent FMA chains that live in registers (no memory traffic), so the
// result is the arithmetic ceiling that MFU is quoted against.
//
// Shared by bench/peak_fma.c (the program) and bench/bench_train.c (which
// measures the peak itself when none is passed in). Header-only and static,
// because CMake turns every bench/*.c into its own executable.
//
// The instruction set is chosen at run time from fl_cpu(): AVX-512F (16
// lanes), else AVX2+FMA (8 lanes), else portable C (scalar multiply-add,
// whatever the compiler makes of it). FITLM_NO_SIMD=1 forces the portable
// path, as for the engine's kernels.
#ifndef FITLM_BENCH_FMA_PEAK_H
#define FITLM_BENCH_FMA_PEAK_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "fitlm/core.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// Independent accumulators per thread: FMA latency 4 cycles x 2 FMA ports
// needs >= 8 in flight; 12 leaves headroom and still fits in 32 registers.
#define FMA_PEAK_CHAINS 12

// acc = acc * a + b converges to b / (1 - a) ~ 1: no overflow, no denormals.
#define FMA_PEAK_A 0.9999999f
#define FMA_PEAK_B 1e-7f

#if defined(__x86_64__)
__attribute__((target("avx512f"))) static float fma_peak_run_avx512(int64_t iters) {
    __m512 a = _mm512_set1_ps(FMA_PEAK_A), b = _mm512_set1_ps(FMA_PEAK_B);
    __m512 c0 = _mm512_set1_ps(0.1f), c1 = _mm512_set1_ps(0.2f), c2 = _mm512_set1_ps(0.3f),
           c3 = _mm512_set1_ps(0.4f), c4 = _mm512_set1_ps(0.5f), c5 = _mm512_set1_ps(0.6f),
           c6 = _mm512_set1_ps(0.7f), c7 = _mm512_set1_ps(0.8f), c8 = _mm512_set1_ps(0.9f),
           c9 = _mm512_set1_ps(1.0f), c10 = _mm512_set1_ps(1.1f), c11 = _mm512_set1_ps(1.2f);
    for (int64_t i = 0; i < iters; i++) {
        c0 = _mm512_fmadd_ps(c0, a, b);
        c1 = _mm512_fmadd_ps(c1, a, b);
        c2 = _mm512_fmadd_ps(c2, a, b);
        c3 = _mm512_fmadd_ps(c3, a, b);
        c4 = _mm512_fmadd_ps(c4, a, b);
        c5 = _mm512_fmadd_ps(c5, a, b);
        c6 = _mm512_fmadd_ps(c6, a, b);
        c7 = _mm512_fmadd_ps(c7, a, b);
        c8 = _mm512_fmadd_ps(c8, a, b);
        c9 = _mm512_fmadd_ps(c9, a, b);
        c10 = _mm512_fmadd_ps(c10, a, b);
        c11 = _mm512_fmadd_ps(c11, a, b);
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                             _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(c8, c9), _mm512_add_ps(c10, c11)));
    return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx2,fma"))) static float fma_peak_run_avx2(int64_t iters) {
    __m256 a = _mm256_set1_ps(FMA_PEAK_A), b = _mm256_set1_ps(FMA_PEAK_B);
    __m256 c0 = _mm256_set1_ps(0.1f), c1 = _mm256_set1_ps(0.2f), c2 = _mm256_set1_ps(0.3f),
           c3 = _mm256_set1_ps(0.4f), c4 = _mm256_set1_ps(0.5f), c5 = _mm256_set1_ps(0.6f),
           c6 = _mm256_set1_ps(0.7f), c7 = _mm256_set1_ps(0.8f), c8 = _mm256_set1_ps(0.9f),
           c9 = _mm256_set1_ps(1.0f), c10 = _mm256_set1_ps(1.1f), c11 = _mm256_set1_ps(1.2f);
    for (int64_t i = 0; i < iters; i++) {
        c0 = _mm256_fmadd_ps(c0, a, b);
        c1 = _mm256_fmadd_ps(c1, a, b);
        c2 = _mm256_fmadd_ps(c2, a, b);
        c3 = _mm256_fmadd_ps(c3, a, b);
        c4 = _mm256_fmadd_ps(c4, a, b);
        c5 = _mm256_fmadd_ps(c5, a, b);
        c6 = _mm256_fmadd_ps(c6, a, b);
        c7 = _mm256_fmadd_ps(c7, a, b);
        c8 = _mm256_fmadd_ps(c8, a, b);
        c9 = _mm256_fmadd_ps(c9, a, b);
        c10 = _mm256_fmadd_ps(c10, a, b);
        c11 = _mm256_fmadd_ps(c11, a, b);
    }
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(c0, c1), _mm256_add_ps(c2, c3)),
                             _mm256_add_ps(_mm256_add_ps(c4, c5), _mm256_add_ps(c6, c7)));
    s = _mm256_add_ps(s, _mm256_add_ps(_mm256_add_ps(c8, c9), _mm256_add_ps(c10, c11)));
    float lanes[8];
    _mm256_storeu_ps(lanes, s);
    float sum = 0.0f;
    for (int i = 0; i < 8; i++) sum += lanes[i];
    return sum;
}
#endif

// Portable: 8 lanes x FMA_PEAK_CHAINS independent chains of a*b+c (two
// flops each, whether or not the compiler fuses or vectorises them).
#define FMA_PEAK_PORTABLE_LANES 8
static float fma_peak_run_portable(int64_t iters) {
    float c[FMA_PEAK_CHAINS][FMA_PEAK_PORTABLE_LANES];
    for (int j = 0; j < FMA_PEAK_CHAINS; j++)
        for (int k = 0; k < FMA_PEAK_PORTABLE_LANES; k++) c[j][k] = 0.1f * (j + 1) + 0.01f * k;
    const float a = FMA_PEAK_A, b = FMA_PEAK_B;
    for (int64_t i = 0; i < iters; i++)
        for (int j = 0; j < FMA_PEAK_CHAINS; j++)
            for (int k = 0; k < FMA_PEAK_PORTABLE_LANES; k++) c[j][k] = c[j][k] * a + b;
    float sum = 0.0f;
    for (int j = 0; j < FMA_PEAK_CHAINS; j++)
        for (int k = 0; k < FMA_PEAK_PORTABLE_LANES; k++) sum += c[j][k];
    return sum;
}

typedef enum { FMA_PEAK_PORTABLE, FMA_PEAK_AVX2, FMA_PEAK_AVX512 } fma_peak_isa;

static fma_peak_isa fma_peak_pick_isa(void) {
#if defined(__x86_64__)
    const fl_cpu_features *f = fl_cpu();
    if (f->avx512f) return FMA_PEAK_AVX512;
    if (f->avx2 && f->fma) return FMA_PEAK_AVX2;
#endif
    return FMA_PEAK_PORTABLE;
}

static const char *fma_peak_isa_name(fma_peak_isa isa) {
    return isa == FMA_PEAK_AVX512 ? "avx512" : isa == FMA_PEAK_AVX2 ? "avx2" : "portable";
}

// Floating-point operations of one loop iteration (an FMA counts as two).
static double fma_peak_flops_per_iter(fma_peak_isa isa) {
    int lanes = isa == FMA_PEAK_AVX512 ? 16 : isa == FMA_PEAK_AVX2 ? 8 : FMA_PEAK_PORTABLE_LANES;
    return 2.0 * lanes * FMA_PEAK_CHAINS;
}

static volatile float fma_peak_sink; // keeps the results alive

static float fma_peak_run(fma_peak_isa isa, int64_t iters) {
#if defined(__x86_64__)
    if (isa == FMA_PEAK_AVX512) return fma_peak_run_avx512(iters);
    if (isa == FMA_PEAK_AVX2) return fma_peak_run_avx2(iters);
#endif
    (void)isa;
    return fma_peak_run_portable(iters);
}

// Wall time of every thread running `iters` iterations at once.
static double fma_peak_time(fma_peak_isa isa, int threads, int64_t iters) {
    double t0 = 0.0, t1 = 0.0;
#pragma omp parallel num_threads(threads)
    {
#pragma omp barrier
#pragma omp master
        t0 = fl_now();
        float r = fma_peak_run(isa, iters);
#pragma omp barrier
#pragma omp master
        {
            t1 = fl_now();
            fma_peak_sink = r;
        }
    }
    return t1 - t0;
}

static int fma_peak_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// GFLOP/s with `threads` threads: iterations calibrated so one measurement
// takes ~seconds_each, then the median of `reps` measurements. min/max (if
// not NULL) receive the slowest and fastest measurement's GFLOP/s.
static double fma_peak_gflops(fma_peak_isa isa, int threads, double seconds_each, int reps,
                              double *min_out, double *max_out) {
    int64_t iters = 1 << 16;
    double dt;
    while ((dt = fma_peak_time(isa, threads, iters)) < 0.05) iters *= 2; // also warms up
    iters = (int64_t)(iters * (seconds_each / dt));
    if (iters < 1) iters = 1;
    double *g = malloc(sizeof(double) * (size_t)reps);
    if (!g) fl_die("out of memory");
    double flops = fma_peak_flops_per_iter(isa) * (double)iters * threads;
    for (int r = 0; r < reps; r++) g[r] = flops / fma_peak_time(isa, threads, iters) / 1e9;
    qsort(g, (size_t)reps, sizeof(double), fma_peak_cmp_double);
    double med = reps % 2 ? g[reps / 2] : 0.5 * (g[reps / 2 - 1] + g[reps / 2]);
    if (min_out) *min_out = g[0];
    if (max_out) *max_out = g[reps - 1];
    free(g);
    return med;
}

#endif
