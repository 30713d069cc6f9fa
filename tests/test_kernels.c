// test_kernels.c: every kernel three ways.
// 1. fast vs _ref on many shapes (odd C, T=1, N=1, odd head size, several
//    attention row blocks) and special values, forward and backward;
// 2. float forward vs an independent double-precision forward written here,
//    and both backwards vs central finite differences of that double forward
//    (loss = sum(out * R), so dout = R), with gradient buffers prefilled so
//    the += contract is checked at the same time (softmax_xent overwrites,
//    also in place; rope works in place);
// 3. the fast kernels run twice give bitwise identical results;
// 4. in bf16 and fp16 (see "bf16 and fp16" below) against the fp32 _ref, with
//    tolerances from the dtype's unit roundoff, and exact checks that
//    gradients are rounded once per call.
// Outputs and workspaces start as NaN: a kernel that reads what it should
// only write fails loudly. Everything runs twice, in a forked child with the
// portable paths (FITLM_ISA=portable), with AVX2 where the CPU has more,
// and then with the CPU's own paths.
#include "fitlm/core.h"
#include "fitlm/kernels.h"
#include "testlib.h"
#include "../src/kernels/gemm.h" // the packed GEMM under matmul's 16-bit path
#include "../src/kernels/simd.h" // exp512 and exp256, for their lane-for-lane test

#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cblas.h>

// ----------------------------------------------------------------------------
// tolerances

// Finite differences: h = 1e-6 in double has truncation error ~h^2 |f'''| ~
// 1e-12 and cancellation error ~1e-16 |L| / h ~ 1e-9 (|L| < 10), so the
// numeric gradient is exact far below float precision. The analytic float
// gradient is a sum of at most ~100 terms of size <~ 2 (inputs are O(1)),
// each rounded at u = 6e-8: typically ~1e-6 off (<1e-6 observed), plus a
// relative error of a few u from the saved float statistics (mean, rstd,
// lse). Hence |a - n| <= 1e-5 + 1e-4 |n|, 10x or more above the observed
// error, while a real bug (a missing term, a wrong factor or sign, an
// overwrite instead of +=) is off by O(0.1) with these inputs.
#define GC_H    1e-6
#define GC_ATOL 1e-5
#define GC_RTOL 1e-4

// Float result vs the double forward: same argument, a few u per term.
#define FWD_ATOL 1e-5
#define FWD_RTOL 1e-5

// fast vs _ref where both sum K terms of size <= 1 in different orders
// (blocked BLAS kernels, SIMD reductions): rounding grows about like K u in
// the worst realistic case, so allow 1e-6 + 2e-7 K (about 3 u per term).
static double sum_tol(int K) {
    return 1e-6 + 2e-7 * K;
}
#define REF_RTOL 1e-5

// The emulated CPUs' runs and the sanitizer build (t_quick) leave out the
// cases of more than this many multiply-adds (the kernels' or the
// references'): the smaller ones run every line of src/ that they do
// (gcov, under each ISA cap), and the release build takes them all.
#define QUICK_MAX_MACS 50e6
static int quick_skip(double macs) {
    return t_quick() && macs > QUICK_MAX_MACS;
}

// ----------------------------------------------------------------------------
// helpers

static const char *nm(const char *fmt, ...) {
    static char buf[160];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

static float *frand(size_t n, unsigned seed, float scale) {
    float *x = malloc((n ? n : 1) * sizeof *x);
    t_fill(x, n, seed, scale);
    return x;
}

static float *fnan(size_t n) {
    float *x = malloc((n ? n : 1) * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i] = NAN;
    return x;
}

static float *fcopy(const float *x, size_t n) {
    float *y = malloc((n ? n : 1) * sizeof *y);
    memcpy(y, x, n * sizeof *y);
    return y;
}

static double *dcopy(const float *x, size_t n) {
    double *y = malloc((n ? n : 1) * sizeof *y);
    for (size_t i = 0; i < n; i++) y[i] = x[i];
    return y;
}

static double dot_d(const double *a, const double *b, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

static void same_bits(const char *name, const float *a, const float *b, size_t n) {
    t_check(memcmp(a, b, n * sizeof *a) == 0, "%s: two runs differ", name);
}

static void check_fwd(const char *name, const float *got, const double *want, size_t n) {
    double *g = dcopy(got, n);
    t_close_d(name, g, want, n, FWD_ATOL, FWD_RTOL);
    free(g);
}

// The backward added its gradient to `before`, the prefilled buffer.
static void check_grad(const char *name, const float *after, const float *before, const double *num,
                       size_t n) {
    double *a = malloc((n ? n : 1) * sizeof *a);
    for (size_t i = 0; i < n; i++) a[i] = (double)after[i] - (double)before[i];
    t_close_d(name, a, num, n, GC_ATOL, GC_RTOL);
    free(a);
}

// Central differences of loss(ctx) with respect to each x[k]; x lives in ctx.
typedef double (*loss_fn)(const void *ctx);
static double *numgrad(double *x, size_t n, loss_fn loss, const void *ctx) {
    double *g = malloc((n ? n : 1) * sizeof *g);
    for (size_t k = 0; k < n; k++) {
        double x0 = x[k];
        x[k] = x0 + GC_H;
        double lp = loss(ctx);
        x[k] = x0 - GC_H;
        double lm = loss(ctx);
        x[k] = x0;
        g[k] = (lp - lm) / (2 * GC_H);
    }
    return g;
}

static int *tokens(size_t n, unsigned seed, int lo, int hi) {
    int *t = malloc((n ? n : 1) * sizeof *t);
    float *u = frand(n, seed, 1.0f);
    for (size_t i = 0; i < n; i++) {
        int v = lo + (int)((u[i] + 1.0f) * 0.5f * (hi - lo + 1));
        t[i] = v > hi ? hi : v;
    }
    free(u);
    return t;
}

// ----------------------------------------------------------------------------
// the fast kernels in fp32, with their _ref twins' signatures

static void encoder_forward_f32(float *out, const int *inp, const float *wte, const float *wpe,
                                int B, int T, int C) {
    encoder_forward(FL_F32, out, inp, wte, wpe, B, T, C);
}
static void encoder_backward_f32(float *dwte, float *dwpe, const float *dout, const int *inp, int B,
                                 int T, int C) {
    encoder_backward(FL_F32, dwte, dwpe, dout, inp, B, T, C);
}
static void layernorm_forward_f32(float *out, float *mean, float *rstd, const float *inp,
                                  const float *weight, const float *bias, int N, int C) {
    layernorm_forward(FL_F32, out, mean, rstd, inp, weight, bias, N, C);
}
static void layernorm_backward_f32(float *dinp, float *dweight, float *dbias, const float *dout,
                                   const float *inp, const float *weight, const float *mean,
                                   const float *rstd, int N, int C) {
    layernorm_backward(FL_F32, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C);
}
// fp32 needs no matmul workspace on the portable path (NULL), some with AVX2
static void *mm_workspace_f32(int N, int C, int OC) {
    size_t bytes = matmul_workspace_bytes(FL_F32, N, C, OC);
    return bytes ? malloc(bytes) : NULL;
}
static void matmul_forward_f32(float *out, const float *inp, const float *weight, const float *bias,
                               int N, int C, int OC) {
    void *ws = mm_workspace_f32(N, C, OC);
    matmul_forward(FL_F32, out, inp, weight, bias, ws, N, C, OC);
    free(ws);
}
static void matmul_backward_f32(float *dinp, float *dweight, float *dbias, const float *dout,
                                const float *inp, const float *weight, int N, int C, int OC) {
    void *ws = mm_workspace_f32(N, C, OC);
    matmul_backward(FL_F32, dinp, dweight, dbias, dout, inp, weight, ws, N, C, OC);
    free(ws);
}
static void attention_forward_f32(float *out, float *lse, const float *qkv, float *workspace, int B,
                                  int T, int NH, int NKV, int HS) {
    attention_forward(FL_F32, out, lse, qkv, workspace, B, T, NH, NKV, HS);
}
static void attention_backward_f32(float *dqkv, const float *dout, const float *qkv,
                                   const float *out, const float *lse, float *workspace, int B,
                                   int T, int NH, int NKV, int HS) {
    attention_backward(FL_F32, dqkv, dout, qkv, out, lse, workspace, B, T, NH, NKV, HS);
}
static void rmsnorm_forward_f32(float *out, float *rstd, const float *inp, const float *weight,
                                int N, int C, float eps) {
    rmsnorm_forward(FL_F32, out, rstd, inp, weight, N, C, eps);
}
static void rmsnorm_backward_f32(float *dinp, float *dweight, const float *dout, const float *inp,
                                 const float *weight, const float *rstd, int N, int C) {
    rmsnorm_backward(FL_F32, dinp, dweight, dout, inp, weight, rstd, N, C);
}
static void rope_forward_f32(float *qkv, const float *cos_sin, int B, int T, int NH, int NKV,
                             int HS) {
    rope_forward(FL_F32, qkv, cos_sin, B, T, NH, NKV, HS);
}
static void rope_backward_f32(float *dqkv, const float *cos_sin, int B, int T, int NH, int NKV,
                              int HS) {
    rope_backward(FL_F32, dqkv, cos_sin, B, T, NH, NKV, HS);
}
static void swiglu_forward_f32(float *out, const float *inp, int N, int IC) {
    swiglu_forward(FL_F32, out, inp, N, IC);
}
static void swiglu_backward_f32(float *dinp, const float *inp, const float *dout, int N, int IC) {
    swiglu_backward(FL_F32, dinp, inp, dout, N, IC);
}
static void gelu_forward_f32(float *out, const float *inp, size_t N) {
    gelu_forward(FL_F32, out, inp, N);
}
static void gelu_backward_f32(float *dinp, const float *inp, const float *dout, size_t N) {
    gelu_backward(FL_F32, dinp, inp, dout, N);
}
static void residual_forward_f32(float *out, const float *a, const float *b, size_t N) {
    residual_forward(FL_F32, out, a, b, N);
}
static void residual_backward_f32(float *da, float *db, const float *dout, size_t N) {
    residual_backward(FL_F32, da, db, dout, N);
}
static void softmax_xent_forward_f32(float *losses, float *lse, const float *logits,
                                     const int *targets, int N, int V, int Vp) {
    softmax_xent_forward(FL_F32, losses, lse, logits, targets, N, V, Vp);
}
static void softmax_xent_backward_f32(float *dlogits, const float *logits, const float *lse,
                                      const int *targets, const float *dlosses, int N, int V,
                                      int Vp) {
    softmax_xent_backward(FL_F32, dlogits, logits, lse, targets, dlosses, N, V, Vp);
}

// ----------------------------------------------------------------------------
// encoder

typedef struct {
    const int *inp;
    double *wte, *wpe, *R, *out;
    int B, T, C;
} enc_ctx;

static void encoder_fwd_d(double *out, const int *inp, const double *wte, const double *wpe, int B,
                          int T, int C) {
    for (int bt = 0; bt < B * T; bt++)
        for (int c = 0; c < C; c++)
            out[(size_t)bt * C + c] = wte[(size_t)inp[bt] * C + c] + wpe[(size_t)(bt % T) * C + c];
}

static double enc_loss(const void *p) {
    const enc_ctx *c = p;
    encoder_fwd_d(c->out, c->inp, c->wte, c->wpe, c->B, c->T, c->C);
    return dot_d(c->out, c->R, (size_t)c->B * c->T * c->C);
}

static void test_encoder(void) {
    printf("encoder\n");
    // The fast kernel adds the same terms in the same order as _ref (dwte in
    // (b,t) order, dwpe in b order), so they must agree exactly.
    int shapes[][4] = {{1, 1, 1, 2}, {2, 3, 7, 5}, {3, 17, 33, 11}, {4, 64, 96, 50}}; // B T C Vp
    for (int s = 0; s < 4; s++) {
        int B = shapes[s][0], T = shapes[s][1], C = shapes[s][2], Vp = shapes[s][3], maxT = T + 2;
        size_t nout = (size_t)B * T * C;
        int *inp = tokens((size_t)B * T, 10 + s, 0, Vp - 2); // row Vp-1 is never used
        float *wte = frand((size_t)Vp * C, 1, 1.0f), *wpe = frand((size_t)maxT * C, 2, 1.0f);
        float *dout = frand(nout, 3, 1.0f);
        float *out_r = fnan(nout), *out_f = fnan(nout), *out_f2 = fnan(nout);
        float *dwte_r = frand((size_t)Vp * C, 4, 1.0f), *dwpe_r = frand((size_t)maxT * C, 5, 1.0f);
        float *dwte_f = fcopy(dwte_r, (size_t)Vp * C), *dwpe_f = fcopy(dwpe_r, (size_t)maxT * C);
        float *dwte_f2 = fcopy(dwte_r, (size_t)Vp * C), *dwpe_f2 = fcopy(dwpe_r, (size_t)maxT * C);
        encoder_forward_ref(out_r, inp, wte, wpe, B, T, C);
        encoder_forward_f32(out_f, inp, wte, wpe, B, T, C);
        encoder_forward_f32(out_f2, inp, wte, wpe, B, T, C);
        encoder_backward_ref(dwte_r, dwpe_r, dout, inp, B, T, C);
        encoder_backward_f32(dwte_f, dwpe_f, dout, inp, B, T, C);
        encoder_backward_f32(dwte_f2, dwpe_f2, dout, inp, B, T, C);
        t_close(nm("enc B%d T%d C%d out", B, T, C), out_f, out_r, nout, 0, 0);
        t_close(nm("enc B%d T%d C%d dwte", B, T, C), dwte_f, dwte_r, (size_t)Vp * C, 0, 0);
        t_close(nm("enc B%d T%d C%d dwpe", B, T, C), dwpe_f, dwpe_r, (size_t)maxT * C, 0, 0);
        same_bits("enc out", out_f, out_f2, nout);
        same_bits("enc dwte", dwte_f, dwte_f2, (size_t)Vp * C);
        same_bits("enc dwpe", dwpe_f, dwpe_f2, (size_t)maxT * C);
        free(inp), free(wte), free(wpe), free(dout), free(out_r), free(out_f), free(out_f2);
        free(dwte_r), free(dwpe_r), free(dwte_f), free(dwpe_f), free(dwte_f2), free(dwpe_f2);
    }

    // gradient check; repeated tokens exercise the accumulation into dwte
    int B = 2, T = 3, C = 5, Vp = 6, maxT = 4;
    size_t nout = (size_t)B * T * C, nwte = (size_t)Vp * C, nwpe = (size_t)maxT * C;
    int inp[] = {1, 3, 1, 1, 0, 3};
    float *wte = frand(nwte, 21, 1.0f), *wpe = frand(nwpe, 22, 1.0f), *R = frand(nout, 23, 1.0f);
    enc_ctx ctx = {inp, dcopy(wte, nwte), dcopy(wpe, nwpe), dcopy(R, nout), malloc(nout * 8), B, T,
                   C};
    double *g_wte = numgrad(ctx.wte, nwte, enc_loss, &ctx);
    double *g_wpe = numgrad(ctx.wpe, nwpe, enc_loss, &ctx);
    encoder_fwd_d(ctx.out, inp, ctx.wte, ctx.wpe, B, T, C);
    for (int fast = 0; fast < 2; fast++) {
        const char *v = fast ? "fast" : "ref";
        float *out = fnan(nout);
        float *dwte0 = frand(nwte, 24, 1.0f), *dwpe0 = frand(nwpe, 25, 1.0f);
        float *dwte = fcopy(dwte0, nwte), *dwpe = fcopy(dwpe0, nwpe);
        (fast ? encoder_forward_f32 : encoder_forward_ref)(out, inp, wte, wpe, B, T, C);
        (fast ? encoder_backward_f32 : encoder_backward_ref)(dwte, dwpe, R, inp, B, T, C);
        check_fwd(nm("enc %s out vs double", v), out, ctx.out, nout);
        check_grad(nm("enc %s dwte vs numeric", v), dwte, dwte0, g_wte, nwte);
        check_grad(nm("enc %s dwpe vs numeric", v), dwpe, dwpe0, g_wpe, nwpe);
        free(out), free(dwte0), free(dwpe0), free(dwte), free(dwpe);
    }
    free(wte), free(wpe), free(R), free(g_wte), free(g_wpe);
    free(ctx.wte), free(ctx.wpe), free(ctx.R), free(ctx.out);
}

// ----------------------------------------------------------------------------
// layernorm

typedef struct {
    double *inp, *w, *b, *R, *out;
    int N, C;
} ln_ctx;

static void layernorm_fwd_d(double *out, const double *inp, const double *w, const double *b, int N,
                            int C) {
    for (int n = 0; n < N; n++) {
        const double *x = inp + (size_t)n * C;
        double m = 0.0, v = 0.0;
        for (int i = 0; i < C; i++) m += x[i] / C;
        for (int i = 0; i < C; i++) v += (x[i] - m) * (x[i] - m) / C;
        double r = 1.0 / sqrt(v + 1e-5);
        for (int i = 0; i < C; i++) out[(size_t)n * C + i] = (x[i] - m) * r * w[i] + b[i];
    }
}

static double ln_loss(const void *p) {
    const ln_ctx *c = p;
    layernorm_fwd_d(c->out, c->inp, c->w, c->b, c->N, c->C);
    return dot_d(c->out, c->R, (size_t)c->N * c->C);
}

static void test_layernorm(void) {
    printf("layernorm\n");
    int shapes[][2] = {{1, 1}, {1, 7}, {5, 33}, {3, 16}, {64, 768}}; // N C
    for (int s = 0; s < 5; s++) {
        int N = shapes[s][0], C = shapes[s][1];
        size_t n = (size_t)N * C;
        float *inp = frand(n, 31, 2.0f), *w = frand(C, 32, 1.0f), *b = frand(C, 33, 1.0f);
        float *dout = frand(n, 34, 1.0f);
        float *out_r = fnan(n), *mean_r = fnan(N), *rstd_r = fnan(N);
        float *out_f = fnan(n), *mean_f = fnan(N), *rstd_f = fnan(N), *out_f2 = fnan(n);
        float *dinp_r = frand(n, 35, 1.0f), *dw_r = frand(C, 36, 1.0f), *db_r = frand(C, 37, 1.0f);
        float *dinp_f = fcopy(dinp_r, n), *dw_f = fcopy(dw_r, C), *db_f = fcopy(db_r, C);
        float *dinp_f2 = fcopy(dinp_r, n), *dw_f2 = fcopy(dw_r, C), *db_f2 = fcopy(db_r, C);
        layernorm_forward_ref(out_r, mean_r, rstd_r, inp, w, b, N, C);
        layernorm_forward_f32(out_f, mean_f, rstd_f, inp, w, b, N, C);
        layernorm_forward_f32(out_f2, mean_f, rstd_f, inp, w, b, N, C);
        layernorm_backward_ref(dinp_r, dw_r, db_r, dout, inp, w, mean_r, rstd_r, N, C);
        layernorm_backward_f32(dinp_f, dw_f, db_f, dout, inp, w, mean_f, rstd_f, N, C);
        layernorm_backward_f32(dinp_f2, dw_f2, db_f2, dout, inp, w, mean_f, rstd_f, N, C);
        // rstd of a one-channel row is 1/sqrt(eps) ~ 316: relative tolerance
        t_close(nm("ln N%d C%d out", N, C), out_f, out_r, n, sum_tol(C), REF_RTOL);
        t_close(nm("ln N%d C%d mean", N, C), mean_f, mean_r, N, sum_tol(C), REF_RTOL);
        t_close(nm("ln N%d C%d rstd", N, C), rstd_f, rstd_r, N, sum_tol(C), REF_RTOL);
        t_close(nm("ln N%d C%d dinp", N, C), dinp_f, dinp_r, n, sum_tol(C), REF_RTOL);
        t_close(nm("ln N%d C%d dweight", N, C), dw_f, dw_r, C, sum_tol(N), REF_RTOL);
        t_close(nm("ln N%d C%d dbias", N, C), db_f, db_r, C, sum_tol(N), REF_RTOL);
        same_bits("ln out", out_f, out_f2, n);
        same_bits("ln dinp", dinp_f, dinp_f2, n);
        same_bits("ln dweight", dw_f, dw_f2, C);
        same_bits("ln dbias", db_f, db_f2, C);
        free(inp), free(w), free(b), free(dout), free(out_r), free(mean_r), free(rstd_r);
        free(out_f), free(mean_f), free(rstd_f), free(out_f2), free(dinp_r), free(dw_r);
        free(db_r), free(dinp_f), free(dw_f), free(db_f), free(dinp_f2), free(dw_f2), free(db_f2);
    }

    // above FL_PAR_MIN_VALUES the threads split the rows, then the weight
    // and bias gradients' channels (in ranges of whole blocks, a ragged one
    // last): the bits of one thread
    {
        int N = 1024, C = 520, threads = omp_get_max_threads();
        size_t n = (size_t)N * C;
        float *inp = frand(n, 46, 2.0f), *w = frand(C, 47, 1.0f), *b = frand(C, 48, 1.0f);
        float *dout = frand(n, 49, 1.0f), *out[2], *mean[2], *rstd[2], *dinp[2], *dw[2], *db[2];
        for (int k = 0; k < 2; k++) {
            omp_set_num_threads(k ? 1 : threads);
            out[k] = fnan(n), mean[k] = fnan(N), rstd[k] = fnan(N);
            dinp[k] = frand(n, 50, 1.0f), dw[k] = frand(C, 51, 1.0f), db[k] = frand(C, 52, 1.0f);
            layernorm_forward_f32(out[k], mean[k], rstd[k], inp, w, b, N, C);
            layernorm_backward_f32(dinp[k], dw[k], db[k], dout, inp, w, mean[k], rstd[k], N, C);
        }
        omp_set_num_threads(threads);
        t_check(!memcmp(out[0], out[1], n * 4) && !memcmp(dinp[0], dinp[1], n * 4) &&
                    !memcmp(dw[0], dw[1], C * 4) && !memcmp(db[0], db[1], C * 4),
                "ln N%d C%d: %d threads and one differ", N, C, threads);
        free(inp), free(w), free(b), free(dout);
        for (int k = 0; k < 2; k++)
            free(out[k]), free(mean[k]), free(rstd[k]), free(dinp[k]), free(dw[k]), free(db[k]);
    }

    // N, C, input scale: the tiny scale gives a variance ~1e-5, where a
    // wrong eps shows
    struct {
        int N, C;
        float scale;
    } gshapes[] = {{3, 7, 2.0f}, {2, 33, 2.0f}, {2, 16, 0.005f}};
    for (int s = 0; s < 3; s++) {
        int N = gshapes[s].N, C = gshapes[s].C;
        float sc = gshapes[s].scale;
        size_t n = (size_t)N * C;
        float *inp = frand(n, 41, sc), *w = frand(C, 42, 1.0f), *b = frand(C, 43, 1.0f);
        float *R = frand(n, 44, 1.0f);
        ln_ctx ctx = {dcopy(inp, n), dcopy(w, C), dcopy(b, C), dcopy(R, n), malloc(n * 8), N, C};
        double *g_inp = numgrad(ctx.inp, n, ln_loss, &ctx);
        double *g_w = numgrad(ctx.w, C, ln_loss, &ctx);
        double *g_b = numgrad(ctx.b, C, ln_loss, &ctx);
        layernorm_fwd_d(ctx.out, ctx.inp, ctx.w, ctx.b, N, C);
        for (int fast = 0; fast < 2; fast++) {
            const char *v = fast ? "fast" : "ref";
            float *out = fnan(n), *mean = fnan(N), *rstd = fnan(N);
            float *dinp0 = frand(n, 45, 1.0f), *dw0 = frand(C, 46, 1.0f), *db0 = frand(C, 47, 1.0f);
            float *dinp = fcopy(dinp0, n), *dw = fcopy(dw0, C), *db = fcopy(db0, C);
            (fast ? layernorm_forward_f32 : layernorm_forward_ref)(out, mean, rstd, inp, w, b, N,
                                                                   C);
            (fast ? layernorm_backward_f32 : layernorm_backward_ref)(dinp, dw, db, R, inp, w, mean,
                                                                     rstd, N, C);
            check_fwd(nm("ln %s C%d s%g out vs double", v, C, sc), out, ctx.out, n);
            check_grad(nm("ln %s C%d s%g dinp vs numeric", v, C, sc), dinp, dinp0, g_inp, n);
            check_grad(nm("ln %s C%d s%g dweight vs numeric", v, C, sc), dw, dw0, g_w, C);
            check_grad(nm("ln %s C%d s%g dbias vs numeric", v, C, sc), db, db0, g_b, C);
            free(out), free(mean), free(rstd), free(dinp0), free(dw0), free(db0);
            free(dinp), free(dw), free(db);
        }
        free(inp), free(w), free(b), free(R), free(g_inp), free(g_w), free(g_b);
        free(ctx.inp), free(ctx.w), free(ctx.b), free(ctx.R), free(ctx.out);
    }
}

// ----------------------------------------------------------------------------
// matmul

typedef struct {
    double *inp, *w, *bias, *R, *out;
    int N, C, OC;
} mm_ctx;

static void matmul_fwd_d(double *out, const double *inp, const double *w, const double *bias, int N,
                         int C, int OC) {
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++)
            out[(size_t)n * OC + o] =
                (bias ? bias[o] : 0.0) + dot_d(inp + (size_t)n * C, w + (size_t)o * C, C);
}

static double mm_loss(const void *p) {
    const mm_ctx *c = p;
    matmul_fwd_d(c->out, c->inp, c->w, c->bias, c->N, c->C, c->OC);
    return dot_d(c->out, c->R, (size_t)c->N * c->OC);
}

static void test_matmul(void) {
    printf("matmul\n");
    // N C OC; with AVX2 the input gradient of N 400 has three row tiles and
    // two column tiles (dout packed ahead for both, the weight's rows for all
    // three) in two chunks of OC; that of N 1160 (>= 8 x 144 rows) has nine
    // row tiles of all C columns, the last of 8 rows, each packing its own
    // rows of dout; with OC <= N so does the forward, the weight packed ahead
    // (N 1160, C 8, OC 40 takes those paths in the reduced list too)
    int shapes[][3] = {{1, 1, 1},        {1, 7, 3},        {5, 33, 17},
                       {64, 96, 288},    {130, 192, 320},  {400, 400, 2100},
                       {1160, 40, 2100}, {1160, 300, 200}, {1160, 8, 40}};
    for (int s = 0; s < 9; s++) {
        int N = shapes[s][0], C = shapes[s][1], OC = shapes[s][2];
        if (quick_skip((double)N * C * OC)) continue;
        size_t ni = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
        float *inp = frand(ni, 51, 1.0f), *w = frand(nw, 52, 1.0f), *bias = frand(OC, 53, 1.0f);
        float *dout = frand(no, 54, 1.0f);
        for (int has_bias = 0; has_bias < 2; has_bias++) {
            const float *bp = has_bias ? bias : NULL;
            float *out_r = fnan(no), *out_f = fnan(no), *out_f2 = fnan(no);
            matmul_forward_ref(out_r, inp, w, bp, N, C, OC);
            matmul_forward_f32(out_f, inp, w, bp, N, C, OC);
            matmul_forward_f32(out_f2, inp, w, bp, N, C, OC);
            t_close(nm("mm N%d C%d OC%d bias%d out", N, C, OC, has_bias), out_f, out_r, no,
                    sum_tol(C), REF_RTOL);
            same_bits("mm out", out_f, out_f2, no);
            free(out_r), free(out_f), free(out_f2);
        }
        float *dinp_r = frand(ni, 55, 1.0f), *dw_r = frand(nw, 56, 1.0f),
              *db_r = frand(OC, 57, 1.0f);
        float *dinp_f = fcopy(dinp_r, ni), *dw_f = fcopy(dw_r, nw), *db_f = fcopy(db_r, OC);
        float *dinp_f2 = fcopy(dinp_r, ni), *dw_f2 = fcopy(dw_r, nw), *db_f2 = fcopy(db_r, OC);
        matmul_backward_ref(dinp_r, dw_r, db_r, dout, inp, w, N, C, OC);
        matmul_backward_f32(dinp_f, dw_f, db_f, dout, inp, w, N, C, OC);
        matmul_backward_f32(dinp_f2, dw_f2, db_f2, dout, inp, w, N, C, OC);
        t_close(nm("mm N%d C%d OC%d dinp", N, C, OC), dinp_f, dinp_r, ni, sum_tol(OC), REF_RTOL);
        t_close(nm("mm N%d C%d OC%d dweight", N, C, OC), dw_f, dw_r, nw, sum_tol(N), REF_RTOL);
        t_close(nm("mm N%d C%d OC%d dbias", N, C, OC), db_f, db_r, OC, sum_tol(N), REF_RTOL);
        same_bits("mm dinp", dinp_f, dinp_f2, ni);
        same_bits("mm dweight", dw_f, dw_f2, nw);
        same_bits("mm dbias", db_f, db_f2, OC);
        // each gradient may be skipped with NULL; the others come out the same
        for (int mask = 0; mask < 7; mask++) {
            float *di = mask & 1 ? NULL : frand(ni, 55, 1.0f);
            float *dw = mask & 2 ? NULL : frand(nw, 56, 1.0f);
            float *db = mask & 4 ? NULL : frand(OC, 57, 1.0f);
            matmul_backward_f32(di, dw, db, dout, inp, w, N, C, OC);
            int ok = (!di || !memcmp(di, dinp_f, ni * 4)) && (!dw || !memcmp(dw, dw_f, nw * 4)) &&
                     (!db || !memcmp(db, db_f, OC * 4));
            t_check(ok, "mm N%d C%d OC%d backward with NULL mask %d differs", N, C, OC, mask);
            free(di), free(dw), free(db);
        }
        free(inp), free(w), free(bias), free(dout), free(dinp_r), free(dw_r), free(db_r);
        free(dinp_f), free(dw_f), free(db_f), free(dinp_f2), free(dw_f2), free(db_f2);
    }

    int N = 3, C = 7, OC = 5;
    size_t ni = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
    float *inp = frand(ni, 61, 1.0f), *w = frand(nw, 62, 1.0f), *bias = frand(OC, 63, 1.0f);
    float *R = frand(no, 64, 1.0f);
    mm_ctx ctx = {
        dcopy(inp, ni), dcopy(w, nw), dcopy(bias, OC), dcopy(R, no), malloc(no * 8), N, C, OC};
    double *g_inp = numgrad(ctx.inp, ni, mm_loss, &ctx);
    double *g_w = numgrad(ctx.w, nw, mm_loss, &ctx);
    double *g_b = numgrad(ctx.bias, OC, mm_loss, &ctx);
    matmul_fwd_d(ctx.out, ctx.inp, ctx.w, ctx.bias, N, C, OC);
    for (int fast = 0; fast < 2; fast++) {
        const char *v = fast ? "fast" : "ref";
        float *out = fnan(no);
        float *dinp0 = frand(ni, 65, 1.0f), *dw0 = frand(nw, 66, 1.0f), *db0 = frand(OC, 67, 1.0f);
        float *dinp = fcopy(dinp0, ni), *dw = fcopy(dw0, nw), *db = fcopy(db0, OC);
        (fast ? matmul_forward_f32 : matmul_forward_ref)(out, inp, w, bias, N, C, OC);
        (fast ? matmul_backward_f32 : matmul_backward_ref)(dinp, dw, db, R, inp, w, N, C, OC);
        check_fwd(nm("mm %s out vs double", v), out, ctx.out, no);
        check_grad(nm("mm %s dinp vs numeric", v), dinp, dinp0, g_inp, ni);
        check_grad(nm("mm %s dweight vs numeric", v), dw, dw0, g_w, nw);
        check_grad(nm("mm %s dbias vs numeric", v), db, db0, g_b, OC);
        free(out), free(dinp0), free(dw0), free(db0), free(dinp), free(dw), free(db);
    }
    free(inp), free(w), free(bias), free(R), free(g_inp), free(g_w), free(g_b);
    free(ctx.inp), free(ctx.w), free(ctx.bias), free(ctx.R), free(ctx.out);
}

// ----------------------------------------------------------------------------
// attention

typedef struct {
    double *qkv, *R, *out, *lse;
    int B, T, NH, NKV, HS;
} att_ctx;

// qkv row width of a shape: NH query heads, NKV key and NKV value heads
static int qkv_width(int NH, int NKV, int HS) {
    return (NH + 2 * NKV) * HS;
}

static void attention_fwd_d(double *out, double *lse, const double *qkv, int B, int T, int NH,
                            int NKV, int HS) {
    int W = qkv_width(NH, NKV, HS), C = NH * HS, group = NH / NKV;
    double scale = 1.0 / sqrt(HS), *s = malloc(T * sizeof *s);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++) {
            size_t koff = (size_t)C + (size_t)(h / group) * HS, voff = koff + (size_t)NKV * HS;
            for (int t = 0; t < T; t++) {
                const double *q = qkv + ((size_t)b * T + t) * W + h * HS;
                double m = -INFINITY, sum = 0.0;
                for (int j = 0; j <= t; j++) {
                    s[j] = scale * dot_d(q, qkv + ((size_t)b * T + j) * W + koff, HS);
                    m = fmax(m, s[j]);
                }
                for (int j = 0; j <= t; j++) sum += exp(s[j] - m);
                // cppcheck-suppress invalidFunctionArg ; j = t ran, so sum >= 1
                lse[((size_t)b * NH + h) * T + t] = m + log(sum);
                double *o = out + ((size_t)b * T + t) * C + h * HS;
                for (int e = 0; e < HS; e++) o[e] = 0.0;
                for (int j = 0; j <= t; j++) {
                    const double *v = qkv + ((size_t)b * T + j) * W + voff;
                    for (int e = 0; e < HS; e++) o[e] += exp(s[j] - m) / sum * v[e];
                }
            }
        }
    free(s);
}

