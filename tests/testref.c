// testref.c: see testref.h. Every length and count is checked against the
// bytes that are really there before it is used, so a damaged file fails
// with a message.
#include "testref.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "testlib.h"

static uint32_t rd_u32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t rd_u64(const unsigned char *p) {
    return (uint64_t)rd_u32(p) | (uint64_t)rd_u32(p + 4) << 32;
}

static int fx_fail(fixture *fx, const char *fmt, const char *arg, size_t at) {
    char msg[256];
    snprintf(msg, sizeof msg, fmt, arg);
    snprintf(fx->err, sizeof fx->err, "%s (at byte %zu of %zu)", msg, at, fx->size);
    return 0;
}

const fx_record *fx_find(const fixture *fx, const char *name) {
    for (int i = 0; i < fx->n; i++)
        if (strcmp(fx->recs[i].name, name) == 0) return &fx->recs[i];
    return NULL;
}

// Indexes the records of data[0, size); returns 0 with fx->err set on damage.
int fx_parse(fixture *fx, const unsigned char *data, size_t size) {
    fx->data = data;
    fx->size = size;
    fx->n = 0;
    fx->err[0] = 0;
    if (size < 12) return fx_fail(fx, "file too short for the header%s", "", size);
    if (memcmp(data, "FITLMREF", 8) != 0) return fx_fail(fx, "bad magic%s (want FITLMREF)", "", 0);
    if (rd_u32(data + 8) != 1) return fx_fail(fx, "unsupported version%s (want 1)", "", 8);
    size_t pos = 12;
    while (pos < size) {
        size_t start = pos;
        if (size - pos < 4) return fx_fail(fx, "truncated record header%s", "", pos);
        uint32_t name_len = rd_u32(data + pos);
        pos += 4;
        if (name_len == 0 || name_len > FX_MAX_NAME)
            return fx_fail(fx, "bad record name length%s", "", start);
        if (size - pos < name_len) return fx_fail(fx, "truncated record name%s", "", pos);
        if (fx->n == fx->cap) {
            fx->cap = fx->cap ? 2 * fx->cap : 64;
            fx->recs = realloc(fx->recs, (size_t)fx->cap * sizeof *fx->recs);
            if (!fx->recs) return fx_fail(fx, "out of memory%s", "", pos);
        }
        fx_record *r = &fx->recs[fx->n];
        memcpy(r->name, data + pos, name_len);
        r->name[name_len] = 0;
        for (uint32_t i = 0; i < name_len; i++)
            if (r->name[i] < 0x21 || r->name[i] > 0x7e)
                return fx_fail(fx, "record name is not printable ASCII%s", "", pos);
        pos += name_len;
        if (size - pos < 8) return fx_fail(fx, "truncated header of record '%s'", r->name, pos);
        r->dtype = rd_u32(data + pos);
        r->ndim = rd_u32(data + pos + 4);
        pos += 8;
        if (r->dtype != FX_F32 && r->dtype != FX_I32)
            return fx_fail(fx, "record '%s' has an unknown dtype", r->name, pos - 8);
        if (r->ndim > FX_MAX_NDIM)
            return fx_fail(fx, "record '%s' has too many dimensions", r->name, pos - 4);
        if ((size - pos) / 8 < r->ndim)
            return fx_fail(fx, "truncated shape of record '%s'", r->name, pos);
        r->numel = 1;
        for (uint32_t d = 0; d < r->ndim; d++) {
            r->shape[d] = rd_u64(data + pos);
            pos += 8;
            // Bounding every factor by the file size keeps the product from
            // overflowing before it is compared with the bytes left.
            if (r->shape[d] > size || (r->shape[d] && r->numel > (size / 4) / r->shape[d]))
                return fx_fail(fx, "record '%s' is larger than the file", r->name, pos - 8);
            r->numel *= (size_t)r->shape[d];
        }
        if ((size - pos) / 4 < r->numel)
            return fx_fail(fx, "truncated data of record '%s'", r->name, pos);
        r->offset = pos;
        pos += r->numel * 4;
        if (fx_find(fx, r->name)) return fx_fail(fx, "duplicate record '%s'", r->name, start);
        fx->n++;
    }
    return 1;
}

