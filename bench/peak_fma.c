// peak_fma.c: this machine's peak multiply-add rates with 1 and 2 (or
// --threads N) threads, the denominators of the MFU figures in bench/: fp32
// FMA (fp32 training), the AVX512_BF16 dot product vdpbf16ps (bf16/fp16
// training) and, where the CPU and kernel allow it, AMX-BF16 tiles; and the
// memory bandwidth of a read-modify-write stream, the roofline of the
// optimizer's update (AdamW reads the weights, gradients and both moments and
// writes back all but the gradients, each line where it was read).
//
//   peak_fma [--threads N] [--seconds S] [--reps R] [--bf16 0|1] [--amx 0|1]
//            [--bandwidth 0|1]
//
// Each measurement runs independent register-resident chains per thread
// (fma_peak.h) for ~S seconds (default 0.5); the figure is the median of R
// (default 5) measurements. The fp32 ISA is picked at run time (AVX-512F,
// else AVX2+FMA, else portable C; FITLM_NO_SIMD=1 forces portable); the bf16
// and AMX peaks are measured only when the CPU has them (--bf16 0 / --amx 0
// skip them).
//
// Prints a human-readable line per peak and thread count, then one
// machine-readable line:
//   RESULT peak_fma isa=avx512 threads=2 gflops_1t=... gflops_2t=...
//     peak_gflops=... bf16_isa=avx512bf16 bf16_gflops_1t=... bf16_gflops_2t=...
//     bf16_peak_gflops=... amx_gflops_1t=... amx_gflops_2t=... amx_peak_gflops=...
//     bw_gbs_1t=... bw_gbs_2t=... bw_peak_gbs=...
// where *peak_gflops is the figure at the largest thread count measured and
// bw_peak_gbs the highest over the thread counts (one thread may already
// saturate the memory); the bf16_, amx_ and bw_ fields are absent when that
// peak was not measured.
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/core.h"
#include "fma_peak.h"

static void usage(FILE *out) {
    fprintf(out, "usage: peak_fma [--threads N] [--seconds S] [--reps R] [--bf16 0|1] [--amx 0|1]\n"
                 "                [--bandwidth 0|1]\n"
                 "  measures peak fp32 FMA, bf16 dot-product (vdpbf16ps) and AMX-BF16 GFLOP/s\n"
                 "  and the memory bandwidth of a read-modify-write stream, with 1..N threads\n"
                 "  (default N = 2)\n");
}

// Measures one loop with 1..max_threads threads; prints a line per thread
// count and appends " <prefix>gflops_1t=... <prefix>peak_gflops=..." to res.
static void measure(fma_peak_isa isa, const char *what, const char *prefix, int max_threads,
                    double seconds, int reps, char *res, size_t res_size) {
    printf("peak %s: %s, %.0f flops/iteration/thread, ~%.2f s x %d reps (median)\n", what,
           fma_peak_isa_name(isa), fma_peak_flops_per_iter(isa), seconds, reps);
    double glast = 0.0;
    for (int t = 1; t <= max_threads; t++) {
        double lo, hi;
        double g = fma_peak_gflops(isa, t, seconds, reps, &lo, &hi);
        printf("  %d thread%s: %8.1f GFLOP/s (min %.1f, max %.1f; %.1f per thread)\n", t,
               t == 1 ? " " : "s", g, lo, hi, g / t);
        fflush(stdout);
        size_t n = strlen(res);
        if (t <= 2) snprintf(res + n, res_size - n, " %sgflops_%dt=%.1f", prefix, t, g);
        glast = g;
    }
    size_t n = strlen(res);
    snprintf(res + n, res_size - n, " %speak_gflops=%.1f", prefix, glast);
}

// The stream: x = 0.5 x + y over two arrays far larger than any cache, each
// thread on its own contiguous part, as the optimizer's update splits its
// range. Counted bytes are those that move: 8 read and 4 written per
// element (x's lines are written where they were read, so no extra read
// for ownership).
#define BW_FLOATS ((size_t)64 << 20) // 256 MiB per array

static double stream_pass(float *x, const float *y, int threads) {
    double t0 = fl_now();
#pragma omp parallel for schedule(static) num_threads(threads)
    for (size_t i = 0; i < BW_FLOATS; i++) x[i] = 0.5f * x[i] + y[i];
    return fl_now() - t0;
}

