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

size_t fl_gpt2_num_params(const fl_gpt2_config *cfg) {
    fl_gpt2_config c = *cfg;
    fl_gpt2_config_finish(&c);
    fl_param_table t = {0};
    build_table(&t, &c);
    size_t n = t.numel;
    fl_params_free(&t);
    return n;
}

enum { VIEWS_BEFORE_LAYERS = 2, VIEWS_PER_LAYER = 12 };

// Points the weights struct at a flat buffer (params or grads), following
// the table order of build_table.
static void bind_weights(fl_gpt2_weights *w, const fl_param_table *t, float *base, int L) {
    const fl_param_view *v = t->views;
    w->wte = base + v[0].offset;
    w->wpe = base + v[1].offset;
    for (int l = 0; l < L; l++) {
        const fl_param_view *lv = v + VIEWS_BEFORE_LAYERS + l * VIEWS_PER_LAYER;
        float **slots[VIEWS_PER_LAYER] = {&w->h[l].ln1w, &w->h[l].ln1b,     &w->h[l].qkvw,
                                          &w->h[l].qkvb, &w->h[l].attprojw, &w->h[l].attprojb,
                                          &w->h[l].ln2w, &w->h[l].ln2b,     &w->h[l].fcw,
                                          &w->h[l].fcb,  &w->h[l].fcprojw,  &w->h[l].fcprojb};
        for (int i = 0; i < VIEWS_PER_LAYER; i++) *slots[i] = base + lv[i].offset;
    }
    const fl_param_view *f = v + VIEWS_BEFORE_LAYERS + L * VIEWS_PER_LAYER;
    w->lnfw = base + f[0].offset;
    w->lnfb = base + f[1].offset;
}

void fl_gpt2_init(fl_gpt2 *model, const fl_gpt2_config *cfg, uint64_t seed) {
    memset(model, 0, sizeof *model);
    model->config = *cfg;
    fl_gpt2_config_finish(&model->config);
    const fl_gpt2_config *c = &model->config;
    build_table(&model->table, c);
    size_t bytes = model->table.numel * sizeof(float);
    model->params = fl_alloc(FL_MEM_PARAMS, bytes);
    model->grads = fl_alloc(FL_MEM_GRADS, bytes);
    model->w.h = fl_alloc(FL_MEM_OTHER, c->n_layer * sizeof(fl_gpt2_layer));
    model->g.h = fl_alloc(FL_MEM_OTHER, c->n_layer * sizeof(fl_gpt2_layer));
    bind_weights(&model->w, &model->table, model->params, c->n_layer);
    bind_weights(&model->g, &model->table, model->grads, c->n_layer);

    // GPT-2 initialisation: N(0, 0.02) for matrices and embeddings, with the
    // projections into the residual stream scaled by 1/sqrt(2L) since L
    // blocks each add two of them to it.
    fl_rng rng;
    fl_rng_seed(&rng, seed);
    float resid_std = 0.02f / sqrtf(2.0f * c->n_layer);
    for (int i = 0; i < model->table.count; i++) {
        const fl_param_view *v = &model->table.views[i];
        float *p = model->params + v->offset;
        size_t n = v->numel;
        if (strstr(v->name, "ln_") && strstr(v->name, ".weight")) {
            for (size_t j = 0; j < n; j++) p[j] = 1.0f;
        } else if (v->ndim == 2) {
            float std = strstr(v->name, "c_proj.weight") ? resid_std : 0.02f;
            if (i == 0) n = (size_t)c->vocab_size * c->n_embd; // padded rows stay 0
            for (size_t j = 0; j < n; j++) p[j] = std * fl_rng_normal(&rng);
        } // biases stay 0
    }
}

// ----------------------------------------------------------------------------
// activations

