// lora.c: LoRA adapters on the model (lora.h): which linear layers they
// target (PEFT's matching), their table and initialisation
// (peft/tuners/lora/layer.py reset_lora_parameters), their forward and
// backward inside the linear unit, and merging for export
// (get_delta_weight).
//
// For a base row W (out, in) an adapter is A (r, in) and B (out, r):
//   forward   y += s * B (A x'),  x' = dropout(x), s = scaling
//   backward  g = s * dy;  dB += g^T h;  dh = g B;  dA += dh^T x';
//             dx += dropout'(dh A),  with h = A x' recomputed
// A x' is recomputed in the backward (it costs r/out of the base GEMM), so
// the adapters keep no activation of their own: activation checkpointing
// cannot lose their gradients, whatever the policy.
#include "fitlm/lora.h"

#include <math.h>
#include <stdio.h>
#include <string.h>
#include <omp.h>

#include "arch.h"

void fl_lora_config_defaults(fl_lora_config *c) {
    memset(c, 0, sizeof *c);
    c->r = 8;
    c->alpha = 8.0f;
    c->init = FL_LORA_INIT_DEFAULT;
}

// computed in double and rounded once, as PEFT's Python float meets fp32
float fl_lora_scaling(const fl_lora_config *c) {
    double r = c->r;
    return (float)(c->use_rslora ? c->alpha / sqrt(r) : c->alpha / r);
}

// ----------------------------------------------------------------------------
// names

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

void fl_lora_module_name(const fl_model_config *c, const char *row, char *out, size_t size) {
    static const char *const suffixes[] = {".lora_A.weight", ".lora_B.weight", ".weight", ".bias"};
    size_t n = strlen(row);
    for (size_t i = 0; i < sizeof suffixes / sizeof suffixes[0]; i++)
        if (ends_with(row, suffixes[i])) {
            n -= strlen(suffixes[i]);
            break;
        }
    const char *prefix = strncmp(row, "lm_head.", 8) == 0 ? ""
                         : c->arch == FL_ARCH_LLAMA       ? "model."
                                                          : "transformer.";
    snprintf(out, size, "%s%.*s", prefix, (int)n, row);
}

void fl_lora_peft_name(const fl_model_config *c, const char *row, char *out, size_t size) {
    FL_ASSERT(ends_with(row, ".lora_A.weight") || ends_with(row, ".lora_B.weight"));
    char module[FL_PARAM_NAME_MAX + 16];
    fl_lora_module_name(c, row, module, sizeof module);
    snprintf(out, size, "base_model.model.%s.%s.weight", module,
             ends_with(row, ".lora_B.weight") ? "lora_B" : "lora_A");
}

// ----------------------------------------------------------------------------
// targets and the adapters' table

#define MAX_ENTRIES 32

// target_modules split at commas, blanks trimmed; the architecture's
// default when empty (PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING)
static int parse_targets(const fl_model_config *c, const char *spec, char (*out)[64]) {
    const char *s = *spec ? spec : c->arch == FL_ARCH_LLAMA ? "q_proj,v_proj" : "c_attn";
    int n = 0;
    while (*s) {
        while (*s == ' ' || *s == ',') s++;
        const char *e = s;
        while (*e && *e != ',') e++;
        const char *z = e;
        while (z > s && z[-1] == ' ') z--;
        if (z > s) {
            if (n == MAX_ENTRIES || z - s >= 64)
                fl_die("lora.target_modules: at most %d entries of up to 63 characters ('%s')",
                       MAX_ENTRIES, spec);
            snprintf(out[n++], 64, "%.*s", (int)(z - s), s);
        }
        s = e;
    }
    if (n == 0) fl_die("lora.target_modules is empty ('%s')", spec);
    return n;
}

