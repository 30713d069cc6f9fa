// test_formats.c: model-file formats. Hugging Face export and import round
// trips are exact (fp32; fp16/bf16 give the rounded values), sharded or
// not; the PyTorch reference's initial weights, written by
// scripts/make_reference.py as HF safetensors and as llm.c files, load to
// exactly those weights and reproduce the reference logits; malformed files
// are refused with a message naming what is wrong; and thousands of seeded
// mutations of valid files never crash the non-dying parsers (the
// sanitizer build catches any overread).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fitlm/io.h"
#include "fitlm/safetensors.h"
#include "testlib.h"
#include "testref.h"

static char dir[] = "/tmp/fitlm_test_formats_XXXXXX";

#define HF_FIXTURE   "tests/fixtures/gpt2_tiny_hf"
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

static void test_roundtrip(void) {
    // V = 100 pads to 128 rows; C = 32 so transposes are not square
    fl_model_config cfg = {
        .max_seq_len = 16, .vocab_size = 100, .n_layer = 2, .n_head = 4, .n_embd = 32};
    fl_model m;
    fl_model_init(&m, &cfg, FL_F32, 5);
    size_t n = m.table.numel;
    const float *w = m.params;
    float *want = malloc(n * sizeof(float));
    void *stored = malloc(n * sizeof(float)); // the weights in the exported dtype
    const struct {
        const char *name;
        fl_dtype dt;
        size_t shard_bytes;
        int shards;
    } cases[] = {
        {"fp32", FL_F32, 0, 1},
        {"fp32_sharded", FL_F32, 40000, 4}, // cut before the tensor that would overflow
        {"bf16", FL_BF16, 0, 1},
        {"fp16_sharded", FL_F16, 10000, 7},
    };
    char path[PATH_MAX_LEN], file[PATH_MAX_LEN + 64];
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        in_dir(path, cases[k].name);
        fl_hf_export(path, &m, w, cases[k].dt, cases[k].shard_bytes);
        // the exported values are the weights rounded once to the dtype
        fl_convert(cases[k].dt, stored, FL_F32, w, n);
        if (cases[k].dt == FL_F32)
            memcpy(want, w, n * sizeof(float));
        else
            fl_convert(FL_F32, want, cases[k].dt, stored, n);
        fl_model got;
        fl_hf_load(path, &got, FL_F32);
        t_check(got.config.vocab_size == 100 && got.config.padded_vocab_size == 128 &&
                    got.config.n_embd == 32 && got.config.n_layer == 2,
                "%s: config.json gives the shape back", cases[k].name);
        t_check(got.table.numel == n && same_floats(got.params, want, n),
                "%s: export -> import is exact", cases[k].name);
        fl_model_free(&got);
        snprintf(file, sizeof file, "%s/model-%05d-of-%05d.safetensors", path, 1, cases[k].shards);
        if (cases[k].shards > 1) {
            snprintf(file, sizeof file, "%s/model-%05d-of-%05d.safetensors", path, cases[k].shards,
                     cases[k].shards);
            t_check(access(file, F_OK) == 0, "%s: %d shards written", cases[k].name,
                    cases[k].shards);
            snprintf(file, sizeof file, "%s/model-%05d-of-%05d.safetensors", path,
                     cases[k].shards + 1, cases[k].shards + 1);
            t_check(access(file, F_OK) != 0, "%s: no more than %d shards", cases[k].name,
                    cases[k].shards);
        }
        if (cases[k].dt != FL_F32) { // loaded straight into the dtype: the same bits
            fl_hf_load(path, &got, cases[k].dt);
            t_check(memcmp(got.params, stored, n * 2) == 0, "%s: import into %s is exact",
                    cases[k].name, fl_dtype_name(cases[k].dt));
            fl_model_free(&got);
        }
    }

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
    free(want), free(stored);
    fl_model_free(&m);
}

// ----------------------------------------------------------------------------
// the reference weights in each format

