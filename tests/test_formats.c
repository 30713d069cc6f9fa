// test_formats.c: model-file formats. Hugging Face export and import round
// trips are exact (fp32; fp16/bf16 give the rounded values), sharded or
// not; the PyTorch reference's initial weights, written by
// scripts/make_reference.py as HF safetensors and as llm.c files, load to
// exactly those weights and reproduce the reference logits (PEFT adapters:
// test_peft.c); malformed files are refused with a message
// naming what is wrong; and thousands of seeded mutations of valid files
// never crash the non-dying parsers (the sanitizer build catches any
// overread).
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fitlm/io.h"
#include "fitlm/kernels.h"
#include "fitlm/safetensors.h"
#include "testlib.h"
#include "testref.h"

static char dir[] = "/tmp/fitlm_test_formats_XXXXXX";

#define HF_FIXTURE   "tests/fixtures/gpt2_tiny_hf"
#define LLAMA_HF     "tests/fixtures/llama_tiny_hf"
#define LLAMA_REF    "tests/fixtures/llama_tiny.bin"
#define LLAMA_TIED   "tests/fixtures/llama_tiny_tied.bin"
#define LLMC_V3      "tests/fixtures/gpt2_tiny_llmc_v3.bin"
#define LLMC_V5      "tests/fixtures/gpt2_tiny_llmc_v5.bin"
#define PATH_MAX_LEN 1024

static char *in_dir(char *out, const char *name) {
    snprintf(out, PATH_MAX_LEN, "%s/%s", dir, name);
    return out;
}

// A directory `name` holding the reference config.json (or `config`).
static const char *model_dir(char *out, const char *name, const char *config) {
    in_dir(out, name);
    mkdir(out, 0755);
    char path[PATH_MAX_LEN + 16];
    snprintf(path, sizeof path, "%s/config.json", out);
    if (config) {
        t_write_text(path, config);
    } else {
        size_t n;
        unsigned char *c = t_read_file(t_source_path(HF_FIXTURE "/config.json"), &n);
        t_write_file(path, c, n);
        free(c);
    }
    return out;
}

static int same_floats(const float *a, const float *b, size_t n) {
    return memcmp(a, b, n * sizeof(float)) == 0;
}

static void load_hf(void *path) {
    fl_model m;
    fl_hf_load(path, &m, FL_F32);
}

static void load_llmc(void *path) {
    fl_model m;
    fl_llmc_load(path, &m, FL_F32);
}

// ----------------------------------------------------------------------------
// export -> import round trips

typedef struct {
    const char *name;
    fl_dtype dt;
    size_t shard_bytes;
    int shards;
} rt_case;

static int same_config(const fl_model_config *a, const fl_model_config *b) {
    return a->arch == b->arch && a->max_seq_len == b->max_seq_len &&
           a->vocab_size == b->vocab_size && a->padded_vocab_size == b->padded_vocab_size &&
           a->n_layer == b->n_layer && a->n_head == b->n_head && a->n_kv_head == b->n_kv_head &&
           a->n_embd == b->n_embd && a->intermediate_size == b->intermediate_size &&
           a->norm_eps == b->norm_eps && a->rope_theta == b->rope_theta &&
           a->tie_embeddings == b->tie_embeddings;
}

// Exports m in each case's dtype and shard size to dir/<prefix><case> and
// loads it back: the same config, the weights rounded once to the dtype.
static void roundtrip(const fl_model *m, const char *prefix, const rt_case *cases, int n_cases) {
    size_t n = m->table.numel;
    const float *w = m->params;
    float *want = malloc(n * sizeof(float));
    void *stored = malloc(n * sizeof(float)); // the weights in the exported dtype
    char path[PATH_MAX_LEN], file[PATH_MAX_LEN + 64], name[64];
    for (int k = 0; k < n_cases; k++) {
        snprintf(name, sizeof name, "%s%s", prefix, cases[k].name);
        in_dir(path, name);
        fl_hf_export(path, m, w, cases[k].dt, cases[k].shard_bytes);
        // the exported values are the weights rounded once to the dtype
        fl_convert(cases[k].dt, stored, FL_F32, w, n);
        if (cases[k].dt == FL_F32)
            memcpy(want, w, n * sizeof(float));
        else
            fl_convert(FL_F32, want, cases[k].dt, stored, n);
        fl_model got;
        fl_hf_load(path, &got, FL_F32);
        t_check(same_config(&got.config, &m->config), "%s: config.json gives the shape back", name);
        t_check(got.table.numel == n && same_floats(got.params, want, n),
                "%s: export -> import is exact", name);
        fl_model_free(&got);
        snprintf(file, sizeof file, "%s/model-%05d-of-%05d.safetensors", path, cases[k].shards,
                 cases[k].shards);
        if (cases[k].shards > 1)
            t_check(access(file, F_OK) == 0, "%s: %d shards written", name, cases[k].shards);
        snprintf(file, sizeof file, "%s/model-%05d-of-%05d.safetensors", path, cases[k].shards + 1,
                 cases[k].shards + 1);
        t_check(access(file, F_OK) != 0, "%s: no more than %d shards", name, cases[k].shards);
        if (cases[k].dt != FL_F32) { // loaded straight into the dtype: the same bits
            fl_hf_load(path, &got, cases[k].dt);
            t_check(memcmp(got.params, stored, n * 2) == 0, "%s: import into %s is exact", name,
                    fl_dtype_name(cases[k].dt));
            fl_model_free(&got);
        }
    }
    free(want), free(stored);
}

