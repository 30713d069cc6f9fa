// gpt2.c: GPT-2 (Radford et al. 2019) as Hugging Face and llm.c define it:
// learned token and position embeddings, pre-LayerNorm blocks of causal
// multi-head attention (fused QKV) and a GELU MLP of width 4C, a final
// LayerNorm and an LM head tied to the token embedding.
//
// The forward pass is a flat list of kernel calls per layer; the backward
// pass is the same list reversed. Parameters and gradients are two flat
// buffers described by one parameter table.
#include "fitlm/model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "fitlm/kernels.h"
#include "fitlm/profile.h"

// ----------------------------------------------------------------------------
// configuration and parameter table

void fl_gpt2_config_finish(fl_gpt2_config *cfg) {
    const struct {
        const char *name;
        int value;
    } fields[] = {{"n_layer", cfg->n_layer},
                  {"n_head", cfg->n_head},
                  {"n_embd", cfg->n_embd},
                  {"vocab_size", cfg->vocab_size},
                  {"max_seq_len", cfg->max_seq_len}};
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++)
        if (fields[i].value <= 0)
            fl_die("model.%s must be positive (got %d)", fields[i].name, fields[i].value);
    if (cfg->n_embd % cfg->n_head != 0)
        fl_die("model.n_embd (%d) must be divisible by model.n_head (%d)", cfg->n_embd,
               cfg->n_head);
    if (cfg->vocab_size > (1 << 30) || cfg->n_embd > (1 << 16) || cfg->max_seq_len > (1 << 20) ||
        cfg->n_layer > 1024)
        fl_die("model shape out of range (vocab_size %d, n_embd %d, max_seq_len %d, n_layer %d)",
               cfg->vocab_size, cfg->n_embd, cfg->max_seq_len, cfg->n_layer);
    // A multiple of 128 keeps the LM-head GEMM on full SIMD tiles.
    cfg->padded_vocab_size = (cfg->vocab_size + 127) / 128 * 128;
}

enum { VIEWS_BEFORE_LAYERS = 2, VIEWS_PER_LAYER = 12 };

static int add_view(fl_param_table *t, unsigned flags, size_t d0, size_t d1, const char *fmt,
                    int layer) {
    char name[FL_PARAM_NAME_MAX];
    snprintf(name, sizeof name, fmt, layer);
    size_t shape[2] = {d0, d1};
    return fl_params_add(t, name, flags, d1 ? 2 : 1, shape);
}

// Table order is the order of use in the forward pass, one layer after the
// other, so a layer's parameters are one contiguous range (ZeRO-3 gathers
// layer by layer) and hooks fire in a predictable reverse order.
static void build_table(fl_param_table *t, const fl_gpt2_config *cfg) {
    size_t C = cfg->n_embd, Vp = cfg->padded_vocab_size, maxT = cfg->max_seq_len;
    fl_params_reserve(t, VIEWS_BEFORE_LAYERS + VIEWS_PER_LAYER * cfg->n_layer + 2);
    add_view(t, FL_PARAM_DECAY, Vp, C, "wte.weight", 0);
    add_view(t, 0, maxT, C, "wpe.weight", 0);
    for (int l = 0; l < cfg->n_layer; l++) {
        add_view(t, 0, C, 0, "h.%d.ln_1.weight", l);
        add_view(t, 0, C, 0, "h.%d.ln_1.bias", l);
        add_view(t, FL_PARAM_DECAY, 3 * C, C, "h.%d.attn.c_attn.weight", l);
        add_view(t, 0, 3 * C, 0, "h.%d.attn.c_attn.bias", l);
        add_view(t, FL_PARAM_DECAY, C, C, "h.%d.attn.c_proj.weight", l);
        add_view(t, 0, C, 0, "h.%d.attn.c_proj.bias", l);
        add_view(t, 0, C, 0, "h.%d.ln_2.weight", l);
        add_view(t, 0, C, 0, "h.%d.ln_2.bias", l);
        add_view(t, FL_PARAM_DECAY, 4 * C, C, "h.%d.mlp.c_fc.weight", l);
        add_view(t, 0, 4 * C, 0, "h.%d.mlp.c_fc.bias", l);
        add_view(t, FL_PARAM_DECAY, C, 4 * C, "h.%d.mlp.c_proj.weight", l);
        add_view(t, 0, C, 0, "h.%d.mlp.c_proj.bias", l);
    }
    add_view(t, 0, C, 0, "ln_f.weight", 0);
    add_view(t, 0, C, 0, "ln_f.bias", 0);
}

