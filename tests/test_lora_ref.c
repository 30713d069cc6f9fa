// test_lora_ref.c: LoRA adapters (PEFT semantics) against a PyTorch
// reference, on the tiny LLaMA (q_proj, v_proj; r 4, alpha 8) and the tiny
// GPT-2 (c_attn, a Conv1D in transformers, PEFT's fan_in_fan_out; r 2,
// alpha 4): the adapter table and the frozen base, forward, the adapters'
// gradients, the merged weights and a plain model loaded with them, the
// gradients under activation checkpointing, bf16, AdamW steps of the
// adapters alone, and rsLoRA's scaling.
//
// The references are tests/fixtures/lora_llama_tiny.bin and
// lora_gpt2_tiny.bin, written by scripts/make_lora_reference.py (run it with
// /usr/bin/python3, which has torch; its docstring describes the records and
// the PEFT definitions it follows). The base weights and batch are those of
// llama_tiny.bin and gpt2_tiny.bin (with some targets -1), and the adapters
// are drawn with B != 0, so lora_A's gradient is not zero. The fixtures use
// testref.h's format; the adapter records are named as PEFT saves them
// (fl_lora_peft_name), so they are read here rather than by fx_validate.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/lora.h"
#include "fitlm/model.h"
#include "fitlm/optim.h"
#include "fitlm/train.h"
#include "testlib.h"
#include "testref.h"

// fp32 tolerances: test_llama_ref.c's, for the same reason (the engine's
// float32 rounding against the float64 reference rounded once).
// LOGITS_ATOL 5e-6, LOGITS_RTOL 1e-5 (testref.h).
#define LOSS_ATOL      1e-5
#define GRAD_ATOL      1e-6 // adapter gradients up to ~0.2
#define GRAD_RTOL      1e-4
#define STEP_LOSS_ATOL 1e-5
#define NORM_RTOL      1e-5
#define FINAL_ATOL     2e-5
#define FINAL_RTOL     1e-4
// W + scaling * B @ A in fp32: a sum of r <= 4 products and one addition,
// a few float32 ulps of values up to ~0.6.
#define MERGED_ATOL 1e-6
// The bound: a plain model with the merged weights gives the
// adapted model's logits within 1e-5 (fp32).
#define MERGE_LOGITS_ATOL 1e-5
// bf16: weights, adapters and activations are rounded to 8 significant
// bits (unit roundoff u = 2^-9) at every store, so a tensor ends up off by
// some u relative to its own scale: the checks are |diff| <= REL * max|ref|
// of the tensor (llm.c's bf16 test uses a relative 0.079). Observed on
// these fixtures (LLaMA / GPT-2): logits 2^-6.8 / 2^-7.0 of max|ref| (~2),
// adapter gradients at worst 2^-5.2 / 2^-5.0 (they go through more bf16
// stores), the loss 2.4e-6 / 1.1e-3. Each bound keeps a margin of 4x or
// more, yet the adapters' effect is far outside it: without them the
// logits move by up to 2.4 / 0.7 and the loss by 6e-2 / 3e-2.
#define BF16_LOGITS_REL 0x1p-4
#define BF16_GRAD_REL   0x1p-3
#define BF16_LOSS       1e-2

typedef struct {
    const char *path;
    const char *targets; // target_modules the fixture was made with
    fixture fx;
    fx_config c;
    unsigned char *data;
    fl_lora_config lc;
    float scaling;
    int n_adapters; // param/base_model.* records
    int *tokens, *targets_ids;
} lora_case;

// ----------------------------------------------------------------------------
// the fixture

