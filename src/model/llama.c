// llama.c: LLaMA as Hugging Face's LlamaForCausalLM defines it
// (transformers/models/llama/modeling_llama.py): a token embedding, pre-RMSNorm
// blocks of causal attention with grouped-query heads and rotary position
// embeddings (rotate-half convention) and a SwiGLU MLP, a final RMSNorm and
// an LM head (untied unless tie_word_embeddings). No biases anywhere.
//
// q_proj, k_proj and v_proj are consecutive rows of the table, and so are
// gate_proj and up_proj: each group runs as one GEMM over the stacked
// weights, writing [q | k | v] and [gate | up] side by side per position.
#include "arch.h"

// rows of a block, in table order
enum { LN1, WQ, WK, WV, WO, LN2, WGATE, WUP, WDOWN, NROWS };
// activation slots of a block; (S) = dropped and recomputed under "selective"
enum {
    A_LN1,    // (C) (S)
    A_RSTD1,  // (1) fp32 (S)
    A_QKV,    // (QKV) after the rotary embedding
    A_ATTY,   // (C) attention output before o_proj
    A_LSE,    // (NH) fp32
    A_RES2,   // (C) residual after attention
    A_LN2,    // (C) (S)
    A_RSTD2,  // (1) fp32 (S)
    A_GATEUP, // (2I)
    A_ACT,    // (I) silu(gate) * up (S)
    NSLOTS
};
enum { H_NORM, H_RSTD, NHEAD };        // head slots
enum { W_C, W_QKV, W_2I, W_I, NWORK }; // backward scratch

// this rank's q, k and v (all of them at t = 1)
static size_t qkv_width(const fl_model_config *c) {
    return (size_t)(c->n_head + 2 * c->n_kv_head) * (c->n_embd / c->n_head) / (size_t)fl_tp_ways(c);
}

static void finish(fl_model_config *c) {
    if (c->n_kv_head == 0) c->n_kv_head = c->n_head;
    if (c->intermediate_size == 0) c->intermediate_size = 4 * c->n_embd;
    if (c->norm_eps == 0.0f) c->norm_eps = 1e-5f;
    if (c->rope_theta == 0.0f) c->rope_theta = 10000.0f;
    if (!(c->norm_eps > 0.0f && c->norm_eps < 1.0f))
        fl_die("model.norm_eps must be in (0, 1) (got %g)", c->norm_eps);
    if (!(c->rope_theta > 1.0f)) fl_die("model.rope_theta must be > 1 (got %g)", c->rope_theta);
    if ((c->n_embd / c->n_head) % 2)
        fl_die("model: the head size n_embd / n_head (%d) must be even for rotary embeddings",
               c->n_embd / c->n_head);
}

static void sizes(const fl_model_config *c, size_t *largest_row, size_t *block) {
    size_t C = c->n_embd, I = c->intermediate_size;
    size_t kv = (size_t)c->n_kv_head * (C / c->n_head);
    *largest_row = (size_t)c->padded_vocab_size * C;
    if (I * C > *largest_row) *largest_row = I * C;
    *block = 2 * C + 2 * C * C + 2 * kv * C + 3 * I * C;
}

static size_t num_params(const fl_model_config *c) {
    size_t C = c->n_embd, L = c->n_layer, Vp = c->padded_vocab_size;
    size_t largest, block;
    sizes(c, &largest, &block);
    return Vp * C + L * block + C + (c->tie_embeddings ? 0 : Vp * C);
}

static int table_rows(const fl_model_config *c) {
    return 1 + NROWS * c->n_layer + 1 + !c->tie_embeddings;
}