// A copy of a record's data (float32 or int32 by dtype), malloc'd.
void *fx_copy(const fixture *fx, const fx_record *r) {
    uint32_t *out = malloc(r->numel * 4 + 4);
    for (size_t i = 0; i < r->numel; i++) out[i] = rd_u32(fx->data + r->offset + 4 * i);
    return out;
}

// The record `name` with this dtype and shape, or NULL with fx->err set.
const fx_record *fx_expect(fixture *fx, const char *name, uint32_t dtype, int ndim,
                           const uint64_t *shape) {
    const fx_record *r = fx_find(fx, name);
    if (!r) {
        fx_fail(fx, "missing record '%s'", name, fx->size);
        return NULL;
    }
    int ok = r->dtype == dtype && r->ndim == (uint32_t)ndim;
    for (int d = 0; ok && d < ndim; d++) ok = r->shape[d] == shape[d];
    if (!ok) {
        fx_fail(fx, "record '%s' has the wrong dtype or shape", name, r->offset);
        return NULL;
    }
    return r;
}

// Dimensions of the parameter shapes, by code.
enum { D_NONE, D_C, D_3C, D_KV, D_I };

static uint64_t fx_dim(const fx_config *c, int code) {
    switch (code) {
    case D_C:
        return (uint64_t)c->C;
    case D_3C:
        return 3 * (uint64_t)c->C;
    case D_KV:
        return (uint64_t)c->NKV * (uint64_t)(c->C / c->NH);
    case D_I:
        return (uint64_t)c->I;
    default:
        return 0;
    }
}

typedef struct {
    const char *suffix;
    int rows, cols, decay; // cols D_NONE: 1-D
} fx_layer_row;

static const fx_layer_row gpt2_layer[] = {
    {"ln_1.weight", D_C, D_NONE, 0},      {"ln_1.bias", D_C, D_NONE, 0},
    {"attn.c_attn.weight", D_3C, D_C, 1}, {"attn.c_attn.bias", D_3C, D_NONE, 0},
    {"attn.c_proj.weight", D_C, D_C, 1},  {"attn.c_proj.bias", D_C, D_NONE, 0},
    {"ln_2.weight", D_C, D_NONE, 0},      {"ln_2.bias", D_C, D_NONE, 0},
    {"mlp.c_fc.weight", D_I, D_C, 1},     {"mlp.c_fc.bias", D_I, D_NONE, 0},
    {"mlp.c_proj.weight", D_C, D_I, 1},   {"mlp.c_proj.bias", D_C, D_NONE, 0},
};

static const fx_layer_row llama_layer[] = {
    {"input_layernorm.weight", D_C, D_NONE, 0}, {"self_attn.q_proj.weight", D_C, D_C, 1},
    {"self_attn.k_proj.weight", D_KV, D_C, 1},  {"self_attn.v_proj.weight", D_KV, D_C, 1},
    {"self_attn.o_proj.weight", D_C, D_C, 1},   {"post_attention_layernorm.weight", D_C, D_NONE, 0},
    {"mlp.gate_proj.weight", D_I, D_C, 1},      {"mlp.up_proj.weight", D_I, D_C, 1},
    {"mlp.down_proj.weight", D_C, D_I, 1},
};

static fx_param fx_row(const char *name, uint64_t rows, uint64_t cols, int decay, int vocab) {
    fx_param p = {.ndim = cols ? 2 : 1, .shape = {rows, cols}, .decay = decay, .vocab_rows = vocab};
    snprintf(p.name, sizeof p.name, "%s", name);
    return p;
}

