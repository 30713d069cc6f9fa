// train_state.c: what a training checkpoint holds and how a run resumes from
// it. The weights are saved in fp32 (the master copy under mixed precision);
// the 16-bit weights are rounded from them again on resume, which gives back
// exactly the values the run was using, since every step ends that way.
// The fused optimizers (LOMO, AdaLomo) keep no master: their 16-bit weights
// are saved as they are. A data-parallel run saves each rank's shard of the
// flat buffer as pieces of the same named rows (fl_train_ckpt_save_dist), so
// a restore reads whatever range it owns from any number of shard files.
// Under pipeline parallelism a stage's table holds only its rows: each stage
// writes and reads its rows by name the same way.
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <omp.h>
#include <cJSON.h>

#include "fitlm/comm.h"
#include "fitlm/config.h"
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
    static const char *const names[] = {"adamw", "sgd", "lomo", "adalomo"};
    return names[k];
}

// Tensor names: one per table row, "model/<row>" for the fp32 weights and
// "optim/<state>/<row>" for each state tensor of the optimizer's rule (e.g.
// optim/m/h.0.attn.c_attn.weight), so a range of the flat buffer is a set of
// rows and a sharded checkpoint can be resharded by reading ranges. A state
// tensor holds fl_optim_state_numel floats for its row (the row's numel for
// elementwise rules; AdaLomo's row/column statistics), none is written where
// that is 0.
//
// Under LoRA the trained set is the adapters: "lora/<row>" and their
// optimizer's "optim/<state>/<row>"; a frozen base is not saved (it is the
// run's init_from, or its seed's), and a base trained by LOMO (LoRA + LOMO)
// is saved as "model/<row>" with "base_optim/<state>/<row>".
static void tensor_name(char *out, size_t size, const char *prefix, const char *state,
                        const char *row) {
    int n = state ? snprintf(out, size, "%s/%s/%s", prefix, state, row)
                  : snprintf(out, size, "%s/%s", prefix, row);
    FL_ASSERT(n > 0 && (size_t)n < size);
}

enum { NAME_MAX_ = 112 };

// The ranks that read data apart: the world, whose tensor-parallel groups
// and pipelines (Megatron's layout) read the same windows: d = world / (t p).
static int data_ranks(const fl_model *m) {
    return fl_comm_size() / (m->tp.size * m->pp.size);
}

// One parameter set of a checkpoint: its rows' weights (the optimizer's
// fp32 master, else the model's own values) and its optimizer's state.
typedef struct {
    const char *weights, *state; // tensor name prefixes
    const fl_param_table *t;
    void *values; // the model's values (dtype)
    fl_optimizer *optim;
    const fl_device *dev; // where values, the master and the state are
} param_set;

// The sets of a model trained by optim (and, under LoRA + LOMO, base).
static int param_sets(const fl_model *m, const fl_optimizer *optim, const fl_optimizer *base,
                      param_set *out) {
    const fl_device *dev = m->dev; // its optimizers' too
    // an optimizer in host memory while the model is on a device
    // (ZeRO-Offload): its host copy of the weights (or of the adapters), in
    // step with the model's
    int host = optim && optim->dev && optim->dev != dev;
    const fl_device *at = host ? optim->dev : dev;
    if (!m->lora.cfg.r) {
        out[0] = (param_set){
            "model", "optim", &m->table, host ? optim->params : m->params, (fl_optimizer *)optim,
            at};
        return 1;
    }
    out[0] = (param_set){"lora",
                         "optim",
                         &m->lora.table,
                         host ? optim->params : m->lora.params,
                         (fl_optimizer *)optim,
                         at};
    if (!base) return 1;
    out[1] = (param_set){"model", "base_optim", &m->table, m->params, (fl_optimizer *)base, dev};
    return 2;
}

// The spike guard's windows, oldest first (cJSON writes a double so that it
// reads back exactly): a resume judges against the same values.
static void add_spike_series(cJSON *j, const char *key, const fl_spike_series *s, int window) {
    cJSON *arr = cJSON_AddArrayToObject(j, key);
    for (int i = 0; i < s->count; i++)
        cJSON_AddItemToArray(arr,
                             cJSON_CreateNumber(s->v[(s->next - s->count + i + window) % window]));
}

static void add_optim_meta(cJSON *meta, const char *key, const fl_optimizer *o) {
    cJSON *j = cJSON_AddObjectToObject(meta, key);
    cJSON_AddStringToObject(j, "type", optim_kind_name(o->cfg.kind));
    cJSON_AddNumberToObject(j, "t", *fl_optim_step_count(o->rule));
    const fl_spike_guard *g = &o->spike;
    if (!fl_spike_guard_on(g)) return;
    cJSON *sg = cJSON_AddObjectToObject(j, "spike_guard");
    add_spike_series(sg, "loss", &g->loss, g->cfg.window);
    add_spike_series(sg, "grad_norm", &g->norm, g->cfg.window);
    cJSON_AddNumberToObject(sg, "in_row", g->in_row);
    cJSON_AddNumberToObject(sg, "skipped", (double)g->skipped);
}

void fl_train_ckpt_save(const char *dir, int step, const fl_model *model, const fl_optimizer *optim,
                        const fl_optimizer *base, const fl_loader_state *loader,
                        const fl_tokenizer_files *tokenizer, const char *config_json, int keep) {
    fl_train_ckpt_save_run(dir, step, model, optim, base, loader, tokenizer, config_json, keep,
                           NULL);
}

