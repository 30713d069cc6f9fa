// peft.c: LoRA adapters in Hugging Face PEFT's files, so an adapter trained
// here loads with PeftModel.from_pretrained and one trained with PEFT loads
// here: DIR/adapter_config.json (LoraConfig.to_dict, written by
// PeftConfigMixin.save_pretrained as json.dumps(sort_keys=True)) and
// DIR/adapter_model.safetensors (lora_A (r, in) and lora_B (out, r) per
// targeted module, named "base_model.model.<module>.lora_A.weight").
//
// Only plain LoRA is read: a config asking for anything that changes what
// the weights mean (DoRA, per-module ranks, biases, extra trained modules,
// PiSSA/OLoRA bases) is refused by key rather than half-applied.
#include "fitlm/safetensors.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <cJSON.h>

#include "fitlm/io.h"

#define PEFT_CONFIG     "adapter_config.json"
#define PEFT_WEIGHTS    "adapter_model.safetensors"
#define PEFT_NAME_MAX   (FL_PARAM_NAME_MAX + 64)
#define PEFT_MAX_R      65536
#define PEFT_MAX_JSON   (1u << 20)
#define PEFT_ALL_LINEAR "all-linear"

// ----------------------------------------------------------------------------
// adapter_config.json

// An absent key, null, {} or []: PEFT's "not used" for optional settings.
static int unset(const cJSON *item) {
    return !item || cJSON_IsNull(item) ||
           ((cJSON_IsObject(item) || cJSON_IsArray(item)) && !item->child);
}

// root[key] absent (def) or a bool.
static int get_bool(const cJSON *root, const char *key, int def, int *out, char *err,
                    size_t errlen) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, key);
    if (!item) {
        *out = def;
        return 0;
    }
    if (!cJSON_IsBool(item)) return fl_errorf(err, errlen, "%s must be true or false", key);
    *out = cJSON_IsTrue(item);
    return 0;
}

// Settings that would change the adapted function: each must be unset or false.
static int refuse_unsupported(const cJSON *root, char *err, size_t errlen) {
    static const struct {
        const char *key, *why;
    } unset_keys[] = {
        {"rank_pattern", "per-module ranks are not supported (one r for every module)"},
        {"alpha_pattern", "per-module alphas are not supported (one lora_alpha for every module)"},
        {"modules_to_save", "fully trained extra modules are not supported (adapters only)"},
        {"layers_to_transform", "fitlm adapts the targeted modules of every layer"},
        {"exclude_modules", "fitlm takes target_modules only"},
        {"layer_replication", "fitlm does not replicate layers"},
        {"target_parameters", "fitlm adapts linear modules, not parameters"},
        {"trainable_token_indices", "trainable token embeddings are not supported"},
    };
    for (size_t i = 0; i < sizeof unset_keys / sizeof unset_keys[0]; i++)
        if (!unset(cJSON_GetObjectItemCaseSensitive(root, unset_keys[i].key)))
            return fl_errorf(err, errlen, "%s is set: %s", unset_keys[i].key, unset_keys[i].why);
    static const struct {
        const char *key, *what;
    } false_keys[] = {
        {"use_dora", "DoRA"},
        {"lora_bias", "LoRA biases"},
        {"use_qalora", "QA-LoRA"},
    };
    for (size_t i = 0; i < sizeof false_keys / sizeof false_keys[0]; i++) {
        int on = 0;
        if (get_bool(root, false_keys[i].key, 0, &on, err, errlen)) return -1;
        if (on)
            return fl_errorf(err, errlen,
                             "%s true is not supported: fitlm's adapters are plain "
                             "LoRA (no %s)",
                             false_keys[i].key, false_keys[i].what);
    }
    return 0;
}

