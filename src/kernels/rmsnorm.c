// rmsnorm.c: RMSNorm over the last dim C, as Hugging Face's LlamaRMSNorm:
// y = x * rsqrt(mean(x^2) + eps) * weight, in fp32.
// Backward, with r = rstd and n_i = x_i r (the normalised input):
//   dx_i += r (w_i dy_i - n_i mean_j(w_j dy_j n_j)),  dw_i += sum_rows dy_i n_i.
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include "simd.h"
#include <math.h>

// channel block for the weight gradient, see rmsnorm_backward
#define RMS_CBLOCK 64

// One row's rstd. `omp simd` lets the compiler reassociate the sum of squares
// (the reference keeps plain sequential order); it stays in the baseline
// build, as a wider vector would sum in another order.
static float rmsnorm_rstd(const float *x, int C, float eps) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < C; i++) ss += x[i] * x[i];
    return norm_rstd(ss / C + eps);
}

// The elementwise loops, one copy per ISA (FL_ISA_COPIES, core.h): same bits on each.
static inline __attribute__((always_inline)) void
rms_norm_body(float *out, const float *x, const float *weight, float r, int C) {
    for (int i = 0; i < C; i++) out[i] = x[i] * r * weight[i];
}
FL_ISA_COPIES(rms_norm, (float *out, const float *x, const float *weight, float r, int C),
              (out, x, weight, r, C))

static inline __attribute__((always_inline)) void rms_dx_body(float *dx, const float *x,
                                                              const float *dy, const float *weight,
                                                              float r, float dnorm_norm_mean,
                                                              int C) {
    for (int i = 0; i < C; i++) dx[i] += (weight[i] * dy[i] - x[i] * r * dnorm_norm_mean) * r;
}
FL_ISA_COPIES(rms_dx,
              (float *dx, const float *x, const float *dy, const float *weight, float r,
               float dnorm_norm_mean, int C),
              (dx, x, dy, weight, r, dnorm_norm_mean, C))

// one row's terms of the weight gradient
static inline __attribute__((always_inline)) void rms_dw_body(float *dw, const float *x,
                                                              const float *dy, float r, int nc) {
    for (int i = 0; i < nc; i++) dw[i] += x[i] * r * dy[i];
}
FL_ISA_COPIES(rms_dw, (float *dw, const float *x, const float *dy, float r, int nc),
              (dw, x, dy, r, nc))

// 16-bit rows are converted into fp32 buffers of C floats on each thread's
// stack (the weight once per thread); fp32 rows are used in place.
void rmsnorm_forward(fl_dtype dt, void *out, float *rstd, const void *inp, const void *weight,
                     int N, int C, float eps) {
    // out, inp (N,C); rstd (N); weight (C)
    __typeof__(rms_norm_portable) *rms_norm = rms_norm_for(fl_cpu_isa());
#pragma omp parallel if ((size_t)N * C >= FL_PAR_MIN_VALUES)
    {
        float w32[C], x32[C], y32[C];
        const float *w = fl_load_f32(dt, weight, C, w32);
#pragma omp for nowait
        for (int n = 0; n < N; n++) {
            void *y = fl_at(dt, out, (size_t)n * C);
            float *y_f = fp32_out(dt, y, y32);
            const float *x = fl_load_f32(dt, fl_at_const(dt, inp, (size_t)n * C), C, x32);
            rstd[n] = rmsnorm_rstd(x, C, eps);
            rms_norm(y_f, x, w, rstd[n], C);
            fp32_flush(dt, y, y_f, C);
        }
    }
}

