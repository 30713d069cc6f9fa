// test_io.c: text files and checkpoints: round trips are exact, damaged or
// malformed files are refused with a message naming the file, a parser fed
// thousands of mutated checkpoints never crashes, and old checkpoints are
// pruned only after the new one is in place.
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
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
    fl_ckpt_piece piece = {.name = "w", .dtype = FL_F32, .data = w, .numel = 4, .total = 4};
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

// ----------------------------------------------------------------------------
// Tensor-parallel checkpoints: global tensors written as strided pieces (each
// rank's columns of every row, as a row-parallel weight is split) in several
// shard files, read back whole, by ranges and by another slicing.

enum { ROWS = 6, COLS = 8, TOTAL = ROWS * COLS, PIECES_MAX = 8 };

typedef struct {
    fl_ckpt_piece p[PIECES_MAX];
    int n;
} rank_pieces;

// Elements first + k * stride + j (j < run, k < count / run) of x into dst.
static void gather(void *dst, const void *x, size_t esize, size_t first, size_t run, size_t stride,
                   size_t count) {
    for (size_t i = 0; i < count; i++)
        memcpy((char *)dst + i * esize,
               (const char *)x + (first + i / run * stride + i % run) * esize, esize);
}

static const char *find_text(const char *s, size_t n, const char *what) {
    for (size_t m = strlen(what), i = 0; i + m <= n; i++)
        if (!memcmp(s + i, what, m)) return s + i;
    return NULL;
}

// A copy of checkpoint file src at dst with its header's text from `start`
// through the first `end` after it replaced by `to` (start NULL: none) and
// the version set (0: kept), the prefix's length and CRC-32 made to match:
// a file another writer could have written.
static void rewrite_ckpt(const char *src, const char *dst, const char *start, const char *end,
                         const char *to, uint32_t version) {
    size_t n;
    unsigned char *img = t_read_file(src, &n);
    uint32_t h = fl_get_u32(img + 12);
    const char *header = (const char *)img + 28, *at = header + h, *stop = at;
    if (start) {
        at = find_text(header, h, start);
        stop = at ? find_text(at, (size_t)(header + h - at), end) : NULL;
        if (!t_check(at && stop, "%s holds %s...%s", src, start, end)) exit(1);
        stop += strlen(end);
    }
    size_t pre = (size_t)(at - header), cut = (size_t)(stop - at), add = start ? strlen(to) : 0;
    unsigned char *out = malloc(n - cut + add);
    memcpy(out, img, 28);
    memcpy(out + 28, header, pre);
    memcpy(out + 28 + pre, to, add);
    memcpy(out + 28 + pre + add, header + pre + cut, n - 28 - pre - cut);
    uint32_t h2 = (uint32_t)(h - cut + add);
    if (version) fl_put_u32(out + 8, version);
    fl_put_u32(out + 12, h2);
    fl_put_u32(out + 24, fl_crc32(fl_crc32(0, out, 24), out + 28, h2));
    t_write_file(dst, out, n - cut + add);
    free(out);
    free(img);
}

// The shard file a one-rank save wrote into d.
static void shard_in(const char *d, char *out, size_t size) {
    DIR *dd = opendir(d);
    out[0] = 0;
    for (struct dirent *e; dd && (e = readdir(dd));)
        if (strstr(e->d_name, ".rank0-of-1.fitlm")) snprintf(out, size, "%s/%s", d, e->d_name);
    if (dd) closedir(dd);
    t_check(out[0] != 0, "a one-rank save wrote a shard file into %s", d);
}

