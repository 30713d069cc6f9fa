// encoder.c: token + position embedding, out[b,t,:] = wte[inp[b,t],:] + wpe[t,:]
// (wpe NULL: the token embedding alone, as LLaMA's embed_tokens), and its
// tensor-parallel pieces: the lookup in one rank's rows of wte, and the
// position embeddings added on their own. Both paths run the same loops.
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include "simd.h"
#include <limits.h>

// channels per fp32 block on the stack (16-bit data is converted in blocks)
#define ENC_CBLOCK 1024
// positions per block when looking for a token, see add_token_rows
#define ENC_SCAN 256

// out (B,T,C) = the rows of wte (rows,C) for the ids inp (B,T) in [first,
// first + rows) (0 for the others) + wpe (maxT,C) row t when wpe is given
static void lookup(fl_dtype dt, void *out, const int *inp, const void *wte, const void *wpe,
                   int first, int rows, int B, int T, int C) {
#pragma omp parallel for collapse(2) if ((size_t)B * T * C >= FL_PAR_MIN_VALUES)
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            size_t bt = (size_t)b * T + t;
            // unsigned: an id below first is out of the range too
            unsigned id = (unsigned)inp[bt] - (unsigned)first;
            int mine = id < (unsigned)rows;
            for (int c0 = 0; c0 < C; c0 += ENC_CBLOCK) {
                int nc = C - c0 < ENC_CBLOCK ? C - c0 : ENC_CBLOCK;
                float e32[ENC_CBLOCK], p32[ENC_CBLOCK], out32[ENC_CBLOCK];
                void *o = fl_at(dt, out, bt * C + c0);
                float *y = fp32_out(dt, o, out32);
                const float *e =
                    mine ? fl_load_f32(dt, fl_at_const(dt, wte, (size_t)id * C + c0), nc, e32)
                         : NULL;
                const float *p =
                    wpe ? fl_load_f32(dt, fl_at_const(dt, wpe, (size_t)t * C + c0), nc, p32) : NULL;
                const float *only = e ? e : p; // when not both
                if (e && p)
                    for (int i = 0; i < nc; i++) y[i] = e[i] + p[i];
                else
                    for (int i = 0; i < nc; i++) y[i] = only ? only[i] : 0.0f;
                fp32_flush(dt, o, y, nc);
            }
        }
    }
}

void encoder_forward(fl_dtype dt, void *out, const int *inp, const void *wte, const void *wpe,
                     int B, int T, int C) {
    lookup(dt, out, inp, wte, wpe, 0, INT_MAX, B, T, C);
}

void embedding_shard_forward(fl_dtype dt, void *out, const int *inp, const void *wte, int first,
                             int rows, int N, int C) {
    lookup(dt, out, inp, wte, NULL, first, rows, 1, N, C);
}

// out (B,T,C) += wpe (maxT,C) row t, in place
void position_forward(fl_dtype dt, void *out, const void *wpe, int B, int T, int C) {
#pragma omp parallel for collapse(2) if ((size_t)B * T * C >= FL_PAR_MIN_VALUES)
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            for (int c0 = 0; c0 < C; c0 += ENC_CBLOCK) {
                int nc = C - c0 < ENC_CBLOCK ? C - c0 : ENC_CBLOCK;
                float p32[ENC_CBLOCK], out32[ENC_CBLOCK];
                void *o = fl_at(dt, out, ((size_t)b * T + t) * C + c0);
                float *y = fp32_rmw(dt, o, nc, out32);
                const float *p = fl_load_f32(dt, fl_at_const(dt, wpe, (size_t)t * C + c0), nc, p32);
                for (int i = 0; i < nc; i++) y[i] += p[i];
                fp32_flush(dt, o, y, nc);
            }
        }
    }
}

// whether tok is in inp[0, n): no early exit, so the loop vectorises (one
// copy per ISA, FL_ISA_COPIES)
static inline __attribute__((always_inline)) int occurs_body(const int *inp, int n, int tok) {
    int found = 0;
    for (int j = 0; j < n; j++) found |= inp[j] == tok;
    return found;
}
FL_ISA_COPIES_OF(int, occurs, (const int *inp, int n, int tok), (inp, n, tok))
typedef __typeof__(occurs_portable) occurs_fn;

// dst (nc) += channels c0.. of the rows of dout at positions first.. < N
// holding token tok, summed in position order in fp32 and rounded once.
// Positions are scanned in blocks of ENC_SCAN, most of which lack tok.
static void add_token_rows(occurs_fn *occurs, fl_dtype dt, void *dst, const void *dout,
                           const int *inp, int tok, int first, int N, int C, int c0, int nc) {
    float acc32[ENC_CBLOCK], d32[ENC_CBLOCK];
    float *acc = fp32_rmw(dt, dst, nc, acc32);
    for (int j0 = first; j0 < N; j0 += ENC_SCAN) {
        int j1 = N - j0 < ENC_SCAN ? N : j0 + ENC_SCAN;
        if (!occurs(inp + j0, j1 - j0, tok)) continue;
        for (int j = j0; j < j1; j++) {
            if (inp[j] != tok) continue;
            const float *d = fl_load_f32(dt, fl_at_const(dt, dout, (size_t)j * C + c0), nc, d32);
            for (int i = 0; i < nc; i++) acc[i] += d[i];
        }
    }
    fp32_flush(dt, dst, acc, nc);
}

