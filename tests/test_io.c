// test_io.c: text files and checkpoints: round trips are exact, damaged or
// malformed files are refused with a message naming the file, a parser fed
// thousands of mutated checkpoints never crashes, and old checkpoints are
// pruned only after the new one is in place.
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fitlm/io.h"
#include "testlib.h"

static char dir[] = "/tmp/fitlm_test_io_XXXXXX";
static const fl_tokenizer_files byte_tok = {.name = "byte"}; // no files

static void load_text(void *path) {
    fl_text t;
    fl_text_load(&t, path);
}

static void test_text(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/t.txt", dir);
    const char *s = "Hello, w\xc3\xb6rld! \xe2\x82\xac and \xf0\x9f\x98\x80.\n";
    t_write_file(path, s, strlen(s));
    fl_text t;
    fl_text_load(&t, path);
    t_check(t.n == strlen(s) && memcmp(t.bytes, s, t.n) == 0, "text loads byte for byte");
    fl_text_free(&t);

    const struct {
        const char *name, *bytes, *expect;
    } bad[] = {
        {"overlong", "ab\xc0\xaf", "bad byte 0xc0 at offset 2"},
        {"surrogate", "x\xed\xa0\x80", "bad byte 0xed at offset 1"},
        {"truncated", "abc\xe2\x82", "bad byte 0xe2 at offset 3"},
        {"stray continuation", "\x80", "bad byte 0x80 at offset 0"},
        {"beyond U+10FFFF", "\xf4\x90\x80\x80", "bad byte 0xf4 at offset 0"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(path, sizeof path, "%s/bad%zu.txt", dir, i);
        t_write_file(path, bad[i].bytes, strlen(bad[i].bytes));
        t_dies(bad[i].name, load_text, path, bad[i].expect);
    }
}

// The documents of a text, "|"-joined, into out.
static void add_doc(void *ctx, const uint8_t *bytes, size_t n) {
    char *out = ctx;
    size_t at = strlen(out);
    if (at) out[at++] = '|';
    memcpy(out + at, bytes, n);
    out[at + n] = 0;
}

// Documents are separated by blank lines whatever the line ends: LF, CRLF
// or both mixed; a line of nothing but white space is blank; blank lines
// at the start, the end or in a row separate nothing more. A document
// keeps its inner line ends, not the one before a blank line; the last
// keeps its final one, as a file without blank lines is one document.
static void test_documents(void) {
    const struct {
        const char *text, *docs;
        size_t count;
    } cases[] = {
        {"a\n\nb", "a|b", 2},
        {"a\r\n\r\nb", "a|b", 2},
        {"a\nx\n\nb\n", "a\nx|b\n", 2},
        {"a\r\nx\r\n\r\nb\r\n", "a\r\nx|b\r\n", 2},
        {"a\n\r\nb", "a|b", 2},
        {"a\r\n\nb", "a|b", 2},
        {"a\r\n \r\nb", "a|b", 2},
        {"a\n \t\nb", "a|b", 2},
        {"a\r\n\t \f\v\r\n\r\nb\r", "a|b\r", 2},
        {"\r\n\r\na\r\n\r\n\r\n", "a", 1},
        {"\n\n\na\n\n\n\nb\n\n", "a|b", 2},
        {"a\r", "a\r", 1},
        {"a\rb\r\rc", "a\rb\r\rc", 1}, // a lone CR ends no line
        {" \r\n\t\n", "", 0},
        {"one\r\ntwo\n\nthree\r\n\r\nfour", "one\r\ntwo|three|four", 3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char got[256] = "";
        size_t n = fl_text_documents((const uint8_t *)cases[i].text, strlen(cases[i].text), NULL,
                                     add_doc, got);
        t_check(n == cases[i].count && !strcmp(got, cases[i].docs),
                "case %zu: %zu documents '%s' (want %zu '%s')", i, n, got, cases[i].count,
                cases[i].docs);
    }
    char got[256] = "";
    size_t n = fl_text_documents((const uint8_t *)"a--b----c--", 11, "--", add_doc, got);
    t_check(n == 3 && !strcmp(got, "a|b|c"), "a separator given splits at each occurrence: %s",
            got);
    t_check(fl_line_is_blank((const uint8_t *)" \t\r", 3) &&
                !fl_line_is_blank((const uint8_t *)" \0", 2) &&
                !fl_line_is_blank((const uint8_t *)"\xc2\xa0", 2),
            "a blank line holds only ASCII white space");
}

static void load_ckpt(void *path) {
    fl_model m;
    char tok[32];
    fl_ckpt_load_model(path, &m, FL_F32, tok, sizeof tok);
}

static const fl_model_config tiny = {
    .max_seq_len = 16, .vocab_size = 70, .n_layer = 2, .n_head = 2, .n_embd = 8};

static int count_files(const char *d, const char *prefix) {
    DIR *dd = opendir(d);
    int n = 0;
    for (struct dirent *e; dd && (e = readdir(dd));)
        n += !strncmp(e->d_name, prefix, strlen(prefix));
    if (dd) closedir(dd);
    return n;
}

static void read_past_row(void *c) {
    float x[8];
    fl_ckpt_read_range(c, "model/h.1.mlp.c_fc.weight", FL_F32, x, 4 * 8 * 8 - 4, 8);
}

static void test_checkpoint(void) {
    fl_model a, b;
    fl_model_init(&a, &tiny, FL_F32, 3);
    char ck[512], file[600];
    snprintf(ck, sizeof ck, "%s/ck", dir);
    fl_train_ckpt_save(ck, 42, &a, NULL, NULL, NULL, &byte_tok, NULL, 2);
    char tok[32];
    fl_ckpt_load_model(ck, &b, FL_F32, tok, sizeof tok);
    t_check(!strcmp(tok, "byte"), "the tokenizer name round-trips");
    t_check(b.table.numel == a.table.numel && b.config.n_layer == 2 && b.config.n_embd == 8 &&
                b.config.vocab_size == 70 && b.config.padded_vocab_size == 128,
            "the model shape round-trips");
    t_check(memcmp(a.params, b.params, a.table.numel * sizeof(float)) == 0,
            "weights round-trip bit for bit");
    fl_model_free(&b);
    fl_ckpt *c = fl_ckpt_open(ck);
    // a range of a row, as a shard reads it: bf16 too
    int row = fl_params_find(&a.table, "h.1.mlp.c_fc.weight");
    const fl_param_view *v = &a.table.views[row];
    float part[100];
    uint16_t part16[100], want16[100];
    fl_ckpt_read_range(c, "model/h.1.mlp.c_fc.weight", FL_F32, part, 37, 100);
    fl_ckpt_read_range(c, "model/h.1.mlp.c_fc.weight", FL_BF16, part16, 37, 100);
    fl_convert(FL_BF16, want16, FL_F32, (const float *)a.params + v->offset + 37, 100);
    t_check(!memcmp(part, (const float *)a.params + v->offset + 37, sizeof part) &&
                !memcmp(part16, want16, sizeof part16),
            "a range of a row reads back (fp32 and rounded to bf16)");
    t_dies("range past the row", read_past_row, c,
           "are outside tensor 'model/h.1.mlp.c_fc.weight'");
    t_check(fl_ckpt_step(c) == 42 && strstr(fl_ckpt_path(c), "ckpt_00000042.fitlm") &&
                fl_ckpt_has(c, "model/wte.weight") && fl_ckpt_has(c, "model/h.1.mlp.c_proj.bias") &&
                !fl_ckpt_has(c, "optim/m/wte.weight") && !fl_ckpt_has(c, "weights"),
            "latest names step 42's file, one tensor per row, no optimizer state: %s",
            fl_ckpt_path(c));
    fl_ckpt_close(c);

    // bf16: the fp32 weights are rounded on load
    fl_model_init(&b, &tiny, FL_BF16, 0);
    fl_model r;
    fl_ckpt_load_model(ck, &r, FL_BF16, tok, sizeof tok);
    uint16_t *want = malloc(a.table.numel * 2);
    fl_convert(FL_BF16, want, FL_F32, a.params, a.table.numel);
    t_check(memcmp(want, r.params, a.table.numel * 2) == 0, "a bf16 load rounds the fp32 weights");
    free(want);
    fl_model_free(&r);
    fl_model_free(&b);

    snprintf(file, sizeof file, "%s/ckpt_00000042.fitlm", ck);
    size_t n;
    unsigned char *good = t_read_file(file, &n);
    unsigned char *bad = malloc(n);
    char err[256];
    t_check(fl_ckpt_parse(good, n, err, sizeof err) == 0, "the parser accepts a good file");
    // every damaged copy is refused, never loaded and never a crash
    const struct {
        const char *name;
        size_t offset;
        unsigned char xor ;
        size_t len;
        const char *expect;
    } cases[] = {
        {"flipped data byte", n - 100, 0x10, 0, "is corrupt (CRC-32 mismatch"},
        {"flipped header byte", 40, 0x01, 0, "the header is corrupt (CRC-32 mismatch)"},
        {"truncated", 0, 0, n - 7, "truncated or corrupt"},
        {"truncated to 10 bytes", 0, 0, 10, "truncated: 10 bytes"},
        {"bad magic", 0, 'X' ^ 'F', 0, "not a fitlm checkpoint"},
        {"future version", 8, 3 ^ 9, 0, "format version 9"}, // written: version 3
        {"wrong data length", 16, 0x04, 0, "truncated or corrupt"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        memcpy(bad, good, n);
        bad[cases[i].offset] ^= cases[i].xor ;
        t_write_file(file, bad, cases[i].len ? cases[i].len : n);
        t_dies(cases[i].name, load_ckpt, ck, cases[i].expect);
        t_check(fl_ckpt_parse(bad, cases[i].len ? cases[i].len : n, err, sizeof err) != 0 &&
                    strstr(err, cases[i].expect) != NULL,
                "the parser refuses it too: %s", err);
    }
    t_dies("missing", load_ckpt, "/nonexistent", "cannot open checkpoint /nonexistent");
    snprintf(file, sizeof file, "%s/latest", ck);
    t_write_file(file, "garbage\n", 8);
    t_dies("latest names no checkpoint", load_ckpt, ck, "does not name a checkpoint file");

    // Mutations of a good file: the parser returns ok or an error, never
    // crashes (the sanitizer build catches out-of-bounds reads).
    int refused = 0;
    size_t cap = n + 4096;
    unsigned char *mutant = malloc(cap);
    for (int i = 0; i < 3000; i++) {
        size_t len = t_mutate(good, n, 1000 + (unsigned long long)i, mutant, cap);
        // an exact-size copy, so the sanitizer sees any read past the end
        unsigned char *exact = malloc(len ? len : 1);
        memcpy(exact, mutant, len);
        refused += fl_ckpt_parse(exact, len, err, sizeof err) != 0;
        free(exact);
    }
    free(mutant);
    t_check(refused > 2500, "3000 mutated checkpoints parse without a crash (%d refused)", refused);
    free(bad);
    free(good);
    fl_model_free(&a);
}

// A header whose model shape disagrees with its tensors is refused naming the
// tensor, before any parameter is allocated (checked as the child t_dies
// runs dies: FL_MEM_PARAMS has not grown).
static size_t params_before;
static void say_params(int code) {
    (void)code;
    fprintf(stderr, fl_mem_current(FL_MEM_PARAMS) > params_before ? " [params grew]"
                                                                  : " [params not allocated]");
}
static void load_ckpt_counting(void *path) {
    params_before = fl_mem_current(FL_MEM_PARAMS);
    fl_log_set_rank(-1, say_params); // fl_die calls it before ending the process
    load_ckpt(path);
}
static void ckpt_model_config(void *path) { // the resume path: shape, then allocation
    fl_ckpt *c = fl_ckpt_open(path);
    fl_model_config cfg;
    fl_ckpt_model_config(c, &cfg);
    fl_ckpt_close(c);
}

static void test_checkpoint_shape_checked(void) {
    fl_model a;
    fl_model_init(&a, &tiny, FL_F32, 3);
    const fl_param_table *t = &a.table;
    fl_ckpt_tensor *tensors = calloc((size_t)t->count + 1, sizeof *tensors);
    char(*names)[80] = calloc((size_t)t->count + 1, 80);
    for (int r = 0; r < t->count; r++) {
        snprintf(names[r], 80, "model/%s", t->views[r].name);
        tensors[r] = (fl_ckpt_tensor){
            names[r], FL_F32, (const float *)a.params + t->views[r].offset, t->views[r].numel};
    }
    char ck[512];
    snprintf(ck, sizeof ck, "%s/shape", dir);
    const struct {
        const char *name, *model, *lora, *expect;
    } cases[] = {
        {"n_embd 16 for 8", "\"n_layer\": 2, \"n_embd\": 16", NULL,
         "tensor 'model/wte.weight' holds 1024 elements, not the 2048 of the model its header"},
        {"n_layer 1 for 2", "\"n_layer\": 1, \"n_embd\": 8", NULL,
         "tensor 'model/h.1.ln_1.weight' is not a parameter of"},
        {"n_layer 3 for 2", "\"n_layer\": 3, \"n_embd\": 8", NULL,
         "tensor 'model/h.2.ln_1.weight' is missing for"},
        {"LoRA rank 4 for 2", "\"n_layer\": 2, \"n_embd\": 8", "4",
         "tensor 'lora/h.0.attn.c_attn.lora_A.weight' holds 16 elements, not the 32"},
        {"adapter without meta.lora", "\"n_layer\": 2, \"n_embd\": 8", NULL,
         "tensor 'lora/h.0.attn.c_attn.lora_A.weight' is an adapter, with no meta.lora"},
    };
    float adapter[16] = {0};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char meta[512];
        snprintf(meta, sizeof meta,
                 "{\"model\": {%s, \"n_head\": 2, \"vocab_size\": 70, \"max_seq_len\": 16}, "
                 "\"tokenizer\": \"byte\"%s%s%s}",
                 cases[i].model, cases[i].lora ? ", \"lora\": {\"r\": " : "",
                 cases[i].lora ? cases[i].lora : "", cases[i].lora ? "}" : "");
        int n = t->count;
        if (i >= 3) { // adapters (r = 2) of a base saved elsewhere
            tensors[0] =
                (fl_ckpt_tensor){"lora/h.0.attn.c_attn.lora_A.weight", FL_F32, adapter, 16};
            n = 1;
        }
        fl_ckpt_write(ck, (int)i + 1, meta, tensors, n, 1);
        char expect[256];
        snprintf(expect, sizeof expect, "ckpt_%08d.fitlm: %s", (int)i + 1, cases[i].expect);
        t_dies(cases[i].name, ckpt_model_config, ck, expect);
        if (i < 3) { // loading a model: the same, before fl_model_init
            t_dies(cases[i].name, load_ckpt_counting, ck, cases[i].expect);
            t_dies(cases[i].name, load_ckpt_counting, ck, "disagree\n [params not allocated]");
        }
    }
    free(names);
    free(tensors);
    fl_model_free(&a);
}

// A directory or a FIFO where a file is expected: a clear error, never a
// read error or a blocked open.
static void test_not_regular_files(void) {
    char fifo[512];
    snprintf(fifo, sizeof fifo, "%s/fifo", dir);
    t_check(mkfifo(fifo, 0644) == 0, "mkfifo %s", fifo);
    t_dies("text: a directory", load_text, dir, "is a directory");
    t_dies("text: a FIFO", load_text, fifo, "fifo is not a regular file");
    t_dies("checkpoint: a FIFO", load_ckpt, fifo, "fifo is not a regular file");
    unlink(fifo);
}

// keep: only the newest checkpoints stay, and leftovers of a killed writer go.
// A checkpoint written before the by-name layout (one "weights" tensor for the
// whole flat buffer, no model.arch) loads as the GPT-2 it holds.
static void test_legacy_checkpoint(void) {
    fl_model m;
    char tok[32];
    fl_ckpt_load_model(t_source_path("tests/fixtures/ckpt_tiny.fitlm"), &m, FL_F32, tok,
                       sizeof tok);
    fl_ckpt *c = fl_ckpt_open(t_source_path("tests/fixtures/ckpt_tiny.fitlm"));
    float *w = malloc(m.table.numel * sizeof(float));
    fl_ckpt_read(c, "weights", FL_F32, w, m.table.numel);
    t_check(m.config.arch == FL_ARCH_GPT2 && m.config.n_layer == 1 && m.config.n_embd == 8 &&
                !strcmp(tok, "byte") && !memcmp(w, m.params, m.table.numel * sizeof(float)),
            "a pre-LLaMA checkpoint loads: GPT-2, its weights in table order");
    free(w);
    fl_ckpt_close(c);
    fl_model_free(&m);
}

static void test_pruning(void) {
    fl_model a;
    fl_model_init(&a, &tiny, FL_F32, 3);
    char ck[512], tmp[600];
    snprintf(ck, sizeof ck, "%s/prune", dir);
    for (int step = 1; step <= 5; step++) {
        if (step == 3) { // as if a writer had been killed mid-file
            snprintf(tmp, sizeof tmp, "%s/ckpt_00000099.fitlm.tmp.99999", ck);
            t_mark_temporary(tmp, 99999);
            strcat(tmp, "/ckpt_00000099.fitlm");
            t_write_file(tmp, "partial", 7);
        }
        fl_train_ckpt_save(ck, step, &a, NULL, NULL, NULL, &byte_tok, NULL, 2);
    }
    t_check(count_files(ck, "ckpt_") == 2, "keep 2: two checkpoint files remain");
    snprintf(tmp, sizeof tmp, "%s/ckpt_00000004.fitlm", ck);
    t_check(access(tmp, F_OK) == 0, "the previous checkpoint is kept");
    fl_ckpt *c = fl_ckpt_open(ck);
    t_check(fl_ckpt_step(c) == 5, "latest is the newest");
    fl_ckpt_close(c);
    fl_train_ckpt_save(ck, 6, &a, NULL, NULL, NULL, &byte_tok, NULL, 0);
    t_check(count_files(ck, "ckpt_") == 3, "keep 0 keeps every checkpoint");
    // a new run in the same directory: the older run's files go first, even
    // with larger step numbers
    fl_train_ckpt_save(ck, 1, &a, NULL, NULL, NULL, &byte_tok, NULL, 2);
    fl_train_ckpt_save(ck, 2, &a, NULL, NULL, NULL, &byte_tok, NULL, 2);
    snprintf(tmp, sizeof tmp, "%s/ckpt_00000001.fitlm", ck);
    t_check(count_files(ck, "ckpt_") == 2 && access(tmp, F_OK) == 0,
            "a new run's checkpoints replace an older run's");
    fl_model_free(&a);
}

// Files stored in a checkpoint (its run's tokenizer): read back whole from a
// single file and from a sharded checkpoint's manifest, checked by their
// CRC-32; a training checkpoint gives back the tokenizer it was saved with.
static void read_stored(void *path) {
    fl_ckpt *c = fl_ckpt_open(path);
    size_t n;
    fl_free(fl_ckpt_file_read(c, "b", &n));
    fl_ckpt_close(c);
}

static void open_tokenizer(void *path) {
    fl_ckpt *c = fl_ckpt_open(path);
    fl_tokenizer_files f;
    fl_ckpt_tokenizer(c, &f);
}

static void test_stored_files(void) {
    char ck[512], sharded[512], file[600];
    snprintf(ck, sizeof ck, "%s/files", dir);
    snprintf(sharded, sizeof sharded, "%s/files_sharded", dir);
    float w[4] = {1, 2, 3, 4};
    fl_ckpt_tensor t = {"w", FL_F32, w, 4};
    fl_ckpt_piece piece = {"w", FL_F32, w, 4, 0, 4};
    const uint8_t bin[5] = {0, 'x', 0, 0xff, '\n'};
    fl_ckpt_file files[2] = {{"a", "hello", 5}, {"b", bin, 5}};
    fl_ckpt_write_run(ck, 1, "{}", &t, 1, 0, NULL, files, 2);
    fl_ckpt_write_dist(sharded, 1, "{}", "{}", &piece, 1, 1, 0, "r1", files, 2);
    const char *paths[] = {ck, sharded};
    for (int k = 0; k < 2; k++) {
        fl_ckpt *c = fl_ckpt_open(paths[k]);
        size_t na = 0, nb = 0, nc = 1;
        uint8_t *a = fl_ckpt_file_read(c, "a", &na), *b = fl_ckpt_file_read(c, "b", &nb);
        uint8_t *none = fl_ckpt_file_read(c, "c", &nc);
        float back[4];
        fl_ckpt_read(c, "w", FL_F32, back, 4);
        t_check(a && na == 5 && !memcmp(a, "hello", 5) && b && nb == 5 && !memcmp(b, bin, 5) &&
                    !none && !memcmp(back, w, sizeof w) && (k == 0) == !fl_ckpt_shards(c),
                "%s checkpoint: its stored files read back whole, an absent one is NULL",
                k ? "a sharded" : "a single-file");
        fl_free(a);
        fl_free(b);
        fl_ckpt_close(c);
    }
    snprintf(file, sizeof file, "%s/ckpt_00000001.fitlm", ck);
    size_t n;
    unsigned char *img = t_read_file(file, &n);
    char err[256];
    t_check(fl_ckpt_parse(img, n, err, sizeof err) == 0, "the parser takes it: %s", err);
    img[n - 1] ^= 1; // the last byte of file "b"
    t_check(fl_ckpt_parse(img, n, err, sizeof err) != 0 && strstr(err, "file 'b' is corrupt"),
            "the parser checks a stored file's CRC-32: %s", err);
    t_write_file(file, img, n);
    free(img);
    t_dies("a corrupt stored file", read_stored, file, "its file 'b' is corrupt");

    // a training checkpoint holds the tokenizer's files it was given
    const char *json = t_source_path("tests/fixtures/hf_tokenizer_97/tokenizer.json");
    fl_tokenizer_files tok, back;
    fl_tokenizer_files_read(&tok, "hf", json);
    fl_model m;
    fl_model_init(&m, &tiny, FL_F32, 3); // (a checkpoint does not check the vocabulary)
    snprintf(ck, sizeof ck, "%s/files_tok", dir);
    fl_train_ckpt_save(ck, 1, &m, NULL, NULL, NULL, &tok, NULL, 0);
    fl_ckpt *c = fl_ckpt_open(ck);
    fl_ckpt_tokenizer(c, &back);
    fl_ckpt_close(c);
    fl_tokenizer *loaded = fl_tokenizer_load_files(&back);
    t_check(fl_tokenizer_files_equal(&tok, &back) && back.n == 1 &&
                !strcmp(back.file[0], "tokenizer.json") && fl_tokenizer_vocab_size(loaded) == 97,
            "a training checkpoint gives back its tokenizer, byte for byte, and it loads");
    fl_tokenizer_free(loaded);
    fl_tokenizer_files_free(&back);
    fl_tokenizer_files_free(&tok);
    // stored files that are not the named tokenizer's are refused, naming the checkpoint
    fl_tokenizer_files odd = {.name = "gpt2", .n = 1};
    odd.file[0] = "tokenizer.json";
    odd.data[0] = (uint8_t *)"{}";
    odd.size[0] = 2;
    snprintf(ck, sizeof ck, "%s/files_odd", dir);
    fl_train_ckpt_save(ck, 1, &m, NULL, NULL, NULL, &odd, NULL, 0);
    t_dies("stored files of another tokenizer", open_tokenizer, ck,
           "its stored tokenizer files are not those of the gpt2 tokenizer");
    fl_model_free(&m);
    // a checkpoint of the format before stored files holds none
    c = fl_ckpt_open(t_source_path("tests/fixtures/ckpt_tiny.fitlm"));
    fl_ckpt_tokenizer(c, &back);
    fl_ckpt_close(c);
    t_check(!strcmp(back.name, "byte") && back.n == 0, "a version-2 checkpoint: byte, no files");
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    test_text();
    test_documents();
    test_not_regular_files();
    test_checkpoint();
    test_checkpoint_shape_checked();
    test_pruning();
    test_legacy_checkpoint();
    test_stored_files();
    if (t_remove_dir(dir) != 0) return 1;
    return t_report();
}
