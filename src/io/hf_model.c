// hf_model.c: GPT-2 and LLaMA in the Hugging Face layout: export to and load
// from safetensors plus config.json, the way transformers' GPT2LMHeadModel
// and LlamaForCausalLM save_pretrained / from_pretrained see them.
//
// The table's names are HF's without the model prefix; what differs per
// architecture is in hf_layout: the prefix ("transformer." / "model."; the
// head "lm_head.weight" has none), GPT-2's Conv1D matrices stored (in, out),
// the transpose of our nn.Linear (out, in) (LLaMA's are stored as they are),
// the buffers that are skipped, and whether biases exist. Rows with padded
// vocabulary (live_rows) are stored with their live rows only; a tied
// lm_head is not stored.
#include "fitlm/safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cJSON.h>

#include "fitlm/io.h"

#define HF_HEAD      "lm_head."
#define HF_NAME_MAX  (FL_PARAM_NAME_MAX + 16)
#define HF_CHUNK     65536 // elements converted at a time
#define HF_SINGLE    "model.safetensors"
#define HF_INDEX     "model.safetensors.index.json"
#define HF_SHARD_FMT "model-%05d-of-%05d.safetensors"
#define HF_PATH_MAX  4096

typedef struct {
    const char *prefix;     // of every stored name but the head's
    const char *block;      // the blocks' rows start with it
    int conv1d;             // the blocks' matrices are stored (in, out)
    const char *buffers[2]; // suffixes of stored non-parameters (after a '.'), skipped
    const char *embed;      // the embedding a stored tied lm_head must equal
    const char *untied;     // why a stored tied lm_head must equal it
    int biases;             // 0: a stored ".bias" is refused by name
} hf_layout;

static const hf_layout gpt2_layout = {
    .prefix = "transformer.",
    .block = "h.",
    .conv1d = 1,
    .buffers = {"attn.bias", "attn.masked_bias"}, // the causal masks
    .embed = "wte.weight",
    .untied = "untied LM heads are not supported",
    .biases = 1,
};
static const hf_layout llama_layout = {
    .prefix = "model.",
    .block = "layers.",
    .conv1d = 0,
    .buffers = {"rotary_emb.inv_freq", NULL}, // older transformers saved it
    .embed = "embed_tokens.weight",
    .untied = "config.json ties them (tie_word_embeddings)",
    .biases = 0,
};

static const hf_layout *layout_of(const fl_model_config *c) {
    return c->arch == FL_ARCH_LLAMA ? &llama_layout : &gpt2_layout;
}

static int is_transposed(const hf_layout *lay, const fl_param_view *v) {
    return lay->conv1d && v->ndim == 2 && strncmp(v->name, lay->block, strlen(lay->block)) == 0;
}

// The HF shape of a view: the live vocab rows only, Conv1D transposed.
static void hf_shape(const hf_layout *lay, const fl_param_view *v, uint64_t *shape) {
    shape[0] = v->live_rows ? v->live_rows : v->shape[0];
    if (v->ndim == 2) shape[1] = v->shape[1];
    if (is_transposed(lay, v)) shape[0] = v->shape[1], shape[1] = v->shape[0];
}

// The stored name of a table row.
static void hf_name(const hf_layout *lay, const char *name, char *out) {
    int head = strncmp(name, HF_HEAD, strlen(HF_HEAD)) == 0;
    snprintf(out, HF_NAME_MAX, "%s%s", head ? "" : lay->prefix, name);
}

static void join(char *out, const char *dir, const char *name) {
    if ((size_t)snprintf(out, HF_PATH_MAX, "%s/%s", dir, name) >= HF_PATH_MAX)
        fl_die("path too long: %s/%s", dir, name);
}

// ----------------------------------------------------------------------------
// export

typedef struct {
    const fl_model *model;
    const float *weights;
    int first; // table view of the shard's first tensor
    fl_dtype dt;
    float *row;
} export_ctx;

