// layernorm.c: LayerNorm over the last dim C, biased variance, eps 1e-5.
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include "simd.h"
#include <math.h>

#define LN_EPS 1e-5f
// channel block for the weight/bias gradients, see layernorm_backward
#define LN_CBLOCK 64

// One row's mean and rstd. `omp simd` lets the compiler reassociate the sums
// (the reference keeps plain sequential order); they stay in the baseline
// build, as a wider vector would sum in another order.
static void layernorm_stats(float *mean, float *rstd, const float *x, int C) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < C; i++) s += x[i];
    float m = s / C;
    float v = 0.0f;
#pragma omp simd reduction(+ : v)
    for (int i = 0; i < C; i++) v += (x[i] - m) * (x[i] - m);
    *mean = m;
    *rstd = norm_rstd(v / C + LN_EPS);
}

// The elementwise loops, one copy per ISA (simd.h): same bits on each.
static inline __attribute__((always_inline)) void ln_norm_body(float *out, const float *x,
                                                               const float *weight,
                                                               const float *bias, float m, float r,
                                                               int C) {
    for (int i = 0; i < C; i++) out[i] = (x[i] - m) * r * weight[i] + bias[i];
}
FL_ISA_COPIES(ln_norm,
              (float *out, const float *x, const float *weight, const float *bias, float m, float r,
               int C),
              (out, x, weight, bias, m, r, C))

static inline __attribute__((always_inline)) void ln_dx_body(float *dx, const float *x,
                                                             const float *dy, const float *weight,
                                                             float m, float r, float dnorm_mean,
                                                             float dnorm_norm_mean, int C) {
    for (int i = 0; i < C; i++) {
        float norm = (x[i] - m) * r;
        dx[i] += (weight[i] * dy[i] - dnorm_mean - norm * dnorm_norm_mean) * r;
    }
}
FL_ISA_COPIES(ln_dx,
              (float *dx, const float *x, const float *dy, const float *weight, float m, float r,
               float dnorm_mean, float dnorm_norm_mean, int C),
              (dx, x, dy, weight, m, r, dnorm_mean, dnorm_norm_mean, C))

// one row's terms of the weight and bias gradients
static inline __attribute__((always_inline)) void
ln_dwdb_body(float *dw, float *db, const float *x, const float *dy, float m, float r, int nc) {
    for (int i = 0; i < nc; i++) {
        db[i] += dy[i];
        dw[i] += (x[i] - m) * r * dy[i];
    }
}
FL_ISA_COPIES(ln_dwdb,
              (float *dw, float *db, const float *x, const float *dy, float m, float r, int nc),
              (dw, db, x, dy, m, r, nc))

// 16-bit rows are converted into fp32 buffers of C floats on each thread's
// stack (weight and bias once per thread); fp32 rows are used in place.
void layernorm_forward(fl_dtype dt, void *out, float *mean, float *rstd, const void *inp,
                       const void *weight, const void *bias, int N, int C) {
    // out, inp (N,C); mean, rstd (N); weight, bias (C)
    __typeof__(ln_norm_portable) *ln_norm = ln_norm_for(fl_cpu_isa());
#pragma omp parallel if ((size_t)N * C >= FL_PAR_MIN_VALUES)
    {
        float w32[C], b32[C], x32[C], y32[C];
        const float *w = fl_load_f32(dt, weight, C, w32), *b = fl_load_f32(dt, bias, C, b32);
#pragma omp for nowait
        for (int n = 0; n < N; n++) {
            void *y = fl_at(dt, out, (size_t)n * C);
            float *y_f = fp32_out(dt, y, y32);
            const float *x = fl_load_f32(dt, fl_at_const(dt, inp, (size_t)n * C), C, x32);
            layernorm_stats(mean + n, rstd + n, x, C);
            ln_norm(y_f, x, w, b, mean[n], rstd[n], C);
            fp32_flush(dt, y, y_f, C);
        }
    }
}

