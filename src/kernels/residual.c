// residual.c: the residual stream's add, out = a + b, and the same add of a
// row-parallel linear's bias to each row (tensor parallelism).
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include "simd.h"

// values per parallel work item; 16-bit data passes through fp32 blocks of
// this size on the stack
#define RES_BLOCK 1024

// No `omp simd` here: callers may alias out with a, or da with db, and the
// compiler's own vectoriser keeps exact sequential semantics with a run-time
// overlap check.
static inline __attribute__((always_inline)) void add_body(float *out, const float *a,
                                                           const float *b, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}
FL_ISA_COPIES(add, (float *out, const float *a, const float *b, size_t n), (out, a, b, n))

void residual_forward(fl_dtype dt, void *out, const void *a, const void *b, size_t N) {
    size_t nblocks = (N + RES_BLOCK - 1) / RES_BLOCK;
    __typeof__(add_portable) *add = add_for(fl_cpu_isa());
#pragma omp parallel for if (N >= FL_PAR_MIN_VALUES)
    for (size_t blk = 0; blk < nblocks; blk++) {
        size_t i0 = blk * RES_BLOCK, n = N - i0 < RES_BLOCK ? N - i0 : RES_BLOCK;
        float a32[RES_BLOCK], b32[RES_BLOCK], out32[RES_BLOCK];
        float *o = fp32_out(dt, fl_at(dt, out, i0), out32);
        add(o, fl_load_f32(dt, fl_at_const(dt, a, i0), n, a32),
            fl_load_f32(dt, fl_at_const(dt, b, i0), n, b32), n);
        fp32_flush(dt, fl_at(dt, out, i0), o, n);
    }
}

// the sum's gradient flows unchanged into both branches
void residual_backward(fl_dtype dt, void *da, void *db, const void *dout, size_t N) {
    size_t nblocks = (N + RES_BLOCK - 1) / RES_BLOCK;
    __typeof__(add_portable) *add = add_for(fl_cpu_isa());
#pragma omp parallel for if (N >= FL_PAR_MIN_VALUES)
    for (size_t blk = 0; blk < nblocks; blk++) {
        size_t i0 = blk * RES_BLOCK, n = N - i0 < RES_BLOCK ? N - i0 : RES_BLOCK;
        float dout32[RES_BLOCK], g32[RES_BLOCK];
        const float *d = fl_load_f32(dt, fl_at_const(dt, dout, i0), n, dout32);
        // one branch after the other, so da may be db
        void *grads[2] = {fl_at(dt, da, i0), fl_at(dt, db, i0)};
        for (int k = 0; k < 2; k++) {
            float *g = fp32_rmw(dt, grads[k], n, g32);
            add(g, g, d, n);
            fp32_flush(dt, grads[k], g, n);
        }
    }
}

// out (N,OC) += bias (OC) per row: the same add, in place, a row at a time
void bias_forward(fl_dtype dt, void *out, const void *bias, int N, int OC) {
    __typeof__(add_portable) *add = add_for(fl_cpu_isa());
#pragma omp parallel for if ((size_t)N * OC >= FL_PAR_MIN_VALUES)
    for (int n = 0; n < N; n++) {
        for (int c0 = 0; c0 < OC; c0 += RES_BLOCK) {
            int nc = OC - c0 < RES_BLOCK ? OC - c0 : RES_BLOCK;
            float b32[RES_BLOCK], out32[RES_BLOCK];
            void *o = fl_at(dt, out, (size_t)n * OC + c0);
            float *y = fp32_rmw(dt, o, nc, out32);
            add(y, y, fl_load_f32(dt, fl_at_const(dt, bias, c0), nc, b32), nc);
            fp32_flush(dt, o, y, nc);
        }
    }
}

void residual_forward_ref(float *out, const float *a, const float *b, size_t N) {
    for (size_t i = 0; i < N; i++) out[i] = a[i] + b[i];
}

void residual_backward_ref(float *da, float *db, const float *dout, size_t N) {
    for (size_t i = 0; i < N; i++) {
        da[i] += dout[i];
        db[i] += dout[i];
    }
}

void bias_forward_ref(float *out, const float *bias, int N, int OC) {
    for (int n = 0; n < N; n++)
        for (int j = 0; j < OC; j++) out[(size_t)n * OC + j] += bias[j];
}
