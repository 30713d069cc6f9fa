// block.c: the attention half of a pre-norm transformer block, shared by
// the architectures: after the block's first norm, a fused QKV projection,
// rotary embeddings when the model has them, causal attention (grouped-query
// when n_kv_head < n_head), and the output projection added to the residual
// stream. What differs between GPT-2 and LLaMA (the norms, biases, the MLP)
// stays in their files.
#include "arch.h"

void fl_residual_linear_forward(const fl_block *b, const fl_linear *lin, void *out, const void *inp,
                                const void *skip) {
    fl_model *m = b->m;
    int BT = b->B * b->T;
    // The projection is written straight into `out` and the skip connection
    // added in place: its output alone is not needed by the backward.
    fl_linear_forward(m, b->l, lin, out, inp, BT);
    size_t n = (size_t)fl_seq_rows(&m->config, BT) * m->config.n_embd; // the stream's positions
    FL_FWD_IO(FL_OP_RESIDUAL, fl_io(n, m->dtype, 3),
              m->dev->residual_forward(m->dtype, out, skip, out, n));
}

// The forward's products for the profile: S = Q K^T and P V over the
// T (T + 1) / 2 causal pairs of each sequence and head, 2 HS FLOPs a pair
// each; the backward's five (S again, dP, dV, dK, dQ) are 2.5 times that,
// as FlashAttention counts them.
static double attention_flops(const fl_block *b, int NH, int HS) {
    return 2.0 * 2.0 * HS * b->B * NH * (double)b->T * (b->T + 1) / 2.0;
}

// RoPE rotates q and k in place: read and written once
static double rope_io(const fl_block *b, int NH, int KV, int HS) {
    return fl_io((size_t)b->B * b->T * (NH + KV) * HS, b->m->dtype, 2);
}

void fl_attention_forward(const fl_block *b, const fl_linear *qkv_lin, const fl_linear *o_lin,
                          const fl_attention_acts *a, void *out) {
    fl_model *m = b->m;
    const fl_model_config *c = &m->config;
    int t = fl_tp_ways(c), NH = c->n_head / t, KV = c->n_kv_head / t, HS = c->n_embd / c->n_head;
    fl_linear_forward(m, b->l, qkv_lin, a->qkv, a->normed, b->B * b->T);
    if (m->rope_table)
        FL_FWD_IO(FL_OP_ROPE, rope_io(b, NH, KV, HS),
                  m->dev->rope_forward(m->dtype, a->qkv, m->rope_table, b->B, b->T, NH, KV, HS));
    FL_PROFILE(FL_OP_ATTENTION, FL_FWD, attention_flops(b, NH, HS),
               m->dev->attention_forward(m->dtype, a->atty, a->lse, a->qkv, m->att_workspace, b->B,
                                         b->T, NH, KV, HS));
    fl_linear_forward(m, b->l, o_lin, out, a->atty, b->B * b->T);
}

void fl_attention_backward(const fl_block *b, const fl_linear *qkv_lin, const fl_linear *o_lin,
                           const fl_attention_acts *a, const void *dres, void *dnormed,
                           void *dqkv) {
    fl_model *m = b->m;
    const fl_model_config *c = &m->config;
    int t = fl_tp_ways(c), NH = c->n_head / t, KV = c->n_kv_head / t;
    int HS = c->n_embd / c->n_head, BT = b->B * b->T;
    // dnormed first holds d(attention output) (this rank's heads), then
    // d(the norm's output); the device writes each (device.h: no clearing)
    fl_linear_backward(m, b->l, o_lin, dnormed, dres, a->atty, BT);
    FL_PROFILE(FL_OP_ATTENTION, FL_BWD, 2.5 * attention_flops(b, NH, HS),
               m->dev->attention_backward(m->dtype, dqkv, dnormed, a->qkv, a->atty, a->lse,
                                          m->att_workspace, b->B, b->T, NH, KV, HS));
    if (m->rope_table)
        FL_BWD_IO(FL_OP_ROPE, rope_io(b, NH, KV, HS),
                  m->dev->rope_backward(m->dtype, dqkv, m->rope_table, b->B, b->T, NH, KV, HS));
    fl_linear_backward(m, b->l, qkv_lin, dnormed, dqkv, a->normed, BT);
}