// target_modules: a list of names (joined by commas), "all-linear", or null
// (the architecture's default, "").
static int get_targets(const cJSON *root, char *out, char *err, size_t errlen) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(root, "target_modules");
    if (!item) return fl_errorf(err, errlen, "target_modules is missing");
    out[0] = 0;
    if (cJSON_IsNull(item)) return 0;
    if (cJSON_IsString(item)) {
        // PEFT matches a string as a regular expression against whole
        // module names; only its one keyword means the same here.
        if (strcmp(item->valuestring, PEFT_ALL_LINEAR) != 0)
            return fl_errorf(err, errlen,
                             "target_modules \"%.60s\" is a regular expression (PEFT matches a "
                             "string against whole module names): fitlm takes a list of module "
                             "names or \"all-linear\"",
                             item->valuestring);
        strcpy(out, PEFT_ALL_LINEAR);
        return 0;
    }
    if (!cJSON_IsArray(item) || !item->child)
        return fl_errorf(err, errlen,
                         "target_modules must be a non-empty list of module names, "
                         "\"all-linear\" or null");
    size_t at = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, item) {
        if (!cJSON_IsString(e) || !e->valuestring[0] || strchr(e->valuestring, ','))
            return fl_errorf(err, errlen,
                             "target_modules must hold non-empty module names "
                             "(strings without commas)");
        size_t len = strlen(e->valuestring);
        if (at + (at > 0) + len >= FL_LORA_TARGETS_MAX)
            return fl_errorf(err, errlen, "target_modules: the names take more than %d bytes",
                             FL_LORA_TARGETS_MAX - 1);
        if (at) out[at++] = ',';
        memcpy(out + at, e->valuestring, len + 1);
        at += len;
    }
    return 0;
}

static int check_peft(const cJSON *root, fl_lora_config *out, char *err, size_t errlen) {
    if (!cJSON_IsObject(root)) return fl_errorf(err, errlen, "not a JSON object");
    fl_lora_config c;
    fl_lora_config_defaults(&c);
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(root, "peft_type");
    if (!type) return fl_errorf(err, errlen, "peft_type is missing");
    if (!cJSON_IsString(type) || strcmp(type->valuestring, "LORA") != 0)
        return fl_errorf(err, errlen, "peft_type is %.40s: fitlm reads LoRA adapters (\"LORA\")",
                         cJSON_IsString(type) ? type->valuestring : "not a string");
    const cJSON *task = cJSON_GetObjectItemCaseSensitive(root, "task_type");
    if (!unset(task) && !(cJSON_IsString(task) && strcmp(task->valuestring, "CAUSAL_LM") == 0))
        return fl_errorf(err, errlen,
                         "task_type is %.40s: fitlm's models are causal LMs "
                         "(\"CAUSAL_LM\")",
                         cJSON_IsString(task) ? task->valuestring : "not a string");
    const cJSON *bias = cJSON_GetObjectItemCaseSensitive(root, "bias");
    if (bias && !(cJSON_IsString(bias) && strcmp(bias->valuestring, "none") == 0))
        return fl_errorf(err, errlen,
                         "bias %.40s is not supported: fitlm trains no biases "
                         "(bias must be \"none\")",
                         cJSON_IsString(bias) ? bias->valuestring : "(not a string)");
    if (refuse_unsupported(root, err, errlen)) return -1;

    const cJSON *r = cJSON_GetObjectItemCaseSensitive(root, "r");
    if (r) {
        double d = r->valuedouble;
        if (!cJSON_IsNumber(r) || !(d >= 1 && d <= PEFT_MAX_R) || d != floor(d))
            return fl_errorf(err, errlen, "r must be an integer in [1, %d]", PEFT_MAX_R);
        c.r = (int)d;
    }
    const cJSON *alpha = cJSON_GetObjectItemCaseSensitive(root, "lora_alpha");
    if (alpha) {
        if (!cJSON_IsNumber(alpha) || !(alpha->valuedouble > 0 && alpha->valuedouble <= 1e6))
            return fl_errorf(err, errlen, "lora_alpha must be a number in (0, 1e6]");
        c.alpha = (float)alpha->valuedouble;
    }
    const cJSON *drop = cJSON_GetObjectItemCaseSensitive(root, "lora_dropout");
    if (drop) {
        if (!cJSON_IsNumber(drop) || !(drop->valuedouble >= 0 && drop->valuedouble < 1))
            return fl_errorf(err, errlen, "lora_dropout must be a number in [0, 1)");
        c.dropout = (float)drop->valuedouble;
    }
    if (get_bool(root, "use_rslora", 0, &c.use_rslora, err, errlen)) return -1;
    const cJSON *init = cJSON_GetObjectItemCaseSensitive(root, "init_lora_weights");
    if (init && !cJSON_IsTrue(init)) {
        if (!cJSON_IsString(init) || strcmp(init->valuestring, "gaussian") != 0)
            return fl_errorf(err, errlen,
                             "init_lora_weights %.40s is not supported (true or \"gaussian\": "
                             "the others change the base weights or start B non-zero)",
                             cJSON_IsString(init)  ? init->valuestring
                             : cJSON_IsFalse(init) ? "false"
                                                   : "(not a string)");
        c.init = FL_LORA_INIT_GAUSSIAN;
    }
    // fan_in_fan_out is not read: it tells PEFT that GPT-2's Conv1D stores
    // its weight (in, out), but lora_A and lora_B are (r, in) and (out, r)
    // either way, so the files mean the same whatever it says.
    if (get_targets(root, c.target_modules, err, errlen)) return -1;
    *out = c;
    return 0;
}

