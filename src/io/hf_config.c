// hf_config.c: parsing Hugging Face config.json (GPT2Config, LlamaConfig)
// and model.safetensors.index.json, without touching a model (the fuzz
// targets link this file alone). Missing fields take transformers'
// defaults, as from_pretrained does; present ones must be what fitlm's
// GPT-2 or LLaMA computes.
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

static int check_gpt2(const cJSON *root, fl_model_config *out, char *err, size_t errlen) {
    fl_model_config c = {.arch = FL_ARCH_GPT2};
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
    *out = c;
    return 0;
}

// root[key] as a float in (min, max) (checked before and after rounding to
// float), or def when absent.
static int get_float(const cJSON *root, const char *key, float def, float min, float max,
                     float *out, char *err, size_t errlen) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, key);
    double d = cJSON_IsNumber(item) ? item->valuedouble : def;
    if ((item && !cJSON_IsNumber(item)) || !(d > min && d < max) || !((float)d > min))
        return fl_errorf(err, errlen, "%s must be a number in (%g, %g)", key, min, max);
    *out = (float)d;
    return 0;
}

// rope_scaling: null, or the "default" rope type (plain rotary embeddings).
static int plain_rope(const cJSON *scaling) {
    if (!scaling || cJSON_IsNull(scaling)) return 1;
    if (!cJSON_IsObject(scaling) || cJSON_GetArraySize(scaling) != 1) return 0;
    const cJSON *type = scaling->child;
    return (strcmp(type->string, "rope_type") == 0 || strcmp(type->string, "type") == 0) &&
           cJSON_IsString(type) && strcmp(type->valuestring, "default") == 0;
}

// LlamaConfig (transformers' configuration_llama.py); absent fields take
// its defaults: num_key_value_heads = num_attention_heads, head_dim =
// hidden_size / num_attention_heads, untied embeddings, rms_norm_eps 1e-6.
static int check_llama(const cJSON *root, fl_model_config *out, char *err, size_t errlen) {
    fl_model_config c = {.arch = FL_ARCH_LLAMA};
    int tp;
    if (get_int(root, "vocab_size", 32000, 1, 1 << 30, &c.vocab_size, err, errlen) ||
        get_int(root, "max_position_embeddings", 2048, 1, 1 << 20, &c.max_seq_len, err, errlen) ||
        get_int(root, "hidden_size", 4096, 1, 1 << 16, &c.n_embd, err, errlen) ||
        get_int(root, "intermediate_size", 11008, 1, 1 << 20, &c.intermediate_size, err, errlen) ||
        get_int(root, "num_hidden_layers", 32, 1, 1024, &c.n_layer, err, errlen) ||
        get_int(root, "num_attention_heads", 32, 1, 1 << 16, &c.n_head, err, errlen) ||
        get_int(root, "pretraining_tp", 1, 1, 1 << 16, &tp, err, errlen) ||
        get_float(root, "rms_norm_eps", 1e-6f, 0.0f, 1.0f, &c.norm_eps, err, errlen) ||
        get_float(root, "rope_theta", 10000.0f, 1.0f, 1e30f, &c.rope_theta, err, errlen))
        return -1;
    const cJSON *kv = cJSON_GetObjectItemCaseSensitive(root, "num_key_value_heads");
    if (cJSON_IsNull(kv))
        c.n_kv_head = c.n_head;
    else if (get_int(root, "num_key_value_heads", c.n_head, 1, 1 << 16, &c.n_kv_head, err, errlen))
        return -1;
    if (c.n_embd % c.n_head != 0)
        return fl_errorf(err, errlen,
                         "hidden_size (%d) is not divisible by num_attention_heads (%d)", c.n_embd,
                         c.n_head);
    if (c.n_head % c.n_kv_head != 0)
        return fl_errorf(err, errlen,
                         "num_key_value_heads (%d) does not divide num_attention_heads (%d)",
                         c.n_kv_head, c.n_head);
    int hs = c.n_embd / c.n_head;
    if (hs % 2)
        return fl_errorf(err, errlen,
                         "hidden_size / num_attention_heads (%d) is odd: rotary embeddings need an "
                         "even head size",
                         hs);
    const cJSON *head_dim = cJSON_GetObjectItemCaseSensitive(root, "head_dim");
    if (head_dim && !cJSON_IsNull(head_dim) &&
        !(cJSON_IsNumber(head_dim) && head_dim->valuedouble == hs))
        return fl_errorf(err, errlen,
                         "head_dim must be null or hidden_size / num_attention_heads (%d): fitlm's "
                         "heads split hidden_size",
                         hs);
    const cJSON *act = cJSON_GetObjectItemCaseSensitive(root, "hidden_act");
    if (act && !(cJSON_IsString(act) &&
                 (strcmp(act->valuestring, "silu") == 0 || strcmp(act->valuestring, "swish") == 0)))
        return fl_errorf(err, errlen,
                         "hidden_act %.40s is not supported (fitlm's LLaMA MLP is SwiGLU: silu)",
                         cJSON_IsString(act) ? act->valuestring : "(not a string)");
    if (!plain_rope(cJSON_GetObjectItemCaseSensitive(root, "rope_scaling")))
        return fl_errorf(err, errlen,
                         "rope_scaling is not supported: fitlm's LLaMA has plain rotary embeddings "
                         "(rope_scaling must be null)");
    if (tp != 1)
        return fl_errorf(err, errlen, "pretraining_tp %d is not supported (must be 1)", tp);
    const cJSON *drop = cJSON_GetObjectItemCaseSensitive(root, "attention_dropout");
    if (drop && !(cJSON_IsNumber(drop) && drop->valuedouble == 0.0))
        return fl_errorf(err, errlen, "attention_dropout must be 0: fitlm has no dropout");
    if (want_bool(root, "attention_bias", 0, "fitlm's LLaMA attention has no biases", err,
                  errlen) ||
        want_bool(root, "mlp_bias", 0, "fitlm's LLaMA MLP has no biases", err, errlen))
        return -1;
    const cJSON *tie = cJSON_GetObjectItemCaseSensitive(root, "tie_word_embeddings");
    if (tie && !cJSON_IsBool(tie))
        return fl_errorf(err, errlen, "tie_word_embeddings must be true or false");
    c.tie_embeddings = cJSON_IsTrue(tie);
    *out = c;
    return 0;
}

