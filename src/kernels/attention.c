// attention.c: causal multi-head self-attention, flash style.
// Nothing of size (T,T) survives the forward: only lse (B,NH,T), the log of
// each row's softmax denominator, from which the backward recomputes P.
// The fast version walks each (b,h) head in blocks of ATT_BR query rows; the
// block of rows i0..n-1 only sees keys 0..n-1 (causality), so the GEMMs skip
// the masked upper triangle and the per-thread workspace is ATT_BR rows of T
// scores rather than a (T,T) matrix.
// q, k, v and the gradients are read and written in place in qkv/dqkv with a
// leading dimension of 3C: no gathering into contiguous buffers is needed.
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include <cblas.h>
#include <math.h>
#include <omp.h>

#define ATT_BR 64 // query rows per block

// scores block P (ATT_BR,T), dP block (ATT_BR,T), D (ATT_BR)
size_t attention_workspace_floats(int T, int HS) {
    (void)HS; // q, k, v are used in place, so only score blocks are needed
    return (size_t)2 * ATT_BR * T + ATT_BR;
}

void attention_forward(float *out, float *lse, const float *qkv, float *workspace, int B, int T,
                       int C, int NH) {
    FL_ASSERT(NH > 0 && C % NH == 0);
    int HS = C / NH, C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)HS);
    size_t ws_per_thread = attention_workspace_floats(T, HS);
#pragma omp parallel for
    for (int bh = 0; bh < B * NH; bh++) {
        int b = bh / NH, h = bh % NH;
        float *S = workspace + (size_t)omp_get_thread_num() * ws_per_thread;
        const float *q = qkv + (size_t)b * T * C3 + h * HS, *k = q + C, *v = q + 2 * C;
        float *o = out + (size_t)b * T * C + h * HS;
        float *lse_bh = lse + (size_t)bh * T;
        for (int i0 = 0; i0 < T; i0 += ATT_BR) {
            int nb = T - i0 < ATT_BR ? T - i0 : ATT_BR, n = i0 + nb; // rows i0..n-1, keys 0..n-1
            // S (nb,n) = scale * Q[i0:n] K[0:n]^T
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb, n, HS, scale,
                        q + (size_t)i0 * C3, C3, k, C3, 0.0f, S, n);
            for (int r = 0; r < nb; r++) {
                int i = i0 + r;
                float *row = S + (size_t)r * n;
                float maxval = -INFINITY;
                for (int j = 0; j <= i; j++) maxval = fmaxf(maxval, row[j]);
                float sum = 0.0f;
                for (int j = 0; j <= i; j++) {
                    row[j] = expf(row[j] - maxval);
                    sum += row[j];
                }
                float inv = 1.0f / sum;
                for (int j = 0; j <= i; j++) row[j] *= inv;
                for (int j = i + 1; j < n; j++) row[j] = 0.0f; // causal mask
                lse_bh[i] = maxval + logf(sum);
            }
            // O[i0:n] (nb,HS) = P V[0:n], written straight into out
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nb, HS, n, 1.0f, S, n, v, C3,
                        0.0f, o + (size_t)i0 * C, C);
        }
    }
}

void attention_backward(float *dqkv, const float *dout, const float *qkv, const float *out,
                        const float *lse, float *workspace, int B, int T, int C, int NH) {
    FL_ASSERT(NH > 0 && C % NH == 0);
    int HS = C / NH, C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)HS);
    size_t ws_per_thread = attention_workspace_floats(T, HS);
    // each (b,h) owns its own columns of dqkv, so heads never race
