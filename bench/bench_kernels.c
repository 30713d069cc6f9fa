// bench_kernels.c: time each kernel, fast vs _ref, at GPT-2 124M layer shapes.
// usage: bench_kernels [B T [fp32|bf16|fp16]] (default 4 256 fp32): the fast
// kernels run in that storage dtype, the _ref ones in fp32. Threads from
// OMP_NUM_THREADS. Gradients are accumulated across repetitions, which does
// not matter here.
#include "fitlm/core.h"
#include "fitlm/kernels.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

// a copy of x in dtype dt, for the fast kernels; x itself for fp32
static void *as_dt(fl_dtype dt, float *x, size_t n) {
    if (dt == FL_F32) return x;
    void *h = fl_alloc(FL_MEM_OTHER, n * fl_dtype_size(dt));
    fl_convert(dt, h, FL_F32, x, n);
    return h;
}

int main(int argc, char **argv) {
    fl_runtime_env(argv);
    int B = argc > 2 ? atoi(argv[1]) : 4, T = argc > 2 ? atoi(argv[2]) : 256, N = B * T;
    fl_dtype dt = FL_F32;
    if (argc > 3)
        dt = !strcmp(argv[3], "bf16") ? FL_BF16 : !strcmp(argv[3], "fp16") ? FL_F16 : FL_F32;
    int HS = C / NH;
    printf("B=%d T=%d C=%d NH=%d V=%d, %d threads, avx512f %d, fast kernels in %s\n", B, T, C, NH,
           V, fl_threads(), fl_cpu()->avx512f, fl_dtype_name(dt));
    printf("%-14s %10s %10s %10s %10s %9s\n", "kernel (ms)", "fwd", "bwd", "ref fwd", "ref bwd",
           "speedup");

    int *tok = malloc(N * sizeof *tok);
    for (int i = 0; i < N; i++) tok[i] = (i * 7919) % V;
    float *x = buf((size_t)N * C), *y = buf((size_t)N * C), *dy = buf((size_t)N * C);
    float *dx = buf((size_t)N * C), *wte = buf((size_t)VP * C), *dwte = buf((size_t)VP * C);
    float *wpe = buf((size_t)T * C), *dwpe = buf((size_t)T * C);
    void *x_ = as_dt(dt, x, (size_t)N * C), *y_ = as_dt(dt, y, (size_t)N * C);
    void *dy_ = as_dt(dt, dy, (size_t)N * C), *dx_ = as_dt(dt, dx, (size_t)N * C);
    void *wte_ = as_dt(dt, wte, (size_t)VP * C), *dwte_ = as_dt(dt, dwte, (size_t)VP * C);
    void *wpe_ = as_dt(dt, wpe, (size_t)T * C), *dwpe_ = as_dt(dt, dwpe, (size_t)T * C);
    row("encoder", TIME(encoder_forward(dt, y_, tok, wte_, wpe_, B, T, C)),
        TIME(encoder_backward(dt, dwte_, dwpe_, dy_, tok, B, T, C)),
        TIME(encoder_forward_ref(y, tok, wte, wpe, B, T, C)),
        TIME(encoder_backward_ref(dwte, dwpe, dy, tok, B, T, C)));

    float *w = buf(C), *b = buf(C), *dw = buf(C), *db = buf(C), *mean = buf(N), *rstd = buf(N);
    void *w_ = as_dt(dt, w, C), *b_ = as_dt(dt, b, C), *dw_ = as_dt(dt, dw, C);
    void *db_ = as_dt(dt, db, C);
    row("layernorm", TIME(layernorm_forward(dt, y_, mean, rstd, x_, w_, b_, N, C)),
        TIME(layernorm_backward(dt, dx_, dw_, db_, dy_, x_, w_, mean, rstd, N, C)),
        TIME(layernorm_forward_ref(y, mean, rstd, x, w, b, N, C)),
        TIME(layernorm_backward_ref(dx, dw, db, dy, x, w, mean, rstd, N, C)));

    // the MLP's first matmul, C -> 4C; the reference is too slow to repeat
    // at full size, so it runs on 1/16 of the rows and is scaled up
    size_t n4 = (size_t)N * 4 * C;
    float *W = buf((size_t)4 * C * C), *dW = buf((size_t)4 * C * C), *bias = buf(4 * C);
    float *dbias = buf(4 * C), *h = buf(n4), *dh = buf(n4);
    void *W_ = as_dt(dt, W, (size_t)4 * C * C), *dW_ = as_dt(dt, dW, (size_t)4 * C * C);
    void *bias_ = as_dt(dt, bias, 4 * C), *dbias_ = as_dt(dt, dbias, 4 * C);
    void *h_ = as_dt(dt, h, n4), *dh_ = as_dt(dt, dh, n4);
    size_t mm_bytes = matmul_workspace_bytes(dt, N, C, 4 * C);
    void *mm_ws = mm_bytes ? fl_alloc(FL_MEM_WORKSPACE, mm_bytes) : NULL;
    int Nr = N / 16 > 0 ? N / 16 : 1;
    double scale = (double)N / Nr;
    row("matmul C->4C", TIME(matmul_forward(dt, h_, x_, W_, bias_, mm_ws, N, C, 4 * C)),
        TIME(matmul_backward(dt, dx_, dW_, dbias_, dh_, x_, W_, mm_ws, N, C, 4 * C)),
        scale * TIME(matmul_forward_ref(h, x, W, bias, Nr, C, 4 * C)),
        scale * TIME(matmul_backward_ref(dx, dW, dbias, dh, x, W, Nr, C, 4 * C)));

    float *qkv = buf((size_t)N * 3 * C), *dqkv = buf((size_t)N * 3 * C), *lse = buf((size_t)N * NH);
    for (size_t i = 0; i < (size_t)N * 3 * C; i++) qkv[i] *= 0.3f; // realistic score spread
    void *qkv_ = as_dt(dt, qkv, (size_t)N * 3 * C), *dqkv_ = as_dt(dt, dqkv, (size_t)N * 3 * C);
    float *ws = fl_alloc(FL_MEM_WORKSPACE,
                         attention_workspace_floats(dt, T, HS, 1) * fl_threads() * sizeof(float));
    row("attention", TIME(attention_forward(dt, y_, lse, qkv_, ws, B, T, NH, NH, HS)),
        TIME(attention_backward(dt, dqkv_, dy_, qkv_, y_, lse, ws, B, T, NH, NH, HS)),
        TIME(attention_forward_ref(y, lse, qkv, B, T, NH, NH, HS)),
        TIME(attention_backward_ref(dqkv, dy, qkv, y, lse, B, T, NH, NH, HS)));

    // LLaMA's kernels at the same shapes: RoPE on the q and k heads of the
    // qkv buffer (NKV = NH), SwiGLU with an intermediate size of 2C (its
    // input, (N,4C), is the fc output)
    float *rs = buf(N), *cs = buf((size_t)T * HS);
    rope_table(cs, T, HS, 10000.0f);
    row("rmsnorm", TIME(rmsnorm_forward(dt, y_, rs, x_, w_, N, C, 1e-5f)),
        TIME(rmsnorm_backward(dt, dx_, dw_, dy_, x_, w_, rs, N, C)),
        TIME(rmsnorm_forward_ref(y, rs, x, w, N, C, 1e-5f)),
        TIME(rmsnorm_backward_ref(dx, dw, dy, x, w, rs, N, C)));
    row("rope", TIME(rope_forward(dt, qkv_, cs, B, T, NH, NH, HS)),
        TIME(rope_backward(dt, dqkv_, cs, B, T, NH, NH, HS)),
        TIME(rope_forward_ref(qkv, cs, B, T, NH, NH, HS)),
        TIME(rope_backward_ref(dqkv, cs, B, T, NH, NH, HS)));
    float *sw = buf((size_t)N * 2 * C);
    void *sw_ = as_dt(dt, sw, (size_t)N * 2 * C);
    row("swiglu (2C)", TIME(swiglu_forward(dt, sw_, h_, N, 2 * C)),
        TIME(swiglu_backward(dt, dh_, h_, sw_, N, 2 * C)),
        TIME(swiglu_forward_ref(sw, h, N, 2 * C)), TIME(swiglu_backward_ref(dh, h, sw, N, 2 * C)));

    float *g = buf(n4);
    void *g_ = as_dt(dt, g, n4);
    row("gelu (4C)", TIME(gelu_forward(dt, g_, h_, n4)), TIME(gelu_backward(dt, dh_, h_, g_, n4)),
        TIME(gelu_forward_ref(g, h, n4)), TIME(gelu_backward_ref(dh, h, g, n4)));

    size_t nc = (size_t)N * C;
    row("residual", TIME(residual_forward(dt, y_, x_, dy_, nc)),
        TIME(residual_backward(dt, dx_, y_, dy_, nc)), TIME(residual_forward_ref(y, x, dy, nc)),
        TIME(residual_backward_ref(dx, y, dy, nc)));

    // one row block of logits at a time keeps memory modest for large B*T
    int Nx = N < 256 ? N : 256;
    float *logits = buf((size_t)Nx * VP), *losses = buf(Nx), *lsex = buf(Nx), *dl = buf(Nx);
    float *dlogits = buf((size_t)Nx * VP);
    void *logits_ = as_dt(dt, logits, (size_t)Nx * VP),
         *dlogits_ = as_dt(dt, dlogits, (size_t)Nx * VP);
    double xs = (double)N / Nx;
    row("softmax_xent", xs * TIME(softmax_xent_forward(dt, losses, lsex, logits_, tok, Nx, V, VP)),
        xs * TIME(softmax_xent_backward(dt, dlogits_, logits_, lsex, tok, dl, Nx, V, VP)),
        xs * TIME(softmax_xent_forward_ref(losses, lsex, logits, tok, Nx, V, VP)),
        xs * TIME(softmax_xent_backward_ref(dlogits, logits, lsex, tok, dl, Nx, V, VP)));
    return 0;
}
