// attention.c: causal multi-head self-attention with grouped-query
// attention (NH query heads share NKV key/value heads), flash style.
// Nothing of size (T,T) survives the forward: only lse (B,NH,T), the log of
// each row's softmax denominator, from which the backward recomputes P.
// The fast version walks each (b, query head) in blocks of ATT_BR query rows;
// the block of rows i0..n-1 only sees keys 0..n-1 (causality), so the GEMMs
// skip the masked upper triangle and the per-thread workspace is ATT_BR rows
// of T scores rather than a (T,T) matrix. The backward runs one (b, kv head)
// per work item and its group's query heads inside it, in order: they all
// add into the same dk and dv, so this keeps it race-free and deterministic
// (with NKV == NH each item is one head, as in plain multi-head attention).
// fp32 q, k, v and their gradients are read and written in place in
// qkv/dqkv with a leading dimension of (NH+2*NKV)*HS (out and dout: NH*HS).
// For bf16/fp16 each head is first gathered into contiguous fp32 copies
// (leading dimension HS) in the workspace, the same algorithm runs on those,
// and the gradients, accumulated there in fp32 (dk and dv over the whole
// group), are rounded back into dqkv once.
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include "simd.h"
#include <cblas.h>
#include <math.h>
#include <omp.h>

#define ATT_BR 64 // query rows per block

// scores block P (ATT_BR,T), dP block (ATT_BR,T), D (ATT_BR); for 16-bit data
// also fp32 copies (T,HS) of q, k, v, out, dout, dq, dk and dv. The backward
// keeps one kv head's k, v, dk, dv for the whole group and reuses the query
// head's slots, so the size does not depend on the group.
size_t attention_workspace_floats(fl_dtype dt, int T, int HS, int group) {
    FL_ASSERT(group >= 1);
    size_t copies = dt == FL_F32 ? 0 : (size_t)8 * T * HS;
    return (size_t)2 * ATT_BR * T + ATT_BR + copies;
}

// An fp32 view of one head: T rows of HS values at src, ld elements apart.
// fp32: src itself (leading dimension ld); else its values converted into
// the workspace's copy number `slot` (leading dimension HS).
static float *head_f32(fl_dtype dt, const void *src, int ld, int T, int HS, float *copies,
                       int slot) {
    if (dt == FL_F32) return (float *)src;
    float *copy = copies + (size_t)slot * T * HS;
    for (int t = 0; t < T; t++)
        fl_convert(FL_F32, copy + (size_t)t * HS, dt, fl_at_const(dt, src, (size_t)t * ld), HS);
    return copy;
}

// Stores a head's fp32 copy (leading dimension HS) into dst; for fp32 the
// view was dst itself, so there is nothing to do.
static void head_flush(fl_dtype dt, void *dst, int ld, int T, int HS, const float *copy) {
    for (int t = 0; dt != FL_F32 && t < T; t++)
        fl_store_f32(dt, fl_at(dt, dst, (size_t)t * ld), copy + (size_t)t * HS, HS);
}

static void check_heads(int NH, int NKV, int HS) {
    FL_ASSERT(NH > 0 && NKV > 0 && NH % NKV == 0 && HS > 0);
}

void attention_forward(fl_dtype dt, void *out, float *lse, const void *qkv, float *workspace, int B,
                       int T, int NH, int NKV, int HS) {
    check_heads(NH, NKV, HS);
    int group = NH / NKV, C = NH * HS, W = (NH + 2 * NKV) * HS;   // out and qkv row widths
    int ldq = dt == FL_F32 ? W : HS, ldo = dt == FL_F32 ? C : HS; // of the fp32 views
    float scale = 1.0f / sqrtf((float)HS);
    size_t ws_per_thread = attention_workspace_floats(dt, T, HS, group);
#pragma omp parallel for
    for (int bh = 0; bh < B * NH; bh++) {
        int b = bh / NH, h = bh % NH, g = h / group;
        float *S = workspace + (size_t)omp_get_thread_num() * ws_per_thread;
        float *copies = S + (size_t)2 * ATT_BR * T + ATT_BR;
        const void *row0 = fl_at_const(dt, qkv, (size_t)b * T * W);
        const float *q = head_f32(dt, fl_at_const(dt, row0, (size_t)h * HS), W, T, HS, copies, 0);
        const float *k =
            head_f32(dt, fl_at_const(dt, row0, (size_t)C + g * HS), W, T, HS, copies, 1);
        const float *v =
            head_f32(dt, fl_at_const(dt, row0, (size_t)C + (NKV + g) * HS), W, T, HS, copies, 2);
        void *oh = fl_at(dt, out, (size_t)b * T * C + h * HS);
        float *o = dt == FL_F32 ? (float *)oh : copies + 3 * (size_t)T * HS;
        float *lse_bh = lse + (size_t)bh * T;
        for (int i0 = 0; i0 < T; i0 += ATT_BR) {
            int nb = T - i0 < ATT_BR ? T - i0 : ATT_BR, n = i0 + nb; // rows i0..n-1, keys 0..n-1
            // S (nb,n) = scale * Q[i0:n] K[0:n]^T
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb, n, HS, scale,
                        q + (size_t)i0 * ldq, ldq, k, ldq, 0.0f, S, n);
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
            // O[i0:n] (nb,HS) = P V[0:n]
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nb, HS, n, 1.0f, S, n, v, ldq,
                        0.0f, o + (size_t)i0 * ldo, ldo);
        }
        head_flush(dt, oh, C, T, HS, o);
    }
}