// The replicated part of a training checkpoint (the meta): the shape,
// precision, tokenizer, config, optimizer step count and loss scaler, and
// the loader's position with the world size it was taken in.
static char *train_meta(const fl_model *model, const fl_optimizer *optim, const fl_optimizer *base,
                        const fl_loader_state *loader, const char *tokenizer,
                        const char *config_json) {
    const fl_model_config *c = &model->config;
    cJSON *meta = cJSON_CreateObject();
    cJSON *m = cJSON_AddObjectToObject(meta, "model");
    cJSON_AddStringToObject(m, "arch", fl_arch_name(c->arch));
    cJSON_AddNumberToObject(m, "n_layer", c->n_layer);
    cJSON_AddNumberToObject(m, "n_head", c->n_head);
    cJSON_AddNumberToObject(m, "n_kv_head", c->n_kv_head);
    cJSON_AddNumberToObject(m, "n_embd", c->n_embd);
    cJSON_AddNumberToObject(m, "intermediate_size", c->intermediate_size);
    cJSON_AddNumberToObject(m, "vocab_size", c->vocab_size);
    cJSON_AddNumberToObject(m, "max_seq_len", c->max_seq_len);
    cJSON_AddNumberToObject(m, "norm_eps", c->norm_eps);
    cJSON_AddNumberToObject(m, "rope_theta", c->rope_theta);
    cJSON_AddBoolToObject(m, "tie_embeddings", c->tie_embeddings);
    cJSON_AddStringToObject(meta, "precision", fl_dtype_name(model->dtype));
    cJSON_AddStringToObject(meta, "tokenizer", tokenizer);
    // reductions split by thread: a resume with another count is not bitwise
    cJSON_AddNumberToObject(meta, "threads", omp_get_max_threads());
    if (config_json) {
        cJSON *cfg = cJSON_Parse(config_json);
        FL_ASSERT(cfg);
        cJSON_AddItemToObject(meta, "config", cfg);
    }
    if (model->lora.cfg.r) {
        const fl_lora_config *lc = &model->lora.cfg;
        cJSON *l = cJSON_AddObjectToObject(meta, "lora");
        cJSON_AddNumberToObject(l, "r", lc->r);
        cJSON_AddNumberToObject(l, "lora_alpha", lc->alpha);
        cJSON_AddBoolToObject(l, "train_base", lc->train_base);
    }
    if (optim) {
        add_optim_meta(meta, "optimizer", optim);
        if (base) add_optim_meta(meta, "base_optimizer", base);
        const fl_loss_scaler *s = &optim->scaler;
        cJSON *ls = cJSON_AddObjectToObject(meta, "loss_scaler");
        cJSON_AddNumberToObject(ls, "scale", s->scale);
        cJSON_AddNumberToObject(ls, "cur_hysteresis", s->cur_hysteresis);
        cJSON_AddNumberToObject(ls, "iter", (double)s->iter);
        cJSON_AddNumberToObject(ls, "last_overflow_iter", (double)s->last_overflow_iter);
    } else {
        FL_ASSERT(model->dtype == FL_F32);
    }
    if (loader) {
        cJSON *l = cJSON_AddObjectToObject(meta, "loader");
        add_u64(l, "epoch", loader->epoch);
        add_u64(l, "index", loader->index);
        add_u64_array(l, "key", loader->key, 2);
        add_u64_array(l, "rng", loader->rng.s, 4);
        // every rank took `index` windows of the epoch's order: the world
        // consumed index * world, which another world size splits anew
        cJSON_AddNumberToObject(l, "world", data_ranks(model));
    }
    char *text = cJSON_PrintUnformatted(meta);
    cJSON_Delete(meta);
    return text;
}

// A set's tensors, as a checkpoint file lists them.
typedef struct {
    fl_ckpt_piece *t;
    char (*names)[NAME_MAX_];
    size_t n, cap;
} tensor_list;

static void list_init(tensor_list *l, size_t cap) {
    l->t = fl_alloc(FL_MEM_OTHER, (cap ? cap : 1) * sizeof *l->t);
    l->names = fl_alloc(FL_MEM_OTHER, (cap ? cap : 1) * NAME_MAX_);
    l->n = 0;
    l->cap = cap;
}

static void list_free(tensor_list *l) {
    fl_free(l->t);
    fl_free(l->names);
}

// The fp32 weights of flat element i of a set (the master under mixed
// precision), else the model's weights (the optimizer's params, which under
// ZeRO-3 start at params_first).
static const void *weights_at(const param_set *s, fl_dtype dt, size_t i) {
    const fl_optimizer *o = s->optim;
    if (o && o->master) return o->master + (i - o->rule->window_begin);
    if (o) return fl_at_const(dt, o->params, i - o->params_first);
    return fl_at_const(dt, s->values, i);
}

// The tensors of a set over the flat range [b, e): "<weights>/<row>", then
// each state's "<state>/<name>/<row>". pieces 0: whole rows (the range is
// the whole buffer); 1: each row's part inside the range, with its first
// element and the row's size (a shard file).
typedef struct {
    tensor_list *out;
    const char *name;
    fl_dtype dt;
    const void *data; // element `at` of the row's data
    size_t at, total; // total: the whole row's elements
    const fl_device *dev;
} tp_pieces;

static void add_block(void *ctx, size_t local, size_t first, size_t run, size_t stride,
                      size_t count) {
    tp_pieces *p = ctx;
    tensor_list *out = p->out;
    FL_ASSERT(out->n < out->cap);
    int strided = run < count;
    out->t[out->n++] = (fl_ckpt_piece){p->name,
                                       p->dt,
                                       fl_at_const(p->dt, p->data, local - p->at),
                                       count,
                                       first,
                                       p->total,
                                       strided ? run : 0,
                                       strided ? stride : 0,
                                       p->dev};
}

