// linear.c: the linear unit (see model.h). Every GEMM of a model goes
// through here, so LoRA, NF4 dequantisation and tensor-parallel collectives
// have one place to wrap; a frozen weight gets no gradient.
#include "fitlm/model.h"

#include "arch.h"

// FLOPs of one (N x C) @ (C x OC) GEMM: the profile's GFLOP/s; the backward
// is two of them (input and weight gradients).
static double gemm_flops(int N, int C, int OC) {
    return 2.0 * (double)N * C * OC;
}

size_t fl_linear_workspace_bytes(const fl_device *d, fl_dtype dt, const fl_linear *lin, int N) {
    return d->matmul_workspace_bytes(dt, N, lin->in, lin->out);
}

// The linear's place under tensor parallelism (whole at t = 1).
static int tp_kind(const fl_model *m, const fl_linear *lin) {
    return m->tp.size > 1 ? lin->tp : FL_LINEAR_WHOLE;
}

// Under sequence parallelism a column-parallel linear's input and a
// row-parallel linear's output hold this rank's N/t positions: the input is
// all-gathered first (Megatron's f becomes an all-gather, its backward a
// reduce-scatter), the output reduce-scattered (g), every position's
// product in between. Neither gathered copy is kept: the backward gathers
// again (as Megatron does).
static int seq_parallel(const fl_model *m) {
    return fl_seq_parallel(&m->config);
}

void fl_linear_forward(fl_model *m, int unit, const fl_linear *lin, void *out, const void *inp,
                       int N) {
    const void *w = fl_quant_weights(m, unit, lin, FL_FWD);
    const void *b = lin->b >= 0 ? fl_unit_w(m, unit, lin->b) : NULL;
    int kind = tp_kind(m, lin), sp = seq_parallel(m);
    if (sp && kind == FL_LINEAR_COLUMN) {
        fl_tp_all_gather(m, inp, m->tp_gather, (size_t)fl_seq_rows(&m->config, N) * lin->in,
                         FL_FWD);
        inp = m->tp_gather;
    }
    // a row-parallel product is a partial sum: the bias comes once, after it
    int row = kind == FL_LINEAR_ROW;
    void *prod = row && sp ? m->tp_partial : out;
    FL_PROFILE(lin->op, FL_FWD, gemm_flops(N, lin->in, lin->out),
               m->dev->matmul_forward(m->dtype, prod, inp, w, row ? NULL : b, m->matmul_workspace,
                                      N, lin->in, lin->out));
    if (m->lora.cfg.r) fl_lora_forward(m, unit, lin, out, inp, N);
    if (!row) return;
    int rows = N;
    if (sp) {
        rows = fl_seq_rows(&m->config, N);
        fl_tp_reduce_scatter(m, prod, out, (size_t)rows * lin->out, FL_FWD);
    } else {
        fl_tp_all_reduce(m, out, (size_t)N * lin->out, FL_FWD);
    }
    if (b) FL_PROFILE(lin->op, FL_FWD, 0.0, m->dev->bias_forward(m->dtype, out, b, rows, lin->out));
}

void fl_linear_forward_gelu(fl_model *m, int unit, const fl_linear *lin, void *out, void *pre,
                            const void *inp, int N) {
    const fl_device *d = m->dev;
    size_t n = (size_t)N * lin->out;
    if (!d->matmul_gelu_forward || m->lora.cfg.r || tp_kind(m, lin) != FL_LINEAR_WHOLE ||
        m->recompute == FL_RECOMPUTE_SELECTIVE) {
        fl_linear_forward(m, unit, lin, pre, inp, N);
        FL_FWD_IO(FL_OP_GELU, fl_io(n, m->dtype, 2), d->gelu_forward(m->dtype, out, pre, n));
        return;
    }
    const void *w = fl_quant_weights(m, unit, lin, FL_FWD);
    const void *b = lin->b >= 0 ? fl_unit_w(m, unit, lin->b) : NULL;
    FL_PROFILE(lin->op, FL_FWD, gemm_flops(N, lin->in, lin->out),
               d->matmul_gelu_forward(m->dtype, out, pre, inp, w, b, m->matmul_workspace, N,
                                      lin->in, lin->out));
}