void attention_backward(fl_dtype dt, void *dqkv, const void *dout, const void *qkv, const void *out,
                        const float *lse, float *workspace, int B, int T, int NH, int NKV, int HS) {
    check_heads(NH, NKV, HS);
    int group = NH / NKV, C = NH * HS, W = (NH + 2 * NKV) * HS;   // out and qkv row widths
    int ldq = dt == FL_F32 ? W : HS, ldo = dt == FL_F32 ? C : HS; // of the fp32 views
    float scale = 1.0f / sqrtf((float)HS);
    size_t ws_per_thread = attention_workspace_floats(dt, T, HS, group);
    // each (b, kv head) owns its own columns of dqkv: its dk, dv and its
    // query heads' dq, so work items never race
#pragma omp parallel for
    for (int bg = 0; bg < B * NKV; bg++) {
        int b = bg / NKV, g = bg % NKV;
        float *P = workspace + (size_t)omp_get_thread_num() * ws_per_thread;
        float *dP = P + (size_t)ATT_BR * T, *D = dP + (size_t)ATT_BR * T, *copies = D + ATT_BR;
        const void *row0 = fl_at_const(dt, qkv, (size_t)b * T * W);
        void *drow0 = fl_at(dt, dqkv, (size_t)b * T * W);
        void *dkh = fl_at(dt, drow0, (size_t)C + g * HS);
        void *dvh = fl_at(dt, drow0, (size_t)C + (NKV + g) * HS);
        const float *k =
            head_f32(dt, fl_at_const(dt, row0, (size_t)C + g * HS), W, T, HS, copies, 1);
        const float *v =
            head_f32(dt, fl_at_const(dt, row0, (size_t)C + (NKV + g) * HS), W, T, HS, copies, 2);
        float *dk = head_f32(dt, dkh, W, T, HS, copies, 6);
        float *dv = head_f32(dt, dvh, W, T, HS, copies, 7);
        for (int h = g * group; h < (g + 1) * group; h++) { // the group's query heads, in order
            const void *oh = fl_at_const(dt, out, (size_t)b * T * C + h * HS);
            const void *dOh = fl_at_const(dt, dout, (size_t)b * T * C + h * HS);
            void *dqh = fl_at(dt, drow0, (size_t)h * HS);
            const float *q =
                head_f32(dt, fl_at_const(dt, row0, (size_t)h * HS), W, T, HS, copies, 0);
            const float *o = head_f32(dt, oh, C, T, HS, copies, 3);
            const float *dO = head_f32(dt, dOh, C, T, HS, copies, 4);
            float *dq = head_f32(dt, dqh, W, T, HS, copies, 5);
            const float *lse_bh = lse + ((size_t)b * NH + h) * T;
            for (int i0 = 0; i0 < T; i0 += ATT_BR) {
                int nb = T - i0 < ATT_BR ? T - i0 : ATT_BR, n = i0 + nb;
                const float *q_blk = q + (size_t)i0 * ldq, *dO_blk = dO + (size_t)i0 * ldo;
                // recompute P = exp(scale * Q K^T - lse), masked
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb, n, HS, scale, q_blk, ldq,
                            k, ldq, 0.0f, P, n);
                for (int r = 0; r < nb; r++) {
                    int i = i0 + r;
                    float *row = P + (size_t)r * n;
                    for (int j = 0; j <= i; j++) row[j] = expf(row[j] - lse_bh[i]);
                    for (int j = i + 1; j < n; j++) row[j] = 0.0f;
                    // D_i = rowsum(dO_i * O_i) = sum_j P_ij dP_ij
                    const float *o_i = o + (size_t)i * ldo, *dO_i = dO + (size_t)i * ldo;
                    float d = 0.0f;
                    for (int e = 0; e < HS; e++) d += dO_i[e] * o_i[e];
                    D[r] = d;
                }
                // dV[0:n] += P^T dO[i0:n]
                cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, HS, nb, 1.0f, P, n, dO_blk,
                            ldo, 1.0f, dv, ldq);
                // dP = dO V^T, then dS = P * (dP - D) in place
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nb, n, HS, 1.0f, dO_blk, ldo,
                            v, ldq, 0.0f, dP, n);
                for (int r = 0; r < nb; r++) {
                    float *dS = dP + (size_t)r * n;
                    const float *p = P + (size_t)r * n;
                    for (int j = 0; j < n; j++) dS[j] = p[j] * (dS[j] - D[r]);
                }
                // dQ[i0:n] += scale * dS K[0:n] ; dK[0:n] += scale * dS^T Q[i0:n]
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nb, HS, n, scale, dP, n, k,
                            ldq, 1.0f, dq + (size_t)i0 * ldq, ldq);
                cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, n, HS, nb, scale, dP, n, q_blk,
                            ldq, 1.0f, dk, ldq);
            }
            head_flush(dt, dqh, W, T, HS, dq);
        }
        head_flush(dt, dkh, W, T, HS, dk);
        head_flush(dt, dvh, W, T, HS, dv);
    }
}

