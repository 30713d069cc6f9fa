// test_tokenizer.c: the GPT-2 tokenizer gives exactly the ids of OpenAI's
// encoder.py (tests/fixtures/gpt2_tokens.json, written by
// scripts/make_tokenizer_fixture.py), decoding gives back any input byte for
// byte, threads encoding at once agree, and bad files are refused by name.
// Needs data/gpt2 and the Brown texts (scripts/setup.sh).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <omp.h>
#include <cjson/cJSON.h>

#include "fitlm/core.h"
#include "fitlm/tokenizer.h"
#include "testlib.h"

static char dir[] = "/tmp/fitlm_test_tokenizer_XXXXXX";
static char gpt2_dir[4096];

// Decodes ids and compares with the input; returns 1 when they match.
static int decodes_to(const fl_tokenizer *tok, const fl_tokens *t, const uint8_t *text, size_t n) {
    size_t at = 0;
    for (size_t i = 0; i < t->n; i++) {
        size_t len;
        const uint8_t *b = fl_tokenizer_token_bytes(tok, t->ids[i], &len);
        if (at + len > n || memcmp(text + at, b, len) != 0) return 0;
        at += len;
    }
    return at == n;
}

// ----------------------------------------------------------------------------
// error paths (before any OpenMP region: t_dies forks)

static void load_gpt2_from(void *d) {
    fl_tokenizer_load("gpt2", d);
}
static void load_named(void *name) {
    fl_tokenizer_load(name, gpt2_dir);
}
static void bad_id(void *tok) {
    size_t len;
    fl_tokenizer_token_bytes(tok, 257, &len);
}

static void test_errors(void) {
    char enc[4200], vocab[4200], real[4200];
    snprintf(enc, sizeof enc, "%s/encoder.json", dir);
    snprintf(vocab, sizeof vocab, "%s/vocab.bpe", dir);
    t_dies("unknown tokenizer", load_named, "gpt3", "unknown tokenizer \"gpt3\"");
    t_dies("missing encoder.json", load_gpt2_from, "/nonexistent",
           "cannot open tokenizer file /nonexistent/encoder.json");
    t_write_text(enc, "{\"a\": 0, \"b\": 1");
    t_dies("truncated encoder.json", load_gpt2_from, dir, "encoder.json is not valid JSON");
    t_write_text(enc, "[1, 2]");
    t_dies("encoder.json not an object", load_gpt2_from, dir, "expected a JSON object");
    t_write_text(enc, "{\"a\": 0, \"b\": \"one\"}");
    t_dies("string id", load_gpt2_from, dir, "key \"b\": the id must be an integer in 0..1");
    t_write_text(enc, "{\"a\": 0, \"b\": 2}");
    t_dies("id out of range", load_gpt2_from, dir, "key \"b\": the id must be an integer");
    t_write_text(enc, "{\"a\": 0, \"b\": 0}");
    t_dies("id used twice", load_gpt2_from, dir, "id 0 is used twice");
    t_write_text(enc, "{\"a\": 0, \"b c\": 1}"); // a space is written as U+0120
    t_dies("outside the byte alphabet", load_gpt2_from, dir, "key \"b c\" is not a token");
    t_write_text(enc, "{\"a\": 0, \"b\": 1}");
    t_dies("no byte tokens", load_gpt2_from, dir, "has no token for byte 0x00");

    // the real encoder.json with a damaged vocab.bpe
    uint8_t *json;
    snprintf(real, sizeof real, "%s/encoder.json", gpt2_dir);
    size_t n;
    json = t_read_file(real, &n);
    json[n] = 0;
    t_write_text(enc, (char *)json);
    free(json);
    t_dies("missing vocab.bpe", load_gpt2_from, dir, "vocab.bpe: No such file");
    t_write_text(vocab, "\xc4\xa0 t\n");
    t_dies("no header", load_gpt2_from, dir, "vocab.bpe line 1: expected the \"#version\"");
    t_write_text(vocab, "#version: 0.2\n\xc4\xa0 t\nheh\n");
    t_dies("one token", load_gpt2_from, dir, "vocab.bpe line 3: expected two tokens");
    t_write_text(vocab, "#version: 0.2\n\xc4\xa0  t\n");
    t_dies("two spaces", load_gpt2_from, dir, "vocab.bpe line 2: expected two tokens");
    t_write_text(vocab, "#version: 0.2\r\n\xc4\xa0 t\r\n");
    t_dies("CRLF", load_gpt2_from, dir, "vocab.bpe line 2: a character outside");
    t_write_text(vocab, "#version: 0.2\nqqqqqqqq zzzzzzzzz\n");
    t_dies("unknown token", load_gpt2_from, dir, "line 2: the merge \"qqqqqqqq zzzzzzzzz\"");

    fl_tokenizer *tok = fl_tokenizer_load("byte", NULL);
    t_dies("token id out of range", bad_id, tok, "token id 257 is out of range");
    fl_tokenizer_free(tok);
}