// dwte (rows,C) += the rows of dout (N,C) at the ids in [first, first + rows).
// Each token's row of dwte is owned by the first position holding that
// token, which sums all the token's rows in (b,t) order: no races, a result
// independent of the thread count, and one rounding per element.
void embedding_shard_backward(fl_dtype dt, void *dwte, const void *dout, const int *inp, int first,
                              int rows, int N, int C) {
    occurs_fn *occurs = occurs_for(fl_cpu_isa());
#pragma omp parallel for schedule(dynamic, 16) if ((size_t)N * C >= FL_PAR_MIN_VALUES)
    for (int bt = 0; bt < N; bt++) {
        int tok = inp[bt], seen = (unsigned)tok - (unsigned)first >= (unsigned)rows;
        for (int j0 = 0; j0 < bt && !seen; j0 += ENC_SCAN)
            seen = occurs(inp + j0, bt - j0 < ENC_SCAN ? bt - j0 : ENC_SCAN, tok);
        for (int c0 = 0; !seen && c0 < C; c0 += ENC_CBLOCK) {
            int nc = C - c0 < ENC_CBLOCK ? C - c0 : ENC_CBLOCK;
            add_token_rows(occurs, dt, fl_at(dt, dwte, (size_t)(tok - first) * C + c0), dout, inp,
                           tok, bt, N, C, c0, nc);
        }
    }
}

// each t owns its row of dwpe; batches are summed in order
void position_backward(fl_dtype dt, void *dwpe, const void *dout, int B, int T, int C) {
#pragma omp parallel for if ((size_t)B * T * C >= FL_PAR_MIN_VALUES)
    for (int t = 0; t < T; t++) {
        for (int c0 = 0; c0 < C; c0 += ENC_CBLOCK) {
            int nc = C - c0 < ENC_CBLOCK ? C - c0 : ENC_CBLOCK;
            float acc32[ENC_CBLOCK], d32[ENC_CBLOCK];
            void *dst = fl_at(dt, dwpe, (size_t)t * C + c0);
            float *acc = fp32_rmw(dt, dst, nc, acc32);
            for (int b = 0; b < B; b++) {
                size_t off = ((size_t)b * T + t) * C + c0;
                const float *d = fl_load_f32(dt, fl_at_const(dt, dout, off), nc, d32);
                for (int i = 0; i < nc; i++) acc[i] += d[i];
            }
            fp32_flush(dt, dst, acc, nc);
        }
    }
}

void encoder_backward(fl_dtype dt, void *dwte, void *dwpe, const void *dout, const int *inp, int B,
                      int T, int C) {
    if (dwte) embedding_shard_backward(dt, dwte, dout, inp, 0, INT_MAX, B * T, C);
    if (dwpe) position_backward(dt, dwpe, dout, B, T, C);
}

void encoder_forward_ref(float *out, const int *inp, const float *wte, const float *wpe, int B,
                         int T, int C) {
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            float *out_bt = out + ((size_t)b * T + t) * C;
            const float *wte_ix = wte + (size_t)inp[b * T + t] * C;
            for (int i = 0; i < C; i++)
                out_bt[i] = wte_ix[i] + (wpe ? wpe[(size_t)t * C + i] : 0.0f);
        }
    }
}

void encoder_backward_ref(float *dwte, float *dwpe, const float *dout, const int *inp, int B, int T,
                          int C) {
    for (int b = 0; b < B; b++) {
        for (int t = 0; t < T; t++) {
            const float *dout_bt = dout + ((size_t)b * T + t) * C;
            float *dwte_ix = dwte + (size_t)inp[b * T + t] * C;
            for (int i = 0; i < C; i++) {
                dwte_ix[i] += dout_bt[i];
                if (dwpe) dwpe[(size_t)t * C + i] += dout_bt[i];
            }
        }
    }
}

void embedding_shard_forward_ref(float *out, const int *inp, const float *wte, int first, int rows,
                                 int N, int C) {
    for (int n = 0; n < N; n++) {
        int id = inp[n] - first;
        for (int i = 0; i < C; i++)
            out[(size_t)n * C + i] = id >= 0 && id < rows ? wte[(size_t)id * C + i] : 0.0f;
    }
}

void embedding_shard_backward_ref(float *dwte, const float *dout, const int *inp, int first,
                                  int rows, int N, int C) {
    for (int n = 0; n < N; n++) {
        int id = inp[n] - first;
        if (id < 0 || id >= rows) continue;
        for (int i = 0; i < C; i++) dwte[(size_t)id * C + i] += dout[(size_t)n * C + i];
    }
}

void position_forward_ref(float *out, const float *wpe, int B, int T, int C) {
    for (int bt = 0; bt < B * T; bt++)
        for (int i = 0; i < C; i++) out[(size_t)bt * C + i] += wpe[(size_t)(bt % T) * C + i];
}

void position_backward_ref(float *dwpe, const float *dout, int B, int T, int C) {
    for (int bt = 0; bt < B * T; bt++)
        for (int i = 0; i < C; i++) dwpe[(size_t)(bt % T) * C + i] += dout[(size_t)bt * C + i];
}