static float dot(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

void attention_forward_ref(float *out, float *lse, const float *qkv, int B, int T, int NH, int NKV,
                           int HS) {
    check_heads(NH, NKV, HS);
    int group = NH / NKV, C = NH * HS, W = (NH + 2 * NKV) * HS;
    float scale = 1.0f / sqrtf((float)HS);
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            const float *qh = qkv + (size_t)b * T * W + h * HS; // position 0's q
            const float *kh = qkv + (size_t)b * T * W + C + (h / group) * HS, *vh = kh + NKV * HS;
            for (int t = 0; t < T; t++) {
                const float *q = qh + (size_t)t * W;
                float maxval = -INFINITY;
                for (int t2 = 0; t2 <= t; t2++)
                    maxval = fmaxf(maxval, scale * dot(q, kh + (size_t)t2 * W, HS));
                float sum = 0.0f;
                for (int t2 = 0; t2 <= t; t2++)
                    sum += expf(scale * dot(q, kh + (size_t)t2 * W, HS) - maxval);
                // cppcheck-suppress invalidFunctionArg ; the loop above ran at least once
                float l = maxval + logf(sum);
                lse[((size_t)b * NH + h) * T + t] = l;
                float *o = out + ((size_t)b * T + t) * C + h * HS;
                for (int e = 0; e < HS; e++) o[e] = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float *k = kh + (size_t)t2 * W, *v = vh + (size_t)t2 * W;
                    float p = expf(scale * dot(q, k, HS) - l);
                    for (int e = 0; e < HS; e++) o[e] += p * v[e];
                }
            }
        }
    }
}

void attention_backward_ref(float *dqkv, const float *dout, const float *qkv, const float *out,
                            const float *lse, int B, int T, int NH, int NKV, int HS) {
    (void)out; // D is summed as P.dP here, so the oracle does not trust out
    check_heads(NH, NKV, HS);
    int group = NH / NKV, C = NH * HS, W = (NH + 2 * NKV) * HS;
    float scale = 1.0f / sqrtf((float)HS);
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            size_t qoff = (size_t)b * T * W + h * HS; // position 0's q in (d)qkv
            size_t koff = (size_t)b * T * W + C + (h / group) * HS, voff = koff + NKV * HS;
            for (int t = 0; t < T; t++) {
                const float *q = qkv + qoff + (size_t)t * W;
                const float *dO = dout + ((size_t)b * T + t) * C + h * HS;
                float *dq = dqkv + qoff + (size_t)t * W;
                float l = lse[((size_t)b * NH + h) * T + t];
                // P_j = softmax weight of key j, dP_j = dO . v_j, D = sum_j P_j dP_j
                float D = 0.0f;
                for (int t2 = 0; t2 <= t; t2++) {
                    const float *k = qkv + koff + (size_t)t2 * W, *v = qkv + voff + (size_t)t2 * W;
                    D += expf(scale * dot(q, k, HS) - l) * dot(dO, v, HS);
                }
                for (int t2 = 0; t2 <= t; t2++) {
                    const float *k = qkv + koff + (size_t)t2 * W, *v = qkv + voff + (size_t)t2 * W;
                    float *dk = dqkv + koff + (size_t)t2 * W, *dv = dqkv + voff + (size_t)t2 * W;
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
