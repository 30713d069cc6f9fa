// bench_matmul.c: milliseconds of a linear layer's three GEMMs (forward with
// bias, dinp, dweight) at the GPT-2 124M shapes through matmul_forward and
// matmul_backward (src/kernels/matmul.c) in fp32, bf16 and fp16, and the
// 16-bit times relative to fp32's. Whichever path the CPU (capped by
// FITLM_ISA) takes runs: OpenBLAS sgemm for fp32, oneDNN for bf16 with
// AVX512_BF16 or AMX, else the conversion to fp32 around sgemm. The fastest of REPS
// runs after one warm-up, the dtypes taking turns: on a shared machine the
// minimum is the figure other load disturbs least. Gradients accumulate
// across runs, which does not matter here.
// usage: bench_matmul [N [threads]] (default N = B*T = 2048, 2 threads).
// ONEDNN_VERBOSE=1 in the environment shows the oneDNN implementation picked.
#include "fitlm/core.h"
#include "fitlm/kernels.h"

#include "../src/kernels/matmul_dnnl.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

enum { REPS = 7, NDTYPES = 3 };

static const fl_dtype dtypes[NDTYPES] = {FL_F32, FL_BF16, FL_F16};

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

// one layer's operands in one dtype
typedef struct {
    void *x, *w, *b, *dy, *y, *dx, *dw, *ws;
    size_t ws_bytes;
} operands;

static operands operands_new(fl_dtype dt, int N, int C, int OC, uint64_t seed) {
    size_t nx = (size_t)N * C, nw = (size_t)OC * C, ny = (size_t)N * OC;
    operands o = {buf(dt, nx, seed + 1),
                  buf(dt, nw, seed + 2),
                  buf(dt, OC, seed + 3),
                  buf(dt, ny, seed + 4),
                  buf(dt, ny, seed + 5),
                  buf(dt, nx, seed + 6),
                  buf(dt, nw, seed + 7),
                  NULL,
                  matmul_workspace_bytes(dt, N, C, OC)};
    if (o.ws_bytes) o.ws = fl_alloc(FL_MEM_WORKSPACE, o.ws_bytes);
    return o;
}

static void operands_free(operands *o) {
    fl_free(o->x), fl_free(o->w), fl_free(o->b), fl_free(o->dy), fl_free(o->y), fl_free(o->dx);
    fl_free(o->dw);
    if (o->ws) fl_free(o->ws);
}

enum { GEMM_FWD, GEMM_DINP, GEMM_DWEIGHT, NGEMMS };

// seconds of one run of GEMM g on o
static double run_gemm(int g, fl_dtype dt, const operands *o, int N, int C, int OC) {
    double t0 = fl_now();
    if (g == GEMM_FWD)
        matmul_forward(dt, o->y, o->x, o->w, o->b, o->ws, N, C, OC);
    else if (g == GEMM_DINP)
        matmul_backward(dt, o->dx, NULL, NULL, o->dy, o->x, o->w, o->ws, N, C, OC);
    else
        matmul_backward(dt, NULL, o->dw, NULL, o->dy, o->x, o->w, o->ws, N, C, OC);
    return fl_now() - t0;
}

int main(int argc, char **argv) {
    fl_runtime_env(argv);
    int N = argc > 1 ? atoi(argv[1]) : 2048, threads = argc > 2 ? atoi(argv[2]) : 2;
    if (N < 1) fl_die("usage: bench_matmul [N [threads]]");
    fl_set_threads(threads);
    printf("N=%d, %d threads, ISA %s, oneDNN bf16 %s; fastest of %d after a warm-up\n", N,
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
    double total[NDTYPES] = {0};
    for (size_t l = 0; l < sizeof layers / sizeof layers[0]; l++) {
        int C = layers[l].C, OC = layers[l].OC;
        operands o[NDTYPES];
        for (int d = 0; d < NDTYPES; d++) o[d] = operands_new(dtypes[d], N, C, OC, 100 * l);
        // (M, K, N) of each GEMM as a product (M x K) @ (K x N)
        const int shape[NGEMMS][3] = {{N, C, OC}, {N, OC, C}, {OC, N, C}};
        for (int g = 0; g < NGEMMS; g++) {
            // the dtypes take turns, so a burst of load elsewhere hits all of them
            double t[NDTYPES];
            for (int d = 0; d < NDTYPES; d++) t[d] = run_gemm(g, dtypes[d], &o[d], N, C, OC);
            for (int r = 0; r < REPS; r++)
                for (int d = 0; d < NDTYPES; d++) {
                    double s = run_gemm(g, dtypes[d], &o[d], N, C, OC);
                    if (r == 0 || s < t[d]) t[d] = s;
                }
            char name[32] = "";
            if (g == 0) snprintf(name, sizeof name, "%s %d->%d", layers[l].name, C, OC);
            double gflop = 2.0 * shape[g][0] * shape[g][1] * shape[g][2] * 1e-9;
            printf("%-20s %-8s %5d x %5d x %5d %9.2f %8.1f %9.2f %6.2f %9.2f %6.2f", name,
                   gemm_names[g], shape[g][0], shape[g][1], shape[g][2], 1e3 * t[0], gflop / t[0],
                   1e3 * t[1], t[1] / t[0], 1e3 * t[2], t[2] / t[0]);
            if (g == 0)
                printf(" %7.1f M %7.1f M", o[1].ws_bytes / 1048576.0, o[2].ws_bytes / 1048576.0);
            printf("\n");
            fflush(stdout);
            for (int d = 0; d < NDTYPES; d++) total[d] += t[d];
        }
        for (int d = 0; d < NDTYPES; d++) operands_free(&o[d]);
    }
    printf("%-20s %-8s %21s %9.2f %8s %9.2f %6.2f %9.2f %6.2f\n", "all", "", "", 1e3 * total[0], "",
           1e3 * total[1], total[1] / total[0], 1e3 * total[2], total[2] / total[0]);
    dnnl_matmul_release();
    return 0;
}