int fx_expected_params(const fx_config *c, fx_param *out) {
    int llama = c->arch == FL_ARCH_LLAMA, n = 0;
    uint64_t V = (uint64_t)c->V, C = (uint64_t)c->C;
    const fx_layer_row *layer = llama ? llama_layer : gpt2_layer;
    size_t nrows = llama ? sizeof llama_layer / sizeof llama_layer[0]
                         : sizeof gpt2_layer / sizeof gpt2_layer[0];
    out[n++] = fx_row(llama ? "embed_tokens.weight" : "wte.weight", V, C, 1, 1);
    if (!llama) out[n++] = fx_row("wpe.weight", (uint64_t)c->maxT, C, 0, 0);
    for (int l = 0; l < c->L; l++)
        for (size_t i = 0; i < nrows; i++) {
            char name[FL_PARAM_NAME_MAX];
            snprintf(name, sizeof name, "%s.%d.%s", llama ? "layers" : "h", l, layer[i].suffix);
            out[n++] =
                fx_row(name, fx_dim(c, layer[i].rows), fx_dim(c, layer[i].cols), layer[i].decay, 0);
        }
    if (llama) {
        out[n++] = fx_row("norm.weight", C, 0, 0, 0);
        if (!c->tie) out[n++] = fx_row("lm_head.weight", V, C, 1, 1);
    } else {
        out[n++] = fx_row("ln_f.weight", C, 0, 0, 0);
        out[n++] = fx_row("ln_f.bias", C, 0, 0, 0);
    }
    return n;
}

// "config": GPT-2's 8 ints or LLaMA's 11 (and then "config_f").
static int fx_read_config(fixture *fx, fx_config *c) {
    memset(c, 0, sizeof *c);
    const fx_record *r = fx_find(fx, "config");
    if (!r) return fx_fail(fx, "missing record '%s'", "config", fx->size);
    if (r->dtype != FX_I32 || r->ndim != 1 || (r->shape[0] != 8 && r->shape[0] != 11))
        return fx_fail(fx, "record 'config' is neither int32 (8) (GPT-2) nor int32 (11) (LLaMA)%s",
                       "", r->offset);
    int32_t *ci = fx_copy(fx, r);
    if (r->shape[0] == 8) {
        c->arch = FL_ARCH_GPT2;
        c->maxT = ci[0], c->V = ci[1], c->L = ci[2], c->NH = ci[3], c->C = ci[4];
        c->B = ci[5], c->T = ci[6], c->steps = ci[7];
        c->NKV = c->NH, c->I = 4 * c->C, c->tie = 1;
    } else {
        c->arch = FL_ARCH_LLAMA;
        c->maxT = ci[0], c->V = ci[1], c->L = ci[2], c->NH = ci[3], c->NKV = ci[4], c->C = ci[5];
        c->I = ci[6], c->B = ci[7], c->T = ci[8], c->steps = ci[9], c->tie = ci[10];
    }
    free(ci);
    if (c->maxT <= 0 || c->V <= 0 || c->L <= 0 || c->L > 16 || c->NH <= 0 || c->C <= 0 ||
        c->B <= 0 || c->T <= 0 || c->steps <= 0 || c->maxT > 4096 || c->V > 65536 || c->C > 4096 ||
        c->B > 64 || c->steps > 10000 || c->C % c->NH != 0 || c->T > c->maxT || c->NKV <= 0 ||
        c->NH % c->NKV != 0 || c->I <= 0 || c->I > 16384 || (c->tie != 0 && c->tie != 1) ||
        (c->arch == FL_ARCH_LLAMA && (c->C / c->NH) % 2 != 0))
        return fx_fail(fx, "implausible config%s", "", r->offset);
    if (c->arch == FL_ARCH_GPT2) return 1;
    uint64_t two = 2;
    if (!(r = fx_expect(fx, "config_f", FX_F32, 1, &two))) return 0;
    float *f = fx_copy(fx, r);
    c->norm_eps = f[0], c->rope_theta = f[1];
    free(f);
    if (!(c->norm_eps > 0 && c->norm_eps < 1 && c->rope_theta > 1 && c->rope_theta < 1e9f))
        return fx_fail(fx, "implausible rms_norm_eps or rope_theta%s", "", r->offset);
    return 1;
}