void fl_gpt2_table(fl_param_table *t, const fl_gpt2_config *cfg) {
    fl_gpt2_config c = *cfg;
    fl_gpt2_config_finish(&c);
    memset(t, 0, sizeof *t);
    build_table(t, &c);
}

// The sum of build_table's view sizes, without allocating (planning must not
// move the memory peaks it predicts); fl_gpt2_init checks the two agree.
size_t fl_gpt2_num_params(const fl_gpt2_config *cfg) {
    fl_gpt2_config c = *cfg;
    fl_gpt2_config_finish(&c);
    size_t C = c.n_embd, L = c.n_layer;
    return (size_t)c.padded_vocab_size * C + (size_t)c.max_seq_len * C + L * (12 * C * C + 13 * C) +
           2 * C;
}

// Points the weights struct at a flat buffer (params or grads), following
// the table order of build_table.
static void bind_weights(fl_gpt2_weights *w, const fl_param_table *t, fl_dtype dt, void *base,
                         int L) {
    const fl_param_view *v = t->views;
    w->wte = fl_at(dt, base, v[0].offset);
    w->wpe = fl_at(dt, base, v[1].offset);
    for (int l = 0; l < L; l++) {
        const fl_param_view *lv = v + VIEWS_BEFORE_LAYERS + l * VIEWS_PER_LAYER;
        void **slots[VIEWS_PER_LAYER] = {&w->h[l].ln1w, &w->h[l].ln1b,     &w->h[l].qkvw,
                                         &w->h[l].qkvb, &w->h[l].attprojw, &w->h[l].attprojb,
                                         &w->h[l].ln2w, &w->h[l].ln2b,     &w->h[l].fcw,
                                         &w->h[l].fcb,  &w->h[l].fcprojw,  &w->h[l].fcprojb};
        for (int i = 0; i < VIEWS_PER_LAYER; i++) *slots[i] = fl_at(dt, base, lv[i].offset);
    }
    const fl_param_view *f = v + VIEWS_BEFORE_LAYERS + L * VIEWS_PER_LAYER;
    w->lnfw = fl_at(dt, base, f[0].offset);
    w->lnfb = fl_at(dt, base, f[1].offset);
}

void fl_gpt2_init(fl_gpt2 *model, const fl_gpt2_config *cfg, fl_dtype dt, uint64_t seed) {
    memset(model, 0, sizeof *model);
    model->config = *cfg;
    model->dtype = dt;
    fl_gpt2_config_finish(&model->config);
    const fl_gpt2_config *c = &model->config;
    build_table(&model->table, c);
    size_t n = model->table.numel;
    FL_ASSERT(n == fl_gpt2_num_params(c));
    model->params = fl_alloc(FL_MEM_PARAMS, n * fl_dtype_size(dt));
    model->grads = fl_alloc(FL_MEM_GRADS, n * fl_dtype_size(dt));
    model->w.h = fl_alloc(FL_MEM_OTHER, c->n_layer * sizeof(fl_gpt2_layer));
    model->g.h = fl_alloc(FL_MEM_OTHER, c->n_layer * sizeof(fl_gpt2_layer));
    bind_weights(&model->w, &model->table, dt, model->params, c->n_layer);
    bind_weights(&model->g, &model->table, dt, model->grads, c->n_layer);

    // GPT-2 initialisation: N(0, 0.02) for matrices and embeddings, with the
    // projections into the residual stream scaled by 1/sqrt(2L) since L
    // blocks each add two of them to it. Drawn in fp32, view by view, then
    // rounded to the storage dtype: the same draws for every precision.
    fl_rng rng;
    fl_rng_seed(&rng, seed);
    float resid_std = 0.02f / sqrtf(2.0f * c->n_layer);
    float block[4096];
    for (int i = 0; i < model->table.count; i++) {
        const fl_param_view *v = &model->table.views[i];
        int ones = strstr(v->name, "ln_") && strstr(v->name, ".weight");
        float std = v->ndim == 1 ? 0.0f : strstr(v->name, "c_proj.weight") ? resid_std : 0.02f;
        size_t drawn = i == 0 ? (size_t)c->vocab_size * c->n_embd : v->numel; // padded rows: 0
        for (size_t j0 = 0; j0 < v->numel; j0 += 4096) {
            size_t len = v->numel - j0 < 4096 ? v->numel - j0 : 4096;
            for (size_t j = 0; j < len; j++)
                block[j] = ones                           ? 1.0f
                           : std > 0.0f && j0 + j < drawn ? std * fl_rng_normal(&rng)
                                                          : 0.0f; // biases: 0
            fl_store_f32(dt, fl_at(dt, model->params, v->offset + j0), block, len);
        }
    }
}