static double att_loss(const void *p) {
    const att_ctx *c = p;
    attention_fwd_d(c->out, c->lse, c->qkv, c->B, c->T, c->NH, c->NKV, c->HS);
    return dot_d(c->out, c->R, (size_t)c->B * c->T * c->NH * c->HS);
}

static float *att_workspace(fl_dtype dt, int T, int HS, int group) {
    return fnan(attention_workspace_floats(dt, T, HS, group) * fl_threads());
}

// B T NH NKV HS of the attention tests: multi-head (NKV = NH) and grouped
// query (NKV < NH, down to one kv head); see test_attention
static const int ATT_SHAPES[][5] = {
    {1, 1, 1, 1, 3},    {2, 5, 3, 3, 5},    {1, 7, 6, 6, 1},    {1, 64, 1, 1, 8},
    {2, 65, 2, 2, 6},   {2, 150, 4, 4, 12}, {1, 1024, 2, 2, 4}, {2, 130, 2, 2, 64},
    {1, 100, 3, 3, 40}, {1, 20, 1, 1, 257}, {2, 7, 4, 2, 8},    {1, 7, 4, 1, 8},
    {2, 65, 6, 2, 5},   {2, 150, 8, 2, 6},  {1, 9, 3, 1, 3},    {1, 200, 4, 2, 64}};
enum { N_ATT_SHAPES = sizeof ATT_SHAPES / sizeof ATT_SHAPES[0] };

static void test_attention(void) {
    printf("attention\n");
    // MHA: T=1; odd HS=5 with NH=3; HS=1; one full row block (64), one plus
    // a row, several blocks with a ragged end; the longest context; GPT-2's
    // HS=64 (the tiles' whole vectors), HS=40 (three vectors, the last
    // ragged), HS=257 (past one packing depth block: OpenBLAS's products).
    // GQA: groups of 2, 4 (NKV=1), 3 with odd HS, 4 over several row
    // blocks, 3 with NKV=1 and odd HS, 2 at HS=64.
    for (int s = 0; s < N_ATT_SHAPES; s++) {
        int B = ATT_SHAPES[s][0], T = ATT_SHAPES[s][1], NH = ATT_SHAPES[s][2];
        int NKV = ATT_SHAPES[s][3], HS = ATT_SHAPES[s][4];
        size_t nqkv = (size_t)B * T * qkv_width(NH, NKV, HS), no = (size_t)B * T * NH * HS;
        size_t nl = (size_t)B * NH * T;
        float *qkv = frand(nqkv, 71, 2.0f), *dout = frand(no, 72, 1.0f),
              *ws = att_workspace(FL_F32, T, HS, NH / NKV);
        float *out_r = fnan(no), *lse_r = fnan(nl), *out_f = fnan(no), *lse_f = fnan(nl);
        float *out_f2 = fnan(no), *lse_f2 = fnan(nl);
        float *dqkv_r = frand(nqkv, 73, 1.0f), *dqkv_f = fcopy(dqkv_r, nqkv);
        float *dqkv_f2 = fcopy(dqkv_r, nqkv);
        attention_forward_ref(out_r, lse_r, qkv, B, T, NH, NKV, HS);
        attention_forward_f32(out_f, lse_f, qkv, ws, B, T, NH, NKV, HS);
        attention_forward_f32(out_f2, lse_f2, qkv, ws, B, T, NH, NKV, HS);
        attention_backward_ref(dqkv_r, dout, qkv, out_r, lse_r, B, T, NH, NKV, HS);
        attention_backward_f32(dqkv_f, dout, qkv, out_f, lse_f, ws, B, T, NH, NKV, HS);
        attention_backward_f32(dqkv_f2, dout, qkv, out_f, lse_f, ws, B, T, NH, NKV, HS);
        // out mixes up to T values of v (|v| <= 2) with weights summing to 1,
        // scores and lse sum HS terms of size <= 4: sum_tol(T + HS); each
        // dqkv entry sums up to T terms of size <~ 4 (|q|, |k|, |v| <= 2): 4x;
        // a kv head's dk and dv sum group * T terms, over its query heads
        int group = NH / NKV;
        t_close(nm("att B%d T%d NH%d NKV%d HS%d out", B, T, NH, NKV, HS), out_f, out_r, no,
                sum_tol(T + HS), REF_RTOL);
        t_close(nm("att B%d T%d NH%d NKV%d HS%d lse", B, T, NH, NKV, HS), lse_f, lse_r, nl,
                sum_tol(T + HS), REF_RTOL);
        t_close(nm("att B%d T%d NH%d NKV%d HS%d dqkv", B, T, NH, NKV, HS), dqkv_f, dqkv_r, nqkv,
                4 * sum_tol(group * T + HS), REF_RTOL);
        same_bits("att out", out_f, out_f2, no);
        same_bits("att lse", lse_f, lse_f2, nl);
        same_bits(nm("att NH%d NKV%d dqkv", NH, NKV), dqkv_f, dqkv_f2, nqkv);
        free(qkv), free(dout), free(ws), free(out_r), free(lse_r), free(out_f), free(lse_f);
        free(out_f2), free(lse_f2), free(dqkv_r), free(dqkv_f), free(dqkv_f2);
    }

    // gradient check: odd head size with three heads, two row blocks; GQA
    // groups of 2 and 4 (NKV=1), 3 with odd HS, and 2 over two row blocks
    int gshapes[][5] = {{2, 5, 3, 3, 5}, {1, 67, 2, 2, 3}, {2, 7, 4, 2, 8},
                        {1, 7, 4, 1, 8}, {1, 5, 6, 2, 3},  {1, 67, 4, 2, 2}};
    for (int s = 0; s < 6; s++) {
        int B = gshapes[s][0], T = gshapes[s][1], NH = gshapes[s][2], NKV = gshapes[s][3];
        int HS = gshapes[s][4];
        size_t nqkv = (size_t)B * T * qkv_width(NH, NKV, HS), no = (size_t)B * T * NH * HS;
        size_t nl = (size_t)B * NH * T;
        // two double forwards per input, each ~B NH T^2 HS multiply-adds
        if (quick_skip(2.0 * nqkv * B * NH * T * T * HS)) continue;
        float *qkv = frand(nqkv, 81, 1.5f), *R = frand(no, 82, 1.0f);
        att_ctx ctx = {
            dcopy(qkv, nqkv), dcopy(R, no), malloc(no * 8), malloc(nl * 8), B, T, NH, NKV, HS};
        double *g = numgrad(ctx.qkv, nqkv, att_loss, &ctx);
        attention_fwd_d(ctx.out, ctx.lse, ctx.qkv, B, T, NH, NKV, HS);
        for (int fast = 0; fast < 2; fast++) {
            const char *v = fast ? "fast" : "ref";
            float *out = fnan(no), *lse = fnan(nl), *ws = att_workspace(FL_F32, T, HS, NH / NKV);
            float *dqkv0 = frand(nqkv, 83, 1.0f), *dqkv = fcopy(dqkv0, nqkv);
            if (fast) {
                attention_forward_f32(out, lse, qkv, ws, B, T, NH, NKV, HS);
                attention_backward_f32(dqkv, R, qkv, out, lse, ws, B, T, NH, NKV, HS);
            } else {
                attention_forward_ref(out, lse, qkv, B, T, NH, NKV, HS);
                attention_backward_ref(dqkv, R, qkv, out, lse, B, T, NH, NKV, HS);
            }
            check_fwd(nm("att %s T%d NH%d NKV%d out vs double", v, T, NH, NKV), out, ctx.out, no);
            check_fwd(nm("att %s T%d NH%d NKV%d lse vs double", v, T, NH, NKV), lse, ctx.lse, nl);
            check_grad(nm("att %s T%d NH%d NKV%d dqkv vs numeric", v, T, NH, NKV), dqkv, dqkv0, g,
                       nqkv);
            free(out), free(lse), free(ws), free(dqkv0), free(dqkv);
        }
        free(qkv), free(R), free(g), free(ctx.qkv), free(ctx.R), free(ctx.out), free(ctx.lse);
    }
}

// Forks a child under FITLM_ISA=cap: returns 1 in the child, which does its
// part and _exits; 0 in the parent once the child has exited, checked. The
// parent must not have read the CPU's features (fl_cpu caches them).
static int in_child_under_cap(const char *cap, const char *what) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        setenv("FITLM_ISA", cap, 1);
        return 1;
    }
    int status = 0;
    if (pid > 0) waitpid(pid, &status, 0);
    t_check(pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s %s-path child failed",
            what, cap);
    return 0;
}