// A sharded checkpoint at out of `world` shard files, rank r's holding
// ranks[r]: each written by a one-rank save (fl_ckpt_write_dist) and
// relabelled rank r of world, then the manifest listing them.
static void write_ranks(const char *out, const rank_pieces *ranks, int world) {
    char sharding[4096], one[600], shard[900], path[900], to[256];
    int at = snprintf(sharding, sizeof sharding, "\"sharding\":{\"world\":%d,\"shards\":[", world);
    mkdir(out, 0755);
    for (int r = 0; r < world; r++) {
        snprintf(one, sizeof one, "%s.rank%d", out, r);
        fl_ckpt_write_dist(one, 1, "{}", "{}", ranks[r].p, ranks[r].n, 1, 0, "tp", NULL, 0);
        shard_in(one, shard, sizeof shard);
        char name[64];
        snprintf(name, sizeof name, "ckpt_00000001.0000abcd.rank%d-of-%d.fitlm", r, world);
        snprintf(path, sizeof path, "%s/%s", out, name);
        snprintf(to, sizeof to,
                 "\"shard\":{\"of\":\"ckpt_00000001.fitlm\",\"rank\":%d,\"world\":%d}", r, world);
        rewrite_ckpt(shard, path, "\"shard\":{", "}", to, 0);
        size_t n;
        unsigned char *img = t_read_file(path, &n);
        at += snprintf(sharding + at, sizeof sharding - (size_t)at,
                       "%s{\"file\":\"%s\",\"bytes\":%zu,\"header_crc32\":\"%08x\"}", r ? "," : "",
                       name, n, fl_get_u32(img + 24));
        free(img);
    }
    snprintf(sharding + at, sizeof sharding - (size_t)at, "]}");
    snprintf(one, sizeof one, "%s.rank0/ckpt_00000001.fitlm", out);
    snprintf(path, sizeof path, "%s/ckpt_00000001.fitlm", out);
    rewrite_ckpt(one, path, "\"sharding\":{", "]}", sharding, 0);
    snprintf(path, sizeof path, "%s/latest", out);
    t_write_text(path, "ckpt_00000001.fitlm\n");
}

// Rank r of 2 (t = 2, split over the columns): "w" (fp32) as one strided
// piece of runs of w_run (rank 1's last); "w16" (bf16) as its slice's
// ZeRO-like parts: rows 0-1 strided, row 2 in two contiguous parts, rows
// 3-5 strided. The slices: the rank's columns, back to back.
static void tp2_pieces(rank_pieces *rp, int r, const float *wslice, const uint16_t *hslice,
                       size_t w_run) {
    size_t c = (size_t)r * COLS / 2, half = COLS / 2;
    rp->n = 0;
    fl_ckpt_piece *p = rp->p;
    p[rp->n++] = (fl_ckpt_piece){.name = "w16",
                                 .dtype = FL_BF16,
                                 .data = hslice + 12,
                                 .numel = 12,
                                 .first = 3 * COLS + c,
                                 .total = TOTAL,
                                 .run = half,
                                 .stride = COLS};
    p[rp->n++] = (fl_ckpt_piece){.name = "w16",
                                 .dtype = FL_BF16,
                                 .data = hslice + 10,
                                 .numel = 2,
                                 .first = 2 * COLS + c + 2,
                                 .total = TOTAL};
    p[rp->n++] = (fl_ckpt_piece){.name = "w16",
                                 .dtype = FL_BF16,
                                 .data = hslice,
                                 .numel = 8,
                                 .first = c,
                                 .total = TOTAL,
                                 .run = half,
                                 .stride = COLS};
    p[rp->n++] = (fl_ckpt_piece){.name = "w16",
                                 .dtype = FL_BF16,
                                 .data = hslice + 8,
                                 .numel = 2,
                                 .first = 2 * COLS + c,
                                 .total = TOTAL};
    p[rp->n++] = (fl_ckpt_piece){.name = "w",
                                 .dtype = FL_F32,
                                 .data = wslice,
                                 .numel = ROWS * w_run,
                                 .first = c,
                                 .total = TOTAL,
                                 .run = w_run,
                                 .stride = COLS};
    if (!r) { // rank 0 lists "w" first
        fl_ckpt_piece first = p[0];
        p[0] = p[rp->n - 1];
        p[rp->n - 1] = first;
    }
}

typedef struct {
    const char *path, *name;
    size_t first, run, stride, count;
} runs_read;

static void read_runs_of(void *arg) {
    const runs_read *a = arg;
    fl_ckpt *c = fl_ckpt_open(a->path);
    float x[TOTAL];
    fl_ckpt_read_runs(c, a->name, FL_F32, x, a->first, a->run, a->stride, a->count);
}

static void open_ckpt(void *path) {
    fl_ckpt_close(fl_ckpt_open(path));
}

