// bench_matmul.c: GFLOP/s of a linear layer's three GEMMs (forward, dinp,
// dweight) at the GPT-2 124M shapes: bf16 through oneDNN
// (src/kernels/matmul_dnnl.c) against fp32 through OpenBLAS sgemm, the way
// src/kernels/matmul.c calls it (forward: bias prefill, then sgemm with
// beta=1). Median of REPS runs after one warm-up; gradients accumulate
// across runs, which does not matter here.
// usage: bench_matmul [N [threads]] (default N = B*T = 2048, 2 threads).
// ONEDNN_VERBOSE=1 in the environment shows the oneDNN implementation picked.
#include "fitlm/core.h"

#include "../src/kernels/matmul_dnnl.h"

#include <cblas.h>
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

// n values uniform in [-1, 1): fp32, or bf16 when half is set
static void *buf(size_t n, int half, uint64_t seed) {
    void *x = fl_alloc(FL_MEM_OTHER, n * (half ? 2 : 4));
    fl_rng rng;
    fl_rng_seed(&rng, seed);
    for (size_t i = 0; i < n; i++) {
        float v = 2.0f * fl_rng_uniform(&rng) - 1.0f;
        if (half)
            ((uint16_t *)x)[i] = fl_f32_to_bf16(v);
        else
            ((float *)x)[i] = v;
    }
    return x;
}

// fp32 forward as in src/kernels/matmul.c: bias prefill, then sgemm adds
static void sgemm_forward(float *out, const float *inp, const float *weight, const float *bias,
                          int N, int C, int OC) {
#pragma omp parallel for
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) out[(size_t)n * OC + o] = bias[o];
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C, 1.0f,
                out, OC);
}

// one line of the table; ws (the oneDNN workspace) is printed when > 0
static void row(const char *layer, const char *op, int M, int K, int Nn, double t_bf16,
                double t_f32, size_t ws) {
    double gflop = 2.0 * M * K * Nn * 1e-9;
    printf("%-20s %-8s %5d x %5d x %5d %9.2f %8.1f %9.2f %8.1f %7.2fx", layer, op, M, K, Nn,
           1e3 * t_bf16, gflop / t_bf16, 1e3 * t_f32, gflop / t_f32, t_f32 / t_bf16);
    if (ws) printf(" %8.2f", ws / 1048576.0);
    printf("\n");
}

int main(int argc, char **argv) {
    int N = argc > 1 ? atoi(argv[1]) : 2048, threads = argc > 2 ? atoi(argv[2]) : 2;
    if (N < 1) fl_die("usage: bench_matmul [N [threads]]");
    fl_set_threads(threads);
    printf("N=%d, %d threads, avx512_bf16 %d, amx_bf16 %d; median of %d after a warm-up\n", N,
           fl_threads(), fl_cpu()->avx512_bf16, fl_cpu()->amx_bf16, REPS);
    if (!dnnl_matmul_supported(FL_BF16)) {
        printf("oneDNN bf16 matmul is not supported on this CPU: nothing to compare\n");
        return 0;
    }
    printf("%-20s %-8s %21s %9s %8s %9s %8s %8s %8s\n", "layer", "GEMM", "M x K x N", "bf16 ms",
           "GFLOP/s", "fp32 ms", "GFLOP/s", "speedup", "ws MiB");
    printf("%-20s %-8s %21s %18s %18s\n", "", "", "", "(oneDNN)", "(OpenBLAS)");

    const struct {
        const char *name;
        int C, OC;
    } layers[] = {{"attn qkv", 768, 2304},
                  {"attn proj", 768, 768},
                  {"mlp fc", 768, 3072},
                  {"mlp proj", 3072, 768},
                  {"lm head", 768, 50304}};
    for (size_t l = 0; l < sizeof layers / sizeof layers[0]; l++) {
        int C = layers[l].C, OC = layers[l].OC;
        size_t nx = (size_t)N * C, nw = (size_t)OC * C, ny = (size_t)N * OC;
        uint64_t s = 100 * l;
        uint16_t *x = buf(nx, 1, s + 1), *w = buf(nw, 1, s + 2), *b = buf(OC, 1, s + 3);
        uint16_t *dy = buf(ny, 1, s + 4), *y = buf(ny, 1, s + 5), *dx = buf(nx, 1, s + 6);
        uint16_t *dw = buf(nw, 1, s + 7);
        size_t ws_bytes = dnnl_matmul_workspace_bytes(FL_BF16, N, C, OC);
        void *ws = fl_alloc(FL_MEM_WORKSPACE, ws_bytes);
        double h_fwd = TIME(dnnl_matmul_forward(FL_BF16, y, x, w, b, ws, N, C, OC));
        double h_dx = TIME(dnnl_matmul_backward(FL_BF16, dx, NULL, NULL, dy, x, w, ws, N, C, OC));
        double h_dw = TIME(dnnl_matmul_backward(FL_BF16, NULL, dw, NULL, dy, x, w, ws, N, C, OC));
        fl_free(x), fl_free(w), fl_free(b), fl_free(dy), fl_free(y), fl_free(dx), fl_free(dw);
        fl_free(ws);

        float *xf = buf(nx, 0, s + 1), *wf = buf(nw, 0, s + 2), *bf = buf(OC, 0, s + 3);
        float *dyf = buf(ny, 0, s + 4), *yf = buf(ny, 0, s + 5), *dxf = buf(nx, 0, s + 6);
        float *dwf = buf(nw, 0, s + 7);
        double f_fwd = TIME(sgemm_forward(yf, xf, wf, bf, N, C, OC));
        double f_dx = TIME(cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f,
                                       dyf, OC, wf, C, 1.0f, dxf, C));
        double f_dw = TIME(cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dyf,
                                       OC, xf, C, 1.0f, dwf, C));
        fl_free(xf), fl_free(wf), fl_free(bf), fl_free(dyf), fl_free(yf), fl_free(dxf);
        fl_free(dwf);

        char name[32];
        snprintf(name, sizeof name, "%s %d->%d", layers[l].name, C, OC);
        row(name, "forward", N, C, OC, h_fwd, f_fwd, ws_bytes);
        row("", "dinp", N, OC, C, h_dx, f_dx, 0);
        row("", "dweight", OC, N, C, h_dw, f_dw, 0);
        fflush(stdout);
    }
    dnnl_matmul_release();
    return 0;
}