static void test_roundtrip(void) {
    // V = 100 pads to 128 rows; C = 32 so transposes are not square
    fl_model_config cfg = {
        .max_seq_len = 16, .vocab_size = 100, .n_layer = 2, .n_head = 4, .n_embd = 32};
    fl_model m;
    fl_model_init(&m, &cfg, FL_F32, 5);
    size_t n = m.table.numel;
    const float *w = m.params;
    const rt_case cases[] = {
        {"fp32", FL_F32, 0, 1},
        {"fp32_sharded", FL_F32, 40000, 4}, // cut before the tensor that would overflow
        {"bf16", FL_BF16, 0, 1},
        {"fp16_sharded", FL_F16, 10000, 7},
    };
    roundtrip(&m, "", cases, sizeof cases / sizeof cases[0]);
    char path[PATH_MAX_LEN], file[PATH_MAX_LEN + 64];

    // The safetensors data section starts 8-byte aligned.
    size_t size;
    unsigned char *b = t_read_file(in_dir(path, "fp32/model.safetensors"), &size);
    t_check(size > 8 && b[8] == '{' && (8 + b[0] + 256 * b[1]) % 8 == 0,
            "the data section is 8-byte aligned");
    free(b);

    // Exporting over a sharded export leaves no stale shards or index.
    in_dir(path, "fp32_sharded");
    fl_hf_export(path, &m, w, FL_F32, 0);
    snprintf(file, sizeof file, "%s/model-00001-of-00004.safetensors", path);
    int stale = access(file, F_OK) == 0;
    snprintf(file, sizeof file, "%s/model.safetensors.index.json", path);
    stale |= access(file, F_OK) == 0;
    t_check(!stale, "re-export unsharded removes the old shards and index");
    fl_model got;
    fl_hf_load(path, &got, FL_F32);
    t_check(same_floats(got.params, w, n), "re-exported directory loads exactly");
    fl_model_free(&got);
    fl_model_free(&m);
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

static void test_llama_roundtrip(void) {
    // sizes (fp32): embed_tokens and lm_head 12800 bytes, a block 30976;
    // fp16 halves them
    const rt_case untied[] = {
        {"fp32", FL_F32, 0, 1},
        {"fp32_sharded", FL_F32, 40000, 3}, // lm_head overflows the second shard
        {"bf16", FL_BF16, 0, 1},
        {"fp16_sharded", FL_F16, 10000, 5},
    };
    const rt_case tied[] = {
        {"fp32", FL_F32, 0, 1},
        {"fp32_sharded", FL_F32, 40000, 2},
        {"fp16", FL_F16, 0, 1},
        {"bf16_sharded", FL_BF16, 10000, 4},
    };
    char path[PATH_MAX_LEN];
    for (int tie = 0; tie <= 1; tie++) {
        fl_model_config cfg = llama_config(tie);
        fl_model m;
        fl_model_init(&m, &cfg, FL_F32, 7);
        const char *prefix = tie ? "llama_tied_" : "llama_";
        if (tie)
            roundtrip(&m, prefix, tied, sizeof tied / sizeof tied[0]);
        else
            roundtrip(&m, prefix, untied, sizeof untied / sizeof untied[0]);

        // Hugging Face's names and nn.Linear shapes (not transposed), the
        // live vocab rows, lm_head without the prefix and only when untied
        char what[64];
        snprintf(what, sizeof what, "%sfp32", prefix);
        snprintf(path, sizeof path, "%s/%s/model.safetensors", dir, what);
        fl_safetensors st;
        fl_safetensors_open(&st, path);
        t_check(st.count == m.table.count, "%s: %d tensors stored, one per parameter", what,
                st.count);
        t_st_stored(&st, what, "model.embed_tokens.weight", 2, 100, 32);
        t_st_stored(&st, what, "model.layers.0.input_layernorm.weight", 1, 32, 0);
        t_st_stored(&st, what, "model.layers.0.self_attn.q_proj.weight", 2, 32, 32);
        t_st_stored(&st, what, "model.layers.1.self_attn.k_proj.weight", 2, 16, 32);
        t_st_stored(&st, what, "model.layers.1.self_attn.v_proj.weight", 2, 16, 32);
        t_st_stored(&st, what, "model.layers.1.mlp.gate_proj.weight", 2, 48, 32);
        t_st_stored(&st, what, "model.layers.1.mlp.down_proj.weight", 2, 32, 48);
        t_st_stored(&st, what, "model.norm.weight", 1, 32, 0);
        t_st_stored(&st, what, "lm_head.weight", tie ? 0 : 2, 100, 32);
        t_st_stored(&st, what, "model.lm_head.weight", 0, 0, 0);
        // k_proj's bytes are the table row's as they are
        int k = fl_params_find(&m.table, "layers.1.self_attn.k_proj.weight");
        const fl_st_tensor *t = fl_safetensors_find(&st, "model.layers.1.self_attn.k_proj.weight");
        t_check(k >= 0 && t &&
                    memcmp(st.data + t->begin, (const float *)m.params + m.table.views[k].offset,
                           16 * 32 * sizeof(float)) == 0,
                "%s: k_proj is stored (out, in), as nn.Linear", what);
        fl_safetensors_free(&st);

        snprintf(path, sizeof path, "%s/%s/config.json", dir, what);
        size_t len;
        char *json = (char *)t_read_file(path, &len);
        const char *keys[] = {"\"LlamaForCausalLM\"",
                              "\"model_type\":\t\"llama\"",
                              "\"num_key_value_heads\":\t2",
                              "\"intermediate_size\":\t48",
                              "\"rms_norm_eps\":\t1e-06",
                              "\"rope_theta\":\t500000",
                              "\"hidden_act\":\t\"silu\"",
                              "\"torch_dtype\":\t\"float32\"",
                              tie ? "\"tie_word_embeddings\":\ttrue"
                                  : "\"tie_word_embeddings\":\tfalse"};
        for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++)
            t_check(json && strstr(json, keys[i]), "%s: config.json has %s", what, keys[i]);
        free(json);
        fl_model_free(&m);
    }
}

// ----------------------------------------------------------------------------
// the reference weights in each format

// Every weight of m is the fixture's param/<name>, bit for bit (records
// with the live vocab rows; the padded rows are zero).
static int weights_are(const fl_model *m, const fixture *fx) {
    int exact = 1;
    for (int i = 0; i < m->table.count; i++) {
        const fl_param_view *v = &m->table.views[i];
        char name[FX_MAX_NAME + 1];
        snprintf(name, sizeof name, "param/%s", v->name);
        const fx_record *r = fx_find(fx, name);
        if (!t_check(r && r->dtype == FX_F32 && r->numel <= v->numel, "record '%s'", name))
            return 0;
        float *x = fx_copy(fx, r);
        const float *got = (const float *)m->params + v->offset;
        exact &= same_floats(got, x, r->numel);
        for (size_t j = r->numel; j < v->numel; j++) exact &= got[j] == 0.0f; // padded rows
        free(x);
    }
    return exact;
}

// The forward of m (fp32) on the fixture's tokens gives its logits.
static void check_logits(const char *what, fl_model *m, const fixture *fx, int B, int T) {
    const fx_record *tr = fx_find(fx, "tokens"), *lr = fx_find(fx, "logits");
    size_t BT = (size_t)B * T, V = (size_t)m->config.vocab_size, Vp = m->config.padded_vocab_size;
    if (!t_check(tr && tr->numel == BT && lr && lr->numel == BT * V, "%s: tokens and logits", what))
        return;
    int *tokens = fx_copy(fx, tr);
    float *want = fx_copy(fx, lr), *logits = malloc(BT * V * sizeof(float));
    fl_model_alloc_acts(m, B, T, FL_RECOMPUTE_NONE, 0);
    fl_model_forward(m, tokens, NULL, B, T);
    for (size_t i = 0; i < BT; i++)
        memcpy(logits + i * V, (const float *)m->logits + i * Vp, V * sizeof(float));
    t_close(what, logits, want, BT * V, LOGITS_ATOL, LOGITS_RTOL);
    free(tokens), free(want), free(logits);
}