void fl_gpt2_alloc_acts(fl_gpt2 *model, int B, int T) {
    const fl_gpt2_config *c = &model->config;
    if (B <= 0 || T <= 0)
        fl_die("batch size and sequence length must be positive (B=%d, T=%d)", B, T);
    if (T > c->max_seq_len)
        fl_die("sequence length %d exceeds the model's max_seq_len %d", T, c->max_seq_len);
    FL_ASSERT(model->max_B == 0); // allocated once, up front
    size_t L = c->n_layer, C = c->n_embd, NH = c->n_head, Vp = c->padded_vocab_size;
    size_t BT = (size_t)B * T;
    fl_gpt2_acts *a = &model->acts;
#define ACT(field, count) a->field = fl_alloc(FL_MEM_ACTS, (count) * sizeof(float))
    ACT(encoded, BT * C);
    ACT(ln1, L * BT * C);
    ACT(ln1_mean, L * BT);
    ACT(ln1_rstd, L * BT);
    ACT(qkv, L * BT * 3 * C);
    ACT(atty, L * BT * C);
    ACT(att_lse, L * B * NH * T);
    ACT(residual2, L * BT * C);
    ACT(ln2, L * BT * C);
    ACT(ln2_mean, L * BT);
    ACT(ln2_rstd, L * BT);
    ACT(fch, L * BT * 4 * C);
    ACT(fch_gelu, L * BT * 4 * C);
    ACT(residual3, L * BT * C);
    ACT(lnf, BT * C);
    ACT(lnf_mean, BT);
    ACT(lnf_rstd, BT);
    ACT(logits, BT * Vp);
    ACT(losses, BT);
    ACT(xent_lse, BT);
#undef ACT
#define WS(field, count) model->field = fl_alloc(FL_MEM_WORKSPACE, (count) * sizeof(float))
    WS(dres, BT * C);
    WS(dbuf_c, BT * C);
    WS(dbuf_4c_a, BT * 4 * C);
    WS(dbuf_4c_b, BT * 4 * C);
    WS(dlosses, BT);
    WS(att_workspace, attention_workspace_floats(T, C / NH) * (size_t)fl_threads());
#undef WS
    model->att_workspace_threads = fl_threads();
    model->inputs = fl_alloc(FL_MEM_ACTS, BT * sizeof(int));
    model->targets = fl_alloc(FL_MEM_ACTS, BT * sizeof(int));
    model->max_B = B;
    model->max_T = T;
}

void fl_gpt2_free(fl_gpt2 *model) {
    fl_gpt2_acts *a = &model->acts;
    float *bufs[] = {a->encoded,       a->ln1,
                     a->ln1_mean,      a->ln1_rstd,
                     a->qkv,           a->atty,
                     a->att_lse,       a->residual2,
                     a->ln2,           a->ln2_mean,
                     a->ln2_rstd,      a->fch,
                     a->fch_gelu,      a->residual3,
                     a->lnf,           a->lnf_mean,
                     a->lnf_rstd,      a->logits,
                     a->losses,        a->xent_lse,
                     model->dres,      model->dbuf_c,
                     model->dbuf_4c_a, model->dbuf_4c_b,
                     model->dlosses,   model->att_workspace,
                     model->params,    model->grads};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) fl_free(bufs[i]);
    fl_free(model->inputs);
    fl_free(model->targets);
    fl_free(model->w.h);
    fl_free(model->g.h);
    fl_params_free(&model->table);
    memset(model, 0, sizeof *model);
}

// ----------------------------------------------------------------------------
// forward

