// test_io.c: text data and checkpoints: round trips are exact, and damaged
// or malformed files are refused with a message naming the file.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fitlm/io.h"
#include "testlib.h"

static char dir[] = "/tmp/fitlm_test_io_XXXXXX";

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    fwrite(data, 1, n, f);
    fclose(f);
}

static size_t read_bytes(const char *path, unsigned char **out) {
    FILE *f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    size_t n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    *out = malloc(n);
    if (fread(*out, 1, n, f) != n) n = 0;
    fclose(f);
    return n;
}

static void load_text(void *path) {
    fl_text t;
    fl_text_load(&t, path);
}

static void test_text(void) {
    char path[512];
    snprintf(path, sizeof path, "%s/t.txt", dir);
    const char *s = "Hello, w\xc3\xb6rld! \xe2\x82\xac and \xf0\x9f\x98\x80.\n";
    write_bytes(path, s, strlen(s));
    fl_text t;
    fl_text_load(&t, path);
    t_check(t.n == strlen(s) && memcmp(t.bytes, s, t.n) == 0, "text loads byte for byte");
    int in[2 * 4], tg[2 * 4];
    fl_rng rng;
    fl_rng_seed(&rng, 7);
    fl_text_random_batch(&t, &rng, in, tg, 2, 4);
    int shifted = 1;
    for (int b = 0; b < 2; b++)
        for (int i = 0; i < 3; i++) shifted &= tg[b * 4 + i] == in[b * 4 + i + 1];
    t_check(shifted, "targets are the inputs shifted by one");
    int e1[2 * 4], e2[2 * 4], et[2 * 4];
    fl_text_eval_batch(&t, 1, 3, e1, et, 2, 4);
    fl_text_eval_batch(&t, 1, 3, e2, et, 2, 4);
    t_check(memcmp(e1, e2, sizeof e1) == 0, "evaluation batches are fixed");
    fl_text_eval_batch(&t, 2, 3, e1, et, 2, 4);
    t_check(e1[4] == (unsigned char)s[t.n - 5] && et[7] == '\n',
            "the last evaluation window ends at the end of the text");
    double h = fl_text_unigram_xent(&t, &t);
    t_check(h > 2.0 && h < 5.6, "unigram cross-entropy is plausible (%g nats)", h);
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
        write_bytes(path, bad[i].bytes, strlen(bad[i].bytes));
        t_dies(bad[i].name, load_text, path, bad[i].expect);
    }
}

static void load_ckpt(void *ckpt_dir) {
    fl_gpt2 m;
    char tok[32];
    int step;
    fl_ckpt_load(ckpt_dir, &m, FL_F32, tok, sizeof tok, &step);
}

static void test_checkpoint(void) {
    fl_gpt2_config cfg = {
        .max_seq_len = 16, .vocab_size = 70, .n_layer = 2, .n_head = 2, .n_embd = 8};
    fl_gpt2 a, b;
    fl_gpt2_init(&a, &cfg, FL_F32, 3);
    char ck[512], file[600];
    snprintf(ck, sizeof ck, "%s/ck", dir);
    fl_ckpt_save(ck, &a, a.params, "byte", 42);
    char tok[32];
    int step = 0;
    fl_ckpt_load(ck, &b, FL_F32, tok, sizeof tok, &step);
    t_check(step == 42 && !strcmp(tok, "byte"), "step and tokenizer round-trip");
    t_check(b.table.numel == a.table.numel && b.config.n_layer == 2 && b.config.n_embd == 8 &&
                b.config.vocab_size == 70 && b.config.padded_vocab_size == 128,
            "the model shape round-trips");
    t_check(memcmp(a.params, b.params, a.table.numel * sizeof(float)) == 0,
            "weights round-trip bit for bit");
    fl_gpt2_free(&b);
    fl_gpt2_free(&a);

    snprintf(file, sizeof file, "%s/model.ckpt", ck);
    unsigned char *good;
    size_t n = read_bytes(file, &good);
    unsigned char *bad = malloc(n);
    // every damaged copy is refused, never loaded and never a crash
    memcpy(bad, good, n);
    bad[n / 2] ^= 0x10;
    write_bytes(file, bad, n);
    t_dies("flipped data byte", load_ckpt, ck, "CRC-32 mismatch");
    memcpy(bad, good, n);
    bad[30] ^= 0x01; // inside the JSON header
    write_bytes(file, bad, n);
    t_dies("flipped header byte", load_ckpt, ck, "model.ckpt");
    write_bytes(file, good, n - 7);
    t_dies("truncated", load_ckpt, ck, "truncated or corrupt");
    write_bytes(file, good, 10);
    t_dies("truncated to 10 bytes", load_ckpt, ck, "is truncated");
    memcpy(bad, good, n);
    bad[0] = 'X';
    write_bytes(file, bad, n);
    t_dies("bad magic", load_ckpt, ck, "not a fitlm checkpoint");
    memcpy(bad, good, n);
    bad[8] = 9;
    write_bytes(file, bad, n);
    t_dies("future version", load_ckpt, ck, "format version 9");
    memcpy(bad, good, n);
    bad[16] ^= 0x04; // data length
    write_bytes(file, bad, n);
    t_dies("wrong data length", load_ckpt, ck, "truncated or corrupt");
    t_dies("missing", load_ckpt, "/nonexistent", "cannot open checkpoint /nonexistent/model.ckpt");

    // A save over an existing checkpoint leaves no temporary file behind.
    write_bytes(file, good, n);
    fl_gpt2_init(&a, &cfg, FL_F32, 4);
    fl_ckpt_save(ck, &a, a.params, "byte", 43);
    fl_gpt2_free(&a);
    snprintf(file, sizeof file, "%s/model.ckpt.tmp", ck);
    t_check(access(file, F_OK) != 0, "no temporary file is left after a save");
    free(bad);
    free(good);
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    test_text();
    test_checkpoint();
    char cmd[256];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    if (system(cmd) != 0) return 1;
    return t_report();
}