// The softmax loops of every ISA the CPU has, on the same inputs: each runs
// in a child forked before any OpenMP thread exists (fl_cpu() reads
// FITLM_ISA once per process) and leaves out, lse and dqkv in shared memory.
// AVX2 and AVX-512 run tiles that sum every product in the same order, and
// loops that sum the same 16 lanes in the same order with exp256 == exp512,
// hence the same bits. The portable path's products are OpenBLAS's: a score
// sums its HS terms (each <= 4 / sqrt(HS) in size) in another order, which
// moves it by ~sqrt(HS) * 4 / sqrt(HS) u = 4 u (independent roundings), and
// P by as much in relative terms; its loops use expf (exp512 is within ~1
// ulp of it) and sum in another order. A row's sum of n positive
// terms then differs by ~sqrt(n) u in relative terms (independent roundings;
// n u is the adversarial worst case), and so do its P, lse, out (weights of
// |v| <= 2) and the gradients that sum such P. Allow 4 sqrt(T) u (~1 ulp
// per 16 keys, 10x what is seen), scaled by what is summed: max|v| = 2 for
// out, 1 for lse plus the rounding of max + log(sum), and for dqkv the 4 of
// test_attention's bound (over the group's heads for dk, dv).
static void test_attention_isas(int avx2, int avx512) {
    printf("attention paths\n");
    const char *caps[] = {"portable", "avx2", "avx512"};
    int have[] = {1, avx2, avx512},
        shapes[][5] = {{2, 150, 8, 2, 6}, {1, 300, 4, 4, 29}, {1, 200, 4, 2, 64}};
    for (int s = 0; s < 3; s++) {
        int B = shapes[s][0], T = shapes[s][1], NH = shapes[s][2], NKV = shapes[s][3];
        int HS = shapes[s][4];
        size_t nqkv = (size_t)B * T * qkv_width(NH, NKV, HS), no = (size_t)B * T * NH * HS;
        size_t nl = (size_t)B * NH * T, nres = no + nl + nqkv;
        float *qkv = frand(nqkv, 91, 2.0f), *dout = frand(no, 92, 1.0f),
              *dqkv0 = frand(nqkv, 93, 1.0f);
        float *out_r = fnan(no), *lse_r = fnan(nl);
        // the backwards all start from the same out and lse
        attention_forward_ref(out_r, lse_r, qkv, B, T, NH, NKV, HS);
        float *res = mmap(NULL, 3 * nres * sizeof *res, PROT_READ | PROT_WRITE,
                          MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        t_check(res != MAP_FAILED, "mmap failed");
        if (res == MAP_FAILED) return;
        for (int k = 0; k < 3; k++) {
            if (!have[k] || !in_child_under_cap(caps[k], "attention")) continue;
            float *out = res + k * nres, *lse = out + no, *dqkv = lse + nl;
            float *ws = att_workspace(FL_F32, T, HS, NH / NKV);
            memcpy(dqkv, dqkv0, nqkv * sizeof *dqkv);
            attention_forward_f32(out, lse, qkv, ws, B, T, NH, NKV, HS);
            attention_backward_f32(dqkv, dout, qkv, out_r, lse_r, ws, B, T, NH, NKV, HS);
            _exit(0);
        }
        double tol = 4 * sqrt(T) * 0x1p-24;
        const float *out_s = res, *lse_s = out_s + no, *dqkv_s = lse_s + nl;
        for (int k = 1; k < 3; k++) {
            if (!have[k]) continue;
            const float *out = res + k * nres, *lse = out + no, *dqkv = lse + nl;
            t_close(nm("att %s T%d NH%d NKV%d HS%d out vs scalar", caps[k], T, NH, NKV, HS), out,
                    out_s, no, 2 * tol, 0.0);
            t_close(nm("att %s T%d NH%d NKV%d HS%d lse vs scalar", caps[k], T, NH, NKV, HS), lse,
                    lse_s, nl, tol, 0x1p-23);
            t_close(nm("att %s T%d NH%d NKV%d HS%d dqkv vs scalar", caps[k], T, NH, NKV, HS), dqkv,
                    dqkv_s, nqkv, 4 * (NH / NKV) * tol, 0.0);
        }
        if (have[1] && have[2])
            same_bits(nm("att T%d NH%d NKV%d HS%d avx2 vs avx512", T, NH, NKV, HS), res + nres,
                      res + 2 * nres, nres);
        munmap(res, 3 * nres * sizeof *res);
        free(qkv), free(dout), free(dqkv0), free(out_r), free(lse_r);
    }
}

// ----------------------------------------------------------------------------
// gelu and residual

// The SIMD paths of gelu and softmax_xent (AVX-512 and AVX2) are designed to
// give the same bits. exp512 and exp256 are checked against each other lane
// for lane; both, and the kernels' SIMD outputs, against exp_model and the
// models below, scalar copies of the same operations (fmaf is the FMA
// instructions' single rounding), so AVX2 and AVX-512 agree bit for bit even
// though each run of this program sees only one of them.

// exp512 and exp256 for finite and infinite x (NaN: see test_exp_lanes)
static float exp_model(float x) {
    int keep = !(x < -80.0f); // results below e^-80 are flushed to 0
    x = x < -80.0f ? -80.0f : x > 89.0f ? 89.0f : x;
    float k = nearbyintf(x * 1.44269504f);
    float r = fmaf(-k, 0.693359375f, x);
    r = fmaf(-k, -2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r + 1.0f);
    return keep ? ldexpf(p, (int)k) : 0.0f;
}

#if FL_HAVE_X86_SIMD
__attribute__((target("avx512f"))) static void exp512_all(float *y, const float *x, size_t n) {
    for (size_t i = 0; i < n; i += 16) _mm512_storeu_ps(y + i, exp512(_mm512_loadu_ps(x + i)));
}

__attribute__((target("avx2,fma"))) static void exp256_all(float *y, const float *x, size_t n) {
    for (size_t i = 0; i < n; i += 8) _mm256_storeu_ps(y + i, exp256(_mm256_loadu_ps(x + i)));
}
#endif

// A dense sweep of [-100, 100], steps of single ulps around the flush point
// -80 and the overflow point 88.72, a strided walk over all 2^32 bit
// patterns (every exponent, subnormals, NaN payloads), and the specials.
static void test_exp_lanes(void) {
    enum { DENSE = 2000001, ULPS = 4096, STRIDE = 4099 };
    size_t cap = DENSE + 4 * ULPS + (0x100000000ull / STRIDE + 1) + 16, n = 0;
    cap = (cap + 15) / 16 * 16; // whole 16-lane blocks, zero-padded
    float *x = calloc(cap, sizeof *x), *want = malloc(cap * sizeof *want);
    for (int i = 0; i < DENSE; i++) x[n++] = -100.0f + 200.0f * (float)i / (DENSE - 1);
    float edges[2] = {-80.0f, 88.72283935546875f}; // 88.722839: the largest finite expf
    for (int e = 0; e < 2; e++) {
        float up = edges[e], down = edges[e];
        for (int i = 0; i < ULPS; i++) {
            x[n++] = up = nextafterf(up, INFINITY);
            x[n++] = down = nextafterf(down, -INFINITY);
        }
    }
    for (uint64_t b = 0; b < 0x100000000ull; b += STRIDE) {
        uint32_t u = (uint32_t)b;
        memcpy(&x[n++], &u, sizeof u);
    }
    float specials[] = {
        0.0f,  -0.0f,      INFINITY, -INFINITY, NAN,     -NAN,    -80.0f, 88.72283935546875f,
        89.0f, -87.33654f, 1e-45f,   -1e-45f,   FLT_MAX, -FLT_MAX};
    for (size_t i = 0; i < sizeof specials / sizeof *specials; i++) x[n++] = specials[i];
    for (size_t i = 0; i < cap; i++) want[i] = isnan(x[i]) ? NAN : exp_model(x[i]);
#if FL_HAVE_X86_SIMD
    int avx2 = t_cpu_avx2();
    int avx512 = __builtin_cpu_supports("avx512f");
    float *y512 = malloc(cap * sizeof *y512), *y256 = malloc(cap * sizeof *y256);
    if (avx512) exp512_all(y512, x, cap);
    if (avx2) exp256_all(y256, x, cap);
    for (int v = 0; v < 2; v++) {
        const float *y = v ? y256 : y512;
        if (!(v ? avx2 : avx512)) continue;
        size_t diff = 0, first = 0;
        int nan_ok = 1;
        for (size_t i = 0; i < cap; i++) {
            if (isnan(x[i])) {
                nan_ok &= isnan(y[i]) != 0;
                continue;
            }
            if (memcmp(&y[i], &want[i], sizeof(float)) != 0 && !diff++) first = i;
        }
        t_check(diff == 0, "%s vs exp_model: %zu of %zu differ, first x = %a: %a vs %a",
                v ? "exp256" : "exp512", diff, cap, x[first], y[first], want[first]);
        t_check(nan_ok, "%s: NaN in, NaN out", v ? "exp256" : "exp512");
    }
    if (avx2 && avx512)
        t_check(memcmp(y512, y256, cap * sizeof *y512) == 0,
                "exp256 vs exp512: %zu values (NaNs too) differ in some bit", cap);
    free(y512), free(y256);
#endif
    free(x), free(want);
}

// the kernels' SIMD GELU: s = 1 / (1 + exp(-2|u|)) (or its complement), as in gelu.c
#define GELU_S 0.7978845608028654f // sqrt(2/pi)
#define GELU_K 0.044715f

static void gelu_sigmoid_model(float x, float *s, float *s1s) {
    float u = (x * GELU_S) * fmaf(x * x, GELU_K, 1.0f);
    float a = exp_model(-2.0f * fabsf(u));
    float r = 1.0f / (1.0f + a), ar = a * r;
    *s = u < 0.0f ? ar : r;
    *s1s = ar * r;
}

static void gelu_forward_model(float *out, const float *inp, size_t N) {
    for (size_t i = 0; i < N; i++) {
        float s, s1s;
        gelu_sigmoid_model(inp[i], &s, &s1s);
        out[i] = inp[i] * s;
    }
}

static void gelu_backward_model(float *dinp, const float *inp, const float *dout, size_t N) {
    for (size_t i = 0; i < N; i++) {
        float x = inp[i], s, s1s;
        gelu_sigmoid_model(x, &s, &s1s);
        float du2 = fmaf(x * x, 6.0f * GELU_K * GELU_S, 2.0f * GELU_S);
        dinp[i] = fmaf(fmaf(x * s1s, du2, s), dout[i], dinp[i]);
    }
}

// the fast kernels use SIMD (and should match the models) unless capped to portable
static int simd_paths(void) {
    return fl_cpu()->avx512f || (fl_cpu()->avx2 && fl_cpu()->fma);
}

static void same_as_model(const char *name, const float *got, const float *model, size_t n) {
    size_t i = 0;
    while (i < n && memcmp(&got[i], &model[i], sizeof *got) == 0) i++;
    t_check(i == n, "%s (%s path) differs from its SIMD model at %zu: %a vs %a", name,
            fl_isa_name(fl_cpu_isa()), i, i < n ? got[i] : 0.0f, i < n ? model[i] : 0.0f);
}

typedef struct {
    double *x, *R, *out;
    size_t N;
} gelu_ctx;

static double gelu_loss(const void *p) {
    const gelu_ctx *c = p;
    for (size_t i = 0; i < c->N; i++) {
        double x = c->x[i];
        c->out[i] = 0.5 * x * (1.0 + tanh(sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x)));
    }
    return dot_d(c->out, c->R, c->N);
}

static void test_gelu(void) {
    printf("gelu\n");
    test_exp_lanes(); // GELU's and softmax_xent's SIMD paths rest on it
    // elementwise: the SIMD path's exp is ~1 ulp, but the reference's
    // 1 + tanh(u) cancels for negative x, to ~|x| u / 2 absolute: 1e-6
    size_t sizes[] = {1, 7, 33, 100003};
    for (int s = 0; s < 4; s++) {
        size_t N = sizes[s];
        float *x = frand(N, 91, 6.0f), *dout = frand(N, 92, 1.0f);
        float *out_r = fnan(N), *out_f = fnan(N), *out_f2 = fnan(N);
        float *dx_r = frand(N, 93, 1.0f), *dx_f = fcopy(dx_r, N), *dx_f2 = fcopy(dx_r, N);
        gelu_forward_ref(out_r, x, N);
        gelu_forward_f32(out_f, x, N);
        gelu_forward_f32(out_f2, x, N);
        gelu_backward_ref(dx_r, x, dout, N);
        gelu_backward_f32(dx_f, x, dout, N);
        gelu_backward_f32(dx_f2, x, dout, N);
        t_close(nm("gelu N%zu out", N), out_f, out_r, N, 1e-6, REF_RTOL);
        t_close(nm("gelu N%zu dinp", N), dx_f, dx_r, N, 1e-6, REF_RTOL);
        same_bits("gelu out", out_f, out_f2, N);
        same_bits("gelu dinp", dx_f, dx_f2, N);
        if (simd_paths()) {
            float *out_m = fnan(N), *dx_m = frand(N, 93, 1.0f);
            gelu_forward_model(out_m, x, N);
            gelu_backward_model(dx_m, x, dout, N);
            same_as_model(nm("gelu N%zu out", N), out_f, out_m, N);
            same_as_model(nm("gelu N%zu dinp", N), dx_f, dx_m, N);
            free(out_m), free(dx_m);
        }
        free(x), free(dout), free(out_r), free(out_f), free(out_f2), free(dx_r), free(dx_f);
        free(dx_f2);
    }

    // tails, zeros and a denormal: both versions stay finite and agree
    enum { NX = 20 };
    float xs[NX] = {0.0f,  -0.0f, 1e-30f, -1e-30f, 1e-40f, 0.5f,   -0.5f,   3.0f, -3.0f, 5.0f,
                    -5.0f, 9.5f,  -9.5f,  20.0f,   -20.0f, 100.0f, -100.0f, 1e4f, -1e4f, 3e12f};
    float ones[NX], out_r[NX], out_f[NX], dx_r[NX] = {0}, dx_f[NX] = {0};
    size_t nx = NX;
    for (size_t i = 0; i < nx; i++) ones[i] = 1.0f;
    gelu_forward_ref(out_r, xs, nx);
    gelu_forward_f32(out_f, xs, nx);
    gelu_backward_ref(dx_r, xs, ones, nx);
    gelu_backward_f32(dx_f, xs, ones, nx);
    t_close("gelu special out", out_f, out_r, nx, 1e-6, REF_RTOL);
    t_close("gelu special dinp", dx_f, dx_r, nx, 1e-6, REF_RTOL);
    if (simd_paths()) {
        float out_m[NX], dx_m[NX] = {0};
        gelu_forward_model(out_m, xs, nx);
        gelu_backward_model(dx_m, xs, ones, nx);
        same_as_model("gelu special out", out_f, out_m, nx);
        same_as_model("gelu special dinp", dx_f, dx_m, nx);
    }

    // |x| up to 5 reaches the saturated tails
    size_t N = 64;
    float *x = frand(N, 94, 5.0f), *R = frand(N, 95, 1.0f);
    gelu_ctx ctx = {dcopy(x, N), dcopy(R, N), malloc(N * 8), N};
    double *g = numgrad(ctx.x, N, gelu_loss, &ctx);
    gelu_loss(&ctx);
    for (int fast = 0; fast < 2; fast++) {
        const char *v = fast ? "fast" : "ref";
        float *out = fnan(N), *dx0 = frand(N, 96, 1.0f), *dx = fcopy(dx0, N);
        (fast ? gelu_forward_f32 : gelu_forward_ref)(out, x, N);
        (fast ? gelu_backward_f32 : gelu_backward_ref)(dx, x, R, N);
        check_fwd(nm("gelu %s out vs double", v), out, ctx.out, N);
        check_grad(nm("gelu %s dinp vs numeric", v), dx, dx0, g, N);
        free(out), free(dx0), free(dx);
    }
    free(x), free(R), free(g), free(ctx.x), free(ctx.R), free(ctx.out);
}

typedef struct {
    double *a, *b, *R, *out;
    size_t N;
} res_ctx;

static double res_loss(const void *p) {
    const res_ctx *c = p;
    for (size_t i = 0; i < c->N; i++) c->out[i] = c->a[i] + c->b[i];
    return dot_d(c->out, c->R, c->N);
}

static void test_residual(void) {
    printf("residual\n");
    // one float addition per element in both versions: exact agreement
    size_t sizes[] = {1, 7, 33, 100003};
    for (int s = 0; s < 4; s++) {
        size_t N = sizes[s];
        float *a = frand(N, 101, 1.0f), *b = frand(N, 102, 1.0f), *dout = frand(N, 103, 1.0f);
        float *out_r = fnan(N), *out_f = fnan(N), *out_f2 = fnan(N);
        float *da_r = frand(N, 104, 1.0f), *db_r = frand(N, 105, 1.0f);
        float *da_f = fcopy(da_r, N), *db_f = fcopy(db_r, N);
        float *da_f2 = fcopy(da_r, N), *db_f2 = fcopy(db_r, N);
        residual_forward_ref(out_r, a, b, N);
        residual_forward_f32(out_f, a, b, N);
        residual_forward_f32(out_f2, a, b, N);
        residual_backward_ref(da_r, db_r, dout, N);
        residual_backward_f32(da_f, db_f, dout, N);
        residual_backward_f32(da_f2, db_f2, dout, N);
        t_close(nm("res N%zu out", N), out_f, out_r, N, 0, 0);
        t_close(nm("res N%zu da", N), da_f, da_r, N, 0, 0);
        t_close(nm("res N%zu db", N), db_f, db_r, N, 0, 0);
        same_bits("res out", out_f, out_f2, N);
        same_bits("res da", da_f, da_f2, N);
        same_bits("res db", db_f, db_f2, N);
        free(a), free(b), free(dout), free(out_r), free(out_f), free(out_f2);
        free(da_r), free(db_r), free(da_f), free(db_f), free(da_f2), free(db_f2);
    }

    size_t N = 13;
    float *a = frand(N, 111, 1.0f), *b = frand(N, 112, 1.0f), *R = frand(N, 113, 1.0f);
    res_ctx ctx = {dcopy(a, N), dcopy(b, N), dcopy(R, N), malloc(N * 8), N};
    double *g_a = numgrad(ctx.a, N, res_loss, &ctx), *g_b = numgrad(ctx.b, N, res_loss, &ctx);
    res_loss(&ctx);
    for (int fast = 0; fast < 2; fast++) {
        const char *v = fast ? "fast" : "ref";
        float *out = fnan(N), *da0 = frand(N, 114, 1.0f), *db0 = frand(N, 115, 1.0f);
        float *da = fcopy(da0, N), *db = fcopy(db0, N);
        (fast ? residual_forward_f32 : residual_forward_ref)(out, a, b, N);
        (fast ? residual_backward_f32 : residual_backward_ref)(da, db, R, N);
        check_fwd(nm("res %s out vs double", v), out, ctx.out, N);
        check_grad(nm("res %s da vs numeric", v), da, da0, g_a, N);
        check_grad(nm("res %s db vs numeric", v), db, db0, g_b, N);
        free(out), free(da0), free(db0), free(da), free(db);
    }
    free(a), free(b), free(R), free(g_a), free(g_b), free(ctx.a), free(ctx.b), free(ctx.R);
    free(ctx.out);
}

// ----------------------------------------------------------------------------
// softmax + cross-entropy

typedef struct {
    double *logits, *dl, *losses, *lse;
    const int *targets;
    int N, V, Vp;
} xent_ctx;

static void xent_fwd_d(double *losses, double *lse, const double *logits, const int *targets, int N,
                       int V, int Vp) {
    for (int i = 0; i < N; i++) {
        const double *x = logits + (size_t)i * Vp;
        double m = -INFINITY, sum = 0.0;
        for (int j = 0; j < V; j++) m = fmax(m, x[j]);
        for (int j = 0; j < V; j++) sum += exp(x[j] - m);
        // cppcheck-suppress invalidFunctionArg ; V >= 1, so sum >= 1
        lse[i] = m + log(sum);
        losses[i] = targets[i] < 0 ? 0.0 : lse[i] - x[targets[i]];
    }
}

static double xent_loss(const void *p) {
    const xent_ctx *c = p;
    xent_fwd_d(c->losses, c->lse, c->logits, c->targets, c->N, c->V, c->Vp);
    return dot_d(c->losses, c->dl, c->N);
}

// The kernels' SIMD softmax_xent on fp32 rows: the exps summed in double per
// lane of 16, and the lanes added as _mm512_reduce_add_pd(lo + hi) does
// (8 -> 4 -> 2 -> 1 by halves). The order of the double additions hardly
// ever shows in the float lse (a sequential sum passes too); the exps and
// the elementwise gradient are what these checks pin down.
static void xent_forward_model(float *losses, float *lse, const float *logits, const int *targets,
                               int N, int V, int Vp) {
    for (int i = 0; i < N; i++) {
        const float *x = logits + (size_t)i * Vp;
        float m = -INFINITY;
        for (int j = 0; j < V; j++) m = fmaxf(m, x[j]);
        double acc[16] = {0}, v[8], t[4];
        for (int j = 0; j < V; j++) acc[j % 16] += exp_model(x[j] - m);
        for (int q = 0; q < 8; q++) v[q] = acc[q] + acc[q + 8];
        for (int q = 0; q < 4; q++) t[q] = v[q + 4] + v[q];
        lse[i] = m + (float)log((t[2] + t[0]) + (t[3] + t[1]));
        losses[i] = targets[i] < 0 ? 0.0f : lse[i] - x[targets[i]];
    }
}

static void xent_backward_model(float *dlogits, const float *logits, const float *lse,
                                const int *targets, const float *dlosses, int N, int V, int Vp) {
    for (int i = 0; i < N; i++) {
        const float *x = logits + (size_t)i * Vp;
        float *dx = dlogits + (size_t)i * Vp;
        int target = targets[i];
        for (int j = 0; j < Vp; j++)
            dx[j] = target < 0 || j >= V ? 0.0f : dlosses[i] * exp_model(x[j] - lse[i]);
        if (target >= 0) dx[target] = dlosses[i] * (expf(x[target] - lse[i]) - 1.0f);
    }
}

// fast kernels vs the SIMD models, bit for bit (dlogits from the kernel's lse)
static void xent_vs_model(const char *name, const float *losses, const float *lse,
                          const float *dlogits, const float *logits, const int *targets,
                          const float *dl, int N, int V, int Vp) {
    size_t n = (size_t)N * Vp;
    char base[96]; // name may be nm()'s buffer, which the calls below reuse
    snprintf(base, sizeof base, "%s", name);
    float *loss_m = fnan(N), *lse_m = fnan(N), *dx_m = fnan(n);
    xent_forward_model(loss_m, lse_m, logits, targets, N, V, Vp);
    xent_backward_model(dx_m, logits, lse, targets, dl, N, V, Vp);
    same_as_model(nm("%s losses", base), losses, loss_m, N);
    same_as_model(nm("%s lse", base), lse, lse_m, N);
    same_as_model(nm("%s dlogits", base), dlogits, dx_m, n);
    free(loss_m), free(lse_m), free(dx_m);
}

static void test_softmax_xent(void) {
    printf("softmax_xent\n");
    int shapes[][3] = {{1, 1, 1}, {1, 5, 8}, {7, 33, 48}, {64, 1000, 1024}, {3, 50257, 50304}};
    for (int s = 0; s < 5; s++) {
        int N = shapes[s][0], V = shapes[s][1], Vp = shapes[s][2];
        size_t n = (size_t)N * Vp;
        float *logits = frand(n, 121, 8.0f), *dl = frand(N, 122, 1.0f);
        int *targets = tokens(N, 123 + s, -1, V - 1); // some rows ignored
        float *loss_r = fnan(N), *lse_r = fnan(N), *loss_f = fnan(N), *lse_f = fnan(N);
        float *loss_f2 = fnan(N), *lse_f2 = fnan(N);
        float *dx_r = fnan(n), *dx_f = fnan(n), *dx_f2 = fnan(n); // overwritten, never read
        softmax_xent_forward_ref(loss_r, lse_r, logits, targets, N, V, Vp);
        softmax_xent_forward_f32(loss_f, lse_f, logits, targets, N, V, Vp);
        softmax_xent_forward_f32(loss_f2, lse_f2, logits, targets, N, V, Vp);
        softmax_xent_backward_ref(dx_r, logits, lse_r, targets, dl, N, V, Vp);
        softmax_xent_backward_f32(dx_f, logits, lse_f, targets, dl, N, V, Vp);
        softmax_xent_backward_f32(dx_f2, logits, lse_f, targets, dl, N, V, Vp);
        // lse ~ 8 + log V; gradients are dloss * p with errors of a few u * p
        t_close(nm("xent N%d V%d losses", N, V), loss_f, loss_r, N, 1e-5, REF_RTOL);
        t_close(nm("xent N%d V%d lse", N, V), lse_f, lse_r, N, 1e-5, REF_RTOL);
        t_close(nm("xent N%d V%d dlogits", N, V), dx_f, dx_r, n, 1e-7, REF_RTOL);
        same_bits("xent losses", loss_f, loss_f2, N);
        same_bits("xent dlogits", dx_f, dx_f2, n);
        if (simd_paths())
            xent_vs_model(nm("xent N%d V%d", N, V), loss_f, lse_f, dx_f, logits, targets, dl, N, V,
                          Vp);
        // in place: the logits buffer becomes its own gradient
        float *buf = fcopy(logits, n);
        softmax_xent_backward_f32(buf, buf, lse_f, targets, dl, N, V, Vp);
        same_bits("xent in-place fast", buf, dx_f, n);
        memcpy(buf, logits, n * sizeof *buf);
        softmax_xent_backward_ref(buf, buf, lse_r, targets, dl, N, V, Vp);
        same_bits("xent in-place ref", buf, dx_r, n);
        int ignored_ok = 1;
        for (int i = 0; i < N; i++) {
            if (targets[i] >= 0) continue;
            ignored_ok &= loss_f[i] == 0.0f && loss_r[i] == 0.0f;
            for (int j = 0; j < Vp; j++) ignored_ok &= dx_f[(size_t)i * Vp + j] == 0.0f;
        }
        t_check(ignored_ok, "xent N%d V%d: ignored rows must give loss 0 and gradient 0", N, V);
        free(logits), free(dl), free(targets), free(loss_r), free(lse_r), free(loss_f);
        free(lse_f), free(loss_f2), free(lse_f2), free(dx_r), free(dx_f), free(dx_f2), free(buf);
    }

    {
        // flat row, one dominant logit (p = 1 - tiny at the target), and a
        // spread where most exps underflow to 0
        enum { SN = 3, SV = 37, SVP = 48 };
        float x[SN * SVP], loss_r[SN], lse_r[SN], loss_f[SN], lse_f[SN],
            dl[SN] = {1.0f, -2.0f, 0.5f};
        float dx_r[SN * SVP], dx_f[SN * SVP];
        int tg[SN] = {5, 36, 0};
        for (int j = 0; j < SVP; j++) {
            x[j] = 0.0f;
            x[SVP + j] = j == 36 ? 60.0f : -60.0f;
            x[2 * SVP + j] = 160.0f * (j % 7) / 6.0f - 80.0f;
        }
        softmax_xent_forward_ref(loss_r, lse_r, x, tg, SN, SV, SVP);
        softmax_xent_forward_f32(loss_f, lse_f, x, tg, SN, SV, SVP);
        softmax_xent_backward_ref(dx_r, x, lse_r, tg, dl, SN, SV, SVP);
        softmax_xent_backward_f32(dx_f, x, lse_f, tg, dl, SN, SV, SVP);
        t_close("xent special losses", loss_f, loss_r, SN, 1e-5, REF_RTOL);
        t_close("xent special lse", lse_f, lse_r, SN, 1e-5, REF_RTOL);
        t_close("xent special dlogits", dx_f, dx_r, SN * SVP, 1e-7, REF_RTOL);
        if (simd_paths())
            xent_vs_model("xent special", loss_f, lse_f, dx_f, x, tg, dl, SN, SV, SVP);
    }

    int N = 4, V = 7, Vp = 9, targets[] = {2, -1, 0, 6};
    size_t n = (size_t)N * Vp;
    float *logits = frand(n, 131, 3.0f), *dl = frand(N, 132, 1.0f);
    xent_ctx ctx = {
        dcopy(logits, n), dcopy(dl, N), malloc(N * 8), malloc(N * 8), targets, N, V, Vp};
    double *g = numgrad(ctx.logits, n, xent_loss, &ctx);
    xent_loss(&ctx);
    for (int fast = 0; fast < 2; fast++) {
        const char *v = fast ? "fast" : "ref";
        float *losses = fnan(N), *lse = fnan(N), *dx = fnan(n), *zero = calloc(n, sizeof *zero);
        (fast ? softmax_xent_forward_f32 : softmax_xent_forward_ref)(losses, lse, logits, targets,
                                                                     N, V, Vp);
        (fast ? softmax_xent_backward_f32 : softmax_xent_backward_ref)(dx, logits, lse, targets, dl,
                                                                       N, V, Vp);
        check_fwd(nm("xent %s losses vs double", v), losses, ctx.losses, N);
        check_fwd(nm("xent %s lse vs double", v), lse, ctx.lse, N);
        check_grad(nm("xent %s dlogits vs numeric", v), dx, zero, g, n); // overwrites
        free(losses), free(lse), free(dx), free(zero);
    }
    free(logits), free(dl), free(g), free(ctx.logits), free(ctx.dl), free(ctx.losses);
    free(ctx.lse);
}