// State tensor k of row r of t (k < 0: the weights) as a row of its own
// (*sv), in a one-row table with t's split: how a rank's part of it lies in
// the whole tensor (AdaLomo's row and column statistics split apart from
// their row, fl_optim_state_view).
static fl_param_table tensor_row(const fl_param_table *t, int r, const fl_optim_rule *rule, int k,
                                 fl_param_view *sv) {
    *sv = k < 0 ? t->views[r] : fl_optim_state_view(rule, k, &t->views[r]);
    return (fl_param_table){.views = sv,
                            .count = 1,
                            .capacity = 1,
                            .numel = sv->numel,
                            .tp_size = t->tp_size,
                            .tp_rank = t->tp_rank};
}

static void collect(const param_set *s, fl_dtype model_dt, size_t b, size_t e, int pieces,
                    tensor_list *out) {
    const fl_param_table *t = s->t;
    int tp = t->tp_size > 1;
    fl_optim_rule *rule = s->optim ? s->optim->rule : NULL;
    int nstate = rule ? fl_optim_state_count(rule) : 0;
    // fp32, or 16-bit weights without a master (LOMO, AdaLomo)
    fl_dtype wdt = s->optim && s->optim->master ? FL_F32 : model_dt;
    FL_ASSERT(s->optim || model_dt == FL_F32);
    for (int st = -1; st < nstate; st++) {
        for (int r = 0; r < t->count; r++) {
            const fl_param_view *v = &t->views[r];
            fl_param_view sv;
            fl_param_table one = tensor_row(t, r, rule, st, &sv);
            size_t lo = v->offset > b ? v->offset : b;
            size_t hi = v->offset + v->numel < e ? v->offset + v->numel : e;
            size_t total = sv.numel;
            if (lo >= hi || total == 0) continue;
            if (tp && sv.tp_dim < 0 && t->tp_rank > 0) continue; // TP rank 0 writes it
            if (v->flags & FL_PARAM_TIED_COPY) continue;         // stage 0 writes the embedding
            size_t first = lo - v->offset, count = hi - lo;
            const void *data;
            if (st < 0) {
                data = weights_at(s, wdt, lo);
            } else if (total != v->numel) { // per-row state (AdaLomo): whole rows only
                FL_ASSERT(first == 0 && count == v->numel);
                data = fl_optim_state_ptr(rule, st, v->offset);
                count = total;
            } else {
                data = fl_optim_state_ptr(rule, st, lo);
            }
            FL_ASSERT(out->n < out->cap);
            char *name = out->names[out->n];
            tensor_name(name, NAME_MAX_, st < 0 ? s->weights : s->state,
                        st < 0 ? NULL : fl_optim_state_name(rule, st), v->name);
            if (tp) { // this rank's slice, as blocks of the whole tensor
                FL_ASSERT(pieces);
                tp_pieces p = {out,   name,  st < 0 ? wdt : FL_F32,
                               data,  first, fl_params_whole_numel(&one, 0),
                               s->dev};
                fl_params_blocks(&one, 0, first, first + count, add_block, &p); // one name for all
                continue;
            }
            out->t[out->n++] = (fl_ckpt_piece){.name = name,
                                               .dtype = st < 0 ? wdt : FL_F32,
                                               .data = data,
                                               .numel = count,
                                               .first = pieces ? first : 0,
                                               .total = pieces ? total : 0,
                                               .dev = s->dev};
        }
    }
}

// Upper bound of the tensors of the sets.
static size_t count_tensors(const param_set *sets, int nsets) {
    size_t n = 0;
    for (int i = 0; i < nsets; i++)
        n += (size_t)sets[i].t->count *
             (1 + (sets[i].optim ? fl_optim_state_count(sets[i].optim->rule) : 0));
    // a tensor-parallel slice: up to 3 parts (c_attn's Q, K, V), each cut
    // by a range into up to 3 blocks
    return sets[0].t->tp_size > 1 ? 9 * n : n;
}

// The tokenizer's files as a checkpoint stores them: "tokenizer/<file>".
typedef struct {
    fl_ckpt_file f[FL_TOKENIZER_FILES];
    char names[FL_TOKENIZER_FILES][64];
} tokenizer_blobs;

static int tokenizer_files(const fl_tokenizer_files *tok, tokenizer_blobs *b) {
    for (int i = 0; i < tok->n; i++) {
        snprintf(b->names[i], sizeof b->names[i], "tokenizer/%s", tok->file[i]);
        b->f[i] = (fl_ckpt_file){b->names[i], tok->data[i], tok->size[i]};
    }
    return tok->n;
}

void fl_train_ckpt_save_run(const char *dir, int step, const fl_model *model,
                            const fl_optimizer *optim, const fl_optimizer *base,
                            const fl_loader_state *loader, const fl_tokenizer_files *tokenizer,
                            const char *config_json, int keep, const char *run) {
    char *text = train_meta(model, optim, base, loader, tokenizer->name, config_json);
    param_set sets[2];
    int nsets = param_sets(model, optim, base, sets);
    tensor_list l;
    list_init(&l, count_tensors(sets, nsets));
    for (int i = 0; i < nsets; i++) collect(&sets[i], model->dtype, 0, sets[i].t->numel, 0, &l);
    tokenizer_blobs blobs;
    int n_files = tokenizer_files(tokenizer, &blobs);
    fl_ckpt_write_whole(dir, step, text, l.t, (int)l.n, keep, run, blobs.f, n_files);
    cJSON_free(text);
    list_free(&l);
}