// Checks that every record the test uses is present with a consistent shape
// and sane values; fills the config. Returns 0 with fx->err set otherwise.
int fx_validate(fixture *fx, fx_config *c) {
    uint64_t s6 = 6;
    if (!fx_read_config(fx, c)) return 0;
    const fx_record *r = fx_expect(fx, "adamw", FX_F32, 1, &s6);
    if (!r) return 0;
    float *h = fx_copy(fx, r);
    c->lr = h[0], c->beta1 = h[1], c->beta2 = h[2], c->eps = h[3], c->weight_decay = h[4];
    c->max_grad_norm = h[5];
    free(h);
    if (!(c->lr > 0 && c->beta1 >= 0 && c->beta1 < 1 && c->beta2 >= 0 && c->beta2 < 1 &&
          c->eps > 0 && c->weight_decay >= 0 && c->max_grad_norm >= 0))
        return fx_fail(fx, "implausible AdamW hyperparameters%s", "", r->offset);

    uint64_t bt[3] = {(uint64_t)c->B, (uint64_t)c->T, (uint64_t)c->V}, one = 1,
             steps = (uint64_t)c->steps;
    const char *ints[2] = {"tokens", "targets"};
    for (int k = 0; k < 2; k++) {
        if (!(r = fx_expect(fx, ints[k], FX_I32, 2, bt))) return 0;
        int32_t *t = fx_copy(fx, r);
        int bad = 0;
        size_t n = 0; // targets with a loss
        for (size_t i = 0; i < r->numel; i++) {
            bad |= t[i] < -k || t[i] >= c->V; // a target may be -1
            n += t[i] != -1;
        }
        free(t);
        if (bad) return fx_fail(fx, "record '%s' holds a token outside [0, V)", ints[k], r->offset);
        if (n == 0) return fx_fail(fx, "record '%s' holds no target", ints[k], r->offset);
    }
    if (!fx_expect(fx, "logits", FX_F32, 3, bt) || !fx_expect(fx, "loss", FX_F32, 1, &one) ||
        !fx_expect(fx, "step_losses", FX_F32, 1, &steps) ||
        !fx_expect(fx, "step_grad_norms", FX_F32, 1, &steps))
        return 0;
    fx_param ps[FX_MAX_PARAMS];
    int np = fx_expected_params(c, ps);
    const char *prefixes[3] = {"param/", "grad/", "final/"};
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < np; i++) {
            char name[FX_MAX_NAME + 1];
            snprintf(name, sizeof name, "%s%.*s", prefixes[k], FL_PARAM_NAME_MAX, ps[i].name);
            if (!fx_expect(fx, name, FX_F32, ps[i].ndim, ps[i].shape)) return 0;
        }
    return 1;
}

float *fx_floats(fixture *fx, const char *name) {
    const fx_record *r = fx_find(fx, name);
    FL_ASSERT(r && r->dtype == FX_F32); // fx_validate has checked every name used
    return fx_copy(fx, r);
}

int *fx_ints(fixture *fx, const char *name) {
    const fx_record *r = fx_find(fx, name);
    FL_ASSERT(r && r->dtype == FX_I32);
    return fx_copy(fx, r);
}

fl_model_config fx_make_config(const fx_config *c) {
    fl_model_config cfg = {.arch = c->arch,
                           .max_seq_len = c->maxT,
                           .vocab_size = c->V,
                           .n_layer = c->L,
                           .n_head = c->NH,
                           .n_embd = c->C};
    if (c->arch == FL_ARCH_LLAMA) {
        cfg.n_kv_head = c->NKV;
        cfg.intermediate_size = c->I;
        cfg.norm_eps = c->norm_eps;
        cfg.rope_theta = c->rope_theta;
        cfg.tie_embeddings = c->tie;
    }
    fl_model_config_finish(&cfg);
    return cfg;
}

int fx_load(const char *path, fixture *fx, fx_config *c, unsigned char **data) {
    *data = NULL;
    memset(fx, 0, sizeof *fx);
    FILE *f = fopen(path, "rb");
    if (!f)
        return t_check(0, "cannot open %s (regenerate it with /usr/bin/python3 scripts/%s)", path,
                       strstr(path, "llama") ? "make_llama_reference.py" : "make_reference.py");
    fseek(f, 0, SEEK_END);
    long size = ftell(f);
    fseek(f, 0, SEEK_SET);
    *data = malloc(size > 0 ? (size_t)size : 1);
    size_t got = size > 0 ? fread(*data, 1, (size_t)size, f) : 0;
    fclose(f);
    if (!t_check(size > 0 && got == (size_t)size, "cannot read %s", path) ||
        !t_check(fx_parse(fx, *data, got) && fx_validate(fx, c), "fixture %s: %s", path, fx->err))
        return 0;
    printf("fixture %s: %zu bytes, %d records\n", path, got, fx->n);
    return 1;
}