// ----------------------------------------------------------------------------

static void test_byte(void) {
    fl_tokenizer *tok = fl_tokenizer_load("byte", NULL);
    t_check(!strcmp(fl_tokenizer_name(tok), "byte") && fl_tokenizer_vocab_size(tok) == 257 &&
                fl_tokenizer_eot(tok) == 256,
            "byte tokenizer: vocabulary 257, <|endoftext|> = 256");
    const uint8_t text[] = "h\xc3\xa9\xff\0!";
    fl_tokens t = {0};
    fl_tokenizer_encode(tok, text, sizeof text - 1, &t);
    int ok = t.n == sizeof text - 1;
    for (size_t i = 0; ok && i < t.n; i++) ok = t.ids[i] == text[i];
    t_check(ok && decodes_to(tok, &t, text, t.n), "byte tokenizer: a token is a byte");
    size_t len;
    const uint8_t *eot = fl_tokenizer_token_bytes(tok, 256, &len);
    t_check(len == 13 && !memcmp(eot, "<|endoftext|>", 13), "byte tokenizer: eot's bytes");
    fl_tokens_free(&t);
    fl_tokenizer_free(tok);
}

static int hex_value(char c) {
    return c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10;
}

static void test_fixture(const fl_tokenizer *tok) {
    uint8_t *json;
    size_t n;
    json = t_read_file(t_source_path("tests/fixtures/gpt2_tokens.json"), &n);
    cJSON *root = cJSON_ParseWithLength((char *)json, n);
    if (!t_check(cJSON_IsArray(root) && cJSON_GetArraySize(root) > 200, "the fixture parses"))
        return;
    int bad_ids = 0, bad_bytes = 0, count = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, root) {
        const char *hex = cJSON_GetObjectItem(e, "hex")->valuestring;
        const cJSON *want = cJSON_GetObjectItem(e, "ids");
        size_t len = strlen(hex) / 2;
        uint8_t *text = malloc(len + 1);
        for (size_t i = 0; i < len; i++)
            text[i] = (uint8_t)(hex_value(hex[2 * i]) << 4 | hex_value(hex[2 * i + 1]));
        fl_tokens t = {0};
        fl_tokenizer_encode(tok, text, len, &t);
        int same = (int)t.n == cJSON_GetArraySize(want);
        for (size_t i = 0; same && i < t.n; i++)
            same = t.ids[i] == cJSON_GetArrayItem(want, (int)i)->valueint;
        if (!same && bad_ids++ < 5) {
            printf("  mismatch for hex %s: got", hex);
            for (size_t i = 0; i < t.n; i++) printf(" %d", t.ids[i]);
            printf("\n");
        }
        bad_bytes += !decodes_to(tok, &t, text, len);
        count++;
        fl_tokens_free(&t);
        free(text);
    }
    t_check(bad_ids == 0, "%d fixture strings encode to encoder.py's ids (%d differ)", count,
            bad_ids);
    t_check(bad_bytes == 0, "%d fixture strings decode to their bytes (%d differ)", count,
            bad_bytes);
    cJSON_Delete(root);
    free(json);
}

// Round trip and thread agreement over the Brown texts.
static void test_corpus(const fl_tokenizer *tok) {
    uint8_t *train;
    size_t n_train;
    train = t_read_file(t_source_path("data/brown.txt"), &n_train);
    size_t n_val = n_train / 10; // the last tenth, encoded again on its own
    uint8_t *val = train + n_train - n_val;
    fl_tokens t = {0}, v = {0};
    double t0 = fl_now();
    fl_tokenizer_encode(tok, train, n_train, &t);
    double secs = fl_now() - t0;
    printf("  brown.txt: %zu bytes -> %zu tokens (%.2f bytes/token), %.1f MB/s\n", n_train, t.n,
           (double)n_train / t.n, n_train / secs / 1e6);
    t_check(decodes_to(tok, &t, train, n_train), "brown.txt decodes back byte for byte");
    fl_tokenizer_encode(tok, val, n_val, &v);
    t_check(decodes_to(tok, &v, val, n_val), "its last tenth decodes back byte for byte");
    size_t n_first = t.n;
    fl_tokenizer_encode(tok, val, n_val, &t);
    t_check(t.n == n_first + v.n && !memcmp(t.ids + n_first, v.ids, v.n * sizeof *v.ids),
            "encode appends to the tokens it is given");

    // both threads encode the whole training text at once
    fl_tokens mine[2] = {{0}, {0}};
#pragma omp parallel num_threads(2)
    { fl_tokenizer_encode(tok, train, n_train, &mine[omp_get_thread_num()]); }
    int agree = 1;
    for (int k = 0; k < 2; k++)
        agree &= mine[k].n == n_first && !memcmp(mine[k].ids, t.ids, n_first * sizeof *t.ids);
    t_check(agree, "two threads encoding at once get the single-thread ids");
    fl_tokens_free(&mine[0]);
    fl_tokens_free(&mine[1]);
    fl_tokens_free(&v);
    fl_tokens_free(&t);
    free(train);
}

