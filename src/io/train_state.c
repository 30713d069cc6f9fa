// train_state.c: what a training checkpoint holds and how a run resumes from
// it. The weights are saved in fp32 (the master copy under mixed precision);
// the 16-bit weights are rounded from them again on resume, which gives back
// exactly the values the run was using, since every step ends that way.
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cJSON.h>

#include "fitlm/io.h"

static void add_u64(cJSON *obj, const char *key, uint64_t v) {
    char hex[24]; // JSON numbers are doubles: 64-bit state goes as hex text
    snprintf(hex, sizeof hex, "%016" PRIx64, v);
    cJSON_AddStringToObject(obj, key, hex);
}

static void add_u64_array(cJSON *obj, const char *key, const uint64_t *v, int n) {
    cJSON *arr = cJSON_AddArrayToObject(obj, key);
    for (int i = 0; i < n; i++) {
        char hex[24];
        snprintf(hex, sizeof hex, "%016" PRIx64, v[i]);
        cJSON_AddItemToArray(arr, cJSON_CreateString(hex));
    }
}

static uint64_t hex_u64(const cJSON *item, const char *path, const char *key) {
    char *end;
    if (!cJSON_IsString(item) || strlen(item->valuestring) != 16 ||
        (strtoull(item->valuestring, &end, 16), *end))
        fl_die("checkpoint %s: '%s' is missing or not 16 hex digits", path, key);
    return strtoull(item->valuestring, NULL, 16);
}

static double number(const cJSON *obj, const char *key, const char *path, double min, double max) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsNumber(item) || !(item->valuedouble >= min && item->valuedouble <= max))
        fl_die("checkpoint %s: '%s' is missing or outside [%g, %g]", path, key, min, max);
    return item->valuedouble;
}

static const cJSON *object(const cJSON *obj, const char *key, const char *path) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsObject(item)) fl_die("checkpoint %s: '%s' is missing", path, key);
    return item;
}

static const char *string(const cJSON *obj, const char *key, const char *path) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsString(item)) fl_die("checkpoint %s: '%s' is missing", path, key);
    return item->valuestring;
}

static const char *optim_kind_name(fl_optim_kind k) {
    return k == FL_OPT_ADAMW ? "adamw" : "sgd";
}

void fl_train_ckpt_save(const char *dir, int step, const fl_gpt2 *model, const fl_optimizer *optim,
                        const fl_loader_state *loader, const char *tokenizer,
                        const char *config_json, int keep) {
    const fl_gpt2_config *c = &model->config;
    cJSON *meta = cJSON_CreateObject();
    cJSON *m = cJSON_AddObjectToObject(meta, "model");
    cJSON_AddNumberToObject(m, "n_layer", c->n_layer);
    cJSON_AddNumberToObject(m, "n_head", c->n_head);
    cJSON_AddNumberToObject(m, "n_embd", c->n_embd);
    cJSON_AddNumberToObject(m, "vocab_size", c->vocab_size);
    cJSON_AddNumberToObject(m, "max_seq_len", c->max_seq_len);
    cJSON_AddStringToObject(meta, "precision", fl_dtype_name(model->dtype));
    cJSON_AddStringToObject(meta, "tokenizer", tokenizer);
    if (config_json) {
        cJSON *cfg = cJSON_Parse(config_json);
        FL_ASSERT(cfg);
        cJSON_AddItemToObject(meta, "config", cfg);
    }
    fl_ckpt_tensor tensors[3];
    int n = 0;
    const float *weights = model->params;
    if (optim) {
        if (optim->master) weights = optim->master;
        cJSON *o = cJSON_AddObjectToObject(meta, "optimizer");
        cJSON_AddStringToObject(o, "type", optim_kind_name(optim->cfg.kind));
        cJSON_AddNumberToObject(o, "t",
                                optim->cfg.kind == FL_OPT_ADAMW ? optim->adamw.t : optim->sgd.t);
        const fl_loss_scaler *s = &optim->scaler;
        cJSON *ls = cJSON_AddObjectToObject(meta, "loss_scaler");
        cJSON_AddNumberToObject(ls, "scale", s->scale);
        cJSON_AddNumberToObject(ls, "cur_hysteresis", s->cur_hysteresis);
        cJSON_AddNumberToObject(ls, "iter", (double)s->iter);
        cJSON_AddNumberToObject(ls, "last_overflow_iter", (double)s->last_overflow_iter);
    } else {
        FL_ASSERT(model->dtype == FL_F32);
    }
    tensors[n++] = (fl_ckpt_tensor){"weights", FL_F32, weights, model->table.numel};
    if (optim && optim->cfg.kind == FL_OPT_ADAMW) {
        tensors[n++] = (fl_ckpt_tensor){"adamw.m", FL_F32, optim->adamw.m, optim->adamw.numel};
        tensors[n++] = (fl_ckpt_tensor){"adamw.v", FL_F32, optim->adamw.v, optim->adamw.numel};
    } else if (optim && optim->sgd.buf) {
        tensors[n++] = (fl_ckpt_tensor){"sgd.momentum", FL_F32, optim->sgd.buf, optim->sgd.numel};
    }
    if (loader) {
        cJSON *l = cJSON_AddObjectToObject(meta, "loader");
        add_u64(l, "epoch", loader->epoch);
        add_u64(l, "index", loader->index);
        add_u64_array(l, "key", loader->key, 2);
        add_u64_array(l, "rng", loader->rng.s, 4);
    }
    char *text = cJSON_PrintUnformatted(meta);
    cJSON_Delete(meta);
    fl_ckpt_write(dir, step, text, tensors, n, keep);
    cJSON_free(text);
}

