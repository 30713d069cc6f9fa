// gpt2.c: GPT-2 (Radford et al. 2019) as Hugging Face and llm.c define it:
// learned token and position embeddings, pre-LayerNorm blocks of causal
// multi-head attention (fused QKV) and a GELU MLP of width 4C, a final
// LayerNorm and an LM head tied to the token embedding. The driver
// (model.c) runs these passes; this file is the table and the passes.
#include <math.h>

#include "arch.h"

// rows of a block, in table order
enum { LN1W, LN1B, QKVW, QKVB, ATTPROJW, ATTPROJB, LN2W, LN2B, FCW, FCB, FCPROJW, FCPROJB, NROWS };
// activation slots of a block; (S) = dropped and recomputed under "selective"
enum {
    A_LN1,      // (C) (S)
    A_LN1_MEAN, // (1) fp32 (S)
    A_LN1_RSTD, // (1) fp32 (S)
    A_QKV,      // (3C)
    A_ATTY,     // (C) attention output before projection
    A_LSE,      // (NH) fp32 softmax log-sum-exp
    A_RES2,     // (C) residual after attention
    A_LN2,      // (C) (S)
    A_LN2_MEAN, // (1) fp32 (S)
    A_LN2_RSTD, // (1) fp32 (S)
    A_FCH,      // (4C) MLP pre-activation
    A_GELU,     // (4C) (S)
    NSLOTS
};
enum { H_LNF, H_MEAN, H_RSTD, NHEAD }; // head slots
enum { W_C, W_4A, W_4B, NWORK };       // backward scratch

static void finish(fl_model_config *c) {
    if (c->n_kv_head && c->n_kv_head != c->n_head)
        fl_die("model.n_kv_head: GPT-2 has no grouped-query attention (n_kv_head %d != n_head %d)",
               c->n_kv_head, c->n_head);
    if (c->intermediate_size && c->intermediate_size != 4 * c->n_embd)
        fl_die("model.intermediate_size: GPT-2's MLP is 4 x n_embd = %d (got %d)", 4 * c->n_embd,
               c->intermediate_size);
    if (c->norm_eps != 0.0f && c->norm_eps != 1e-5f)
        fl_die("model.norm_eps: GPT-2's LayerNorm eps is 1e-5 (got %g)", c->norm_eps);
    if (c->rope_theta != 0.0f) fl_die("model.rope_theta: GPT-2 has no rotary embeddings");
    c->n_kv_head = c->n_head;
    c->intermediate_size = 4 * c->n_embd;
    c->norm_eps = 1e-5f;
    c->tie_embeddings = 1;
}

static size_t num_params(const fl_model_config *c) {
    size_t C = c->n_embd, L = c->n_layer;
    return (size_t)c->padded_vocab_size * C + (size_t)c->max_seq_len * C +
           L * (12 * C * C + 13 * C) + 2 * C;
}

static void sizes(const fl_model_config *c, size_t *largest_row, size_t *block) {
    size_t C = c->n_embd, Vp = c->padded_vocab_size, maxT = c->max_seq_len;
    *largest_row = Vp * C; // wte; the MLP matrices (4C x C) and wpe are the other candidates
    if (4 * C * C > *largest_row) *largest_row = 4 * C * C;
    if (maxT * C > *largest_row) *largest_row = maxT * C;
    *block = 12 * C * C + 13 * C;
}

static int table_rows(const fl_model_config *c) {
    return 2 + NROWS * c->n_layer + 2;
}

