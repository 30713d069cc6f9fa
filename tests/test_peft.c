// test_peft.c: the PEFT LoRA adapter format. adapter_config.json and
// adapter_model.safetensors as peft's save_pretrained writes them: PEFT's
// keys and names, save -> load bit for bit (and rounded once into another
// dtype); configs and files PEFT writes but fitlm cannot honour are refused
// with a message naming what is wrong; seeded mutations of a config never
// crash its parser; `fitlm export --merge` writes the merged weights rounded
// once, and `fitlm sample --adapter` samples the merged model.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cjson/cJSON.h>

#include "fitlm/io.h"
#include "fitlm/safetensors.h"
#include "testlib.h"

static char dir[] = "/tmp/fitlm_test_peft_XXXXXX";

#define PATH_MAX_LEN 1024

// ----------------------------------------------------------------------------
// helpers shared with test_formats.c (copied: small, and tied to its fixtures)

static char *in_dir(char *out, const char *name) {
    snprintf(out, PATH_MAX_LEN, "%s/%s", dir, name);
    return out;
}

static int same_floats(const float *a, const float *b, size_t n) {
    return memcmp(a, b, n * sizeof(float)) == 0;
}

// A LLaMA shape whose matrices are all non-square (k/v_proj (16, 32), the
// MLP (48, 32) and (32, 48)), with non-default eps and theta.
static fl_model_config llama_config(int tie) {
    return (fl_model_config){.arch = FL_ARCH_LLAMA,
                             .max_seq_len = 16,
                             .vocab_size = 100,
                             .n_layer = 2,
                             .n_head = 4,
                             .n_kv_head = 2,
                             .n_embd = 32,
                             .intermediate_size = 48,
                             .norm_eps = 1e-6f,
                             .rope_theta = 500000.0f,
                             .tie_embeddings = tie};
}

// ----------------------------------------------------------------------------
// PEFT LoRA adapters: adapter_config.json and adapter_model.safetensors as
// peft's save_pretrained writes them; save -> load is bitwise; a merged
// export equals fl_model_merged_f32 rounded once to the dtype.

#define PEFT_R 4

static fl_model_config gpt2_tiny(int vocab) {
    return (fl_model_config){
        .max_seq_len = 16, .vocab_size = vocab, .n_layer = 2, .n_head = 4, .n_embd = 32};
}

static fl_model_config peft_base(int llama) {
    return llama ? llama_config(0) : gpt2_tiny(100);
}

// Random A and B (B non-zero, so B @ A is not zero and every value is
// seen by the round trip).
static void fill_adapters(fl_model *m, unsigned seed) {
    size_t n = m->lora.table.numel;
    float *x = malloc(n * sizeof(float));
    t_fill(x, n, seed, 0.5f);
    fl_store_f32(m->dtype, m->lora.params, x, n);
    free(x);
}

// Adapters with r 4, alpha 16, dropout 0.05 on `targets`.
static void add_adapters(fl_model *m, const char *targets, fl_lora_init init, unsigned seed) {
    fl_lora_config lc;
    fl_lora_config_defaults(&lc);
    lc.r = PEFT_R;
    lc.alpha = 16;
    lc.dropout = 0.05f;
    lc.init = init;
    snprintf(lc.target_modules, sizeof lc.target_modules, "%s", targets);
    fl_model_add_lora(m, &lc, seed);
    fill_adapters(m, seed);
}

typedef struct {
    const char *name;
    int llama;
    fl_dtype dt;
    const char *targets;
    fl_lora_init init;
    const char *saved; // target_modules as written: names joined by commas, or "all-linear"
    struct {
        const char *name;
        int ndim; // 0: not stored
        uint64_t d0, d1;
    } stored[4];
} peft_case;