static void test_reference(fixture *fx, const fx_config *c) {
    fl_model hf, one, v3, v5;
    fl_hf_load(t_source_path(HF_FIXTURE), &hf, FL_F32);
    size_t n = hf.table.numel;
    t_check(weights_are(&hf, fx),
            "HF safetensors fixture: every weight is the reference's, bit for bit");

    fl_hf_load(t_source_path(HF_FIXTURE "/model.safetensors"), &one, FL_F32);
    t_check(one.table.numel == n && same_floats(one.params, hf.params, n),
            "a .safetensors path with config.json beside it loads the same");
    fl_llmc_load(t_source_path(LLMC_V3), &v3, FL_F32);
    t_check(v3.table.numel == n && same_floats(v3.params, hf.params, n),
            "llm.c v3 (fp32, padded vocab 80) fixture: the same weights");
    fl_llmc_load(t_source_path(LLMC_V5), &v5, FL_F32);
    float *bf = malloc(n * sizeof(float));
    uint16_t *bits = malloc(n * sizeof(uint16_t));
    fl_convert(FL_BF16, bits, FL_F32, hf.params, n);
    fl_convert(FL_F32, bf, FL_BF16, bits, n);
    t_check(v5.table.numel == n && same_floats(v5.params, bf, n),
            "llm.c v5 (bf16) fixture: the weights rounded to bf16");
    free(bf), free(bits);

    // the forward pass of the loaded models gives the reference logits
    check_logits("logits (HF safetensors)", &hf, fx, c->B, c->T);
    check_logits("logits (llm.c v3)", &v3, fx, c->B, c->T);
    fl_model_free(&hf), fl_model_free(&one), fl_model_free(&v3), fl_model_free(&v5);
}

// ----------------------------------------------------------------------------
// malformed files

#define T16(name, begin, end)                                                                      \
    "\"" name "\":{\"dtype\":\"F32\",\"shape\":[16],\"data_offsets\":[" #begin "," #end "]}"

static void test_bad_safetensors(void) {
    const struct {
        const char *name, *header;
        size_t data;
        const char *expect;
    } cases[] = {
        {"offsets past the end", "{" T16("a", 0, 64) "}", 32, "run past the data section"},
        {"offsets vs shape", "{" T16("a", 0, 32) "}", 32, "take 64"},
        {"overlapping ranges", "{" T16("a", 0, 64) "," T16("b", 32, 96) "}", 96, "overlap"},
        {"hole between tensors", "{" T16("a", 0, 64) "," T16("b", 128, 192) "}", 192,
         "64 unused bytes before tensor 'b'"},
        {"bytes after the last tensor", "{" T16("a", 0, 64) "}", 128, "64 unused bytes after"},
        {"duplicate name", "{" T16("a", 0, 64) "," T16("a", 64, 128) "}", 128, "appears twice"},
        {"bad dtype", "{\"a\":{\"dtype\":\"F64\",\"shape\":[8],\"data_offsets\":[0,64]}}", 64,
         "dtype 'F64'; only F32, F16 and BF16"},
        {"huge shape",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],"
         "\"data_offsets\":[0,4]}}",
         4, "overflows"},
        {"negative shape", "{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4,
         "non-negative integers"},
        {"bad JSON", "{\"a\":{\"dtype\":", 0, "not valid JSON"},
        {"not an object", "[1, 2]", 0, "does not start with '{'"},
        {"trailing garbage", "{" T16("a", 0, 64) "}x", 64,
         "not valid JSON: unexpected text after the top-level JSON value at byte 56"},
        {"bad metadata", "{\"__metadata__\":{\"format\":1}," T16("a", 0, 64) "}", 64,
         "__metadata__ value 'format' is not a string"},
    };
    char d[PATH_MAX_LEN], path[PATH_MAX_LEN + 32];
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char name[32];
        snprintf(name, sizeof name, "bad_st_%zu", k);
        model_dir(d, name, NULL);
        snprintf(path, sizeof path, "%s/model.safetensors", d);
        t_write_st(path, cases[k].header, cases[k].data);
        t_dies(cases[k].name, load_hf, d, cases[k].expect);
    }

    // the length prefix of the reference file set past its end / too large
    size_t n;
    unsigned char *good = t_read_file(t_source_path(HF_FIXTURE "/model.safetensors"), &n);
    const struct {
        const char *name;
        uint64_t len;
        const char *expect;
    } lens[] = {{"header length past the end", n - 7, "runs past the end of the file"},
                {"header length huge", 1ull << 62, "exceeds the limit"},
                {"header length small", 5, "not valid JSON"}};
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
        char name[32];
        snprintf(name, sizeof name, "bad_len_%zu", k);
        model_dir(d, name, NULL);
        snprintf(path, sizeof path, "%s/model.safetensors", d);
        for (int i = 0; i < 8; i++) good[i] = (unsigned char)(lens[k].len >> (8 * i));
        t_write_file(path, good, n);
        t_dies(lens[k].name, load_hf, d, lens[k].expect);
    }
    snprintf(path, sizeof path, "%s/short.safetensors", model_dir(d, "bad_short", NULL));
    t_write_file(path, "\x10\0\0", 3);
    t_dies("file shorter than 8 bytes", load_hf, path, "too short for the header length");
    free(good);
    t_dies("missing file", load_hf, "/nonexistent/model", "cannot open /nonexistent/model");
}

typedef struct {
    const char *name;
    t_st_edit edit;
    const char *expect; // NULL: loads
} model_case;

// Each case: dir/<prefix>_<k> holding `config` (NULL: the GPT-2 fixture's)
// and the edited copy of src; it dies with `expect` or loads (and then,
// when `same` is given, to the weights of the model `same`).
static void run_model_cases(const char *prefix, const char *config, const char *src,
                            const model_case *cases, int n_cases, const fl_model *same) {
    char d[PATH_MAX_LEN], path[PATH_MAX_LEN + 32];
    for (int k = 0; k < n_cases; k++) {
        char name[64];
        snprintf(name, sizeof name, "%s_%d", prefix, k);
        model_dir(d, name, config);
        snprintf(path, sizeof path, "%s/model.safetensors", d);
        t_st_rewrite(t_source_path(src), path, &cases[k].edit);
        if (cases[k].expect) {
            t_dies(cases[k].name, load_hf, d, cases[k].expect);
            continue;
        }
        fl_model m;
        fl_hf_load(d, &m, FL_F32);
        t_check(m.table.numel > 0 &&
                    (!same || (m.table.numel == same->table.numel &&
                               same_floats(m.params, same->params, m.table.numel))),
                "%s: loads%s", cases[k].name, same ? " the same weights" : "");
        fl_model_free(&m);
    }
}

static void test_bad_models(void) {
    const model_case cases[] = {
        {"missing tensor",
         {.drop = "transformer.ln_f.bias"},
         "tensor 'transformer.ln_f.bias' is missing"},
        {"unknown tensor",
         {.from = "transformer.h.1.attn.bias", .to = "transformer.h.1.attn.rotary"},
         "unknown tensor 'transformer.h.1.attn.rotary'"},
        {"tensor stored twice",
         {.from = "transformer.h.0.attn.bias", .to = "wte.weight"},
         "stored twice"},
        {"wrong shape",
         {.transpose = "transformer.wte.weight"},
         "'transformer.wte.weight' has shape [16, 64], config.json implies [64, 16]"},
        {"untied lm_head",
         {.copy = "transformer.wte.weight", .copy_as = "lm_head.weight", .flip = 1},
         "untied LM heads are not supported"},
        {"tied lm_head stored",
         {.copy = "transformer.wte.weight", .copy_as = "lm_head.weight"},
         NULL},
        {"names without prefix", {.from = "transformer.wte.weight", .to = "wte.weight"}, NULL},
    };
    run_model_cases("bad_model", NULL, HF_FIXTURE "/model.safetensors", cases,
                    sizeof cases / sizeof cases[0], NULL);
}

