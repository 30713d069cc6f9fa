// hf_config.c: parsing Hugging Face GPT-2 config.json and
// model.safetensors.index.json, without touching a model (the fuzz targets
// link this file alone). Missing GPT2Config fields take transformers'
// defaults, as from_pretrained does; present ones must be what fitlm's
// GPT-2 computes.
#include "fitlm/safetensors.h"

#include <stdlib.h>
#include <string.h>
#include <cJSON.h>

// root[key] as an integer in [min, max], or def when absent.
static int get_int(const cJSON *root, const char *key, int def, int min, int max, int *out,
                   char *err, size_t errlen) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!item) {
        *out = def;
        return 0;
    }
    double d = item->valuedouble;
    if (!cJSON_IsNumber(item) || !(d >= min && d <= max) || d != (double)(int)d)
        return fl_errorf(err, errlen, "%s must be an integer in [%d, %d]", key, min, max);
    *out = (int)d;
    return 0;
}

// root[key] absent or a bool equal to want.
static int want_bool(const cJSON *root, const char *key, int want, const char *why, char *err,
                     size_t errlen) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!item) return 0;
    if (!cJSON_IsBool(item)) return fl_errorf(err, errlen, "%s must be true or false", key);
    if (cJSON_IsTrue(item) != want)
        return fl_errorf(err, errlen, "%s %s is not supported: %s", key, want ? "false" : "true",
                         why);
    return 0;
}

static int check_config(const cJSON *root, fl_model_config *out, char *err, size_t errlen) {
    if (!cJSON_IsObject(root)) return fl_errorf(err, errlen, "not a JSON object");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (type && (!cJSON_IsString(type) || strcmp(type->valuestring, "gpt2") != 0))
        return fl_errorf(err, errlen, "model_type is %.40s, not \"gpt2\"",
                         cJSON_IsString(type) ? type->valuestring : "not a string");
    fl_model_config c = {0};
    if (get_int(root, "vocab_size", 50257, 1, 1 << 30, &c.vocab_size, err, errlen) ||
        get_int(root, "n_positions", 1024, 1, 1 << 20, &c.max_seq_len, err, errlen) ||
        get_int(root, "n_embd", 768, 1, 1 << 16, &c.n_embd, err, errlen) ||
        get_int(root, "n_layer", 12, 1, 1024, &c.n_layer, err, errlen) ||
        get_int(root, "n_head", 12, 1, 1 << 16, &c.n_head, err, errlen))
        return -1;
    if (c.n_embd % c.n_head != 0)
        return fl_errorf(err, errlen, "n_embd (%d) is not divisible by n_head (%d)", c.n_embd,
                         c.n_head);
    const cJSON *inner = cJSON_GetObjectItemCaseSensitive(root, "n_inner");
    if (inner && !cJSON_IsNull(inner) &&
        !(cJSON_IsNumber(inner) && inner->valuedouble == 4.0 * c.n_embd))
        return fl_errorf(err, errlen, "n_inner must be null or 4 * n_embd (%d): fitlm's MLP is 4C",
                         4 * c.n_embd);
    const cJSON *act = cJSON_GetObjectItemCaseSensitive(root, "activation_function");
    if (act && !(cJSON_IsString(act) && (strcmp(act->valuestring, "gelu_new") == 0 ||
                                         strcmp(act->valuestring, "gelu_pytorch_tanh") == 0)))
        return fl_errorf(err, errlen,
                         "activation_function %.40s is not supported (fitlm's GPT-2 uses the tanh "
                         "GELU: gelu_new or gelu_pytorch_tanh)",
                         cJSON_IsString(act) ? act->valuestring : "(not a string)");
    const cJSON *eps = cJSON_GetObjectItemCaseSensitive(root, "layer_norm_epsilon");
    if (eps && !(cJSON_IsNumber(eps) && eps->valuedouble == 1e-5))
        return fl_errorf(err, errlen, "layer_norm_epsilon must be 1e-5, the only value fitlm uses");
    if (want_bool(root, "tie_word_embeddings", 1, "fitlm's LM head is tied to wte", err, errlen) ||
        want_bool(root, "scale_attn_weights", 1, "fitlm scales scores by 1/sqrt(head size)", err,
                  errlen) ||
        want_bool(root, "scale_attn_by_inverse_layer_idx", 0, "fitlm scales all layers alike", err,
                  errlen) ||
        want_bool(root, "add_cross_attention", 0, "fitlm's GPT-2 is decoder-only", err, errlen))
        return -1;
    c.padded_vocab_size = (c.vocab_size + 127) / 128 * 128; // as fl_model_config_finish
    *out = c;
    return 0;
}