// ----------------------------------------------------------------------------
// checks of the engine against a fixture

void fx_test_damaged(const unsigned char *data, size_t size, const fixture *good) {
    fixture fx = {0};
    fx_config c;
    // Cut the file inside every record header, and in each record's data:
    // every cut must fail in fx_parse or, at a record boundary, fx_validate.
    size_t cuts = 0, accepted = 0;
    for (int i = 0; i <= good->n; i++) {
        size_t start = i == 0 ? 0 : good->recs[i - 1].offset + good->recs[i - 1].numel * 4;
        size_t end = i < good->n ? good->recs[i].offset + 1 : start;
        for (size_t len = start; len <= end && len < size; len++) {
            cuts++;
            if (fx_parse(&fx, data, len) && fx_validate(&fx, &c)) accepted++;
        }
        if (i < good->n && good->recs[i].numel > 1) {
            size_t mid = good->recs[i].offset + good->recs[i].numel * 2 + 1;
            cuts++;
            if (fx_parse(&fx, data, mid) && fx_validate(&fx, &c)) accepted++;
        }
    }
    t_check(accepted == 0, "%zu of %zu truncated copies of the fixture were accepted", accepted,
            cuts);
    // the message of a cut inside the last record
    const fx_record *last = &good->recs[good->n - 1];
    if (!fx_parse(&fx, data, last->offset + 6)) printf("  %-19s -> %s\n", "truncated", fx.err);

    // Corrupt single header fields: each must be refused with a message.
    unsigned char *bad = malloc(size);
    const fx_record *r = &good->recs[good->n / 2];
    FL_ASSERT(r->ndim >= 1);
    size_t name_at = r->offset - 8 * r->ndim - 8 - strlen(r->name) - 4;
    struct {
        const char *what;
        size_t at;
        uint32_t value;
    } cases[] = {
        {"magic", 0, 0x4d4c5446},
        {"version", 8, 2},
        {"name length", name_at, 0x7fffffff},
        {"dtype", r->offset - 8 * r->ndim - 8, 7},
        {"ndim", r->offset - 8 * r->ndim - 4, 1000},
        {"shape", r->offset - 8 * r->ndim, 0xffffffff},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        memcpy(bad, data, size);
        for (int b = 0; b < 4; b++) bad[cases[k].at + b] = (unsigned char)(cases[k].value >> 8 * b);
        if (strcmp(cases[k].what, "shape") == 0)
            for (int b = 4; b < 8; b++) bad[cases[k].at + b] = 0xff; // a 2^64-1 dimension
        int ok = fx_parse(&fx, bad, size) && fx_validate(&fx, &c);
        t_check(!ok && fx.err[0], "corrupt %s accepted", cases[k].what);
        if (!ok) printf("  corrupt %-11s -> %s\n", cases[k].what, fx.err);
    }
    free(bad);
    free(fx.recs);
}

void fx_model_init(fl_model *m, const fx_config *c, fl_recompute policy) {
    fl_model_config cfg = fx_make_config(c);
    memset(m, 0, sizeof *m);
    fl_model_init(m, &cfg, FL_F32, 1);
    fl_model_alloc_acts(m, c->B, c->T, policy, 0);
}

void fx_load_params(fl_model *m, fixture *fx, const char *prefix) {
    for (int i = 0; i < m->table.count; i++) {
        const fl_param_view *v = &m->table.views[i];
        char name[FX_MAX_NAME + 1];
        snprintf(name, sizeof name, "%s%s", prefix, v->name);
        const fx_record *r = fx_find(fx, name);
        FL_ASSERT(r && r->numel <= v->numel);
        float *x = fx_copy(fx, r);
        memset((float *)m->params + v->offset, 0, v->numel * sizeof(float));
        memcpy((float *)m->params + v->offset, x, r->numel * sizeof(float));
        free(x);
    }
}