void fl_train_ckpt_save_dist(const char *dir, int step, const fl_model *model,
                             const fl_optimizer *optim, const fl_loader_state *loader,
                             const fl_tokenizer_files *tokenizer, const char *config_json, int keep,
                             const char *run) {
    FL_ASSERT(optim && !model->lora.cfg.r); // dist.h trains whole models only
    size_t b = optim->rule->state_begin, e = optim->rule->state_end, numel = model->table.numel;
    double partial = b != 0 || e != numel; // ZeRO: a shard per rank
    fl_comm_max(fl_comm_world(), &partial, 1);
    // tensor and pipeline parallelism: every TP rank its slices of its
    // stage's rows, of its range (a ZeRO shard), or, where the data-parallel
    // ranks hold the same (DDP), those of data-parallel rank 0 alone
    int tp = model->tp.size > 1, pp = model->pp.size > 1, tp_rank, dp_rank, pp_rank;
    fl_layout_coords(fl_comm_size(), model->tp.size, model->pp.size, fl_comm_rank(), &tp_rank,
                     &dp_rank, &pp_rank);
    int writes = partial != 0.0 || dp_rank == 0;
    char *text = train_meta(model, optim, NULL, loader, tokenizer->name, config_json);
    param_set sets[2];
    param_sets(model, optim, NULL, sets);
    tensor_list l;
    list_init(&l, count_tensors(sets, 1));
    char shard_meta[192] = "{}";
    if (tp || pp) {
        if (writes) collect(&sets[0], model->dtype, b, e, 1, &l);
        snprintf(shard_meta, sizeof shard_meta,
                 "{\"tensor_parallel\":{\"size\":%d,\"rank\":%d},\"pipeline_parallel\":{"
                 "\"size\":%d,\"rank\":%d},\"range\":{\"begin\":%zu,\"end\":%zu}}",
                 model->tp.size, model->tp.rank, model->pp.size, model->pp.rank, b, e);
    } else if (partial) {
        collect(&sets[0], model->dtype, b, e, 1, &l);
        snprintf(shard_meta, sizeof shard_meta, "{\"range\":{\"begin\":%zu,\"end\":%zu}}", b, e);
    } else if (fl_comm_rank() == 0) { // DDP: rank 0 writes today's single file
        collect(&sets[0], model->dtype, 0, numel, 0, &l);
    }
    tokenizer_blobs blobs;
    int n_files = tokenizer_files(tokenizer, &blobs);
    fl_ckpt_write_dist(dir, step, text, shard_meta, l.t, (int)l.n, tp || pp || partial != 0.0, keep,
                       run, blobs.f, n_files);
    cJSON_free(text);
    list_free(&l);
}

// Reads the elements [b, e) of a set's weights into dst (fp32 or dt; dst[0]
// is element b) row by row: each row's part inside the range. Checkpoints
// written before the by-name layout hold the whole buffer as one tensor
// (`legacy`, in the same table order): read as such.
typedef struct {
    fl_ckpt *ck;
    const char *name;
    fl_dtype dt;
    const fl_device *dev; // dst's
    void *dst;            // element `at` of the row
    size_t at;
} tp_read;

static void read_block(void *ctx, size_t local, size_t first, size_t run, size_t stride,
                       size_t count) {
    const tp_read *r = ctx;
    fl_ckpt_read_runs_to(r->ck, r->name, r->dt, r->dev, fl_at(r->dt, r->dst, local - r->at), first,
                         run, stride, count);
}

// Elements [lo, hi) of row r (of t) of tensor `name` into dst: a range of
// the whole row, or under tensor parallelism this rank's slice's part,
// whatever the layout that saved it. Dies unless the tensor has the whole
// row's size.
static void read_row_part(fl_ckpt *ck, const fl_param_table *t, int r, const char *name,
                          fl_dtype dt, const fl_device *dev, void *dst, size_t lo, size_t hi) {
    size_t whole = fl_params_whole_numel(t, r);
    if (fl_ckpt_numel(ck, name) != whole) // dies naming the sizes (or the missing tensor)
        fl_ckpt_read(ck, name, dt, dst, whole);
    if (t->tp_size <= 1) {
        fl_ckpt_read_range_to(ck, name, dt, dev, dst, lo, hi - lo);
        return;
    }
    tp_read rd = {ck, name, dt, dev, dst, lo};
    fl_params_blocks(t, r, lo, hi, read_block, &rd);
}

static void read_rows_range(fl_ckpt *ck, const fl_param_table *t, const char *prefix,
                            const char *legacy, fl_dtype dt, const fl_device *dev, void *dst,
                            size_t b, size_t e) {
    if (b >= e) return;
    if (legacy && fl_ckpt_has(ck, legacy)) {
        if (t->tp_size > 1)
            fl_die("checkpoint %s holds its weights in the layout before by-name tensors: resume "
                   "it without tensor parallelism first",
                   fl_ckpt_path(ck));
        if (fl_ckpt_numel(ck, legacy) != t->numel)
            fl_die("checkpoint %s: tensor '%s' has %zu elements, this model needs %zu",
                   fl_ckpt_path(ck), legacy, fl_ckpt_numel(ck, legacy), t->numel);
        fl_ckpt_read_range_to(ck, legacy, dt, dev, dst, b, e - b);
        return;
    }
    for (int r = 0; r < t->count; r++) {
        const fl_param_view *v = &t->views[r];
        size_t lo = v->offset > b ? v->offset : b;
        size_t hi = v->offset + v->numel < e ? v->offset + v->numel : e;
        if (lo >= hi) continue;
        char name[NAME_MAX_];
        tensor_name(name, sizeof name, prefix, NULL, v->name);
        read_row_part(ck, t, r, name, dt, dev, fl_at(dt, dst, lo - b), lo - v->offset,
                      hi - v->offset);
    }
}