// The config records (testref.h's, plus "lora" [r, use_rslora] and
// "lora_f" [lora_alpha, scaling]); 0 with a failed t_check if damaged.
static int read_config(lora_case *k) {
    fixture *fx = &k->fx;
    fx_config *c = &k->c;
    const fx_record *cr = fx_find(fx, "config");
    if (!t_check(cr && cr->dtype == FX_I32 && (cr->numel == 8 || cr->numel == 11),
                 "%s: record 'config' missing or not 8 / 11 ints", k->path))
        return 0;
    int *v = fx_ints(fx, "config");
    memset(c, 0, sizeof *c);
    // in record order; GPT-2 has no NKV, I and tie (NH, 4C and tied)
    int llama = cr->numel == 11, *p = v;
    c->arch = llama ? FL_ARCH_LLAMA : FL_ARCH_GPT2;
    c->maxT = *p++, c->V = *p++, c->L = *p++, c->NH = *p++;
    c->NKV = llama ? *p++ : c->NH;
    c->C = *p++;
    c->I = llama ? *p++ : 4 * c->C;
    c->B = *p++, c->T = *p++, c->steps = *p++;
    c->tie = llama ? *p : 1;
    free(v);
    uint64_t two = 2, six = 6, steps = (uint64_t)c->steps,
             bt[3] = {(uint64_t)c->B, (uint64_t)c->T, (uint64_t)c->V};
    int ok = (c->arch == FL_ARCH_GPT2 || fx_expect(fx, "config_f", FX_F32, 1, &two)) &&
             fx_expect(fx, "lora", FX_I32, 1, &two) && fx_expect(fx, "lora_f", FX_F32, 1, &two) &&
             fx_expect(fx, "adamw", FX_F32, 1, &six) && fx_expect(fx, "tokens", FX_I32, 2, bt) &&
             fx_expect(fx, "targets", FX_I32, 2, bt) && fx_expect(fx, "logits", FX_F32, 3, bt) &&
             fx_expect(fx, "loss", FX_F32, 1, (uint64_t[]){1}) &&
             fx_expect(fx, "step_losses", FX_F32, 1, &steps) &&
             fx_expect(fx, "step_grad_norms", FX_F32, 1, &steps);
    if (!t_check(ok, "%s: %s", k->path, fx->err)) return 0;
    if (c->arch == FL_ARCH_LLAMA) {
        float *f = fx_floats(fx, "config_f");
        c->norm_eps = f[0], c->rope_theta = f[1];
        free(f);
    }
    float *a = fx_floats(fx, "adamw"), *lf = fx_floats(fx, "lora_f");
    int *li = fx_ints(fx, "lora");
    c->lr = a[0], c->beta1 = a[1], c->beta2 = a[2], c->eps = a[3], c->weight_decay = a[4],
    c->max_grad_norm = a[5];
    fl_lora_config_defaults(&k->lc);
    k->lc.r = li[0];
    k->lc.use_rslora = li[1];
    k->lc.alpha = lf[0];
    k->scaling = lf[1];
    snprintf(k->lc.target_modules, sizeof k->lc.target_modules, "%s", k->targets);
    free(a), free(lf), free(li);
    k->n_adapters = 0;
    for (int i = 0; i < fx->n; i++)
        k->n_adapters += strncmp(fx->recs[i].name, "param/base_model.", 17) == 0;
    k->tokens = fx_ints(fx, "tokens");
    k->targets_ids = fx_ints(fx, "targets");
    return 1;
}

static int load_case(lora_case *k) {
    size_t n;
    k->data = t_read_file(t_source_path(k->path), &n);
    if (!t_check(k->data != NULL,
                 "cannot read %s (regenerate it with /usr/bin/python3 "
                 "scripts/make_lora_reference.py)",
                 k->path))
        return 0;
    if (!t_check(fx_parse(&k->fx, k->data, n), "%s: %s", k->path, k->fx.err) || !read_config(k))
        return 0;
    printf("fixture %s: %zu bytes, %d records, %d adapter tensors\n", k->path, n, k->fx.n,
           k->n_adapters);
    return 1;
}

// The record `prefix`<name> with a table row's shape (dimension 0 may be
// shorter: the vocabulary rows, V of Vp); NULL with a failed t_check.
static const fx_record *row_record(lora_case *k, const char *prefix, const char *name,
                                   const fl_param_view *v) {
    char full[FX_MAX_NAME + 1];
    snprintf(full, sizeof full, "%s%s", prefix, name);
    const fx_record *r = fx_find(&k->fx, full);
    int ok = r && r->dtype == FX_F32 && (int)r->ndim == v->ndim && r->numel <= v->numel;
    for (int d = 1; ok && d < v->ndim; d++) ok = r->shape[d] == v->shape[d];
    t_check(ok, "%s: record '%s' missing or not of the row's shape", k->path, full);
    return ok ? r : NULL;
}

// The PEFT name of adapter row i.
static void peft_name(const fl_model *m, int i, char *out, size_t size) {
    fl_lora_peft_name(&m->config, m->lora.table.views[i].name, out, size);
}