static void export_fill(void *p, int i, void *dst) {
    const export_ctx *x = p;
    const fl_param_view *v = &x->model->table.views[x->first + i];
    const hf_layout *lay = layout_of(&x->model->config);
    const float *src = x->weights + v->offset;
    if (!is_transposed(lay, v)) { // as stored (vocab rows: the first V)
        uint64_t shape[2];
        hf_shape(lay, v, shape);
        fl_convert(x->dt, dst, FL_F32, src, v->ndim == 2 ? shape[0] * shape[1] : shape[0]);
        return;
    }
    size_t out = v->shape[0], in = v->shape[1];
    for (size_t j = 0; j < in; j++) {
        for (size_t o = 0; o < out; o++) x->row[o] = src[o * in + j];
        fl_store_f32(x->dt, fl_at(x->dt, dst, j * out), x->row, out);
    }
}

static const char *torch_dtype(fl_dtype dt) {
    return dt == FL_F32 ? "float32" : dt == FL_BF16 ? "bfloat16" : "float16";
}

// Writes r as dir/name and frees it.
static void write_json(const char *dir, const char *name, cJSON *r) {
    char *json = cJSON_Print(r), path[HF_PATH_MAX];
    cJSON_Delete(r);
    if (!json) fl_die("out of memory writing %s/%s", dir, name);
    join(path, dir, name);
    fl_file_write_all(path, json, strlen(json));
    cJSON_free(json);
}

static void add_architecture(cJSON *r, const char *name) {
    cJSON *list = cJSON_AddArrayToObject(r, "architectures");
    cJSON_AddItemToArray(list, cJSON_CreateString(name));
}

// bos/eos: GPT-2's <|endoftext|>; other vocabularies have no such token
static void add_token_id(cJSON *r, const char *key, const fl_model_config *c) {
    if (c->vocab_size == 50257)
        cJSON_AddNumberToObject(r, key, 50256);
    else
        cJSON_AddNullToObject(r, key);
}

double fl_json_float(float f) {
    char text[32];
    for (int digits = 1; digits < 10; digits++) {
        snprintf(text, sizeof text, "%.*g", digits, (double)f);
        if (strtof(text, NULL) == f) break;
    }
    return strtod(text, NULL);
}

// GPT2Config's fields, keys sorted as transformers writes them.
static cJSON *gpt2_config(const fl_model_config *c) {
    cJSON *r = cJSON_CreateObject();
    cJSON_AddStringToObject(r, "activation_function", "gelu_new");
    add_architecture(r, "GPT2LMHeadModel");
    cJSON_AddNumberToObject(r, "attn_pdrop", 0.1);
    add_token_id(r, "bos_token_id", c);
    cJSON_AddNumberToObject(r, "embd_pdrop", 0.1);
    add_token_id(r, "eos_token_id", c);
    cJSON_AddNumberToObject(r, "initializer_range", 0.02);
    cJSON_AddNumberToObject(r, "layer_norm_epsilon", 1e-5);
    cJSON_AddStringToObject(r, "model_type", "gpt2");
    cJSON_AddNumberToObject(r, "n_ctx", c->max_seq_len);
    cJSON_AddNumberToObject(r, "n_embd", c->n_embd);
    cJSON_AddNumberToObject(r, "n_head", c->n_head);
    cJSON_AddNullToObject(r, "n_inner");
    cJSON_AddNumberToObject(r, "n_layer", c->n_layer);
    cJSON_AddNumberToObject(r, "n_positions", c->max_seq_len);
    cJSON_AddFalseToObject(r, "reorder_and_upcast_attn");
    cJSON_AddNumberToObject(r, "resid_pdrop", 0.1);
    cJSON_AddFalseToObject(r, "scale_attn_by_inverse_layer_idx");
    cJSON_AddTrueToObject(r, "scale_attn_weights");
    cJSON_AddNullToObject(r, "summary_activation");
    cJSON_AddNumberToObject(r, "summary_first_dropout", 0.1);
    cJSON_AddTrueToObject(r, "summary_proj_to_labels");
    cJSON_AddStringToObject(r, "summary_type", "cls_index");
    cJSON_AddTrueToObject(r, "summary_use_proj");
    cJSON_AddTrueToObject(r, "tie_word_embeddings");
    return r;
}