// ----------------------------------------------------------------------------
// rmsnorm

typedef struct {
    double *inp, *w, *R, *out;
    int N, C;
    double eps;
} rms_ctx;

static void rmsnorm_fwd_d(double *out, const double *inp, const double *w, int N, int C,
                          double eps) {
    for (int n = 0; n < N; n++) {
        const double *x = inp + (size_t)n * C;
        double ms = 0.0;
        for (int i = 0; i < C; i++) ms += x[i] * x[i] / C;
        double r = 1.0 / sqrt(ms + eps);
        for (int i = 0; i < C; i++) out[(size_t)n * C + i] = x[i] * r * w[i];
    }
}

static double rms_loss(const void *p) {
    const rms_ctx *c = p;
    rmsnorm_fwd_d(c->out, c->inp, c->w, c->N, c->C, c->eps);
    return dot_d(c->out, c->R, (size_t)c->N * c->C);
}

static void test_rmsnorm(void) {
    printf("rmsnorm\n");
    // N C: one channel, odd C, two channel blocks with a ragged end, GPT-2's C
    int shapes[][2] = {{1, 1}, {1, 7}, {5, 33}, {3, 16}, {7, 130}, {64, 768}};
    for (int s = 0; s < 6; s++) {
        int N = shapes[s][0], C = shapes[s][1];
        size_t n = (size_t)N * C;
        float eps = 1e-5f;
        float *inp = frand(n, 161, 2.0f), *w = frand(C, 162, 1.0f), *dout = frand(n, 163, 1.0f);
        float *out_r = fnan(n), *rstd_r = fnan(N), *out_f = fnan(n), *rstd_f = fnan(N);
        float *out_f2 = fnan(n), *rstd_f2 = fnan(N);
        float *dinp_r = frand(n, 164, 1.0f), *dw_r = frand(C, 165, 1.0f);
        float *dinp_f = fcopy(dinp_r, n), *dw_f = fcopy(dw_r, C);
        float *dinp_f2 = fcopy(dinp_r, n), *dw_f2 = fcopy(dw_r, C);
        rmsnorm_forward_ref(out_r, rstd_r, inp, w, N, C, eps);
        rmsnorm_forward_f32(out_f, rstd_f, inp, w, N, C, eps);
        rmsnorm_forward_f32(out_f2, rstd_f2, inp, w, N, C, eps);
        rmsnorm_backward_ref(dinp_r, dw_r, dout, inp, w, rstd_r, N, C);
        rmsnorm_backward_f32(dinp_f, dw_f, dout, inp, w, rstd_f, N, C);
        rmsnorm_backward_f32(dinp_f2, dw_f2, dout, inp, w, rstd_f, N, C);
        // as layernorm: C-term sums per row, N-term sums for the weight
        t_close(nm("rms N%d C%d out", N, C), out_f, out_r, n, sum_tol(C), REF_RTOL);
        t_close(nm("rms N%d C%d rstd", N, C), rstd_f, rstd_r, N, sum_tol(C), REF_RTOL);
        t_close(nm("rms N%d C%d dinp", N, C), dinp_f, dinp_r, n, sum_tol(C), REF_RTOL);
        t_close(nm("rms N%d C%d dweight", N, C), dw_f, dw_r, C, sum_tol(N), REF_RTOL);
        same_bits("rms out", out_f, out_f2, n);
        same_bits("rms rstd", rstd_f, rstd_f2, N);
        same_bits("rms dinp", dinp_f, dinp_f2, n);
        same_bits("rms dweight", dw_f, dw_f2, C);
        free(inp), free(w), free(dout), free(out_r), free(rstd_r), free(out_f), free(rstd_f);
        free(out_f2), free(rstd_f2), free(dinp_r), free(dw_r), free(dinp_f), free(dw_f);
        free(dinp_f2), free(dw_f2);
    }

    // above FL_PAR_MIN_VALUES the threads split the rows, then the weight
    // gradient's channels (in ranges of whole blocks, a ragged one last): the
    // bits of one thread
    {
        int N = 1024, C = 520, threads = omp_get_max_threads();
        size_t n = (size_t)N * C;
        float *inp = frand(n, 166, 2.0f), *w = frand(C, 167, 1.0f), *dout = frand(n, 168, 1.0f);
        float *out[2], *rstd[2], *dinp[2], *dw[2];
        for (int k = 0; k < 2; k++) {
            omp_set_num_threads(k ? 1 : threads);
            out[k] = fnan(n), rstd[k] = fnan(N), dinp[k] = frand(n, 169, 1.0f);
            dw[k] = frand(C, 170, 1.0f);
            rmsnorm_forward_f32(out[k], rstd[k], inp, w, N, C, 1e-5f);
            rmsnorm_backward_f32(dinp[k], dw[k], dout, inp, w, rstd[k], N, C);
        }
        omp_set_num_threads(threads);
        t_check(!memcmp(out[0], out[1], n * 4) && !memcmp(rstd[0], rstd[1], N * 4) &&
                    !memcmp(dinp[0], dinp[1], n * 4) && !memcmp(dw[0], dw[1], C * 4),
                "rms N%d C%d: %d threads and one differ", N, C, threads);
        free(inp), free(w), free(dout);
        for (int k = 0; k < 2; k++) free(out[k]), free(rstd[k]), free(dinp[k]), free(dw[k]);
    }

    // N, C, input scale, eps: the tiny scale gives mean(x^2) ~ 1e-5, where
    // a wrong or missing eps shows; LLaMA uses eps 1e-5 and 1e-6
    struct {
        int N, C;
        float scale, eps;
    } gshapes[] = {{3, 7, 2.0f, 1e-5f}, {2, 33, 2.0f, 1e-6f}, {2, 16, 0.005f, 1e-5f}};
    for (int s = 0; s < 3; s++) {
        int N = gshapes[s].N, C = gshapes[s].C;
        float sc = gshapes[s].scale, eps = gshapes[s].eps;
        size_t n = (size_t)N * C;
        float *inp = frand(n, 171, sc), *w = frand(C, 172, 1.0f), *R = frand(n, 173, 1.0f);
        rms_ctx ctx = {dcopy(inp, n), dcopy(w, C), dcopy(R, n), malloc(n * 8), N, C, eps};
        double *g_inp = numgrad(ctx.inp, n, rms_loss, &ctx);
        double *g_w = numgrad(ctx.w, C, rms_loss, &ctx);
        rmsnorm_fwd_d(ctx.out, ctx.inp, ctx.w, N, C, eps);
        for (int fast = 0; fast < 2; fast++) {
            const char *v = fast ? "fast" : "ref";
            float *out = fnan(n), *rstd = fnan(N);
            float *dinp0 = frand(n, 174, 1.0f), *dw0 = frand(C, 175, 1.0f);
            float *dinp = fcopy(dinp0, n), *dw = fcopy(dw0, C);
            (fast ? rmsnorm_forward_f32 : rmsnorm_forward_ref)(out, rstd, inp, w, N, C, eps);
            (fast ? rmsnorm_backward_f32 : rmsnorm_backward_ref)(dinp, dw, R, inp, w, rstd, N, C);
            check_fwd(nm("rms %s C%d s%g out vs double", v, C, sc), out, ctx.out, n);
            check_grad(nm("rms %s C%d s%g dinp vs numeric", v, C, sc), dinp, dinp0, g_inp, n);
            check_grad(nm("rms %s C%d s%g dweight vs numeric", v, C, sc), dw, dw0, g_w, C);
            free(out), free(rstd), free(dinp0), free(dw0), free(dinp), free(dw);
        }
        free(inp), free(w), free(R), free(g_inp), free(g_w), free(ctx.inp), free(ctx.w);
        free(ctx.R), free(ctx.out);
    }
}

// ----------------------------------------------------------------------------
// rope

// B T NH NKV HS: HS=2, one position; GQA; NKV=1; MHA with odd head count;
// LLaMA's head size
static const int ROPE_SHAPES[][5] = {
    {1, 1, 1, 1, 2}, {2, 7, 4, 2, 8}, {1, 7, 4, 1, 8}, {3, 13, 3, 3, 6}, {2, 33, 8, 2, 128}};
enum { N_ROPE_SHAPES = sizeof ROPE_SHAPES / sizeof ROPE_SHAPES[0] };

typedef struct {
    double *qkv, *R, *out;
    const float *cs;
    int B, T, NH, NKV, HS;
} rope_ctx;

// the rotation in double, with the table's (float) cos and sin
static void rope_fwd_d(double *out, const double *qkv, const float *cs, int B, int T, int NH,
                       int NKV, int HS) {
    int W = qkv_width(NH, NKV, HS), h = HS / 2;
    size_t n = (size_t)B * T * W;
    memcpy(out, qkv, n * sizeof *out);
    for (int bt = 0; bt < B * T; bt++)
        for (int hd = 0; hd < NH + NKV; hd++) {
            const double *x = qkv + (size_t)bt * W + (size_t)hd * HS;
            double *y = out + (size_t)bt * W + (size_t)hd * HS;
            for (int i = 0; i < h; i++) {
                double c = cs[((size_t)(bt % T) * h + i) * 2],
                       s = cs[((size_t)(bt % T) * h + i) * 2 + 1];
                y[i] = x[i] * c - x[i + h] * s;
                y[i + h] = x[i + h] * c + x[i] * s;
            }
        }
}

static double rope_loss(const void *p) {
    const rope_ctx *c = p;
    rope_fwd_d(c->out, c->qkv, c->cs, c->B, c->T, c->NH, c->NKV, c->HS);
    return dot_d(c->out, c->R, (size_t)c->B * c->T * qkv_width(c->NH, c->NKV, c->HS));
}

static float *rope_table_new(int T, int HS, float theta) {
    float *cs = fnan((size_t)T * HS);
    rope_table(cs, T, HS, theta);
    return cs;
}

static void rope_odd_hs(void *arg) {
    (void)arg;
    float cs[6];
    rope_table(cs, 1, 3, 10000.0f);
}

static void test_rope(void) {
    printf("rope\n");
    // The table: t = 0 is exactly {1, 0}; column 0 (inv_freq = 1) is cos t
    // and sin t correctly rounded; every entry is within float rounding of
    // the angle's (t * inv_freq rounded to float: |t| 2^-24 relative) of the
    // exact cos and sin of t theta^(-2i/HS)
    for (int th = 0; th < 2; th++) {
        int T = 300, HS = 128, h = HS / 2;
        double theta = th ? 500000.0 : 10000.0; // LLaMA 2, LLaMA 3
        float *cs = rope_table_new(T, HS, (float)theta);
        int t0_ok = 1, col0_ok = 1;
        for (int i = 0; i < h; i++) t0_ok &= cs[2 * i] == 1.0f && cs[2 * i + 1] == 0.0f;
        for (int t = 0; t < T; t++)
            col0_ok &=
                cs[(size_t)t * HS] == (float)cos(t) && cs[(size_t)t * HS + 1] == (float)sin(t);
        t_check(t0_ok, "rope table theta %g: t = 0 must be cos 1, sin 0", theta);
        t_check(col0_ok, "rope table theta %g: column 0 must be cos t, sin t", theta);
        double *want = malloc((size_t)T * HS * sizeof *want), *got = dcopy(cs, (size_t)T * HS);
        for (int t = 0; t < T; t++)
            for (int i = 0; i < h; i++) {
                double a = t * pow(theta, -2.0 * i / HS);
                want[((size_t)t * h + i) * 2] = cos(a);
                want[((size_t)t * h + i) * 2 + 1] = sin(a);
            }
        // the float32 angle t * inv_freq is off by <= t (3 u inv_freq +
        // u e ln(theta) inv_freq) (the product, the division and pow
        // rounded, and the exponent e = 2i/HS rounded), which is at most
        // t (3 + 1/e_Euler) u = 6e-5 at t < 300; plus the final rounding
        t_close_d(nm("rope table theta %g vs exact", theta), got, want, (size_t)T * HS, 1e-4, 0);
        free(cs), free(want), free(got);
    }
    // a known value: HF's LlamaRotaryEmbedding (float32) for HS=8, theta
    // 10000, t=3, i=1: inv_freq = 0.1, angle 0.3 (float), cos 0.95533649
    {
        float *cs = rope_table_new(4, 8, 10000.0f);
        float want[2] = {(float)cos((double)(3.0f * (1.0f / (float)pow(10000.0, 0.25)))),
                         (float)sin((double)(3.0f * (1.0f / (float)pow(10000.0, 0.25))))};
        t_close("rope table HS8 t3 i1", cs + (3 * 4 + 1) * 2, want, 2, 0, 0);
        t_check(fabs(cs[(3 * 4 + 1) * 2] - 0.95533649) < 1e-7, "rope cos(0.3) = %.9g",
                cs[(3 * 4 + 1) * 2]);
        free(cs);
    }
    t_dies("rope odd head size", rope_odd_hs, NULL, "assertion");

    for (int s = 0; s < N_ROPE_SHAPES; s++) {
        int B = ROPE_SHAPES[s][0], T = ROPE_SHAPES[s][1], NH = ROPE_SHAPES[s][2];
        int NKV = ROPE_SHAPES[s][3], HS = ROPE_SHAPES[s][4], W = qkv_width(NH, NKV, HS);
        size_t n = (size_t)B * T * W;
        float *cs = rope_table_new(T, HS, 10000.0f);
        float *x = frand(n, 181, 2.0f), *y_r = fcopy(x, n), *y_f = fcopy(x, n), *y_f2 = fcopy(x, n);
        rope_forward_ref(y_r, cs, B, T, NH, NKV, HS);
        rope_forward_f32(y_f, cs, B, T, NH, NKV, HS);
        rope_forward_f32(y_f2, cs, B, T, NH, NKV, HS);
        // each output is a*b - c*d with |values| <= 2: a few ulps of 4
        t_close(nm("rope B%d T%d NH%d NKV%d HS%d fwd", B, T, NH, NKV, HS), y_f, y_r, n, 1e-6,
                REF_RTOL);
        same_bits("rope fwd", y_f, y_f2, n);
        // v untouched (bit for bit); q and k changed where t > 0
        int v_ok = 1, moved = 0;
        for (int bt = 0; bt < B * T; bt++)
            for (int j = 0; j < W; j++) {
                size_t k = (size_t)bt * W + j;
                if (j >= (NH + NKV) * HS)
                    v_ok &= !memcmp(&y_f[k], &x[k], sizeof *x);
                else
                    moved += y_f[k] != x[k];
            }
        t_check(v_ok, "rope NH%d NKV%d HS%d: v heads must be untouched", NH, NKV, HS);
        t_check(T == 1 || moved > 0, "rope NH%d NKV%d HS%d: q, k must be rotated", NH, NKV, HS);
        // the backward of the forward is the identity (the rotation is
        // orthogonal): back to x within a few ulps of |x| <= 2
        float *g_r = fcopy(y_r, n), *g_f = fcopy(y_f, n), *g_f2 = fcopy(y_f, n);
        rope_backward_ref(g_r, cs, B, T, NH, NKV, HS);
        rope_backward_f32(g_f, cs, B, T, NH, NKV, HS);
        rope_backward_f32(g_f2, cs, B, T, NH, NKV, HS);
        t_close(nm("rope B%d T%d NH%d NKV%d HS%d bwd", B, T, NH, NKV, HS), g_f, g_r, n, 1e-6,
                REF_RTOL);
        same_bits("rope bwd", g_f, g_f2, n);
        t_close(nm("rope B%d T%d NH%d NKV%d HS%d bwd(fwd(x)) = x", B, T, NH, NKV, HS), g_f, x, n,
                2e-6, 0);
        t_close(nm("rope ref B%d T%d NH%d NKV%d HS%d bwd(fwd(x)) = x", B, T, NH, NKV, HS), g_r, x,
                n, 2e-6, 0);
        free(cs), free(x), free(y_r), free(y_f), free(y_f2), free(g_r), free(g_f), free(g_f2);
    }

    // gradient check: the loss sum(rope(qkv) * R); rope_backward turns dout
    // = R, in place, into the gradient (it overwrites: no prefill)
    int gshapes[][5] = {{2, 7, 4, 2, 8}, {1, 7, 4, 1, 8}, {1, 5, 3, 3, 6}};
    for (int s = 0; s < 3; s++) {
        int B = gshapes[s][0], T = gshapes[s][1], NH = gshapes[s][2], NKV = gshapes[s][3];
        int HS = gshapes[s][4], W = qkv_width(NH, NKV, HS);
        size_t n = (size_t)B * T * W;
        float *cs = rope_table_new(T, HS, 10000.0f);
        float *x = frand(n, 191, 2.0f), *R = frand(n, 192, 1.0f);
        rope_ctx ctx = {dcopy(x, n), dcopy(R, n), malloc(n * 8), cs, B, T, NH, NKV, HS};
        double *g = numgrad(ctx.qkv, n, rope_loss, &ctx);
        rope_fwd_d(ctx.out, ctx.qkv, cs, B, T, NH, NKV, HS);
        float *zero = calloc(n, sizeof *zero);
        for (int fast = 0; fast < 2; fast++) {
            const char *v = fast ? "fast" : "ref";
            float *y = fcopy(x, n), *d = fcopy(R, n);
            (fast ? rope_forward_f32 : rope_forward_ref)(y, cs, B, T, NH, NKV, HS);
            (fast ? rope_backward_f32 : rope_backward_ref)(d, cs, B, T, NH, NKV, HS);
            check_fwd(nm("rope %s NH%d NKV%d out vs double", v, NH, NKV), y, ctx.out, n);
            check_grad(nm("rope %s NH%d NKV%d dqkv vs numeric", v, NH, NKV), d, zero, g, n);
            free(y), free(d);
        }
        free(cs), free(x), free(R), free(g), free(zero), free(ctx.qkv), free(ctx.R), free(ctx.out);
    }
}

// ----------------------------------------------------------------------------
// swiglu

typedef struct {
    double *inp, *R, *out;
    int N, IC;
} swiglu_ctx;

static void swiglu_fwd_d(double *out, const double *inp, int N, int IC) {
    for (int n = 0; n < N; n++)
        for (int i = 0; i < IC; i++) {
            double g = inp[(size_t)n * 2 * IC + i], u = inp[(size_t)n * 2 * IC + IC + i];
            out[(size_t)n * IC + i] = g / (1.0 + exp(-g)) * u;
        }
}

static double swiglu_loss(const void *p) {
    const swiglu_ctx *c = p;
    swiglu_fwd_d(c->out, c->inp, c->N, c->IC);
    return dot_d(c->out, c->R, (size_t)c->N * c->IC);
}

// the kernels' SIMD SwiGLU, as in swiglu.c: e = exp(-|x|), r = 1 / (1 + e)
static void swiglu_sigmoid_model(float x, float *s, float *s1) {
    float e = exp_model(-1.0f * fabsf(x)), r = 1.0f / (1.0f + e), er = e * r;
    *s = x < 0.0f ? er : r;
    *s1 = x < 0.0f ? r : er;
}

static void swiglu_forward_model(float *out, const float *inp, int N, int IC) {
    for (int n = 0; n < N; n++)
        for (int i = 0; i < IC; i++) {
            float x = inp[(size_t)n * 2 * IC + i], up = inp[(size_t)n * 2 * IC + IC + i], s, s1;
            swiglu_sigmoid_model(x, &s, &s1);
            out[(size_t)n * IC + i] = x * s * up;
        }
}

static void swiglu_backward_model(float *dinp, const float *inp, const float *dout, int N, int IC) {
    for (int n = 0; n < N; n++)
        for (int i = 0; i < IC; i++) {
            size_t g = (size_t)n * 2 * IC + i, u = g + IC;
            float x = inp[g], dy = dout[(size_t)n * IC + i], s, s1;
            swiglu_sigmoid_model(x, &s, &s1);
            dinp[g] = fmaf(dy * inp[u], s * fmaf(x, s1, 1.0f), dinp[g]);
            dinp[u] = fmaf(dy, x * s, dinp[u]);
        }
}