int fl_hf_config_parse(const char *json, size_t n, fl_model_config *out, char *err, size_t errlen) {
    cJSON *root = cJSON_ParseWithLength(json, n);
    if (!root) return fl_errorf(err, errlen, "not valid JSON");
    int rc = check_config(root, out, err, errlen);
    cJSON_Delete(root);
    return rc;
}

// ----------------------------------------------------------------------------
// the index of a sharded checkpoint

#define MAX_SHARDS 4096

static int shard_name_ok(const char *s) {
    size_t len = strlen(s), ext = strlen(".safetensors");
    return len > ext && len < 256 && s[0] != '.' && !strchr(s, '/') &&
           strcmp(s + len - ext, ".safetensors") == 0;
}

static int entry_by_name(const void *a, const void *b) {
    return strcmp(((const fl_hf_index_entry *)a)->name, ((const fl_hf_index_entry *)b)->name);
}

static int check_index(const cJSON *root, fl_hf_index *out, char *err, size_t errlen) {
    if (!cJSON_IsObject(root)) return fl_errorf(err, errlen, "not a JSON object");
    const cJSON *meta = cJSON_GetObjectItemCaseSensitive(root, "metadata");
    if (meta && !cJSON_IsObject(meta)) return fl_errorf(err, errlen, "metadata is not an object");
    const cJSON *total = meta ? cJSON_GetObjectItemCaseSensitive(meta, "total_size") : NULL;
    if (total && !(cJSON_IsNumber(total) && total->valuedouble >= 0))
        return fl_errorf(err, errlen, "metadata.total_size is not a non-negative number");
    const cJSON *map = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    if (!cJSON_IsObject(map))
        return fl_errorf(err, errlen, "weight_map is missing or not an object");
    int n = cJSON_GetArraySize(map);
    out->entries = fl_alloc(FL_MEM_OTHER, (size_t)n * sizeof *out->entries);
    out->files = fl_alloc(FL_MEM_OTHER, (size_t)n * sizeof *out->files);
    const cJSON *item;
    cJSON_ArrayForEach(item, map) {
        if (!cJSON_IsString(item))
            return fl_errorf(err, errlen, "weight_map['%s'] is not a string", item->string);
        if (!shard_name_ok(item->valuestring))
            return fl_errorf(err, errlen,
                             "weight_map['%s']: '%.80s' is not a plain .safetensors file name",
                             item->string, item->valuestring);
        int f = 0;
        while (f < out->n_files && strcmp(out->files[f], item->valuestring) != 0) f++;
        if (f == out->n_files) {
            if (f == MAX_SHARDS) return fl_errorf(err, errlen, "more than %d shards", MAX_SHARDS);
            size_t len = strlen(item->valuestring) + 1;
            out->files[out->n_files] = fl_alloc(FL_MEM_OTHER, len);
            memcpy(out->files[out->n_files++], item->valuestring, len);
        }
        size_t len = strlen(item->string) + 1;
        char *name = fl_alloc(FL_MEM_OTHER, len);
        memcpy(name, item->string, len);
        out->entries[out->n_entries++] = (fl_hf_index_entry){name, f};
    }
    fl_hf_index_entry *sorted = fl_alloc(FL_MEM_OTHER, (size_t)n * sizeof *sorted);
    if (n) memcpy(sorted, out->entries, (size_t)n * sizeof *sorted);
    qsort(sorted, (size_t)n, sizeof *sorted, entry_by_name);
    int rc = 0;
    for (int i = 1; i < n && !rc; i++)
        if (strcmp(sorted[i - 1].name, sorted[i].name) == 0)
            rc = fl_errorf(err, errlen, "weight_map lists '%s' twice", sorted[i].name);
    fl_free(sorted);
    return rc;
}

int fl_hf_index_parse(const char *json, size_t n, fl_hf_index *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    cJSON *root = cJSON_ParseWithLength(json, n);
    if (!root) return fl_errorf(err, errlen, "not valid JSON");
    int rc = check_index(root, out, err, errlen);
    cJSON_Delete(root);
    return rc;
}

void fl_hf_index_free(fl_hf_index *idx) {
    for (int i = 0; i < idx->n_entries; i++) fl_free((void *)idx->entries[i].name);
    for (int i = 0; i < idx->n_files; i++) fl_free(idx->files[i]);
    fl_free(idx->entries);
    fl_free(idx->files);
    memset(idx, 0, sizeof *idx);
}
