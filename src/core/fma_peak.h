// fma_peak.h: the machine's peak multiply-add rates, measured with
// independent chains that live in registers (no memory traffic), so the
// result is the arithmetic ceiling that MFU is quoted against.
//
// Shared by bench/peak_fma.c (the program) and bench/bench_train.c (which
// measures the peaks itself when none are passed in). Header-only and static,
// because CMake turns every bench/*.c into its own executable.
//
// Three peaks, each a "kernel" below:
//  - fp32 FMA: the instruction set is chosen at run time from fl_cpu():
//    AVX-512F (16 lanes), else AVX2+FMA (8 lanes), else portable C (scalar
//    multiply-add, whatever the compiler makes of it). FITLM_NO_SIMD=1 forces
//    the portable path, as for the engine's kernels.
//  - bf16 dot product: AVX512_BF16 vdpbf16ps (_mm512_dpbf16_ps), 16 fp32
//    lanes each accumulating the products of 2 bf16 pairs: 32 multiply-adds,
//    64 FLOPs per instruction.
//  - AMX-BF16 tiles: tdpbf16ps on 16x32 bf16 A and 32x16 (VNNI-packed) B
//    tiles into a 16x16 fp32 tile: 16*16*32 multiply-adds, 16384 FLOPs per
//    instruction. Needs the kernel's permission for the tile data
//    (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)), which
//    fma_peak_amx_available() asks for once.
#ifndef FITLM_BENCH_FMA_PEAK_H
#define FITLM_BENCH_FMA_PEAK_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <omp.h>

#include "fitlm/core.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <sys/syscall.h>
#endif

// Independent accumulators per thread: FMA latency 4 cycles x 2 FMA ports
// needs >= 8 in flight; 12 leaves headroom and still fits in 32 registers.
// The vdpbf16ps loop uses as many (24 chains measure the same rate here).
#define FMA_PEAK_CHAINS 12
// Accumulator tiles of the AMX loop (of 8 tile registers; the other 4 hold
// the inputs): tdpbf16ps issues about every 16 cycles, so 4 chains hide its
// latency.
#define FMA_PEAK_AMX_TILES 4

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

// vdpbf16ps: acc[i] += a[2i]*b[2i] + a[2i+1]*b[2i+1] over 16 lanes. With
// a = b = bf16 2^-8 every instruction adds 2^-15 to each lane: no overflow
// for any run this bench makes (a lane reaches 2^15 after 2^30 iterations).
__attribute__((target("avx512bf16,avx512f"))) static float fma_peak_run_bf16(int64_t iters) {
    __m512bh a = (__m512bh)_mm512_set1_epi16(0x3b80); // bf16 2^-8
    __m512 c0 = _mm512_set1_ps(0.1f), c1 = _mm512_set1_ps(0.2f), c2 = _mm512_set1_ps(0.3f),
           c3 = _mm512_set1_ps(0.4f), c4 = _mm512_set1_ps(0.5f), c5 = _mm512_set1_ps(0.6f),
           c6 = _mm512_set1_ps(0.7f), c7 = _mm512_set1_ps(0.8f), c8 = _mm512_set1_ps(0.9f),
           c9 = _mm512_set1_ps(1.0f), c10 = _mm512_set1_ps(1.1f), c11 = _mm512_set1_ps(1.2f);
    for (int64_t i = 0; i < iters; i++) {
        c0 = _mm512_dpbf16_ps(c0, a, a);
        c1 = _mm512_dpbf16_ps(c1, a, a);
        c2 = _mm512_dpbf16_ps(c2, a, a);
        c3 = _mm512_dpbf16_ps(c3, a, a);
        c4 = _mm512_dpbf16_ps(c4, a, a);
        c5 = _mm512_dpbf16_ps(c5, a, a);
        c6 = _mm512_dpbf16_ps(c6, a, a);
        c7 = _mm512_dpbf16_ps(c7, a, a);
        c8 = _mm512_dpbf16_ps(c8, a, a);
        c9 = _mm512_dpbf16_ps(c9, a, a);
        c10 = _mm512_dpbf16_ps(c10, a, a);
        c11 = _mm512_dpbf16_ps(c11, a, a);
    }
    __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(c0, c1), _mm512_add_ps(c2, c3)),
                             _mm512_add_ps(_mm512_add_ps(c4, c5), _mm512_add_ps(c6, c7)));
    s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(c8, c9), _mm512_add_ps(c10, c11)));
    return _mm512_reduce_add_ps(s);
}

// AMX: 4 independent accumulator tiles (tmm0-3, 16x16 fp32), two A tiles
// (tmm4-5, 16 rows x 32 bf16) and two B tiles (tmm6-7, 16 rows x 16 pairs),
// 4 tdpbf16ps per iteration (C[i][j] += A[i] B[j]). The tile configuration
// is per thread, so every thread loads it. Values as for vdpbf16ps: each
// instruction adds 32 * 2^-16 = 2^-11 to every element.
typedef struct {
    uint8_t palette_id, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} fma_peak_tilecfg;