// Table order is the order of use in the forward pass, one block after the
// other, so a block's parameters are one contiguous range. Initialisation:
// N(0, 0.02) for matrices and embeddings, with the projections into the
// residual stream scaled by 1/sqrt(2L) since L blocks each add two of them.
// Tensor parallelism: c_attn and c_fc are column-parallel (c_attn by heads
// within each of Q, K and V), the projections row-parallel (their biases
// whole), wte split by vocabulary rows; the norms and wpe are replicated.
static void build_table(fl_param_table *t, const fl_model_config *c) {
    size_t C = c->n_embd;
    float std = 0.02f, resid = 0.02f / sqrtf(2.0f * c->n_layer);
    const unsigned D = FL_PARAM_DECAY, LIN = FL_PARAM_DECAY | FL_PARAM_LINEAR;
    const unsigned NORM = FL_PARAM_TOKENWISE;
    int wte = fl_arch_add_row(t, FL_UNIT_EMBED, D, FL_INIT_NORMAL, std, c->padded_vocab_size, C,
                              "wte.weight", 0);
    t->views[wte].live_rows = c->vocab_size; // the padding rows stay zero
    fl_params_split(t, wte, 0, 1);
    fl_arch_add_row(t, FL_UNIT_EMBED, 0, FL_INIT_NORMAL, std, c->max_seq_len, C, "wpe.weight", 0);
    for (int l = 0; l < c->n_layer; l++) {
        fl_arch_add_row(t, l, NORM, FL_INIT_ONES, 0, C, 0, "h.%d.ln_1.weight", l);
        fl_arch_add_row(t, l, NORM, FL_INIT_ZEROS, 0, C, 0, "h.%d.ln_1.bias", l);
        int r =
            fl_arch_add_row(t, l, LIN, FL_INIT_NORMAL, std, 3 * C, C, "h.%d.attn.c_attn.weight", l);
        fl_params_split(t, r, 0, 3);
        r = fl_arch_add_row(t, l, 0, FL_INIT_ZEROS, 0, 3 * C, 0, "h.%d.attn.c_attn.bias", l);
        fl_params_split(t, r, 0, 3);
        r = fl_arch_add_row(t, l, LIN, FL_INIT_NORMAL, resid, C, C, "h.%d.attn.c_proj.weight", l);
        fl_params_split(t, r, 1, 1);
        fl_arch_add_row(t, l, 0, FL_INIT_ZEROS, 0, C, 0, "h.%d.attn.c_proj.bias", l);
        fl_arch_add_row(t, l, NORM, FL_INIT_ONES, 0, C, 0, "h.%d.ln_2.weight", l);
        fl_arch_add_row(t, l, NORM, FL_INIT_ZEROS, 0, C, 0, "h.%d.ln_2.bias", l);
        r = fl_arch_add_row(t, l, LIN, FL_INIT_NORMAL, std, 4 * C, C, "h.%d.mlp.c_fc.weight", l);
        fl_params_split(t, r, 0, 1);
        r = fl_arch_add_row(t, l, 0, FL_INIT_ZEROS, 0, 4 * C, 0, "h.%d.mlp.c_fc.bias", l);
        fl_params_split(t, r, 0, 1);
        r = fl_arch_add_row(t, l, LIN, FL_INIT_NORMAL, resid, C, 4 * C, "h.%d.mlp.c_proj.weight",
                            l);
        fl_params_split(t, r, 1, 1);
        fl_arch_add_row(t, l, 0, FL_INIT_ZEROS, 0, C, 0, "h.%d.mlp.c_proj.bias", l);
    }
    int L = c->n_layer;
    fl_arch_add_row(t, FL_UNIT_HEAD(L), NORM, FL_INIT_ONES, 0, C, 0, "ln_f.weight", 0);
    fl_arch_add_row(t, FL_UNIT_HEAD(L), NORM, FL_INIT_ZEROS, 0, C, 0, "ln_f.bias", 0);
}

// (Under tensor parallelism the attention's and the MLP's inner widths are
// this rank's 1/t.)
static int block_slots(const fl_model_config *c, fl_slot *s) {
    size_t C = c->n_embd, t = (size_t)fl_tp_ways(c);
    s[A_LN1] = (fl_slot){C, 0, 1, 1};
    s[A_LN1_MEAN] = s[A_LN1_RSTD] = (fl_slot){1, 1, 1, 1};
    s[A_QKV] = (fl_slot){3 * C / t, 0, 0, 0};
    s[A_ATTY] = (fl_slot){C / t, 0, 0, 0};
    s[A_LSE] = (fl_slot){(size_t)c->n_head / t, 1, 0, 0};
    s[A_RES2] = (fl_slot){C, 0, 0, 1};
    s[A_LN2] = (fl_slot){C, 0, 1, 1};
    s[A_LN2_MEAN] = s[A_LN2_RSTD] = (fl_slot){1, 1, 1, 1};
    s[A_FCH] = (fl_slot){4 * C / t, 0, 0, 0};
    s[A_GELU] = (fl_slot){4 * C / t, 0, 1, 0};
    return NSLOTS;
}

static int head_slots(const fl_model_config *c, fl_slot *s) {
    s[H_LNF] = (fl_slot){(size_t)c->n_embd, 0, 0, 1};
    s[H_MEAN] = s[H_RSTD] = (fl_slot){1, 1, 0, 1};
    return NHEAD;
}

static int work_slots(const fl_model_config *c, fl_slot *s) {
    // W_C: d(a norm's output) on the stream's side, first d(attention output)
    // (C/t of every position: the same size under sequence parallelism)
    s[W_C] = (fl_slot){(size_t)c->n_embd, 0, 0, 1};
    s[W_4A] = s[W_4B] = (fl_slot){4 * (size_t)c->n_embd / (size_t)fl_tp_ways(c), 0, 0, 0};
    return NWORK;
}