// The fixture's base weights (param/<name>) in the table's layout, fp32,
// the padded vocabulary rows zero: table.numel floats, malloc'd.
static float *base_f32(const fl_model *m, lora_case *k) {
    float *w = calloc(m->table.numel, sizeof(float));
    for (int i = 0; i < m->table.count; i++) {
        const fl_param_view *v = &m->table.views[i];
        const fx_record *r = row_record(k, "param/", v->name, v);
        FL_ASSERT(r);
        float *x = fx_copy(&k->fx, r);
        memcpy(w + v->offset, x, r->numel * sizeof(float));
        free(x);
    }
    return w;
}

// Every base row from w (table.numel floats), rounded to the model's dtype.
static void store_base(fl_model *m, const float *w) {
    for (int i = 0; i < m->table.count; i++)
        fl_model_store_row(m, i, 0, w + m->table.views[i].offset, m->table.views[i].numel);
}

// The fixture's initial adapters (param/<PEFT name>), rounded to the model's dtype.
static void load_adapters(fl_model *m, lora_case *k) {
    for (int i = 0; i < m->lora.table.count; i++) {
        const fl_param_view *v = &m->lora.table.views[i];
        char name[FX_MAX_NAME + 1];
        peft_name(m, i, name, sizeof name);
        const fx_record *r = row_record(k, "param/", name, v);
        FL_ASSERT(r && r->numel == v->numel);
        float *x = fx_copy(&k->fx, r);
        fl_store_f32(m->dtype, fl_at(m->dtype, m->lora.params, v->offset), x, v->numel);
        free(x);
    }
}

// A model of the fixture's shape in dtype dt with its base weights, the
// adapters of the fixture (lora: 1) or none, activations under `policy`.
static void make_model(fl_model *m, lora_case *k, fl_dtype dt, fl_recompute policy, int lora,
                       const fl_lora_config *lc) {
    fl_model_config cfg = fx_make_config(&k->c);
    memset(m, 0, sizeof *m);
    fl_model_init(m, &cfg, dt, 1);
    float *w = base_f32(m, k);
    store_base(m, w);
    free(w);
    if (lora) {
        fl_model_add_lora(m, lc ? lc : &k->lc, 7);
        load_adapters(m, k);
    }
    fl_model_alloc_acts(m, k->c.B, k->c.T, policy, 0);
}

// The logits (B,T,V) of the last forward as fp32, without the padded
// columns; malloc'd.
static float *logits_f32(const fl_model *m) {
    size_t BT = (size_t)m->B * m->T, V = (size_t)m->config.vocab_size,
           Vp = (size_t)m->config.padded_vocab_size;
    float *out = malloc(BT * V * sizeof(float));
    for (size_t i = 0; i < BT; i++)
        fl_convert(FL_F32, out + i * V, m->dtype, fl_at_const(m->dtype, m->logits, i * Vp), V);
    return out;
}

// Forward, then (with adapters) the backward of d(mean loss) into zeroed
// adapter gradients; returns the logits (logits_f32), taken before the
// backward overwrites them with their gradient.
static float *run(fl_model *m, lora_case *k) {
    fl_model_forward(m, k->tokens, k->targets_ids, k->c.B, k->c.T);
    float *logits = logits_f32(m);
    if (m->lora.cfg.r > 0) {
        memset(m->lora.grads, 0, m->lora.table.numel * fl_dtype_size(m->dtype));
        fl_model_backward(m, 1.0f / m->n_targets);
    }
    return logits;
}

// A flat adapter buffer (params or grads) as fp32; malloc'd.
static float *adapters_f32(const fl_model *m, const void *buf) {
    float *out = malloc(m->lora.table.numel * sizeof(float));
    fl_convert(FL_F32, out, m->dtype, buf, m->lora.table.numel);
    return out;
}

static double max_abs(const float *x, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs((double)x[i]));
    return m;
}

// Compares an adapter buffer row by row with `prefix`<peft name>; rel > 0:
// the bf16 check (atol rel * max|ref| of the row, the names marked "bf16")
// instead of atol, rtol.
static void compare_adapters(const fl_model *m, lora_case *k, const void *buf, const char *prefix,
                             double atol, double rtol, double rel) {
    float *got = adapters_f32(m, buf);
    for (int i = 0; i < m->lora.table.count; i++) {
        const fl_param_view *v = &m->lora.table.views[i];
        char name[FX_MAX_NAME + 1], full[FX_MAX_NAME + 8], label[FX_MAX_NAME + 16];
        peft_name(m, i, name, sizeof name);
        snprintf(full, sizeof full, "%s%s", prefix, name);
        snprintf(label, sizeof label, "%s%s", rel > 0 ? "bf16 " : "", full);
        float *want = fx_floats(&k->fx, full);
        if (rel > 0) atol = rel * max_abs(want, v->numel), rtol = 0;
        t_close(label, got + v->offset, want, v->numel, atol, rtol);
        free(want);
    }
    free(got);
}