// Marks the targeted base rows; dies naming an entry that matches nothing
// or matches what is not a block's linear layer.
static void match_targets(const fl_param_table *base, const fl_model_config *c,
                          const fl_lora_config *lc, unsigned char *hit) {
    char entries[MAX_ENTRIES][64], module[FL_PARAM_NAME_MAX + 16];
    int n = parse_targets(c, lc->target_modules, entries);
    const char *arch = c->arch == FL_ARCH_LLAMA ? "LLaMA" : "GPT-2";
    const char *linears = c->arch == FL_ARCH_LLAMA
                              ? "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"
                              : "c_attn, attn.c_proj, c_fc, mlp.c_proj";
    memset(hit, 0, (size_t)base->count);
    for (int e = 0; e < n; e++) {
        int all = strcmp(entries[e], "all-linear") == 0, matched = 0;
        if (all && n > 1) fl_die("lora.target_modules: all-linear cannot be combined with names");
        for (int r = 0; r < base->count; r++) {
            const fl_param_view *v = &base->views[r];
            if (!ends_with(v->name, ".weight")) continue;
            int linear = (v->flags & FL_PARAM_LINEAR) != 0;
            if (all) {
                matched += linear;
                hit[r] |= linear;
                continue;
            }
            fl_lora_module_name(c, v->name, module, sizeof module);
            size_t ml = strlen(module), el = strlen(entries[e]);
            int match = strcmp(module, entries[e]) == 0 ||
                        (ml > el && module[ml - el - 1] == '.' && ends_with(module, entries[e]));
            if (!match) continue;
            if (!linear)
                fl_die("lora.target_modules: '%s' matches %s, which is not a linear layer of a "
                       "block (adapters on embeddings, norms and the LM head are not supported; "
                       "the %s linear layers are %s)",
                       entries[e], module, arch, linears);
            hit[r] = 1;
            matched++;
        }
        if (!matched)
            fl_die("lora.target_modules: '%s' matches no module of this %s model (its linear "
                   "layers: %s, or all-linear)",
                   entries[e], arch, linears);
    }
}

void fl_lora_table(fl_param_table *t, const fl_param_table *base, const fl_model_config *c,
                   const fl_lora_config *lc, int *a_row) {
    if (lc->r < 1 || lc->r > 65536) fl_die("lora.r must be in [1, 65536] (got %d)", lc->r);
    unsigned char *hit = fl_alloc(FL_MEM_WORKSPACE, (size_t)base->count);
    match_targets(base, c, lc, hit);
    int n = 0;
    for (int r = 0; r < base->count; r++) n += hit[r];
    memset(t, 0, sizeof *t);
    fl_params_reserve(t, 2 * n);
    char name[FL_PARAM_NAME_MAX + 16];
    for (int r = 0; r < base->count; r++) {
        if (a_row) a_row[r] = hit[r] ? t->count : -1;
        if (!hit[r]) continue;
        const fl_param_view *v = &base->views[r];
        size_t out = v->shape[0], in = v->shape[1], shape[2];
        size_t stem = strlen(v->name) - strlen(".weight");
        for (int ab = 0; ab < 2; ab++) {
            snprintf(name, sizeof name, "%.*s.lora_%c.weight", (int)stem, v->name, "AB"[ab]);
            if (strlen(name) >= FL_PARAM_NAME_MAX) fl_die("parameter name too long: %s", name);
            shape[0] = ab ? out : (size_t)lc->r;
            shape[1] = ab ? (size_t)lc->r : in;
            fl_param_view *w = &t->views[fl_params_add(t, name, FL_PARAM_DECAY, 2, shape)];
            w->unit = v->unit;
            if (ab) { // B = 0: the adapted model starts as the base
                w->init = FL_INIT_ZEROS;
            } else if (lc->init == FL_LORA_INIT_GAUSSIAN) {
                w->init = FL_INIT_NORMAL;
                w->std = 1.0f / (float)lc->r;
            } else { // kaiming_uniform_(a = sqrt 5): bound sqrt(6 / ((1 + 5) fan_in))
                w->init = FL_INIT_UNIFORM;
                w->std = 1.0f / sqrtf((float)in);
            }
        }
    }
    fl_free(hit);
}

static void init_sink(void *ctx, int row, size_t first, const float *values, size_t n) {
    fl_model *m = ctx;
    size_t at = m->lora.table.views[row].offset + first;
    fl_model_upload_f32(m, fl_at(m->dtype, m->lora.params, at), values, n);
}

