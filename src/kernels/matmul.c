// matmul.c: out (N,OC) = inp (N,C) @ weight^T + bias, weight (OC,C) as in
// nn.Linear. fp32 hands everything to OpenBLAS's sgemm; transposes are
// expressed through the sgemm flags, never materialised.
// bf16/fp16 take the portable path: inp is converted to fp32 once, weight and
// out (or dout) in panels of MM_PANEL output channels, and each panel is
// multiplied with sgemm. Gradients are accumulated in fp32 across all panels
// and rounded once per element per call.
// A native bf16 GEMM plugs in at the top of matmul_forward/matmul_backward
// (and matmul_workspace_bytes), before the portable path.
#include "fitlm/kernels.h"
#include "fitlm/core.h"

#include <cblas.h>

#include "matmul_dnnl.h"

// output-channel block for the bias gradient (see add_column_sums)
#define MM_OCBLOCK 64
// Output channels per panel of weight on the portable path. sgemm packs the
// other operand (inp, N x C) again for every call, so narrow panels spend
// that much more time re-reading it: at 256 a GPT-2 layer ran 10-35% slower
// than fp32 at N = 2048, at 2048 within a few percent. The panel (weight and
// out or dout in fp32) is transient workspace, ~8 MiB at N = 256.
#define MM_PANEL 2048
// The input gradient sums dout @ weight over output channels in steps of
// MM_KSTEP (sgemm with beta = 1 on the fp32 accumulator): a fixed order,
// independent of MM_PANEL, so the rounding does not change with it.
#define MM_KSTEP 256

// dst (ncols) += column sums of src (N rows, leading dimension ld): each
// thread owns a block of columns and sums the rows in order (deterministic,
// no atomics)
static void add_column_sums(float *dst, const float *src, int N, int ncols, int ld) {
    int nblocks = (ncols + MM_OCBLOCK - 1) / MM_OCBLOCK;
#pragma omp parallel for
    for (int blk = 0; blk < nblocks; blk++) {
        int o0 = blk * MM_OCBLOCK, o1 = o0 + MM_OCBLOCK < ncols ? o0 + MM_OCBLOCK : ncols;
        for (int n = 0; n < N; n++) {
            const float *src_n = src + (size_t)n * ld;
            for (int o = o0; o < o1; o++) dst[o] += src_n[o];
        }
    }
}

// ----------------------------------------------------------------------------
// portable path for 16-bit data

// Workspace in floats: inp in fp32 (N,C), the dinp accumulator (N,C), a panel
// of weight or dweight (ob,C), of out or dout (N,ob), and of bias or dbias
// (ob), with ob = min(OC, MM_PANEL).
static size_t portable_workspace_floats(int N, int C, int OC) {
    size_t ob = OC < MM_PANEL ? (size_t)OC : MM_PANEL;
    return 2 * (size_t)N * C + ob * C + (size_t)N * ob + ob;
}

// dst (rows,cols) contiguous fp32 = src (rows,cols) of dtype dt, row stride ld
static void load_block(fl_dtype dt, float *dst, const void *src, int rows, int cols, int ld) {
#pragma omp parallel for
    for (int r = 0; r < rows; r++)
        fl_convert(FL_F32, dst + (size_t)r * cols, dt, fl_at_const(dt, src, (size_t)r * ld), cols);
}

static void store_block(fl_dtype dt, void *dst, const float *src, int rows, int cols, int ld) {
#pragma omp parallel for
    for (int r = 0; r < rows; r++)
        fl_store_f32(dt, fl_at(dt, dst, (size_t)r * ld), src + (size_t)r * cols, cols);
}

static void portable_forward(fl_dtype dt, void *out, const void *inp, const void *weight,
                             const void *bias, float *ws, int N, int C, int OC) {
    // the backward's layout; the dinp accumulator stays unused
    int ob_max = OC < MM_PANEL ? OC : MM_PANEL;
    float *inp32 = ws, *w32 = inp32 + 2 * (size_t)N * C, *out32 = w32 + (size_t)ob_max * C;
    float *bias32 = out32 + (size_t)N * ob_max;
    load_block(dt, inp32, inp, N, C, C);
    for (int o0 = 0; o0 < OC; o0 += MM_PANEL) {
        int ob = OC - o0 < MM_PANEL ? OC - o0 : MM_PANEL;
        load_block(dt, w32, fl_at_const(dt, weight, (size_t)o0 * C), ob, C, C);
        // with a bias, prefill out with it and let sgemm add the product
        if (bias) {
            fl_convert(FL_F32, bias32, dt, fl_at_const(dt, bias, o0), ob);
#pragma omp parallel for
            for (int n = 0; n < N; n++)
                for (int o = 0; o < ob; o++) out32[(size_t)n * ob + o] = bias32[o];
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, ob, C, 1.0f, inp32, C, w32, C,
                    bias ? 1.0f : 0.0f, out32, ob);
        store_block(dt, fl_at(dt, out, o0), out32, N, ob, OC);
    }
}