// ----------------------------------------------------------------------------
// the checks

// The adapter table: one A (r, in) and B (out, r) per fixture adapter,
// trainable and decayed; the base frozen with no gradient buffer; the
// scaling; target_modules "" (the architecture's default) gives the same rows.
static void check_table(const fl_model *m, lora_case *k) {
    const fl_param_table *t = &m->lora.table;
    t_check(t->count == k->n_adapters, "%d adapter rows, the fixture has %d", t->count,
            k->n_adapters);
    for (int i = 0; i < t->count; i++) {
        const fl_param_view *v = &t->views[i];
        char name[FX_MAX_NAME + 1];
        peft_name(m, i, name, sizeof name);
        const fx_record *r = row_record(k, "param/", name, v);
        t_check(!r || r->numel == v->numel, "adapter row %s: %zu values, the fixture's %zu",
                v->name, v->numel, r ? r->numel : 0);
        t_check(!(v->flags & FL_PARAM_FROZEN) && (v->flags & FL_PARAM_DECAY),
                "adapter row %s: trainable and decayed (as the reference's AdamW)", v->name);
    }
    int frozen = 0;
    for (int i = 0; i < m->table.count; i++)
        frozen += !!(m->table.views[i].flags & FL_PARAM_FROZEN);
    t_check(frozen == m->table.count, "%d of %d base rows flagged FL_PARAM_FROZEN", frozen,
            m->table.count);
    t_check(m->grads == NULL, "the frozen base has a gradient buffer");
    t_check(m->lora.grads != NULL, "no adapter gradient buffer");
    t_check(m->lora.scaling == k->scaling, "scaling %g, want %g", m->lora.scaling, k->scaling);

    fl_lora_config def = k->lc;
    def.target_modules[0] = 0;
    fl_param_table dt = {0};
    fl_lora_table(&dt, &m->table, &m->config, &def, NULL);
    int same = dt.count == t->count;
    for (int i = 0; same && i < t->count; i++)
        same = strcmp(dt.views[i].name, t->views[i].name) == 0;
    t_check(same, "target_modules \"\" (the default) adapts other rows than \"%s\"", k->targets);
    fl_params_free(&dt);
    printf("  %d adapter rows as the fixture's, base frozen without gradients, scaling %g\n",
           t->count, m->lora.scaling);
}

// The loss, the logits (got) and the adapters' gradients of the fp32 model.
static void check_forward_backward(const fl_model *m, lora_case *k, const float *got) {
    float *want = fx_floats(&k->fx, "logits"), *want_loss = fx_floats(&k->fx, "loss");
    size_t n = (size_t)k->c.B * k->c.T * k->c.V;
    t_close("loss", &m->loss, want_loss, 1, LOSS_ATOL, 0);
    t_close("logits", got, want, n, LOGITS_ATOL, LOGITS_RTOL);
    compare_adapters(m, k, m->lora.grads, "grad/", GRAD_ATOL, GRAD_RTOL, 0);
    free(want), free(want_loss);
}

