// layernorm.c: LayerNorm over the last dim C, biased variance, eps 1e-5.
#include "fitlm/kernels.h"

#include <math.h>

#define LN_EPS 1e-5f
// channel block for the weight/bias gradients, see layernorm_backward
#define LN_CBLOCK 64

// One row: the fast version lets the compiler reassociate the sums
// (omp simd), the reference keeps plain sequential order.
static void layernorm_row_fast(float *out, float *mean, float *rstd, const float *x,
                               const float *weight, const float *bias, int C) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < C; i++) s += x[i];
    float m = s / C;
    float v = 0.0f;
#pragma omp simd reduction(+ : v)
    for (int i = 0; i < C; i++) v += (x[i] - m) * (x[i] - m);
    float r = 1.0f / sqrtf(v / C + LN_EPS);
    for (int i = 0; i < C; i++) out[i] = (x[i] - m) * r * weight[i] + bias[i];
    *mean = m;
    *rstd = r;
}

void layernorm_forward(float *out, float *mean, float *rstd, const float *inp, const float *weight,
                       const float *bias, int N, int C) {
    // out, inp (N,C); mean, rstd (N); weight, bias (C)
#pragma omp parallel for
    for (int n = 0; n < N; n++)
        layernorm_row_fast(out + (size_t)n * C, mean + n, rstd + n, inp + (size_t)n * C, weight,
                           bias, C);
}

void layernorm_backward(float *dinp, float *dweight, float *dbias, const float *dout,
                        const float *inp, const float *weight, const float *mean, const float *rstd,
                        int N, int C) {
    // dinp: rows are independent
#pragma omp parallel for
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
        float *dx = dinp + (size_t)n * C;
        float m = mean[n], r = rstd[n];
        float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
#pragma omp simd reduction(+ : dnorm_mean, dnorm_norm_mean)
        for (int i = 0; i < C; i++) {
            float dnorm = weight[i] * dy[i];
            dnorm_mean += dnorm;
            dnorm_norm_mean += dnorm * (x[i] - m) * r;
        }
        dnorm_mean /= C;
        dnorm_norm_mean /= C;
        for (int i = 0; i < C; i++) {
            float norm = (x[i] - m) * r;
            dx[i] += (weight[i] * dy[i] - dnorm_mean - norm * dnorm_norm_mean) * r;
        }
    }
    // dweight, dbias: each thread owns a block of channels and sums the rows
    // in order, so there is no reduction across threads (deterministic)
    int nblocks = (C + LN_CBLOCK - 1) / LN_CBLOCK;
#pragma omp parallel for
    for (int blk = 0; blk < nblocks; blk++) {
        int c0 = blk * LN_CBLOCK, c1 = c0 + LN_CBLOCK < C ? c0 + LN_CBLOCK : C;
        for (int n = 0; n < N; n++) {
            const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * C;
            float m = mean[n], r = rstd[n];
            for (int i = c0; i < c1; i++) {
                dbias[i] += dy[i];
                dweight[i] += (x[i] - m) * r * dy[i];
            }
        }
    }
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
        float r = 1.0f / sqrtf(v + LN_EPS);
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