// One allocation of the activation set: where its pointer goes, how many
// elements of what size, under which tag. fl_gpt2_alloc_acts walks this list
// to allocate and fl_gpt2_memory to predict, so the two cannot disagree.
typedef struct {
    void **slot; // NULL when only sizes are wanted
    size_t count, elem;
    fl_mem_tag tag;
} act_spec;

enum { MAX_SPECS = 40 };

static int act_specs(fl_gpt2 *m, const fl_gpt2_config *c, fl_dtype dt, int B, int T, int threads,
                     act_spec *out) {
    size_t L = c->n_layer, C = c->n_embd, NH = c->n_head, Vp = c->padded_vocab_size;
    size_t BT = (size_t)B * T, D = fl_dtype_size(dt), F = sizeof(float), I = sizeof(int);
    fl_gpt2_acts *a = m ? &m->acts : NULL;
    int n = 0;
#define SPEC(field, cnt, size, tag)                                                                \
    out[n++] = (act_spec){m ? (void **)&(field) : NULL, cnt, size, tag}
    SPEC(a->encoded, BT * C, D, FL_MEM_ACTS);
    SPEC(a->ln1, L * BT * C, D, FL_MEM_ACTS);
    SPEC(a->ln1_mean, L * BT, F, FL_MEM_ACTS);
    SPEC(a->ln1_rstd, L * BT, F, FL_MEM_ACTS);
    SPEC(a->qkv, L * BT * 3 * C, D, FL_MEM_ACTS);
    SPEC(a->atty, L * BT * C, D, FL_MEM_ACTS);
    SPEC(a->att_lse, L * BT * NH, F, FL_MEM_ACTS);
    SPEC(a->residual2, L * BT * C, D, FL_MEM_ACTS);
    SPEC(a->ln2, L * BT * C, D, FL_MEM_ACTS);
    SPEC(a->ln2_mean, L * BT, F, FL_MEM_ACTS);
    SPEC(a->ln2_rstd, L * BT, F, FL_MEM_ACTS);
    SPEC(a->fch, L * BT * 4 * C, D, FL_MEM_ACTS);
    SPEC(a->fch_gelu, L * BT * 4 * C, D, FL_MEM_ACTS);
    SPEC(a->residual3, L * BT * C, D, FL_MEM_ACTS);
    SPEC(a->lnf, BT * C, D, FL_MEM_ACTS);
    SPEC(a->lnf_mean, BT, F, FL_MEM_ACTS);
    SPEC(a->lnf_rstd, BT, F, FL_MEM_ACTS);
    SPEC(a->logits, BT * Vp, D, FL_MEM_ACTS);
    SPEC(a->losses, BT, F, FL_MEM_ACTS);
    SPEC(a->xent_lse, BT, F, FL_MEM_ACTS);
    SPEC(m->inputs, BT, I, FL_MEM_ACTS);
    SPEC(m->targets, BT, I, FL_MEM_ACTS);
    SPEC(m->dres, BT * C, D, FL_MEM_WORKSPACE);
    SPEC(m->dbuf_c, BT * C, D, FL_MEM_WORKSPACE);
    SPEC(m->dbuf_4c_a, BT * 4 * C, D, FL_MEM_WORKSPACE);
    SPEC(m->dbuf_4c_b, BT * 4 * C, D, FL_MEM_WORKSPACE);
    SPEC(m->dlosses, BT, F, FL_MEM_WORKSPACE);
    SPEC(m->att_workspace, attention_workspace_floats(dt, T, C / NH) * (size_t)threads, F,
         FL_MEM_WORKSPACE);
    // the largest GEMM workspace of the step: the four layer shapes and the LM head
    size_t mm = 0;
    int shapes[5][2] = {{C, 3 * C}, {C, C}, {C, 4 * C}, {4 * C, C}, {C, Vp}};
    for (int i = 0; i < 5; i++) {
        size_t b = matmul_workspace_bytes(dt, (int)BT, shapes[i][0], shapes[i][1]);
        if (b > mm) mm = b;
    }
    SPEC(m->matmul_workspace, mm, 1, FL_MEM_WORKSPACE);
#undef SPEC
    FL_ASSERT(n <= MAX_SPECS);
    return n;
}