static void measure_bandwidth(int max_threads, int reps, char *res, size_t res_size) {
    printf("memory bandwidth: x = 0.5 x + y over 2 x %zu MiB, 12 bytes moved per element, "
           "%d reps (median)\n",
           BW_FLOATS * sizeof(float) >> 20, reps);
    float *x = fl_alloc(FL_MEM_OTHER, BW_FLOATS * sizeof(float));
    float *y = fl_alloc(FL_MEM_OTHER, BW_FLOATS * sizeof(float));
    // first touch by the threads that stream them
#pragma omp parallel for schedule(static) num_threads(max_threads)
    for (size_t i = 0; i < BW_FLOATS; i++) x[i] = 0.0f, y[i] = 1.0f;
    double *gbs = fl_alloc(FL_MEM_OTHER, (size_t)reps * sizeof(double)), gmax = 0.0;
    for (int t = 1; t <= max_threads; t++) {
        stream_pass(x, y, t); // warm-up
        for (int r = 0; r < reps; r++) gbs[r] = 12.0 * BW_FLOATS / stream_pass(x, y, t) / 1e9;
        qsort(gbs, (size_t)reps, sizeof(double), fma_peak_cmp_double);
        double g = gbs[reps / 2];
        printf("  %d thread%s: %8.1f GB/s (min %.1f, max %.1f)\n", t, t == 1 ? " " : "s", g, gbs[0],
               gbs[reps - 1]);
        fflush(stdout);
        size_t n = strlen(res);
        if (t <= 2) snprintf(res + n, res_size - n, " bw_gbs_%dt=%.1f", t, g);
        if (g > gmax) gmax = g;
    }
    size_t n = strlen(res);
    snprintf(res + n, res_size - n, " bw_peak_gbs=%.1f", gmax);
    fl_free(gbs);
    fl_free(y);
    fl_free(x);
}

int main(int argc, char **argv) {
    int max_threads = 2, reps = 5, bf16 = 1, amx = 1, bandwidth = 1;
    double seconds = 0.5;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        }
        if (i + 1 >= argc) {
            usage(stderr);
            fl_die("option %s needs a value", a);
        }
        const char *v = argv[++i];
        if (!strcmp(a, "--threads"))
            max_threads = atoi(v);
        else if (!strcmp(a, "--seconds"))
            seconds = atof(v);
        else if (!strcmp(a, "--reps"))
            reps = atoi(v);
        else if (!strcmp(a, "--bf16"))
            bf16 = atoi(v);
        else if (!strcmp(a, "--amx"))
            amx = atoi(v);
        else if (!strcmp(a, "--bandwidth"))
            bandwidth = atoi(v);
        else {
            usage(stderr);
            fl_die("unknown option %s", a);
        }
    }
    if (max_threads < 1 || reps < 1 || !(seconds > 0.0))
        fl_die("--threads and --reps must be >= 1 and --seconds > 0");

    char res[512];
    fma_peak_isa isa = fma_peak_pick_isa();
    snprintf(res, sizeof(res), "RESULT peak_fma isa=%s threads=%d", fma_peak_isa_name(isa),
             max_threads);
    measure(isa, "fp32 FMA", "", max_threads, seconds, reps, res, sizeof(res));
    if (bf16 && fma_peak_has(FMA_PEAK_BF16_DP)) {
        size_t n = strlen(res);
        snprintf(res + n, sizeof(res) - n, " bf16_isa=%s", fma_peak_isa_name(FMA_PEAK_BF16_DP));
        measure(FMA_PEAK_BF16_DP, "bf16 dot product", "bf16_", max_threads, seconds, reps, res,
                sizeof(res));
    } else if (bf16) {
        printf("peak bf16 dot product: no AVX512_BF16 on this CPU\n");
    }
    if (amx && fma_peak_has(FMA_PEAK_AMX_BF16))
        measure(FMA_PEAK_AMX_BF16, "AMX-BF16 tiles", "amx_", max_threads, seconds, reps, res,
                sizeof(res));
    else if (amx)
        printf("peak AMX-BF16: not available (CPU without AMX-BF16, or the kernel refused "
               "the tile state)\n");
    if (bandwidth) measure_bandwidth(max_threads, reps, res, sizeof(res));
    printf("%s\n", res);
    return 0;
}