__attribute__((target("amx-tile,amx-bf16"))) static float fma_peak_run_amx(int64_t iters) {
    fma_peak_tilecfg cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    uint16_t ab[16 * 32];
    for (int i = 0; i < 16 * 32; i++) ab[i] = 0x3b80; // bf16 2^-8
    float out[16 * 16];
    _tile_loadconfig(&cfg);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, ab, 64);
    _tile_loadd(5, ab, 64);
    _tile_loadd(6, ab, 64);
    _tile_loadd(7, ab, 64);
    for (int64_t i = 0; i < iters; i++) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    float sum = 0.0f;
    _tile_stored(0, out, 64);
    sum += out[0];
    _tile_stored(1, out, 64);
    sum += out[17];
    _tile_stored(2, out, 64);
    sum += out[34];
    _tile_stored(3, out, 64);
    sum += out[255];
    _tile_release();
    return sum;
}
#endif

// Asks the kernel, once per process, for the AMX tile data state; 1 when
// the CPU has AMX-BF16 (and FITLM_NO_SIMD is unset) and the kernel allows it.
static int fma_peak_amx_available(void) {
#if defined(__x86_64__) && defined(SYS_arch_prctl)
    static int state = -1;
    if (state < 0) {
        state = 0;
        if (fl_cpu()->amx_bf16)
            state = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */,
                            18 /* XFEATURE_XTILEDATA */) == 0;
    }
    return state;
#else
    return 0;
#endif
}

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

// What a measurement runs: the fp32 FMA loop of one instruction set, the
// AVX512_BF16 dot-product loop, or the AMX-BF16 tile loop.
typedef enum {
    FMA_PEAK_PORTABLE,
    FMA_PEAK_AVX2,
    FMA_PEAK_AVX512,
    FMA_PEAK_BF16_DP, // vdpbf16ps
    FMA_PEAK_AMX_BF16 // tdpbf16ps
} fma_peak_isa;

// The fp32 FMA loop for this CPU.
static fma_peak_isa fma_peak_pick_isa(void) {
#if defined(__x86_64__)
    const fl_cpu_features *f = fl_cpu();
    if (f->avx512f) return FMA_PEAK_AVX512;
    if (f->avx2 && f->fma) return FMA_PEAK_AVX2;
#endif
    return FMA_PEAK_PORTABLE;
}

// Whether the CPU can run a loop (AMX: also asks the kernel for the tiles).
static int fma_peak_has(fma_peak_isa isa) {
    const fl_cpu_features *f = fl_cpu();
    switch (isa) {
    case FMA_PEAK_PORTABLE:
        return 1;
    case FMA_PEAK_AVX2:
        return f->avx2 && f->fma;
    case FMA_PEAK_AVX512:
        return f->avx512f;
    case FMA_PEAK_BF16_DP:
        return f->avx512f && f->avx512_bf16;
    case FMA_PEAK_AMX_BF16:
        return fma_peak_amx_available();
    }
    return 0;
}

static const char *fma_peak_isa_name(fma_peak_isa isa) {
    switch (isa) {
    case FMA_PEAK_AVX512:
        return "avx512";
    case FMA_PEAK_AVX2:
        return "avx2";
    case FMA_PEAK_BF16_DP:
        return "avx512bf16";
    case FMA_PEAK_AMX_BF16:
        return "amx";
    default:
        return "portable";
    }
}

// Floating-point operations of one loop iteration (a multiply-add counts as
// two): per chain, 2 x 16 lanes (AVX-512), x 8 (AVX2), x 8 (portable), 2 x
// 32 (vdpbf16ps: 16 lanes x 2 bf16 products); per AMX tile 2 x 16*16*32.
static double fma_peak_flops_per_iter(fma_peak_isa isa) {
    switch (isa) {
    case FMA_PEAK_AVX512:
        return 2.0 * 16 * FMA_PEAK_CHAINS;
    case FMA_PEAK_AVX2:
        return 2.0 * 8 * FMA_PEAK_CHAINS;
    case FMA_PEAK_BF16_DP:
        return 2.0 * 32 * FMA_PEAK_CHAINS;
    case FMA_PEAK_AMX_BF16:
        return 2.0 * 16 * 16 * 32 * FMA_PEAK_AMX_TILES;
    default:
        return 2.0 * FMA_PEAK_PORTABLE_LANES * FMA_PEAK_CHAINS;
    }
}

static volatile float fma_peak_sink; // keeps the results alive

static float fma_peak_run(fma_peak_isa isa, int64_t iters) {
#if defined(__x86_64__)
    if (isa == FMA_PEAK_AVX512) return fma_peak_run_avx512(iters);
    if (isa == FMA_PEAK_AVX2) return fma_peak_run_avx2(iters);
    if (isa == FMA_PEAK_BF16_DP) return fma_peak_run_bf16(iters);
    if (isa == FMA_PEAK_AMX_BF16) return fma_peak_run_amx(iters);
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
    // a third of a measurement (at most 0.05 s) is long enough to time, and
    // the doubling rounds before it (as long again) warm the units up: a
    // run's start-up measurement (0.03 s) takes about 0.05 s in all
    double calibrate = seconds_each / 3 < 0.05 ? seconds_each / 3 : 0.05;
    while ((dt = fma_peak_time(isa, threads, iters)) < calibrate) iters *= 2;
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