static cJSON *parse_meta(const fl_ckpt *ck) {
    cJSON *meta = cJSON_Parse(fl_ckpt_meta(ck));
    FL_ASSERT(meta); // fl_ckpt_open checked it
    return meta;
}

static void read_shape(const cJSON *meta, const char *path, fl_model_config *cfg) {
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
    // checkpoints from before LLaMA hold GPT-2 and no more keys
    if (!cJSON_GetObjectItemCaseSensitive(m, "arch")) return;
    if (fl_arch_parse(string(m, "arch", path), &cfg->arch))
        fl_die("checkpoint %s: unknown model.arch '%s'", path, string(m, "arch", path));
    cfg->n_kv_head = (int)number(m, "n_kv_head", path, 1, 1 << 16);
    cfg->intermediate_size = (int)number(m, "intermediate_size", path, 1, 1 << 20);
    cfg->norm_eps = (float)number(m, "norm_eps", path, 1e-30, 1);
    if (cfg->arch == FL_ARCH_LLAMA) cfg->rope_theta = (float)number(m, "rope_theta", path, 1, 1e12);
    const cJSON *tie = cJSON_GetObjectItemCaseSensitive(m, "tie_embeddings");
    if (!cJSON_IsBool(tie)) fl_die("checkpoint %s: 'tie_embeddings' is missing", path);
    cfg->tie_embeddings = cJSON_IsTrue(tie);
}

// Elements of adapter row `row` ("<module>.lora_A.weight" (r, in) or
// ".lora_B.weight" (out, r)) of rank r on base table t; 0 when no 2-D base
// row "<module>.weight" exists.
static size_t lora_numel(const fl_param_table *t, const char *row, int r) {
    static const char *const suffix[2] = {".lora_A.weight", ".lora_B.weight"};
    size_t len = strlen(row);
    for (int ab = 0; ab < 2; ab++) {
        size_t sl = strlen(suffix[ab]);
        if (len <= sl || strcmp(row + len - sl, suffix[ab])) continue;
        char base[NAME_MAX_];
        snprintf(base, sizeof base, "%.*s.weight", (int)(len - sl), row);
        int b = fl_params_find(t, base);
        if (b < 0 || t->views[b].ndim != 2) return 0;
        return (size_t)r * t->views[b].shape[ab ? 0 : 1];
    }
    return 0;
}

static void shape_mismatch(const char *path, const fl_model_config *c, const char *tensor,
                           const char *what) {
    fl_die("checkpoint %s: tensor '%s' %s the model its header describes (%s, n_layer %d, n_head "
           "%d, n_embd %d, vocab %d, max_seq_len %d): the header and the tensors disagree",
           path, tensor, what, fl_arch_name(c->arch), c->n_layer, c->n_head, c->n_embd,
           c->vocab_size, c->max_seq_len);
}

void fl_ckpt_check_shape(const fl_ckpt *ck) {
    const char *path = fl_ckpt_path(ck);
    cJSON *meta = parse_meta(ck);
    fl_model_config cfg;
    read_shape(meta, path, &cfg);
    const cJSON *lora = cJSON_GetObjectItemCaseSensitive(meta, "lora");
    int r = lora ? (int)number(lora, "r", path, 1, 1 << 16) : 0;
    cJSON_Delete(meta);
    fl_param_table t; // the views only: no parameters are allocated
    fl_model_table(&t, &cfg);
    int n_model = 0;
    char msg[96];
    for (int i = 0; i < fl_ckpt_tensor_count(ck); i++) {
        const char *name = fl_ckpt_tensor_name(ck, i);
        size_t want;
        if (!strncmp(name, "model/", 6)) {
            int row = fl_params_find(&t, name + 6);
            if (row < 0) shape_mismatch(path, &cfg, name, "is not a parameter of");
            want = t.views[row].numel;
            n_model++;
        } else if (!strncmp(name, "lora/", 5)) {
            if (!r) shape_mismatch(path, &cfg, name, "is an adapter, with no meta.lora, of");
            want = lora_numel(&t, name + 5, r);
            if (!want) shape_mismatch(path, &cfg, name, "adapts no linear layer of");
        } else if (!strcmp(name, "weights")) { // the layout before by-name tensors
            want = t.numel;
        } else {
            continue; // optimizer state: its sizes are the rule's, checked on restore
        }
        size_t got = fl_ckpt_numel(ck, name);
        if (got != want) {
            snprintf(msg, sizeof msg, "holds %zu elements, not the %zu of", got, want);
            shape_mismatch(path, &cfg, name, msg);
        }
    }
    // a whole model (always, but for LoRA adapters on a base saved elsewhere)
    if (n_model || (!r && !fl_ckpt_has(ck, "weights")))
        for (int row = 0; row < t.count; row++) {
            char name[NAME_MAX_];
            tensor_name(name, sizeof name, "model", NULL, t.views[row].name);
            if (!fl_ckpt_has(ck, name)) shape_mismatch(path, &cfg, name, "is missing for");
        }
    fl_params_free(&t);
}

void fl_ckpt_model_config(const fl_ckpt *ck, fl_model_config *cfg) {
    cJSON *meta = parse_meta(ck);
    read_shape(meta, fl_ckpt_path(ck), cfg);
    cJSON_Delete(meta);
    fl_model_config_finish(cfg);
    fl_ckpt_check_shape(ck); // callers allocate by this shape
}

