// test_kernels.c: every kernel three ways.
// 1. fast vs _ref on many shapes (odd C, T=1, N=1, odd head size, several
//    attention row blocks) and special values, forward and backward;
// 2. float forward vs an independent double-precision forward written here,
//    and both backwards vs central finite differences of that double forward
//    (loss = sum(out * R), so dout = R), with gradient buffers prefilled so
//    the += contract is checked at the same time (softmax_xent overwrites,
//    also in place);
// 3. the fast kernels run twice give bitwise identical results.
// Outputs and workspaces start as NaN: a kernel that reads what it should
// only write fails loudly. Everything runs twice, in a forked child with the
// portable paths (FITLM_NO_SIMD=1) and then with the CPU's SIMD paths.
#include "fitlm/core.h"
#include "fitlm/kernels.h"
#include "testlib.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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
        encoder_forward(out_f, inp, wte, wpe, B, T, C);
        encoder_forward(out_f2, inp, wte, wpe, B, T, C);
        encoder_backward_ref(dwte_r, dwpe_r, dout, inp, B, T, C);
        encoder_backward(dwte_f, dwpe_f, dout, inp, B, T, C);
        encoder_backward(dwte_f2, dwpe_f2, dout, inp, B, T, C);
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
        (fast ? encoder_forward : encoder_forward_ref)(out, inp, wte, wpe, B, T, C);
        (fast ? encoder_backward : encoder_backward_ref)(dwte, dwpe, R, inp, B, T, C);
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
        layernorm_forward(out_f, mean_f, rstd_f, inp, w, b, N, C);
        layernorm_forward(out_f2, mean_f, rstd_f, inp, w, b, N, C);
        layernorm_backward_ref(dinp_r, dw_r, db_r, dout, inp, w, mean_r, rstd_r, N, C);
        layernorm_backward(dinp_f, dw_f, db_f, dout, inp, w, mean_f, rstd_f, N, C);
        layernorm_backward(dinp_f2, dw_f2, db_f2, dout, inp, w, mean_f, rstd_f, N, C);
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
            (fast ? layernorm_forward : layernorm_forward_ref)(out, mean, rstd, inp, w, b, N, C);
            (fast ? layernorm_backward : layernorm_backward_ref)(dinp, dw, db, R, inp, w, mean,
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
    int shapes[][3] = {{1, 1, 1}, {1, 7, 3}, {5, 33, 17}, {64, 96, 288}, {130, 192, 320}}; // N C OC
    for (int s = 0; s < 5; s++) {
        int N = shapes[s][0], C = shapes[s][1], OC = shapes[s][2];
        size_t ni = (size_t)N * C, nw = (size_t)OC * C, no = (size_t)N * OC;
        float *inp = frand(ni, 51, 1.0f), *w = frand(nw, 52, 1.0f), *bias = frand(OC, 53, 1.0f);
        float *dout = frand(no, 54, 1.0f);
        for (int has_bias = 0; has_bias < 2; has_bias++) {
            const float *bp = has_bias ? bias : NULL;
            float *out_r = fnan(no), *out_f = fnan(no), *out_f2 = fnan(no);
            matmul_forward_ref(out_r, inp, w, bp, N, C, OC);
            matmul_forward(out_f, inp, w, bp, N, C, OC);
            matmul_forward(out_f2, inp, w, bp, N, C, OC);
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
        matmul_backward(dinp_f, dw_f, db_f, dout, inp, w, N, C, OC);
        matmul_backward(dinp_f2, dw_f2, db_f2, dout, inp, w, N, C, OC);
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
            matmul_backward(di, dw, db, dout, inp, w, N, C, OC);
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
        (fast ? matmul_forward : matmul_forward_ref)(out, inp, w, bias, N, C, OC);
        (fast ? matmul_backward : matmul_backward_ref)(dinp, dw, db, R, inp, w, N, C, OC);
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
    int B, T, C, NH;
} att_ctx;

static void attention_fwd_d(double *out, double *lse, const double *qkv, int B, int T, int C,
                            int NH) {
    int HS = C / NH;
    double scale = 1.0 / sqrt(HS), *s = malloc(T * sizeof *s);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const double *q = qkv + ((size_t)b * T + t) * 3 * C + h * HS;
                double m = -INFINITY, sum = 0.0;
                for (int j = 0; j <= t; j++) {
                    s[j] = scale * dot_d(q, qkv + ((size_t)b * T + j) * 3 * C + C + h * HS, HS);
                    m = fmax(m, s[j]);
                }
                for (int j = 0; j <= t; j++) sum += exp(s[j] - m);
                // cppcheck-suppress invalidFunctionArg ; j = t ran, so sum >= 1
                lse[((size_t)b * NH + h) * T + t] = m + log(sum);
                double *o = out + ((size_t)b * T + t) * C + h * HS;
                for (int e = 0; e < HS; e++) o[e] = 0.0;
                for (int j = 0; j <= t; j++) {
                    const double *v = qkv + ((size_t)b * T + j) * 3 * C + 2 * C + h * HS;
                    for (int e = 0; e < HS; e++) o[e] += exp(s[j] - m) / sum * v[e];
                }
            }
    free(s);
}

static double att_loss(const void *p) {
    const att_ctx *c = p;
    attention_fwd_d(c->out, c->lse, c->qkv, c->B, c->T, c->C, c->NH);
    return dot_d(c->out, c->R, (size_t)c->B * c->T * c->C);
}

static float *att_workspace(int T, int HS) {
    return fnan(attention_workspace_floats(T, HS) * fl_threads());
}

static void test_attention(void) {
    printf("attention\n");
    // B T C NH: T=1; odd HS=5 with NH=3; HS=1; one full row block (64), one
    // plus a row, several blocks with a ragged end; the longest context
    int shapes[][4] = {{1, 1, 3, 1},   {2, 5, 15, 3},   {1, 7, 6, 6},   {1, 64, 8, 1},
                       {2, 65, 12, 2}, {2, 150, 48, 4}, {1, 1024, 8, 2}};
    for (int s = 0; s < 7; s++) {
        int B = shapes[s][0], T = shapes[s][1], C = shapes[s][2], NH = shapes[s][3], HS = C / NH;
        size_t nqkv = (size_t)B * T * 3 * C, no = (size_t)B * T * C, nl = (size_t)B * NH * T;
        float *qkv = frand(nqkv, 71, 2.0f), *dout = frand(no, 72, 1.0f), *ws = att_workspace(T, HS);
        float *out_r = fnan(no), *lse_r = fnan(nl), *out_f = fnan(no), *lse_f = fnan(nl);
        float *out_f2 = fnan(no), *lse_f2 = fnan(nl);
        float *dqkv_r = frand(nqkv, 73, 1.0f), *dqkv_f = fcopy(dqkv_r, nqkv);
        float *dqkv_f2 = fcopy(dqkv_r, nqkv);
        attention_forward_ref(out_r, lse_r, qkv, B, T, C, NH);
        attention_forward(out_f, lse_f, qkv, ws, B, T, C, NH);
        attention_forward(out_f2, lse_f2, qkv, ws, B, T, C, NH);
        attention_backward_ref(dqkv_r, dout, qkv, out_r, lse_r, B, T, C, NH);
        attention_backward(dqkv_f, dout, qkv, out_f, lse_f, ws, B, T, C, NH);
        attention_backward(dqkv_f2, dout, qkv, out_f, lse_f, ws, B, T, C, NH);
        // out mixes up to T values of v (|v| <= 2) with weights summing to 1,
        // scores and lse sum HS terms of size <= 4: sum_tol(T + HS); each
        // dqkv entry sums up to T terms of size <~ 4 (|q|, |k|, |v| <= 2): 4x
        t_close(nm("att B%d T%d C%d NH%d out", B, T, C, NH), out_f, out_r, no, sum_tol(T + HS),
                REF_RTOL);
        t_close(nm("att B%d T%d C%d NH%d lse", B, T, C, NH), lse_f, lse_r, nl, sum_tol(T + HS),
                REF_RTOL);
        t_close(nm("att B%d T%d C%d NH%d dqkv", B, T, C, NH), dqkv_f, dqkv_r, nqkv,
                4 * sum_tol(T + HS), REF_RTOL);
        same_bits("att out", out_f, out_f2, no);
        same_bits("att lse", lse_f, lse_f2, nl);
        same_bits("att dqkv", dqkv_f, dqkv_f2, nqkv);
        free(qkv), free(dout), free(ws), free(out_r), free(lse_r), free(out_f), free(lse_f);
        free(out_f2), free(lse_f2), free(dqkv_r), free(dqkv_f), free(dqkv_f2);
    }

    // gradient check: odd head size with three heads, and two row blocks
    int gshapes[][4] = {{2, 5, 15, 3}, {1, 67, 6, 2}};
    for (int s = 0; s < 2; s++) {
        int B = gshapes[s][0], T = gshapes[s][1], C = gshapes[s][2], NH = gshapes[s][3];
        int HS = C / NH;
        size_t nqkv = (size_t)B * T * 3 * C, no = (size_t)B * T * C, nl = (size_t)B * NH * T;
        float *qkv = frand(nqkv, 81, 1.5f), *R = frand(no, 82, 1.0f);
        att_ctx ctx = {dcopy(qkv, nqkv), dcopy(R, no), malloc(no * 8), malloc(nl * 8), B, T, C, NH};
        double *g = numgrad(ctx.qkv, nqkv, att_loss, &ctx);
        attention_fwd_d(ctx.out, ctx.lse, ctx.qkv, B, T, C, NH);
        for (int fast = 0; fast < 2; fast++) {
            const char *v = fast ? "fast" : "ref";
            float *out = fnan(no), *lse = fnan(nl), *ws = att_workspace(T, HS);
            float *dqkv0 = frand(nqkv, 83, 1.0f), *dqkv = fcopy(dqkv0, nqkv);
            if (fast) {
                attention_forward(out, lse, qkv, ws, B, T, C, NH);
                attention_backward(dqkv, R, qkv, out, lse, ws, B, T, C, NH);
            } else {
                attention_forward_ref(out, lse, qkv, B, T, C, NH);
                attention_backward_ref(dqkv, R, qkv, out, lse, B, T, C, NH);
            }
            check_fwd(nm("att %s T%d out vs double", v, T), out, ctx.out, no);
            check_fwd(nm("att %s T%d lse vs double", v, T), lse, ctx.lse, nl);
            check_grad(nm("att %s T%d dqkv vs numeric", v, T), dqkv, dqkv0, g, nqkv);
            free(out), free(lse), free(ws), free(dqkv0), free(dqkv);
        }
        free(qkv), free(R), free(g), free(ctx.qkv), free(ctx.R), free(ctx.out), free(ctx.lse);
    }
}

// ----------------------------------------------------------------------------
// gelu and residual

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
    // elementwise: the SIMD path's exp is ~1 ulp, but the reference's
    // 1 + tanh(u) cancels for negative x, to ~|x| u / 2 absolute: 1e-6
    size_t sizes[] = {1, 7, 33, 100003};
    for (int s = 0; s < 4; s++) {
        size_t N = sizes[s];
        float *x = frand(N, 91, 6.0f), *dout = frand(N, 92, 1.0f);
        float *out_r = fnan(N), *out_f = fnan(N), *out_f2 = fnan(N);
        float *dx_r = frand(N, 93, 1.0f), *dx_f = fcopy(dx_r, N), *dx_f2 = fcopy(dx_r, N);
        gelu_forward_ref(out_r, x, N);
        gelu_forward(out_f, x, N);
        gelu_forward(out_f2, x, N);
        gelu_backward_ref(dx_r, x, dout, N);
        gelu_backward(dx_f, x, dout, N);
        gelu_backward(dx_f2, x, dout, N);
        t_close(nm("gelu N%zu out", N), out_f, out_r, N, 1e-6, REF_RTOL);
        t_close(nm("gelu N%zu dinp", N), dx_f, dx_r, N, 1e-6, REF_RTOL);
        same_bits("gelu out", out_f, out_f2, N);
        same_bits("gelu dinp", dx_f, dx_f2, N);
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
    gelu_forward(out_f, xs, nx);
    gelu_backward_ref(dx_r, xs, ones, nx);
    gelu_backward(dx_f, xs, ones, nx);
    t_close("gelu special out", out_f, out_r, nx, 1e-6, REF_RTOL);
    t_close("gelu special dinp", dx_f, dx_r, nx, 1e-6, REF_RTOL);

    // |x| up to 5 reaches the saturated tails
    size_t N = 64;
    float *x = frand(N, 94, 5.0f), *R = frand(N, 95, 1.0f);
    gelu_ctx ctx = {dcopy(x, N), dcopy(R, N), malloc(N * 8), N};
    double *g = numgrad(ctx.x, N, gelu_loss, &ctx);
    gelu_loss(&ctx);
    for (int fast = 0; fast < 2; fast++) {
        const char *v = fast ? "fast" : "ref";
        float *out = fnan(N), *dx0 = frand(N, 96, 1.0f), *dx = fcopy(dx0, N);
        (fast ? gelu_forward : gelu_forward_ref)(out, x, N);
        (fast ? gelu_backward : gelu_backward_ref)(dx, x, R, N);
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
        residual_forward(out_f, a, b, N);
        residual_forward(out_f2, a, b, N);
        residual_backward_ref(da_r, db_r, dout, N);
        residual_backward(da_f, db_f, dout, N);
        residual_backward(da_f2, db_f2, dout, N);
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
        (fast ? residual_forward : residual_forward_ref)(out, a, b, N);
        (fast ? residual_backward : residual_backward_ref)(da, db, R, N);
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
        softmax_xent_forward(loss_f, lse_f, logits, targets, N, V, Vp);
        softmax_xent_forward(loss_f2, lse_f2, logits, targets, N, V, Vp);
        softmax_xent_backward_ref(dx_r, logits, lse_r, targets, dl, N, V, Vp);
        softmax_xent_backward(dx_f, logits, lse_f, targets, dl, N, V, Vp);
        softmax_xent_backward(dx_f2, logits, lse_f, targets, dl, N, V, Vp);
        // lse ~ 8 + log V; gradients are dloss * p with errors of a few u * p
        t_close(nm("xent N%d V%d losses", N, V), loss_f, loss_r, N, 1e-5, REF_RTOL);
        t_close(nm("xent N%d V%d lse", N, V), lse_f, lse_r, N, 1e-5, REF_RTOL);
        t_close(nm("xent N%d V%d dlogits", N, V), dx_f, dx_r, n, 1e-7, REF_RTOL);
        same_bits("xent losses", loss_f, loss_f2, N);
        same_bits("xent dlogits", dx_f, dx_f2, n);
        // in place: the logits buffer becomes its own gradient
        float *buf = fcopy(logits, n);
        softmax_xent_backward(buf, buf, lse_f, targets, dl, N, V, Vp);
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
        softmax_xent_forward(loss_f, lse_f, x, tg, SN, SV, SVP);
        softmax_xent_backward_ref(dx_r, x, lse_r, tg, dl, SN, SV, SVP);
        softmax_xent_backward(dx_f, x, lse_f, tg, dl, SN, SV, SVP);
        t_close("xent special losses", loss_f, loss_r, SN, 1e-5, REF_RTOL);
        t_close("xent special lse", lse_f, lse_r, SN, 1e-5, REF_RTOL);
        t_close("xent special dlogits", dx_f, dx_r, SN * SVP, 1e-7, REF_RTOL);
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
        (fast ? softmax_xent_forward : softmax_xent_forward_ref)(losses, lse, logits, targets, N, V,
                                                                 Vp);
        (fast ? softmax_xent_backward : softmax_xent_backward_ref)(dx, logits, lse, targets, dl, N,
                                                                   V, Vp);
        check_fwd(nm("xent %s losses vs double", v), losses, ctx.losses, N);
        check_fwd(nm("xent %s lse vs double", v), lse, ctx.lse, N);
        check_grad(nm("xent %s dlogits vs numeric", v), dx, zero, g, n); // overwrites
        free(losses), free(lse), free(dx), free(zero);
    }
    free(logits), free(dl), free(g), free(ctx.logits), free(ctx.dl), free(ctx.losses);
    free(ctx.lse);
}

static int run_all(const char *path) {
    printf("%s paths: threads %d, avx512f %d\n", path, fl_threads(), fl_cpu()->avx512f);
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
    return t_report();
}

// fl_cpu() reads FITLM_NO_SIMD once per process, so the portable fallbacks
// of the SIMD kernels are tested in a child forked first thing, before any
// OpenMP thread exists; the parent then tests the CPU's own paths.
int main(void) {
    if (getenv("FITLM_NO_SIMD")) return run_all("portable (FITLM_NO_SIMD)");
    fflush(stdout);
    pid_t pid = fork();
    if (pid < 0) return t_check(0, "fork failed"), t_report();
    if (pid == 0) {
        setenv("FITLM_NO_SIMD", "1", 1);
        exit(run_all("portable"));
    }
    int status = 0;
    waitpid(pid, &status, 0);
    t_check(WIFEXITED(status) && WEXITSTATUS(status) == 0, "portable-path run failed");
    return run_all("native");
}