// Reads the slices of `name` (dtype src) in dt through every reader and
// compares them with the global tensor x: whole, ZeRO ranges, t = 4
// column slices, the written t = 2 slices, runs across the pieces' edges.
static void check_reads(fl_ckpt *c, const char *name, fl_dtype dt, const void *x) {
    size_t es = fl_dtype_size(dt);
    uint8_t got[TOTAL * 4 + 1], want[TOTAL * 4]; // + a byte that no read may touch
    fl_ckpt_read(c, name, dt, got, TOTAL);
    int ok = !memcmp(got, x, TOTAL * es);
    const size_t ranges[][2] = {{0, 16}, {16, 16}, {32, 16}, {5, 37}, {47, 1}};
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0]; i++) {
        fl_ckpt_read_range(c, name, dt, got, ranges[i][0], ranges[i][1]);
        ok &= !memcmp(got, (const uint8_t *)x + ranges[i][0] * es, ranges[i][1] * es);
    }
    const size_t runs[][4] = {
        {0, 2, COLS, 12}, {2, 2, COLS, 12},
        {4, 2, COLS, 12}, {6, 2, COLS, 12}, // t = 4
        {0, 4, COLS, 24}, {4, 4, COLS, 24}, // t = 2
        {3, 3, COLS, 18}, {2 * COLS + 1, 6, COLS, 12},
        {1, 1, 3, 15},                   // across edges
        {0, 16, 16, 48},  {5, 1, 1, 40}, // contiguous
    };
    for (size_t i = 0; i < sizeof runs / sizeof runs[0]; i++) {
        memset(got, 0xee, sizeof got);
        fl_ckpt_read_runs(c, name, dt, got, runs[i][0], runs[i][1], runs[i][2], runs[i][3]);
        gather(want, x, es, runs[i][0], runs[i][1], runs[i][2], runs[i][3]);
        ok &= !memcmp(got, want, runs[i][3] * es) && got[runs[i][3] * es] == 0xee;
    }
    t_check(ok, "'%s' as %s: whole, by ranges and by strided runs, bitwise", name,
            dt == FL_F32 ? "fp32" : "bf16");
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void test_tensor_parallel(void) {
    float w[TOTAL], w_of16[TOTAL], wslice[2][TOTAL / 2];
    uint16_t h[TOTAL], w_bf16[TOTAL], hslice[2][TOTAL / 2];
    t_fill(w, TOTAL, 7, 1.0f);
    t_fill(w_of16, TOTAL, 8, 1.0f);
    fl_convert(FL_BF16, h, FL_F32, w_of16, TOTAL);
    fl_convert(FL_F32, w_of16, FL_BF16, h, TOTAL); // h's values exactly
    fl_convert(FL_BF16, w_bf16, FL_F32, w, TOTAL);
    rank_pieces ranks[2];
    for (int r = 0; r < 2; r++) {
        gather(wslice[r], w, 4, (size_t)r * 4, 4, COLS, TOTAL / 2);
        gather(hslice[r], h, 2, (size_t)r * 4, 4, COLS, TOTAL / 2);
        tp2_pieces(&ranks[r], r, wslice[r], hslice[r], 4);
    }
    char ck[512], shard[900], file[900];
    snprintf(ck, sizeof ck, "%s/tp2", dir);
    write_ranks(ck, ranks, 2);
    fl_ckpt *c = fl_ckpt_open(ck);
    t_check(fl_ckpt_shards(c) == 2 && fl_ckpt_numel(c, "w") == TOTAL &&
                fl_ckpt_numel(c, "w16") == TOTAL && fl_ckpt_tensor_count(c) == 2,
            "two shard files of strided pieces open as two whole tensors");
    check_reads(c, "w", FL_F32, w);
    check_reads(c, "w16", FL_BF16, h);
    check_reads(c, "w", FL_BF16, w_bf16);  // rounded on the way
    check_reads(c, "w16", FL_F32, w_of16); // widened
    fl_ckpt_close(c);

    // versions: 4 for a file with a strided piece only; the manifest stays 3
    snprintf(file, sizeof file, "%s/ckpt_00000001.0000abcd.rank0-of-2.fitlm", ck);
    size_t n;
    unsigned char *img = t_read_file(file, &n);
    snprintf(shard, sizeof shard, "%s/ckpt_00000001.fitlm", ck);
    unsigned char *man = t_read_file(shard, &n);
    t_check(fl_get_u32(img + 8) == 4 && fl_get_u32(man + 8) == 3,
            "a shard file of strided pieces is version 4, its manifest version 3");
    free(man);
    free(img);
    // the same tensor as contiguous ZeRO ranges: version 3, read as before
    fl_ckpt_piece zero[2] = {
        {.name = "w", .dtype = FL_F32, .data = w, .numel = 20, .total = TOTAL},
        {.name = "w", .dtype = FL_F32, .data = w + 20, .numel = 28, .first = 20, .total = TOTAL}};
    snprintf(file, sizeof file, "%s/zero", dir);
    fl_ckpt_write_dist(file, 1, "{}", "{}", zero, 2, 1, 0, "z", NULL, 0);
    shard_in(file, shard, sizeof shard);
    img = t_read_file(shard, &n);
    c = fl_ckpt_open(file);
    float back[TOTAL], part[12];
    fl_ckpt_read(c, "w", FL_F32, back, TOTAL);
    fl_ckpt_read_runs(c, "w", FL_F32, part, 2, 2, COLS, 12);
    float want[12];
    gather(want, w, 4, 2, 2, COLS, 12);
    t_check(fl_get_u32(img + 8) == 3 && !memcmp(back, w, sizeof w) && !memcmp(part, want, 48),
            "contiguous pieces stay version 3, read whole and as a t = 4 slice");
    fl_ckpt_close(c);
    free(img);

    // only the pieces that hold wanted elements are read: rank 1's "w"
    // damaged, t = 4 rank 0 reads; rank 3 finds the damage
    snprintf(file, sizeof file, "%s/ckpt_00000001.0000abcd.rank1-of-2.fitlm", ck);
    img = t_read_file(file, &n);
    img[n - 1] ^= 0x40; // rank 1's last piece: "w"
    t_write_file(file, img, n);
    free(img);
    runs_read t4r3 = {ck, "w", 6, 2, COLS, 12};
    c = fl_ckpt_open(ck);
    fl_ckpt_read_runs(c, "w", FL_F32, part, 0, 2, COLS, 12);
    gather(want, w, 4, 0, 2, COLS, 12);
    t_check(!memcmp(part, want, 48), "a slice reads only the pieces that hold it");
    fl_ckpt_close(c);
    t_dies("a damaged strided piece", read_runs_of, &t4r3,
           "rank1-of-2.fitlm: tensor 'w' is corrupt (CRC-32 mismatch");

    // a slice that is not one, or lies past the tensor
    runs_read bad_runs[] = {{ck, "w", 0, 0, COLS, 12},
                            {ck, "w", 0, 4, 3, 12},
                            {ck, "w", 0, 5, COLS, 12},
                            {ck, "w", 6, 4, COLS, 24}};
    const char *bad_why[] = {"12 elements in runs of 0 every 8 are not a slice of tensor 'w'",
                             "12 elements in runs of 4 every 3 are not a slice",
                             "12 elements in runs of 5 every 8 are not a slice",
                             "6 runs of 4 every 8 from element 6 are outside tensor 'w' of 48"};
    for (int i = 0; i < 4; i++) t_dies("a bad slice", read_runs_of, &bad_runs[i], bad_why[i]);

    // overlaps and gaps between strided pieces, named by tensor and element
    float fake[TOTAL];
    memcpy(fake, wslice[1], sizeof wslice[1]);
    tp2_pieces(&ranks[1], 1, fake, hslice[1], 4);
    ranks[1].p[ranks[1].n - 1].first = 2; // columns 2-5: 2 and 3 are rank 0's too
    snprintf(ck, sizeof ck, "%s/tp2_overlap", dir);
    write_ranks(ck, ranks, 2);
    t_dies("strided pieces overlap", open_ckpt, ck,
           "tensor 'w' has element 2 twice (" /* the second piece's file */);
    snprintf(file, sizeof file, "rank1-of-2.fitlm)");
    t_dies("strided pieces overlap: the file", open_ckpt, ck, file);
    tp2_pieces(&ranks[1], 1, fake, hslice[1], 3); // columns 4-6: 7 in no file
    snprintf(ck, sizeof ck, "%s/tp2_gap", dir);
    write_ranks(ck, ranks, 2);
    t_dies("a gap between strided pieces", open_ckpt, ck, "tensor 'w' has element 7 in no file");
    tp2_pieces(&ranks[1], 1, fake, hslice[1], 4);
    ranks[1].p[1].first = 2 * COLS + 4 + 3; // a contiguous part one element late
    ranks[1].p[1].numel = 1;
    snprintf(ck, sizeof ck, "%s/tp2_gap16", dir);
    write_ranks(ck, ranks, 2);
    t_dies("a gap beside a strided piece", open_ckpt, ck, "tensor 'w16' has element 22 in no file");

    // damaged run/stride values are refused, naming the file and the tensor
    snprintf(ck, sizeof ck, "%s/tp2", dir);
    snprintf(shard, sizeof shard, "%s/ckpt_00000001.0000abcd.rank0-of-2.fitlm", ck);
    snprintf(file, sizeof file, "%s/damaged.fitlm", dir);
    const struct {
        const char *to, *expect;
        uint32_t version;
    } damaged[] = {
        {"\"run\":5,\"stride\":8", "tensor 'w': its 24 elements are not whole runs of 5", 0},
        {"\"run\":4,\"stride\":3", "tensor 'w': stride 3 is shorter than its run 4", 0},
        {"\"run\":4,\"stride\":9",
         "tensor 'w': 6 runs of 4 every 9 from element 0 end past its 48 elements", 0},
        {"\"run\":0,\"stride\":8", "tensor 'w': run/stride are malformed", 0},
        {"\"run\":-4,\"stride\":8", "tensor 'w': run/stride are malformed", 0},
        {"\"run\":4,\"stride\":\"8\"", "tensor 'w': run/stride are malformed", 0},
        {"\"stride\":8", "tensor 'w': run/stride are malformed", 0},
        {"\"run\":4,\"stride\":8", "tensor 'w': run/stride in a version-3 file", 3},
    };
    char err[256];
    for (size_t i = 0; i < sizeof damaged / sizeof damaged[0]; i++) {
        rewrite_ckpt(shard, file, "\"run\":4,", "\"stride\":8", damaged[i].to, damaged[i].version);
        img = t_read_file(file, &n);
        t_check(fl_ckpt_parse(img, n, err, sizeof err) != 0 && strstr(err, damaged[i].expect),
                "%s: refused: %s", damaged[i].to, err);
        free(img);
    }
    rewrite_ckpt(shard, file, "\"run\":4,", "\"stride\":8", "\"run\":4,\"stride\":3", 0);
    rename(file, shard);
    t_dies("a damaged stride, opened", open_ckpt, ck,
           "rank0-of-2.fitlm (of " /* the shard named */);
    t_dies("a damaged stride, opened: why", open_ckpt, ck, "stride 3 is shorter than its run 4");

    // the format of a strided shard file, byte for byte (the fuzzer's seed)
    snprintf(ck, sizeof ck, "%s/tp2.rank0", dir);
    shard_in(ck, shard, sizeof shard);
    img = t_read_file(shard, &n);
    size_t nf;
    unsigned char *fixture = t_read_file(t_source_path("tests/fixtures/ckpt_tp_shard.fitlm"), &nf);
    t_check(fixture && nf == n && !memcmp(img, fixture, n),
            "a strided shard file is written as tests/fixtures/ckpt_tp_shard.fitlm records");
    free(fixture);
    free(img);
    t_mutations("strided shard file", shard, 3000, 4242, fl_ckpt_parse);
}