void fl_ckpt_tokenizer(const fl_ckpt *ck, fl_tokenizer_files *f) {
    memset(f, 0, sizeof *f);
    cJSON *meta = parse_meta(ck);
    const char *name = string(meta, "tokenizer", fl_ckpt_path(ck));
    if (strlen(name) >= sizeof f->name)
        fl_die("checkpoint %s: tokenizer name too long", fl_ckpt_path(ck));
    strcpy(f->name, name);
    cJSON_Delete(meta);
    snprintf(f->from, sizeof f->from, "checkpoint %s (its stored copy)", fl_ckpt_path(ck));
    static const char *const names[] = {"encoder.json", "vocab.bpe", "tokenizer.json",
                                        "tokenizer_config.json"};
    for (int i = 0; i < 4; i++) {
        char blob[64], where[FL_TOKENIZER_WHERE];
        size_t size;
        snprintf(blob, sizeof blob, "tokenizer/%s", names[i]);
        uint8_t *data = fl_ckpt_file_read(ck, blob, &size);
        if (!data) continue;
        if (f->n == FL_TOKENIZER_FILES)
            fl_die("checkpoint %s holds more tokenizer files than the %s tokenizer has",
                   fl_ckpt_path(ck), f->name);
        snprintf(where, sizeof where, "%s (stored in checkpoint %s)", names[i], fl_ckpt_path(ck));
        fl_tokenizer_files_add(f, names[i], data, size, where);
    }
    // the files a load needs, in the order it takes them
    int gpt2 = !strcmp(f->name, "gpt2"), hf = !strcmp(f->name, "hf");
    if ((gpt2 && f->n && (f->n != 2 || strcmp(f->file[1], "vocab.bpe"))) ||
        (hf && f->n && strcmp(f->file[0], "tokenizer.json")) || (!gpt2 && !hf && f->n))
        fl_die("checkpoint %s: its stored tokenizer files are not those of the %s tokenizer",
               fl_ckpt_path(ck), f->name);
    snprintf(f->missing, sizeof f->missing,
             "checkpoint %s holds no copy of its %s tokenizer (it was saved before checkpoints "
             "held their tokenizer's files): name them with --tokenizer-path; the path its run "
             "used is never read, as the checkpoint does not contain it",
             fl_ckpt_path(ck), f->name);
}

int fl_source_tokenizer(const char *source, fl_tokenizer_files *f) {
    if (fl_is_checkpoint(source)) {
        fl_ckpt *ck = fl_ckpt_open(source);
        fl_ckpt_tokenizer(ck, f);
        fl_ckpt_close(ck);
        return 1;
    }
    char json[FL_FILE_PATH_MAX + 32];
    snprintf(json, sizeof json, "%s/tokenizer.json", source);
    int hf = access(json, R_OK) == 0;
    fl_tokenizer_files_read(f, hf ? "hf" : "gpt2", hf ? source : NULL);
    return hf;
}

// A checkpoint as a weight source: its model rows ("model/<row>", or the
// buffer of the layout before by-name tensors), read in the model's dtype
// straight into the range the model holds.
typedef struct {
    fl_ckpt *ck;
    int owned;        // opened by the source, closed with it
    const char *path; // as given, for messages
} ckpt_source;

static void ckpt_check(fl_weight_source *s, const fl_param_table *t, const fl_quant_config *q) {
    const ckpt_source *c = s->state;
    if (q)
        fl_die("%s: NF4 quantisation (--quantize nf4) loads a Hugging Face model directory "
               "(config.json + safetensors), not a fitlm checkpoint",
               c->path);
    cJSON *meta = parse_meta(c->ck);
    int adapters = cJSON_GetObjectItemCaseSensitive(meta, "lora") != NULL;
    cJSON_Delete(meta);
    char first[NAME_MAX_];
    tensor_name(first, sizeof first, "model", NULL, t->views[0].name);
    if (adapters && !fl_ckpt_has(c->ck, first))
        fl_die("checkpoint %s holds LoRA adapters, not a whole model: load its base (the run's "
               "init_from) with the adapters in PEFT's format, e.g. --adapter OUT/adapter",
               fl_ckpt_path(c->ck));
}

static void ckpt_fill(fl_weight_source *s, fl_model *m) {
    const ckpt_source *c = s->state;
    read_rows_range(c->ck, &m->table, "model", "weights", m->dtype, m->dev, m->params,
                    m->params_begin, m->params_end);
}

static void ckpt_close(fl_weight_source *s) {
    ckpt_source *c = s->state;
    if (c->owned) fl_ckpt_close(c->ck);
    fl_free(c);
}

static void ckpt_source_of(fl_weight_source *s, fl_ckpt *ck, int owned, const char *path) {
    ckpt_source *c = fl_alloc(FL_MEM_OTHER, sizeof *c);
    c->ck = ck;
    c->owned = owned;
    c->path = path;
    memset(s, 0, sizeof *s);
    fl_ckpt_model_config(ck, &s->config); // checked against the tensors
    s->state = c;
    s->check = ckpt_check;
    s->fill = ckpt_fill;
    s->close = ckpt_close;
}

void fl_ckpt_source(fl_weight_source *s, fl_ckpt *ck) {
    ckpt_source_of(s, ck, 0, fl_ckpt_path(ck));
}

void fl_ckpt_source_open(fl_weight_source *s, const char *path) {
    ckpt_source_of(s, fl_ckpt_open(path), 1, path);
}