// Initialisation as Hugging Face's LlamaPreTrainedModel: N(0, 0.02) for
// every matrix and embedding, RMSNorm weights 1. Tensor parallelism: q, k,
// v, gate and up are column-parallel (by heads, KV heads, MLP width),
// o_proj and down_proj row-parallel, the embedding and LM head split by
// vocabulary rows; the norms are replicated.
static void build_table(fl_param_table *t, const fl_model_config *c) {
    size_t C = c->n_embd, I = c->intermediate_size, kv = (size_t)c->n_kv_head * (C / c->n_head);
    const unsigned D = FL_PARAM_DECAY, LIN = FL_PARAM_DECAY | FL_PARAM_LINEAR;
    const unsigned NORM = FL_PARAM_TOKENWISE;
    const float std = 0.02f;
    int L = c->n_layer;
    int e = fl_arch_add_row(t, FL_UNIT_EMBED, D, FL_INIT_NORMAL, std, c->padded_vocab_size, C,
                            "embed_tokens.weight", 0);
    t->views[e].live_rows = c->vocab_size;
    fl_params_split(t, e, 0, 1);
    static const struct {
        const char *name;
        int out, in, dim; // sizes: 0 C, 1 kv, 2 I
    } mats[] = {{"layers.%d.self_attn.q_proj.weight", 0, 0, 0},
                {"layers.%d.self_attn.k_proj.weight", 1, 0, 0},
                {"layers.%d.self_attn.v_proj.weight", 1, 0, 0},
                {"layers.%d.self_attn.o_proj.weight", 0, 0, 1},
                {NULL, 0, 0, 0}, // post_attention_layernorm
                {"layers.%d.mlp.gate_proj.weight", 2, 0, 0},
                {"layers.%d.mlp.up_proj.weight", 2, 0, 0},
                {"layers.%d.mlp.down_proj.weight", 0, 2, 1}};
    size_t size[] = {C, kv, I};
    for (int l = 0; l < L; l++) {
        fl_arch_add_row(t, l, NORM, FL_INIT_ONES, 0, C, 0, "layers.%d.input_layernorm.weight", l);
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) {
            if (!mats[i].name) {
                fl_arch_add_row(t, l, NORM, FL_INIT_ONES, 0, C, 0,
                                "layers.%d.post_attention_layernorm.weight", l);
                continue;
            }
            int r = fl_arch_add_row(t, l, LIN, FL_INIT_NORMAL, std, size[mats[i].out],
                                    size[mats[i].in], mats[i].name, l);
            fl_params_split(t, r, mats[i].dim, 1);
        }
    }
    fl_arch_add_row(t, FL_UNIT_HEAD(L), NORM, FL_INIT_ONES, 0, C, 0, "norm.weight", 0);
    if (!c->tie_embeddings) {
        int h = fl_arch_add_row(t, FL_UNIT_HEAD(L), D, FL_INIT_NORMAL, std, c->padded_vocab_size, C,
                                "lm_head.weight", 0);
        t->views[h].live_rows = c->vocab_size;
        fl_params_split(t, h, 0, 1);
    }
}

// (Under tensor parallelism the attention's and the MLP's inner widths are
// this rank's 1/t.)
static int block_slots(const fl_model_config *c, fl_slot *s) {
    size_t C = c->n_embd, t = (size_t)fl_tp_ways(c), I = c->intermediate_size / t;
    s[A_LN1] = s[A_LN2] = (fl_slot){C, 0, 1, 1};
    s[A_RSTD1] = s[A_RSTD2] = (fl_slot){1, 1, 1, 1};
    s[A_QKV] = (fl_slot){qkv_width(c), 0, 0, 0};
    s[A_ATTY] = (fl_slot){C / t, 0, 0, 0};
    s[A_RES2] = (fl_slot){C, 0, 0, 1};
    s[A_LSE] = (fl_slot){(size_t)c->n_head / t, 1, 0, 0};
    s[A_GATEUP] = (fl_slot){2 * I, 0, 0, 0};
    s[A_ACT] = (fl_slot){I, 0, 1, 0};
    return NSLOTS;
}

static int head_slots(const fl_model_config *c, fl_slot *s) {
    s[H_NORM] = (fl_slot){(size_t)c->n_embd, 0, 0, 1};
    s[H_RSTD] = (fl_slot){1, 1, 0, 1};
    return NHEAD;
}

static int work_slots(const fl_model_config *c, fl_slot *s) {
    size_t I = c->intermediate_size / (size_t)fl_tp_ways(c);
    // W_C: d(a norm's output) on the stream's side, first d(attention output)
    // (C/t of every position: the same size under sequence parallelism)
    s[W_C] = (fl_slot){(size_t)c->n_embd, 0, 0, 1};
    s[W_QKV] = (fl_slot){qkv_width(c), 0, 0, 0};
    s[W_2I] = (fl_slot){2 * I, 0, 0, 0};
    s[W_I] = (fl_slot){I, 0, 0, 0};
    return NWORK;
}