void fx_compare_views(const fl_model *m, fixture *fx, const float *buf, const char *prefix,
                      double atol, double rtol, double k_bias_atol) {
    const size_t C = (size_t)m->config.n_embd;
    for (int i = 0; i < m->table.count; i++) {
        const fl_param_view *v = &m->table.views[i];
        char name[FX_MAX_NAME + 1];
        snprintf(name, sizeof name, "%s%s", prefix, v->name);
        const fx_record *r = fx_find(fx, name);
        float *want = fx_copy(fx, r);
        const float *got = buf + v->offset;
        size_t len = strlen(v->name);
        if (k_bias_atol > 0 && len >= 16 && strcmp(v->name + len - 16, "attn.c_attn.bias") == 0) {
            char part[FX_MAX_NAME + 16];
            snprintf(part, sizeof part, "%s[q]", name);
            t_close(part, got, want, C, atol, rtol);
            snprintf(part, sizeof part, "%s[k]", name);
            t_close(part, got + C, want + C, C, k_bias_atol, 0);
            snprintf(part, sizeof part, "%s[v]", name);
            t_close(part, got + 2 * C, want + 2 * C, C, atol, rtol);
        } else {
            t_close(name, got, want, r->numel, atol, rtol);
        }
        free(want);
        if (r->numel < v->numel) { // the padded vocabulary rows V..Vp-1
            size_t nonzero = 0;
            for (size_t j = r->numel; j < v->numel; j++) nonzero += buf[v->offset + j] != 0.0f;
            t_check(nonzero == 0, "%s: %zu nonzero values in the padded vocab rows", name, nonzero);
        }
    }
}

int fx_check_table(const fl_model *m, const fx_config *c) {
    fx_param ps[FX_MAX_PARAMS];
    int np = fx_expected_params(c, ps);
    int ok =
        t_check(m->table.count == np, "parameter table has %d views, want %d", m->table.count, np);
    for (int i = 0; ok && i < np; i++) {
        const fl_param_view *v = &m->table.views[i];
        uint64_t rows = ps[i].vocab_rows ? (uint64_t)m->config.padded_vocab_size : ps[i].shape[0];
        int same = strcmp(v->name, ps[i].name) == 0 && v->ndim == ps[i].ndim &&
                   v->shape[0] == rows && (ps[i].ndim == 1 || v->shape[1] == ps[i].shape[1]);
        ok &= t_check(same, "table view %d is '%s' (ndim %d, %zu x %zu), want '%s' (%llu x %llu)",
                      i, v->name, v->ndim, v->shape[0], v->ndim > 1 ? v->shape[1] : 1, ps[i].name,
                      (unsigned long long)rows, (unsigned long long)ps[i].shape[1]);
        t_check(!!(v->flags & FL_PARAM_DECAY) == ps[i].decay, "'%s': weight decay flag %s", v->name,
                ps[i].decay ? "missing" : "set");
        t_check(fl_params_find(&m->table, ps[i].name) == i, "fl_params_find('%s')", ps[i].name);
    }
    if (ok)
        printf("parameter table: %d rows, names, shapes and decay flags as the fixture's\n", np);
    return ok;
}

double fx_mean_loss(const fl_model *m) {
    double s = 0;
    int n = 0;
    for (int i = 0; i < m->B * m->T; i++)
        if (m->targets[i] != -1) s += m->losses[i], n++;
    return n ? s / n : 0.0;
}

float *fx_logits(const fl_model *m) {
    size_t BT = (size_t)m->B * m->T, V = (size_t)m->config.vocab_size,
           Vp = (size_t)m->config.padded_vocab_size;
    float *out = malloc(BT * V * sizeof(float));
    for (size_t i = 0; i < BT; i++)
        memcpy(out + i * V, (const float *)m->logits + i * Vp, V * sizeof(float));
    return out;
}

size_t fx_count_outside(const float *got, const float *want, size_t n, double atol, double rtol) {
    size_t bad = 0;
    for (size_t i = 0; i < n; i++)
        bad += !(fabs((double)got[i] - want[i]) <= atol + rtol * fabs((double)want[i]));
    return bad;
}