void fl_ckpt_load_model(const char *path, fl_model *model, fl_dtype dt, char *tokenizer,
                        size_t tokenizer_size) {
    fl_weight_source s;
    fl_ckpt_source_open(&s, path);
    const fl_ckpt *ck = ((const ckpt_source *)s.state)->ck;
    cJSON *meta = parse_meta(ck);
    const char *tok = string(meta, "tokenizer", fl_ckpt_path(ck));
    if (strlen(tok) >= tokenizer_size)
        fl_die("checkpoint %s: tokenizer name too long", fl_ckpt_path(ck));
    strcpy(tokenizer, tok);
    cJSON_Delete(meta);
    fl_model_init_from(model, &s, dt, NULL, 0, SIZE_MAX);
    fl_weight_source_close(&s);
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

int fl_train_ckpt_world(const fl_ckpt *ck) {
    cJSON *meta = parse_meta(ck);
    const cJSON *l = cJSON_GetObjectItemCaseSensitive(meta, "loader");
    const cJSON *w = cJSON_GetObjectItemCaseSensitive(l, "world");
    int n = cJSON_IsNumber(w) && w->valuedouble >= 1 && w->valuedouble <= 1 << 20
                ? (int)w->valuedouble
                : 1; // checkpoints from before data parallelism
    cJSON_Delete(meta);
    return n;
}

int fl_train_ckpt_threads(const fl_ckpt *ck) {
    cJSON *meta = parse_meta(ck);
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(meta, "threads");
    int n = cJSON_IsNumber(t) && t->valuedouble >= 1 && t->valuedouble <= 1 << 20
                ? (int)t->valuedouble
                : 0;
    cJSON_Delete(meta);
    return n;
}

// The optimizer's kind and step count, checked against meta[key].
static void restore_optim_meta(const cJSON *meta, const char *key, const char *path,
                               fl_optimizer *o) {
    const cJSON *j = object(meta, key, path);
    const char *kind = string(j, "type", path);
    if (strcmp(kind, optim_kind_name(o->cfg.kind)))
        fl_die("checkpoint %s holds %s state; this run uses %s", path, kind,
               optim_kind_name(o->cfg.kind));
    *fl_optim_step_count(o->rule) = (int)number(j, "t", path, 0, 1 << 30);
    const cJSON *sg = cJSON_GetObjectItemCaseSensitive(j, "spike_guard");
    fl_spike_guard *g = &o->spike;
    if (!sg || !fl_spike_guard_on(g)) return; // a checkpoint from before the guard, or it is off
    const char *names[2] = {"loss", "grad_norm"};
    fl_spike_series *series[2] = {&g->loss, &g->norm};
    for (int k = 0; k < 2; k++) {
        const cJSON *arr = cJSON_GetObjectItemCaseSensitive(sg, names[k]);
        if (!cJSON_IsArray(arr))
            fl_die("checkpoint %s: '%s.spike_guard.%s' is missing", path, key, names[k]);
        int n = cJSON_GetArraySize(arr), i = 0;
        const cJSON *v;
        cJSON_ArrayForEach(v, arr) {
            if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble))
                fl_die("checkpoint %s: '%s.spike_guard.%s' holds a value that is not a finite "
                       "number",
                       path, key, names[k]);
            // a smaller window now keeps the newest values
            if (i++ >= n - g->cfg.window) fl_spike_push(series[k], g->cfg.window, v->valuedouble);
        }
    }
    g->in_row = (int)number(sg, "in_row", path, 0, 1 << 30);
    g->skipped = (long)number(sg, "skipped", path, 0, 1e15);
}

// A set's weights and its optimizer's state tensors (and those of the layout
// before by-name tensors). The optimizer covers [b, e) of the flat buffer
// (a rank's shard under ZeRO, else all of it): its master and state are read
// there, the model's own weights whole (every rank computes with all of
// them until fl_dist_attach shards them).
static void restore_set(fl_ckpt *ck, const fl_model *model, const param_set *s) {
    const fl_param_table *t = s->t;
    fl_optimizer *optim = s->optim;
    size_t n = t->numel;
    fl_optim_rule *rule = optim->rule;
    size_t b = rule->state_begin, e = rule->state_end;
    const char *legacy_weights = strcmp(s->weights, "model") ? NULL : "weights";
    // the weights the model holds: all, or a ZeRO-3 rank's shard
    size_t pb = 0, pe = n;
    if (s->values == model->params && fl_model_sharded(model)) {
        pb = model->params_begin;
        pe = model->params_end;
    }
    const fl_device *dev = s->dev;
    if (optim->master) {
        read_rows_range(ck, t, s->weights, legacy_weights, FL_F32, dev, optim->master, b, e);
        if (b == pb && e == pe) // the 16-bit weights, rounded from the fp32 ones as steps end
            dev->convert(model->dtype, s->values, FL_F32, optim->master, e - b);
        else
            read_rows_range(ck, t, s->weights, legacy_weights, model->dtype, dev, s->values, pb,
                            pe);
    } else { // fp32, or 16-bit weights without a master
        read_rows_range(ck, t, s->weights, legacy_weights, model->dtype, dev, s->values, pb, pe);
    }
    static const char *const legacy[2][2] = {{"adamw.m", "adamw.v"}, {"sgd.momentum", NULL}};
    int nstate = fl_optim_state_count(rule);
    for (int k = 0; k < nstate && b < e; k++) {
        const char *old = optim->cfg.kind <= FL_OPT_SGD ? legacy[optim->cfg.kind][k] : NULL;
        if (old && legacy_weights && fl_ckpt_has(ck, old)) {
            if (fl_ckpt_numel(ck, old) != n)
                fl_die("checkpoint %s: tensor '%s' has %zu elements, this model needs %zu",
                       fl_ckpt_path(ck), old, fl_ckpt_numel(ck, old), n);
            fl_ckpt_read_range_to(ck, old, FL_F32, dev, fl_optim_state_ptr(rule, k, b), b, e - b);
            continue;
        }
        for (int r = 0; r < t->count; r++) { // per row: its own size, the part in [b, e)
            const fl_param_view *v = &t->views[r];
            // a pipeline's copy of the tied embedding: frozen, no state (stage 0's is the row's)
            if (v->flags & FL_PARAM_TIED_COPY) continue;
            fl_param_view sv;
            fl_param_table one = tensor_row(t, r, rule, k, &sv);
            size_t lo = v->offset > b ? v->offset : b;
            size_t hi = v->offset + v->numel < e ? v->offset + v->numel : e;
            if (sv.numel == 0 || lo >= hi) continue;
            char name[NAME_MAX_];
            tensor_name(name, sizeof name, s->state, fl_optim_state_name(rule, k), v->name);
            size_t first = lo - v->offset, last = hi - v->offset;
            if (sv.numel != v->numel) { // per row (AdaLomo): whole rows only
                FL_ASSERT(first == 0 && last == v->numel);
                last = sv.numel;
            }
            read_row_part(ck, &one, 0, name, FL_F32, dev, fl_optim_state_ptr(rule, k, lo), first,
                          last);
        }
    }
    char first[NAME_MAX_];
    tensor_name(first, sizeof first, s->state, "momentum", t->views[0].name);
    if (optim->cfg.kind == FL_OPT_SGD && !nstate &&
        (fl_ckpt_has(ck, first) || (legacy_weights && fl_ckpt_has(ck, "sgd.momentum"))))
        fl_die("checkpoint %s holds SGD momentum; this run has momentum 0", fl_ckpt_path(ck));
}