// The backward of lin; with pre (the GELU's input, lin's input its output)
// the input gradient leaves through GELU's backward in the GEMM's epilogue
static void linear_backward(fl_model *m, int unit, const fl_linear *lin, void *dinp,
                            const void *dout, const void *inp, const void *pre, int N) {
    int row = m->unit_row[unit + 1] + lin->w;
    unsigned flags = m->table.views[row].flags;
    int frozen = (flags & FL_PARAM_FROZEN) != 0;
    if (flags & FL_PARAM_TIED_COPY) { // stage 0 computes the weight's gradient from these
        m->tied_dout = dout;
        m->tied_inp = inp;
    }
    void *dw = frozen ? NULL : fl_unit_g(m, unit, lin->w);
    void *db = lin->b >= 0 && !frozen ? fl_unit_g(m, unit, lin->b) : NULL;
    const void *w = fl_quant_weights(m, unit, lin, FL_BWD);
    int kind = tp_kind(m, lin), sp = seq_parallel(m);
    size_t local = (size_t)fl_seq_rows(&m->config, N);
    void *dinp_here = dinp;
    if (sp && kind == FL_LINEAR_COLUMN) { // every position's input, and its gradient's partial sum
        fl_tp_all_gather(m, inp, m->tp_gather, local * lin->in, FL_BWD);
        inp = m->tp_gather;
        if (dinp) dinp_here = m->tp_partial;
    } else if (sp && kind == FL_LINEAR_ROW) { // every position's output gradient
        fl_tp_all_gather(m, dout, m->tp_gather, local * lin->out, FL_BWD);
        dout = m->tp_gather;
    }
    // a frozen weight's GEMM only passes the gradient on: half the work
    double flops = (dw ? 2.0 : 1.0) * gemm_flops(N, lin->in, lin->out);
    if (pre)
        FL_PROFILE(lin->op, FL_BWD, flops,
                   m->dev->matmul_dgelu_backward(m->dtype, dinp_here, dw, db, dout, inp, w, pre,
                                                 m->matmul_workspace, N, lin->in, lin->out));
    else
        FL_PROFILE(lin->op, FL_BWD, flops,
                   m->dev->matmul_backward(m->dtype, dinp_here, dw, db, dout, inp, w,
                                           m->matmul_workspace, N, lin->in, lin->out, 0));
    if (m->lora.cfg.r) fl_lora_backward(m, unit, lin, dinp, dout, inp, N);
    // a column-parallel input's gradient is this rank's outputs' share
    if (!dinp || kind != FL_LINEAR_COLUMN) return;
    if (sp)
        fl_tp_reduce_scatter(m, dinp_here, dinp, local * lin->in, FL_BWD);
    else
        fl_tp_all_reduce(m, dinp, (size_t)N * lin->in, FL_BWD);
}

void fl_linear_backward(fl_model *m, int unit, const fl_linear *lin, void *dinp, const void *dout,
                        const void *inp, int N) {
    linear_backward(m, unit, lin, dinp, dout, inp, NULL, N);
}

void fl_linear_backward_dgelu(fl_model *m, int unit, const fl_linear *lin, void *dpre, void *dh,
                              const void *dout, const void *inp, const void *pre, int N) {
    const fl_device *d = m->dev;
    if (!d->matmul_dgelu_backward || m->lora.cfg.r || tp_kind(m, lin) != FL_LINEAR_WHOLE) {
        size_t n = (size_t)N * lin->in;
        linear_backward(m, unit, lin, dh, dout, inp, NULL, N);
        FL_BWD_IO(FL_OP_GELU, fl_io(n, m->dtype, 3), d->gelu_backward(m->dtype, dpre, pre, dh, n));
        return;
    }
    linear_backward(m, unit, lin, dpre, dout, inp, pre, N);
}