static void test_bad_configs(void) {
    // the reference config with one field replaced
    static const char base[] = "{\"activation_function\": %s, \"layer_norm_epsilon\": %s, "
                               "\"model_type\": %s, \"n_embd\": %s, \"n_head\": 4, \"n_layer\": "
                               "2, \"n_positions\": 16, \"tie_word_embeddings\": %s, "
                               "\"vocab_size\": %s%s}";
    const struct {
        const char *name, *act, *eps, *type, *embd, *tie, *vocab, *extra, *expect;
    } cases[] = {
        {"unsupported activation", "\"relu\"", "1e-5", "\"gpt2\"", "16", "true", "64", "",
         "activation_function relu is not supported"},
        {"other layer_norm_epsilon", "\"gelu_new\"", "1e-6", "\"gpt2\"", "16", "true", "64", "",
         "layer_norm_epsilon must be 1e-5"},
        {"other model_type", "\"gelu_new\"", "1e-5", "\"mistral\"", "16", "true", "64", "",
         "model_type is mistral, not \"gpt2\" or \"llama\""},
        {"untied embeddings", "\"gelu_new\"", "1e-5", "\"gpt2\"", "16", "false", "64", "",
         "tie_word_embeddings false is not supported"},
        {"n_embd not divisible", "\"gelu_new\"", "1e-5", "\"gpt2\"", "18", "true", "64", "",
         "n_embd (18) is not divisible by n_head (4)"},
        {"vocab_size not an integer", "\"gelu_new\"", "1e-5", "\"gpt2\"", "16", "true", "64.5", "",
         "vocab_size must be an integer"},
        {"n_inner not 4C", "\"gelu_new\"", "1e-5", "\"gpt2\"", "16", "true", "64",
         ", \"n_inner\": 32", "n_inner must be null or 4 * n_embd"},
        {"layer-scaled attention", "\"gelu_new\"", "1e-5", "\"gpt2\"", "16", "true", "64",
         ", \"scale_attn_by_inverse_layer_idx\": true", "scale_attn_by_inverse_layer_idx true"},
        {"config/tensor mismatch", "\"gelu_new\"", "1e-5", "\"gpt2\"", "16", "true", "65", "",
         "config.json implies [65, 16]"},
    };
    char d[PATH_MAX_LEN], path[PATH_MAX_LEN + 32], json[1024];
    size_t n;
    unsigned char *st = t_read_file(t_source_path(HF_FIXTURE "/model.safetensors"), &n);
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char name[32];
        snprintf(name, sizeof name, "bad_config_%zu", k);
        snprintf(json, sizeof json, base, cases[k].act, cases[k].eps, cases[k].type, cases[k].embd,
                 cases[k].tie, cases[k].vocab, cases[k].extra);
        model_dir(d, name, json);
        snprintf(path, sizeof path, "%s/model.safetensors", d);
        t_write_file(path, st, n);
        t_dies(cases[k].name, load_hf, d, cases[k].expect);
    }
    // gelu_pytorch_tanh is the same function: accepted
    snprintf(json, sizeof json, base, "\"gelu_pytorch_tanh\"", "1e-05", "\"gpt2\"", "16", "true",
             "64", "");
    model_dir(d, "config_tanh", json);
    snprintf(path, sizeof path, "%s/model.safetensors", d);
    t_write_file(path, st, n);
    fl_model m;
    fl_hf_load(d, &m, FL_F32);
    t_check(m.config.n_embd == 16, "gelu_pytorch_tanh is accepted");
    fl_model_free(&m);
    model_dir(d, "config_bad_json", "{\"n_embd\": 16,");
    snprintf(path, sizeof path, "%s/model.safetensors", d);
    t_write_file(path, st, n);
    t_dies("config.json not JSON", load_hf, d, "config.json: not valid JSON");
    free(st);
    model_dir(d, "no_weights", NULL);
    t_dies("no weights", load_hf, d, "holds neither model.safetensors");
}

// ----------------------------------------------------------------------------
// LLaMA: the reference written by scripts/make_llama_reference.py (records
// "config" int32 [maxT, V, L, NH, NKV, C, I, B, T, steps, tie], "config_f"
// float32 [rms_norm_eps, rope_theta], "tokens", "param/<name>", "logits")
// and its HF directory; malformed configs and files.

typedef struct {
    fixture fx;
    unsigned char *data;
    fl_model_config cfg;
    int B, T;
} llama_ref;

static int llama_ref_load(const char *rel, llama_ref *r) {
    memset(r, 0, sizeof *r);
    size_t n;
    r->data = t_read_file(t_source_path(rel), &n);
    if (!t_check(r->data && n > 0 && fx_parse(&r->fx, r->data, n),
                 "%s (regenerate it with /usr/bin/python3 scripts/make_llama_reference.py): %s",
                 rel, r->fx.err))
        return 0;
    uint64_t s11 = 11, s2 = 2;
    const fx_record *ci = fx_expect(&r->fx, "config", FX_I32, 1, &s11);
    const fx_record *cf = fx_expect(&r->fx, "config_f", FX_F32, 1, &s2);
    if (!t_check(ci && cf, "%s: %s", rel, r->fx.err)) return 0;
    int32_t *i = fx_copy(&r->fx, ci);
    float *f = fx_copy(&r->fx, cf);
    r->cfg = (fl_model_config){.arch = FL_ARCH_LLAMA,
                               .max_seq_len = i[0],
                               .vocab_size = i[1],
                               .n_layer = i[2],
                               .n_head = i[3],
                               .n_kv_head = i[4],
                               .n_embd = i[5],
                               .intermediate_size = i[6],
                               .norm_eps = f[0],
                               .rope_theta = f[1],
                               .tie_embeddings = i[10]};
    r->B = i[7], r->T = i[8];
    free(i), free(f);
    const fl_model_config *c = &r->cfg;
    return t_check(c->max_seq_len > 0 && c->max_seq_len <= 4096 && c->vocab_size > 0 &&
                       c->vocab_size <= 65536 && c->n_layer > 0 && c->n_layer <= 16 &&
                       c->n_head > 0 && c->n_kv_head > 0 && c->n_head % c->n_kv_head == 0 &&
                       c->n_embd > 0 && c->n_embd <= 4096 && c->n_embd % c->n_head == 0 &&
                       (c->n_embd / c->n_head) % 2 == 0 && c->intermediate_size > 0 &&
                       c->intermediate_size <= 16384 && c->norm_eps > 0 && c->norm_eps < 1 &&
                       c->rope_theta > 1 && r->B > 0 && r->B <= 64 && r->T > 0 &&
                       r->T <= c->max_seq_len,
                   "%s: plausible config", rel);
}

static void llama_ref_free(llama_ref *r) {
    free(r->data), free(r->fx.recs);
}