void fl_model_add_lora(fl_model *m, const fl_lora_config *cfg, uint64_t seed) {
    FL_ASSERT(m->lora.cfg.r == 0 && m->max_B == 0); // before the activations
    if (!(cfg->dropout >= 0.0f && cfg->dropout < 1.0f))
        fl_die("lora.lora_dropout must be in [0, 1) (got %g)", cfg->dropout);
    if (!(cfg->alpha > 0.0f)) fl_die("lora.lora_alpha must be positive (got %g)", cfg->alpha);
    fl_lora_set *s = &m->lora;
    s->a_row = fl_alloc(FL_MEM_OTHER, (size_t)m->table.count * sizeof(int));
    fl_lora_table(&s->table, &m->table, &m->config, cfg, s->a_row);
    s->cfg = *cfg;
    s->scaling = fl_lora_scaling(cfg);
    s->params = fl_model_mem(m, FL_MEM_PARAMS, s->table.numel * fl_dtype_size(m->dtype));
    fl_params_init_each(&s->table, seed, init_sink, m); // fl_params_init's values, uploaded
    s->dropout_seed = seed;
    if (!cfg->train_base)
        for (int r = 0; r < m->table.count; r++) m->table.views[r].flags |= FL_PARAM_FROZEN;
}

// ----------------------------------------------------------------------------
// the adapted linear unit

// Calls fn for each adapted row of a linear unit's group (its rows run as
// one GEMM): the base row, its lora_A row and its first output column.
typedef void (*adapted_fn)(fl_model *m, const fl_linear *lin, int row, int a, int col, void *ctx);

static void for_adapted(fl_model *m, int unit, const fl_linear *lin, adapted_fn fn, void *ctx) {
    const fl_param_view *v = m->table.views;
    int col = 0;
    for (int r = m->unit_row[unit + 1] + lin->w; col < lin->out; r++) {
        if (m->lora.a_row[r] >= 0) fn(m, lin, r, m->lora.a_row[r], col, ctx);
        col += (int)v[r].shape[0];
    }
}

static void *lora_w(const fl_model *m, int a) {
    return fl_at(m->dtype, m->lora.params, m->lora.table.views[a].offset);
}
static void *lora_g(const fl_model *m, int a) {
    return fl_at(m->dtype, m->lora.grads, m->lora.table.views[a].offset);
}

// the mask of row `row` in this micro-batch (dropout_step 0: no dropout)
static uint64_t dropout_key(const fl_model *m, int row) {
    return fl_sr_bits(m->lora.dropout_seed ^ ((uint64_t)row << 40), m->lora.dropout_step);
}
static int dropout_on(const fl_model *m) {
    return m->lora.cfg.dropout > 0.0f && m->lora.dropout_step > 0;
}

// The adapter's input: x, or dropout(x) in lora.xd.
static const void *adapter_input(fl_model *m, int row, const void *inp, int N, int in) {
    if (!dropout_on(m)) return inp;
    m->dev->dropout_apply(m->dtype, m->lora.xd, inp, (size_t)N * in, m->lora.cfg.dropout,
                          dropout_key(m, row));
    return m->lora.xd;
}

typedef struct {
    void *out;
    const void *dout, *inp;
    void *dinp;
    int N;
} lora_io;

static void forward_one(fl_model *m, const fl_linear *lin, int row, int a, int col, void *ctx) {
    const lora_io *io = ctx;
    fl_lora_set *s = &m->lora;
    fl_dtype dt = m->dtype;
    int N = io->N, r = s->cfg.r, out = (int)m->table.views[row].shape[0];
    const void *x = adapter_input(m, row, io->inp, N, lin->in);
    m->dev->matmul_forward(dt, s->h, x, lora_w(m, a), NULL, m->matmul_workspace, N, lin->in, r);
    m->dev->matmul_forward(dt, s->dy, s->h, lora_w(m, a + 1), NULL, m->matmul_workspace, N, r, out);
    m->dev->lora_add_columns(dt, fl_at(dt, io->out, (size_t)col), lin->out, s->dy, s->scaling, N,
                             out);
}