#pragma omp parallel for
    for (int bh = 0; bh < B * NH; bh++) {
        int b = bh / NH, h = bh % NH;
        float *P = workspace + (size_t)omp_get_thread_num() * ws_per_thread;
        float *dP = P + (size_t)ATT_BR * T, *D = dP + (size_t)ATT_BR * T;
        const float *q = qkv + (size_t)b * T * C3 + h * HS, *k = q + C, *v = q + 2 * C;
        float *dq = dqkv + (size_t)b * T * C3 + h * HS, *dk = dq + C, *dv = dq + 2 * C;
        const float *o = out + (size_t)b * T * C + h * HS, *dO = dout + (size_t)b * T * C + h * HS;
        const float *lse_bh = lse + (size_t)bh * T;
        for (int i0 = 0; i0 < T; i0 += ATT_BR) {
            int nb = T - i0 < ATT_BR ? T - i0 : ATT_BR, n = i0 + nb;
            const float *q_blk = q + (size_t)i0 * C3, *dO_blk = dO + (size_t)i0 * C;
            // recompute P = exp(scale * Q K^T - lse), masked
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb, n, HS, scale, q_blk, C3, k, C3,
                        0.0f, P, n);
            for (int r = 0; r < nb; r++) {
                int i = i0 + r;
                float *row = P + (size_t)r * n;
                for (int j = 0; j <= i; j++) row[j] = expf(row[j] - lse_bh[i]);
                for (int j = i + 1; j < n; j++) row[j] = 0.0f;
                // D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij
                const float *o_i = o + (size_t)i * C, *dO_i = dO + (size_t)i * C;
                float d = 0.0f;
                for (int e = 0; e < HS; e++) d += dO_i[e] * o_i[e];
                D[r] = d;
            }
            // dV[0:n] += P^T dO[i0:n]
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, HS, nb, 1.0f, P, n, dO_blk, C,
                        1.0f, dv, C3);
            // dP = dO V^T, then dS = P * (dP - D) in place
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb, n, HS, 1.0f, dO_blk, C, v, C3,
                        0.0f, dP, n);
            for (int r = 0; r < nb; r++) {
                float *dS = dP + (size_t)r * n;
                const float *p = P + (size_t)r * n;
                for (int j = 0; j < n; j++) dS[j] = p[j] * (dS[j] - D[r]);
            }
            // dQ[i0:n] += scale * dS K[0:n] ; dK[0:n] += scale * dS^T Q[i0:n]
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nb, HS, n, scale, dP, n, k, C3,
                        1.0f, dq + (size_t)i0 * C3, C3);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, HS, nb, scale, dP, n, q_blk, C3,
                        1.0f, dk, C3);
        }
    }
}

static float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

void attention_forward_ref(float *out, float *lse, const float *qkv, int B, int T, int C, int NH) {
    int HS = C / NH, C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)HS);
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            const float *head = qkv + (size_t)b * T * C3 + h * HS; // position 0's q; k +C, v +2C
            for (int t = 0; t < T; t++) {
                const float *q = head + (size_t)t * C3;
                float maxval = -INFINITY;
                for (int t2 = 0; t2 <= t; t2++)
                    maxval = fmaxf(maxval, scale * dot(q, head + (size_t)t2 * C3 + C, HS));
                float sum = 0.0f;
                for (int t2 = 0; t2 <= t; t2++)
                    sum += expf(scale * dot(q, head + (size_t)t2 * C3 + C, HS) - maxval);
                // cppcheck-suppress invalidFunctionArg ; the loop above ran at least once
                float l = maxval + logf(sum);
                lse[((size_t)b * NH + h) * T + t] = l;
                float *o = out + ((size_t)b * T + t) * C + h * HS;
                for (int e = 0; e < HS; e++) o[e] = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float *k = head + (size_t)t2 * C3 + C, *v = k + C;
                    float p = expf(scale * dot(q, k, HS) - l);
                    for (int e = 0; e < HS; e++) o[e] += p * v[e];
                }
            }
        }
    }
}

void attention_backward_ref(float *dqkv, const float *dout, const float *qkv, const float *out,
                            const float *lse, int B, int T, int C, int NH) {
    (void)out; // D is summed as P.dP here, so the oracle does not trust out
    int HS = C / NH, C3 = 3 * C;
    float scale = 1.0f / sqrtf((float)HS);
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            size_t head = (size_t)b * T * C3 + h * HS; // offset of position 0's q in (d)qkv
            for (int t = 0; t < T; t++) {
                const float *q = qkv + head + (size_t)t * C3;
                const float *dO = dout + ((size_t)b * T + t) * C + h * HS;
                float *dq = dqkv + head + (size_t)t * C3;
                float l = lse[((size_t)b * NH + h) * T + t];
                // P_j = softmax weight of key j, dP_j = dO . v_j, D = sum_j P_j dP_j
                float D = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float *k = qkv + head + (size_t)t2 * C3 + C, *v = k + C;
                    D += expf(scale * dot(q, k, HS) - l) * dot(dO, v, HS);
                }
                for (int t2 = 0; t2 <= t; t2++) {
                    const float *k = qkv + head + (size_t)t2 * C3 + C, *v = k + C;
                    float *dk = dqkv + head + (size_t)t2 * C3 + C, *dv = dk + C;
                    float p = expf(scale * dot(q, k, HS) - l);
                    float ds = p * (dot(dO, v, HS) - D); // through the softmax
                    for (int e = 0; e < HS; e++) {
                        dq[e] += scale * ds * k[e];
                        dk[e] += scale * ds * q[e];
                        dv[e] += p * dO[e];
                    }
                }
            }
        }
    }
}