int fl_peft_config_parse(const char *json, size_t n, fl_lora_config *out, char *err,
                         size_t errlen) {
    cJSON *root = fl_json_read(json, n, err, errlen);
    if (!root) return -1;
    int rc = check_peft(root, out, err, errlen);
    cJSON_Delete(root);
    return rc;
}

static void join(char *out, const char *dir, const char *name) {
    if ((size_t)snprintf(out, FL_FILE_PATH_MAX, "%s/%s", dir, name) >= FL_FILE_PATH_MAX)
        fl_die("path too long: %s/%s", dir, name);
}

void fl_peft_read_config(const char *dir, fl_lora_config *out) {
    char path[FL_FILE_PATH_MAX], err[512];
    join(path, dir, PEFT_CONFIG);
    size_t n;
    char *json = (char *)fl_file_read_all(path, PEFT_MAX_JSON, &n, "PEFT adapter config");
    if (fl_peft_config_parse(json, n, out, err, sizeof err) != 0) fl_die("%s: %s", path, err);
    fl_free(json);
}

// ----------------------------------------------------------------------------
// save

// target_modules as PEFT writes it: the entries, "all-linear", and for the
// architecture's default the module names it resolved to (the last part of
// each adapted module's name, once each), as PEFT stores the resolved set.
static void add_targets(cJSON *r, const fl_model *m) {
    char copy[FL_LORA_TARGETS_MAX];
    snprintf(copy, sizeof copy, "%s", m->lora.cfg.target_modules);
    // blanks around the commas are the config's spelling, not PEFT's names
    char *save = NULL, *e = strtok_r(copy, ", ", &save);
    if (e && strcmp(e, PEFT_ALL_LINEAR) == 0) {
        cJSON_AddStringToObject(r, "target_modules", PEFT_ALL_LINEAR);
        return;
    }
    cJSON *list = cJSON_AddArrayToObject(r, "target_modules");
    if (e) {
        for (; e; e = strtok_r(NULL, ", ", &save))
            cJSON_AddItemToArray(list, cJSON_CreateString(e));
        return;
    }
    const fl_param_table *lt = &m->lora.table;
    for (int i = 0; i < lt->count; i += 2) { // lora_A rows: "<module>.lora_A.weight"
        char module[FL_PARAM_NAME_MAX];
        snprintf(module, sizeof module, "%s", lt->views[i].name);
        char *end = strstr(module, ".lora_A.");
        FL_ASSERT(end);
        *end = 0;
        const char *leaf = strrchr(module, '.') ? strrchr(module, '.') + 1 : module;
        int seen = 0;
        const cJSON *item;
        cJSON_ArrayForEach(item, list) seen |= strcmp(item->valuestring, leaf) == 0;
        if (!seen) cJSON_AddItemToArray(list, cJSON_CreateString(leaf));
    }
}

