// bench_kernels.c: time each kernel, fast vs _ref, at GPT-2 124M layer shapes.
// usage: bench_kernels [B T] (default 4 256); threads from OMP_NUM_THREADS.
// Gradients are accumulated across repetitions, which does not matter here.
#include "fitlm/core.h"
#include "fitlm/kernels.h"

#include <stdio.h>
#include <stdlib.h>

enum { C = 768, NH = 12, V = 50257, VP = 50304, REPS = 3 };

static float *buf(size_t n) {
    float *x = fl_alloc(FL_MEM_OTHER, n * sizeof *x);
    fl_rng rng;
    fl_rng_seed(&rng, n);
    for (size_t i = 0; i < n; i++) x[i] = fl_rng_normal(&rng);
    return x;
}

// mean seconds of REPS runs of a statement, after one warm-up run
#define TIME(stmt)                                                                                 \
    ({                                                                                             \
        stmt;                                                                                      \
        double t0_ = fl_now();                                                                     \
        for (int r_ = 0; r_ < REPS; r_++) stmt;                                                    \
        (fl_now() - t0_) / REPS;                                                                   \
    })

static void row(const char *name, double fast_fwd, double fast_bwd, double ref_fwd,
                double ref_bwd) {
    printf("%-14s %10.2f %10.2f %10.2f %10.2f %8.1fx\n", name, 1e3 * fast_fwd, 1e3 * fast_bwd,
           1e3 * ref_fwd, 1e3 * ref_bwd, (ref_fwd + ref_bwd) / (fast_fwd + fast_bwd));
}

int main(int argc, char **argv) {
    int B = argc > 2 ? atoi(argv[1]) : 4, T = argc > 2 ? atoi(argv[2]) : 256, N = B * T;
    int HS = C / NH;
    printf("B=%d T=%d C=%d NH=%d V=%d, %d threads, avx512f %d\n", B, T, C, NH, V, fl_threads(),
           fl_cpu()->avx512f);
    printf("%-14s %10s %10s %10s %10s %9s\n", "kernel (ms)", "fwd", "bwd", "ref fwd", "ref bwd",
           "speedup");

    int *tok = malloc(N * sizeof *tok);
    for (int i = 0; i < N; i++) tok[i] = (i * 7919) % V;
    float *x = buf((size_t)N * C), *y = buf((size_t)N * C), *dy = buf((size_t)N * C);
    float *dx = buf((size_t)N * C), *wte = buf((size_t)VP * C), *dwte = buf((size_t)VP * C);
    float *wpe = buf((size_t)T * C), *dwpe = buf((size_t)T * C);
    row("encoder", TIME(encoder_forward(y, tok, wte, wpe, B, T, C)),
        TIME(encoder_backward(dwte, dwpe, dy, tok, B, T, C)),
        TIME(encoder_forward_ref(y, tok, wte, wpe, B, T, C)),
        TIME(encoder_backward_ref(dwte, dwpe, dy, tok, B, T, C)));

    float *w = buf(C), *b = buf(C), *dw = buf(C), *db = buf(C), *mean = buf(N), *rstd = buf(N);
    row("layernorm", TIME(layernorm_forward(y, mean, rstd, x, w, b, N, C)),
        TIME(layernorm_backward(dx, dw, db, dy, x, w, mean, rstd, N, C)),
        TIME(layernorm_forward_ref(y, mean, rstd, x, w, b, N, C)),
        TIME(layernorm_backward_ref(dx, dw, db, dy, x, w, mean, rstd, N, C)));

    // the MLP's first matmul, C -> 4C; the reference is too slow to repeat
    // at full size, so it runs on 1/16 of the rows and is scaled up
    float *W = buf((size_t)4 * C * C), *dW = buf((size_t)4 * C * C), *bias = buf(4 * C);
    float *dbias = buf(4 * C), *h = buf((size_t)N * 4 * C), *dh = buf((size_t)N * 4 * C);
    int Nr = N / 16 > 0 ? N / 16 : 1;
    double scale = (double)N / Nr;
    row("matmul C->4C", TIME(matmul_forward(h, x, W, bias, N, C, 4 * C)),
        TIME(matmul_backward(dx, dW, dbias, dh, x, W, N, C, 4 * C)),
        scale * TIME(matmul_forward_ref(h, x, W, bias, Nr, C, 4 * C)),
        scale * TIME(matmul_backward_ref(dx, dW, dbias, dh, x, W, Nr, C, 4 * C)));

    float *qkv = buf((size_t)N * 3 * C), *dqkv = buf((size_t)N * 3 * C), *lse = buf((size_t)N * NH);
    float *ws = fl_alloc(FL_MEM_WORKSPACE,
                         attention_workspace_floats(T, HS) * fl_threads() * sizeof(float));
    for (size_t i = 0; i < (size_t)N * 3 * C; i++) qkv[i] *= 0.3f; // realistic score spread
    row("attention", TIME(attention_forward(y, lse, qkv, ws, B, T, C, NH)),
        TIME(attention_backward(dqkv, dy, qkv, y, lse, ws, B, T, C, NH)),
        TIME(attention_forward_ref(y, lse, qkv, B, T, C, NH)),
        TIME(attention_backward_ref(dqkv, dy, qkv, y, lse, B, T, C, NH)));

    size_t n4 = (size_t)N * 4 * C;
    float *g = buf(n4);
    row("gelu (4C)", TIME(gelu_forward(g, h, n4)), TIME(gelu_backward(dh, h, g, n4)),
        TIME(gelu_forward_ref(g, h, n4)), TIME(gelu_backward_ref(dh, h, g, n4)));

    size_t nc = (size_t)N * C;
    row("residual", TIME(residual_forward(y, x, dy, nc)), TIME(residual_backward(dx, y, dy, nc)),
        TIME(residual_forward_ref(y, x, dy, nc)), TIME(residual_backward_ref(dx, y, dy, nc)));

    // one row block of logits at a time keeps memory modest for large B*T
    int Nx = N < 256 ? N : 256;
    float *logits = buf((size_t)Nx * VP), *losses = buf(Nx), *lsex = buf(Nx), *dl = buf(Nx);
    float *dlogits = buf((size_t)Nx * VP);
    double xs = (double)N / Nx;
    row("softmax_xent", xs * TIME(softmax_xent_forward(losses, lsex, logits, tok, Nx, V, VP)),
        xs * TIME(softmax_xent_backward(dlogits, logits, lsex, tok, dl, Nx, V, VP)),
        xs * TIME(softmax_xent_forward_ref(losses, lsex, logits, tok, Nx, V, VP)),
        xs * TIME(softmax_xent_backward_ref(dlogits, logits, lsex, tok, dl, Nx, V, VP)));
    return 0;
}