void fl_gpt2_memory(const fl_gpt2_config *cfg, fl_dtype dt, int B, int T, int threads,
                    size_t bytes[FL_MEM_NTAGS]) {
    fl_gpt2_config c = *cfg;
    fl_gpt2_config_finish(&c);
    memset(bytes, 0, FL_MEM_NTAGS * sizeof(size_t));
    size_t numel = fl_gpt2_num_params(&c);
    bytes[FL_MEM_PARAMS] = numel * fl_dtype_size(dt);
    bytes[FL_MEM_GRADS] = numel * fl_dtype_size(dt);
    // the table's views (reserved exactly) and the two layer arrays
    size_t views = VIEWS_BEFORE_LAYERS + VIEWS_PER_LAYER * (size_t)c.n_layer + 2;
    bytes[FL_MEM_OTHER] = views * sizeof(fl_param_view) + 2 * c.n_layer * sizeof(fl_gpt2_layer);
    if (B == 0) return;
    act_spec specs[MAX_SPECS];
    int n = act_specs(NULL, &c, dt, B, T, threads, specs);
    for (int i = 0; i < n; i++) bytes[specs[i].tag] += specs[i].count * specs[i].elem;
}

void fl_gpt2_alloc_acts(fl_gpt2 *model, int B, int T) {
    const fl_gpt2_config *c = &model->config;
    if (B <= 0 || T <= 0)
        fl_die("batch size and sequence length must be positive (B=%d, T=%d)", B, T);
    if (T > c->max_seq_len)
        fl_die("sequence length %d exceeds the model's max_seq_len %d", T, c->max_seq_len);
    FL_ASSERT(model->max_B == 0); // allocated once, up front
    act_spec specs[MAX_SPECS];
    int n = act_specs(model, c, model->dtype, B, T, fl_threads(), specs);
    for (int i = 0; i < n; i++)
        *specs[i].slot = fl_alloc(specs[i].tag, specs[i].count * specs[i].elem);
    model->att_workspace_threads = fl_threads();
    model->max_B = B;
    model->max_T = T;
}

void fl_gpt2_free(fl_gpt2 *model) {
    if (model->max_B) {
        act_spec specs[MAX_SPECS];
        int n = act_specs(model, &model->config, model->dtype, model->max_B, model->max_T,
                          model->att_workspace_threads, specs);
        for (int i = 0; i < n; i++) fl_free(*specs[i].slot);
    }
    fl_free(model->params);
    fl_free(model->grads);
    fl_free(model->w.h);
    fl_free(model->g.h);
    fl_params_free(&model->table);
    memset(model, 0, sizeof *model);
}

// ----------------------------------------------------------------------------
// forward

// FLOPs of one (N x C) @ (C x OC) GEMM: the profile's GFLOP/s; a matmul's
// backward is two of them (input and weight gradients).
static double gemm_flops(size_t N, int C, int OC) {
    return 2.0 * (double)N * C * OC;
}