static void test_swiglu(void) {
    printf("swiglu\n");
    // N IC: single value, odd IC, a row over two chunks of 1024 columns, many rows
    int shapes[][2] = {{1, 1}, {1, 7}, {5, 33}, {3, 1030}, {64, 300}};
    for (int s = 0; s < 5; s++) {
        int N = shapes[s][0], IC = shapes[s][1];
        size_t ni = (size_t)N * 2 * IC, no = (size_t)N * IC;
        float *inp = frand(ni, 201, 6.0f), *dout = frand(no, 202, 1.0f);
        float *out_r = fnan(no), *out_f = fnan(no), *out_f2 = fnan(no);
        float *dx_r = frand(ni, 203, 1.0f), *dx_f = fcopy(dx_r, ni), *dx_f2 = fcopy(dx_r, ni);
        swiglu_forward_ref(out_r, inp, N, IC);
        swiglu_forward_f32(out_f, inp, N, IC);
        swiglu_forward_f32(out_f2, inp, N, IC);
        swiglu_backward_ref(dx_r, inp, dout, N, IC);
        swiglu_backward_f32(dx_f, inp, dout, N, IC);
        swiglu_backward_f32(dx_f2, inp, dout, N, IC);
        // elementwise, a few roundings of values <= 36: 1e-6 + 1e-5 relative
        t_close(nm("swiglu N%d IC%d out", N, IC), out_f, out_r, no, 1e-6, REF_RTOL);
        t_close(nm("swiglu N%d IC%d dinp", N, IC), dx_f, dx_r, ni, 1e-6, REF_RTOL);
        same_bits("swiglu out", out_f, out_f2, no);
        same_bits("swiglu dinp", dx_f, dx_f2, ni);
        if (simd_paths()) { // AVX2 and AVX-512: both bitwise their model
            float *out_m = fnan(no), *dx_m = frand(ni, 203, 1.0f);
            swiglu_forward_model(out_m, inp, N, IC);
            swiglu_backward_model(dx_m, inp, dout, N, IC);
            same_as_model(nm("swiglu N%d IC%d out", N, IC), out_f, out_m, no);
            same_as_model(nm("swiglu N%d IC%d dinp", N, IC), dx_f, dx_m, ni);
            free(out_m), free(dx_m);
        }
        free(inp), free(dout), free(out_r), free(out_f), free(out_f2), free(dx_r), free(dx_f);
        free(dx_f2);
    }

    // gates in the tails, zeros and a denormal (up = 1, dout = 1): finite,
    // both versions agree, and silu's limits hold: silu(x) -> x for large x,
    // -> -0 or a tiny negative value for very negative x
    enum { NX = 20 };
    float gs[NX] = {0.0f,  -0.0f, 1e-30f, -1e-30f, 1e-40f, 0.5f,   -0.5f,   3.0f, -3.0f, 5.0f,
                    -5.0f, 9.5f,  -9.5f,  20.0f,   -20.0f, 100.0f, -100.0f, 1e4f, -1e4f, 3e12f};
    float in[2 * NX], ones[NX], out_r[NX], out_f[NX], dx_r[2 * NX] = {0}, dx_f[2 * NX] = {0};
    for (int i = 0; i < NX; i++) in[i] = gs[i], in[NX + i] = 1.0f, ones[i] = 1.0f;
    swiglu_forward_ref(out_r, in, 1, NX);
    swiglu_forward_f32(out_f, in, 1, NX);
    swiglu_backward_ref(dx_r, in, ones, 1, NX);
    swiglu_backward_f32(dx_f, in, ones, 1, NX);
    t_close("swiglu special out", out_f, out_r, NX, 1e-6, REF_RTOL);
    t_close("swiglu special dinp", dx_f, dx_r, 2 * NX, 1e-6, REF_RTOL);
    if (simd_paths()) {
        float out_m[NX], dx_m[2 * NX] = {0};
        swiglu_forward_model(out_m, in, 1, NX);
        swiglu_backward_model(dx_m, in, ones, 1, NX);
        same_as_model("swiglu special out", out_f, out_m, NX);
        same_as_model("swiglu special dinp", dx_f, dx_m, 2 * NX);
    }
    int lim_ok = 1;
    for (int i = 0; i < NX; i++) {
        double g = gs[i], want = g > 0 ? g / (1.0 + exp(-g)) : g * exp(g) / (1.0 + exp(g));
        double dwant = g > 50    ? 1.0
                       : g < -50 ? 0.0
                                 : 1.0 / (1.0 + exp(-g)) * (1.0 + g / (1.0 + exp(g)));
        lim_ok &= isfinite(out_f[i]) && isfinite(dx_f[i]) && isfinite(dx_f[NX + i]);
        lim_ok &= fabs(out_f[i] - want) <= 1e-6 * fabs(want) + 1e-37;
        lim_ok &=
            fabs(dx_f[i] - dwant) <= 1e-6 && fabs(dx_f[NX + i] - want) <= 1e-6 * fabs(want) + 1e-37;
    }
    t_check(lim_ok, "swiglu special values: silu and its derivative in the tails");

    // |gate| up to 5 reaches into the tails
    int N = 3, IC = 7;
    size_t ni = (size_t)N * 2 * IC, no = (size_t)N * IC;
    float *inp = frand(ni, 211, 5.0f), *R = frand(no, 212, 1.0f);
    swiglu_ctx ctx = {dcopy(inp, ni), dcopy(R, no), malloc(no * 8), N, IC};
    double *g = numgrad(ctx.inp, ni, swiglu_loss, &ctx);
    swiglu_loss(&ctx);
    for (int fast = 0; fast < 2; fast++) {
        const char *v = fast ? "fast" : "ref";
        float *out = fnan(no), *dx0 = frand(ni, 213, 1.0f), *dx = fcopy(dx0, ni);
        (fast ? swiglu_forward_f32 : swiglu_forward_ref)(out, inp, N, IC);
        (fast ? swiglu_backward_f32 : swiglu_backward_ref)(dx, inp, R, N, IC);
        check_fwd(nm("swiglu %s out vs double", v), out, ctx.out, no);
        check_grad(nm("swiglu %s dinp vs numeric", v), dx, dx0, g, ni);
        free(out), free(dx0), free(dx);
    }
    free(inp), free(R), free(g), free(ctx.inp), free(ctx.R), free(ctx.out);
}

// ----------------------------------------------------------------------------
// bf16 and fp16
//
// Each fast kernel runs in bf16 and in fp16 against its fp32 _ref. Random
// inputs are rounded to the dtype first, so both sides see the same values;
// the 16-bit outputs are converted back and compared. A kernel computes in
// fp32 and rounds each output once to nearest even, so its result is an fp32
// value x within the fp32 fast-vs-ref tolerance (atol32 + rtol32 |want|, as
// above), rounded: |round(x) - x| <= u |x|, u the unit roundoff (bf16 has 8
// significant bits, u = 2^-8 = 3.9e-3; fp16 11 bits, u = 2^-11 = 4.9e-4).
// Hence |got - want| <= 2 atol32 + 2^-25 + (u + 2 rtol32) |want|: the 2s cover
// the (1 + u) |x - want| the bound expands to, and 2^-25 is half the spacing
// of fp16's subnormals (below 2^-14), where the relative bound does not hold.
// Gradients are prefilled with rounded values, so that also checks the +=
// contract, dst = round(prefill + contribution). Where the kernel's fp32
// arithmetic is the _ref's own (encoder, residual, exact sums), the 16-bit
// result must be round(want) bit for bit. Outputs and workspaces start as NaN.

static const fl_dtype LOWP[2] = {FL_BF16, FL_F16};

static double unit_roundoff(fl_dtype dt) {
    return dt == FL_BF16 ? 0x1p-8 : 0x1p-11;
}

// x in dtype dt (a new buffer)
static void *to_dt(fl_dtype dt, const float *x, size_t n) {
    void *h = malloc((n ? n : 1) * fl_dtype_size(dt));
    fl_convert(dt, h, FL_F32, x, n);
    return h;
}

static float *to_f32(fl_dtype dt, const void *h, size_t n) {
    float *x = malloc((n ? n : 1) * sizeof *x);
    fl_convert(FL_F32, x, dt, h, n);
    return x;
}

// random values exactly representable in dt
static float *frand_dt(fl_dtype dt, size_t n, unsigned seed, float scale) {
    float *x = frand(n, seed, scale);
    void *h = to_dt(dt, x, n);
    fl_convert(FL_F32, x, dt, h, n);
    free(h);
    return x;
}

static void *nan_dt(fl_dtype dt, size_t n) {
    float *x = fnan(n);
    void *h = to_dt(dt, x, n);
    free(x);
    return h;
}

static void *copy_dt(fl_dtype dt, const void *h, size_t n) {
    void *c = malloc((n ? n : 1) * fl_dtype_size(dt));
    memcpy(c, h, n * fl_dtype_size(dt));
    return c;
}

static void check_lp(const char *name, fl_dtype dt, const void *got, const float *want, size_t n,
                     double atol32, double rtol32) {
    char full[160];
    snprintf(full, sizeof full, "%s %s", fl_dtype_name(dt), name);
    float *g = to_f32(dt, got, n);
    t_close(full, g, want, n, 2 * atol32 + 0x1p-25, unit_roundoff(dt) + 2 * rtol32);
    free(g);
}

// got must be want rounded to dt, bit for bit
static void check_lp_exact(const char *name, fl_dtype dt, const void *got, const float *want,
                           size_t n) {
    void *w = to_dt(dt, want, n);
    t_check(memcmp(got, w, n * fl_dtype_size(dt)) == 0, "%s %s: not the rounded fp32 result",
            fl_dtype_name(dt), name);
    free(w);
}

static void same_bytes(const char *name, fl_dtype dt, const void *a, const void *b, size_t n) {
    t_check(memcmp(a, b, n * fl_dtype_size(dt)) == 0, "%s %s: two runs differ", fl_dtype_name(dt),
            name);
}

static void test_encoder_lp(fl_dtype dt) {
    // The kernel adds the same fp32 terms in the same order as _ref and
    // rounds once: exact agreement with the rounded fp32 result.
    int shapes[][4] = {{1, 1, 1, 2}, {2, 3, 7, 5}, {3, 17, 33, 11}, {4, 64, 96, 50}}; // B T C Vp
    for (int s = 0; s < 4; s++) {
        int B = shapes[s][0], T = shapes[s][1], C = shapes[s][2], Vp = shapes[s][3], maxT = T + 2;
        size_t nout = (size_t)B * T * C, nwte = (size_t)Vp * C, nwpe = (size_t)maxT * C;
        int *inp = tokens((size_t)B * T, 10 + s, 0, Vp - 2);
        float *wte = frand_dt(dt, nwte, 1, 1.0f), *wpe = frand_dt(dt, nwpe, 2, 1.0f);
        float *dout = frand_dt(dt, nout, 3, 1.0f), *out = fnan(nout);
        float *dwte = frand_dt(dt, nwte, 4, 1.0f), *dwpe = frand_dt(dt, nwpe, 5, 1.0f);
        void *wte_h = to_dt(dt, wte, nwte), *wpe_h = to_dt(dt, wpe, nwpe);
        void *dout_h = to_dt(dt, dout, nout), *out_h = nan_dt(dt, nout), *out_h2 = nan_dt(dt, nout);
        void *dwte_h = to_dt(dt, dwte, nwte), *dwpe_h = to_dt(dt, dwpe, nwpe);
        void *dwte_h2 = copy_dt(dt, dwte_h, nwte), *dwpe_h2 = copy_dt(dt, dwpe_h, nwpe);
        encoder_forward_ref(out, inp, wte, wpe, B, T, C);
        encoder_forward(dt, out_h, inp, wte_h, wpe_h, B, T, C);
        encoder_forward(dt, out_h2, inp, wte_h, wpe_h, B, T, C);
        encoder_backward_ref(dwte, dwpe, dout, inp, B, T, C);
        encoder_backward(dt, dwte_h, dwpe_h, dout_h, inp, B, T, C);
        encoder_backward(dt, dwte_h2, dwpe_h2, dout_h, inp, B, T, C);
        check_lp_exact(nm("enc B%d T%d C%d out", B, T, C), dt, out_h, out, nout);
        check_lp_exact(nm("enc B%d T%d C%d dwte", B, T, C), dt, dwte_h, dwte, nwte);
        check_lp_exact(nm("enc B%d T%d C%d dwpe", B, T, C), dt, dwpe_h, dwpe, nwpe);
        same_bytes("enc out", dt, out_h, out_h2, nout);
        same_bytes("enc dwte", dt, dwte_h, dwte_h2, nwte);
        same_bytes("enc dwpe", dt, dwpe_h, dwpe_h2, nwpe);
        free(inp), free(wte), free(wpe), free(dout), free(out), free(dwte), free(dwpe);
        free(wte_h), free(wpe_h), free(dout_h), free(out_h), free(out_h2), free(dwte_h);
        free(dwpe_h), free(dwte_h2), free(dwpe_h2);
    }
}

static void test_layernorm_lp(fl_dtype dt) {
    int shapes[][2] = {{1, 1}, {1, 7}, {5, 33}, {64, 768}}; // N C
    for (int s = 0; s < 4; s++) {
        int N = shapes[s][0], C = shapes[s][1];
        size_t n = (size_t)N * C;
        float *inp = frand_dt(dt, n, 31, 2.0f), *w = frand_dt(dt, C, 32, 1.0f);
        float *b = frand_dt(dt, C, 33, 1.0f), *dout = frand_dt(dt, n, 34, 1.0f);
        float *dinp = frand_dt(dt, n, 35, 1.0f), *dw = frand_dt(dt, C, 36, 1.0f);
        float *db = frand_dt(dt, C, 37, 1.0f);
        float *out = fnan(n), *mean_r = fnan(N), *rstd_r = fnan(N), *mean = fnan(N);
        float *rstd = fnan(N);
        void *inp_h = to_dt(dt, inp, n), *w_h = to_dt(dt, w, C), *b_h = to_dt(dt, b, C);
        void *dout_h = to_dt(dt, dout, n), *out_h = nan_dt(dt, n), *out_h2 = nan_dt(dt, n);
        void *dinp_h = to_dt(dt, dinp, n), *dw_h = to_dt(dt, dw, C), *db_h = to_dt(dt, db, C);
        void *dinp_h2 = copy_dt(dt, dinp_h, n), *dw_h2 = copy_dt(dt, dw_h, C);
        void *db_h2 = copy_dt(dt, db_h, C);
        layernorm_forward_ref(out, mean_r, rstd_r, inp, w, b, N, C);
        layernorm_forward(dt, out_h, mean, rstd, inp_h, w_h, b_h, N, C);
        layernorm_forward(dt, out_h2, mean, rstd, inp_h, w_h, b_h, N, C);
        layernorm_backward_ref(dinp, dw, db, dout, inp, w, mean_r, rstd_r, N, C);
        layernorm_backward(dt, dinp_h, dw_h, db_h, dout_h, inp_h, w_h, mean, rstd, N, C);
        layernorm_backward(dt, dinp_h2, dw_h2, db_h2, dout_h, inp_h, w_h, mean, rstd, N, C);
        // mean and rstd stay fp32: the fp32 tolerances
        check_lp(nm("ln N%d C%d out", N, C), dt, out_h, out, n, sum_tol(C), REF_RTOL);
        t_close(nm("%s ln N%d C%d mean", fl_dtype_name(dt), N, C), mean, mean_r, N, sum_tol(C),
                REF_RTOL);
        t_close(nm("%s ln N%d C%d rstd", fl_dtype_name(dt), N, C), rstd, rstd_r, N, sum_tol(C),
                REF_RTOL);
        check_lp(nm("ln N%d C%d dinp", N, C), dt, dinp_h, dinp, n, sum_tol(C), REF_RTOL);
        check_lp(nm("ln N%d C%d dweight", N, C), dt, dw_h, dw, C, sum_tol(N), REF_RTOL);
        check_lp(nm("ln N%d C%d dbias", N, C), dt, db_h, db, C, sum_tol(N), REF_RTOL);
        same_bytes("ln out", dt, out_h, out_h2, n);
        same_bytes("ln dinp", dt, dinp_h, dinp_h2, n);
        same_bytes("ln dweight", dt, dw_h, dw_h2, C);
        same_bytes("ln dbias", dt, db_h, db_h2, C);
        free(inp), free(w), free(b), free(dout), free(dinp), free(dw), free(db), free(out);
        free(mean_r), free(rstd_r), free(mean), free(rstd), free(inp_h), free(w_h), free(b_h);
        free(dout_h), free(out_h), free(out_h2), free(dinp_h), free(dw_h), free(db_h);
        free(dinp_h2), free(dw_h2), free(db_h2);
    }
}

static void *mm_workspace(fl_dtype dt, int N, int C, int OC) {
    return fnan(matmul_workspace_bytes(dt, N, C, OC) / sizeof(float));
}

static void test_matmul_lp(fl_dtype dt) {
    // on the portable path OC 320 and 530 span two and three of the input
    // gradient's 256-channel steps, OC 4500 three 2048-channel weight panels;
    // N 1100 two forward row blocks; with AVX2 the input gradients of N 400
    // and C 400 have three row tiles and two column tiles (dout and the
    // weight's rows packed ahead), over OC 2100 in two 2048-channel spans,
    // each span packed after the last one's tiles; their weight gradients
    // sum more than one depth block of tokens; N 1160's input gradient takes
    // row tiles of all C columns, each converting its own rows of dout, and
    // with OC <= N so does the forward (inp's rows), the weight packed ahead
    int shapes[][3] = {{1, 1, 1},       {1, 7, 3},        {5, 33, 17},      {64, 96, 288},
                       {130, 192, 320}, {2, 33, 530},     {3, 20, 4500},    {1100, 20, 40},
                       {400, 400, 300}, {400, 400, 2100}, {1160, 40, 2100}, {1160, 300, 200},
                       {1160, 8, 40}};
    // N C OC; N 1160 with C 8 as in test_matmul
    if (fl_cpu_isa() == FL_ISA_PORTABLE)
        t_check(matmul_workspace_bytes(FL_F32, 130, 192, 320) == 0,
                "fp32 matmul on the portable path needs no workspace");
    for (int s = 0; s < 13; s++) {
        int N = shapes[s][0], C = shapes[s][1], OC = shapes[s][2];
        if (quick_skip((double)N * C * OC)) continue;
        size_t ni = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
        float *inp = frand_dt(dt, ni, 51, 1.0f), *w = frand_dt(dt, nw, 52, 1.0f);
        float *bias = frand_dt(dt, OC, 53, 1.0f), *dout = frand_dt(dt, no, 54, 1.0f);
        void *inp_h = to_dt(dt, inp, ni), *w_h = to_dt(dt, w, nw), *bias_h = to_dt(dt, bias, OC);
        void *dout_h = to_dt(dt, dout, no), *ws = mm_workspace(dt, N, C, OC);
        for (int has_bias = 0; has_bias < 2; has_bias++) {
            float *out = fnan(no);
            void *out_h = nan_dt(dt, no), *out_h2 = nan_dt(dt, no);
            matmul_forward_ref(out, inp, w, has_bias ? bias : NULL, N, C, OC);
            matmul_forward(dt, out_h, inp_h, w_h, has_bias ? bias_h : NULL, ws, N, C, OC);
            matmul_forward(dt, out_h2, inp_h, w_h, has_bias ? bias_h : NULL, ws, N, C, OC);
            check_lp(nm("mm N%d C%d OC%d bias%d out", N, C, OC, has_bias), dt, out_h, out, no,
                     sum_tol(C), REF_RTOL);
            same_bytes("mm out", dt, out_h, out_h2, no);
            free(out), free(out_h), free(out_h2);
        }
        float *dinp = frand_dt(dt, ni, 55, 1.0f), *dw = frand_dt(dt, nw, 56, 1.0f);
        float *db = frand_dt(dt, OC, 57, 1.0f);
        void *dinp_h = to_dt(dt, dinp, ni), *dw_h = to_dt(dt, dw, nw), *db_h = to_dt(dt, db, OC);
        void *dinp_h2 = copy_dt(dt, dinp_h, ni), *dw_h2 = copy_dt(dt, dw_h, nw);
        void *db_h2 = copy_dt(dt, db_h, OC);
        matmul_backward_ref(dinp, dw, db, dout, inp, w, N, C, OC);
        matmul_backward(dt, dinp_h, dw_h, db_h, dout_h, inp_h, w_h, ws, N, C, OC);
        matmul_backward(dt, dinp_h2, dw_h2, db_h2, dout_h, inp_h, w_h, ws, N, C, OC);
        check_lp(nm("mm N%d C%d OC%d dinp", N, C, OC), dt, dinp_h, dinp, ni, sum_tol(OC), REF_RTOL);
        check_lp(nm("mm N%d C%d OC%d dweight", N, C, OC), dt, dw_h, dw, nw, sum_tol(N), REF_RTOL);
        check_lp(nm("mm N%d C%d OC%d dbias", N, C, OC), dt, db_h, db, OC, sum_tol(N), REF_RTOL);
        same_bytes("mm dinp", dt, dinp_h, dinp_h2, ni);
        same_bytes("mm dweight", dt, dw_h, dw_h2, nw);
        same_bytes("mm dbias", dt, db_h, db_h2, OC);
        // each gradient may be skipped with NULL; the others come out the same
        for (int mask = 0; mask < 7; mask++) {
            float *di = mask & 1 ? NULL : frand(ni, 55, 1.0f);
            float *dwm = mask & 2 ? NULL : frand(nw, 56, 1.0f);
            float *dbm = mask & 4 ? NULL : frand(OC, 57, 1.0f);
            void *di_h = di ? to_dt(dt, di, ni) : NULL, *dw_m = dwm ? to_dt(dt, dwm, nw) : NULL;
            void *db_m = dbm ? to_dt(dt, dbm, OC) : NULL;
            matmul_backward(dt, di_h, dw_m, db_m, dout_h, inp_h, w_h, ws, N, C, OC);
            size_t sz = fl_dtype_size(dt);
            int ok = (!di_h || !memcmp(di_h, dinp_h, ni * sz)) &&
                     (!dw_m || !memcmp(dw_m, dw_h, nw * sz)) &&
                     (!db_m || !memcmp(db_m, db_h, OC * sz));
            t_check(ok, "%s mm N%d C%d OC%d backward with NULL mask %d differs", fl_dtype_name(dt),
                    N, C, OC, mask);
            free(di), free(dwm), free(dbm), free(di_h), free(dw_m), free(db_m);
        }
        free(inp), free(w), free(bias), free(dout), free(inp_h), free(w_h), free(bias_h);
        free(dout_h), free(ws), free(dinp), free(dw), free(db), free(dinp_h), free(dw_h);
        free(db_h), free(dinp_h2), free(dw_h2), free(db_h2);
    }
}

// gemm.c, the GEMM of the 16-bit path with AVX2 or AVX-512 (the portable
// path is OpenBLAS's sgemm, covered by test_matmul under that cap). Against
// a double reference with the fp32 bound of a K-term sum, (K + 2) u
// sum |a b| + u |c|; a 16-bit operand gives the bits of its fp32 copy
// (conversion is exact), read in place or packed; sub-tiles give the whole
// call's bits (matmul's tiles rely on it); AVX2 and AVX-512 give the same
// bits (FMAs in k order); a 16-bit c (one depth block) gets the bits of an
// fp32 c rounded after the call.
static gemm_mat gm(fl_dtype dt, const void *p, int ld, int trans) {
    return (gemm_mat){.dt = dt, .p = p, .ld = ld, .trans = trans};
}

// x packed ahead whole (as gemm_pack's callers do, range by range)
static float *packed(gemm_mat x, int as_b, int count, int K) {
    float *dst = fnan(gemm_packed_floats(count, K));
    for (int i = 0; i < count; i += GEMM_PACK_QUANTUM)
        for (int k0 = 0; k0 < K; k0 += GEMM_DEPTH_BLOCK)
            gemm_pack(dst, x, as_b, count, K, i,
                      count - i < GEMM_PACK_QUANTUM ? count - i : GEMM_PACK_QUANTUM, k0);
    return dst;
}

// How a gemm_case's c starts: zero (beta 0), its values (beta 1), or a bias
// row (beta 0 with a bias: the tile's c is NaN, and c0 holds the bias in
// every row for the reference and for the beta 1 call it must equal).
enum { INIT_ZERO, INIT_C, INIT_BIAS };