static const peft_case peft_cases[] = {
    {"llama_qv_fp32",
     1,
     FL_F32,
     "q_proj,v_proj",
     FL_LORA_INIT_DEFAULT,
     "q_proj,v_proj",
     {{"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", 2, PEFT_R, 32},
      {"base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight", 2, 16, PEFT_R},
      {"base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight", 0, 0, 0}}},
    {"llama_all_bf16",
     1,
     FL_BF16,
     "all-linear",
     FL_LORA_INIT_GAUSSIAN,
     "all-linear",
     {{"base_model.model.model.layers.1.mlp.down_proj.lora_A.weight", 2, PEFT_R, 48},
      {"base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight", 2, 48, PEFT_R},
      {"base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight", 2, 32, PEFT_R},
      {"base_model.model.lm_head.lora_A.weight", 0, 0, 0}}},
    {"llama_default_fp32",
     1,
     FL_F32,
     "",
     FL_LORA_INIT_DEFAULT,
     "q_proj,v_proj",
     {{"base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight", 2, 32, PEFT_R}}},
    {"gpt2_attn_fp32",
     0,
     FL_F32,
     "c_attn",
     FL_LORA_INIT_DEFAULT,
     "c_attn",
     {{"base_model.model.transformer.h.0.attn.c_attn.lora_A.weight", 2, PEFT_R, 32},
      {"base_model.model.transformer.h.1.attn.c_attn.lora_B.weight", 2, 96, PEFT_R},
      {"base_model.model.transformer.h.0.attn.c_proj.lora_A.weight", 0, 0, 0}}},
    {"gpt2_default_bf16",
     0,
     FL_BF16,
     "",
     FL_LORA_INIT_GAUSSIAN,
     "c_attn",
     {{"base_model.model.transformer.h.1.attn.c_attn.lora_A.weight", 2, PEFT_R, 32}}},
};

// adapter_config.json: PEFT's keys, sorted, with these adapters' values.
static void check_peft_json(const char *what, const char *path, const peft_case *c) {
    static const char *keys[] = {"alpha_pattern",
                                 "auto_mapping",
                                 "base_model_name_or_path",
                                 "bias",
                                 "exclude_modules",
                                 "fan_in_fan_out",
                                 "inference_mode",
                                 "init_lora_weights",
                                 "layer_replication",
                                 "layers_pattern",
                                 "layers_to_transform",
                                 "loftq_config",
                                 "lora_alpha",
                                 "lora_dropout",
                                 "megatron_config",
                                 "megatron_core",
                                 "modules_to_save",
                                 "peft_type",
                                 "r",
                                 "rank_pattern",
                                 "revision",
                                 "target_modules",
                                 "task_type",
                                 "use_dora",
                                 "use_rslora"};
    size_t n;
    char *json = (char *)t_read_file(path, &n);
    cJSON *r = json ? cJSON_ParseWithLength(json, n) : NULL;
    free(json);
    if (!t_check(cJSON_IsObject(r), "%s: adapter_config.json is a JSON object", what)) return;
    int k = 0, in_order = 1;
    const cJSON *e;
    cJSON_ArrayForEach(e, r) {
        in_order &= k < (int)(sizeof keys / sizeof keys[0]) && strcmp(e->string, keys[k]) == 0;
        k++;
    }
    t_check(in_order && k == (int)(sizeof keys / sizeof keys[0]),
            "%s: adapter_config.json has PEFT's %zu keys, sorted", what,
            sizeof keys / sizeof keys[0]);
#define STR_IS(key, want)                                                                          \
    (cJSON_IsString(cJSON_GetObjectItem(r, key)) &&                                                \
     strcmp(cJSON_GetObjectItem(r, key)->valuestring, want) == 0)
#define NUM_IS(key, want)                                                                          \
    (cJSON_IsNumber(cJSON_GetObjectItem(r, key)) &&                                                \
     cJSON_GetObjectItem(r, key)->valuedouble == want)
#define EMPTY_OBJ(key)                                                                             \
    (cJSON_IsObject(cJSON_GetObjectItem(r, key)) && !cJSON_GetObjectItem(r, key)->child)
    t_check(STR_IS("peft_type", "LORA") && STR_IS("task_type", "CAUSAL_LM") &&
                STR_IS("bias", "none") && STR_IS("base_model_name_or_path", "tiny-base") &&
                NUM_IS("r", PEFT_R) && NUM_IS("lora_alpha", 16) && NUM_IS("lora_dropout", 0.05),
            "%s: peft_type, task_type, bias, base model, r, lora_alpha, lora_dropout", what);
    t_check(cJSON_IsBool(cJSON_GetObjectItem(r, "fan_in_fan_out")) &&
                cJSON_IsTrue(cJSON_GetObjectItem(r, "fan_in_fan_out")) == !c->llama,
            "%s: fan_in_fan_out is %s", what, c->llama ? "false (nn.Linear)" : "true (Conv1D)");
    t_check(c->init == FL_LORA_INIT_GAUSSIAN
                ? STR_IS("init_lora_weights", "gaussian")
                : cJSON_IsTrue(cJSON_GetObjectItem(r, "init_lora_weights")),
            "%s: init_lora_weights", what);
    t_check(cJSON_IsFalse(cJSON_GetObjectItem(r, "use_rslora")) &&
                cJSON_IsFalse(cJSON_GetObjectItem(r, "use_dora")) &&
                cJSON_IsTrue(cJSON_GetObjectItem(r, "inference_mode")) &&
                cJSON_IsNull(cJSON_GetObjectItem(r, "modules_to_save")) &&
                cJSON_IsNull(cJSON_GetObjectItem(r, "layers_to_transform")) &&
                EMPTY_OBJ("rank_pattern") && EMPTY_OBJ("alpha_pattern"),
            "%s: use_rslora, use_dora, inference_mode, modules_to_save, layers_to_transform, "
            "rank_pattern, alpha_pattern",
            what);
    char joined[FL_LORA_TARGETS_MAX] = "";
    const cJSON *t = cJSON_GetObjectItem(r, "target_modules");
    if (cJSON_IsString(t)) snprintf(joined, sizeof joined, "%s", t->valuestring);
    const cJSON *list = cJSON_IsArray(t) ? t : NULL;
    cJSON_ArrayForEach(e, list) {
        size_t len = strlen(joined);
        snprintf(joined + len, sizeof joined - len, "%s%s", len ? "," : "",
                 cJSON_IsString(e) ? e->valuestring : "?");
    }
    t_check(strcmp(joined, c->saved) == 0 && (cJSON_IsArray(t) || !strcmp(c->saved, "all-linear")),
            "%s: target_modules %s, got %s", what, c->saved, joined);
#undef STR_IS
#undef NUM_IS
#undef EMPTY_OBJ
    cJSON_Delete(r);
}