void fl_train_ckpt_restore(fl_ckpt *ck, fl_model *model, fl_optimizer *optim, fl_optimizer *base,
                           fl_loader_state *loader, const char *tokenizer) {
    const char *path = fl_ckpt_path(ck);
    cJSON *meta = parse_meta(ck);
    fl_model_config shape;
    read_shape(meta, path, &shape);
    shape.tp_size = model->config.tp_size; // how this run splits it, not the model's
    shape.sequence_parallel = model->config.sequence_parallel;
    shape.logits_chunk = model->config.logits_chunk;
    fl_model_config_finish(&shape);
    const fl_model_config *c = &model->config;
    if (memcmp(&shape, c, sizeof shape))
        fl_die("checkpoint %s holds a %s model of n_layer %d, n_head %d (kv %d), n_embd %d, mlp "
               "%d, vocab %d, max_seq_len %d; this run's model differs",
               path, fl_arch_name(shape.arch), shape.n_layer, shape.n_head, shape.n_kv_head,
               shape.n_embd, shape.intermediate_size, shape.vocab_size, shape.max_seq_len);
    const char *precision = string(meta, "precision", path);
    if (strcmp(precision, fl_dtype_name(model->dtype)))
        fl_die("checkpoint %s was trained in %s; this run is %s (a resume must keep the "
               "precision)",
               path, precision, fl_dtype_name(model->dtype));
    const char *tok = string(meta, "tokenizer", path);
    if (strcmp(tok, tokenizer))
        fl_die("checkpoint %s was trained with the %s tokenizer; this run's data uses %s", path,
               tok, tokenizer);
    const cJSON *lora = cJSON_GetObjectItemCaseSensitive(meta, "lora");
    if (!lora != !model->lora.cfg.r)
        fl_die("checkpoint %s %s LoRA adapters; this run %s", path, lora ? "holds" : "has no",
               model->lora.cfg.r ? "trains adapters" : "trains the whole model");
    if (lora && (int)number(lora, "r", path, 1, 1 << 16) != model->lora.cfg.r)
        fl_die("checkpoint %s holds adapters of rank %d; this run's lora.r is %d", path,
               (int)number(lora, "r", path, 1, 1 << 16), model->lora.cfg.r);
    restore_optim_meta(meta, "optimizer", path, optim);
    if (base) restore_optim_meta(meta, "base_optimizer", path, base);
    param_set sets[2];
    int nsets = param_sets(model, optim, base, sets);
    for (int i = 0; i < nsets; i++) restore_set(ck, model, &sets[i]);
    const cJSON *ls = object(meta, "loss_scaler", path);
    fl_loss_scaler *s = &optim->scaler;
    s->scale = (float)number(ls, "scale", path, 0, 1e38);
    s->cur_hysteresis = (int)number(ls, "cur_hysteresis", path, 0, 1 << 30);
    s->iter = (long)number(ls, "iter", path, 0, 1e15);
    s->last_overflow_iter = (long)number(ls, "last_overflow_iter", path, -1, 1e15);

    const cJSON *l = object(meta, "loader", path);
    loader->epoch = hex_u64(cJSON_GetObjectItemCaseSensitive(l, "epoch"), path, "loader.epoch");
    loader->index = hex_u64(cJSON_GetObjectItemCaseSensitive(l, "index"), path, "loader.index");
    // The windows the saving world took this epoch, split over this one's
    // ranks: each rank takes every world-th window of the same order.
    uint64_t saved_world = cJSON_GetObjectItemCaseSensitive(l, "world")
                               ? (uint64_t)number(l, "world", path, 1, 1 << 20)
                               : 1; // checkpoints from before data parallelism
    uint64_t world = (uint64_t)data_ranks(model), taken = loader->index * saved_world;
    if (taken % world)
        fl_die("checkpoint %s was saved by %llu rank(s) after %llu windows of the epoch, which "
               "%llu ranks cannot split evenly: resume on a number of ranks that divides %llu",
               path, (unsigned long long)saved_world, (unsigned long long)taken,
               (unsigned long long)world, (unsigned long long)taken);
    loader->index = taken / world;
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