// The HF fixture loads to the reference's weights and logits; a tied model
// built from llama_tiny_tied.bin's weights exports, re-imports bit for bit
// and gives that reference's logits.
static void test_llama_reference(void) {
    llama_ref ref, tied;
    if (llama_ref_load(LLAMA_REF, &ref)) {
        fl_model hf, one;
        fl_hf_load(t_source_path(LLAMA_HF), &hf, FL_F32);
        fl_model_config want = ref.cfg;
        fl_model_config_finish(&want);
        t_check(same_config(&hf.config, &want),
                "LLaMA HF fixture: config.json gives the reference's shape");
        t_check(weights_are(&hf, &ref.fx),
                "LLaMA HF fixture: every weight is the reference's, bit for bit");
        fl_hf_load(t_source_path(LLAMA_HF "/model.safetensors"), &one, FL_F32);
        t_check(one.table.numel == hf.table.numel &&
                    same_floats(one.params, hf.params, hf.table.numel),
                "LLaMA: a .safetensors path with config.json beside it loads the same");
        check_logits("LLaMA logits (HF safetensors)", &hf, &ref.fx, ref.B, ref.T);
        fl_model_free(&hf), fl_model_free(&one);
    }
    if (llama_ref_load(LLAMA_TIED, &tied) && t_check(tied.cfg.tie_embeddings, "tied fixture")) {
        fl_model m, got;
        fl_model_init(&m, &tied.cfg, FL_F32, 1);
        for (int i = 0; i < m.table.count; i++) { // the reference's weights
            const fl_param_view *v = &m.table.views[i];
            char name[FX_MAX_NAME + 1];
            snprintf(name, sizeof name, "param/%s", v->name);
            const fx_record *r = fx_find(&tied.fx, name);
            if (!t_check(r && r->numel <= v->numel, "tied fixture: record '%s'", name)) break;
            float *x = fx_copy(&tied.fx, r);
            memcpy((float *)m.params + v->offset, x, r->numel * sizeof(float));
            free(x);
        }
        char path[PATH_MAX_LEN];
        fl_hf_export(in_dir(path, "llama_tied_ref"), &m, m.params, FL_F32, 0);
        fl_hf_load(path, &got, FL_F32);
        t_check(same_config(&got.config, &m.config) && weights_are(&got, &tied.fx),
                "tied LLaMA reference: export -> import gives its weights, bit for bit");
        check_logits("tied LLaMA logits (exported, re-imported)", &got, &tied.fx, tied.B, tied.T);
        fl_model_free(&m), fl_model_free(&got);
    }
    llama_ref_free(&ref), llama_ref_free(&tied);
}

// The LLaMA fixture's config.json with the first `find` replaced by `repl`
// (malloc'd).
static char *llama_config_with(const char *find, const char *repl) {
    size_t n;
    char *text = (char *)t_read_file(t_source_path(LLAMA_HF "/config.json"), &n);
    char *at = text ? strstr(text, find) : NULL;
    t_check(at != NULL, "'%s' is in the LLaMA fixture's config.json", find);
    char *out = malloc(n + strlen(repl) + 1);
    if (at)
        sprintf(out, "%.*s%s%s", (int)(at - text), text, repl, at + strlen(find));
    else
        strcpy(out, text ? text : "");
    free(text);
    return out;
}

static void test_llama_configs(void) {
    const struct {
        const char *name, *find, *repl, *expect;
    } bad[] = {
        {"rope_scaling set", "\"rope_scaling\": null",
         "\"rope_scaling\": {\"type\": \"linear\", \"factor\": 2.0}",
         "rope_scaling is not supported"},
        {"llama3 rope_scaling", "\"rope_scaling\": null",
         "\"rope_scaling\": {\"rope_type\": \"llama3\"}", "rope_scaling is not supported"},
        {"attention_bias", "\"attention_bias\": false", "\"attention_bias\": true",
         "attention_bias true is not supported"},
        {"mlp_bias", "\"mlp_bias\": false", "\"mlp_bias\": true", "mlp_bias true is not supported"},
        {"kv heads not dividing", "\"num_key_value_heads\": 2", "\"num_key_value_heads\": 3",
         "num_key_value_heads (3) does not divide num_attention_heads (4)"},
        {"kv heads zero", "\"num_key_value_heads\": 2", "\"num_key_value_heads\": 0",
         "num_key_value_heads must be an integer in [1, 65536]"},
        {"gelu", "\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"",
         "hidden_act gelu is not supported"},
        {"head_dim", "\"head_dim\": 4", "\"head_dim\": 8",
         "head_dim must be null or hidden_size / num_attention_heads (4)"},
        {"pretraining_tp", "\"pretraining_tp\": 1", "\"pretraining_tp\": 2",
         "pretraining_tp 2 is not supported"},
        {"rms_norm_eps 0", "\"rms_norm_eps\": 1e-05", "\"rms_norm_eps\": 0",
         "rms_norm_eps must be a number in (0, 1)"},
        {"rope_theta 1", "\"rope_theta\": 10000.0", "\"rope_theta\": 1",
         "rope_theta must be a number in (1, "},
        {"odd head size", "\"hidden_size\": 16", "\"hidden_size\": 12",
         "hidden_size / num_attention_heads (3) is odd"},
        {"hidden_size not divisible", "\"hidden_size\": 16", "\"hidden_size\": 18",
         "hidden_size (18) is not divisible by num_attention_heads (4)"},
        {"attention_dropout", "\"attention_dropout\": 0.0", "\"attention_dropout\": 0.1",
         "attention_dropout must be 0"},
        {"tie not a bool", "\"tie_word_embeddings\": false", "\"tie_word_embeddings\": 1",
         "tie_word_embeddings must be true or false"},
        {"architectures disagree", "\"LlamaForCausalLM\"", "\"GPT2LMHeadModel\"",
         "architectures names a GPT-2 model, model_type is llama"},
    };
    char err[512];
    fl_model_config c;
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        char *json = llama_config_with(bad[k].find, bad[k].repl);
        err[0] = 0;
        int rc = fl_hf_config_parse(json, strlen(json), &c, err, sizeof err);
        t_check(rc == -1 && strstr(err, bad[k].expect), "LLaMA config, %s: refused with '%s' (%s)",
                bad[k].name, bad[k].expect, err);
        free(json);
    }

    const struct {
        const char *name, *find, *repl;
        int n_kv_head;
    } good[] = {
        {"the fixture", "{", "{", 2},
        {"no model_type (architectures)", "\"model_type\": \"llama\",", "", 2},
        {"no num_key_value_heads", "\"num_key_value_heads\": 2,", "", 4},
        {"num_key_value_heads null", "\"num_key_value_heads\": 2", "\"num_key_value_heads\": null",
         4},
        {"rope_scaling default", "\"rope_scaling\": null",
         "\"rope_scaling\": {\"rope_type\": \"default\"}", 2},
        {"no head_dim", "\"head_dim\": 4,", "", 2},
    };
    for (size_t k = 0; k < sizeof good / sizeof good[0]; k++) {
        char *json = llama_config_with(good[k].find, good[k].repl);
        err[0] = 0;
        int rc = fl_hf_config_parse(json, strlen(json), &c, err, sizeof err);
        t_check(rc == 0 && c.arch == FL_ARCH_LLAMA && c.n_kv_head == good[k].n_kv_head &&
                    c.n_head == 4 && c.n_embd == 16 && c.n_layer == 2 &&
                    c.intermediate_size == 24 && c.vocab_size == 64 && c.padded_vocab_size == 128 &&
                    c.max_seq_len == 16 && c.norm_eps == 1e-5f && c.rope_theta == 10000.0f &&
                    c.tie_embeddings == 0,
                "LLaMA config, %s: accepted with its values (%s)", good[k].name, err);
        free(json);
    }
    // LlamaConfig's defaults for what is absent
    const char *bare = "{\"model_type\": \"llama\"}";
    t_check(fl_hf_config_parse(bare, strlen(bare), &c, err, sizeof err) == 0 &&
                c.arch == FL_ARCH_LLAMA && c.n_embd == 4096 && c.intermediate_size == 11008 &&
                c.n_layer == 32 && c.n_head == 32 && c.n_kv_head == 32 && c.vocab_size == 32000 &&
                c.max_seq_len == 2048 && c.norm_eps == 1e-6f && c.rope_theta == 10000.0f &&
                !c.tie_embeddings,
            "LLaMA config: LlamaConfig's defaults");

    // through the loader: the file and the key named
    char d[PATH_MAX_LEN], path[PATH_MAX_LEN + 32];
    char *json = llama_config_with("\"rope_scaling\": null",
                                   "\"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 4}");
    model_dir(d, "llama_rope_scaling", json);
    free(json);
    snprintf(path, sizeof path, "%s/model.safetensors", d);
    t_st_rewrite(t_source_path(LLAMA_HF "/model.safetensors"), path, &(t_st_edit){0});
    t_dies("LLaMA rope_scaling through the loader", load_hf, d,
           "config.json: rope_scaling is not supported");
}