static void portable_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias, const void *dout,
                              const void *inp, const void *weight, float *ws, int N, int C,
                              int OC) {
    int ob_max = OC < MM_PANEL ? OC : MM_PANEL;
    float *inp32 = ws, *dinp32 = inp32 + (size_t)N * C, *w32 = dinp32 + (size_t)N * C;
    float *dout32 = w32 + (size_t)ob_max * C, *dbias32 = dout32 + (size_t)N * ob_max;
    if (dweight) load_block(dt, inp32, inp, N, C, C);
    if (dinp) load_block(dt, dinp32, dinp, N, C, C); // accumulates on top of dinp
    for (int o0 = 0; o0 < OC; o0 += MM_PANEL) {
        int ob = OC - o0 < MM_PANEL ? OC - o0 : MM_PANEL;
        load_block(dt, dout32, fl_at_const(dt, dout, o0), N, ob, OC);
        // dinp (N,C) += dout[:, o0:o0+ob] @ weight[o0:o0+ob, :], in steps of MM_KSTEP
        if (dinp) {
            load_block(dt, w32, fl_at_const(dt, weight, (size_t)o0 * C), ob, C, C);
            for (int k0 = 0; k0 < ob; k0 += MM_KSTEP) {
                int kb = ob - k0 < MM_KSTEP ? ob - k0 : MM_KSTEP;
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, kb, 1.0f, dout32 + k0,
                            ob, w32 + (size_t)k0 * C, C, 1.0f, dinp32, C);
            }
        }
        // dweight[o0:o0+ob, :] += dout[:, o0:o0+ob]^T @ inp, in w32's place
        if (dweight) {
            void *dw = fl_at(dt, dweight, (size_t)o0 * C);
            load_block(dt, w32, dw, ob, C, C);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, ob, C, N, 1.0f, dout32, ob, inp32,
                        C, 1.0f, w32, C);
            store_block(dt, dw, w32, ob, C, C);
        }
        if (dbias) {
            void *db = fl_at(dt, dbias, o0);
            fl_convert(FL_F32, dbias32, dt, db, ob);
            add_column_sums(dbias32, dout32, N, ob, ob);
            fl_store_f32(dt, db, dbias32, ob);
        }
    }
    if (dinp) store_block(dt, dinp, dinp32, N, C, C);
}

// ----------------------------------------------------------------------------

size_t matmul_workspace_bytes(fl_dtype dt, int N, int C, int OC) {
    if (dnnl_matmul_supported(dt)) return dnnl_matmul_workspace_bytes(dt, N, C, OC);
    return dt == FL_F32 ? 0 : portable_workspace_floats(N, C, OC) * sizeof(float);
}

void matmul_forward(fl_dtype dt, void *out, const void *inp, const void *weight, const void *bias,
                    void *workspace, int N, int C, int OC) {
    // a native bf16 GEMM (oneDNN: AMX or AVX512_BF16) where the CPU has one
    if (dnnl_matmul_supported(dt)) {
        dnnl_matmul_forward(dt, out, inp, weight, bias, workspace, N, C, OC);
        return;
    }
    if (dt != FL_F32) {
        FL_ASSERT(workspace);
        portable_forward(dt, out, inp, weight, bias, workspace, N, C, OC);
        return;
    }
    // with a bias, prefill out with it and let sgemm add the product (beta=1)
    float *out32 = out;
    const float *bias32 = bias;
    if (bias) {
#pragma omp parallel for
        for (int n = 0; n < N; n++)
            for (int o = 0; o < OC; o++) out32[(size_t)n * OC + o] = bias32[o];
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, OC, C, 1.0f, inp, C, weight, C,
                bias ? 1.0f : 0.0f, out32, OC);
}

void matmul_backward(fl_dtype dt, void *dinp, void *dweight, void *dbias, const void *dout,
                     const void *inp, const void *weight, void *workspace, int N, int C, int OC) {
    if (dnnl_matmul_supported(dt)) {
        dnnl_matmul_backward(dt, dinp, dweight, dbias, dout, inp, weight, workspace, N, C, OC);
        return;
    }
    if (dt != FL_F32) {
        FL_ASSERT(workspace);
        portable_backward(dt, dinp, dweight, dbias, dout, inp, weight, workspace, N, C, OC);
        return;
    }
    // dinp (N,C) += dout (N,OC) @ weight (OC,C)
    if (dinp)
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, N, C, OC, 1.0f, dout, OC, weight, C,
                    1.0f, dinp, C);
    // dweight (OC,C) += dout^T (OC,N) @ inp (N,C)
    if (dweight)
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f,
                    dweight, C);
    // dbias (OC) += column sums of dout
    if (dbias) add_column_sums(dbias, dout, N, OC, OC);
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
