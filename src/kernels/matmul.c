// matmul.c: out (N,OC) = inp (N,C) @ weight^T + bias, weight (OC,C) as in
// nn.Linear. The fast path hands everything to OpenBLAS's sgemm; transposes
// are expressed through the sgemm flags, never materialised.
#include "fitlm/kernels.h"

#include <cblas.h>

// output-channel block for the bias gradient (see matmul_backward)
#define MM_OCBLOCK 64

void matmul_forward(float *out, const float *inp, const float *weight, const float *bias, int N,
                    int C, int OC) {
    // with a bias, prefill out with it and let sgemm add the product (beta=1)
    if (bias) {
#pragma omp parallel for
        for (int n = 0; n < N; n++)
            for (int o = 0; o < OC; o++) out[(size_t)n * OC + o] = bias[o];
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C,
                bias ? 1.0f : 0.0f, out, OC);
}

void matmul_backward(float *dinp, float *dweight, float *dbias, const float *dout, const float *inp,
                     const float *weight, int N, int C, int OC) {
    // dinp (N,C) += dout (N,OC) @ weight (OC,C)
    if (dinp)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, weight, C,
                    1.0f, dinp, C);
    // dweight (OC,C) += dout^T (OC,N) @ inp (N,C)
    if (dweight)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f,
                    dweight, C);
    // dbias (OC) += column sums of dout: each thread owns a block of output
    // channels and sums the rows in order (deterministic, no atomics)
    if (dbias) {
        int nblocks = (OC + MM_OCBLOCK - 1) / MM_OCBLOCK;
#pragma omp parallel for
        for (int blk = 0; blk < nblocks; blk++) {
            int o0 = blk * MM_OCBLOCK, o1 = o0 + MM_OCBLOCK < OC ? o0 + MM_OCBLOCK : OC;
            for (int n = 0; n < N; n++) {
                const float *dout_n = dout + (size_t)n * OC;
                for (int o = o0; o < o1; o++) dbias[o] += dout_n[o];
            }
        }
    }
}

void matmul_forward_ref(float *out, const float *inp, const float *weight, const float *bias, int N,
                        int C, int OC) {
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C;
        for (int o = 0; o < OC; o++) {
            const float *w = weight + (size_t)o * C;
            float val = bias ? bias[o] : 0.0f;
            for (int i = 0; i < C; i++) val += x[i] * w[i];
            out[(size_t)n * OC + o] = val;
        }
    }
}

void matmul_backward_ref(float *dinp, float *dweight, float *dbias, const float *dout,
                         const float *inp, const float *weight, int N, int C, int OC) {
    for (int n = 0; n < N; n++) {
        const float *x = inp + (size_t)n * C, *dy = dout + (size_t)n * OC;
        for (int o = 0; o < OC; o++) {
            const float *w = weight + (size_t)o * C;
            if (dinp)
                for (int i = 0; i < C; i++) dinp[(size_t)n * C + i] += dy[o] * w[i];
            if (dweight)
                for (int i = 0; i < C; i++) dweight[(size_t)o * C + i] += dy[o] * x[i];
            if (dbias) dbias[o] += dy[o];
        }
    }
}