// The architecture architectures[] names: 0 GPT-2, 1 LLaMA, -1 none known.
static int named_arch(const cJSON *root) {
    const cJSON *item, *list = cJSON_GetObjectItemCaseSensitive(root, "architectures");
    if (!cJSON_IsArray(list)) return -1;
    cJSON_ArrayForEach(item, list) {
        if (!cJSON_IsString(item)) continue;
        if (strcmp(item->valuestring, "GPT2LMHeadModel") == 0 ||
            strcmp(item->valuestring, "GPT2Model") == 0)
            return FL_ARCH_GPT2;
        if (strcmp(item->valuestring, "LlamaForCausalLM") == 0 ||
            strcmp(item->valuestring, "LlamaModel") == 0)
            return FL_ARCH_LLAMA;
    }
    return -1;
}

// model_type decides; without it architectures[], and without both GPT-2.
static int check_config(const cJSON *root, fl_model_config *out, char *err, size_t errlen) {
    if (!cJSON_IsObject(root)) return fl_errorf(err, errlen, "not a JSON object");
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    int named = named_arch(root), arch = named < 0 ? FL_ARCH_GPT2 : named;
    if (type) {
        int gpt2 = cJSON_IsString(type) && strcmp(type->valuestring, "gpt2") == 0;
        int llama = cJSON_IsString(type) && strcmp(type->valuestring, "llama") == 0;
        if (!gpt2 && !llama)
            return fl_errorf(err, errlen, "model_type is %.40s, not \"gpt2\" or \"llama\"",
                             cJSON_IsString(type) ? type->valuestring : "not a string");
        arch = llama ? FL_ARCH_LLAMA : FL_ARCH_GPT2;
        if (named >= 0 && named != arch)
            return fl_errorf(err, errlen, "architectures names a %s model, model_type is %s",
                             named == FL_ARCH_LLAMA ? "LLaMA" : "GPT-2", type->valuestring);
    }
    fl_model_config c = {0};
    if ((arch == FL_ARCH_LLAMA ? check_llama : check_gpt2)(root, &c, err, errlen) != 0) return -1;
    c.padded_vocab_size = (c.vocab_size + 127) / 128 * 128; // as fl_model_config_finish
    *out = c;
    return 0;
}

int fl_hf_config_parse(const char *json, size_t n, fl_model_config *out, char *err, size_t errlen) {
    cJSON *root = fl_json_read(json, n, err, errlen);
    if (!root) return -1;
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
    cJSON *root = fl_json_read(json, n, err, errlen);
    if (!root) return -1;
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