// Kernel calls timed into the profile's op slots (fitlm/profile.h).
#define FWD(op, ...)              FL_PROFILE(op, FL_FWD, 0.0, __VA_ARGS__)
#define BWD(op, ...)              FL_PROFILE(op, FL_BWD, 0.0, __VA_ARGS__)
#define MM_FWD(op, N, C, OC, ...) FL_PROFILE(op, FL_FWD, gemm_flops(N, C, OC), __VA_ARGS__)
#define MM_BWD(op, N, C, OC, ...) FL_PROFILE(op, FL_BWD, 2.0 * gemm_flops(N, C, OC), __VA_ARGS__)

float fl_gpt2_forward(fl_gpt2 *model, const int *tokens, const int *targets, int B, int T) {
    const fl_gpt2_config *c = &model->config;
    if (model->max_B == 0) fl_die("internal: fl_gpt2_forward before fl_gpt2_alloc_acts");
    if (B > model->max_B || T > model->max_T)
        fl_die("internal: batch %dx%d exceeds the allocated %dx%d", B, T, model->max_B,
               model->max_T);
    int L = c->n_layer, C = c->n_embd, NH = c->n_head, V = c->vocab_size, Vp = c->padded_vocab_size;
    fl_dtype dt = model->dtype;
    size_t BT = (size_t)B * T, BTC = BT * C;
    for (size_t i = 0; i < BT; i++) {
        if (tokens[i] < 0 || tokens[i] >= V)
            fl_die("token id %d at position %zu is outside the vocabulary [0, %d)", tokens[i], i,
                   V);
        if (targets && (targets[i] < -1 || targets[i] >= V))
            fl_die("target id %d at position %zu is outside the vocabulary [0, %d)", targets[i], i,
                   V);
    }
    // attention takes one workspace slice per thread
    if (fl_threads() > model->att_workspace_threads)
        fl_die("internal: %d threads, but activations were allocated for %d", fl_threads(),
               model->att_workspace_threads);
    memcpy(model->inputs, tokens, BT * sizeof(int));
    model->B = B;
    model->T = T;

    fl_gpt2_acts *a = &model->acts;
    void *mm_ws = model->matmul_workspace;
    FWD(FL_OP_ENCODER,
        encoder_forward(dt, a->encoded, tokens, model->w.wte, model->w.wpe, B, T, C));
    for (int l = 0; l < L; l++) {
        const fl_gpt2_layer *w = &model->w.h[l];
        void *residual = l == 0 ? a->encoded : fl_at(dt, a->residual3, (l - 1) * BTC);
        void *ln1 = fl_at(dt, a->ln1, l * BTC), *qkv = fl_at(dt, a->qkv, l * 3 * BTC);
        void *atty = fl_at(dt, a->atty, l * BTC), *residual2 = fl_at(dt, a->residual2, l * BTC);
        void *ln2 = fl_at(dt, a->ln2, l * BTC), *fch = fl_at(dt, a->fch, l * 4 * BTC);
        void *fch_gelu = fl_at(dt, a->fch_gelu, l * 4 * BTC);
        void *residual3 = fl_at(dt, a->residual3, l * BTC);
        FWD(FL_OP_LAYERNORM, layernorm_forward(dt, ln1, a->ln1_mean + l * BT, a->ln1_rstd + l * BT,
                                               residual, w->ln1w, w->ln1b, BT, C));
        MM_FWD(FL_OP_MM_QKV, BT, C, 3 * C,
               matmul_forward(dt, qkv, ln1, w->qkvw, w->qkvb, mm_ws, BT, C, 3 * C));
        FWD(FL_OP_ATTENTION, attention_forward(dt, atty, a->att_lse + l * BT * NH, qkv,
                                               model->att_workspace, B, T, C, NH));
        // The projection is written straight into residual2 and the skip
        // connection added in place: its output is not needed by the backward.
        MM_FWD(FL_OP_MM_ATTPROJ, BT, C, C,
               matmul_forward(dt, residual2, atty, w->attprojw, w->attprojb, mm_ws, BT, C, C));
        FWD(FL_OP_RESIDUAL, residual_forward(dt, residual2, residual, residual2, BTC));
        FWD(FL_OP_LAYERNORM, layernorm_forward(dt, ln2, a->ln2_mean + l * BT, a->ln2_rstd + l * BT,
                                               residual2, w->ln2w, w->ln2b, BT, C));
        MM_FWD(FL_OP_MM_FC, BT, C, 4 * C,
               matmul_forward(dt, fch, ln2, w->fcw, w->fcb, mm_ws, BT, C, 4 * C));
        FWD(FL_OP_GELU, gelu_forward(dt, fch_gelu, fch, 4 * BTC));
        MM_FWD(
            FL_OP_MM_FCPROJ, BT, 4 * C, C,
            matmul_forward(dt, residual3, fch_gelu, w->fcprojw, w->fcprojb, mm_ws, BT, 4 * C, C));
        FWD(FL_OP_RESIDUAL, residual_forward(dt, residual3, residual2, residual3, BTC));
    }
    void *last = fl_at(dt, a->residual3, (L - 1) * BTC);
    FWD(FL_OP_LAYERNORM, layernorm_forward(dt, a->lnf, a->lnf_mean, a->lnf_rstd, last,
                                           model->w.lnfw, model->w.lnfb, BT, C));
    MM_FWD(FL_OP_MM_LMHEAD, BT, C, Vp, // tied LM head
           matmul_forward(dt, a->logits, a->lnf, model->w.wte, NULL, mm_ws, BT, C, Vp));

    model->loss = -1.0f;
    model->n_targets = 0;
    if (!targets) return model->loss;
    memcpy(model->targets, targets, BT * sizeof(int));
    FWD(FL_OP_XENT,
        softmax_xent_forward(dt, a->losses, a->xent_lse, a->logits, targets, BT, V, Vp));
    double sum = 0.0; // fixed order: deterministic
    for (size_t i = 0; i < BT; i++) {
        if (targets[i] == -1) continue;
        sum += a->losses[i];
        model->n_targets++;
    }
    model->loss = model->n_targets ? (float)(sum / model->n_targets) : 0.0f;
    return model->loss;
}