float fl_gpt2_forward(fl_gpt2 *model, const int *tokens, const int *targets, int B, int T) {
    const fl_gpt2_config *c = &model->config;
    if (model->max_B == 0) fl_die("internal: fl_gpt2_forward before fl_gpt2_alloc_acts");
    if (B > model->max_B || T > model->max_T)
        fl_die("internal: batch %dx%d exceeds the allocated %dx%d", B, T, model->max_B,
               model->max_T);
    int L = c->n_layer, C = c->n_embd, NH = c->n_head, V = c->vocab_size, Vp = c->padded_vocab_size;
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
    encoder_forward(a->encoded, tokens, model->w.wte, model->w.wpe, B, T, C);
    for (int l = 0; l < L; l++) {
        const fl_gpt2_layer *w = &model->w.h[l];
        float *residual = l == 0 ? a->encoded : a->residual3 + (l - 1) * BTC;
        float *ln1 = a->ln1 + l * BTC, *qkv = a->qkv + l * 3 * BTC, *atty = a->atty + l * BTC;
        float *residual2 = a->residual2 + l * BTC, *ln2 = a->ln2 + l * BTC;
        float *fch = a->fch + l * 4 * BTC, *fch_gelu = a->fch_gelu + l * 4 * BTC;
        float *residual3 = a->residual3 + l * BTC;
        layernorm_forward(ln1, a->ln1_mean + l * BT, a->ln1_rstd + l * BT, residual, w->ln1w,
                          w->ln1b, BT, C);
        matmul_forward(qkv, ln1, w->qkvw, w->qkvb, BT, C, 3 * C);
        attention_forward(atty, a->att_lse + l * BT * NH, qkv, model->att_workspace, B, T, C, NH);
        // The projection is written straight into residual2 and the skip
        // connection added in place: its output is not needed by the backward.
        matmul_forward(residual2, atty, w->attprojw, w->attprojb, BT, C, C);
        residual_forward(residual2, residual, residual2, BTC);
        layernorm_forward(ln2, a->ln2_mean + l * BT, a->ln2_rstd + l * BT, residual2, w->ln2w,
                          w->ln2b, BT, C);
        matmul_forward(fch, ln2, w->fcw, w->fcb, BT, C, 4 * C);
        gelu_forward(fch_gelu, fch, 4 * BTC);
        matmul_forward(residual3, fch_gelu, w->fcprojw, w->fcprojb, BT, 4 * C, C);
        residual_forward(residual3, residual2, residual3, BTC);
    }
    float *last = a->residual3 + (L - 1) * BTC;
    layernorm_forward(a->lnf, a->lnf_mean, a->lnf_rstd, last, model->w.lnfw, model->w.lnfb, BT, C);
    matmul_forward(a->logits, a->lnf, model->w.wte, NULL, BT, C, Vp); // tied LM head

    model->loss = -1.0f;
    model->n_targets = 0;
    if (!targets) return model->loss;
    memcpy(model->targets, targets, BT * sizeof(int));
    softmax_xent_forward(a->losses, a->xent_lse, a->logits, targets, BT, V, Vp);
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
    memset(model->grads, 0, model->table.numel * sizeof(float));
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
    size_t BT = (size_t)B * T, BTC = BT * C;
    fl_gpt2_acts *a = &model->acts;
    fl_gpt2_weights *w = &model->w, *g = &model->g;

    // d(mean loss)/d(loss_i) = 1/n over the positions that have a target
    float d = model->n_targets ? loss_scale / model->n_targets : 0.0f;
    for (size_t i = 0; i < BT; i++) model->dlosses[i] = d;
    float *dlogits = a->logits; // overwritten in place by its own gradient
    softmax_xent_backward(dlogits, a->logits, a->xent_lse, model->targets, model->dlosses, BT, V,
                          Vp);

    float *dres = model->dres, *dbuf = model->dbuf_c;
    memset(dbuf, 0, BTC * sizeof(float));
    matmul_backward(dbuf, g->wte, NULL, dlogits, a->lnf, w->wte, BT, C, Vp);
    memset(dres, 0, BTC * sizeof(float));
    layernorm_backward(dres, g->lnfw, g->lnfb, dbuf, a->residual3 + (L - 1) * BTC, w->lnfw,
                       a->lnf_mean, a->lnf_rstd, BT, C);
    grad_ready(model, VIEWS_BEFORE_LAYERS + L * VIEWS_PER_LAYER, 2);

    // dres holds the gradient of the residual stream, walking back through
    // the layers; each residual add passes it through unchanged.
    for (int l = L - 1; l >= 0; l--) {
        const fl_gpt2_layer *lw = &w->h[l];
        fl_gpt2_layer *lg = &g->h[l];
        float *residual = l == 0 ? a->encoded : a->residual3 + (l - 1) * BTC;
        float *ln1 = a->ln1 + l * BTC, *qkv = a->qkv + l * 3 * BTC, *atty = a->atty + l * BTC;
        float *residual2 = a->residual2 + l * BTC, *ln2 = a->ln2 + l * BTC;
        float *fch = a->fch + l * 4 * BTC, *fch_gelu = a->fch_gelu + l * 4 * BTC;
        float *d4a = model->dbuf_4c_a, *d4b = model->dbuf_4c_b;

        // MLP: residual3 = residual2 + fcproj(gelu(fc(ln2(residual2))))
        memset(d4a, 0, 4 * BTC * sizeof(float));
        matmul_backward(d4a, lg->fcprojw, lg->fcprojb, dres, fch_gelu, lw->fcprojw, BT, 4 * C, C);
        memset(d4b, 0, 4 * BTC * sizeof(float));
        gelu_backward(d4b, fch, d4a, 4 * BTC);
        memset(dbuf, 0, BTC * sizeof(float));
        matmul_backward(dbuf, lg->fcw, lg->fcb, d4b, ln2, lw->fcw, BT, C, 4 * C);
        layernorm_backward(dres, lg->ln2w, lg->ln2b, dbuf, residual2, lw->ln2w,
                           a->ln2_mean + l * BT, a->ln2_rstd + l * BT, BT, C);

        // attention: residual2 = residual + attproj(attn(qkv(ln1(residual))))
        memset(dbuf, 0, BTC * sizeof(float));
        matmul_backward(dbuf, lg->attprojw, lg->attprojb, dres, atty, lw->attprojw, BT, C, C);
        memset(d4a, 0, 3 * BTC * sizeof(float));
        attention_backward(d4a, dbuf, qkv, atty, a->att_lse + l * BT * NH, model->att_workspace, B,
                           T, C, NH);
        memset(dbuf, 0, BTC * sizeof(float));
        matmul_backward(dbuf, lg->qkvw, lg->qkvb, d4a, ln1, lw->qkvw, BT, C, 3 * C);
        layernorm_backward(dres, lg->ln1w, lg->ln1b, dbuf, residual, lw->ln1w, a->ln1_mean + l * BT,
                           a->ln1_rstd + l * BT, BT, C);
        grad_ready(model, VIEWS_BEFORE_LAYERS + l * VIEWS_PER_LAYER, VIEWS_PER_LAYER);
    }
    // wte is complete only now: it also received the LM head's gradient.
    encoder_backward(g->wte, g->wpe, dres, model->inputs, B, T, C);
    grad_ready(model, 0, VIEWS_BEFORE_LAYERS);
}