static void gemm_case(int M, int N, int K, int ta, int tb, fl_dtype dt, int init, unsigned seed) {
    int lda = (ta ? M : K) + 3, ldb = (tb ? K : N) + 1, ldc = N + 2;
    size_t na = (size_t)(ta ? K : M) * lda, nb = (size_t)(tb ? N : K) * ldb, nc = (size_t)M * ldc;
    float *a = frand_dt(dt, na, seed, 1.0f), *b = frand_dt(dt, nb, seed + 1, 1.0f);
    float *c0 = frand(nc, seed + 2, 1.0f), *bias = frand(N, seed + 3, 1.0f);
    float beta = init == INIT_C ? 1.0f : 0.0f, *bias_or_null = init == INIT_BIAS ? bias : NULL;
    if (init == INIT_BIAS)
        for (int i = 0; i < M; i++) memcpy(c0 + (size_t)i * ldc, bias, N * sizeof *bias);
    // what the calls start from: c0, its tile NaN where c is not to be read
    float *start = fcopy(c0, nc);
    if (init == INIT_BIAS)
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) start[(size_t)i * ldc + j] = NAN;
    float *c = fcopy(start, nc), *c32 = fcopy(start, nc);
    void *a_h = to_dt(dt, a, na), *b_h = to_dt(dt, b, nb);
    float *pack = fnan(gemm_pack_floats(M, N, K));
    gemm_tile(M, N, K, gm(dt, a_h, lda, ta), gm(dt, b_h, ldb, tb), beta, bias_or_null, FL_F32, c,
              ldc, pack);
    const char *name =
        nm("gemm %s M%d N%d K%d ta%d tb%d init %s", fl_dtype_name(dt), M, N, K, ta, tb,
           init == INIT_ZERO ? "zero"
           : init == INIT_C  ? "c"
                             : "bias");
    int bad = 0;
    for (int i = 0; i < M && !bad; i++)
        for (int j = 0; j < N && !bad; j++) {
            double sum = init != INIT_ZERO ? c0[(size_t)i * ldc + j] : 0.0, mag = 0.0;
            for (int k = 0; k < K; k++) {
                double x = ta ? a[(size_t)k * lda + i] : a[(size_t)i * lda + k];
                double y = tb ? b[(size_t)j * ldb + k] : b[(size_t)k * ldb + j];
                sum += x * y, mag += fabs(x * y);
            }
            double tol = (K + 2) * 0x1p-24 * mag + 0x1p-24 * fabs(sum);
            bad = !(fabs(c[(size_t)i * ldc + j] - sum) <= tol);
            t_check(!bad, "%s: c[%d][%d] = %.9g, want %.9g +- %.3g", name, i, j,
                    c[(size_t)i * ldc + j], sum, tol);
        }
    if (init == INIT_BIAS) {
        // the bits of c set to the bias row, beta 1
        memcpy(c32, c0, nc * sizeof *c32);
        gemm_tile(M, N, K, gm(dt, a_h, lda, ta), gm(dt, b_h, ldb, tb), 1.0f, NULL, FL_F32, c32, ldc,
                  pack);
        t_check(!memcmp(c, c32, nc * sizeof *c), "%s: differs from c = bias, beta 1", name);
    }
    // the fp32 copy of the operands in four sub-tiles, then the operands
    // packed ahead in four sub-tiles split on the packing quantum
    float *pa = packed(gm(dt, a_h, lda, ta), 0, M, K), *pb = packed(gm(dt, b_h, ldb, tb), 1, N, K);
    for (int pass = 0; pass < 2; pass++) {
        int m1 = pass ? (M > GEMM_PACK_QUANTUM ? GEMM_PACK_QUANTUM : 0) : M / 3, n1 = N / 2;
        if (pass) n1 = N > GEMM_PACK_QUANTUM ? GEMM_PACK_QUANTUM : 0;
        memcpy(c32, start, nc * sizeof *c32);
        for (int q = 0; q < 4; q++) {
            int i0 = q & 1 ? m1 : 0, j0 = q & 2 ? n1 : 0;
            int rows = q & 1 ? M - m1 : m1, cols = q & 2 ? N - n1 : n1;
            if (!rows || !cols) continue;
            gemm_mat ma = gm(FL_F32, a + (ta ? (size_t)i0 : (size_t)i0 * lda), lda, ta);
            gemm_mat mb = gm(FL_F32, b + (tb ? (size_t)j0 * ldb : (size_t)j0), ldb, tb);
            if (pass)
                ma = (gemm_mat){.packed = pa, .count = M, .first = i0},
                mb = (gemm_mat){.packed = pb, .count = N, .first = j0};
            gemm_tile(rows, cols, K, ma, mb, beta, bias_or_null ? bias_or_null + j0 : NULL, FL_F32,
                      c32 + (size_t)i0 * ldc + j0, ldc, pack);
        }
        t_check(!memcmp(c, c32, nc * sizeof *c), "%s: differs %s", name,
                pass ? "with operands packed ahead" : "from its fp32 copy in sub-tiles");
    }
    if (fl_cpu_isa() == FL_ISA_AVX512) {
        memcpy(c32, start, nc * sizeof *c32);
        gemm_tile_isa(FL_ISA_AVX2, M, N, K, gm(dt, a_h, lda, ta), gm(dt, b_h, ldb, tb), beta,
                      bias_or_null, FL_F32, c32, ldc, pack);
        t_check(!memcmp(c, c32, nc * sizeof *c), "%s: AVX2 and AVX-512 differ", name);
    }
    if (dt != FL_F32 && K <= GEMM_DEPTH_BLOCK) {
        // c in dt: the fp32 call on c's 16-bit values (or on the fp32
        // bias), rounded after
        void *c_h = to_dt(dt, start, nc);
        fl_convert(FL_F32, c32, dt, c_h, nc);
        gemm_tile(M, N, K, gm(FL_F32, a, lda, ta), gm(FL_F32, b, ldb, tb), beta, bias_or_null,
                  FL_F32, c32, ldc, pack);
        for (int isa = FL_ISA_AVX2; isa <= (int)fl_cpu_isa(); isa++) {
            void *got = to_dt(dt, start, nc);
            gemm_tile_isa(isa, M, N, K, gm(dt, a_h, lda, ta), gm(dt, b_h, ldb, tb), beta,
                          bias_or_null, dt, got, ldc, pack);
            check_lp_exact(nm("%s, c in it (isa %d)", name, isa), dt, got, c32, nc);
            free(got);
        }
        free(c_h);
    }
    free(a), free(b), free(c0), free(c), free(c32), free(a_h), free(b_h), free(pack);
    free(pa), free(pb), free(bias), free(start);
}

static void test_gemm(void) {
    if (fl_cpu_isa() < FL_ISA_AVX2) return;
    // edges of the 8 x 48 and 6 x 16 micro-tiles, of the 256-deep k and
    // 288-wide n blocks and of the 192-row a block; M <= 192 takes the loop
    // order that packs a once per depth block; N = 128 and 64 end in panels
    // of 32 and 16 columns (AVX-512's narrow kernels); K <= 256 also takes
    // a 16-bit c, and N a multiple of 16 a 16-bit op(b) in place; K = 0
    // leaves c its start
    int shapes[][3] = {{1, 1, 1},       {13, 33, 7},   {7, 17, 0},    {50, 40, 300},
                       {200, 300, 513}, {24, 128, 70}, {17, 64, 260}, {200, 96, 256}};
    fl_dtype dts[] = {FL_F32, FL_BF16, FL_F16};
    unsigned seed = 300;
    for (int s = 0; s < 8; s++) {
        int M = shapes[s][0], N = shapes[s][1], K = shapes[s][2];
        // the reduced list takes a shape whose twelve cases are too much
        // work once (fp32, neither operand transposed), on the same seeds
        int cases = quick_skip(12.0 * M * N * K) ? 1 : 12;
        for (int k = 0; k < 12; k++) {
            int d = k / 4, t = k % 4;
            seed += 4;
            if (k < cases) gemm_case(M, N, K, t & 1, t >> 1, dts[d], (s + t + d) % 3, seed);
        }
    }
}

static void test_attention_lp(fl_dtype dt) {
    // the shapes of test_attention but the longest ones
    for (int s = 0; s < N_ATT_SHAPES; s++) {
        int B = ATT_SHAPES[s][0], T = ATT_SHAPES[s][1], NH = ATT_SHAPES[s][2];
        int NKV = ATT_SHAPES[s][3], HS = ATT_SHAPES[s][4], group = NH / NKV;
        if (T > 200) continue;
        size_t nqkv = (size_t)B * T * qkv_width(NH, NKV, HS), no = (size_t)B * T * NH * HS;
        size_t nl = (size_t)B * NH * T;
        float *qkv = frand_dt(dt, nqkv, 71, 2.0f), *dout = frand_dt(dt, no, 72, 1.0f);
        float *dqkv = frand_dt(dt, nqkv, 73, 1.0f), *prefill = fcopy(dqkv, nqkv), *out = fnan(no);
        float *lse_r = fnan(nl), *lse = fnan(nl), *lse2 = fnan(nl);
        float *ws = att_workspace(dt, T, HS, group);
        void *qkv_h = to_dt(dt, qkv, nqkv), *dout_h = to_dt(dt, dout, no);
        void *out_h = nan_dt(dt, no), *out_h2 = nan_dt(dt, no);
        void *dqkv_h = to_dt(dt, dqkv, nqkv), *dqkv_h2 = copy_dt(dt, dqkv_h, nqkv);
        attention_forward_ref(out, lse_r, qkv, B, T, NH, NKV, HS);
        attention_forward(dt, out_h, lse, qkv_h, ws, B, T, NH, NKV, HS);
        attention_forward(dt, out_h2, lse2, qkv_h, ws, B, T, NH, NKV, HS);
        attention_backward_ref(dqkv, dout, qkv, out, lse_r, B, T, NH, NKV, HS);
        attention_backward(dt, dqkv_h, dout_h, qkv_h, out_h, lse, ws, B, T, NH, NKV, HS);
        attention_backward(dt, dqkv_h2, dout_h, qkv_h, out_h, lse, ws, B, T, NH, NKV, HS);
        double tol = sum_tol(T + HS);
        check_lp(nm("att B%d T%d NH%d NKV%d HS%d out", B, T, NH, NKV, HS), dt, out_h, out, no, tol,
                 REF_RTOL);
        t_close(nm("%s att B%d T%d NH%d NKV%d HS%d lse", fl_dtype_name(dt), B, T, NH, NKV, HS), lse,
                lse_r, nl, tol, REF_RTOL);
        // The backward reads out as stored, rounded, in D_i = dO_i . o_i
        // (_ref sums P dP instead), and dS_ij = P_ij (dP_ij - D_i) passes
        // D's error of ~u |dO| |o| on to every gradient: ~u times the
        // gradient's scale M (its largest contribution), not u times each
        // element (observed <= 0.65 u M; the fp32 kernel fed the same rounded
        // out agrees with this one to the fp32 tolerance). A kv head's dk
        // and dv gather that from each of the group's query heads.
        double M = 0.0;
        for (size_t i = 0; i < nqkv; i++) M = fmax(M, fabs(dqkv[i] - prefill[i]));
        check_lp(nm("att B%d T%d NH%d NKV%d HS%d dqkv", B, T, NH, NKV, HS), dt, dqkv_h, dqkv, nqkv,
                 4 * sum_tol(group * T + HS) + group * unit_roundoff(dt) * M, REF_RTOL);
        same_bytes("att out", dt, out_h, out_h2, no);
        same_bits("att lse", lse, lse2, nl);
        same_bytes(nm("att NH%d NKV%d dqkv", NH, NKV), dt, dqkv_h, dqkv_h2, nqkv);
        free(qkv), free(dout), free(dqkv), free(prefill), free(out), free(lse_r), free(lse);
        free(lse2), free(ws), free(qkv_h), free(dout_h), free(out_h), free(out_h2), free(dqkv_h);
        free(dqkv_h2);
    }
}

static void test_gelu_lp(fl_dtype dt) {
    size_t sizes[] = {1, 7, 33, 100003};
    for (int s = 0; s < 4; s++) {
        size_t N = sizes[s];
        float *x = frand_dt(dt, N, 91, 6.0f), *dout = frand_dt(dt, N, 92, 1.0f);
        float *dx = frand_dt(dt, N, 93, 1.0f), *out = fnan(N);
        void *x_h = to_dt(dt, x, N), *dout_h = to_dt(dt, dout, N), *out_h = nan_dt(dt, N);
        void *out_h2 = nan_dt(dt, N), *dx_h = to_dt(dt, dx, N), *dx_h2 = copy_dt(dt, dx_h, N);
        float *out32 = fnan(N), *dx32 = fcopy(dx, N);
        gelu_forward_ref(out, x, N);
        gelu_forward(dt, out_h, x_h, N);
        gelu_forward(dt, out_h2, x_h, N);
        gelu_backward_ref(dx, x, dout, N);
        gelu_backward(dt, dx_h, x_h, dout_h, N);
        gelu_backward(dt, dx_h2, x_h, dout_h, N);
        check_lp(nm("gelu N%zu out", N), dt, out_h, out, N, 1e-6, REF_RTOL);
        check_lp(nm("gelu N%zu dinp", N), dt, dx_h, dx, N, 1e-6, REF_RTOL);
        same_bytes("gelu out", dt, out_h, out_h2, N);
        same_bytes("gelu dinp", dt, dx_h, dx_h2, N);
        // converted as loaded and stored: the fp32 kernel's values rounded once
        gelu_forward(FL_F32, out32, x, N);
        gelu_backward(FL_F32, dx32, x, dout, N);
        void *out_w = to_dt(dt, out32, N), *dx_w = to_dt(dt, dx32, N);
        t_check(!memcmp(out_h, out_w, N * fl_dtype_size(dt)) &&
                    !memcmp(dx_h, dx_w, N * fl_dtype_size(dt)),
                "%s gelu N%zu: not the fp32 kernel's values rounded once", fl_dtype_name(dt), N);
        free(x), free(dout), free(dx), free(out), free(x_h), free(dout_h), free(out_h);
        free(out_h2), free(dx_h), free(dx_h2), free(out32), free(dx32), free(out_w), free(dx_w);
    }
}

static void test_residual_lp(fl_dtype dt) {
    // one fp32 addition per element, as in _ref, then one rounding: exact
    size_t sizes[] = {1, 7, 33, 100003};
    for (int s = 0; s < 4; s++) {
        size_t N = sizes[s];
        float *a = frand_dt(dt, N, 101, 1.0f), *b = frand_dt(dt, N, 102, 1.0f);
        float *dout = frand_dt(dt, N, 103, 1.0f), *da = frand_dt(dt, N, 104, 1.0f);
        float *db = frand_dt(dt, N, 105, 1.0f), *out = fnan(N);
        void *a_h = to_dt(dt, a, N), *b_h = to_dt(dt, b, N), *dout_h = to_dt(dt, dout, N);
        void *da_h = to_dt(dt, da, N), *db_h = to_dt(dt, db, N), *out_h = nan_dt(dt, N);
        residual_forward_ref(out, a, b, N);
        residual_forward(dt, out_h, a_h, b_h, N);
        residual_backward_ref(da, db, dout, N);
        residual_backward(dt, da_h, db_h, dout_h, N);
        check_lp_exact(nm("res N%zu out", N), dt, out_h, out, N);
        check_lp_exact(nm("res N%zu da", N), dt, da_h, da, N);
        check_lp_exact(nm("res N%zu db", N), dt, db_h, db, N);
        // in place, as on the residual stream: out is a
        residual_forward(dt, a_h, a_h, b_h, N);
        same_bytes("res in place", dt, a_h, out_h, N);
        free(a), free(b), free(dout), free(da), free(db), free(out), free(a_h), free(b_h);
        free(dout_h), free(da_h), free(db_h), free(out_h);
    }
}

static void test_softmax_xent_lp(fl_dtype dt) {
    int shapes[][3] = {{1, 1, 1}, {1, 5, 8}, {7, 33, 48}, {3, 50257, 50304}};
    for (int s = 0; s < 4; s++) {
        int N = shapes[s][0], V = shapes[s][1], Vp = shapes[s][2];
        size_t n = (size_t)N * Vp;
        float *logits = frand_dt(dt, n, 121, 8.0f), *dl = frand(N, 122, 1.0f), *dx = fnan(n);
        int *targets = tokens(N, 123 + s, -1, V - 1);
        float *loss_r = fnan(N), *lse_r = fnan(N), *loss = fnan(N), *lse = fnan(N);
        float *loss2 = fnan(N), *lse2 = fnan(N);
        void *logits_h = to_dt(dt, logits, n), *dx_h = nan_dt(dt, n), *dx_h2 = nan_dt(dt, n);
        softmax_xent_forward_ref(loss_r, lse_r, logits, targets, N, V, Vp);
        softmax_xent_forward(dt, loss, lse, logits_h, targets, N, V, Vp);
        softmax_xent_forward(dt, loss2, lse2, logits_h, targets, N, V, Vp);
        softmax_xent_backward_ref(dx, logits, lse_r, targets, dl, N, V, Vp);
        softmax_xent_backward(dt, dx_h, logits_h, lse, targets, dl, N, V, Vp);
        softmax_xent_backward(dt, dx_h2, logits_h, lse, targets, dl, N, V, Vp);
        // losses and lse stay fp32: the fp32 tolerances
        t_close(nm("%s xent N%d V%d losses", fl_dtype_name(dt), N, V), loss, loss_r, N, 1e-5,
                REF_RTOL);
        t_close(nm("%s xent N%d V%d lse", fl_dtype_name(dt), N, V), lse, lse_r, N, 1e-5, REF_RTOL);
        check_lp(nm("xent N%d V%d dlogits", N, V), dt, dx_h, dx, n, 1e-7, REF_RTOL);
        same_bits("xent losses", loss, loss2, N);
        same_bytes("xent dlogits", dt, dx_h, dx_h2, n);
        // in place: the logits buffer becomes its own gradient
        softmax_xent_backward(dt, logits_h, logits_h, lse, targets, dl, N, V, Vp);
        same_bytes("xent in place", dt, logits_h, dx_h, n);
        // ignored rows and the padding are exact zeros (all-zero bits)
        int zeros_ok = 1;
        const uint16_t *g = dx_h;
        for (int i = 0; i < N; i++)
            for (int j = targets[i] < 0 ? 0 : V; j < Vp; j++)
                zeros_ok &= g[(size_t)i * Vp + j] == 0;
        t_check(zeros_ok, "%s xent N%d V%d: padding and ignored rows must be 0", fl_dtype_name(dt),
                N, V);
        free(logits), free(dl), free(dx), free(targets), free(loss_r), free(lse_r), free(loss);
        free(lse), free(loss2), free(lse2), free(logits_h), free(dx_h), free(dx_h2);
    }
}

// softmax_xent_forward_backward: the bits of the forward, then the backward
// with the logits as their own gradient; rows run on both threads, ignored
// targets and the vocabulary padding included.
static void test_softmax_xent_fused(void) {
    printf("softmax_xent_forward_backward\n");
    fl_dtype dts[] = {FL_F32, FL_BF16, FL_F16};
    int shapes[][3] = {{1, 1, 1}, {7, 33, 48}, {5, 50257, 50304}};
    for (int d = 0; d < 3; d++)
        for (int s = 0; s < 3; s++) {
            fl_dtype dt = dts[d];
            int N = shapes[s][0], V = shapes[s][1], Vp = shapes[s][2];
            size_t n = (size_t)N * Vp;
            float *logits = frand_dt(dt, n, 131 + s, 8.0f), *dl = frand(N, 132 + s, 1.0f);
            int *targets = tokens(N, 133 + s, -1, V - 1);
            float *loss = fnan(N), *lse = fnan(N), *loss2 = fnan(N), *lse2 = fnan(N);
            void *apart = to_dt(dt, logits, n), *fused = copy_dt(dt, apart, n);
            softmax_xent_forward(dt, loss, lse, apart, targets, N, V, Vp);
            softmax_xent_backward(dt, apart, apart, lse, targets, dl, N, V, Vp);
            softmax_xent_forward_backward(dt, loss2, lse2, fused, targets, dl, N, V, Vp);
            const char *name = nm("%s xent fused N%d V%d", fl_dtype_name(dt), N, V);
            same_bits(nm("%s losses", name), loss, loss2, N);
            same_bits(nm("%s lse", name), lse, lse2, N);
            same_bytes(nm("%s dlogits", name), dt, apart, fused, n);
            free(logits), free(dl), free(targets), free(loss), free(lse), free(loss2), free(lse2);
            free(apart), free(fused);
        }
}

// Gradients summed over many rows are rounded once per call, not once per
// row or block of rows: each single contribution below is at most half an
// ulp of the prefilled gradient, 1.0, so rounding per row would lose them all,
// while their sum is several ulps. All values are powers of two, the fp32
// sums exact: the result must be exactly round(1 + sum).
static float *fconst(size_t n, double value) {
    float *x = malloc((n ? n : 1) * sizeof *x);
    for (size_t i = 0; i < n; i++) x[i] = (float)value;
    return x;
}

static void test_rounding_once(fl_dtype dt) {
    double u = unit_roundoff(dt); // half an ulp of 1.0

    // encoder: one token at all 64 positions, dout = u/2
    {
        int B = 4, T = 16, C = 5, Vp = 3, inp[64];
        size_t nout = (size_t)B * T * C, nwte = (size_t)Vp * C, nwpe = (size_t)T * C;
        for (int i = 0; i < B * T; i++) inp[i] = 1;
        float *dout = fconst(nout, u / 2), *dwte = fconst(nwte, 1.0), *dwpe = fconst(nwpe, 1.0);
        void *dout_h = to_dt(dt, dout, nout), *dwte_h = to_dt(dt, dwte, nwte);
        void *dwpe_h = to_dt(dt, dwpe, nwpe);
        encoder_backward_ref(dwte, dwpe, dout, inp, B, T, C);
        encoder_backward(dt, dwte_h, dwpe_h, dout_h, inp, B, T, C);
        check_lp_exact("once: enc dwte", dt, dwte_h, dwte, nwte);
        check_lp_exact("once: enc dwpe", dt, dwpe_h, dwpe, nwpe);
        free(dout), free(dwte), free(dwpe), free(dout_h), free(dwte_h), free(dwpe_h);
    }

    // layernorm dbias: 64 rows of dout = u/2
    {
        int N = 64, C = 7;
        size_t n = (size_t)N * C;
        float *inp = frand_dt(dt, n, 141, 2.0f), *w = frand_dt(dt, C, 142, 1.0f), *out = fnan(n);
        float *mean = fnan(N), *rstd = fnan(N), *dout = fconst(n, u / 2), *dinp = fconst(n, 0.0);
        float *dw = fconst(C, 1.0), *db = fconst(C, 1.0);
        void *inp_h = to_dt(dt, inp, n), *w_h = to_dt(dt, w, C), *dout_h = to_dt(dt, dout, n);
        void *dinp_h = to_dt(dt, dinp, n), *dw_h = to_dt(dt, dw, C), *db_h = to_dt(dt, db, C);
        layernorm_forward_ref(out, mean, rstd, inp, w, w, N, C);
        layernorm_backward_ref(dinp, dw, db, dout, inp, w, mean, rstd, N, C);
        layernorm_backward(dt, dinp_h, dw_h, db_h, dout_h, inp_h, w_h, mean, rstd, N, C);
        check_lp_exact("once: ln dbias", dt, db_h, db, C);
        free(inp), free(w), free(out), free(mean), free(rstd), free(dout), free(dinp), free(dw);
        free(db), free(inp_h), free(w_h), free(dout_h), free(dinp_h), free(dw_h), free(db_h);
    }

    // matmul: inp = 256, weight = 1, dout = u/512: dinp sums 1000 output
    // channels (four weight blocks of u/2 each), dweight 64 rows of u/2;
    // then dbias alone, over 64 rows of dout = u/2
    {
        int N = 64, C = 4, OC = 1000;
        size_t ni = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
        float *inp = fconst(ni, 256.0), *w = fconst(nw, 1.0), *dout = fconst(no, u / 512);
        float *dinp = fconst(ni, 1.0), *dw = fconst(nw, 1.0), *db = fconst(OC, 1.0);
        void *inp_h = to_dt(dt, inp, ni), *w_h = to_dt(dt, w, nw), *dout_h = to_dt(dt, dout, no);
        void *dinp_h = to_dt(dt, dinp, ni), *dw_h = to_dt(dt, dw, nw), *db_h = to_dt(dt, db, OC);
        void *ws = mm_workspace(dt, N, C, OC);
        matmul_backward_ref(dinp, dw, NULL, dout, inp, w, N, C, OC);
        matmul_backward(dt, dinp_h, dw_h, NULL, dout_h, inp_h, w_h, ws, N, C, OC);
        check_lp_exact("once: mm dinp", dt, dinp_h, dinp, ni);
        check_lp_exact("once: mm dweight", dt, dw_h, dw, nw);
        for (size_t i = 0; i < no; i++) dout[i] = (float)(u / 2);
        fl_convert(dt, dout_h, FL_F32, dout, no);
        matmul_backward_ref(NULL, NULL, db, dout, inp, w, N, C, OC);
        matmul_backward(dt, NULL, NULL, db_h, dout_h, inp_h, w_h, ws, N, C, OC);
        check_lp_exact("once: mm dbias", dt, db_h, db, OC);
        free(inp), free(w), free(dout), free(dinp), free(dw), free(db), free(inp_h), free(w_h);
        free(dout_h), free(dinp_h), free(dw_h), free(db_h), free(ws);
    }

    // attention dv over 4 row blocks: q = k = 0 make P uniform, P_ij =
    // 1/(i+1), and dout = u, so dv_0 = 1 + u (H_64 + (H_128 - H_64) + ...):
    // 4.7u from the first block, under half an ulp from each later one. Not
    // exact (1/(i+1)), hence the tolerance check, which rounding per block
    // would fail by 1.1u (about 2x the tolerance).
    // Then GQA, 4 query heads on one kv head, one row block, dout = u/4:
    // each head adds u/4 H_8 = 0.68u to dv_0, under half an ulp, 2.7u in
    // all; rounding per query head would fail by 2.7u.
    int cases[2][6] = {{1, 200, 1, 1, 4, 1}, {1, 8, 4, 1, 4, 4}}; // B T NH NKV HS, dout = u/x
    for (int c = 0; c < 2; c++) {
        int B = cases[c][0], T = cases[c][1], NH = cases[c][2], NKV = cases[c][3];
        int HS = cases[c][4], W = qkv_width(NH, NKV, HS);
        size_t nqkv = (size_t)B * T * W, no = (size_t)B * T * NH * HS, nl = (size_t)B * NH * T;
        float *qkv = frand_dt(dt, nqkv, 151, 1.0f), *dout = fconst(no, u / cases[c][5]);
        float *dqkv = fconst(nqkv, 1.0), *out = fnan(no), *lse = fnan(nl), *lse_r = fnan(nl);
        float *ws = att_workspace(dt, T, HS, NH / NKV);
        for (int t = 0; t < T; t++)
            for (int j = 0; j < (NH + NKV) * HS; j++) qkv[(size_t)t * W + j] = 0.0f; // q, k
        void *qkv_h = to_dt(dt, qkv, nqkv), *dout_h = to_dt(dt, dout, no);
        void *dqkv_h = to_dt(dt, dqkv, nqkv), *out_h = nan_dt(dt, no);
        attention_forward_ref(out, lse_r, qkv, B, T, NH, NKV, HS);
        attention_backward_ref(dqkv, dout, qkv, out, lse_r, B, T, NH, NKV, HS);
        attention_forward(dt, out_h, lse, qkv_h, ws, B, T, NH, NKV, HS);
        attention_backward(dt, dqkv_h, dout_h, qkv_h, out_h, lse, ws, B, T, NH, NKV, HS);
        check_lp(nm("once: att NH%d NKV%d dqkv", NH, NKV), dt, dqkv_h, dqkv, nqkv, 1e-6, REF_RTOL);
        free(qkv), free(dout), free(dqkv), free(out), free(lse), free(lse_r), free(ws);
        free(qkv_h), free(dout_h), free(dqkv_h), free(out_h);
    }
}

