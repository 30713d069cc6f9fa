// bench_matmul.c: milliseconds of a linear layer's three GEMMs (forward with
// bias, dinp, dweight) at the GPT-2 124M shapes through matmul_forward and
// matmul_backward (src/kernels/matmul.c) in fp32, bf16 and fp16, and the
// 16-bit times relative to fp32's. Whichever path the CPU (capped by
// FITLM_ISA) takes runs: OpenBLAS sgemm for fp32, oneDNN for bf16 with
// AVX512_BF16 or AMX, else the conversion to fp32 around sgemm. Median of
// REPS runs after one warm-up; gradients accumulate across runs, which does
// not matter here.
// usage: bench_matmul [N [threads]] (default N = B*T = 2048, 2 threads).
// ONEDNN_VERBOSE=1 in the environment shows the oneDNN implementation picked.
#include "fitlm/core.h"
#include "fitlm/kernels.h"

#include "../src/kernels/matmul_dnnl.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

enum { REPS = 5 };

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// median seconds of REPS runs of a statement, after one warm-up run
#define TIME(stmt)                                                                                 \
    ({                                                                                             \
        double t_[REPS];                                                                           \
        stmt;                                                                                      \
        for (int r_ = 0; r_ < REPS; r_++) {                                                        \
            double t0_ = fl_now();                                                                 \
            stmt;                                                                                  \
            t_[r_] = fl_now() - t0_;                                                               \
        }                                                                                          \
        qsort(t_, REPS, sizeof t_[0], cmp_double);                                                 \
        t_[REPS / 2];                                                                              \
    })

// n values uniform in [-1, 1) stored in dtype dt
static void *buf(fl_dtype dt, size_t n, uint64_t seed) {
    float *f = fl_alloc(FL_MEM_OTHER, n * sizeof(float));
    fl_rng rng;
    fl_rng_seed(&rng, seed);
    for (size_t i = 0; i < n; i++) f[i] = 2.0f * fl_rng_uniform(&rng) - 1.0f;
    void *x = fl_alloc(FL_MEM_OTHER, n * fl_dtype_size(dt));
    fl_store_f32(dt, x, f, n);
    fl_free(f);
    return x;
}

enum { GEMM_FWD, GEMM_DINP, GEMM_DWEIGHT, NGEMMS };

// median seconds of each GEMM of one layer in dtype dt; *ws_bytes: its workspace
static void time_layer(fl_dtype dt, int N, int C, int OC, uint64_t seed, double t[NGEMMS],
                       size_t *ws_bytes) {
    size_t nx = (size_t)N * C, nw = (size_t)OC * C, ny = (size_t)N * OC;
    void *x = buf(dt, nx, seed + 1), *w = buf(dt, nw, seed + 2), *b = buf(dt, OC, seed + 3);
    void *dy = buf(dt, ny, seed + 4), *y = buf(dt, ny, seed + 5), *dx = buf(dt, nx, seed + 6);
    void *dw = buf(dt, nw, seed + 7);
    *ws_bytes = matmul_workspace_bytes(dt, N, C, OC);
    void *ws = *ws_bytes ? fl_alloc(FL_MEM_WORKSPACE, *ws_bytes) : NULL;
    t[GEMM_FWD] = TIME(matmul_forward(dt, y, x, w, b, ws, N, C, OC));
    t[GEMM_DINP] = TIME(matmul_backward(dt, dx, NULL, NULL, dy, x, w, ws, N, C, OC));
    t[GEMM_DWEIGHT] = TIME(matmul_backward(dt, NULL, dw, NULL, dy, x, w, ws, N, C, OC));
    fl_free(x), fl_free(w), fl_free(b), fl_free(dy), fl_free(y), fl_free(dx), fl_free(dw);
    if (ws) fl_free(ws);
}

int main(int argc, char **argv) {
    int N = argc > 1 ? atoi(argv[1]) : 2048, threads = argc > 2 ? atoi(argv[2]) : 2;
    if (N < 1) fl_die("usage: bench_matmul [N [threads]]");
    fl_set_threads(threads);
    printf("N=%d, %d threads, ISA %s, oneDNN bf16 %s; median of %d after a warm-up\n", N,
           fl_threads(), fl_isa_name(fl_cpu_isa()), dnnl_matmul_supported(FL_BF16) ? "yes" : "no",
           REPS);
    printf("%-20s %-8s %21s %9s %8s %9s %6s %9s %6s %9s %9s\n", "layer", "GEMM", "M x K x N",
           "fp32 ms", "GFLOP/s", "bf16 ms", "x fp32", "fp16 ms", "x fp32", "bf16 ws", "fp16 ws");

    const struct {
        const char *name;
        int C, OC;
    } layers[] = {{"attn qkv", 768, 2304},
                  {"attn proj", 768, 768},
                  {"mlp fc", 768, 3072},
                  {"mlp proj", 3072, 768},
                  {"lm head", 768, 50304}};
    static const char *const gemm_names[NGEMMS] = {"forward", "dinp", "dweight"};
    double total[3] = {0};
    for (size_t l = 0; l < sizeof layers / sizeof layers[0]; l++) {
        int C = layers[l].C, OC = layers[l].OC;
        const fl_dtype dts[3] = {FL_F32, FL_BF16, FL_F16};
        double t[3][NGEMMS];
        size_t ws[3];
        for (int d = 0; d < 3; d++) time_layer(dts[d], N, C, OC, 100 * l, t[d], &ws[d]);
        // (M, K, N) of each GEMM as a product (M x K) @ (K x N)
        const int shape[NGEMMS][3] = {{N, C, OC}, {N, OC, C}, {OC, N, C}};
        for (int g = 0; g < NGEMMS; g++) {
            char name[32] = "";
            if (g == 0) snprintf(name, sizeof name, "%s %d->%d", layers[l].name, C, OC);
            double gflop = 2.0 * shape[g][0] * shape[g][1] * shape[g][2] * 1e-9;
            printf("%-20s %-8s %5d x %5d x %5d %9.2f %8.1f %9.2f %6.2f %9.2f %6.2f", name,
                   gemm_names[g], shape[g][0], shape[g][1], shape[g][2], 1e3 * t[0][g],
                   gflop / t[0][g], 1e3 * t[1][g], t[1][g] / t[0][g], 1e3 * t[2][g],
                   t[2][g] / t[0][g]);
            if (g == 0) printf(" %7.1f M %7.1f M", ws[1] / 1048576.0, ws[2] / 1048576.0);
            printf("\n");
            for (int d = 0; d < 3; d++) total[d] += t[d][g];
        }
        fflush(stdout);
    }
    printf("%-20s %-8s %21s %9.2f %8s %9.2f %6.2f %9.2f %6.2f\n", "all", "", "", 1e3 * total[0], "",
           1e3 * total[1], total[1] / total[0], 1e3 * total[2], total[2] / total[0]);
    dnnl_matmul_release();
    return 0;
}