static void test_peft_roundtrip(void) {
    char path[PATH_MAX_LEN], file[PATH_MAX_LEN + 32];
    for (size_t k = 0; k < sizeof peft_cases / sizeof peft_cases[0]; k++) {
        const peft_case *c = &peft_cases[k];
        char name[64];
        snprintf(name, sizeof name, "peft_%s", c->name);
        fl_model_config cfg = peft_base(c->llama);
        fl_model m;
        fl_model_init(&m, &cfg, c->dt, 3);
        add_adapters(&m, c->targets, c->init, 100 + (unsigned)k);
        in_dir(path, name);
        fl_peft_save(path, &m, "tiny-base");
        snprintf(file, sizeof file, "%s/adapter_config.json", path);
        check_peft_json(c->name, file, c);

        // the config reads back as the adapters were made
        fl_lora_config lc;
        fl_peft_read_config(path, &lc);
        t_check(lc.r == PEFT_R && lc.alpha == 16 && lc.dropout == 0.05f && !lc.use_rslora &&
                    lc.init == c->init && strcmp(lc.target_modules, c->saved) == 0,
                "%s: adapter_config.json reads back (target_modules '%s')", c->name,
                lc.target_modules);

        // PEFT's names and shapes, the model's dtype, one tensor per row
        snprintf(file, sizeof file, "%s/adapter_model.safetensors", path);
        fl_safetensors st;
        fl_safetensors_open(&st, file);
        int same_dt = 1;
        for (int i = 0; i < st.count; i++) same_dt &= st.tensors[i].dtype == c->dt;
        t_check(st.count == m.lora.table.count && same_dt, "%s: %d tensors of %s", c->name,
                st.count, fl_dtype_name(c->dt));
        for (int i = 0; i < 4 && c->stored[i].name; i++)
            t_st_stored(&st, c->name, c->stored[i].name, c->stored[i].ndim, c->stored[i].d0,
                        c->stored[i].d1);
        fl_safetensors_free(&st);

        // a fresh base with the adapters the files describe: the same bits
        fl_model got;
        fl_model_init(&got, &cfg, c->dt, 4);
        fl_model_add_lora(&got, &lc, 5);
        fl_peft_load(path, &got);
        size_t n = m.lora.table.numel;
        t_check(got.lora.table.count == m.lora.table.count && got.lora.table.numel == n &&
                    memcmp(got.lora.params, m.lora.params, n * fl_dtype_size(c->dt)) == 0,
                "%s: save -> load is bitwise", c->name);
        fl_model_free(&got);

        // into another dtype: the stored values rounded once
        fl_dtype other = c->dt == FL_F32 ? FL_BF16 : FL_F32;
        fl_model_init(&got, &cfg, other, 4);
        fl_model_add_lora(&got, &lc, 5);
        fl_peft_load(path, &got);
        void *want = malloc(n * sizeof(float));
        fl_convert(other, want, c->dt, m.lora.params, n);
        t_check(memcmp(got.lora.params, want, n * fl_dtype_size(other)) == 0,
                "%s: loaded into %s, the values rounded once", c->name, fl_dtype_name(other));
        free(want);
        fl_model_free(&got);
        fl_model_free(&m);
    }
}