static void backward_one(fl_model *m, const fl_linear *lin, int row, int a, int col, void *ctx) {
    const lora_io *io = ctx;
    fl_lora_set *s = &m->lora;
    fl_dtype dt = m->dtype;
    int N = io->N, r = s->cfg.r, in = lin->in, out = (int)m->table.views[row].shape[0];
    void *ws = m->matmul_workspace;
    const void *x = adapter_input(m, row, io->inp, N, in);
    m->dev->matmul_forward(dt, s->h, x, lora_w(m, a), NULL, ws, N, in, r);
    m->dev->lora_gather_columns(dt, s->dy, fl_at_const(dt, io->dout, (size_t)col), lin->out,
                                s->scaling, N, out);
    m->dev->matmul_backward(dt, s->dh, lora_g(m, a + 1), NULL, s->dy, s->h, lora_w(m, a + 1), ws, N,
                            r, out, 0);
    if (!dropout_on(m)) { // dx += dh A, on the base's
        m->dev->matmul_backward(dt, io->dinp, lora_g(m, a), NULL, s->dh, x, lora_w(m, a), ws, N, in,
                                r, 1);
        return;
    }
    m->dev->matmul_backward(dt, NULL, lora_g(m, a), NULL, s->dh, x, lora_w(m, a), ws, N, in, r, 0);
    if (!io->dinp) return;
    // dx += dropout'(dh A): formed in lora.xd (x' is no longer needed)
    m->dev->matmul_backward(dt, s->xd, NULL, NULL, s->dh, x, lora_w(m, a), ws, N, in, r, 0);
    m->dev->dropout_apply(dt, s->xd, s->xd, (size_t)N * in, s->cfg.dropout, dropout_key(m, row));
    m->dev->residual_forward(dt, io->dinp, io->dinp, s->xd, (size_t)N * in);
}

void fl_lora_forward(fl_model *m, int unit, const fl_linear *lin, void *out, const void *inp,
                     int N) {
    lora_io io = {out, NULL, inp, NULL, N};
    FL_FWD_OP(FL_OP_LORA, for_adapted(m, unit, lin, forward_one, &io));
}

void fl_lora_backward(fl_model *m, int unit, const fl_linear *lin, void *dinp, const void *dout,
                      const void *inp, int N) {
    FL_ASSERT(m->lora.grads);
    lora_io io = {NULL, dout, inp, dinp, N};
    FL_BWD_OP(FL_OP_LORA, for_adapted(m, unit, lin, backward_one, &io));
}

void fl_lora_workspace(const fl_param_table *t, int r, float dropout, size_t N, size_t *h,
                       size_t *dy, size_t *xd) {
    size_t out = 0, in = 0;
    for (int a = 0; a < t->count; a += 2) {
        if (t->views[a + 1].shape[0] > out) out = t->views[a + 1].shape[0];
        if (t->views[a].shape[1] > in) in = t->views[a].shape[1];
    }
    *h = N * (size_t)r;
    *dy = N * out;
    *xd = dropout > 0.0f ? N * in : 0;
}

// ----------------------------------------------------------------------------
// merging

void fl_model_merged_f32(const fl_model *m, float *out) {
    const fl_param_table *t = &m->table;
    for (int row = 0; row < t->count; row++) {
        const fl_param_view *v = &t->views[row];
        float *w = out + v->offset;
        fl_model_row_f32(m, row, w);
        int a = m->lora.cfg.r ? m->lora.a_row[row] : -1;
        if (a < 0) continue;
        // W (out, in) += s * B (out, r) @ A (r, in), in fp32 (PEFT's get_delta_weight)
        size_t O = v->shape[0], I = v->shape[1], R = (size_t)m->lora.cfg.r;
        size_t threads = (size_t)omp_get_max_threads();
        float *A = fl_alloc(FL_MEM_WORKSPACE, (R * I + O * R + threads * I) * sizeof(float));
        float *B = A + R * I, *deltas = B + O * R;
        fl_model_download_f32(m, A, lora_w(m, a), R * I);
        fl_model_download_f32(m, B, lora_w(m, a + 1), O * R);
        float s = m->lora.scaling;
#pragma omp parallel for
        for (size_t o = 0; o < O; o++) {
            // row o of B @ A, then scaled and added once, as PEFT
            float *delta = deltas + (size_t)omp_get_thread_num() * I;
            memset(delta, 0, I * sizeof(float));
            for (size_t k = 0; k < R; k++) {
                float b = B[o * R + k];
                const float *ak = A + k * I;
                for (size_t i = 0; i < I; i++) delta[i] += b * ak[i];
            }
            for (size_t i = 0; i < I; i++) w[o * I + i] += delta[i] * s;
        }
        fl_free(A);
    }
}
