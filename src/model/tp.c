// tp.c: tensor parallelism (Shoeybi et al. 2019, Megatron-LM) on the model's
// side: the whole rows a weight source gives stored as this rank's slices,
// the vocabulary-parallel embedding and cross-entropy, and the all-reduce
// the linear unit calls. The collectives are the TP group's (m->tp.ops, from
// src/parallel); at t = 1 nothing here communicates. Tensor parallelism
// runs on the cpu device only (fl_model_init_tp refuses another): the
// vocabulary-parallel loss's loops read the model's targets, maxima and sums
// on the host.
#include <math.h>

#include "arch.h"

// Each collective is timed into the profile's communication slot, under the
// pass it serves.
void fl_tp_all_reduce(fl_model *m, void *buf, size_t n, int pass) {
    if (m->tp.size > 1)
        FL_PROFILE(FL_OP_COMM, pass, 0.0, m->tp.ops->all_reduce(m->tp.ops->ctx, m->dtype, buf, n));
}

void fl_tp_all_gather(fl_model *m, const void *send, void *recv, size_t n, int pass) {
    FL_PROFILE(FL_OP_COMM, pass, 0.0,
               m->tp.ops->all_gather(m->tp.ops->ctx, m->dtype, send, recv, n));
}

void fl_tp_reduce_scatter(fl_model *m, const void *send, void *recv, size_t n, int pass) {
    FL_PROFILE(FL_OP_COMM, pass, 0.0,
               m->tp.ops->reduce_scatter(m->tp.ops->ctx, m->dtype, send, recv, n));
}

// ----------------------------------------------------------------------------
// storing whole rows into slices

typedef struct {
    fl_model *m;
    int row;
    size_t first, n; // the whole row's elements given
    const float *w;
} slice_store;

static void store_block(void *ctx, size_t local, size_t first, size_t run, size_t stride,
                        size_t count) {
    const slice_store *s = ctx;
    size_t runs = count / run, lo = s->first, hi = s->first + s->n;
    if (hi <= first) return;
    // the runs [k0, k1) that can meet [lo, hi)
    size_t k0 = lo > first ? (lo - first) / stride : 0;
    size_t k1 = (hi - first + stride - 1) / stride;
    if (k1 > runs) k1 = runs;
    for (size_t k = k0; k < k1; k++) {
        size_t g = first + k * stride, a = g > lo ? g : lo, b = g + run < hi ? g + run : hi;
        if (a < b)
            fl_model_store_local(s->m, s->row, local + k * run + (a - g), s->w + (a - lo), b - a);
    }
}

void fl_model_store_row(fl_model *m, int row, size_t first, const float *w, size_t n) {
    FL_ASSERT(first + n <= fl_model_whole_table(m)->views[row].numel);
    m->stored += n;
    if (m->row_local && (row = m->row_local[row]) < 0) return; // another pipeline stage's
    if (m->tp.size == 1) {
        fl_model_store_local(m, row, first, w, n);
        return;
    }
    slice_store s = {m, row, first, n, w};
    fl_params_blocks(&m->table, row, 0, m->table.views[row].numel, store_block, &s);
}

// ----------------------------------------------------------------------------
// the vocabulary-parallel embedding

void fl_embed_forward(fl_model *m, void *out, const int *tokens, const void *wte, const void *wpe,
                      int B, int T) {
    int C = m->config.n_embd;
    if (m->tp.size == 1) {
        // the tokens' rows and the positions' read, the sum written
        FL_FWD_IO(FL_OP_ENCODER,
                  fl_io((size_t)B * T * C, m->dtype, 2) +
                      (wpe ? fl_io((size_t)T * C, m->dtype, 1) : 0),
                  m->dev->encoder_forward(m->dtype, out, tokens, wte, wpe, B, T, C));
        return;
    }
    int rows = fl_vocab_cols(&m->config), N = B * T;
    size_t local = (size_t)fl_seq_rows(&m->config, N) * C;
    // under sequence parallelism every position's lookup, then this rank's
    // positions of the sum (GPT-2: of the sum with the positions added)
    void *all = fl_seq_parallel(&m->config) ? m->tp_gather : out;
    FL_FWD_OP(FL_OP_ENCODER, m->dev->embedding_shard_forward(m->dtype, all, tokens, wte,
                                                             m->tp.rank * rows, rows, N, C));
    if (all != out && !wpe) {
        fl_tp_reduce_scatter(m, all, out, local, FL_FWD);
        return;
    }
    fl_tp_all_reduce(m, all, (size_t)N * C, FL_FWD);
    if (wpe) FL_FWD_OP(FL_OP_ENCODER, m->dev->position_forward(m->dtype, all, wpe, B, T, C));
    if (all != out)
        m->dev->copy_d2d(m->dev, out, fl_at(m->dtype, all, (size_t)m->tp.rank * local),
                         local * fl_dtype_size(m->dtype));
}