static cJSON *parse_meta(const fl_ckpt *ck) {
    cJSON *meta = cJSON_Parse(fl_ckpt_meta(ck));
    FL_ASSERT(meta); // fl_ckpt_open checked it
    return meta;
}

static void read_shape(const cJSON *meta, const char *path, fl_gpt2_config *cfg) {
    const cJSON *m = object(meta, "model", path);
    memset(cfg, 0, sizeof *cfg);
    cfg->n_layer = (int)number(m, "n_layer", path, 1, 1024);
    cfg->n_head = (int)number(m, "n_head", path, 1, 1 << 16);
    cfg->n_embd = (int)number(m, "n_embd", path, 1, 1 << 16);
    cfg->vocab_size = (int)number(m, "vocab_size", path, 1, 1 << 30);
    cfg->max_seq_len = (int)number(m, "max_seq_len", path, 1, 1 << 20);
    if (cfg->n_embd % cfg->n_head)
        fl_die("checkpoint %s: n_embd %d is not a multiple of n_head %d", path, cfg->n_embd,
               cfg->n_head);
}

void fl_ckpt_model_config(const fl_ckpt *ck, fl_gpt2_config *cfg) {
    cJSON *meta = parse_meta(ck);
    read_shape(meta, fl_ckpt_path(ck), cfg);
    cJSON_Delete(meta);
}

void fl_ckpt_load_model(const char *path, fl_gpt2 *model, fl_dtype dt, char *tokenizer,
                        size_t tokenizer_size) {
    fl_ckpt *ck = fl_ckpt_open(path);
    cJSON *meta = parse_meta(ck);
    fl_gpt2_config cfg;
    read_shape(meta, fl_ckpt_path(ck), &cfg);
    const char *tok = string(meta, "tokenizer", fl_ckpt_path(ck));
    if (strlen(tok) >= tokenizer_size)
        fl_die("checkpoint %s: tokenizer name too long", fl_ckpt_path(ck));
    strcpy(tokenizer, tok);
    cJSON_Delete(meta);
    // the shape is checked against the tensor before the model is allocated
    if (!fl_ckpt_has(ck, "weights")) fl_die("checkpoint %s has no weights", fl_ckpt_path(ck));
    fl_gpt2_init(model, &cfg, dt, 0);
    fl_ckpt_read(ck, "weights", dt, model->params, model->table.numel);
    fl_ckpt_close(ck);
}

char *fl_train_ckpt_config(const fl_ckpt *ck) {
    cJSON *meta = parse_meta(ck);
    const cJSON *cfg = object(meta, "config", fl_ckpt_path(ck));
    char *text = cJSON_PrintUnformatted(cfg);
    size_t n = strlen(text);
    char *out = fl_alloc(FL_MEM_OTHER, n + 1);
    memcpy(out, text, n + 1);
    cJSON_free(text);
    cJSON_Delete(meta);
    return out;
}