static void test_reference(fixture *fx, const fx_config *c) {
    fl_model hf, one, v3, v5;
    fl_hf_load(t_source_path(HF_FIXTURE), &hf, FL_F32);
    size_t n = hf.table.numel;
    int exact = 1;
    for (int i = 0; i < hf.table.count; i++) {
        const fl_param_view *v = &hf.table.views[i];
        char name[FX_MAX_NAME + 1];
        snprintf(name, sizeof name, "param/%s", v->name);
        const fx_record *r = fx_find(fx, name);
        float *x = fx_copy(fx, r);
        const float *got = (const float *)hf.params + v->offset;
        exact &= same_floats(got, x, r->numel);
        for (size_t j = r->numel; j < v->numel; j++) exact &= got[j] == 0.0f; // padded rows
        free(x);
    }
    t_check(exact, "HF safetensors fixture: every weight is the reference's, bit for bit");

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
    int *tokens = fx_copy(fx, fx_find(fx, "tokens"));
    float *want = fx_floats(fx, "logits");
    size_t BT = (size_t)c->B * c->T, V = (size_t)c->V, Vp = hf.config.padded_vocab_size;
    float *logits = malloc(BT * V * sizeof(float));
    fl_model *models[2] = {&hf, &v3};
    const char *names[2] = {"logits (HF safetensors)", "logits (llm.c v3)"};
    for (int k = 0; k < 2; k++) {
        fl_model_alloc_acts(models[k], c->B, c->T, FL_RECOMPUTE_NONE);
        fl_model_forward(models[k], tokens, NULL, c->B, c->T);
        for (size_t i = 0; i < BT; i++)
            memcpy(logits + i * V, (const float *)models[k]->logits + i * Vp, V * sizeof(float));
        t_close(names[k], logits, want, BT * V, LOGITS_ATOL, LOGITS_RTOL);
    }
    free(tokens), free(want), free(logits);
    fl_model_free(&hf), fl_model_free(&one), fl_model_free(&v3), fl_model_free(&v5);
}

// ----------------------------------------------------------------------------
// malformed files

// A safetensors file with this header and `data` zero bytes of data.
static void write_st(const char *path, const char *header, size_t data) {
    size_t h = strlen(header);
    unsigned char *b = calloc(1, 8 + h + data);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)((uint64_t)h >> (8 * i));
    memcpy(b + 8, header, h);
    t_write_file(path, b, 8 + h + data);
    free(b);
}

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
        {"trailing garbage", "{" T16("a", 0, 64) "}x", 64, "bytes after the header's JSON"},
        {"bad metadata", "{\"__metadata__\":{\"format\":1}," T16("a", 0, 64) "}", 64,
         "__metadata__ value 'format' is not a string"},
    };
    char d[PATH_MAX_LEN], path[PATH_MAX_LEN + 32];
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char name[32];
        snprintf(name, sizeof name, "bad_st_%zu", k);
        model_dir(d, name, NULL);
        snprintf(path, sizeof path, "%s/model.safetensors", d);
        write_st(path, cases[k].header, cases[k].data);
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

// Copies of the reference safetensors with one edit, to test the GPT-2
// layer above the format.
typedef struct {
    const fl_safetensors *src;
    const fl_st_tensor *from[64]; // source tensor of each output tensor
    int flip;                     // flip a bit of the last tensor's data
} rewrite_ctx;

static void rewrite_fill(void *p, int i, void *dst) {
    const rewrite_ctx *x = p;
    const fl_st_tensor *t = x->from[i];
    memcpy(dst, x->src->data + t->begin, t->end - t->begin);
    if (x->flip && x->from[i + 1] == NULL) ((unsigned char *)dst)[0] ^= 1;
}

// drop: a tensor left out; rename: from -> to; reshape: wte's shape
// transposed; lm_head: 1 adds a copy of wte as lm_head.weight, 2 a copy
// with one bit changed.
static void rewrite(const char *out, const char *drop, const char *from, const char *to,
                    int reshape, int lm_head) {
    fl_safetensors src;
    fl_safetensors_open(&src, t_source_path(HF_FIXTURE "/model.safetensors"));
    fl_st_tensor ts[64];
    rewrite_ctx x = {.src = &src, .flip = lm_head == 2};
    int n = 0;
    for (int i = 0; i < src.count && n < 62; i++) {
        const fl_st_tensor *t = &src.tensors[i];
        if (drop && strcmp(t->name, drop) == 0) continue;
        ts[n] = *t;
        if (from && strcmp(t->name, from) == 0) ts[n].name = to;
        if (reshape && strcmp(t->name, "transformer.wte.weight") == 0)
            ts[n].shape[0] = t->shape[1], ts[n].shape[1] = t->shape[0];
        x.from[n++] = t;
    }
    if (lm_head) {
        const fl_st_tensor *wte = fl_safetensors_find(&src, "transformer.wte.weight");
        ts[n] = *wte;
        ts[n].name = "lm_head.weight";
        x.from[n++] = wte;
    }
    x.from[n] = NULL;
    fl_safetensors_write(out, ts, n, rewrite_fill, &x);
    fl_safetensors_free(&src);
}