static void test_rmsnorm_lp(fl_dtype dt) {
    int shapes[][2] = {{1, 1}, {1, 7}, {5, 33}, {7, 130}, {64, 768}}; // N C
    for (int s = 0; s < 5; s++) {
        int N = shapes[s][0], C = shapes[s][1];
        size_t n = (size_t)N * C;
        float *inp = frand_dt(dt, n, 161, 2.0f), *w = frand_dt(dt, C, 162, 1.0f);
        float *dout = frand_dt(dt, n, 163, 1.0f), *dinp = frand_dt(dt, n, 164, 1.0f);
        float *dw = frand_dt(dt, C, 165, 1.0f), *out = fnan(n), *rstd_r = fnan(N);
        float *rstd = fnan(N), *rstd2 = fnan(N);
        void *inp_h = to_dt(dt, inp, n), *w_h = to_dt(dt, w, C), *dout_h = to_dt(dt, dout, n);
        void *out_h = nan_dt(dt, n), *out_h2 = nan_dt(dt, n);
        void *dinp_h = to_dt(dt, dinp, n), *dw_h = to_dt(dt, dw, C);
        void *dinp_h2 = copy_dt(dt, dinp_h, n), *dw_h2 = copy_dt(dt, dw_h, C);
        rmsnorm_forward_ref(out, rstd_r, inp, w, N, C, 1e-5f);
        rmsnorm_forward(dt, out_h, rstd, inp_h, w_h, N, C, 1e-5f);
        rmsnorm_forward(dt, out_h2, rstd2, inp_h, w_h, N, C, 1e-5f);
        rmsnorm_backward_ref(dinp, dw, dout, inp, w, rstd_r, N, C);
        rmsnorm_backward(dt, dinp_h, dw_h, dout_h, inp_h, w_h, rstd, N, C);
        rmsnorm_backward(dt, dinp_h2, dw_h2, dout_h, inp_h, w_h, rstd, N, C);
        check_lp(nm("rms N%d C%d out", N, C), dt, out_h, out, n, sum_tol(C), REF_RTOL);
        t_close(nm("%s rms N%d C%d rstd", fl_dtype_name(dt), N, C), rstd, rstd_r, N, sum_tol(C),
                REF_RTOL); // fp32
        check_lp(nm("rms N%d C%d dinp", N, C), dt, dinp_h, dinp, n, sum_tol(C), REF_RTOL);
        check_lp(nm("rms N%d C%d dweight", N, C), dt, dw_h, dw, C, sum_tol(N), REF_RTOL);
        same_bytes("rms out", dt, out_h, out_h2, n);
        same_bits("rms rstd", rstd, rstd2, N);
        same_bytes("rms dinp", dt, dinp_h, dinp_h2, n);
        same_bytes("rms dweight", dt, dw_h, dw_h2, C);
        free(inp), free(w), free(dout), free(dinp), free(dw), free(out), free(rstd_r), free(rstd);
        free(rstd2), free(inp_h), free(w_h), free(dout_h), free(out_h), free(out_h2);
        free(dinp_h), free(dw_h), free(dinp_h2), free(dw_h2);
    }
    // dweight is rounded once per call: 64 rows of x = 1, w = 1, dout = u/2
    // (rstd ~ 1 - eps/2, so each term is ~u/2, under half an ulp of 1)
    int N = 64, C = 7;
    size_t n = (size_t)N * C;
    double u = unit_roundoff(dt);
    float *inp = fconst(n, 1.0), *w = fconst(C, 1.0), *dout = fconst(n, u / 2);
    float *out = fnan(n), *rstd = fnan(N), *dinp = fconst(n, 0.0), *dw = fconst(C, 1.0);
    void *inp_h = to_dt(dt, inp, n), *w_h = to_dt(dt, w, C), *dout_h = to_dt(dt, dout, n);
    void *dinp_h = to_dt(dt, dinp, n), *dw_h = to_dt(dt, dw, C);
    rmsnorm_forward_ref(out, rstd, inp, w, N, C, 1e-5f);
    rmsnorm_backward_ref(dinp, dw, dout, inp, w, rstd, N, C);
    rmsnorm_backward(dt, dinp_h, dw_h, dout_h, inp_h, w_h, rstd, N, C);
    check_lp("once: rms dweight", dt, dw_h, dw, C, 1e-6, REF_RTOL);
    free(inp), free(w), free(dout), free(out), free(rstd), free(dinp), free(dw), free(inp_h);
    free(w_h), free(dout_h), free(dinp_h), free(dw_h);
}

static void test_rope_lp(fl_dtype dt) {
    for (int s = 0; s < N_ROPE_SHAPES; s++) {
        int B = ROPE_SHAPES[s][0], T = ROPE_SHAPES[s][1], NH = ROPE_SHAPES[s][2];
        int NKV = ROPE_SHAPES[s][3], HS = ROPE_SHAPES[s][4];
        size_t n = (size_t)B * T * qkv_width(NH, NKV, HS);
        float *cs = rope_table_new(T, HS, 10000.0f);
        float *x = frand_dt(dt, n, 181, 2.0f), *y = fcopy(x, n);
        void *x_h = to_dt(dt, x, n), *y_h = copy_dt(dt, x_h, n), *y_h2 = copy_dt(dt, x_h, n);
        rope_forward_ref(y, cs, B, T, NH, NKV, HS);
        rope_forward(dt, y_h, cs, B, T, NH, NKV, HS);
        rope_forward(dt, y_h2, cs, B, T, NH, NKV, HS);
        check_lp(nm("rope B%d T%d NH%d NKV%d HS%d fwd", B, T, NH, NKV, HS), dt, y_h, y, n, 1e-6,
                 REF_RTOL);
        same_bytes("rope fwd", dt, y_h, y_h2, n);
        // the backward on the same (16-bit) gradient
        float *g = to_f32(dt, y_h, n);
        rope_backward_ref(g, cs, B, T, NH, NKV, HS);
        rope_backward(dt, y_h, cs, B, T, NH, NKV, HS);
        check_lp(nm("rope B%d T%d NH%d NKV%d HS%d bwd", B, T, NH, NKV, HS), dt, y_h, g, n, 1e-6,
                 REF_RTOL);
        // each pass rounds once: back to x within 2 u |x| + fp32 rounding
        float *back = to_f32(dt, y_h, n);
        t_close(nm("%s rope bwd(fwd(x)) = x", fl_dtype_name(dt)), back, x, n,
                2 * 2 * unit_roundoff(dt) * 2.0, 0);
        free(cs), free(x), free(y), free(x_h), free(y_h), free(y_h2), free(g), free(back);
    }
}

static void test_swiglu_lp(fl_dtype dt) {
    int shapes[][2] = {{1, 1}, {1, 7}, {5, 33}, {3, 1030}, {64, 300}}; // N IC
    for (int s = 0; s < 5; s++) {
        int N = shapes[s][0], IC = shapes[s][1];
        size_t ni = (size_t)N * 2 * IC, no = (size_t)N * IC;
        float *inp = frand_dt(dt, ni, 201, 6.0f), *dout = frand_dt(dt, no, 202, 1.0f);
        float *dx = frand_dt(dt, ni, 203, 1.0f), *out = fnan(no);
        void *inp_h = to_dt(dt, inp, ni), *dout_h = to_dt(dt, dout, no), *out_h = nan_dt(dt, no);
        void *out_h2 = nan_dt(dt, no), *dx_h = to_dt(dt, dx, ni), *dx_h2 = copy_dt(dt, dx_h, ni);
        float *out32 = fnan(no), *dx32 = fcopy(dx, ni);
        swiglu_forward_ref(out, inp, N, IC);
        swiglu_forward(dt, out_h, inp_h, N, IC);
        swiglu_forward(dt, out_h2, inp_h, N, IC);
        swiglu_backward_ref(dx, inp, dout, N, IC);
        swiglu_backward(dt, dx_h, inp_h, dout_h, N, IC);
        swiglu_backward(dt, dx_h2, inp_h, dout_h, N, IC);
        check_lp(nm("swiglu N%d IC%d out", N, IC), dt, out_h, out, no, 1e-6, REF_RTOL);
        check_lp(nm("swiglu N%d IC%d dinp", N, IC), dt, dx_h, dx, ni, 1e-6, REF_RTOL);
        same_bytes("swiglu out", dt, out_h, out_h2, no);
        same_bytes("swiglu dinp", dt, dx_h, dx_h2, ni);
        // 16-bit data is converted as it is loaded and stored: the bits of the
        // fp32 kernel on the fp32 values, each output rounded once
        swiglu_forward(FL_F32, out32, inp, N, IC);
        swiglu_backward(FL_F32, dx32, inp, dout, N, IC);
        void *out_w = to_dt(dt, out32, no), *dx_w = to_dt(dt, dx32, ni);
        t_check(!memcmp(out_h, out_w, no * fl_dtype_size(dt)) &&
                    !memcmp(dx_h, dx_w, ni * fl_dtype_size(dt)),
                "%s swiglu N%d IC%d: not the fp32 kernel's values rounded once", fl_dtype_name(dt),
                N, IC);
        free(inp), free(dout), free(dx), free(out), free(inp_h), free(dout_h), free(out_h);
        free(out_h2), free(dx_h), free(dx_h2), free(out32), free(dx32), free(out_w), free(dx_w);
    }
}

// ----------------------------------------------------------------------------
// tensor parallelism's kernels, in fp32, bf16 and fp16
//
// The vocabulary-parallel embedding and cross-entropy run on t = 1, 2 and 4
// shards of the vocabulary, ceil(Vp / t) rows or columns each, the last
// shorter or empty, and are combined as the model combines them over the TP
// group; the results are checked against the one-process kernels
// (encoder_*, softmax_xent_*), and each kernel against its _ref twin, by
// finite differences in double (the fp32 backwards) and across thread counts.

static const fl_dtype ALL_DT[3] = {FL_F32, FL_BF16, FL_F16};

// shard k of t over n rows or columns: [*first, *first + *count)
static void shard_range(int n, int t, int k, int *first, int *count) {
    int per = (n + t - 1) / t;
    *first = k * per < n ? k * per : n;
    *count = n - *first < per ? n - *first : per;
}

// got (dt) against the fp32 want: fp32's tolerance, or check_lp's in 16 bits
static void check_dt(const char *name, fl_dtype dt, const void *got, const float *want, size_t n,
                     double atol, double rtol) {
    if (dt != FL_F32) {
        check_lp(name, dt, got, want, n, atol, rtol);
        return;
    }
    char full[160];
    snprintf(full, sizeof full, "fp32 %s", name);
    t_close(full, got, want, n, atol, rtol);
}

typedef struct {
    const int *inp;
    double *wte, *wpe, *R, *out;
    int first, rows, B, T, C;
} emb_ctx;

// embedding_shard_forward, then position_forward, in double
static double emb_loss(const void *p) {
    const emb_ctx *c = p;
    for (int bt = 0; bt < c->B * c->T; bt++) {
        int id = c->inp[bt] - c->first;
        for (int i = 0; i < c->C; i++)
            c->out[(size_t)bt * c->C + i] =
                (id >= 0 && id < c->rows ? c->wte[(size_t)id * c->C + i] : 0.0) +
                c->wpe[(size_t)(bt % c->T) * c->C + i];
    }
    return dot_d(c->out, c->R, (size_t)c->B * c->T * c->C);
}

// The shards' lookups summed (the all-reduce) plus position_forward are
// encoder_forward's bits, the shards' gradients side by side and
// position_backward's encoder_backward's, in every dtype (each output is one
// fp32 sum, rounded once); each kernel agrees with its _ref exactly.
static void test_embedding_shard(fl_dtype dt) {
    int shapes[][4] = {
        {1, 1, 1, 2}, {2, 3, 7, 5}, {3, 17, 33, 11}, {4, 64, 96, 50}, {2, 5, 1100, 9}};
    for (int s = 0; s < 5; s++) {
        int B = shapes[s][0], T = shapes[s][1], C = shapes[s][2], Vp = shapes[s][3], N = B * T;
        int maxT = T + 2;
        size_t nout = (size_t)N * C, nwte = (size_t)Vp * C, nwpe = (size_t)maxT * C;
        int *inp = tokens(N, 10 + s, 0, Vp - 1);
        float *wte = frand_dt(dt, nwte, 1, 1.0f), *wpe = frand_dt(dt, nwpe, 2, 1.0f);
        float *dout = frand_dt(dt, nout, 3, 1.0f), *dwte0 = frand_dt(dt, nwte, 4, 1.0f);
        float *dwpe0 = frand_dt(dt, nwpe, 5, 1.0f), *sum = fnan(nout);
        void *wte_h = to_dt(dt, wte, nwte), *wpe_h = to_dt(dt, wpe, nwpe);
        void *dout_h = to_dt(dt, dout, nout), *enc_h = nan_dt(dt, nout);
        void *dwte_e = to_dt(dt, dwte0, nwte), *dwpe_e = to_dt(dt, dwpe0, nwpe);
        encoder_forward(dt, enc_h, inp, wte_h, wpe_h, B, T, C);
        encoder_backward(dt, dwte_e, dwpe_e, dout_h, inp, B, T, C);
        for (int t = 1; t <= 4; t *= 2) {
            void *dwte_h = to_dt(dt, dwte0, nwte), *part_h = nan_dt(dt, nout);
            float *part = fnan(nout);
            for (size_t i = 0; i < nout; i++) sum[i] = 0.0f;
            for (int k = 0; k < t; k++) {
                int first, rows;
                shard_range(Vp, t, k, &first, &rows);
                const char *name = nm("emb shard B%d T%d C%d t%d k%d", B, T, C, t, k);
                char base[96];
                snprintf(base, sizeof base, "%s", name);
                embedding_shard_forward(dt, part_h, inp, fl_at_const(dt, wte_h, (size_t)first * C),
                                        first, rows, N, C);
                embedding_shard_forward_ref(part, inp, wte + (size_t)first * C, first, rows, N, C);
                check_lp_exact(nm("%s out", base), dt, part_h, part, nout);
                for (size_t i = 0; i < nout; i++) sum[i] += part[i];
                float *dw = fcopy(dwte0 + (size_t)first * C, (size_t)rows * C);
                void *dw_h = fl_at(dt, dwte_h, (size_t)first * C);
                embedding_shard_backward(dt, dw_h, dout_h, inp, first, rows, N, C);
                embedding_shard_backward_ref(dw, dout, inp, first, rows, N, C);
                check_lp_exact(nm("%s dwte", base), dt, dw_h, dw, (size_t)rows * C);
                free(dw);
            }
            void *pos_h = to_dt(dt, sum, nout);
            position_forward(dt, pos_h, wpe_h, B, T, C);
            position_forward_ref(sum, wpe, B, T, C);
            check_lp_exact(nm("pos B%d T%d C%d t%d out", B, T, C, t), dt, pos_h, sum, nout);
            same_bytes(nm("emb shards t%d + position = encoder out", t), dt, pos_h, enc_h, nout);
            same_bytes(nm("emb shards t%d = encoder dwte", t), dt, dwte_h, dwte_e, nwte);
            free(dwte_h), free(part_h), free(part), free(pos_h);
        }
        void *dwpe_h = to_dt(dt, dwpe0, nwpe);
        position_backward(dt, dwpe_h, dout_h, B, T, C);
        position_backward_ref(dwpe0, dout, B, T, C);
        check_lp_exact(nm("pos B%d T%d C%d dwpe", B, T, C), dt, dwpe_h, dwpe0, nwpe);
        same_bytes("position = encoder dwpe", dt, dwpe_h, dwpe_e, nwpe);
        free(inp), free(wte), free(wpe), free(dout), free(dwte0), free(dwpe0), free(sum);
        free(wte_h), free(wpe_h), free(dout_h), free(enc_h), free(dwte_e), free(dwpe_e);
        free(dwpe_h);
    }

    // above FL_PAR_MIN_VALUES: one thread's bits (repeated tokens, C past a block)
    {
        int B = 4, T = 64, C = 2100, Vp = 50, first = 20, rows = 20,
            threads = omp_get_max_threads();
        size_t nout = (size_t)B * T * C, nw = (size_t)rows * C, np = (size_t)T * C;
        int *inp = tokens((size_t)B * T, 31, 0, Vp - 1);
        float *wte = frand_dt(dt, nw, 32, 1.0f), *wpe = frand_dt(dt, np, 33, 1.0f);
        float *dout = frand_dt(dt, nout, 34, 1.0f);
        void *wte_h = to_dt(dt, wte, nw), *wpe_h = to_dt(dt, wpe, np),
             *dout_h = to_dt(dt, dout, nout);
        void *out[2], *dw[2], *dp[2];
        for (int k = 0; k < 2; k++) {
            omp_set_num_threads(k ? 1 : threads);
            out[k] = nan_dt(dt, nout), dw[k] = to_dt(dt, wte, nw), dp[k] = to_dt(dt, wpe, np);
            embedding_shard_forward(dt, out[k], inp, wte_h, first, rows, B * T, C);
            position_forward(dt, out[k], wpe_h, B, T, C);
            embedding_shard_backward(dt, dw[k], dout_h, inp, first, rows, B * T, C);
            position_backward(dt, dp[k], dout_h, B, T, C);
        }
        omp_set_num_threads(threads);
        size_t es = fl_dtype_size(dt);
        t_check(!memcmp(out[0], out[1], nout * es) && !memcmp(dw[0], dw[1], nw * es) &&
                    !memcmp(dp[0], dp[1], np * es),
                "%s emb shard + position C%d: %d threads and one differ", fl_dtype_name(dt), C,
                threads);
        free(inp), free(wte), free(wpe), free(dout), free(wte_h), free(wpe_h), free(dout_h);
        for (int k = 0; k < 2; k++) free(out[k]), free(dw[k]), free(dp[k]);
    }
    if (dt != FL_F32) return;

    // gradient check of the shard holding rows [2, 5) of 6, with the
    // positions: ids 0, 1 and 5 are another rank's; repeated ids accumulate
    int B = 2, T = 4, C = 5, first = 2, rows = 3, maxT = 5;
    size_t nout = (size_t)B * T * C, nwte = (size_t)rows * C, nwpe = (size_t)maxT * C;
    int inp[] = {2, 0, 4, 2, 5, 3, 1, 2};
    float *wte = frand(nwte, 41, 1.0f), *wpe = frand(nwpe, 42, 1.0f), *R = frand(nout, 43, 1.0f);
    emb_ctx ctx = {inp,
                   dcopy(wte, nwte),
                   dcopy(wpe, nwpe),
                   dcopy(R, nout),
                   malloc(nout * 8),
                   first,
                   rows,
                   B,
                   T,
                   C};
    double *g_wte = numgrad(ctx.wte, nwte, emb_loss, &ctx);
    double *g_wpe = numgrad(ctx.wpe, nwpe, emb_loss, &ctx);
    emb_loss(&ctx);
    for (int fast = 0; fast < 2; fast++) {
        const char *v = fast ? "fast" : "ref";
        float *out = fnan(nout), *dwte0 = frand(nwte, 44, 1.0f), *dwpe0 = frand(nwpe, 45, 1.0f);
        float *dwte = fcopy(dwte0, nwte), *dwpe = fcopy(dwpe0, nwpe);
        if (fast) {
            embedding_shard_forward(FL_F32, out, inp, wte, first, rows, B * T, C);
            position_forward(FL_F32, out, wpe, B, T, C);
            embedding_shard_backward(FL_F32, dwte, R, inp, first, rows, B * T, C);
            position_backward(FL_F32, dwpe, R, B, T, C);
        } else {
            embedding_shard_forward_ref(out, inp, wte, first, rows, B * T, C);
            position_forward_ref(out, wpe, B, T, C);
            embedding_shard_backward_ref(dwte, R, inp, first, rows, B * T, C);
            position_backward_ref(dwpe, R, B, T, C);
        }
        check_fwd(nm("emb shard %s out vs double", v), out, ctx.out, nout);
        check_grad(nm("emb shard %s dwte vs numeric", v), dwte, dwte0, g_wte, nwte);
        check_grad(nm("position %s dwpe vs numeric", v), dwpe, dwpe0, g_wpe, nwpe);
        free(out), free(dwte0), free(dwpe0), free(dwte), free(dwpe);
    }
    free(wte), free(wpe), free(R), free(g_wte), free(g_wpe);
    free(ctx.wte), free(ctx.wpe), free(ctx.R), free(ctx.out);
}

