// test_data.c: token shards and the loader: shards round-trip in both token
// widths, damaged shards are refused naming the file and byte offset, every
// epoch visits each window once, ranks get disjoint windows, and a saved
// loader position continues exactly where it stopped.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/data.h"
#include "fitlm/io.h"
#include "testlib.h"

static char dir[] = "/tmp/fitlm_test_data_XXXXXX";

static void path_of(char *out, size_t size, const char *name) {
    snprintf(out, size, "%s/%s", dir, name);
}

static void open_shard(void *path) {
    fl_shard s;
    fl_shard_open(&s, path);
}

static void test_crc(void) {
    t_check(fl_crc32(0, "123456789", 9) == 0xcbf43926u, "CRC-32 check value (zlib's)");
    unsigned char buf[1000];
    for (int i = 0; i < 1000; i++) buf[i] = (unsigned char)(i * 31 + 7);
    uint32_t whole = fl_crc32(0, buf, 1000),
             parts = fl_crc32(fl_crc32(0, buf, 333), buf + 333, 667);
    t_check(whole == parts, "CRC-32 continues across calls at any split");
}

static void test_shards(void) {
    enum { N = 1000 };
    int32_t tokens[N];
    for (int i = 0; i < N; i++) tokens[i] = (i * 7919) % 50257;
    char p16[512], p32[512];
    path_of(p16, sizeof p16, "a_000000.bin");
    path_of(p32, sizeof p32, "wide.bin");
    fl_shard_write(p16, "gpt2", 50257, tokens, N, 4321);
    fl_shard_write(p32, "big", 70000, tokens, N, 1);
    fl_shard s;
    fl_shard_open(&s, p16);
    int same = s.n_tokens == N && s.width == 2 && s.vocab_size == 50257 && s.source_bytes == 4321 &&
               !strcmp(s.tokenizer, "gpt2");
    for (int i = 0; i < N; i++) same &= fl_shard_token(&s, (uint64_t)i) == (uint32_t)tokens[i];
    t_check(same, "a uint16 shard round-trips header and tokens");
    fl_shard_close(&s);
    fl_shard_open(&s, p32);
    same = s.width == 4 && s.vocab_size == 70000;
    for (int i = 0; i < N; i++) same &= fl_shard_token(&s, (uint64_t)i) == (uint32_t)tokens[i];
    t_check(same, "a vocabulary over 65536 gets uint32 tokens");
    fl_shard_close(&s);

    size_t n;
    unsigned char *good = t_read_file(p16, &n), *bad;
    bad = malloc(n);
    char p[512];
    path_of(p, sizeof p, "bad.bin");
    const struct {
        const char *name;
        size_t offset;
        unsigned char xor ;
        size_t len;
        const char *expect;
    } cases[] = {
        {"bad magic", 0, 0x20, 0, "bad.bin is not a fitlm token shard (bad magic at byte offset 0"},
        {"header flip", 13, 0x01, 0, "bad.bin: the header (bytes 0-59) is corrupt"},
        {"data flip", 500, 0x04, 0, "bad.bin: the token data (byte offset 64 on) is corrupt"},
        {"truncated", 0, 0, n - 3, "bad.bin is truncated or too long"},
        {"shorter than a header", 0, 0, 30, "bad.bin is truncated: 30 bytes"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        memcpy(bad, good, n);
        bad[cases[i].offset] ^= cases[i].xor ;
        t_write_file(p, bad, cases[i].len ? cases[i].len : n);
        t_dies(cases[i].name, open_shard, p, cases[i].expect);
    }
    t_dies("missing", open_shard, "/nonexistent/x.bin",
           "cannot open token shard /nonexistent/x.bin");

    // A token past the vocabulary, with every checksum valid: named by offset.
    fl_shard_write(p, "gpt2", 50257, tokens, N, 1);
    free(good);
    good = t_read_file(p, &n);
    good[64 + 2 * 10] = 0xff, good[64 + 2 * 10 + 1] = 0xff; // token 10 = 65535
    uint32_t crc = fl_crc32(0, good + 64, n - 64);
    for (int k = 0; k < 4; k++) good[20 + k] = (unsigned char)(crc >> (8 * k));
    crc = fl_crc32(0, good, 60);
    for (int k = 0; k < 4; k++) good[60 + k] = (unsigned char)(crc >> (8 * k));
    t_write_file(p, good, n);
    t_dies("token past the vocabulary", open_shard, p,
           "token 65535 at byte offset 84 is not below the vocabulary size 50257");
    free(good);
    free(bad);
}

// A vocabulary field past 2^30 (here with a valid header CRC) is refused
// before any int holds it.
static void test_shard_vocab_range(void) {
    int32_t tokens[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    char p[512];
    path_of(p, sizeof p, "vocab.bin");
    fl_shard_write(p, "big", 70000, tokens, 8, 8);
    size_t n;
    unsigned char *good = t_read_file(p, &n);
    const uint32_t vocab[] = {0xffffffffu, 0x80000000u, (1u << 30) + 1};
    for (size_t i = 0; i < sizeof vocab / sizeof vocab[0]; i++) {
        fl_put_u32(good + 12, vocab[i]);
        fl_put_u32(good + 60, fl_crc32(0, good, 60));
        t_write_file(p, good, n);
        char expect[128];
        snprintf(expect, sizeof expect, "vocab.bin: vocabulary size %u (byte offset 12)", vocab[i]);
        t_dies(expect, open_shard, p, expect);
    }
    free(good);
}

// Shards d/train_00000k.bin of the given lengths; token i of shard k is
// k*1000 + i, so a window tells where it came from.
static void make_dataset(const char *name, const int *lengths, int n) {
    char d[512], p[600];
    path_of(d, sizeof d, name);
    char cmd[700];
    snprintf(cmd, sizeof cmd, "mkdir -p %s", d);
    if (system(cmd) != 0) return;
    for (int k = 0; k < n; k++) {
        int32_t *tok = malloc((size_t)lengths[k] * sizeof(int32_t));
        for (int i = 0; i < lengths[k]; i++) tok[i] = k * 1000 + i;
        snprintf(p, sizeof p, "%s/train_%06d.bin", d, k);
        fl_shard_write(p, "byte", 5000, tok, (uint64_t)lengths[k], (uint64_t)lengths[k]);
        free(tok);
    }
}

static void open_loader(void *pattern) {
    fl_loader l;
    fl_loader_open(&l, pattern, "train", 8, 1, 1, 0, 1);
}

static void test_loader(void) {
    const int lengths[] = {100, 9, 57}; // windows of T=8: 12, 1, 7 = 20
    make_dataset("ds", lengths, 3);
    char d[512];
    path_of(d, sizeof d, "ds");
    const int T = 8;
    fl_loader l;
    fl_loader_open(&l, d, "train", T, 42, 1, 0, 1);
    t_check(l.n_shards == 3 && l.n_windows == 20 && l.n_tokens == 166,
            "three shards, 20 windows of 8+1 tokens (got %llu)", (unsigned long long)l.n_windows);
    int in[20 * 8], tg[20 * 8];
    int consistent = 1, seen[3][16] = {{0}};
    for (int epoch = 0; epoch < 2; epoch++) {
        fl_loader_next(&l, in, tg, 20);
        for (int b = 0; b < 20; b++) {
            int shard = in[b * T] / 1000, start = in[b * T] % 1000;
            consistent &= start % T == 0;
            for (int t = 0; t < T; t++)
                consistent &=
                    in[b * T + t] == shard * 1000 + start + t && tg[b * T + t] == in[b * T + t] + 1;
            seen[shard][start / T] += 1;
        }
    }
    t_check(consistent, "windows are aligned and targets are the inputs shifted by one");
    int once = 1;
    for (int k = 0; k < 3; k++)
        for (int w = 0; w < 16; w++) {
            int exists = (uint64_t)w < l.first_window[k + 1] - l.first_window[k];
            once &= seen[k][w] == (exists ? 2 : 0);
        }
    t_check(once, "two epochs visit every window exactly twice");
    t_check(l.state.epoch == 1 && l.state.index == 20, "the position counts epochs and windows");
    fl_loader_close(&l);

    // Order differs between epochs and seeds; no shuffle keeps file order.
    fl_loader a, b;
    fl_loader_open(&a, d, "train", T, 42, 1, 0, 1);
    fl_loader_open(&b, d, "train", T, 43, 1, 0, 1);
    int ea[20 * 8], eb[20 * 8], e2[20 * 8];
    fl_loader_next(&a, ea, tg, 20);
    fl_loader_next(&a, e2, tg, 20);
    fl_loader_next(&b, eb, tg, 20);
    t_check(memcmp(ea, eb, sizeof ea) != 0 && memcmp(ea, e2, sizeof ea) != 0,
            "another seed or another epoch gives another order");
    fl_loader_close(&b);
    fl_loader_open(&b, d, "train", T, 42, 0, 0, 1);
    fl_loader_next(&b, eb, tg, 3);
    t_check(eb[0] == 0 && eb[T] == 8 && eb[2 * T] == 16, "without shuffle, windows come in order");
    fl_loader_close(&b);

    // Saved position: a copy of the state continues identically.
    fl_loader_state saved = a.state;
    fl_loader_next(&a, ea, tg, 13);
    fl_loader_open(&b, d, "train", T, 7, 1, 0, 1); // another seed: the state decides
    b.state = saved;
    fl_loader_next(&b, eb, tg, 13);
    t_check(memcmp(ea, eb, 13 * T * sizeof(int)) == 0,
            "a restored position continues exactly, across an epoch boundary");
    fl_loader_close(&a);
    fl_loader_close(&b);

    // Ranks: disjoint windows whose union is (almost) everything.
    for (int world = 2; world <= 4; world++) {
        int count[3][16] = {{0}}, total = 0;
        for (int r = 0; r < world; r++) {
            fl_loader_open(&a, d, "train", T, 42, 1, r, world);
            int per = (int)a.per_rank;
            fl_loader_next(&a, ea, tg, per);
            for (int k = 0; k < per; k++) count[ea[k * T] / 1000][(ea[k * T] % 1000) / T]++;
            total += per;
            fl_loader_close(&a);
        }
        int disjoint = 1;
        for (int k = 0; k < 3; k++)
            for (int w = 0; w < 16; w++) disjoint &= count[k][w] <= 1;
        t_check(disjoint && total == 20 / world * world,
                "%d ranks take disjoint windows, %d in all", world, total);
    }

    // Evaluation batches are fixed, spread, and leave the position alone.
    fl_loader_open(&a, d, "train", T, 42, 1, 0, 1);
    fl_loader_eval_batch(&a, 1, 2, ea, tg, 5);
    fl_loader_eval_batch(&a, 1, 2, eb, tg, 5);
    t_check(memcmp(ea, eb, 5 * T * sizeof(int)) == 0 && a.state.index == 0,
            "evaluation batches repeat and do not move the loader");
    double h = fl_loader_unigram_xent(&a, &a);
    t_check(h > 4.0 && h < 9.0, "unigram cross-entropy is plausible (%g nats)", h);
    fl_loader_close(&a);

    t_dies("no shards", open_loader, "/nonexistent/dir",
           "no train token shards at /nonexistent/dir");
    int32_t other[20] = {0};
    char p[600];
    path_of(p, sizeof p, "short.bin");
    fl_shard_write(p, "byte", 257, other, 8, 8);
    t_dies("too short", open_loader, p, "holds 0 windows of 8+1 tokens: too few for 1 rank");
    char q[600];
    path_of(q, sizeof q, "ds/train_000009.bin");
    fl_shard_write(q, "gpt2", 50257, other, 20, 20);
    t_dies("mixed tokenizers", open_loader, d, "does not match");
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    test_crc();
    test_shards();
    test_shard_vocab_range();
    test_loader();
    if (t_remove_dir(dir) != 0) return 1;
    return t_report();
}