// LoraConfig.to_dict() of these adapters, keys in sorted order.
static cJSON *peft_config(const fl_model *m, const char *base_model) {
    const fl_lora_config *c = &m->lora.cfg;
    cJSON *r = cJSON_CreateObject();
    cJSON_AddObjectToObject(r, "alpha_pattern");
    cJSON_AddNullToObject(r, "auto_mapping");
    if (base_model)
        cJSON_AddStringToObject(r, "base_model_name_or_path", base_model);
    else
        cJSON_AddNullToObject(r, "base_model_name_or_path");
    cJSON_AddStringToObject(r, "bias", "none");
    cJSON_AddNullToObject(r, "exclude_modules");
    // GPT-2's Conv1D stores weights (in, out): PEFT must know to merge B @ A
    // transposed into them
    cJSON_AddBoolToObject(r, "fan_in_fan_out", m->config.arch == FL_ARCH_GPT2);
    cJSON_AddTrueToObject(r, "inference_mode");
    if (c->init == FL_LORA_INIT_GAUSSIAN)
        cJSON_AddStringToObject(r, "init_lora_weights", "gaussian");
    else
        cJSON_AddTrueToObject(r, "init_lora_weights");
    cJSON_AddNullToObject(r, "layer_replication");
    cJSON_AddNullToObject(r, "layers_pattern");
    cJSON_AddNullToObject(r, "layers_to_transform");
    cJSON_AddObjectToObject(r, "loftq_config");
    cJSON_AddNumberToObject(r, "lora_alpha", fl_json_float(c->alpha));
    cJSON_AddNumberToObject(r, "lora_dropout", fl_json_float(c->dropout));
    cJSON_AddNullToObject(r, "megatron_config");
    cJSON_AddStringToObject(r, "megatron_core", "megatron.core");
    cJSON_AddNullToObject(r, "modules_to_save");
    cJSON_AddStringToObject(r, "peft_type", "LORA");
    cJSON_AddNumberToObject(r, "r", c->r);
    cJSON_AddObjectToObject(r, "rank_pattern");
    cJSON_AddNullToObject(r, "revision");
    add_targets(r, m);
    cJSON_AddStringToObject(r, "task_type", "CAUSAL_LM");
    cJSON_AddFalseToObject(r, "use_dora");
    cJSON_AddBoolToObject(r, "use_rslora", c->use_rslora);
    return r;
}

static void save_fill(void *ctx, int i, void *dst) {
    const fl_model *m = ctx;
    const fl_param_view *v = &m->lora.table.views[i];
    fl_dev_download(m->dev, dst, fl_at_const(m->dtype, m->lora.params, v->offset),
                    v->numel * fl_dtype_size(m->dtype));
}

// The adapter's two files and their temporaries (PEFT's README.md and
// anything else in the directory stay).
static int is_adapter_file(const char *name) { // exactly: a user's copies beside them stay
    return !strcmp(name, PEFT_WEIGHTS) || !strcmp(name, PEFT_CONFIG);
}

void fl_peft_save(const char *out_dir, const fl_model *m, const char *base_model) {
    FL_ASSERT(m->lora.cfg.r > 0);
    // out_dir is a run's own (OUT/adapter), not a name the user gave: a link
    // planted there would have the pair written into whatever it names
    struct stat st;
    if (lstat(out_dir, &st) == 0 && S_ISLNK(st.st_mode))
        fl_die("%s is a symbolic link: fitlm writes the adapter there as a directory of its own "
               "and does not follow a link (remove it; the run's checkpoints hold the adapters)",
               out_dir);
    // the pair is written beside out_dir and swapped in whole (io.h)
    fl_dir_txn txn;
    const char *dir = fl_dir_begin(&txn, out_dir, is_adapter_file);
    const fl_param_table *lt = &m->lora.table;
    fl_st_tensor *tensors = fl_alloc(FL_MEM_OTHER, (size_t)lt->count * sizeof *tensors);
    char(*names)[PEFT_NAME_MAX] = fl_alloc(FL_MEM_OTHER, (size_t)lt->count * PEFT_NAME_MAX);
    for (int i = 0; i < lt->count; i++) {
        const fl_param_view *v = &lt->views[i];
        fl_lora_peft_name(&m->config, v->name, names[i], PEFT_NAME_MAX);
        tensors[i] = (fl_st_tensor){.name = names[i],
                                    .dtype = m->dtype,
                                    .ndim = v->ndim,
                                    .shape = {v->shape[0], v->shape[1]},
                                    .numel = v->numel};
    }
    // Each file is replaced whole (temporary file and rename); the weights
    // go first, so where the directory is written in place a crash between
    // the two leaves a config that no longer matches only when r or the
    // targets changed, which fl_peft_load refuses.
    char path[FL_FILE_PATH_MAX];
    join(path, dir, PEFT_WEIGHTS);
    fl_safetensors_write(path, tensors, lt->count, save_fill, (void *)m);
    cJSON *r = peft_config(m, base_model);
    char *json = cJSON_Print(r);
    cJSON_Delete(r);
    if (!json) fl_die("out of memory writing %s/%s", dir, PEFT_CONFIG);
    join(path, dir, PEFT_CONFIG);
    fl_file_write_all(path, json, strlen(json));
    cJSON_free(json);
    fl_dir_commit(&txn);
    fl_free(tensors), fl_free(names);
}

