// peak_fma.c: this machine's peak fp32 FMA rate with 1 and 2 (or --threads
// N) threads, the denominator of every MFU figure in bench/.
//
//   peak_fma [--threads N] [--seconds S] [--reps R]
//
// Each measurement runs FMA_PEAK_CHAINS independent register-resident FMA
// chains per thread for ~S seconds (default 0.5); the figure is the median
// of R (default 5) measurements. The ISA is picked at run time (AVX-512F,
// else AVX2+FMA, else portable C; FITLM_NO_SIMD=1 forces portable).
//
// Prints a human-readable line per thread count, then one machine-readable
// line:  RESULT peak_fma isa=avx512 gflops_1t=... gflops_2t=... peak_gflops=...
// where peak_gflops is the figure at the largest thread count measured.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/core.h"
#include "fma_peak.h"

static void usage(FILE *out) {
    fprintf(out, "usage: peak_fma [--threads N] [--seconds S] [--reps R]\n"
                 "  measures peak fp32 FMA GFLOP/s with 1..N threads (default N = 2)\n");
}

int main(int argc, char **argv) {
    int max_threads = 2, reps = 5;
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
        else {
            usage(stderr);
            fl_die("unknown option %s", a);
        }
    }
    if (max_threads < 1 || reps < 1 || !(seconds > 0.0))
        fl_die("--threads and --reps must be >= 1 and --seconds > 0");

    fma_peak_isa isa = fma_peak_pick_isa();
    printf("peak fp32 FMA: isa %s, %d chains x %.0f flops/iteration/thread, ~%.2f s x %d reps "
           "(median)\n",
           fma_peak_isa_name(isa), FMA_PEAK_CHAINS, fma_peak_flops_per_iter(isa), seconds, reps);
    double g1 = 0.0, g2 = 0.0, glast = 0.0;
    for (int t = 1; t <= max_threads; t++) {
        double lo, hi;
        double g = fma_peak_gflops(isa, t, seconds, reps, &lo, &hi);
        printf("  %d thread%s: %8.1f GFLOP/s (min %.1f, max %.1f; %.1f per thread)\n", t,
               t == 1 ? " " : "s", g, lo, hi, g / t);
        fflush(stdout);
        if (t == 1) g1 = g;
        if (t == 2) g2 = g;
        glast = g;
    }
    printf("RESULT peak_fma isa=%s threads=%d gflops_1t=%.1f", fma_peak_isa_name(isa), max_threads,
           g1);
    if (max_threads >= 2) printf(" gflops_2t=%.1f", g2);
    printf(" peak_gflops=%.1f\n", glast);
    return 0;
}
