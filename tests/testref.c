// testref.c: see testref.h. Every length and count is checked against the
// bytes that are really there before it is used, so a damaged file fails
// with a message.
#include "testref.h"

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

int fx_expected_params(const fx_config *c, fx_param *out) {
    // shapes in multiples of C: (rows*C) or (rows*C, cols*C); cols 0 = 1-D
    static const struct {
        const char *suffix;
        int rows, cols, decay;
    } layer[] = {
        {"ln_1.weight", 1, 0, 0},        {"ln_1.bias", 1, 0, 0},
        {"attn.c_attn.weight", 3, 1, 1}, {"attn.c_attn.bias", 3, 0, 0},
        {"attn.c_proj.weight", 1, 1, 1}, {"attn.c_proj.bias", 1, 0, 0},
        {"ln_2.weight", 1, 0, 0},        {"ln_2.bias", 1, 0, 0},
        {"mlp.c_fc.weight", 4, 1, 1},    {"mlp.c_fc.bias", 4, 0, 0},
        {"mlp.c_proj.weight", 1, 4, 1},  {"mlp.c_proj.bias", 1, 0, 0},
    };
    int n = 0;
    out[n++] = (fx_param){"wte.weight", 2, {(uint64_t)c->V, (uint64_t)c->C}, 1};
    out[n++] = (fx_param){"wpe.weight", 2, {(uint64_t)c->maxT, (uint64_t)c->C}, 0};
    for (int l = 0; l < c->L; l++)
        for (size_t i = 0; i < sizeof layer / sizeof layer[0]; i++) {
            fx_param *p = &out[n++];
            snprintf(p->name, sizeof p->name, "h.%d.%s", l, layer[i].suffix);
            p->ndim = layer[i].cols ? 2 : 1;
            p->shape[0] = (uint64_t)layer[i].rows * (uint64_t)c->C;
            p->shape[1] = (uint64_t)layer[i].cols * (uint64_t)c->C;
            p->decay = layer[i].decay;
        }
    out[n++] = (fx_param){"ln_f.weight", 1, {(uint64_t)c->C, 0}, 0};
    out[n++] = (fx_param){"ln_f.bias", 1, {(uint64_t)c->C, 0}, 0};
    return n;
}

// Checks that every record the test uses is present with a consistent shape
// and sane values; fills the config. Returns 0 with fx->err set otherwise.
int fx_validate(fixture *fx, fx_config *c) {
    uint64_t s8 = 8, s6 = 6;
    const fx_record *r = fx_expect(fx, "config", FX_I32, 1, &s8);
    if (!r) return 0;
    int32_t *ci = fx_copy(fx, r);
    *c = (fx_config){ci[0], ci[1], ci[2], ci[3], ci[4], ci[5], ci[6], ci[7], 0, 0, 0, 0, 0, 0};
    free(ci);
    if (c->maxT <= 0 || c->V <= 0 || c->L <= 0 || c->L > 16 || c->NH <= 0 || c->C <= 0 ||
        c->B <= 0 || c->T <= 0 || c->steps <= 0 || c->maxT > 4096 || c->V > 65536 || c->C > 4096 ||
        c->B > 64 || c->steps > 10000 || c->C % c->NH != 0 || c->T > c->maxT)
        return fx_fail(fx, "implausible config%s", "", r->offset);
    if (!(r = fx_expect(fx, "adamw", FX_F32, 1, &s6))) return 0;
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
        for (size_t i = 0; i < r->numel; i++) bad |= t[i] < 0 || t[i] >= c->V;
        free(t);
        if (bad) return fx_fail(fx, "record '%s' holds a token outside [0, V)", ints[k], r->offset);
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

fl_model_config fx_make_config(const fx_config *c) {
    fl_model_config cfg = {.max_seq_len = c->maxT,
                           .vocab_size = c->V,
                           .n_layer = c->L,
                           .n_head = c->NH,
                           .n_embd = c->C};
    fl_model_config_finish(&cfg);
    return cfg;
}

int fx_load(const char *path, fixture *fx, fx_config *c, unsigned char **data) {
    *data = NULL;
    memset(fx, 0, sizeof *fx);
    FILE *f = fopen(path, "rb");
    if (!f)
        return t_check(0,
                       "cannot open %s (regenerate it with /usr/bin/python3 "
                       "scripts/make_reference.py)",
                       path);
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