enum { L_QKV, L_O, L_GATEUP, L_DOWN, L_HEAD, NLIN };
static void linear_set(const fl_model_config *c, fl_linear *out) {
    int t = fl_tp_ways(c), C = c->n_embd, I = c->intermediate_size / t;
    enum { COL = FL_LINEAR_COLUMN, ROW = FL_LINEAR_ROW };
    out[L_QKV] = (fl_linear){WQ, -1, C, (int)qkv_width(c), FL_OP_MM_QKV, COL};
    out[L_O] = (fl_linear){WO, -1, C / t, C, FL_OP_MM_ATTPROJ, ROW};
    out[L_GATEUP] = (fl_linear){WGATE, -1, C, 2 * I, FL_OP_MM_FC, COL};
    out[L_DOWN] = (fl_linear){WDOWN, -1, I, C, FL_OP_MM_FCPROJ, ROW};
    // tied: row 0 of the embedding unit; untied: row 1 of the head unit
    out[L_HEAD] =
        (fl_linear){c->tie_embeddings ? 0 : 1, -1, C, fl_vocab_cols(c), FL_OP_MM_LMHEAD, COL};
}

static int linears(const fl_model_config *c, fl_linear *out) {
    linear_set(c, out);
    return NLIN;
}

static int head_unit(const fl_model_config *c) {
    return c->tie_embeddings ? FL_UNIT_EMBED : FL_UNIT_HEAD(c->n_layer);
}

static size_t attention_floats(const fl_model_config *c, const fl_device *d, fl_dtype dt, int B,
                               int T, int threads) {
    return d->attention_workspace_floats(dt, B, T, c->n_head / fl_tp_ways(c), c->n_embd / c->n_head,
                                         c->n_head / c->n_kv_head, threads);
}

static size_t rope_floats(const fl_model_config *c, int T) {
    return (size_t)T * (c->n_embd / c->n_head);
}

static void embed_forward(fl_model *m, void *out, const int *tokens, int B, int T) {
    fl_embed_forward(m, out, tokens, fl_unit_w(m, FL_UNIT_EMBED, 0), NULL, B, T);
}

static void embed_backward(fl_model *m, const void *dout, const int *tokens, int B, int T) {
    fl_embed_backward(m, fl_unit_g(m, FL_UNIT_EMBED, 0), NULL, dout, tokens, B, T);
}

static void block_forward(const fl_block *b, int cheap_only) {
    fl_model *m = b->m;
    const fl_model_config *c = &m->config;
    fl_dtype dt = m->dtype;
    int l = b->l, C = c->n_embd, I = c->intermediate_size / fl_tp_ways(c);
    int BT = b->B * b->T, BTs = fl_seq_rows(c, BT);
    float eps = c->norm_eps;
    void **a = b->act;
    fl_linear lin[NLIN];
    linear_set(c, lin);
    // a norm reads and writes a row (the fused residual add: two each), and
    // saves its rstd
    double norm_io = fl_norm_io(BTs, C, dt, 2, 1);
    FL_FWD_IO(FL_OP_RMSNORM, norm_io,
              m->dev->rmsnorm_forward(dt, a[A_LN1], a[A_RSTD1], b->in, fl_unit_w(m, l, LN1), BTs, C,
                                      eps));
    fl_attention_acts att = {a[A_LN1], a[A_QKV], a[A_ATTY], a[A_LSE]};
    // residual2 = in + o(...), added in the second norm's first pass;
    // recomputing the cheap ops only, residual2 is kept
    if (!cheap_only) {
        fl_attention_forward(b, &lin[L_QKV], &lin[L_O], &att, a[A_RES2]);
        FL_FWD_IO(FL_OP_RMSNORM, fl_norm_io(BTs, C, dt, 4, 1),
                  m->dev->residual_rmsnorm_forward(dt, a[A_RES2], a[A_LN2], a[A_RSTD2], b->in,
                                                   fl_unit_w(m, l, LN2), BTs, C, eps));
    } else
        FL_FWD_IO(FL_OP_RMSNORM, norm_io,
                  m->dev->rmsnorm_forward(dt, a[A_LN2], a[A_RSTD2], a[A_RES2], fl_unit_w(m, l, LN2),
                                          BTs, C, eps));
    if (!cheap_only) fl_linear_forward(m, l, &lin[L_GATEUP], a[A_GATEUP], a[A_LN2], BT);
    // SwiGLU reads gate and up, writes their product
    FL_FWD_IO(FL_OP_SWIGLU, fl_io((size_t)BT * I, dt, 3),
              m->dev->swiglu_forward(dt, a[A_ACT], a[A_GATEUP], BT, I));
    if (!cheap_only) fl_residual_linear_forward(b, &lin[L_DOWN], b->out, a[A_ACT], a[A_RES2]);
}