void layernorm_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias, const void *dout,
                        const void *inp, const void *weight, const float *mean, const float *rstd,
                        int N, int C) {
    fl_isa isa = fl_cpu_isa();
    __typeof__(ln_dx_portable) *ln_dx = ln_dx_for(isa);
    __typeof__(ln_dwdb_portable) *ln_dwdb = ln_dwdb_for(isa);
    // One region for both loops: a thread is woken once per call. They share
    // nothing (the weight sums read inp and dout, never dinp, which must
    // not alias dout), so neither waits for the other (nowait).
#pragma omp parallel if ((size_t)N * C >= FL_PAR_MIN_VALUES)
    {
        // dinp: rows are independent
        float w32[C], x32[C], dy32[C], dx32[C], db32[C];
        const float *weight_f = fl_load_f32(dt, weight, C, w32);
#pragma omp for nowait
        for (int n = 0; n < N; n++) {
            const float *x = fl_load_f32(dt, fl_at_const(dt, inp, (size_t)n * C), C, x32);
            const float *dy = fl_load_f32(dt, fl_at_const(dt, dout, (size_t)n * C), C, dy32);
            float *dx = fp32_rmw(dt, fl_at(dt, dinp, (size_t)n * C), C, dx32);
            float m = mean[n], r = rstd[n];
            float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
#pragma omp simd reduction(+ : dnorm_mean, dnorm_norm_mean)
            for (int i = 0; i < C; i++) {
                float dnorm = weight_f[i] * dy[i];
                dnorm_mean += dnorm;
                dnorm_norm_mean += dnorm * (x[i] - m) * r;
            }
            dnorm_mean /= C;
            dnorm_norm_mean /= C;
            ln_dx(dx, x, dy, weight_f, m, r, dnorm_mean, dnorm_norm_mean, C);
            fp32_flush(dt, fl_at(dt, dinp, (size_t)n * C), dx, C);
        }
        // dweight, dbias (none for a frozen weight and bias): each thread owns
        // a range of channels and sums the rows in order, so there is no
        // reduction across threads (deterministic); the sums stay in fp32
        // until all rows are in. Row by row the range goes in blocks of
        // LN_CBLOCK channels (their sums stay in L1), a 16-bit row's part
        // converted once for all of them.
        int c0, c1;
        thread_block_range(dweight ? C : 0, LN_CBLOCK, &c0, &c1);
        if (c0 < c1) {
            int nc = c1 - c0;
            float *dw = fp32_rmw(dt, fl_at(dt, dweight, c0), nc, dx32);
            float *db = fp32_rmw(dt, fl_at(dt, dbias, c0), nc, db32);
            for (int n = 0; n < N; n++) {
                size_t off = (size_t)n * C + c0;
                const float *x = fl_load_f32(dt, fl_at_const(dt, inp, off), nc, x32);
                const float *dy = fl_load_f32(dt, fl_at_const(dt, dout, off), nc, dy32);
                for (int b = 0; b < nc; b += LN_CBLOCK)
                    ln_dwdb(dw + b, db + b, x + b, dy + b, mean[n], rstd[n],
                            nc - b < LN_CBLOCK ? nc - b : LN_CBLOCK);
            }
            fp32_flush(dt, fl_at(dt, dweight, c0), dw, nc);
            fp32_flush(dt, fl_at(dt, dbias, c0), db, nc);
        }
    }
}

void residual_layernorm_forward(fl_dtype dt, void *res, void *out, float *mean, float *rstd,
                                const void *skip, const void *weight, const void *bias, int N,
                                int C) {
    residual_forward(dt, res, skip, res, (size_t)N * C);
    layernorm_forward(dt, out, mean, rstd, res, weight, bias, N, C);
}

void layernorm_forward_ref(float *out, float *mean, float *rstd, const float *inp,
                           const float *weight, const float *bias, int N, int C) {
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        float *y = out + (size_t)n * C;
        float m = 0.0f;
        for (int i = 0; i < C; i++) m += x[i];
        m /= C;
        float v = 0.0f;
        for (int i = 0; i < C; i++) v += (x[i] - m) * (x[i] - m);
        v /= C;
        float r = norm_rstd(v + LN_EPS);
        for (int i = 0; i < C; i++) y[i] = (x[i] - m) * r * weight[i] + bias[i];
        mean[n] = m;
        rstd[n] = r;
    }
}

void layernorm_backward_ref(float *dinp, float *dweight, float *dbias, const float *dout,
                            const float *inp, const float *weight, const float *mean,
                            const float *rstd, int N, int C) {
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
        float *dx = dinp + (size_t)n * C;
        // the two means that couple the row's gradients
        float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
        for (int i = 0; i < C; i++) {
            float norm = (x[i] - mean[n]) * rstd[n];
            float dnorm = weight[i] * dy[i];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * norm;
        }
        dnorm_mean /= C;
        dnorm_norm_mean /= C;
        for (int i = 0; i < C; i++) {
            float norm = (x[i] - mean[n]) * rstd[n];
            float dnorm = weight[i] * dy[i];
            dbias[i] += dy[i];
            dweight[i] += norm * dy[i];
            dx[i] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * rstd[n];
        }
    }
}
