// encoder.c: token + position embedding, out[b,t,:] = wte[inp[b,t],:] + wpe[t,:].
#include "fitlm/kernels.h"

// Channel block for the backward: each thread owns whole columns of dwte and
// sums into them in (b,t) order, so repeated tokens never race and the
// result does not even depend on the thread count.
#define ENC_CBLOCK 64

void encoder_forward(float *out, const int *inp, const float *wte, const float *wpe, int B, int T,
                     int C) {
    // out (B,T,C), inp (B,T), wte (Vp,C), wpe (maxT,C)
#pragma omp parallel for collapse(2)
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            float *out_bt = out + ((size_t)b * T + t) * C;
            const float *wte_ix = wte + (size_t)inp[b * T + t] * C;
            const float *wpe_t = wpe + (size_t)t * C;
            for (int i = 0; i < C; i++) out_bt[i] = wte_ix[i] + wpe_t[i];
        }
    }
}

void encoder_backward(float *dwte, float *dwpe, const float *dout, const int *inp, int B, int T,
                      int C) {
    int nblocks = (C + ENC_CBLOCK - 1) / ENC_CBLOCK;
#pragma omp parallel for
    for (int blk = 0; blk < nblocks; blk++) {
        int c0 = blk * ENC_CBLOCK, c1 = c0 + ENC_CBLOCK < C ? c0 + ENC_CBLOCK : C;
        for (int bt = 0; bt < B * T; bt++) {
            const float *dout_bt = dout + (size_t)bt * C;
            float *dwte_ix = dwte + (size_t)inp[bt] * C;
            for (int i = c0; i < c1; i++) dwte_ix[i] += dout_bt[i];
        }
    }
    // each t owns its row of dwpe; batches are summed in order
#pragma omp parallel for
    for (int t = 0; t < T; t++) {
        float *dwpe_t = dwpe + (size_t)t * C;
        for (int b = 0; b < B; b++) {
            const float *dout_bt = dout + ((size_t)b * T + t) * C;
            for (int i = 0; i < C; i++) dwpe_t[i] += dout_bt[i];
        }
    }
}

void encoder_forward_ref(float *out, const int *inp, const float *wte, const float *wpe, int B,
                         int T, int C) {
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            float *out_bt = out + ((size_t)b * T + t) * C;
            const float *wte_ix = wte + (size_t)inp[b * T + t] * C;
            const float *wpe_t = wpe + (size_t)t * C;
            for (int i = 0; i < C; i++) out_bt[i] = wte_ix[i] + wpe_t[i];
        }
    }
}

void encoder_backward_ref(float *dwte, float *dwpe, const float *dout, const int *inp, int B, int T,
                          int C) {
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            const float *dout_bt = dout + ((size_t)b * T + t) * C;
            float *dwte_ix = dwte + (size_t)inp[b * T + t] * C;
            float *dwpe_t = dwpe + (size_t)t * C;
            for (int i = 0; i < C; i++) {
                dwte_ix[i] += dout_bt[i];
                dwpe_t[i] += dout_bt[i];
            }
        }
    }
}