void rmsnorm_backward(fl_dtype dt, void *dinp, void *dweight, const void *dout, const void *inp,
                      const void *weight, const float *rstd, int N, int C) {
    fl_isa isa = fl_cpu_isa();
    __typeof__(rms_dx_portable) *rms_dx = rms_dx_for(isa);
    __typeof__(rms_dw_portable) *rms_dw = rms_dw_for(isa);
    // One region for both loops: a thread is woken once per call. They share
    // nothing (the weight sums read inp and dout, never dinp, which must
    // not alias dout), so neither waits for the other (nowait).
#pragma omp parallel if ((size_t)N * C >= FL_PAR_MIN_VALUES)
    {
        // dinp: rows are independent
        float w32[C], x32[C], dy32[C], dx32[C];
        const float *weight_f = fl_load_f32(dt, weight, C, w32);
#pragma omp for nowait
        for (int n = 0; n < N; n++) {
            const float *x = fl_load_f32(dt, fl_at_const(dt, inp, (size_t)n * C), C, x32);
            const float *dy = fl_load_f32(dt, fl_at_const(dt, dout, (size_t)n * C), C, dy32);
            float *dx = fp32_rmw(dt, fl_at(dt, dinp, (size_t)n * C), C, dx32);
            float r = rstd[n];
            float dnorm_norm_mean = 0.0f;
#pragma omp simd reduction(+ : dnorm_norm_mean)
            for (int i = 0; i < C; i++) dnorm_norm_mean += weight_f[i] * dy[i] * (x[i] * r);
            dnorm_norm_mean /= C;
            rms_dx(dx, x, dy, weight_f, r, dnorm_norm_mean, C);
            fp32_flush(dt, fl_at(dt, dinp, (size_t)n * C), dx, C);
        }
        // dweight (none for a frozen weight): each thread owns a range of
        // channels and sums the rows in order, so there is no reduction
        // across threads (deterministic); the sums stay in fp32 until all
        // rows are in. Row by row the range goes in blocks of RMS_CBLOCK
        // channels (their sums stay in L1), a 16-bit row's part converted
        // once for all of them.
        int c0, c1;
        thread_block_range(dweight ? C : 0, RMS_CBLOCK, &c0, &c1);
        if (c0 < c1) {
            int nc = c1 - c0;
            float *dw = fp32_rmw(dt, fl_at(dt, dweight, c0), nc, dx32);
            for (int n = 0; n < N; n++) {
                size_t off = (size_t)n * C + c0;
                const float *x = fl_load_f32(dt, fl_at_const(dt, inp, off), nc, x32);
                const float *dy = fl_load_f32(dt, fl_at_const(dt, dout, off), nc, dy32);
                for (int b = 0; b < nc; b += RMS_CBLOCK)
                    rms_dw(dw + b, x + b, dy + b, rstd[n],
                           nc - b < RMS_CBLOCK ? nc - b : RMS_CBLOCK);
            }
            fp32_flush(dt, fl_at(dt, dweight, c0), dw, nc);
        }
    }
}

void residual_rmsnorm_forward(fl_dtype dt, void *res, void *out, float *rstd, const void *skip,
                              const void *weight, int N, int C, float eps) {
    residual_forward(dt, res, skip, res, (size_t)N * C);
    rmsnorm_forward(dt, out, rstd, res, weight, N, C, eps);
}

void rmsnorm_forward_ref(float *out, float *rstd, const float *inp, const float *weight, int N,
                         int C, float eps) {
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        float *y = out + (size_t)n * C;
        float ss = 0.0f;
        for (int i = 0; i < C; i++) ss += x[i] * x[i];
        float r = norm_rstd(ss / C + eps);
        for (int i = 0; i < C; i++) y[i] = x[i] * r * weight[i];
        rstd[n] = r;
    }
}

void rmsnorm_backward_ref(float *dinp, float *dweight, const float *dout, const float *inp,
                          const float *weight, const float *rstd, int N, int C) {
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
        float *dx = dinp + (size_t)n * C;
        float r = rstd[n];
        // the mean that couples the row's gradients
        float dnorm_norm_mean = 0.0f;
        for (int i = 0; i < C; i++) dnorm_norm_mean += weight[i] * dy[i] * (x[i] * r);
        dnorm_norm_mean /= C;
        for (int i = 0; i < C; i++) {
            float norm = x[i] * r;
            dweight[i] += norm * dy[i];
            dx[i] += (weight[i] * dy[i] - norm * dnorm_norm_mean) * r;
        }
    }
}