// LlamaConfig's fields, keys sorted as transformers writes them.
static cJSON *llama_config(const fl_model_config *c) {
    cJSON *r = cJSON_CreateObject();
    add_architecture(r, "LlamaForCausalLM");
    cJSON_AddFalseToObject(r, "attention_bias");
    cJSON_AddNumberToObject(r, "attention_dropout", 0.0);
    add_token_id(r, "bos_token_id", c);
    add_token_id(r, "eos_token_id", c);
    cJSON_AddNumberToObject(r, "head_dim", c->n_embd / c->n_head);
    cJSON_AddStringToObject(r, "hidden_act", "silu");
    cJSON_AddNumberToObject(r, "hidden_size", c->n_embd);
    cJSON_AddNumberToObject(r, "initializer_range", 0.02);
    cJSON_AddNumberToObject(r, "intermediate_size", c->intermediate_size);
    cJSON_AddNumberToObject(r, "max_position_embeddings", c->max_seq_len);
    cJSON_AddFalseToObject(r, "mlp_bias");
    cJSON_AddStringToObject(r, "model_type", "llama");
    cJSON_AddNumberToObject(r, "num_attention_heads", c->n_head);
    cJSON_AddNumberToObject(r, "num_hidden_layers", c->n_layer);
    cJSON_AddNumberToObject(r, "num_key_value_heads", c->n_kv_head);
    cJSON_AddNumberToObject(r, "pretraining_tp", 1);
    cJSON_AddNumberToObject(r, "rms_norm_eps", fl_json_float(c->norm_eps));
    cJSON_AddNullToObject(r, "rope_scaling");
    cJSON_AddNumberToObject(r, "rope_theta", fl_json_float(c->rope_theta));
    cJSON_AddBoolToObject(r, "tie_word_embeddings", c->tie_embeddings);
    return r;
}

static void write_config(const char *dir, const fl_model_config *c, fl_dtype dt) {
    cJSON *r = c->arch == FL_ARCH_LLAMA ? llama_config(c) : gpt2_config(c);
    cJSON_AddStringToObject(r, "torch_dtype", torch_dtype(dt));
    cJSON_AddTrueToObject(r, "use_cache");
    cJSON_AddNumberToObject(r, "vocab_size", c->vocab_size);
    write_json(dir, "config.json", r);
}

static int by_string(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static void write_index(const char *dir, char (*names)[HF_NAME_MAX], const int *shard_of, int n,
                        int n_shards, size_t total) {
    const char **order = fl_alloc(FL_MEM_OTHER, (size_t)n * sizeof *order);
    for (int i = 0; i < n; i++) order[i] = names[i];
    qsort(order, (size_t)n, sizeof *order, by_string);
    cJSON *r = cJSON_CreateObject();
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(r, "metadata"), "total_size", (double)total);
    cJSON *map = cJSON_AddObjectToObject(r, "weight_map");
    for (int k = 0; k < n; k++) {
        int i = (int)((const char(*)[HF_NAME_MAX])order[k] - names);
        char file[64];
        snprintf(file, sizeof file, HF_SHARD_FMT, shard_of[i] + 1, n_shards);
        cJSON_AddStringToObject(map, names[i], file);
    }
    fl_free(order);
    write_json(dir, HF_INDEX, r);
}