// A tiny LLaMA or GPT-2 base with the adapters DIR's config describes and
// DIR's weights.
typedef struct {
    const char *dir;
    int llama;
} peft_arg;

static void load_peft(void *p) {
    const peft_arg *a = p;
    fl_model_config cfg = peft_base(a->llama);
    fl_model m;
    fl_model_init(&m, &cfg, FL_F32, 1);
    fl_lora_config lc;
    fl_peft_read_config(a->dir, &lc);
    fl_model_add_lora(&m, &lc, 1);
    fl_peft_load(a->dir, &m);
    fl_model_free(&m);
}

// The adapters of peft_llama_qv_fp32, then DIR's files loaded into them.
static void load_peft_into_qv(void *dir_) {
    char src[PATH_MAX_LEN];
    fl_model_config cfg = llama_config(0);
    fl_model m;
    fl_model_init(&m, &cfg, FL_F32, 1);
    fl_lora_config lc;
    fl_peft_read_config(in_dir(src, "peft_llama_qv_fp32"), &lc);
    fl_model_add_lora(&m, &lc, 1);
    fl_peft_load(dir_, &m);
    fl_model_free(&m);
}

#define PEFT_OK "{\"peft_type\": \"LORA\", \"target_modules\": [\"q_proj\"]"

static void test_peft_configs(void) {
    // what peft 0.13's save_pretrained wrote for a LLaMA adapter
    const char *real =
        "{\n  \"alpha_pattern\": {},\n  \"auto_mapping\": null,\n  \"base_model_name_or_path\": "
        "\"meta-llama/Llama-2-7b-hf\",\n  \"bias\": \"none\",\n  \"fan_in_fan_out\": false,\n  "
        "\"inference_mode\": true,\n  \"init_lora_weights\": true,\n  \"layer_replication\": "
        "null,\n  \"layers_pattern\": null,\n  \"layers_to_transform\": null,\n  "
        "\"loftq_config\": {},\n  \"lora_alpha\": 32,\n  \"lora_dropout\": 0.1,\n  "
        "\"megatron_config\": null,\n  \"megatron_core\": \"megatron.core\",\n  "
        "\"modules_to_save\": null,\n  \"peft_type\": \"LORA\",\n  \"r\": 16,\n  "
        "\"rank_pattern\": {},\n  \"revision\": null,\n  \"target_modules\": [\n    \"v_proj\",\n "
        "   \"q_proj\"\n  ],\n  \"task_type\": \"CAUSAL_LM\",\n  \"use_dora\": false,\n  "
        "\"use_rslora\": false\n}";
    fl_lora_config c;
    char err[512] = "";
    int rc = fl_peft_config_parse(real, strlen(real), &c, err, sizeof err);
    t_check(rc == 0 && c.r == 16 && c.alpha == 32 && c.dropout == 0.1f && !c.use_rslora &&
                c.init == FL_LORA_INIT_DEFAULT && strcmp(c.target_modules, "v_proj,q_proj") == 0,
            "a PEFT LLaMA adapter config parses: %s", err);
    const char *minimal = "{\"peft_type\": \"LORA\", \"target_modules\": null}";
    fl_lora_config def;
    fl_lora_config_defaults(&def);
    rc = fl_peft_config_parse(minimal, strlen(minimal), &c, err, sizeof err);
    t_check(rc == 0 && c.r == def.r && c.alpha == def.alpha && c.target_modules[0] == 0,
            "target_modules null: PEFT's defaults and the architecture's modules: %s", err);
    // fan_in_fan_out true on a LLaMA adapter: not needed to read the weights
    const char *other = PEFT_OK ", \"init_lora_weights\": \"gaussian\", \"use_rslora\": true, "
                                "\"fan_in_fan_out\": true, \"rank_pattern\": null, "
                                "\"modules_to_save\": [], \"r\": 64}";
    rc = fl_peft_config_parse(other, strlen(other), &c, err, sizeof err);
    t_check(rc == 0 && c.r == 64 && c.use_rslora && c.init == FL_LORA_INIT_GAUSSIAN,
            "gaussian init, rsLoRA, empty patterns and fan_in_fan_out parse: %s", err);
    const char *all = "{\"peft_type\": \"LORA\", \"target_modules\": \"all-linear\"}";
    rc = fl_peft_config_parse(all, strlen(all), &c, err, sizeof err);
    t_check(rc == 0 && strcmp(c.target_modules, "all-linear") == 0, "\"all-linear\" parses: %s",
            err);

    char long_list[1024] = "{\"peft_type\": \"LORA\", \"target_modules\": [";
    for (int i = 0; i < 30; i++) strcat(long_list, i ? ", \"abcdefghij\"" : "\"abcdefghij\"");
    strcat(long_list, "]}");
    const struct {
        const char *name, *json, *expect;
    } bad[] = {
        {"AdaLoRA", "{\"peft_type\": \"ADALORA\", \"target_modules\": null}",
         "peft_type is ADALORA"},
        {"IA3", "{\"peft_type\": \"IA3\", \"target_modules\": null}", "peft_type is IA3"},
        {"no peft_type", "{\"target_modules\": null}", "peft_type is missing"},
        {"bias all", PEFT_OK ", \"bias\": \"all\"}", "bias all is not supported"},
        {"bias lora_only", PEFT_OK ", \"bias\": \"lora_only\"}", "bias lora_only"},
        {"DoRA", PEFT_OK ", \"use_dora\": true}", "use_dora true is not supported"},
        {"rank_pattern", PEFT_OK ", \"rank_pattern\": {\"q_proj\": 16}}", "rank_pattern is set"},
        {"alpha_pattern", PEFT_OK ", \"alpha_pattern\": {\"q_proj\": 16}}", "alpha_pattern is set"},
        {"modules_to_save", PEFT_OK ", \"modules_to_save\": [\"lm_head\"]}",
         "modules_to_save is set"},
        {"layers_to_transform", PEFT_OK ", \"layers_to_transform\": [0]}",
         "layers_to_transform is set"},
        {"PiSSA", PEFT_OK ", \"init_lora_weights\": \"pissa\"}",
         "init_lora_weights pissa is not supported"},
        {"OLoRA", PEFT_OK ", \"init_lora_weights\": \"olora\"}",
         "init_lora_weights olora is not supported"},
        {"init false", PEFT_OK ", \"init_lora_weights\": false}",
         "init_lora_weights false is not supported"},
        {"NUL in a module name", "{\"peft_type\": \"LORA\", \"target_modules\": [\"q\\u0000k\"]}",
         "(a NUL character) at line 1 (byte 43), in the value of \"target_modules\""},
        {"r 0", PEFT_OK ", \"r\": 0}", "r must be an integer in [1, 65536]"},
        {"r huge", PEFT_OK ", \"r\": 1e9}", "r must be an integer"},
        {"r fractional", PEFT_OK ", \"r\": 2.5}", "r must be an integer"},
        {"dropout 1", PEFT_OK ", \"lora_dropout\": 1}", "lora_dropout must be a number in [0, 1)"},
        {"dropout negative", PEFT_OK ", \"lora_dropout\": -0.1}", "lora_dropout must be"},
        {"alpha a string", PEFT_OK ", \"lora_alpha\": \"16\"}", "lora_alpha must be a number"},
        {"rslora not a bool", PEFT_OK ", \"use_rslora\": \"yes\"}",
         "use_rslora must be true or false"},
        {"LoRA biases", PEFT_OK ", \"lora_bias\": true}", "lora_bias true is not supported"},
        {"task", PEFT_OK ", \"task_type\": \"SEQ_CLS\"}", "task_type is SEQ_CLS"},
        {"no target_modules", "{\"peft_type\": \"LORA\"}", "target_modules is missing"},
        {"empty target_modules", "{\"peft_type\": \"LORA\", \"target_modules\": []}",
         "non-empty list"},
        {"target_modules a number", "{\"peft_type\": \"LORA\", \"target_modules\": 5}",
         "non-empty list"},
        {"target_modules of numbers", "{\"peft_type\": \"LORA\", \"target_modules\": [1]}",
         "non-empty module names"},
        {"target_modules a regex", "{\"peft_type\": \"LORA\", \"target_modules\": \".*q_proj\"}",
         "is a regular expression"},
        {"target_modules too long", long_list, "take more than 255 bytes"},
        {"not JSON", "{\"peft_type\": ", "not valid JSON"},
        {"not an object", "[1]", "not a JSON object"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        err[0] = 0;
        rc = fl_peft_config_parse(bad[k].json, strlen(bad[k].json), &c, err, sizeof err);
        t_check(rc == -1 && strstr(err, bad[k].expect), "%s: refused saying \"%s\", got %d: %s",
                bad[k].name, bad[k].expect, rc, err);
    }

    // through the file: the message names it
    char d[PATH_MAX_LEN], path[PATH_MAX_LEN + 32];
    in_dir(d, "peft_bad_config");
    mkdir(d, 0755);
    snprintf(path, sizeof path, "%s/adapter_config.json", d);
    t_write_text(path, bad[0].json);
    peft_arg a = {d, 1};
    t_dies("AdaLoRA adapter_config.json", load_peft, &a,
           "peft_bad_config/adapter_config.json: peft_type is ADALORA");
    t_dies("no adapter_config.json", load_peft, &(peft_arg){"/nonexistent/adapter", 1},
           "/nonexistent/adapter/adapter_config.json");
}

// A copy of peft_llama_qv_fp32 as dir/<name> with the weights edited.
static const char *peft_copy(char *d, const char *name, const t_st_edit *e) {
    char src[PATH_MAX_LEN + 64], dst[PATH_MAX_LEN + 64];
    in_dir(d, name);
    mkdir(d, 0755);
    snprintf(src, sizeof src, "%s/peft_llama_qv_fp32/adapter_config.json", dir);
    snprintf(dst, sizeof dst, "%s/adapter_config.json", d);
    size_t n;
    unsigned char *json = t_read_file(src, &n);
    t_write_file(dst, json, n);
    free(json);
    snprintf(src, sizeof src, "%s/peft_llama_qv_fp32/adapter_model.safetensors", dir);
    snprintf(dst, sizeof dst, "%s/adapter_model.safetensors", d);
    if (e) t_st_rewrite(src, dst, e);
    return d;
}

#define QV(layer, mod, ab)                                                                         \
    "base_model.model.model.layers." #layer ".self_attn." mod ".lora_" ab ".weight"

static void test_peft_bad_files(void) {
    char d[PATH_MAX_LEN], path[PATH_MAX_LEN + 64];
    const struct {
        const char *name;
        t_st_edit edit;
        const char *expect;
    } cases[] = {
        {"missing tensor",
         {.drop = QV(1, "v_proj", "B")},
         "tensor '" QV(1, "v_proj", "B") "' is missing"},
        {"extra tensor",
         {.copy = QV(0, "q_proj", "A"), .copy_as = QV(0, "k_proj", "A")},
         "unknown tensor '" QV(0, "k_proj", "A") "'"},
        {"adapter name kept in the name",
         {.from = QV(0, "q_proj", "A"),
          .to = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"},
         "unknown tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight'"},
        {"transposed lora_A",
         {.transpose = QV(0, "q_proj", "A")},
         "tensor '" QV(0, "q_proj", "A") "' has shape [32, 4], the model (r 4) needs [4, 32]"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char name[32];
        snprintf(name, sizeof name, "peft_bad_%zu", k);
        t_dies(cases[k].name, load_peft_into_qv, (void *)peft_copy(d, name, &cases[k].edit),
               cases[k].expect);
    }

    // an unsupported dtype, a truncated and a corrupt file, none at all
    peft_copy(d, "peft_f64", NULL);
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", d);
    const char *f64 = "{\"" QV(0, "q_proj", "A") "\":{\"dtype\":\"F64\",\"shape\":[4,32],"
                                                 "\"data_offsets\":[0,1024]}}";
    t_write_st(path, f64, 1024);
    t_dies("F64 adapter", load_peft_into_qv, d,
           "peft_f64/adapter_model.safetensors: tensor '" QV(0, "q_proj", "A") "' has dtype 'F64'");
    size_t n;
    snprintf(path, sizeof path, "%s/peft_llama_qv_fp32/adapter_model.safetensors", dir);
    unsigned char *good = t_read_file(path, &n);
    peft_copy(d, "peft_truncated", NULL);
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", d);
    t_write_file(path, good, n - 100);
    t_dies("truncated adapter", load_peft_into_qv, d, "peft_truncated/adapter_model.safetensors: ");
    peft_copy(d, "peft_corrupt", NULL);
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", d);
    good[8] = 'x'; // the header's '{'
    t_write_file(path, good, n);
    t_dies("corrupt adapter", load_peft_into_qv, d, "does not start with '{'");
    free(good);
    peft_copy(d, "peft_no_weights", NULL);
    t_dies("no adapter_model.safetensors", load_peft_into_qv, d,
           "peft_no_weights/adapter_model.safetensors: No such file");

    // the model's adapters must be the config's (r, alpha decide the meaning)
    peft_copy(d, "peft_alpha", &(t_st_edit){0});
    snprintf(path, sizeof path, "%s/adapter_config.json", d);
    char *json = (char *)t_read_file(path, &n);
    char *at = strstr(json, "\"lora_alpha\":\t16");
    if (t_check(at != NULL, "the saved config has lora_alpha 16")) {
        memcpy(at, "\"lora_alpha\":\t32", 16);
        t_write_file(path, json, n);
        t_dies("lora_alpha differs from the model's adapters", load_peft_into_qv, d,
               "lora_alpha 32, use_rslora 0, but the model's adapters have r 4, lora_alpha 16");
    }
    free(json);

    // an adapter trained on a wider model, and on the other architecture
    fl_model_config wide = llama_config(0);
    wide.n_embd = 64, wide.intermediate_size = 96;
    fl_model m;
    fl_model_init(&m, &wide, FL_F32, 1);
    add_adapters(&m, "q_proj,v_proj", FL_LORA_INIT_DEFAULT, 9);
    fl_peft_save(in_dir(d, "peft_wide"), &m, NULL);
    fl_model_free(&m);
    t_dies("adapter of a wider model", load_peft, &(peft_arg){d, 1},
           "has shape [4, 64], the model (r 4) needs [4, 32]");
    t_dies("GPT-2 adapter on a LLaMA base", load_peft,
           &(peft_arg){in_dir(d, "peft_gpt2_attn_fp32"), 1}, "c_attn");
    t_dies("LLaMA adapter on a GPT-2 base", load_peft,
           &(peft_arg){in_dir(d, "peft_llama_qv_fp32"), 0}, "q_proj");
}

// ----------------------------------------------------------------------------
// `fitlm export --merge` and `fitlm sample --adapter`, through the binary
// (FITLM_BINARY, set by CTest)

static char cli_output[16384];

// Runs `fitlm ARGS` in dir with stdout and stderr captured; the exit status.
static int fitlm(const char *args) {
    return t_fitlm(dir, args, 1, cli_output, sizeof cli_output);
}

static void fails_with(const char *args, const char *what) {
    t_fitlm_fails(dir, args, what, cli_output, sizeof cli_output);
}

// An HF base (vocab 257: the byte tokenizer's) as dir/<base> and adapters
// on it as dir/<adapter>.
static void merge_inputs(const char *base, const char *adapter, int llama, const char *targets) {
    char path[PATH_MAX_LEN];
    fl_model_config cfg = llama ? llama_config(0) : gpt2_tiny(257);
    cfg.vocab_size = 257;
    fl_model m;
    fl_model_init(&m, &cfg, FL_F32, 21);
    fl_hf_export(in_dir(path, base), &m, m.params, FL_F32, 0);
    add_adapters(&m, targets, FL_LORA_INIT_DEFAULT, 22);
    fl_peft_save(in_dir(path, adapter), &m, base);
    fl_model_free(&m);
}

// dir/<out> (written by `fitlm export --merge` in dt) holds the base of
// dir/<base> (its linear layers through NF4 when q is enabled) merged with
// dir/<adapter>, rounded once to dt.
static void check_merged(const char *what, const char *base, const char *adapter, const char *out,
                         fl_dtype dt, const fl_quant_config *q) {
    char path[PATH_MAX_LEN];
    fl_model m, got;
    fl_pretrained_load(in_dir(path, base), &m, FL_F32, q);
    fl_lora_config lc;
    fl_peft_read_config(in_dir(path, adapter), &lc);
    fl_model_add_lora(&m, &lc, 0);
    fl_peft_load(path, &m);
    size_t n = m.table.numel;
    float *want = malloc(n * sizeof(float)), *rounded = malloc(n * sizeof(float));
    fl_model_merged_f32(&m, want);
    void *stored = malloc(n * sizeof(float));
    fl_convert(dt, stored, FL_F32, want, n);
    fl_convert(FL_F32, rounded, dt, stored, n);
    fl_hf_load(in_dir(path, out), &got, FL_F32);
    t_check(got.table.numel == n && same_floats(got.params, rounded, n),
            "%s: the export is fl_model_merged_f32 rounded to %s", what, fl_dtype_name(dt));
    float *base_w = malloc(n * sizeof(float));
    for (int r = 0; r < m.table.count; r++)
        fl_model_row_f32(&m, r, base_w + m.table.views[r].offset);
    t_check(!same_floats(want, base_w, n), "%s: the adapters change the weights", what);
    free(base_w);
    fl_model_free(&got);
    fl_model_free(&m);
    free(want), free(rounded), free(stored);
}

static void test_peft_merge(void) {
    merge_inputs("merge_llama", "merge_llama_adapter", 1, "q_proj,v_proj");
    merge_inputs("merge_gpt2", "merge_gpt2_adapter", 0, "c_attn");
    int rc = fitlm("export merge_llama --adapter merge_llama_adapter --merge -o merged_llama "
                   "--dtype bf16");
    t_check(rc == 0 && strstr(cli_output, "as bf16 tensors"),
            "export --merge (LLaMA, bf16) says the dtype: %.300s", cli_output);
    check_merged("LLaMA bf16", "merge_llama", "merge_llama_adapter", "merged_llama", FL_BF16, NULL);
    rc = fitlm("export merge_llama --adapter merge_llama_adapter --merge -o merged_llama32");
    t_check(rc == 0 && strstr(cli_output, "as fp32 tensors"),
            "export --merge (LLaMA, fp32): %.300s", cli_output);
    check_merged("LLaMA fp32", "merge_llama", "merge_llama_adapter", "merged_llama32", FL_F32,
                 NULL);
    rc =
        fitlm("export merge_gpt2 --merge --adapter merge_gpt2_adapter -o merged_gpt2 --dtype fp16");
    t_check(rc == 0 && strstr(cli_output, "as fp16 tensors"),
            "export --merge (GPT-2, fp16): %.300s", cli_output);
    check_merged("GPT-2 fp16", "merge_gpt2", "merge_gpt2_adapter", "merged_gpt2", FL_F16, NULL);

    // QLoRA: the adapter merged into the dequantised NF4 base, written in bf16
    rc = fitlm("export merge_llama --adapter merge_llama_adapter --merge --quantize nf4 "
               "--double-quant -o merged_nf4 --dtype bf16");
    t_check(rc == 0 && strstr(cli_output, "NF4 dequantised") && strstr(cli_output, "as bf16"),
            "export --merge --quantize nf4 says so: %.300s", cli_output);
    fl_quant_config nf4 = {1, 64, 1};
    check_merged("LLaMA NF4 (double quant) -> bf16", "merge_llama", "merge_llama_adapter",
                 "merged_nf4", FL_BF16, &nf4);
    fails_with("export merge_llama --quantize nf4 -o x", "--quantize nf4 applies to --merge");
    fails_with("export merge_llama --adapter merge_llama_adapter --merge --double-quant -o x",
               "apply with --quantize nf4");
    fails_with("export merge_llama --adapter merge_llama_adapter --merge --quantize fp4 -o x",
               "--quantize fp4 is not supported");
    fails_with("export merge_llama --adapter merge_llama_adapter -o x",
               "--adapter needs --merge: export writes a whole model");
    fails_with("export merge_llama --merge -o x", "--merge needs --adapter");
    fails_with("export merge_llama --adapter merge_llama_adapter --merge", "needs -o DIR");
    fails_with("export merge_llama --adapter merge_llama_adapter --merge -o merge_llama",
               "would overwrite the base");
    fails_with("export merge_llama --adapter merge_llama_adapter --merge -o x --dtype nf4",
               "--dtype must be fp32, bf16 or fp16");
    fails_with("export merge_llama --adapter merge_gpt2_adapter --merge -o x", "c_attn");

    // sampling with the adapters applied is sampling the merged model (greedy)
    char with[sizeof cli_output];
    rc = fitlm("sample --checkpoint merge_llama --adapter merge_llama_adapter --tokenizer byte "
               "--tokens 12 --temperature 0 --prompt ab");
    snprintf(with, sizeof with, "%s", cli_output);
    t_check(rc == 0, "sample --adapter runs: %.300s", with);
    rc = fitlm("sample --checkpoint merged_llama32 --tokenizer byte --tokens 12 --temperature 0 "
               "--prompt ab");
    t_check(rc == 0 && strcmp(with, cli_output) == 0,
            "sample --adapter gives the merged model's text: '%s' vs '%s'", with, cli_output);
    fails_with("sample --checkpoint merge_gpt2 --adapter merge_llama_adapter --tokenizer byte",
               "q_proj");
}

// ----------------------------------------------------------------------------
// seeded mutations of a valid adapter_config.json: the parser returns ok or an error

static int parse_peft(const unsigned char *b, size_t n, char *err, size_t errlen) {
    fl_lora_config c;
    int rc = fl_peft_config_parse((const char *)b, n, &c, err, errlen);
    // what the parser promises fl_lora_table
    if (rc == 0 && (c.r < 1 || !(c.alpha > 0) || !(c.dropout >= 0 && c.dropout < 1) ||
                    strnlen(c.target_modules, FL_LORA_TARGETS_MAX) == FL_LORA_TARGETS_MAX))
        rc = -2;
    return rc;
}

static void test_mutations(void) {
    char peft[PATH_MAX_LEN];
    t_mutations("adapter_config.json", in_dir(peft, "peft_llama_all_bf16/adapter_config.json"),
                2000, 6000000, parse_peft);
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    // t_dies forks: all of them before the first OpenMP region (the forward)
    test_peft_roundtrip();
    test_peft_configs();
    test_peft_bad_files();
    test_mutations();
    test_peft_merge(); // after the last t_dies: the merge may run in parallel
    if (t_remove_dir(dir) != 0) return 1;
    return t_report();
}