static void block_backward(const fl_block *b, void *dres) {
    fl_model *m = b->m;
    const fl_model_config *c = &m->config;
    fl_dtype dt = m->dtype;
    int l = b->l, C = c->n_embd, I = c->intermediate_size / fl_tp_ways(c);
    int BT = b->B * b->T, BTs = fl_seq_rows(c, BT);
    void **a = b->act, **w = b->work;
    fl_linear lin[NLIN];
    linear_set(c, lin);
    // MLP: out = res2 + down(silu(gate(ln2)) * up(ln2)), ln2 = rmsnorm(res2)
    // the work buffers are written by the device (device.h), dres added to
    fl_linear_backward(m, l, &lin[L_DOWN], w[W_I], dres, a[A_ACT], BT);
    // reads dout, gate and up, and writes their gradients
    FL_BWD_IO(FL_OP_SWIGLU, fl_io((size_t)BT * I, dt, 5),
              m->dev->swiglu_backward(dt, w[W_2I], a[A_GATEUP], w[W_I], BT, I));
    fl_linear_backward(m, l, &lin[L_GATEUP], w[W_C], w[W_2I], a[A_LN2], BT);
    // a norm's backward reads dout, its input and dinp, and writes dinp
    double norm_io = fl_norm_io(BTs, C, dt, 4, 1);
    FL_BWD_IO(FL_OP_RMSNORM, norm_io,
              m->dev->rmsnorm_backward(dt, dres, fl_unit_g(m, l, LN2), w[W_C], a[A_RES2],
                                       fl_unit_w(m, l, LN2), a[A_RSTD2], BTs, C));
    // attention: res2 = in + o(attn(rope(qkv(ln1)))), ln1 = rmsnorm(in)
    fl_attention_acts att = {a[A_LN1], a[A_QKV], a[A_ATTY], a[A_LSE]};
    fl_attention_backward(b, &lin[L_QKV], &lin[L_O], &att, dres, w[W_C], w[W_QKV]);
    FL_BWD_IO(FL_OP_RMSNORM, norm_io,
              m->dev->rmsnorm_backward(dt, dres, fl_unit_g(m, l, LN1), w[W_C], b->in,
                                       fl_unit_w(m, l, LN1), a[A_RSTD1], BTs, C));
}

static void head_forward(const fl_block *h, void *logits) {
    fl_model *m = h->m;
    const fl_model_config *c = &m->config;
    int BT = h->B * h->T, U = FL_UNIT_HEAD(c->n_layer);
    void **a = h->act;
    fl_linear lin[NLIN];
    linear_set(c, lin);
    int BTs = fl_seq_rows(c, BT);
    FL_FWD_IO(FL_OP_RMSNORM, fl_norm_io(BTs, c->n_embd, m->dtype, 2, 1),
              m->dev->rmsnorm_forward(m->dtype, a[H_NORM], a[H_RSTD], h->in, fl_unit_w(m, U, 0),
                                      BTs, c->n_embd, c->norm_eps));
    fl_linear_forward(m, head_unit(c), &lin[L_HEAD], logits, a[H_NORM], BT);
}

static void head_backward(const fl_block *h, void *dres, const void *dlogits) {
    fl_model *m = h->m;
    const fl_model_config *c = &m->config;
    int BT = h->B * h->T, C = c->n_embd, U = FL_UNIT_HEAD(c->n_layer), BTs = fl_seq_rows(c, BT);
    size_t BTC = (size_t)BTs * C, D = fl_dtype_size(m->dtype);
    void **a = h->act, *dnorm = h->work[W_C];
    fl_linear lin[NLIN];
    linear_set(c, lin);
    fl_linear_backward(m, head_unit(c), &lin[L_HEAD], dnorm, dlogits, a[H_NORM], BT);
    fl_zero_dact(m, dres, BTC * D); // the residual stream's gradient starts here
    FL_BWD_IO(FL_OP_RMSNORM, fl_norm_io(BTs, C, m->dtype, 4, 1),
              m->dev->rmsnorm_backward(m->dtype, dres, fl_unit_g(m, U, 0), dnorm, h->in,
                                       fl_unit_w(m, U, 0), a[H_RSTD], BTs, C));
}

const fl_arch fl_arch_llama = {
    finish,         num_params,    sizes,          table_rows,       build_table,  block_slots,
    head_slots,     work_slots,    linears,        attention_floats, rope_floats,  embed_forward,
    embed_backward, block_forward, block_backward, head_forward,     head_backward};