static void test_llama_bad_models(void) {
    fl_model ref;
    fl_hf_load(t_source_path(LLAMA_HF), &ref, FL_F32);
    char *untied = llama_config_with("{", "{");
    const model_case cases[] = {
        {"q_proj bias",
         {.copy = "model.layers.0.input_layernorm.weight",
          .copy_as = "model.layers.0.self_attn.q_proj.bias"},
         "tensor 'model.layers.0.self_attn.q_proj.bias' is a bias"},
        {"down_proj bias",
         {.copy = "model.norm.weight", .copy_as = "model.layers.1.mlp.down_proj.bias"},
         "tensor 'model.layers.1.mlp.down_proj.bias' is a bias"},
        {"missing lm_head", {.drop = "lm_head.weight"}, "tensor 'lm_head.weight' is missing"},
        {"missing up_proj",
         {.drop = "model.layers.1.mlp.up_proj.weight"},
         "tensor 'model.layers.1.mlp.up_proj.weight' is missing"},
        {"k_proj transposed",
         {.transpose = "model.layers.0.self_attn.k_proj.weight"},
         "'model.layers.0.self_attn.k_proj.weight' has shape [16, 8], config.json implies [8, 16]"},
        {"unknown tensor",
         {.from = "model.norm.weight", .to = "model.final_norm.weight"},
         "unknown tensor 'model.final_norm.weight'"},
        {"stored twice", {.copy = "model.norm.weight", .copy_as = "norm.weight"}, "stored twice"},
        {"rotary buffer skipped",
         {.copy = "model.norm.weight", .copy_as = "model.layers.1.self_attn.rotary_emb.inv_freq"},
         NULL},
        {"names without prefix",
         {.from = "model.embed_tokens.weight", .to = "embed_tokens.weight"},
         NULL},
        {"lm_head with prefix", {.from = "lm_head.weight", .to = "model.lm_head.weight"}, NULL},
    };
    run_model_cases("llama_model", untied, LLAMA_HF "/model.safetensors", cases,
                    sizeof cases / sizeof cases[0], &ref);
    free(untied);

    // tie_word_embeddings true: a stored lm_head must be embed_tokens
    char *tied =
        llama_config_with("\"tie_word_embeddings\": false", "\"tie_word_embeddings\": true");
    const model_case tied_cases[] = {
        {"tied, lm_head differs", {0}, "lm_head.weight differs from embed_tokens.weight"},
        {"tied, no lm_head", {.drop = "lm_head.weight"}, NULL},
        {"tied, lm_head = embed_tokens",
         {.drop = "lm_head.weight",
          .copy = "model.embed_tokens.weight",
          .copy_as = "lm_head.weight"},
         NULL},
        {"tied, lm_head one bit off",
         {.drop = "lm_head.weight",
          .copy = "model.embed_tokens.weight",
          .copy_as = "lm_head.weight",
          .flip = 1},
         "lm_head.weight differs from embed_tokens.weight"},
    };
    run_model_cases("llama_tied_model", tied, LLAMA_HF "/model.safetensors", tied_cases,
                    sizeof tied_cases / sizeof tied_cases[0], NULL);
    free(tied);
    // the tied model's weights: the fixture's without lm_head
    char d[PATH_MAX_LEN];
    fl_model m;
    fl_hf_load(in_dir(d, "llama_tied_model_2"), &m, FL_F32);
    t_check(m.config.tie_embeddings && m.table.numel < ref.table.numel &&
                same_floats(m.params, ref.params, m.table.numel - (size_t)m.config.n_embd) &&
                fl_params_find(&m.table, "lm_head.weight") < 0,
            "tied LLaMA: embed_tokens and the blocks are the fixture's, no lm_head row");
    fl_model_free(&m);
    fl_model_free(&ref);
}

// A copy of the exported sharded index with `find` replaced by `repl` on
// the first line that contains `line` (NULL: the first occurrence anywhere;
// repl NULL: the line removed).
static void edit_index(const char *name, const char *line, const char *find, const char *repl) {
    char src[PATH_MAX_LEN], d[PATH_MAX_LEN], path[PATH_MAX_LEN + 64];
    in_dir(src, "fp16_sharded");
    model_dir(d, name, NULL);
    snprintf(path, sizeof path, "%s/config.json", src);
    size_t n;
    unsigned char *b = t_read_file(path, &n);
    snprintf(path, sizeof path, "%s/config.json", d);
    t_write_file(path, b, n);
    free(b);
    for (int i = 1; i <= 7; i++) {
        char file[64];
        snprintf(file, sizeof file, "model-%05d-of-00007.safetensors", i);
        snprintf(path, sizeof path, "%s/%s", src, file);
        b = t_read_file(path, &n);
        snprintf(path, sizeof path, "%s/%s", d, file);
        t_write_file(path, b, n);
        free(b);
    }
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", src);
    char *text = (char *)t_read_file(path, &n), *out = malloc(n + 64);
    char *at = line ? strstr(text, line) : text;
    at = at ? strstr(at, find) : NULL;
    if (!at) {
        t_check(0, "index edit %s: '%s' not found", name, find);
        strcpy(out, text);
    } else if (!repl) { // remove the whole line
        char *start = at, *end = strchr(at, '\n');
        while (start > text && start[-1] != '\n') start--;
        snprintf(out, n + 64, "%.*s%s", (int)(start - text), text, end ? end + 1 : "");
    } else {
        snprintf(out, n + 64, "%.*s%s%s", (int)(at - text), text, repl, at + strlen(find));
    }
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", d);
    t_write_text(path, out);
    free(text), free(out);
}