// bias_forward: one fp32 addition per element, as in _ref, rounded once:
// exact; in fp32 also against double. (It has no backward: the bias's
// gradient is matmul_backward's dbias.)
static void test_bias(fl_dtype dt) {
    int shapes[][2] = {
        {1, 1}, {3, 7}, {5, 1030}, {520, 1030}}; // N OC; the last past FL_PAR_MIN_VALUES
    int threads = omp_get_max_threads();
    for (int s = 0; s < 4; s++) {
        int N = shapes[s][0], OC = shapes[s][1];
        size_t n = (size_t)N * OC;
        float *out = frand_dt(dt, n, 51, 1.0f), *bias = frand_dt(dt, OC, 52, 1.0f);
        void *bias_h = to_dt(dt, bias, OC), *out_h = to_dt(dt, out, n), *out_1 = to_dt(dt, out, n);
        double *want = dcopy(out, n);
        for (size_t i = 0; i < n; i++) want[i] += bias[i % OC];
        bias_forward(dt, out_h, bias_h, N, OC);
        omp_set_num_threads(1);
        bias_forward(dt, out_1, bias_h, N, OC);
        omp_set_num_threads(threads);
        bias_forward_ref(out, bias, N, OC);
        check_lp_exact(nm("bias N%d OC%d out", N, OC), dt, out_h, out, n);
        same_bytes(nm("bias N%d OC%d: %d threads and one", N, OC, threads), dt, out_h, out_1, n);
        if (dt == FL_F32) check_fwd(nm("bias N%d OC%d out vs double", N, OC), out_h, want, n);
        free(out), free(bias), free(bias_h), free(out_h), free(out_1), free(want);
    }
}

// Each xent_shard kernel against its _ref on one shard (padding NaN, never
// read), with a global max above the shard's own for some rows, as another
// rank's columns give; and on the whole vocabulary, xent_shard_backward is
// softmax_xent_backward's bits (the same row loop).
static void test_xent_shard_kernels(fl_dtype dt) {
    int shapes[][3] = {{2, 0, 16},  {1, 1, 1},        {1, 5, 8},
                       {7, 33, 48}, {64, 1000, 1003}, {3, 12565, 12576}}; // N V Vp
    int threads = omp_get_max_threads();
    for (int s = 0; s < (t_quick() ? 5 : 6); s++) { // the emulated CPUs: the small shards
        int N = shapes[s][0], V = shapes[s][1], Vp = shapes[s][2];
        size_t n = (size_t)N * Vp;
        float *logits = frand_dt(dt, n, 161, 8.0f), *dl = frand(N, 162, 1.0f);
        for (int i = 0; i < N; i++)
            for (int j = V; j < Vp; j++) logits[(size_t)i * Vp + j] = NAN;
        int *targets = tokens(N, 163 + s, -1, V - 1);
        float *mx = fnan(N), *mx_r = fnan(N), *mx_g = fnan(N), *sums = fnan(2 * N);
        float *sums_r = fnan(2 * N), *lse = fnan(N), *dx_r = fnan(n);
        void *logits_h = to_dt(dt, logits, n), *dx_h = nan_dt(dt, n), *dx_h2 = nan_dt(dt, n);
        char base[96];
        snprintf(base, sizeof base, "xent shard N%d V%d", N, V);
        xent_shard_max(dt, mx, logits_h, N, V, Vp);
        xent_shard_max_ref(mx_r, logits, N, V, Vp);
        t_check(!memcmp(mx, mx_r, N * sizeof *mx), "%s %s: max differs from _ref's",
                fl_dtype_name(dt), base); // the same bits, -inf included
        int empty_ok = 1;
        for (int i = 0; i < N; i++) {
            empty_ok &= V > 0 || (isinf(mx[i]) && mx[i] < 0);
            mx_g[i] = V == 0 ? 3.0f : i % 2 ? mx[i] + 1.5f : mx[i];
        }
        t_check(empty_ok, "%s %s: an empty shard's max is -inf", fl_dtype_name(dt), base);
        xent_shard_sums(dt, sums, logits_h, mx_g, targets, N, V, Vp);
        xent_shard_sums_ref(sums_r, logits, mx_g, targets, N, V, Vp);
        float *se = fnan(N), *se_r = fnan(N), *tl = fnan(N), *tl_r = fnan(N);
        for (int i = 0; i < N; i++) {
            se[i] = sums[2 * i], se_r[i] = sums_r[2 * i];
            tl[i] = sums[2 * i + 1], tl_r[i] = sums_r[2 * i + 1];
            // this shard alone holds the vocabulary here (V = 0: an exp of 1 elsewhere)
            lse[i] = mx_g[i] + logf(V ? se_r[i] : 1.0f);
        }
        // SIMD's exps against expf, each summed in double: fp32's fast-vs-ref bound
        t_close(nm("%s %s exp sums", fl_dtype_name(dt), base), se, se_r, N, 1e-6, REF_RTOL);
        t_close(nm("%s %s target logits", fl_dtype_name(dt), base), tl, tl_r, N, 0, 0);
        int zero_ok = 1;
        for (int i = 0; i < N; i++) zero_ok &= targets[i] >= 0 || tl[i] == 0.0f;
        t_check(zero_ok, "%s %s: a -1 target's logit is 0", fl_dtype_name(dt), base);
        xent_shard_backward(dt, dx_h, logits_h, lse, targets, dl, N, V, Vp);
        xent_shard_backward(dt, dx_h2, logits_h, lse, targets, dl, N, V, Vp);
        xent_shard_backward_ref(dx_r, logits, lse, targets, dl, N, V, Vp);
        check_dt(nm("%s dlogits", base), dt, dx_h, dx_r, n, 1e-7, REF_RTOL);
        same_bytes(nm("%s dlogits twice", base), dt, dx_h, dx_h2, n);
        // the padding is exact zeros; a -1 target's row still has its probabilities
        size_t es = fl_dtype_size(dt);
        const unsigned char *g = dx_h;
        int pad_ok = 1;
        for (int i = 0; i < N; i++)
            for (size_t b = (size_t)V * es; b < (size_t)Vp * es; b++)
                pad_ok &= g[(size_t)i * Vp * es + b] == 0;
        t_check(pad_ok, "%s %s: the padding's gradient is 0", fl_dtype_name(dt), base);
        // one thread's bits, and in place
        omp_set_num_threads(1);
        xent_shard_max(dt, mx_r, logits_h, N, V, Vp);
        xent_shard_sums(dt, sums_r, logits_h, mx_g, targets, N, V, Vp);
        xent_shard_backward(dt, dx_h2, logits_h, lse, targets, dl, N, V, Vp);
        omp_set_num_threads(threads);
        t_check(!memcmp(mx, mx_r, N * sizeof *mx) && !memcmp(sums, sums_r, 2 * N * sizeof *sums),
                "%s %s: %d threads and one differ (max, sums)", fl_dtype_name(dt), base, threads);
        same_bytes(nm("%s dlogits, %d threads and one", base, threads), dt, dx_h, dx_h2, n);
        xent_shard_backward(dt, logits_h, logits_h, lse, targets, dl, N, V, Vp);
        same_bytes(nm("%s in place", base), dt, logits_h, dx_h, n);
        // the whole vocabulary with no-loss rows' dlosses 0: softmax_xent_backward's bits
        if (V > 0) {
            fl_convert(dt, logits_h, FL_F32, logits, n);
            for (int i = 0; i < N; i++) dl[i] = targets[i] < 0 ? 0.0f : dl[i];
            softmax_xent_backward(dt, dx_h, logits_h, lse, targets, dl, N, V, Vp);
            xent_shard_backward(dt, dx_h2, logits_h, lse, targets, dl, N, V, Vp);
            same_bytes(nm("%s = softmax_xent_backward", base), dt, dx_h2, dx_h, n);
        }
        free(logits), free(dl), free(targets), free(mx), free(mx_r), free(mx_g), free(sums);
        free(sums_r), free(lse), free(dx_r), free(logits_h), free(dx_h), free(dx_h2), free(se);
        free(se_r), free(tl), free(tl_r);
    }
}

// The model's combination over t shards of the (N,V) logits: losses, lse
// (N) and the gradient (N,V), the shards' columns side by side. Shard k
// holds global columns [first, first + count) with Vs = ceil(V / t) + 3
// columns in all (NaN padding); targets are global, made local per shard;
// dl is 0 at the positions without loss, as the model passes it.
static void xent_sharded(fl_dtype dt, float *losses, float *lse, float *dlogits,
                         const float *logits, const int *targets, const float *dl, int N, int V,
                         int t, int fast) {
    int Vs = (V + t - 1) / t + 3;
    float *mx = fnan(N), *S = calloc(N, sizeof *S), *tl = calloc(N, sizeof *tl);
    float *smx = fnan(N), *sums = fnan(2 * N), *x = fnan((size_t)N * Vs),
          *dx = fnan((size_t)N * Vs);
    int *local = malloc(N * sizeof *local);
    void *x_h = nan_dt(dt, (size_t)N * Vs);
    for (int i = 0; i < N; i++) mx[i] = -INFINITY;
    for (int pass = 0; pass < 3; pass++) // max, sums, backward: each over all shards
        for (int k = 0; k < t; k++) {
            int first, count;
            shard_range(V, t, k, &first, &count);
            for (int i = 0; i < N; i++) {
                for (int j = 0; j < Vs; j++)
                    x[(size_t)i * Vs + j] = j < count ? logits[(size_t)i * V + first + j] : NAN;
                int g = targets[i] - first;
                local[i] = targets[i] >= 0 && g < count && g >= 0 ? g : -1;
            }
            fl_convert(dt, x_h, FL_F32, x, (size_t)N * Vs);
            if (pass == 0) {
                if (fast)
                    xent_shard_max(dt, smx, x_h, N, count, Vs);
                else
                    xent_shard_max_ref(smx, x, N, count, Vs);
                for (int i = 0; i < N; i++) mx[i] = fmaxf(mx[i], smx[i]);
            } else if (pass == 1) {
                if (fast)
                    xent_shard_sums(dt, sums, x_h, mx, local, N, count, Vs);
                else
                    xent_shard_sums_ref(sums, x, mx, local, N, count, Vs);
                for (int i = 0; i < N; i++) S[i] += sums[2 * i], tl[i] += sums[2 * i + 1];
                if (k == t - 1)
                    for (int i = 0; i < N; i++)
                        lse[i] = mx[i] + logf(S[i]), losses[i] = lse[i] - tl[i];
            } else {
                // in place, as the model turns its logits into their gradient
                if (fast)
                    xent_shard_backward(dt, x_h, x_h, lse, local, dl, N, count, Vs);
                else
                    xent_shard_backward_ref(x, x, lse, local, dl, N, count, Vs);
                if (fast)
                    fl_convert(FL_F32, dx, dt, x_h, (size_t)N * Vs);
                else
                    memcpy(dx, x, (size_t)N * Vs * sizeof *dx);
                int pad_ok = 1;
                for (int i = 0; i < N; i++) {
                    for (int j = 0; j < count; j++)
                        dlogits[(size_t)i * V + first + j] = dx[(size_t)i * Vs + j];
                    for (int j = count; j < Vs; j++) pad_ok &= dx[(size_t)i * Vs + j] == 0.0f;
                }
                t_check(pad_ok, "%s xent t%d shard %d: the padding's gradient is 0",
                        fl_dtype_name(dt), t, k);
            }
        }
    free(mx), free(S), free(tl), free(smx), free(sums), free(x), free(dx), free(local), free(x_h);
}

// Vocabulary-parallel cross-entropy equals the plain one (Megatron's
// test_cross_entropy.py): t = 2 and 4 shards of the logits, combined as the
// model does, against softmax_xent on the whole fp32 matrix. Tolerance: the
// losses and lse within 1e-5 + 1e-5 |x| (softmax_xent's own fast-vs-ref
// bound: the shards' fp32 partial sums and log against one double sum), the
// gradients within 1e-7 + 1e-5 |g| (that lse's relative error times |lse|
// < 15 is 1e-6 of each probability), 16-bit gradients rounded once from it.
static void test_xent_shard_equals_plain(fl_dtype dt) {
    int shapes[][2] = {{5, 5}, {7, 33}, {64, 1000}, {3, 50257}}; // N V; t = 4 of V = 5: 2, 2, 1, 0
    for (int s = 0; s < (t_quick() ? 3 : 4); s++) { // the emulated CPUs: no GPT-2 vocabulary
        int N = shapes[s][0], V = shapes[s][1];
        size_t n = (size_t)N * V;
        float *logits = frand_dt(dt, n, 171 + s, 8.0f), *dl = frand(N, 172, 1.0f);
        int *targets = tokens(N, 173 + s, -1, V - 1);
        targets[0] = -1, targets[N - 1] = V - 1; // a row without loss; the last shard's column
        for (int i = 0; i < N; i++) dl[i] = targets[i] < 0 ? 0.0f : dl[i];
        float *loss_p = fnan(N), *lse_p = fnan(N), *dx_p = fnan(n);
        softmax_xent_forward(FL_F32, loss_p, lse_p, logits, targets, N, V, V);
        softmax_xent_backward(FL_F32, dx_p, logits, lse_p, targets, dl, N, V, V);
        for (int t = 2; t <= 4; t += 2) {
            float *loss = fnan(N), *lse = fnan(N), *dx = fnan(n);
            xent_sharded(dt, loss, lse, dx, logits, targets, dl, N, V, t, 1);
            void *dx_h = to_dt(dt, dx, n);
            char base[96];
            snprintf(base, sizeof base, "xent t%d N%d V%d", t, N, V);
            for (int i = 0; i < N; i++) loss[i] = targets[i] < 0 ? 0.0f : loss[i];
            t_close(nm("%s %s losses = plain", fl_dtype_name(dt), base), loss, loss_p, N, 1e-5,
                    REF_RTOL);
            t_close(nm("%s %s lse = plain", fl_dtype_name(dt), base), lse, lse_p, N, 1e-5,
                    REF_RTOL);
            check_dt(nm("%s dlogits = plain", base), dt, dx_h, dx_p, n, 1e-7, REF_RTOL);
            free(loss), free(lse), free(dx), free(dx_h);
        }
        free(logits), free(dl), free(targets), free(loss_p), free(lse_p), free(dx_p);
    }
}

// the sharded loss and its gradient against double and finite differences,
// fast kernels and _ref twins, over t = 2 shards of 4 and 3 columns
static void test_xent_shard_grad(void) {
    int N = 4, V = 7, targets[] = {2, -1, 0, 6};
    size_t n = (size_t)N * V;
    float *logits = frand(n, 181, 3.0f), *dl = frand(N, 182, 1.0f);
    dl[1] = 0.0f; // no loss there
    xent_ctx ctx = {dcopy(logits, n), dcopy(dl, N), malloc(N * 8), malloc(N * 8), targets, N, V, V};
    double *g = numgrad(ctx.logits, n, xent_loss, &ctx);
    xent_loss(&ctx);
    for (int fast = 0; fast < 2; fast++) {
        const char *v = fast ? "fast" : "ref";
        float *losses = fnan(N), *lse = fnan(N), *dx = fnan(n), *zero = calloc(n, sizeof *zero);
        xent_sharded(FL_F32, losses, lse, dx, logits, targets, dl, N, V, 2, fast);
        losses[1] = 0.0f; // the model masks the positions without loss
        check_fwd(nm("xent shard %s losses vs double", v), losses, ctx.losses, N);
        check_fwd(nm("xent shard %s lse vs double", v), lse, ctx.lse, N);
        check_grad(nm("xent shard %s dlogits vs numeric", v), dx, zero, g, n); // overwrites
        free(losses), free(lse), free(dx), free(zero);
    }
    free(logits), free(dl), free(g), free(ctx.logits), free(ctx.dl), free(ctx.losses);
    free(ctx.lse);
}

static void test_tp_kernels(void) {
    printf("tensor-parallel kernels\n");
    for (int d = 0; d < 3; d++) {
        test_embedding_shard(ALL_DT[d]);
        test_bias(ALL_DT[d]);
        test_xent_shard_kernels(ALL_DT[d]);
        test_xent_shard_equals_plain(ALL_DT[d]);
    }
    test_xent_shard_grad();
}

static void test_lowp(void) {
    for (int d = 0; d < 2; d++) {
        fl_dtype dt = LOWP[d];
        printf("%s\n", fl_dtype_name(dt));
        test_encoder_lp(dt);
        test_layernorm_lp(dt);
        test_matmul_lp(dt);
        test_attention_lp(dt);
        test_gelu_lp(dt);
        test_residual_lp(dt);
        test_softmax_xent_lp(dt);
        test_rounding_once(dt);
        test_rmsnorm_lp(dt);
        test_rope_lp(dt);
        test_swiglu_lp(dt);
    }
}

// matmul on fitlm's GEMM, forward and both gradients, under the AVX2 and the
// AVX-512 caps (forked children, results in shared memory): the same bits,
// fp32 and fp16, including the AVX-512 path's transposed weight-gradient
// tiles (C <= 256) and shapes past gemm's blocks. (bf16 may run on oneDNN
// natively.)
static void test_matmul_isas(int avx512) {
    if (!avx512) return;
    printf("matmul paths\n");
    const char *caps[] = {"avx2", "avx512"};
    int shapes[][3] = {{100, 40, 200},  {200, 96, 300}, {520, 128, 1000},
                       {300, 256, 130}, {130, 320, 64}, {1160, 40, 2100}};
    fl_dtype dts[] = {FL_F32, FL_F16};
    for (int s = 0; s < 6; s++)
        for (int d = 0; d < 2; d++) {
            fl_dtype dt = dts[d];
            int N = shapes[s][0], C = shapes[s][1], OC = shapes[s][2];
            size_t ni = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
            size_t es = fl_dtype_size(dt), nres = (ni + nw + OC + no) * es;
            // fp32 here; converted in the children: the parent must not read
            // the CPU's features before the caps are set
            float *inp = frand(ni, 141, 1.0f), *w = frand(nw, 142, 1.0f);
            float *bias = frand(OC, 143, 1.0f), *dout = frand(no, 144, 1.0f);
            float *dw0 = frand(nw, 145, 1.0f), *dx0 = frand(ni, 146, 1.0f);
            char *res =
                mmap(NULL, 2 * nres, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
            t_check(res != MAP_FAILED, "mmap failed");
            if (res == MAP_FAILED) return;
            for (int k = 0; k < 2; k++) {
                if (!in_child_under_cap(caps[k], "matmul")) continue;
                char *dx = res + k * nres, *dw = dx + ni * es, *db = dw + nw * es;
                char *out = db + (size_t)OC * es;
                fl_convert(dt, dx, FL_F32, dx0, ni), fl_convert(dt, dw, FL_F32, dw0, nw);
                fl_convert(dt, db, FL_F32, bias, OC);
                void *inp_h = to_dt(dt, inp, ni), *w_h = to_dt(dt, w, nw);
                void *bias_h = to_dt(dt, bias, OC), *dout_h = to_dt(dt, dout, no);
                void *ws = fl_alloc(FL_MEM_WORKSPACE, matmul_workspace_bytes(dt, N, C, OC));
                matmul_forward(dt, out, inp_h, w_h, bias_h, ws, N, C, OC);
                matmul_backward(dt, dx, dw, db, dout_h, inp_h, w_h, ws, N, C, OC);
                _exit(0);
            }
            t_check(!memcmp(res, res + nres, nres),
                    "%s matmul N%d C%d OC%d: the AVX2 and AVX-512 paths give the same bits",
                    fl_dtype_name(dt), N, C, OC);
            munmap(res, 2 * nres);
            free(inp), free(w), free(bias), free(dout), free(dw0), free(dx0);
        }
}

// the checks that compare the ISA paths, run once from the parent
static void test_isas(int avx2, int avx512) {
    test_attention_isas(avx2, avx512);
    test_matmul_isas(avx512);
}

// A row whose squares overflow (finite but huge inputs) gives NaN, not the
// bias alone (1/sqrt(inf) = 0 did), in every norm and dtype path and the
// references; the other rows are untouched.
static void test_norm_overflow(void) {
    enum { N = 2, C = 40 };
    float inp[N * C], w[C], b[C], out[N * C], mean[N], rstd[N];
    for (int i = 0; i < N * C; i++) inp[i] = 0.01f * (float)(i % 7) - 0.02f;
    for (int i = 0; i < C; i++) w[i] = 1.0f + 0.01f * (float)i, b[i] = 0.5f;
    inp[C + 3] = 1e30f; // row 1: its variance is (1e30)^2 / C, inf in fp32
    for (int kind = 0; kind < 2; kind++)
        for (int path = 0; path < 4; path++) { // ref; fp32, bf16, fp16 data
            fl_dtype dt = path == 2 ? FL_BF16 : path == 3 ? FL_F16 : FL_F32;
            uint16_t in16[N * C], out16[N * C];
            if (dt != FL_F32) fl_store_f32(dt, in16, inp, N * C);
            const void *x = dt == FL_F32 ? (const void *)inp : in16;
            void *y = dt == FL_F32 ? (void *)out : out16;
            if (kind == 0 && path == 0) layernorm_forward_ref(out, mean, rstd, inp, w, b, N, C);
            if (kind == 0 && path > 0) layernorm_forward(dt, y, mean, rstd, x, w, b, N, C);
            if (kind == 1 && path == 0) rmsnorm_forward_ref(out, rstd, inp, w, N, C, 1e-5f);
            if (kind == 1 && path > 0) rmsnorm_forward(dt, y, rstd, x, w, N, C, 1e-5f);
            if (dt != FL_F32) fl_load_f32(dt, out16, N * C, out);
            int nan_row = 1, finite_row = 1;
            for (int i = 0; i < C; i++)
                nan_row &= isnan(out[C + i]), finite_row &= isfinite(out[i]);
            t_check(nan_row && isnan(rstd[1]) && finite_row && isfinite(rstd[0]),
                    "%s path %d: an overflowing row is NaN (rstd %g), the other finite (rstd %g)",
                    kind ? "rmsnorm" : "layernorm", path, rstd[1], rstd[0]);
        }
}

static int run_all(const char *path) {
    printf("%s paths: threads %d, vector ISA %s\n", path, fl_threads(), fl_isa_name(fl_cpu_isa()));
    if (!strcmp(path, "portable") || !strcmp(path, "avx2"))
        t_check(!strcmp(fl_isa_name(fl_cpu_isa()), path), "FITLM_ISA=%s caps the kernels at %s",
                path, fl_isa_name(fl_cpu_isa()));
    // OpenBLAS must be the OpenMP build: the pthreads build, called inside
    // our parallel regions (attention), oversubscribes and crawls
    t_check(openblas_get_parallel() == 2,
            "OpenBLAS is not the OpenMP build (openblas_get_parallel = %d): check the library path",
            openblas_get_parallel());
    test_encoder();
    test_layernorm();
    test_matmul();
    test_attention();
    test_gelu();
    test_residual();
    test_softmax_xent();
    test_softmax_xent_fused();
    test_rmsnorm();
    test_norm_overflow();
    test_rope();
    test_swiglu();
    test_gemm();
    test_lowp();
    test_tp_kernels();
    return t_report();
}

int main(void) {
    return t_main_under_isa_caps(run_all, test_isas);
}