static void test_bad_models(void) {
    const struct {
        const char *name, *drop, *from, *to;
        int reshape, lm_head;
        const char *expect; // NULL: loads
    } cases[] = {
        {"missing tensor", "transformer.ln_f.bias", NULL, NULL, 0, 0,
         "tensor 'transformer.ln_f.bias' is missing"},
        {"unknown tensor", NULL, "transformer.h.1.attn.bias", "transformer.h.1.attn.rotary", 0, 0,
         "unknown tensor 'transformer.h.1.attn.rotary'"},
        {"tensor stored twice", NULL, "transformer.h.0.attn.bias", "wte.weight", 0, 0,
         "stored twice"},
        {"wrong shape", NULL, NULL, NULL, 1, 0,
         "'transformer.wte.weight' has shape [16, 64], config.json implies [64, 16]"},
        {"untied lm_head", NULL, NULL, NULL, 0, 2, "untied LM heads are not supported"},
        {"tied lm_head stored", NULL, NULL, NULL, 0, 1, NULL},
        {"names without prefix", NULL, "transformer.wte.weight", "wte.weight", 0, 0, NULL},
    };
    char d[PATH_MAX_LEN], path[PATH_MAX_LEN + 32];
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        char name[32];
        snprintf(name, sizeof name, "bad_model_%zu", k);
        model_dir(d, name, NULL);
        snprintf(path, sizeof path, "%s/model.safetensors", d);
        rewrite(path, cases[k].drop, cases[k].from, cases[k].to, cases[k].reshape,
                cases[k].lm_head);
        if (cases[k].expect) {
            t_dies(cases[k].name, load_hf, d, cases[k].expect);
        } else {
            fl_model m;
            fl_hf_load(d, &m, FL_F32);
            t_check(m.table.numel > 0, "%s: loads", cases[k].name);
            fl_model_free(&m);
        }
    }
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
        {"other model_type", "\"gelu_new\"", "1e-5", "\"llama\"", "16", "true", "64", "",
         "model_type is llama"},
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
    if (rc == 0 && (c.n_embd % c.n_head || c.padded_vocab_size < c.vocab_size)) rc = -2;
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

static void mutate(const char *what, const char *path, int count, unsigned long long seed,
                   int (*parse)(const unsigned char *, size_t, char *, size_t)) {
    size_t n;
    unsigned char *good = t_read_file(path, &n);
    char err[512];
    if (!t_check(good && n > 0 && parse(good, n, err, sizeof err) == 0, "%s: %s parses: %s", what,
                 path, err)) {
        free(good);
        return;
    }
    size_t cap = n + 64;
    unsigned char *scratch = malloc(cap);
    int ok = 0, refused = 0, bad = 0;
    for (int i = 0; i < count; i++) {
        size_t len = t_mutate(good, n, seed + (unsigned long long)i, scratch, cap);
        // an exact-size copy, so that ASan sees any read past the end
        unsigned char *b = malloc(len ? len : 1);
        memcpy(b, scratch, len);
        err[0] = 0;
        int rc = parse(b, len, err, sizeof err);
        if (rc == 0)
            ok++;
        else if (rc == -1 && err[0])
            refused++;
        else if (bad++ == 0)
            t_check(0, "%s: mutation %d: rc %d, message '%s'", what, i, rc, err);
        free(b);
    }
    printf("  %-22s %d mutations: %d accepted, %d refused with a message\n", what, count, ok,
           refused);
    t_check(bad == 0 && refused > count / 2, "%s: %d mutations, %d broken results", what, count,
            bad);
    free(scratch), free(good);
}

static void test_mutations(void) {
    char index[PATH_MAX_LEN];
    in_dir(index, "fp16_sharded/model.safetensors.index.json");
    mutate("safetensors", t_source_path(HF_FIXTURE "/model.safetensors"), 3000, 1000000, parse_st);
    mutate("config.json", t_source_path(HF_FIXTURE "/config.json"), 2000, 2000000, parse_config);
    mutate("index.json", index, 2000, 3000000, parse_index);
    mutate("llm.c header", t_source_path(LLMC_V3), 2000, 4000000, parse_llmc);
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
    test_mutations();
    if (have_ref) test_reference(&fx, &c);

    free(data), free(fx.recs);
    if (t_remove_dir(dir) != 0) return 1;
    return t_report();
}