static void test_bad_index(void) {
    char d[PATH_MAX_LEN];
    edit_index("index_escape", NULL, "\"model-00001", "\"../model-00001");
    t_dies("index names a path outside", load_hf, in_dir(d, "index_escape"),
           "is not a plain .safetensors file name");
    edit_index("index_wrong_shard", "\"transformer.wte.weight\"", "model-00001", "model-00002");
    t_dies("index names the wrong shard", load_hf, in_dir(d, "index_wrong_shard"),
           "tensor 'transformer.wte.weight' is not in model-00002-of-00007.safetensors");
    edit_index("index_unlisted", "\"transformer.ln_f.bias\"", "model-", NULL);
    t_dies("index omits a stored tensor", load_hf, in_dir(d, "index_unlisted"),
           "the shards hold 28 tensors, the weight_map lists 27");
    edit_index("index_missing_shard", NULL, "\"model-00001", "\"model-00009");
    t_dies("index names a missing shard", load_hf, in_dir(d, "index_missing_shard"), "cannot open");
    edit_index("index_bad_json", NULL, "{", "[");
    t_dies("index not JSON", load_hf, in_dir(d, "index_bad_json"), "not valid JSON");
    edit_index("index_ok", NULL, "{", "{");
    fl_model m;
    fl_hf_load(in_dir(d, "index_ok"), &m, FL_F32);
    t_check(m.config.vocab_size == 100, "the copied sharded export loads");
    fl_model_free(&m);
}

static void test_bad_llmc(void) {
    size_t n;
    unsigned char *good = t_read_file(t_source_path(LLMC_V3), &n);
    const struct {
        const char *name;
        int field;
        int32_t value;
        size_t cut;
        const char *expect;
    } cases[] = {
        {"bad magic", 0, 20240327, 0, "bad magic 20240327"},
        {"bad version", 1, 4, 0, "version 4 is not supported"},
        {"truncated", 1, 3, 4, "has 33532 bytes, its header"},
        {"padded vocab < vocab", 7, 32, 0, "padded_vocab_size 32 is smaller than vocab_size 64"},
        {"heads do not divide", 5, 3, 0, "channels 16 not divisible by num_heads 3"},
        {"negative layers", 4, -1, 0, "num_layers -1 is outside"},
        {"bf16 version, fp32 data", 1, 5, 0, "implies 17280"},
    };
    char path[PATH_MAX_LEN];
    unsigned char *bad = malloc(n);
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        memcpy(bad, good, n);
        for (int b = 0; b < 4; b++)
            bad[4 * cases[k].field + b] = (unsigned char)((uint32_t)cases[k].value >> (8 * b));
        char name[32];
        snprintf(name, sizeof name, "bad_llmc_%zu.bin", k);
        t_write_file(in_dir(path, name), bad, n - cases[k].cut);
        t_dies(cases[k].name, load_llmc, path, cases[k].expect);
    }
    t_write_file(in_dir(path, "short_llmc.bin"), good, 100);
    t_dies("llm.c file shorter than the header", load_llmc, path, "too short for the 1024-byte");
    free(bad), free(good);
}

// ----------------------------------------------------------------------------
// seeded mutations of valid files: every parser returns ok or an error

static int parse_st(const unsigned char *b, size_t n, char *err, size_t errlen) {
    fl_safetensors st;
    int rc = fl_safetensors_parse(b, n, &st, err, errlen);
    if (rc == 0) // what the parser promises the loaders
        for (int i = 0; i < st.count; i++)
            if (st.tensors[i].end > st.data_size || st.data + st.data_size != b + n) rc = -2;
    fl_safetensors_free(&st);
    return rc;
}

static int parse_config(const unsigned char *b, size_t n, char *err, size_t errlen) {
    fl_model_config c;
    int rc = fl_hf_config_parse((const char *)b, n, &c, err, errlen);
    // what the parser promises fl_model_config_finish
    if (rc == 0 && (c.n_embd % c.n_head || c.padded_vocab_size < c.vocab_size)) rc = -2;
    if (rc == 0 && c.arch == FL_ARCH_LLAMA &&
        (c.n_kv_head < 1 || c.n_head % c.n_kv_head || (c.n_embd / c.n_head) % 2 ||
         c.intermediate_size < 1 || !(c.norm_eps > 0 && c.norm_eps < 1) || !(c.rope_theta > 1)))
        rc = -2;
    return rc;
}

static int parse_index(const unsigned char *b, size_t n, char *err, size_t errlen) {
    fl_hf_index idx;
    int rc = fl_hf_index_parse((const char *)b, n, &idx, err, errlen);
    for (int i = 0; rc == 0 && i < idx.n_entries; i++)
        if (idx.entries[i].file < 0 || idx.entries[i].file >= idx.n_files) rc = -2;
    fl_hf_index_free(&idx);
    return rc;
}

static int parse_llmc(const unsigned char *b, size_t n, char *err, size_t errlen) {
    fl_llmc_header h;
    return fl_llmc_header_parse(b, n, n, &h, err, errlen);
}

// A NUL in a name (a tensor, a file, a model type) would cut it short and
// make it another name: each parser refuses it, naming where.
static void test_nul_in_names(void) {
    char err[512] = "";
    const char *config = "{\"model_type\": \"llama\\u0000x\", \"architectures\": [\"x\"]}";
    fl_model_config c;
    t_check(fl_hf_config_parse(config, strlen(config), &c, err, sizeof err) == -1 &&
                strstr(err, "(a NUL character) at line 1 (byte 21), in the value of "
                            "\"model_type\""),
            "config.json: %s", err);
    const char *index = "{\"weight_map\": {\"a.weight\\u0000b\": \"model.safetensors\"}}";
    fl_hf_index idx;
    t_check(fl_hf_index_parse(index, strlen(index), &idx, err, sizeof err) == -1 &&
                strstr(err, "(a NUL character) at line 1 (byte 25) is not allowed"),
            "the index: %s", err);
    const char *header = "{\"w\\u0000\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": "
                         "[0, 4]}}";
    unsigned char st_file[256] = {0};
    size_t hlen = strlen(header);
    st_file[0] = (unsigned char)hlen;
    memcpy(st_file + 8, header, hlen);
    fl_safetensors st;
    t_check(fl_safetensors_parse(st_file, 8 + hlen + 4, &st, err, sizeof err) == -1 &&
                strstr(err, "\\u0000 (a NUL character) at line 1 (byte 3)"),
            "a safetensors header: %s", err);
    const char *raw = "{\"model_type\": \"gpt2\0\"}";
    t_check(fl_hf_config_parse(raw, 23, &c, err, sizeof err) == -1 &&
                strstr(err, "a NUL byte at line 1 (byte 20)"),
            "a raw NUL byte: %s", err);
}

static void test_mutations(void) {
    char index[PATH_MAX_LEN];
    in_dir(index, "fp16_sharded/model.safetensors.index.json");
    t_mutations("safetensors", t_source_path(HF_FIXTURE "/model.safetensors"), 3000, 1000000,
                parse_st);
    t_mutations("config.json", t_source_path(HF_FIXTURE "/config.json"), 2000, 2000000,
                parse_config);
    t_mutations("LLaMA config.json", t_source_path(LLAMA_HF "/config.json"), 2000, 5000000,
                parse_config);
    t_mutations("index.json", index, 2000, 3000000, parse_index);
    t_mutations("llm.c header", t_source_path(LLMC_V3), 2000, 4000000, parse_llmc);
}