// Removes what an earlier export of another layout left in dir (a single
// file, an index, shards of another count), so a loader cannot pick it up.
static void remove_stale(const char *dir, int n_shards) {
    char path[HF_PATH_MAX];
    if (n_shards > 1)
        join(path, dir, HF_SINGLE);
    else
        join(path, dir, HF_INDEX);
    if (unlink(path) != 0 && errno != ENOENT) fl_die("cannot remove %s: %s", path, strerror(errno));
    DIR *d = opendir(dir);
    if (!d) fl_die("cannot list %s: %s", dir, strerror(errno));
    const struct dirent *e;
    while ((e = readdir(d))) {
        int i, of, end = 0;
        if (sscanf(e->d_name, "model-%5d-of-%5d.safetensors%n", &i, &of, &end) == 2 &&
            e->d_name[end] == 0 && (n_shards == 1 || of != n_shards)) {
            join(path, dir, e->d_name);
            if (unlink(path) != 0) fl_die("cannot remove %s: %s", path, strerror(errno));
        }
    }
    closedir(d);
}

// The first NaN or Inf of n values, or -1.
static long first_nonfinite(const float *x, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i])) return (long)i;
    return -1;
}

static void refuse_nonfinite(const char *source, const char *what, const char *row, const float *x,
                             size_t n) {
    long i = first_nonfinite(x, n);
    if (i >= 0)
        fl_die("%s: %s tensor '%s' holds %s at element %ld: refusing weights that are not "
               "finite (a diverged run?)",
               source, what, row, isnan(x[i]) ? "NaN" : "Inf", i);
}

void fl_model_check_finite(const fl_model *m, const char *source, const char *adapter) {
    size_t widest = 1;
    for (int r = 0; r < m->table.count; r++)
        if (m->table.views[r].numel > widest) widest = m->table.views[r].numel;
    for (int r = 0; r < m->lora.table.count; r++)
        if (m->lora.table.views[r].numel > widest) widest = m->lora.table.views[r].numel;
    float *row = fl_alloc(FL_MEM_WORKSPACE, widest * sizeof(float));
    // a device's adapters come down to the host first
    const fl_device *dev = m->dev;
    void *raw = dev->host ? NULL : fl_alloc(FL_MEM_OTHER, widest * fl_dtype_size(m->dtype));
    for (int r = 0; r < m->table.count; r++) {
        fl_model_row_f32(m, r, row); // NF4 rows dequantised
        refuse_nonfinite(source, "weight", m->table.views[r].name, row, m->table.views[r].numel);
    }
    for (int r = 0; r < m->lora.table.count; r++) {
        const fl_param_view *v = &m->lora.table.views[r];
        const void *src = fl_at_const(m->dtype, m->lora.params, v->offset);
        if (raw) fl_dev_download(dev, raw, src, v->numel * fl_dtype_size(m->dtype));
        fl_convert(FL_F32, row, m->dtype, raw ? raw : src, v->numel);
        refuse_nonfinite(adapter ? adapter : source, "LoRA adapter", v->name, row, v->numel);
    }
    fl_free(raw);
    fl_free(row);
}

// The files an export writes (and their temporaries): the rest of an
// export directory is the user's and stays.
// Exactly the export's own names (the tokenizer's files too: an earlier
// export's never stays beside a model that has none); a user's
// config.json.bak or model-card.md beside them stays.
static int is_export_file(const char *name) {
    int i, of, end = 0;
    return !strcmp(name, "config.json") || !strcmp(name, HF_SINGLE) || !strcmp(name, HF_INDEX) ||
           !strcmp(name, "tokenizer.json") || !strcmp(name, "tokenizer_config.json") ||
           (sscanf(name, "model-%5d-of-%5d.safetensors%n", &i, &of, &end) == 2 && !name[end]);
}

void fl_hf_export(const char *out_dir, const fl_model *model, const float *weights_fp32,
                  fl_dtype out_dtype, size_t max_shard_bytes) {
    fl_hf_export_with(out_dir, model, weights_fp32, out_dtype, max_shard_bytes, NULL);
}