// ----------------------------------------------------------------------------
// backward

void fl_gpt2_zero_grad(fl_gpt2 *model) {
    memset(model->grads, 0, model->table.numel * fl_dtype_size(model->dtype));
}

static void grad_ready(fl_gpt2 *model, int first_view, int count) {
    if (!model->grad_hook) return;
    for (int i = first_view + count - 1; i >= first_view; i--)
        model->grad_hook(model->grad_hook_ctx, i);
}

void fl_gpt2_backward(fl_gpt2 *model, float loss_scale) {
    const fl_gpt2_config *c = &model->config;
    if (model->loss < 0.0f) fl_die("internal: fl_gpt2_backward needs a forward with targets");
    int B = model->B, T = model->T, L = c->n_layer, C = c->n_embd, NH = c->n_head,
        V = c->vocab_size, Vp = c->padded_vocab_size;
    fl_dtype dt = model->dtype;
    size_t BT = (size_t)B * T, BTC = BT * C, D = fl_dtype_size(dt);
    fl_gpt2_acts *a = &model->acts;
    fl_gpt2_weights *w = &model->w, *g = &model->g;
    void *mm_ws = model->matmul_workspace;

    // d(mean loss)/d(loss_i) = 1/n over the positions that have a target
    float d = model->n_targets ? loss_scale / model->n_targets : 0.0f;
    for (size_t i = 0; i < BT; i++) model->dlosses[i] = d;
    void *dlogits = a->logits; // overwritten in place by its own gradient
    BWD(FL_OP_XENT, softmax_xent_backward(dt, dlogits, a->logits, a->xent_lse, model->targets,
                                          model->dlosses, BT, V, Vp));

    void *dres = model->dres, *dbuf = model->dbuf_c;
    memset(dbuf, 0, BTC * D);
    MM_BWD(FL_OP_MM_LMHEAD, BT, C, Vp,
           matmul_backward(dt, dbuf, g->wte, NULL, dlogits, a->lnf, w->wte, mm_ws, BT, C, Vp));
    memset(dres, 0, BTC * D);
    BWD(FL_OP_LAYERNORM,
        layernorm_backward(dt, dres, g->lnfw, g->lnfb, dbuf, fl_at(dt, a->residual3, (L - 1) * BTC),
                           w->lnfw, a->lnf_mean, a->lnf_rstd, BT, C));
    grad_ready(model, VIEWS_BEFORE_LAYERS + L * VIEWS_PER_LAYER, 2);

    // dres holds the gradient of the residual stream, walking back through
    // the layers; each residual add passes it through unchanged.
    for (int l = L - 1; l >= 0; l--) {
        const fl_gpt2_layer *lw = &w->h[l];
        fl_gpt2_layer *lg = &g->h[l];
        void *residual = l == 0 ? a->encoded : fl_at(dt, a->residual3, (l - 1) * BTC);
        void *ln1 = fl_at(dt, a->ln1, l * BTC), *qkv = fl_at(dt, a->qkv, l * 3 * BTC);
        void *atty = fl_at(dt, a->atty, l * BTC), *residual2 = fl_at(dt, a->residual2, l * BTC);
        void *ln2 = fl_at(dt, a->ln2, l * BTC), *fch = fl_at(dt, a->fch, l * 4 * BTC);
        void *fch_gelu = fl_at(dt, a->fch_gelu, l * 4 * BTC);
        void *d4a = model->dbuf_4c_a, *d4b = model->dbuf_4c_b;

        // MLP: residual3 = residual2 + fcproj(gelu(fc(ln2(residual2))))
        memset(d4a, 0, 4 * BTC * D);
        MM_BWD(FL_OP_MM_FCPROJ, BT, 4 * C, C,
               matmul_backward(dt, d4a, lg->fcprojw, lg->fcprojb, dres, fch_gelu, lw->fcprojw,
                               mm_ws, BT, 4 * C, C));
        memset(d4b, 0, 4 * BTC * D);
        BWD(FL_OP_GELU, gelu_backward(dt, d4b, fch, d4a, 4 * BTC));
        memset(dbuf, 0, BTC * D);
        MM_BWD(FL_OP_MM_FC, BT, C, 4 * C,
               matmul_backward(dt, dbuf, lg->fcw, lg->fcb, d4b, ln2, lw->fcw, mm_ws, BT, C, 4 * C));
        BWD(FL_OP_LAYERNORM,
            layernorm_backward(dt, dres, lg->ln2w, lg->ln2b, dbuf, residual2, lw->ln2w,
                               a->ln2_mean + l * BT, a->ln2_rstd + l * BT, BT, C));

        // attention: residual2 = residual + attproj(attn(qkv(ln1(residual))))
        memset(dbuf, 0, BTC * D);
        MM_BWD(FL_OP_MM_ATTPROJ, BT, C, C,
               matmul_backward(dt, dbuf, lg->attprojw, lg->attprojb, dres, atty, lw->attprojw,
                               mm_ws, BT, C, C));
        memset(d4a, 0, 3 * BTC * D);
        BWD(FL_OP_ATTENTION, attention_backward(dt, d4a, dbuf, qkv, atty, a->att_lse + l * BT * NH,
                                                model->att_workspace, B, T, C, NH));
        memset(dbuf, 0, BTC * D);
        MM_BWD(
            FL_OP_MM_QKV, BT, C, 3 * C,
            matmul_backward(dt, dbuf, lg->qkvw, lg->qkvb, d4a, ln1, lw->qkvw, mm_ws, BT, C, 3 * C));
        BWD(FL_OP_LAYERNORM,
            layernorm_backward(dt, dres, lg->ln1w, lg->ln1b, dbuf, residual, lw->ln1w,
                               a->ln1_mean + l * BT, a->ln1_rstd + l * BT, BT, C));
        grad_ready(model, VIEWS_BEFORE_LAYERS + l * VIEWS_PER_LAYER, VIEWS_PER_LAYER);
    }
    // wte is complete only now: it also received the LM head's gradient.
    BWD(FL_OP_ENCODER, encoder_backward(dt, g->wte, g->wpe, dres, model->inputs, B, T, C));
    grad_ready(model, 0, VIEWS_BEFORE_LAYERS);
}