// Random byte strings: uniform bytes, and mixes of the pre-tokenizer's
// corner cases (spaces of all kinds, contractions, invalid UTF-8).
static void test_random(const fl_tokenizer *tok) {
    static const char *pool[] = {"a",
                                 "Zq",
                                 " ",
                                 "   ",
                                 "\t",
                                 "\n",
                                 "\r\n",
                                 "'",
                                 "'s",
                                 "'ll",
                                 "7",
                                 "1,0",
                                 ".",
                                 "!?",
                                 "\xc3\xa9",
                                 "\xce\xb1",
                                 "\xe4\xb8\x96",
                                 "\xcc\x81",
                                 "\xf0\x9f\x98\x80",
                                 "\x80",
                                 "\xff",
                                 "\xe2\x82",
                                 "\xc2\xa0",
                                 "\xe3\x80\x80",
                                 "\x1c",
                                 "\xe2\x80\x8b"};
    fl_rng rng;
    fl_rng_seed(&rng, 2024);
    uint8_t buf[4096];
    int bad = 0, strings = 0;
    for (int s = 0; s < 2000; s++, strings++) {
        size_t n = 0;
        if (s % 2) {
            n = fl_rng_below(&rng, 1024);
            for (size_t i = 0; i < n; i++) buf[i] = (uint8_t)fl_rng_u64(&rng);
        } else {
            for (int k = (int)fl_rng_below(&rng, 200); k > 0; k--) {
                const char *p = pool[fl_rng_below(&rng, sizeof pool / sizeof pool[0])];
                memcpy(buf + n, p, strlen(p));
                n += strlen(p);
            }
        }
        fl_tokens t = {0};
        fl_tokenizer_encode(tok, buf, n, &t);
        bad += !decodes_to(tok, &t, buf, n);
        fl_tokens_free(&t);
    }
    t_check(bad == 0, "%d random byte strings decode back (%d differ)", strings, bad);
}

// Random words, more distinct ones than the per-call cache holds (it grows,
// then starts afresh): encoding the whole text at once gives the same ids as
// encoding it line by line, each line with a cold cache.
static void test_cache_limit(const fl_tokenizer *tok) {
    enum { WORDS = 300000 };
    uint8_t *text = malloc((size_t)WORDS * 8);
    size_t n = 0;
    fl_rng rng;
    fl_rng_seed(&rng, 99);
    for (int w = 0; w < WORDS; w++) {
        for (int k = 3 + (int)fl_rng_below(&rng, 4); k > 0; k--)
            text[n++] = (uint8_t)('a' + fl_rng_below(&rng, 26));
        text[n++] = w % 10 == 9 ? '\n' : ' ';
    }
    fl_tokens whole = {0}, lines = {0};
    fl_tokenizer_encode(tok, text, n, &whole);
    for (size_t i = 0, j; i < n; i = j) {
        for (j = i; text[j] != '\n'; j++) continue;
        fl_tokenizer_encode(tok, text + i, ++j - i, &lines);
    }
    t_check(whole.n == lines.n && !memcmp(whole.ids, lines.ids, whole.n * sizeof *whole.ids) &&
                decodes_to(tok, &whole, text, n),
            "%d random words: the same ids at once and line by line", WORDS);
    fl_tokens_free(&whole);
    fl_tokens_free(&lines);
    free(text);
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    snprintf(gpt2_dir, sizeof gpt2_dir, "%s", t_source_path("data/gpt2"));
    test_errors();
    test_byte();
    fl_tokenizer *tok = fl_tokenizer_load("gpt2", gpt2_dir);
    t_check(!strcmp(fl_tokenizer_name(tok), "gpt2") && fl_tokenizer_vocab_size(tok) == 50257 &&
                fl_tokenizer_eot(tok) == 50256,
            "gpt2 tokenizer: vocabulary 50257, <|endoftext|> = 50256");
    size_t len;
    const uint8_t *b = fl_tokenizer_token_bytes(tok, 50256, &len);
    t_check(len == 13 && !memcmp(b, "<|endoftext|>", 13), "gpt2: eot's bytes");
    test_fixture(tok);
    test_random(tok);
    test_cache_limit(tok);
    test_corpus(tok);
    fl_tokenizer_free(tok);
    if (t_remove_dir(dir) != 0) return 1;
    return t_report();
}