// fl_model_merged_f32 against merged/<row> for the adapted rows and the
// base itself for the others; then a plain model loaded with it must give
// the adapted model's (adapted_logits) within MERGE_LOGITS_ATOL, while the
// base alone does not come near the reference (the adapters matter).
static void check_merged(const fl_model *m, lora_case *k, const float *adapted_logits) {
    float *merged = malloc(m->table.numel * sizeof(float));
    fl_model_merged_f32(m, merged);
    int adapted = 0;
    size_t changed = 0;
    for (int i = 0; i < m->table.count; i++) {
        const fl_param_view *v = &m->table.views[i];
        char full[FX_MAX_NAME + 1];
        snprintf(full, sizeof full, "merged/%s", v->name);
        const fx_record *r = fx_find(&k->fx, full);
        if (r) {
            row_record(k, "merged/", v->name, v);
            float *want = fx_copy(&k->fx, r);
            t_close(full, merged + v->offset, want, r->numel, MERGED_ATOL, 0);
            free(want);
            adapted++;
        } else {
            float *base = malloc(v->numel * sizeof(float));
            fl_model_row_f32(m, i, base);
            changed += memcmp(base, merged + v->offset, v->numel * sizeof(float)) != 0;
            free(base);
        }
    }
    t_check(adapted == m->lora.table.count / 2, "%d merged rows in the fixture, %d adapted",
            adapted, m->lora.table.count / 2);
    t_check(changed == 0, "%zu rows without an adapter changed by the merge", changed);

    fl_model plain;
    make_model(&plain, k, FL_F32, FL_RECOMPUTE_NONE, 0, NULL);
    float *want = fx_floats(&k->fx, "logits"), *base = run(&plain, k);
    size_t n = (size_t)k->c.B * k->c.T * k->c.V,
           outside = fx_count_outside(base, want, n, LOGITS_ATOL, LOGITS_RTOL);
    printf("  the base alone: %zu of %zu logits outside the tolerance\n", outside, n);
    t_check(outside > n / 2, "the adapters hardly change the logits");
    store_base(&plain, merged);
    float *got = run(&plain, k);
    t_close("logits of the merged plain model vs the adapted one", got, adapted_logits, n,
            MERGE_LOGITS_ATOL, 0);
    free(want), free(base), free(got), free(merged);
    fl_model_free(&plain);
}

// Activation checkpointing keeps every adapter gradient: bitwise those of
// no recomputation (PEFT with gradient checkpointing loses them unless the
// inputs require grad; here the recomputed block must re-run its adapters).
static void check_recompute(const fl_model *m0, lora_case *k) {
    static const fl_recompute policy[2] = {FL_RECOMPUTE_SELECTIVE, FL_RECOMPUTE_BLOCK};
    for (int p = 0; p < 2; p++) {
        fl_model m;
        make_model(&m, k, FL_F32, policy[p], 1, NULL);
        free(run(&m, k));
        const float *g = m.lora.grads, *g0 = m0->lora.grads;
        size_t ndiff = 0, zero = 0;
        for (size_t i = 0; i < m.lora.table.numel; i++)
            ndiff += memcmp(&g[i], &g0[i], sizeof(float)) != 0, zero += g[i] == 0.0f;
        t_check(memcmp(&m.loss, &m0->loss, sizeof(float)) == 0, "recompute %s: loss %.9g vs %.9g",
                fl_recompute_name(policy[p]), m.loss, m0->loss);
        t_check(ndiff == 0 && zero == 0,
                "recompute %s: %zu of %zu adapter gradients differ from no recomputation, %zu zero",
                fl_recompute_name(policy[p]), ndiff, m.lora.table.numel, zero);
        if (ndiff == 0)
            printf("  recompute %-9s: loss and all %zu adapter gradients bitwise as without\n",
                   fl_recompute_name(policy[p]), m.lora.table.numel);
        fl_model_free(&m);
    }
}

// c.steps AdamW steps of the adapters through fl_train_step, the base left
// exactly as it was.
static void check_steps(fl_model *m, lora_case *k) {
    const fx_config *c = &k->c;
    fl_optimizer_config oc = {.kind = FL_OPT_ADAMW,
                              .beta1 = c->beta1,
                              .beta2 = c->beta2,
                              .eps = c->eps,
                              .weight_decay = c->weight_decay,
                              .max_grad_norm = c->max_grad_norm,
                              .grad_accum = 1};
    load_adapters(m, k);
    fl_optimizer o;
    fl_optimizer_init(&o, &oc, &m->lora.table, m->dtype, m->lora.params, m->lora.grads);
    float *losses = malloc(c->steps * sizeof(float)), *norms = malloc(c->steps * sizeof(float));
    for (int s = 0; s < c->steps; s++) {
        fl_train_result r = fl_train_step(m, &o, k->tokens, k->targets_ids, 1, c->B, c->T, c->lr);
        losses[s] = r.loss, norms[s] = r.grad_norm;
    }
    fx_check_steps(&k->fx, c, losses, norms, STEP_LOSS_ATOL, NORM_RTOL);
    compare_adapters(m, k, m->lora.params, "final/", FINAL_ATOL, FINAL_RTOL, 0);
    float *want = base_f32(m, k), *got = malloc(m->table.numel * sizeof(float));
    int moved = 0;
    for (int i = 0; i < m->table.count; i++) {
        const fl_param_view *v = &m->table.views[i];
        fl_model_row_f32(m, i, got + v->offset);
        moved += memcmp(got + v->offset, want + v->offset, v->numel * sizeof(float)) != 0;
    }
    t_check(moved == 0, "%d frozen base rows changed by the steps", moved);
    free(want), free(got);
    fl_optimizer_free(&o);
    free(losses), free(norms);
}