void fx_check_forward(fl_model *m, fixture *fx, const fx_config *c, double loss_atol) {
    const int BT = c->B * c->T, V = c->V, Vp = m->config.padded_vocab_size;
    int *tokens = fx_ints(fx, "tokens"), *targets = fx_ints(fx, "targets");
    float *want_logits = fx_floats(fx, "logits"), *want_loss = fx_floats(fx, "loss");
    int n = 0;
    for (int i = 0; i < BT; i++) n += targets[i] != -1;
    fx_load_params(m, fx, "param/");
    float loss = fl_model_forward(m, tokens, targets, c->B, c->T);
    t_check(m->n_targets == n, "n_targets %d, want %d", m->n_targets, n);
    t_close("loss (returned)", &loss, want_loss, 1, loss_atol, 0);
    t_close("loss (model->loss)", &m->loss, want_loss, 1, loss_atol, 0);
    float mean = (float)fx_mean_loss(m);
    t_close("loss (mean of acts.losses)", &mean, want_loss, 1, loss_atol, 0);
    size_t pad_nonzero = 0;
    const float *logits = m->logits; // fp32 model
    for (int i = 0; i < BT; i++)
        for (int j = V; j < Vp; j++) pad_nonzero += logits[(size_t)i * Vp + j] != 0.0f;
    float *got = fx_logits(m);
    t_close("logits", got, want_logits, (size_t)BT * V, LOGITS_ATOL, LOGITS_RTOL);
    t_check(pad_nonzero == 0, "%zu nonzero logits in the padded vocab columns", pad_nonzero);
    free(tokens), free(targets), free(want_logits), free(want_loss), free(got);
}

void fx_check_steps(fixture *fx, const fx_config *c, const float *losses, const float *norms,
                    double loss_atol, double norm_rtol) {
    float *want_losses = fx_floats(fx, "step_losses"),
          *want_norms = fx_floats(fx, "step_grad_norms");
    for (int s = 0; s < c->steps; s++)
        printf("  step %2d: loss %.6f (ref %.6f), grad norm %.6f (ref %.6f)\n", s, losses[s],
               want_losses[s], norms[s], want_norms[s]);
    t_close("step_losses", losses, want_losses, c->steps, loss_atol, 0);
    t_close("step_grad_norms", norms, want_norms, c->steps, 0, norm_rtol);
    free(want_losses), free(want_norms);
}

void fx_check_recompute(fixture *fx, const fx_config *c) {
    static const fl_recompute policy[3] = {FL_RECOMPUTE_NONE, FL_RECOMPUTE_SELECTIVE,
                                           FL_RECOMPUTE_BLOCK};
    int *tokens = fx_ints(fx, "tokens"), *targets = fx_ints(fx, "targets");
    fl_model m[3];
    for (int k = 0; k < 3; k++) {
        fx_model_init(&m[k], c, policy[k]);
        fx_load_params(&m[k], fx, "param/");
        fl_model_forward(&m[k], tokens, targets, c->B, c->T);
        fl_model_zero_grad(&m[k]);
        fl_model_backward(&m[k], 1.0f / m[k].n_targets);
    }
    const float *g0 = m[0].grads;
    size_t n = m[0].table.numel;
    for (int k = 1; k < 3; k++) {
        const char *name = fl_recompute_name(policy[k]);
        const float *g = m[k].grads;
        size_t ndiff = 0, first = 0;
        double worst = 0;
        for (size_t i = 0; i < n; i++)
            if (memcmp(&g[i], &g0[i], sizeof(float)) != 0) {
                if (ndiff++ == 0) first = i;
                if (fabs((double)g[i] - g0[i]) > worst) worst = fabs((double)g[i] - g0[i]);
            }
        const char *row = "?";
        for (int i = 0; i < m[0].table.count; i++)
            if (first >= m[0].table.views[i].offset) row = m[0].table.views[i].name;
        t_check(memcmp(&m[k].loss, &m[0].loss, sizeof(float)) == 0,
                "recompute %s: loss %.9g, without recomputation %.9g", name, m[k].loss, m[0].loss);
        t_check(ndiff == 0,
                "recompute %s: %zu of %zu gradient elements differ from no recomputation (first "
                "at %zu, in %s; max |diff| %.3g)",
                name, ndiff, n, first, row, worst);
        if (ndiff == 0)
            printf("  recompute %-9s: loss %.7f and all %zu gradients bitwise as without\n", name,
                   m[k].loss, n);
    }
    for (int k = 0; k < 3; k++) fl_model_free(&m[k]);
    free(tokens), free(targets);
}