void fl_hf_export_with(const char *out_dir, const fl_model *model, const float *weights_fp32,
                       fl_dtype out_dtype, size_t max_shard_bytes,
                       const fl_tokenizer_files *tokenizer) {
    // written beside out_dir and swapped in whole, so a kill never leaves a
    // mix of two exports' shards and configs (in place beside checkpoints)
    fl_dir_txn txn;
    const char *dir = fl_dir_begin(&txn, out_dir, is_export_file);
    const fl_param_table *t = &model->table;
    const hf_layout *lay = layout_of(&model->config);
    int n = t->count;
    fl_st_tensor *tensors = fl_alloc(FL_MEM_OTHER, (size_t)n * sizeof *tensors);
    char(*names)[HF_NAME_MAX] = fl_alloc(FL_MEM_OTHER, (size_t)n * HF_NAME_MAX);
    int *shard_of = fl_alloc(FL_MEM_OTHER, (size_t)n * sizeof *shard_of);
    // Shards as transformers cuts them: tensors in order, a new shard when
    // the next tensor would overflow the current (non-empty) one.
    size_t total = 0, in_shard = 0, widest = 1;
    int n_shards = 1;
    for (int i = 0; i < n; i++) {
        const fl_param_view *v = &t->views[i];
        fl_st_tensor *s = &tensors[i];
        hf_name(lay, v->name, names[i]);
        s->name = names[i];
        s->dtype = out_dtype;
        s->ndim = v->ndim;
        hf_shape(lay, v, s->shape);
        s->numel = v->ndim == 2 ? s->shape[0] * s->shape[1] : s->shape[0];
        size_t bytes = s->numel * fl_dtype_size(out_dtype);
        if (max_shard_bytes && in_shard > 0 && in_shard + bytes > max_shard_bytes) {
            n_shards++;
            in_shard = 0;
        }
        in_shard += bytes;
        total += bytes;
        shard_of[i] = n_shards - 1;
        if (v->shape[0] > widest) widest = v->shape[0];
    }
    export_ctx ctx = {model, weights_fp32, 0, out_dtype,
                      fl_alloc(FL_MEM_WORKSPACE, widest * sizeof(float))};
    char path[HF_PATH_MAX];
    for (int s = 0, first = 0; s < n_shards; s++) {
        int last = first;
        while (last < n && shard_of[last] == s) last++;
        char file[64];
        if (n_shards == 1)
            snprintf(file, sizeof file, HF_SINGLE);
        else
            snprintf(file, sizeof file, HF_SHARD_FMT, s + 1, n_shards);
        join(path, dir, file);
        ctx.first = first;
        fl_safetensors_write(path, tensors + first, last - first, export_fill, &ctx);
        first = last;
    }
    if (n_shards > 1) write_index(dir, names, shard_of, n, n_shards, total);
    write_config(dir, &model->config, out_dtype);
    if (tokenizer) fl_tokenizer_files_write(tokenizer, dir);
    remove_stale(dir, n_shards);
    fl_dir_commit(&txn);
    fl_free(ctx.row);
    fl_free(tensors), fl_free(names), fl_free(shard_of);
}

// ----------------------------------------------------------------------------
// load

typedef struct {
    fl_safetensors *shards;
    int n_shards;
    const char *where; // the directory or file, for messages
} hf_files;

// Opens the shards of dir's index and checks the index against them: every
// entry is in the shard it names, and the shards hold nothing else.
static void open_index(hf_files *f, const char *dir) {
    char path[HF_PATH_MAX], err[512];
    join(path, dir, HF_INDEX);
    size_t n;
    char *json = (char *)fl_file_read_all(path, FL_HF_MAX_JSON_BYTES, &n, "JSON file");
    fl_hf_index idx;
    if (fl_hf_index_parse(json, n, &idx, err, sizeof err) != 0) fl_die("%s: %s", path, err);
    fl_free(json);
    f->n_shards = idx.n_files;
    f->shards = fl_alloc(FL_MEM_OTHER, (size_t)idx.n_files * sizeof *f->shards);
    int stored = 0;
    for (int i = 0; i < idx.n_files; i++) {
        char shard[HF_PATH_MAX];
        join(shard, dir, idx.files[i]);
        fl_safetensors_open(&f->shards[i], shard);
        stored += f->shards[i].count;
    }
    for (int e = 0; e < idx.n_entries; e++)
        if (!fl_safetensors_find(&f->shards[idx.entries[e].file], idx.entries[e].name))
            fl_die("%s: tensor '%s' is not in %s, where the weight_map puts it", path,
                   idx.entries[e].name, idx.files[idx.entries[e].file]);
    if (stored != idx.n_entries)
        fl_die("%s: the shards hold %d tensors, the weight_map lists %d", path, stored,
               idx.n_entries);
    fl_hf_index_free(&idx);
}