// the block's linears (rows relative to the block) and the tied LM head
// (rows of the embedding unit)
enum { L_QKV, L_ATTPROJ, L_FC, L_FCPROJ, L_HEAD, NLIN };
static void linear_set(const fl_model_config *c, fl_linear *out) {
    int C = c->n_embd, t = fl_tp_ways(c);
    enum { COL = FL_LINEAR_COLUMN, ROW = FL_LINEAR_ROW };
    out[L_QKV] = (fl_linear){QKVW, QKVB, C, 3 * C / t, FL_OP_MM_QKV, COL};
    out[L_ATTPROJ] = (fl_linear){ATTPROJW, ATTPROJB, C / t, C, FL_OP_MM_ATTPROJ, ROW};
    out[L_FC] = (fl_linear){FCW, FCB, C, 4 * C / t, FL_OP_MM_FC, COL};
    out[L_FCPROJ] = (fl_linear){FCPROJW, FCPROJB, 4 * C / t, C, FL_OP_MM_FCPROJ, ROW};
    out[L_HEAD] = (fl_linear){0, -1, C, fl_vocab_cols(c), FL_OP_MM_LMHEAD, COL};
}

static int linears(const fl_model_config *c, fl_linear *out) {
    linear_set(c, out);
    return NLIN;
}

static size_t attention_floats(const fl_model_config *c, const fl_device *d, fl_dtype dt, int B,
                               int T, int threads) {
    return d->attention_workspace_floats(dt, B, T, c->n_head / fl_tp_ways(c), c->n_embd / c->n_head,
                                         1, threads);
}

static size_t rope_floats(const fl_model_config *c, int T) {
    (void)c, (void)T;
    return 0;
}

static void embed_forward(fl_model *m, void *out, const int *tokens, int B, int T) {
    fl_embed_forward(m, out, tokens, fl_unit_w(m, FL_UNIT_EMBED, 0), fl_unit_w(m, FL_UNIT_EMBED, 1),
                     B, T);
}

static void embed_backward(fl_model *m, const void *dout, const int *tokens, int B, int T) {
    fl_embed_backward(m, fl_unit_g(m, FL_UNIT_EMBED, 0), fl_unit_g(m, FL_UNIT_EMBED, 1), dout,
                      tokens, B, T);
}

static void block_forward(const fl_block *b, int cheap_only) {
    fl_model *m = b->m;
    const fl_model_config *c = &m->config;
    fl_dtype dt = m->dtype;
    int l = b->l, C = c->n_embd, BT = b->B * b->T, BTs = fl_seq_rows(c, BT);
    void **a = b->act;
    fl_linear lin[NLIN];
    linear_set(c, lin);
#define W(k) fl_unit_w(m, l, k)
    // a norm reads and writes a row (the fused residual add: two each), and
    // saves its mean and rstd
    double norm_io = fl_norm_io(BTs, C, dt, 2, 2);
    FL_FWD_IO(FL_OP_LAYERNORM, norm_io,
              m->dev->layernorm_forward(dt, a[A_LN1], a[A_LN1_MEAN], a[A_LN1_RSTD], b->in, W(LN1W),
                                        W(LN1B), BTs, C));
    fl_attention_acts att = {a[A_LN1], a[A_QKV], a[A_ATTY], a[A_LSE]};
    // residual2 = in + attproj(...), added in ln_2's first pass; recomputing
    // the cheap ops only, residual2 is kept
    if (!cheap_only) {
        fl_attention_forward(b, &lin[L_QKV], &lin[L_ATTPROJ], &att, a[A_RES2]);
        FL_FWD_IO(FL_OP_LAYERNORM, fl_norm_io(BTs, C, dt, 4, 2),
                  m->dev->residual_layernorm_forward(dt, a[A_RES2], a[A_LN2], a[A_LN2_MEAN],
                                                     a[A_LN2_RSTD], b->in, W(LN2W), W(LN2B), BTs,
                                                     C));
    } else
        FL_FWD_IO(FL_OP_LAYERNORM, norm_io,
                  m->dev->layernorm_forward(dt, a[A_LN2], a[A_LN2_MEAN], a[A_LN2_RSTD], a[A_RES2],
                                            W(LN2W), W(LN2B), BTs, C));
    size_t BT4 = (size_t)BT * lin[L_FC].out;
    if (!cheap_only) // the GELU in the GEMM's epilogue where the device fuses it
        fl_linear_forward_gelu(m, l, &lin[L_FC], a[A_GELU], a[A_FCH], a[A_LN2], BT);
    else
        FL_FWD_IO(FL_OP_GELU, fl_io(BT4, dt, 2),
                  m->dev->gelu_forward(dt, a[A_GELU], a[A_FCH], BT4));
    if (!cheap_only) fl_residual_linear_forward(b, &lin[L_FCPROJ], b->out, a[A_GELU], a[A_RES2]);
#undef W
}