// ----------------------------------------------------------------------------
// load

// The adapters m was built with must be the ones DIR describes: r and the
// scaling decide what the weights mean (the shapes check r again).
static void check_same_config(const char *dir, const fl_lora_config *have) {
    fl_lora_config want;
    fl_peft_read_config(dir, &want);
    if (want.r != have->r || want.alpha != have->alpha || want.use_rslora != have->use_rslora)
        fl_die("%s/%s: r %d, lora_alpha %g, use_rslora %d, but the model's adapters have r %d, "
               "lora_alpha %g, use_rslora %d",
               dir, PEFT_CONFIG, want.r, (double)want.alpha, want.use_rslora, have->r,
               (double)have->alpha, have->use_rslora);
}

void fl_peft_load(const char *dir, fl_model *m) {
    FL_ASSERT(m->lora.cfg.r > 0);
    check_same_config(dir, &m->lora.cfg);
    char path[FL_FILE_PATH_MAX];
    join(path, dir, PEFT_WEIGHTS);
    fl_safetensors st;
    fl_safetensors_open(&st, path);
    const fl_param_table *lt = &m->lora.table;
    // every stored tensor is one of ours (the parser refused repeated names)
    char name[PEFT_NAME_MAX];
    for (int k = 0; k < st.count; k++) {
        int found = 0;
        for (int i = 0; i < lt->count && !found; i++) {
            fl_lora_peft_name(&m->config, lt->views[i].name, name, sizeof name);
            found = strcmp(name, st.tensors[k].name) == 0;
        }
        if (!found)
            fl_die("%s: unknown tensor '%s': the model's adapters (target_modules \"%s\") have no "
                   "such module",
                   path, st.tensors[k].name, m->lora.cfg.target_modules);
    }
    size_t largest = 1;
    for (int i = 0; i < lt->count; i++)
        if (lt->views[i].numel > largest) largest = lt->views[i].numel;
    void *raw = fl_alloc(FL_MEM_WORKSPACE, largest * sizeof(float));
    // a device's adapters are converted on the host, then uploaded
    const fl_device *dev = m->dev;
    void *staged = dev->host ? NULL : fl_alloc(FL_MEM_OTHER, largest * fl_dtype_size(m->dtype));
    for (int i = 0; i < lt->count; i++) {
        const fl_param_view *v = &lt->views[i];
        fl_lora_peft_name(&m->config, v->name, name, sizeof name);
        const fl_st_tensor *t = fl_safetensors_find(&st, name);
        if (!t) fl_die("%s: tensor '%s' is missing", path, name);
        int ok = t->ndim == 2 && t->shape[0] == v->shape[0] && t->shape[1] == v->shape[1];
        if (!ok) {
            char got[160], want[64];
            uint64_t shape[2] = {v->shape[0], v->shape[1]};
            fl_shape_str(got, sizeof got, t->ndim, t->shape);
            fl_shape_str(want, sizeof want, 2, shape);
            fl_die("%s: tensor '%s' has shape %s, the model (r %d) needs %s: is the adapter "
                   "for another base model?",
                   path, name, got, m->lora.cfg.r, want);
        }
        // copied out first: the data may sit at any alignment in the mapping
        memcpy(raw, st.data + t->begin, t->end - t->begin);
        void *dst = fl_at(m->dtype, m->lora.params, v->offset);
        fl_convert(m->dtype, staged ? staged : dst, t->dtype, raw, v->numel);
        if (staged) fl_dev_upload(dev, dst, staged, v->numel * fl_dtype_size(m->dtype));
    }
    fl_free(staged);
    fl_free(raw);
    fl_safetensors_free(&st);
}