// Reads elements [first, first + n) of tensor t as fp32 (the data may sit
// at any alignment in the mapping, so it is copied before conversion).
static void read_f32(const fl_safetensors *st, const fl_st_tensor *t, size_t first, size_t n,
                     float *out, void *chunk) {
    size_t es = fl_dtype_size(t->dtype);
    for (size_t i = 0; i < n; i += HF_CHUNK) {
        size_t len = n - i < HF_CHUNK ? n - i : HF_CHUNK;
        memcpy(chunk, st->data + t->begin + (first + i) * es, len * es);
        fl_convert(FL_F32, out + i, t->dtype, chunk, len);
    }
}

// A stored non-parameter (GPT-2's attention masks, LLaMA's rotary inv_freq):
// the name is one of the layout's suffixes or ends with '.' and one.
static int is_buffer(const hf_layout *lay, const char *name) {
    size_t len = strlen(name);
    for (int i = 0; i < 2 && lay->buffers[i]; i++) {
        size_t n = strlen(lay->buffers[i]);
        if (len >= n && strcmp(name + len - n, lay->buffers[i]) == 0 &&
            (len == n || name[len - n - 1] == '.'))
            return 1;
    }
    return 0;
}

void fl_shape_str(char *out, size_t size, int ndim, const uint64_t *shape) {
    size_t at = (size_t)snprintf(out, size, "[");
    for (int d = 0; d < ndim && at < size; d++)
        at += (size_t)snprintf(out + at, size - at, "%s%llu", d ? ", " : "",
                               (unsigned long long)shape[d]);
    if (at < size) snprintf(out + at, size - at, "]");
}

typedef struct {
    const fl_safetensors *st;
    const fl_st_tensor *t;
} hf_ref;

// Matches every stored tensor to a parameter view (refs[view]) and finds a
// stored lm_head the table does not have (tied); dies on unknown, repeated,
// missing or misshapen tensors.
static void match_tensors(const hf_files *f, const hf_layout *lay, const fl_param_table *table,
                          hf_ref *refs, hf_ref *lm_head) {
    size_t plen = strlen(lay->prefix);
    for (int s = 0; s < f->n_shards; s++)
        for (int i = 0; i < f->shards[s].count; i++) {
            const fl_st_tensor *t = &f->shards[s].tensors[i];
            const char *name = t->name;
            if (strncmp(name, lay->prefix, plen) == 0) name += plen;
            if (is_buffer(lay, name)) continue;
            size_t len = strlen(name);
            if (!lay->biases && len > 5 && strcmp(name + len - 5, ".bias") == 0)
                fl_die("%s: tensor '%s' is a bias: fitlm's LLaMA has none (attention_bias and "
                       "mlp_bias must be false)",
                       f->where, t->name);
            int v = fl_params_find(table, name);
            if (v < 0 && strcmp(name, HF_HEAD "weight") == 0) {
                if (lm_head->t)
                    fl_die("%s: tensor '%s' is stored twice (as '%s' and '%s')", f->where, name,
                           lm_head->t->name, t->name);
                *lm_head = (hf_ref){&f->shards[s], t};
                continue;
            }
            if (v < 0) fl_die("%s: unknown tensor '%s'", f->where, t->name);
            if (refs[v].t)
                fl_die("%s: tensor '%s' is stored twice (as '%s' and '%s')", f->where, name,
                       refs[v].t->name, t->name);
            uint64_t want[2];
            hf_shape(lay, &table->views[v], want);
            int ok = t->ndim == table->views[v].ndim;
            for (int d = 0; ok && d < t->ndim; d++) ok = t->shape[d] == want[d];
            if (!ok) {
                char got_s[160], want_s[64];
                fl_shape_str(got_s, sizeof got_s, t->ndim, t->shape);
                fl_shape_str(want_s, sizeof want_s, table->views[v].ndim, want);
                fl_die("%s: tensor '%s' has shape %s, config.json implies %s", f->where, t->name,
                       got_s, want_s);
            }
            refs[v] = (hf_ref){&f->shards[s], t};
        }
    for (int v = 0; v < table->count; v++)
        if (!refs[v].t) {
            char name[HF_NAME_MAX];
            hf_name(lay, table->views[v].name, name);
            fl_die("%s: tensor '%s' is missing", f->where, name);
        }
}