static void block_backward(const fl_block *b, void *dres) {
    fl_model *m = b->m;
    const fl_model_config *c = &m->config;
    fl_dtype dt = m->dtype;
    int l = b->l, C = c->n_embd, BT = b->B * b->T, BTs = fl_seq_rows(c, BT);
    void **a = b->act, *dbuf = b->work[W_C], *d4a = b->work[W_4A], *d4b = b->work[W_4B];
    fl_linear lin[NLIN];
    linear_set(c, lin);
#define W(k) fl_unit_w(m, l, k)
#define G(k) fl_unit_g(m, l, k)
    // MLP: out = residual2 + fcproj(gelu(fc(ln2(residual2)))); d4a, d4b and
    // dbuf are written by the device (device.h), the residual's dres added to
    fl_linear_backward_dgelu(m, l, &lin[L_FCPROJ], d4b, d4a, dres, a[A_GELU], a[A_FCH], BT);
    fl_linear_backward(m, l, &lin[L_FC], dbuf, d4b, a[A_LN2], BT);
    // a norm's backward reads dout, its input and dinp, and writes dinp
    double norm_io = fl_norm_io(BTs, C, dt, 4, 2);
    FL_BWD_IO(FL_OP_LAYERNORM, norm_io,
              m->dev->layernorm_backward(dt, dres, G(LN2W), G(LN2B), dbuf, a[A_RES2], W(LN2W),
                                         a[A_LN2_MEAN], a[A_LN2_RSTD], BTs, C));
    // attention: residual2 = in + attproj(attn(qkv(ln1(in))))
    fl_attention_acts att = {a[A_LN1], a[A_QKV], a[A_ATTY], a[A_LSE]};
    fl_attention_backward(b, &lin[L_QKV], &lin[L_ATTPROJ], &att, dres, dbuf, d4a);
    FL_BWD_IO(FL_OP_LAYERNORM, norm_io,
              m->dev->layernorm_backward(dt, dres, G(LN1W), G(LN1B), dbuf, b->in, W(LN1W),
                                         a[A_LN1_MEAN], a[A_LN1_RSTD], BTs, C));
#undef W
#undef G
}

static void head_forward(const fl_block *h, void *logits) {
    fl_model *m = h->m;
    int L = m->config.n_layer, C = m->config.n_embd, BT = h->B * h->T;
    void **a = h->act;
    fl_linear lin[NLIN];
    linear_set(&m->config, lin);
    int BTs = fl_seq_rows(&m->config, BT);
    FL_FWD_IO(FL_OP_LAYERNORM, fl_norm_io(BTs, C, m->dtype, 2, 2),
              m->dev->layernorm_forward(m->dtype, a[H_LNF], a[H_MEAN], a[H_RSTD], h->in,
                                        fl_unit_w(m, FL_UNIT_HEAD(L), 0),
                                        fl_unit_w(m, FL_UNIT_HEAD(L), 1), BTs, C));
    fl_linear_forward(m, FL_UNIT_EMBED, &lin[L_HEAD], logits, a[H_LNF], BT); // tied to wte
}

static void head_backward(const fl_block *h, void *dres, const void *dlogits) {
    fl_model *m = h->m;
    int L = m->config.n_layer, C = m->config.n_embd, BT = h->B * h->T, U = FL_UNIT_HEAD(L);
    int BTs = fl_seq_rows(&m->config, BT);
    size_t BTC = (size_t)BTs * C, D = fl_dtype_size(m->dtype);
    void **a = h->act, *dbuf = h->work[W_C];
    fl_linear lin[NLIN];
    linear_set(&m->config, lin);
    fl_linear_backward(m, FL_UNIT_EMBED, &lin[L_HEAD], dbuf, dlogits, a[H_LNF], BT);
    fl_zero_dact(m, dres, BTC * D); // the residual stream's gradient starts here
    FL_BWD_IO(FL_OP_LAYERNORM, fl_norm_io(BTs, C, m->dtype, 4, 2),
              m->dev->layernorm_backward(m->dtype, dres, fl_unit_g(m, U, 0), fl_unit_g(m, U, 1),
                                         dbuf, h->in, fl_unit_w(m, U, 0), a[H_MEAN], a[H_RSTD], BTs,
                                         C));
}

const fl_arch fl_arch_gpt2 = {
    finish,         num_params,    sizes,          table_rows,       build_table,  block_slots,
    head_slots,     work_slots,    linears,        attention_floats, rope_floats,  embed_forward,
    embed_backward, block_forward, block_backward, head_forward,     head_backward};