void fl_embed_backward(fl_model *m, void *dwte, void *dwpe, const void *dout, const int *tokens,
                       int B, int T) {
    int C = m->config.n_embd;
    if (m->tp.size == 1) {
        // dout read (twice with positions), the positions' gradient added
        // into; the tokens' rows at least once each way per distinct token,
        // not counted
        FL_BWD_IO(FL_OP_ENCODER,
                  fl_io((size_t)B * T * C, m->dtype, dwpe ? 2 : 1) +
                      (dwpe ? fl_io((size_t)T * C, m->dtype, 2) : 0),
                  m->dev->encoder_backward(m->dtype, dwte, dwpe, dout, tokens, B, T, C));
        return;
    }
    // dout is the same on every rank (sequence parallelism: gathered): each
    // adds its rows' share, and the (replicated) positions' whole gradient
    int rows = fl_vocab_cols(&m->config);
    if (fl_seq_parallel(&m->config)) {
        fl_tp_all_gather(m, dout, m->tp_gather, (size_t)fl_seq_rows(&m->config, B * T) * C, FL_BWD);
        dout = m->tp_gather;
    }
    if (dwte)
        FL_BWD_OP(FL_OP_ENCODER,
                  m->dev->embedding_shard_backward(m->dtype, dwte, dout, tokens, m->tp.rank * rows,
                                                   rows, B * T, C));
    if (dwpe) FL_BWD_OP(FL_OP_ENCODER, m->dev->position_backward(m->dtype, dwpe, dout, B, T, C));
}

// ----------------------------------------------------------------------------
// the vocabulary-parallel cross-entropy

// This rank's columns: [first, first + valid) of the vocabulary in a row of
// cols (the rest is padding).
static void vocab_range(const fl_model *m, int *first, int *valid, int *cols) {
    *cols = fl_vocab_cols(&m->config);
    *first = m->tp.rank * *cols;
    int v = m->config.vocab_size - *first;
    *valid = v < 0 ? 0 : v > *cols ? *cols : v;
}

// Every target token's loss weighs dloss; positions without one, nothing.
static void tp_dlosses(fl_model *m, float dloss) {
    for (size_t i = 0; i < (size_t)m->B * m->T; i++)
        m->dlosses[i] = m->targets[i] == -1 ? 0.0f : dloss;
}

void fl_vocab_xent(fl_model *m, const float *dloss) {
    const fl_tp_ops *ops = m->tp.ops;
    int first, valid, cols, BT = m->B * m->T;
    vocab_range(m, &first, &valid, &cols);
    float *mx = m->xent_lse, *sums = m->tp_sums; // the max first, then the log-sum-exp
    FL_FWD_OP(FL_OP_XENT, m->dev->xent_shard_max(m->dtype, mx, m->logits, BT, valid, cols));
    FL_PROFILE(FL_OP_COMM, FL_FWD, 0.0, ops->all_reduce_max(ops->ctx, mx, (size_t)BT));
    for (int i = 0; i < BT; i++) {
        int y = m->targets[i];
        m->tp_targets[i] = y >= first && y < first + valid ? y - first : -1;
    }
    FL_FWD_OP(FL_OP_XENT, m->dev->xent_shard_sums(m->dtype, sums, m->logits, mx, m->tp_targets, BT,
                                                  valid, cols));
    FL_PROFILE(FL_OP_COMM, FL_FWD, 0.0, ops->all_reduce(ops->ctx, FL_F32, sums, 2 * (size_t)BT));
    for (int i = 0; i < BT; i++) {
        m->xent_lse[i] = mx[i] + logf(sums[2 * i]);
        m->losses[i] = m->targets[i] == -1 ? 0.0f : m->xent_lse[i] - sums[2 * i + 1];
    }
    if (!dloss) return;
    tp_dlosses(m, *dloss);
    FL_FWD_OP(FL_OP_XENT, m->dev->xent_shard_backward(m->dtype, m->logits, m->logits, m->xent_lse,
                                                      m->tp_targets, m->dlosses, BT, valid, cols));
}

void fl_vocab_xent_backward(fl_model *m, float dloss) {
    int first, valid, cols, BT = m->B * m->T;
    vocab_range(m, &first, &valid, &cols);
    tp_dlosses(m, dloss);
    FL_BWD_OP(FL_OP_XENT, m->dev->xent_shard_backward(m->dtype, m->logits, m->logits, m->xent_lse,
                                                      m->tp_targets, m->dlosses, BT, valid, cols));
}