// A stored head the table does not have must be the embedding itself.
static void check_lm_head(const hf_files *f, const hf_layout *lay, const hf_ref *head,
                          const hf_ref *embed, size_t V, size_t C) {
    if (head->t->ndim != 2 || head->t->shape[0] != V || head->t->shape[1] != C)
        fl_die("%s: lm_head.weight does not have %s's shape", f->where, lay->embed);
    float *a = fl_alloc(FL_MEM_WORKSPACE, 2 * HF_CHUNK * sizeof(float)), *b = a + HF_CHUNK;
    void *chunk = fl_alloc(FL_MEM_WORKSPACE, HF_CHUNK * sizeof(float));
    for (size_t i = 0; i < V * C; i += HF_CHUNK) {
        size_t len = V * C - i < HF_CHUNK ? V * C - i : HF_CHUNK;
        read_f32(head->st, head->t, i, len, a, chunk);
        read_f32(embed->st, embed->t, i, len, b, chunk);
        if (memcmp(a, b, len * sizeof(float)) != 0)
            fl_die("%s: lm_head.weight differs from %s: %s", f->where, lay->embed, lay->untied);
    }
    fl_free(a), fl_free(chunk);
}

// Each row goes through fl_model_store_row (in pieces of HF_CHUNK, a
// multiple of 4096), so NF4 rows are quantised as they arrive.
static void copy_tensors(fl_model *model, const hf_ref *refs) {
    const fl_param_table *table = fl_model_whole_table(model); // the file's rows
    const hf_layout *lay = layout_of(&model->config);
    size_t largest = 0;
    for (int v = 0; v < table->count; v++)
        if (is_transposed(lay, &table->views[v]) && table->views[v].numel > largest)
            largest = table->views[v].numel;
    // a Conv1D matrix is read whole and transposed into the table's layout
    float *whole = fl_alloc(FL_MEM_WORKSPACE, 2 * largest * sizeof(float)), *rows = whole + largest;
    float *buf = fl_alloc(FL_MEM_WORKSPACE, HF_CHUNK * sizeof(float));
    void *chunk = fl_alloc(FL_MEM_WORKSPACE, HF_CHUNK * sizeof(float));
    _Static_assert(HF_CHUNK % FL_PARAMS_INIT_CHUNK == 0, "NF4 rows are stored in such pieces");
    for (int v = 0; v < table->count; v++) {
        const fl_param_view *pv = &table->views[v];
        const fl_st_tensor *t = refs[v].t;
        if (!is_transposed(lay, pv)) { // padded vocab rows past V stay zero
            for (size_t i = 0; i < t->numel; i += HF_CHUNK) {
                size_t len = t->numel - i < HF_CHUNK ? t->numel - i : HF_CHUNK;
                read_f32(refs[v].st, t, i, len, buf, chunk);
                fl_model_store_row(model, v, i, buf, len);
            }
            continue;
        }
        size_t out = pv->shape[0], in = pv->shape[1];
        read_f32(refs[v].st, t, 0, t->numel, whole, chunk);
        for (size_t o = 0; o < out; o++)
            for (size_t j = 0; j < in; j++) rows[o * in + j] = whole[j * out + o];
        for (size_t i = 0; i < t->numel; i += HF_CHUNK)
            fl_model_store_row(model, v, i, rows + i,
                               t->numel - i < HF_CHUNK ? t->numel - i : HF_CHUNK);
    }
    fl_free(whole), fl_free(buf), fl_free(chunk);
}