// bf16 weights, adapters and activations against the float64 reference.
static void check_bf16(lora_case *k) {
    fl_model m;
    make_model(&m, k, FL_BF16, FL_RECOMPUTE_NONE, 1, NULL);
    float *got = run(&m, k);
    float *want = fx_floats(&k->fx, "logits"), *want_loss = fx_floats(&k->fx, "loss");
    size_t n = (size_t)k->c.B * k->c.T * k->c.V;
    t_close("bf16 loss", &m.loss, want_loss, 1, BF16_LOSS, 0);
    t_close("bf16 logits", got, want, n, BF16_LOGITS_REL * max_abs(want, n), 0);
    compare_adapters(&m, k, m.lora.grads, "grad/", 0, 0, BF16_GRAD_REL);
    free(want), free(want_loss), free(got);
    fl_model_free(&m);
}

// rsLoRA: scaling alpha / sqrt(r) instead of alpha / r. With r 4 and alpha
// 2 * scaling the rsLoRA model has the fixture's scaling, so its forward
// must give the fixture's logits.
static void check_rslora(lora_case *k) {
    fl_lora_config lc;
    fl_lora_config_defaults(&lc);
    lc.r = 8, lc.alpha = 16.0f;
    float plain = fl_lora_scaling(&lc);
    lc.use_rslora = 1;
    float rs = fl_lora_scaling(&lc);
    t_check(plain == 2.0f, "scaling alpha / r: %g, want 2", plain);
    t_check(fabs(rs - 16.0 / sqrt(8.0)) <= 1e-6 * rs, "rslora scaling %.9g, want %.9g", rs,
            16.0 / sqrt(8.0));
    lc = k->lc;
    FL_ASSERT(lc.r == 4);
    lc.use_rslora = 1;
    lc.alpha = 2.0f * k->scaling; // sqrt(4) * scaling
    fl_model m;
    make_model(&m, k, FL_F32, FL_RECOMPUTE_NONE, 1, &lc);
    t_check(m.lora.scaling == k->scaling, "rslora r 4 alpha %g: m.lora.scaling %g, want %g",
            lc.alpha, m.lora.scaling, k->scaling);
    float *got = run(&m, k), *want = fx_floats(&k->fx, "logits");
    t_close("rslora (alpha 2 * scaling, r 4) logits", got, want, (size_t)k->c.B * k->c.T * k->c.V,
            LOGITS_ATOL, LOGITS_RTOL);
    printf("  scaling r 8 alpha 16: %g, rslora %.7f\n", plain, rs);
    free(want), free(got);
    fl_model_free(&m);
}

static void test_case(lora_case *k) {
    if (!load_case(k)) return;
    fl_model m;
    make_model(&m, k, FL_F32, FL_RECOMPUTE_NONE, 1, NULL);
    printf("%s, L=%d C=%d, r %d, alpha %g, targets %s:\n", fl_arch_name(k->c.arch), k->c.L, k->c.C,
           k->lc.r, k->lc.alpha, k->targets);
    check_table(&m, k);
    float *logits = run(&m, k);
    printf("forward and backward (fp32):\n");
    check_forward_backward(&m, k, logits);
    printf("merged weights:\n");
    check_merged(&m, k, logits);
    printf("activation checkpointing:\n");
    check_recompute(&m, k);
    printf("bf16:\n");
    check_bf16(k);
    printf("training, %d AdamW steps of the adapters through fl_train_step:\n", k->c.steps);
    check_steps(&m, k);
    if (k->c.arch == FL_ARCH_LLAMA) {
        printf("rslora:\n");
        check_rslora(k);
    }
    free(logits);
    fl_model_free(&m);
}

int main(void) {
    lora_case cases[2] = {
        {.path = "tests/fixtures/lora_llama_tiny.bin", .targets = "q_proj,v_proj"},
        {.path = "tests/fixtures/lora_gpt2_tiny.bin", .targets = "c_attn"},
    };
    for (int i = 0; i < 2; i++) {
        test_case(&cases[i]);
        free(cases[i].data), free(cases[i].fx.recs), free(cases[i].tokens),
            free(cases[i].targets_ids);
    }
    return t_report();
}