void fl_train_ckpt_restore(fl_ckpt *ck, fl_gpt2 *model, fl_optimizer *optim,
                           fl_loader_state *loader, const char *tokenizer) {
    const char *path = fl_ckpt_path(ck);
    cJSON *meta = parse_meta(ck);
    fl_gpt2_config shape;
    read_shape(meta, path, &shape);
    const fl_gpt2_config *c = &model->config;
    if (shape.n_layer != c->n_layer || shape.n_head != c->n_head || shape.n_embd != c->n_embd ||
        shape.vocab_size != c->vocab_size || shape.max_seq_len != c->max_seq_len)
        fl_die("checkpoint %s holds a model of n_layer %d, n_head %d, n_embd %d, vocab %d, "
               "max_seq_len %d; this run's model differs",
               path, shape.n_layer, shape.n_head, shape.n_embd, shape.vocab_size,
               shape.max_seq_len);
    const char *precision = string(meta, "precision", path);
    if (strcmp(precision, fl_dtype_name(model->dtype)))
        fl_die("checkpoint %s was trained in %s; this run is %s (a resume must keep the "
               "precision)",
               path, precision, fl_dtype_name(model->dtype));
    const char *tok = string(meta, "tokenizer", path);
    if (strcmp(tok, tokenizer))
        fl_die("checkpoint %s was trained with the %s tokenizer; this run's data uses %s", path,
               tok, tokenizer);
    const cJSON *o = object(meta, "optimizer", path);
    const char *kind = string(o, "type", path);
    if (strcmp(kind, optim_kind_name(optim->cfg.kind)))
        fl_die("checkpoint %s holds %s state; this run uses %s", path, kind,
               optim_kind_name(optim->cfg.kind));
    int t = (int)number(o, "t", path, 0, 1 << 30);

    size_t n = model->table.numel;
    float *weights = optim->master ? optim->master : model->params;
    fl_ckpt_read(ck, "weights", FL_F32, weights, n);
    if (optim->master) fl_convert(model->dtype, model->params, FL_F32, optim->master, n);
    if (optim->cfg.kind == FL_OPT_ADAMW) {
        fl_ckpt_read(ck, "adamw.m", FL_F32, optim->adamw.m, n);
        fl_ckpt_read(ck, "adamw.v", FL_F32, optim->adamw.v, n);
        optim->adamw.t = t;
    } else {
        if (optim->sgd.buf)
            fl_ckpt_read(ck, "sgd.momentum", FL_F32, optim->sgd.buf, n);
        else if (fl_ckpt_has(ck, "sgd.momentum"))
            fl_die("checkpoint %s holds SGD momentum; this run has momentum 0", path);
        optim->sgd.t = t;
    }
    const cJSON *ls = object(meta, "loss_scaler", path);
    fl_loss_scaler *s = &optim->scaler;
    s->scale = (float)number(ls, "scale", path, 0, 1e38);
    s->cur_hysteresis = (int)number(ls, "cur_hysteresis", path, 0, 1 << 30);
    s->iter = (long)number(ls, "iter", path, 0, 1e15);
    s->last_overflow_iter = (long)number(ls, "last_overflow_iter", path, -1, 1e15);

    const cJSON *l = object(meta, "loader", path);
    loader->epoch = hex_u64(cJSON_GetObjectItemCaseSensitive(l, "epoch"), path, "loader.epoch");
    loader->index = hex_u64(cJSON_GetObjectItemCaseSensitive(l, "index"), path, "loader.index");
    const cJSON *key = cJSON_GetObjectItemCaseSensitive(l, "key");
    const cJSON *rng = cJSON_GetObjectItemCaseSensitive(l, "rng");
    if (cJSON_GetArraySize(key) != 2 || cJSON_GetArraySize(rng) != 4)
        fl_die("checkpoint %s: loader.key or loader.rng is malformed", path);
    for (int i = 0; i < 2; i++)
        loader->key[i] = hex_u64(cJSON_GetArrayItem(key, i), path, "loader.key");
    for (int i = 0; i < 4; i++)
        loader->rng.s[i] = hex_u64(cJSON_GetArrayItem(rng, i), path, "loader.rng");
    cJSON_Delete(meta);
}