// A 768 x 3072 row-parallel weight written by t = 2 read by t = 4: each
// rank reads the one piece that holds its columns, once (each piece a
// million and more elements: runs cross the reader's blocks).
static void test_tensor_parallel_large(void) {
    enum { OUT = 768, IN = 3072 };
    size_t total = (size_t)OUT * IN, half = total / 2;
    float *w = malloc(total * sizeof *w), *slice = malloc(half * 2 * sizeof *w);
    float *got = malloc(total * sizeof *w), *want = malloc(total / 4 * sizeof *w);
    t_fill(w, total, 11, 1.0f);
    rank_pieces ranks[2];
    for (int r = 0; r < 2; r++) {
        gather(slice + r * half, w, 4, (size_t)r * IN / 2, IN / 2, IN, half);
        ranks[r].n = 1;
        ranks[r].p[0] = (fl_ckpt_piece){.name = "h.0.mlp.c_proj.weight",
                                        .dtype = FL_F32,
                                        .data = slice + r * half,
                                        .numel = half,
                                        .first = (size_t)r * IN / 2,
                                        .total = total,
                                        .run = IN / 2,
                                        .stride = IN};
    }
    char ck[512];
    snprintf(ck, sizeof ck, "%s/tp_large", dir);
    write_ranks(ck, ranks, 2);
    fl_ckpt *c = fl_ckpt_open(ck);
    int ok = 1;
    double t0 = now_s();
    for (int r = 0; r < 4; r++) {
        fl_ckpt_read_runs(c, "h.0.mlp.c_proj.weight", FL_F32, got, (size_t)r * IN / 4, IN / 4, IN,
                          total / 4);
        gather(want, w, 4, (size_t)r * IN / 4, IN / 4, IN, total / 4);
        ok &= !memcmp(got, want, total / 4 * sizeof *w);
    }
    double t1 = now_s();
    fl_ckpt_read(c, "h.0.mlp.c_proj.weight", FL_F32, got, total);
    ok &= !memcmp(got, w, total * sizeof *w);
    fl_ckpt_close(c);
    t_check(ok, "a 768 x 3072 weight saved at t = 2 reads back at t = 4 and whole, bitwise");
    printf("  768 x 3072 fp32 weight, 2 strided pieces: 4 t = 4 slices read in %.1f ms\n",
           1e3 * (t1 - t0));
    free(w);
    free(slice);
    free(got);
    free(want);
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
    test_tensor_parallel();
    test_tensor_parallel_large();
    if (t_remove_dir(dir) != 0) return 1;
    return t_report();
}