// ----------------------------------------------------------------------------
// weight sources: each row filled once from the file, NF4 from real values

// The elements the file at path stores (its every tensor).
static size_t stored_elements(const char *path) {
    fl_safetensors st;
    fl_safetensors_open(&st, path);
    size_t n = 0;
    for (int i = 0; i < st.count; i++) n += st.tensors[i].numel;
    fl_safetensors_free(&st);
    return n;
}

// NF4 error statistics of LLaMA's linear layers ("_proj." rows, stored as
// the table holds them) read straight from the safetensors: blocks of
// `block` per row, each value against the codebook entry nearest to it over
// its block's absmax.
static void nf4_error_of_file(const char *path, int block, size_t *count, double *mean,
                              double *most, double *rms) {
    fl_safetensors st;
    fl_safetensors_open(&st, path);
    double sum = 0, sq = 0;
    *count = 0, *most = 0;
    for (int i = 0; i < st.count; i++) {
        const fl_st_tensor *t = &st.tensors[i];
        if (!strstr(t->name, "_proj.")) continue;
        float *w = malloc(t->numel * sizeof(float));
        void *raw = malloc(t->numel * fl_dtype_size(t->dtype));
        memcpy(raw, st.data + t->begin, t->numel * fl_dtype_size(t->dtype));
        fl_convert(FL_F32, w, t->dtype, raw, t->numel);
        for (size_t b = 0; b < t->numel; b += (size_t)block) {
            size_t end = b + (size_t)block < t->numel ? b + (size_t)block : t->numel;
            float absmax = 0;
            for (size_t j = b; j < end; j++) absmax = fmaxf(absmax, fabsf(w[j]));
            for (size_t j = b; j < end; j++) {
                int q = 0;
                double s = absmax > 0 ? (double)w[j] / absmax : 0;
                for (int c = 1; c < 16; c++)
                    if (fabs(s - nf4_codebook[c]) < fabs(s - nf4_codebook[q])) q = c;
                double e = fabs((double)(nf4_codebook[q] * absmax) - w[j]);
                sum += e;
                sq += (double)w[j] * w[j];
                *most = fmax(*most, e);
            }
        }
        *count += t->numel;
        free(w), free(raw);
    }
    fl_safetensors_free(&st);
    *mean = sum / (double)*count;
    *rms = sqrt(sq / (double)*count);
}

static void test_weight_sources(void) {
    // config.json is read once, when the source opens: a config.json broken
    // afterwards does not reach the model, whose weights are the file's
    char d[PATH_MAX_LEN], path[PATH_MAX_LEN + 32];
    model_dir(d, "source_once", NULL);
    snprintf(path, sizeof path, "%s/config.json", d);
    size_t n;
    unsigned char *bytes = t_read_file(t_source_path(LLAMA_HF "/config.json"), &n);
    t_write_file(path, bytes, n);
    free(bytes);
    snprintf(path, sizeof path, "%s/model.safetensors", d);
    bytes = t_read_file(t_source_path(LLAMA_HF "/model.safetensors"), &n);
    t_write_file(path, bytes, n);
    free(bytes);
    fl_weight_source src;
    fl_weight_source_open(&src, d);
    snprintf(path, sizeof path, "%s/config.json", d);
    t_write_text(path, "not JSON");
    fl_model m, ref;
    fl_model_init_from(&m, &src, FL_F32, NULL, 0, SIZE_MAX);
    fl_weight_source_close(&src);
    fl_hf_load(t_source_path(LLAMA_HF), &ref, FL_F32);
    size_t in_file = stored_elements(t_source_path(LLAMA_HF "/model.safetensors"));
    t_check(m.table.numel == ref.table.numel && same_floats(m.params, ref.params, m.table.numel),
            "a source keeps the config.json it read: the model is the file's");
    // a loaded model is stored once, from the file: no random values first
    t_check(m.stored == in_file && ref.stored == in_file,
            "HF: %zu and %zu elements stored, the %zu the file holds", m.stored, ref.stored,
            in_file);
    fl_model_free(&m), fl_model_free(&ref);

    fl_model_config tiny = {
        .max_seq_len = 16, .vocab_size = 64, .n_layer = 2, .n_head = 4, .n_embd = 16};
    fl_model_init(&m, &tiny, FL_F32, 1);
    t_check(m.stored == m.table.numel, "random: every element drawn once (%zu of %zu)", m.stored,
            m.table.numel);
    fl_model_free(&m);
    fl_llmc_load(t_source_path(LLMC_V3), &m, FL_F32);
    size_t pad = (size_t)(m.config.padded_vocab_size - m.config.vocab_size) * m.config.n_embd;
    t_check(m.stored == m.table.numel - pad,
            "llm.c: %zu elements stored, the %zu the file holds (vocabulary padding aside)",
            m.stored, m.table.numel - pad);
    fl_model_free(&m);

    // NF4 quantises each linear row once, from its real values: the report
    // covers exactly the loaded elements and matches a computation from the
    // file itself
    fl_quant_config qc = {.enabled = 1, .blocksize = 64, .double_quant = 0};
    fl_pretrained_load(t_source_path(LLAMA_HF), &m, FL_F32, &qc);
    double mean, most, rms, want_mean, want_most, want_rms;
    size_t want_n, quantised;
    fl_model_quant_error(&m, &mean, &most, &rms);
    fl_quant_bytes_per_param(&m.table, &qc, &quantised);
    nf4_error_of_file(t_source_path(LLAMA_HF "/model.safetensors"), 64, &want_n, &want_mean,
                      &want_most, &want_rms);
    t_check(m.quant.err_n == want_n && quantised == want_n && want_n == 3840,
            "NF4 report: %zu elements quantised, the file's %zu linear ones (3840)", m.quant.err_n,
            want_n);
    t_check(fabs(mean - want_mean) <= 1e-6 * want_mean && fabs(most - want_most) <= 1e-7 &&
                fabs(rms - want_rms) <= 1e-9 * want_rms,
            "NF4 report: mean %.6g, max %.6g, RMS %.6g; from the file: %.6g, %.6g, %.6g", mean,
            most, rms, want_mean, want_most, want_rms);
    printf("  NF4 over %s (block 64): %zu elements, error mean %.4g, max %.4g; weights' RMS "
           "%.4g\n",
           LLAMA_HF, m.quant.err_n, mean, most, rms);
    t_check(m.stored == in_file, "NF4: %zu elements stored, the %zu the file holds", m.stored,
            in_file);
    fl_model_free(&m);
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    fixture fx;
    fx_config c;
    unsigned char *data;
    int have_ref = fx_load(t_source_path("tests/fixtures/gpt2_tiny.bin"), &fx, &c, &data);

    // t_dies forks: all of them before the first OpenMP region (the forward)
    test_roundtrip();
    test_bad_safetensors();
    test_bad_models();
    test_bad_configs();
    test_bad_index();
    test_bad_llmc();
    test_llama_roundtrip();
    test_llama_configs();
    test_llama_bad_models();
    test_nul_in_names();
    test_mutations();
    if (have_ref) test_reference(&fx, &c);
    test_llama_reference();
    test_weight_sources();

    free(data), free(fx.recs);
    if (t_remove_dir(dir) != 0) return 1;
    return t_report();
}