// Where a directory's or file's weights and config.json are: file "" when
// dir holds a sharded index.
static void locate(const char *path, char *dir, char *file) {
    struct stat st;
    if (stat(path, &st) != 0) fl_die("cannot open %s: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) {
        snprintf(dir, HF_PATH_MAX, "%s", path);
        join(file, dir, HF_SINGLE);
        if (access(file, F_OK) != 0) {
            join(file, dir, HF_INDEX);
            if (access(file, F_OK) != 0)
                fl_die("%s holds neither %s nor %s", path, HF_SINGLE, HF_INDEX);
            file[0] = 0;
        }
        return;
    }
    snprintf(file, HF_PATH_MAX, "%s", path);
    snprintf(dir, HF_PATH_MAX, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash)
        *slash = 0;
    else
        strcpy(dir, ".");
}

// What an open Hugging Face source keeps: the path (config.json was parsed
// at the opening), then, from the check on, the safetensors mapped and each
// row's tensor, matched against the table.
typedef struct {
    hf_files f;
    hf_ref *refs; // per table row
} hf_source;

// The safetensors are opened here, not with config.json, so that what they
// take is held from the model's allocation on only (as the plan has it).
static void hf_check(fl_weight_source *s, const fl_param_table *t, const fl_quant_config *q) {
    (void)q; // any row can be quantised as it is read
    hf_source *h = s->state;
    hf_files *f = &h->f;
    char dir[HF_PATH_MAX], file[HF_PATH_MAX];
    locate(f->where, dir, file);
    if (file[0]) {
        f->n_shards = 1;
        f->shards = fl_alloc(FL_MEM_OTHER, sizeof *f->shards);
        fl_safetensors_open(&f->shards[0], file);
    } else {
        open_index(f, dir);
    }
    const hf_layout *lay = layout_of(&s->config);
    h->refs = fl_alloc(FL_MEM_OTHER, (size_t)t->count * sizeof *h->refs);
    hf_ref head = {0};
    match_tensors(f, lay, t, h->refs, &head);
    int embed = fl_params_find(t, lay->embed);
    FL_ASSERT(embed >= 0);
    if (head.t)
        check_lm_head(f, lay, &head, &h->refs[embed], (size_t)s->config.vocab_size,
                      (size_t)s->config.n_embd);
}

static void hf_fill(fl_weight_source *s, fl_model *m) {
    hf_source *h = s->state;
    FL_ASSERT(h->refs); // checked first
    copy_tensors(m, h->refs);
}

static void hf_close(fl_weight_source *s) {
    hf_source *h = s->state;
    for (int i = 0; i < h->f.n_shards; i++) fl_safetensors_free(&h->f.shards[i]);
    fl_free(h->f.shards);
    fl_free(h->refs);
    fl_free(h);
}

void fl_hf_source_open(fl_weight_source *s, const char *path) {
    char dir[HF_PATH_MAX], file[HF_PATH_MAX], config_path[HF_PATH_MAX], err[512];
    locate(path, dir, file);
    memset(s, 0, sizeof *s);
    join(config_path, dir, "config.json");
    size_t n;
    char *json = (char *)fl_file_read_all(config_path, FL_HF_MAX_JSON_BYTES, &n, "config file");
    if (fl_hf_config_parse(json, n, &s->config, err, sizeof err) != 0)
        fl_die("%s: %s", config_path, err);
    fl_free(json);
    hf_source *h = fl_alloc(FL_MEM_OTHER, sizeof *h);
    h->f.where = path;
    s->state = h;
    s->check = hf_check;
    s->fill = hf_fill;
    s->close = hf_close;
}

void fl_hf_load(const char *path, fl_model *model, fl_dtype dt) {
    fl_weight_source s;
    fl_hf_source_open(&s, path);
    fl_model_init_whole(model, &s, dt, NULL);
}
