// test_tokenizer.c: the GPT-2 tokenizer gives exactly the ids of OpenAI's
// encoder.py (tests/fixtures/gpt2_tokens.json, written by
// scripts/make_tokenizer_fixture.py), decoding gives back any input byte for
// byte, threads encoding at once agree, and bad files are refused by name.
// The hf tokenizer gives the ids of llama-tokenizer-js and
// llama3-tokenizer-js (tests/fixtures/hf_tokenizer_*.json), the same ids as
// gpt2 from a tokenizer.json made of GPT-2's files, round trips, and refuses
// every part it does not support by name (small tokenizer.json files made
// here). A BPE learnt by fl_bpe_learn makes the merges worked out by hand on
// small texts and those of a plain learner that recounts every pair, and
// loads as a gpt2 tokenizer that round-trips. Needs data/gpt2, data/llama,
// data/llama3 and the Brown texts (scripts/setup.sh).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>
#include <omp.h>
#include <cjson/cJSON.h>

#include "fitlm/core.h"
#include "fitlm/tokenizer.h"
#include "testlib.h"

static char dir[] = "/tmp/fitlm_test_tokenizer_XXXXXX";
static char gpt2_dir[4096];

// The text with each maximal invalid UTF-8 subpart replaced by U+FFFD, as
// Python's bytes.decode('utf-8', 'replace') does (malloc'd, length in *m).
static uint8_t *replace_invalid(const uint8_t *s, size_t n, size_t *m) {
    uint8_t *out = malloc(3 * n + 1);
    *m = 0;
    for (size_t i = 0; i < n;) {
        uint8_t c = s[i];
        size_t len = c < 0x80                 ? 1
                     : c >= 0xc2 && c <= 0xdf ? 2
                     : c >= 0xe0 && c <= 0xef ? 3
                     : c >= 0xf0 && c <= 0xf4 ? 4
                                              : 0;
        size_t k = 1;
        for (; k < len && i + k < n; k++) {
            uint8_t lo = k > 1 ? 0x80 : c == 0xe0 ? 0xa0 : c == 0xf0 ? 0x90 : 0x80;
            uint8_t hi = k > 1 ? 0xbf : c == 0xed ? 0x9f : c == 0xf4 ? 0x8f : 0xbf;
            if (s[i + k] < lo || s[i + k] > hi) break;
        }
        if (len && k == len) {
            memcpy(out + *m, s + i, len);
            *m += len;
        } else {
            memcpy(out + *m, "\xef\xbf\xbd", 3);
            *m += 3;
        }
        i += len && k == len ? len : k;
    }
    return out;
}

// Decodes ids and compares with the input (hf: with invalid UTF-8
// replaced); returns 1 when they match.
static int decodes_to(const fl_tokenizer *tok, const fl_tokens *t, const uint8_t *text, size_t n) {
    size_t len, want_len = n;
    uint8_t *got = fl_tokenizer_decode(tok, t->ids, t->n, &len);
    uint8_t *want =
        strcmp(fl_tokenizer_name(tok), "hf") ? NULL : replace_invalid(text, n, &want_len);
    int same = len == want_len && !memcmp(got, want ? want : text, len);
    fl_free(got);
    free(want);
    return same;
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
    if (!t_check(json != NULL, "%s reads (scripts/setup.sh fetches it)", real)) return;
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

// A fixture case's input: its "hex" bytes (malloc'd, length in *len).
static uint8_t *case_text(const cJSON *e, size_t *len) {
    const char *hex = cJSON_GetObjectItem(e, "hex")->valuestring;
    *len = strlen(hex) / 2;
    uint8_t *text = malloc(*len + 1);
    for (size_t i = 0; i < *len; i++)
        text[i] = (uint8_t)(hex_value(hex[2 * i]) << 4 | hex_value(hex[2 * i + 1]));
    return text;
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
        const cJSON *want = cJSON_GetObjectItem(e, "ids");
        size_t len;
        uint8_t *text = case_text(e, &len);
        fl_tokens t = {0};
        fl_tokenizer_encode(tok, text, len, &t);
        int same = (int)t.n == cJSON_GetArraySize(want);
        for (size_t i = 0; same && i < t.n; i++)
            same = t.ids[i] == cJSON_GetArrayItem(want, (int)i)->valueint;
        if (!same && bad_ids++ < 5) {
            printf("  mismatch for hex %s: got", cJSON_GetObjectItem(e, "hex")->valuestring);
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

// ----------------------------------------------------------------------------
// hf: small tokenizer.json files

static char hf_file[4200];

// A SentencePiece-style tokenizer.json in LLaMA's layout, as a cJSON tree
// the tests edit: "ab" is one token, "c" has neither a token nor bytes.
static cJSON *spm_json(void) {
    return cJSON_Parse(
        "{\"added_tokens\": [{\"id\": 0, \"content\": \"<unk>\", \"special\": true},"
        " {\"id\": 1, \"content\": \"<s>\", \"special\": true},"
        " {\"id\": 2, \"content\": \"</s>\", \"special\": true}],"
        " \"normalizer\": {\"type\": \"Sequence\", \"normalizers\": ["
        "  {\"type\": \"Prepend\", \"prepend\": \"\u2581\"},"
        "  {\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": \"\u2581\"}]},"
        " \"pre_tokenizer\": null,"
        " \"post_processor\": {\"type\": \"TemplateProcessing\", \"single\": ["
        "  {\"SpecialToken\": {\"id\": \"<s>\", \"type_id\": 0}},"
        "  {\"Sequence\": {\"id\": \"A\", \"type_id\": 0}}],"
        "  \"special_tokens\": {\"<s>\": {\"id\": \"<s>\", \"ids\": [1], \"tokens\": [\"<s>\"]}}},"
        " \"decoder\": {\"type\": \"Sequence\", \"decoders\": ["
        "  {\"type\": \"Replace\", \"pattern\": {\"String\": \"\u2581\"}, \"content\": \" \"},"
        "  {\"type\": \"ByteFallback\"}, {\"type\": \"Fuse\"},"
        "  {\"type\": \"Strip\", \"content\": \" \", \"start\": 1, \"stop\": 0}]},"
        " \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": \"<unk>\","
        "  \"continuing_subword_prefix\": null, \"end_of_word_suffix\": null,"
        "  \"fuse_unk\": true, \"byte_fallback\": true,"
        "  \"vocab\": {\"<unk>\": 0, \"<s>\": 1, \"</s>\": 2, \"<0x0A>\": 3, \"<0xC3>\": 4,"
        "   \"<0xA9>\": 5, \"\u2581\": 6, \"a\": 7, \"b\": 8, \"\u2581a\": 9, \"ab\": 10,"
        "   \"\u2581ab\": 11},"
        "  \"merges\": [\"\u2581 a\", [\"a\", \"b\"], \"\u2581a b\"]}}");
}

// A byte-level tokenizer.json: GPT-2's 256 byte tokens, "ab" and " a".
static cJSON *byte_level_json(void) {
    cJSON *root = cJSON_Parse(
        "{\"added_tokens\": [{\"id\": 258, \"content\": \"<|endoftext|>\", \"special\": true}],"
        " \"normalizer\": null,"
        " \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false,"
        "  \"trim_offsets\": true, \"use_regex\": true},"
        " \"post_processor\": {\"type\": \"ByteLevel\", \"trim_offsets\": false},"
        " \"decoder\": {\"type\": \"ByteLevel\"},"
        " \"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": [\"a b\", \"\u0120 a\"]}}");
    cJSON *vocab = cJSON_GetObjectItem(cJSON_GetObjectItem(root, "model"), "vocab");
    int k = 0;
    for (int b = 0; b < 256; b++) {
        int printable = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
        int cp = printable ? b : 256 + k++;
        char key[4] = {(char)cp, 0};
        if (cp >= 0x80) {
            key[0] = (char)(0xc0 | cp >> 6);
            key[1] = (char)(0x80 | (cp & 0x3f));
            key[2] = 0;
        }
        cJSON_AddNumberToObject(vocab, key, b);
    }
    cJSON_AddNumberToObject(vocab, "ab", 256);
    cJSON_AddNumberToObject(vocab, "\u0120a", 257);
    return root;
}

// "@NUL@" in a string is written as \u0000 (cJSON cannot hold one).
static void write_json(const cJSON *root) {
    char *text = cJSON_PrintUnformatted(root);
    for (char *at; (at = strstr(text, "@NUL@"));) {
        size_t off = (size_t)(at - text), n = strlen(text);
        char *grown = realloc(text, n + 2);
        if (!grown) abort();
        text = grown;
        memmove(text + off + 6, text + off + 5, n - off - 4);
        memcpy(text + off, "\\u0000", 6);
    }
    t_write_text(hf_file, text);
    free(text);
}

// Replaces the value at a dotted path ("model.vocab") with JSON text.
static void set_json(cJSON *root, const char *path, const char *json) {
    char key[128];
    snprintf(key, sizeof key, "%s", path);
    cJSON *obj = root;
    char *dot;
    const char *name = key;
    while ((dot = strchr(name, '.'))) {
        *dot = 0;
        obj = cJSON_GetObjectItem(obj, name);
        name = dot + 1;
    }
    cJSON *value = cJSON_Parse(json);
    if (!value) {
        printf("bad test JSON: %s\n", json);
        exit(1);
    }
    if (cJSON_GetObjectItem(obj, name))
        cJSON_ReplaceItemInObject(obj, name, value);
    else
        cJSON_AddItemToObject(obj, name, value);
}

static void load_hf(void *path) {
    fl_tokenizer_load("hf", path);
}

// One edit of a small file, which must be refused with `expect`.
static void refused(int spm, const char *path, const char *json, const char *expect) {
    cJSON *root = spm ? spm_json() : byte_level_json();
    if (path) set_json(root, path, json);
    write_json(root);
    cJSON_Delete(root);
    char name[200];
    snprintf(name, sizeof name, "hf %s %s", path ? path : "", expect);
    t_dies(name, load_hf, dir, expect);
}

static void test_hf_errors(void) {
    t_dies("hf without a path", load_hf, NULL, "the hf tokenizer needs a path");
    t_dies("hf missing file", load_hf, "/nonexistent", "cannot open tokenizer file /nonexistent");
    t_write_text(hf_file, "{\"model\": ");
    t_dies("hf truncated JSON", load_hf, dir, "tokenizer.json is not valid JSON");
    refused(1, "model.type", "\"Unigram\"", "model: type \"Unigram\" is not supported");
    refused(1, "model.dropout", "0.1", "model.dropout is set");
    refused(1, "model.continuing_subword_prefix", "\"##\"", "continuing_subword_prefix is set");
    refused(1, "model.vocab", "{}", "model.vocab must be a non-empty object");
    refused(1, "model.merges", "null", "model.merges must be an array");
    refused(1, "model.merges", "[\"a\"]", "model.merges[0]: expected \"a b\"");
    refused(1, "model.merges", "[\"a q\"]", "model.merges[0]: \"a\" + \"q\" uses or makes");
    refused(1, "model.merges", "[\"<0x0A> a\"]", "merging <0xNN> byte tokens");
    refused(1, "model.vocab.b", "13", "not contiguous: id 8 is missing");
    refused(1, "model.vocab.b", "7", "model.vocab: id 7 is used twice");
    refused(1, "model.vocab.b", "\"8\"", "key \"b\": the id must be an integer in 0..14");
    refused(1, "added_tokens", "[{\"id\": 7, \"content\": \"zz\"}]", "id 7 is already the token");
    refused(1, "added_tokens", "[{\"id\": 2, \"content\": \"</s>\", \"lstrip\": true}]",
            "added_tokens[0].lstrip true is not supported");
    refused(1, "model.unk_token", "\"<nope>\"", "model.unk_token \"<nope>\" is not a token");
    // a NUL would cut a token, an added token or a name short: refused
    refused(1, "added_tokens", "[{\"id\": 15, \"content\": \"a@NUL@b\"}]",
            "\\u0000 (a NUL character) at line 1");
    refused(1, "added_tokens", "[{\"id\": 15, \"content\": \"@NUL@\"}]",
            ", in the value of \"content\", is not allowed");
    refused(1, "model.unk_token", "\"<unk>@NUL@\"", "in the value of \"unk_token\"");
    refused(1, "model.vocab.a@NUL@", "15", "(a NUL character) at line 1 (byte");
    refused(1, "normalizer", "{\"type\": \"Lowercase\"}",
            "normalizer: type \"Lowercase\" is not supported");
    refused(1, "normalizer", "{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"NFKC\"}]}",
            "normalizer.normalizers[0]: type \"NFKC\" is not supported");
    refused(1, "normalizer",
            "{\"type\": \"Replace\", \"pattern\": {\"Regex\": \" +\"}, \"content\": \"\u2581\"}",
            "normalizer.pattern: only {\"String\": \" \"}");
    refused(1, "normalizer", "{\"type\": \"Prepend\", \"prepend\": \"_\"}",
            "normalizer.prepend \"_\" is not supported");
    refused(1, "normalizer", "null", "a BPE model over characters needs either");
    refused(1, "normalizer", "{\"typo\": 1}", "normalizer.type must be a string");
    refused(1, "pre_tokenizer", "{\"type\": \"Whitespace\"}",
            "pre_tokenizer: type \"Whitespace\" is not supported");
    refused(1, "pre_tokenizer",
            "{\"type\": \"Split\", \"pattern\": {\"Regex\": \"\\\\w+\"}, \"behavior\": "
            "\"Isolated\", \"invert\": false}",
            "the regex \"\\w+\" is not supported");
    refused(1, "pre_tokenizer",
            "{\"type\": \"Metaspace\", \"replacement\": \"\u2581\", \"prepend_scheme\": "
            "\"first\"}",
            "pre_tokenizer.split must be false");
    refused(1, "post_processor", "{\"type\": \"BertProcessing\"}",
            "post_processor: type \"BertProcessing\" is not supported");
    refused(1, "post_processor",
            "{\"type\": \"TemplateProcessing\", \"single\": [{\"Sequence\": {\"id\": \"A\"}}, "
            "{\"SpecialToken\": {\"id\": \"</s>\"}}]}",
            "only \"$A\" and \"<special> $A\" are supported");
    refused(1, "decoder", "{\"type\": \"WordPiece\"}", "decoder: type \"WordPiece\" is not");
    refused(1, "added_tokens", "[{\"id\": 2, \"content\": \"</x>\"}]", "id 2 is already");
    refused(0, "pre_tokenizer",
            "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": "
            "{\"Regex\": \"'s|'t|'re|'ve|'m|'ll|'d| ?\\\\p{L}+| ?\\\\p{N}+| "
            "?[^\\\\s\\\\p{L}\\\\p{N}]+|\\\\s+(?!\\\\S)|\\\\s+\"}, \"behavior\": \"Removed\"}, "
            "{\"type\": \"ByteLevel\", \"use_regex\": false}]}",
            "pre_tokenizer.pretokenizers[0].behavior \"Removed\" is not supported");
    refused(0, "pre_tokenizer", "{\"type\": \"ByteLevel\", \"add_prefix_space\": true}",
            "add_prefix_space true is not supported");
    refused(0, "normalizer", "{\"type\": \"Prepend\", \"prepend\": \"\u2581\"}",
            "a ByteLevel pre-tokenizer with a Prepend");
    refused(0, "model.vocab.\u0120a", "3", "model.vocab: id 3 is used twice");
    refused(0, "model.vocab.a b", "259", "key \"a b\" is not a token in GPT-2's byte alphabet");
    refused(0, "added_tokens", "[{\"id\": 258, \"content\": \"<|x|>\"}]", "no end-of-text token");
    cJSON *root = byte_level_json();
    cJSON_DeleteItemFromObject(cJSON_GetObjectItem(root, "model"), "vocab");
    set_json(root, "model.vocab", "{\"a\": 0, \"b\": 1}");
    set_json(root, "model.merges", "[]");
    set_json(root, "added_tokens", "[{\"id\": 2, \"content\": \"<|endoftext|>\"}]");
    write_json(root);
    cJSON_Delete(root);
    t_dies("hf byte-level without byte tokens", load_hf, dir, "has no token for byte 0x00");
    // an eos_token beside the file that is not a token
    char cfg[4200];
    snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", dir);
    t_write_text(cfg, "{\"eos_token\": \"<nope>\"}");
    refused(1, NULL, NULL, "eos_token \"<nope>\" is not a token");
    remove(cfg);
}

// Encodes text and compares with the ids wanted; prints them when not.
static int encodes_to(const fl_tokenizer *tok, const char *text, const int32_t *want, size_t n) {
    fl_tokens t = {0};
    fl_tokenizer_encode(tok, (const uint8_t *)text, strlen(text), &t);
    int same = t.n == n && !memcmp(t.ids, want, n * sizeof *want);
    if (!same) {
        printf("  \"%s\":", text);
        for (size_t i = 0; i < t.n; i++) printf(" %d", t.ids[i]);
        printf("\n");
    }
    fl_tokens_free(&t);
    return same;
}

#define ENCODES(tok, text, ...)                                                                    \
    encodes_to(tok, text, (const int32_t[]){__VA_ARGS__},                                          \
               sizeof((const int32_t[]){__VA_ARGS__}) / sizeof(int32_t))

static fl_tokenizer *load_json(cJSON *root) {
    write_json(root);
    cJSON_Delete(root);
    return fl_tokenizer_load("hf", hf_file);
}

// The small files' tokens, worked out by hand from their merges.
static void test_hf_small(void) {
    fl_tokenizer *tok = load_json(spm_json());
    t_check(fl_tokenizer_vocab_size(tok) == 12 && fl_tokenizer_bos(tok) == 1 &&
                fl_tokenizer_eot(tok) == 2 && !strcmp(fl_tokenizer_name(tok), "hf"),
            "hf spm: vocabulary 12, <s> = 1 from the post-processor, </s> = 2");
    t_check(ENCODES(tok, "ab ab\n\xc3\xa9", 11, 11, 3, 4, 5),
            "hf spm: \"▁\" prepended, merges by rank, byte fallback");
    t_check(ENCODES(tok, " a", 6, 9), "hf spm: a leading space is a second \"▁\"");
    t_check(ENCODES(tok,
                    "a\xe2\x96\x81"
                    "b",
                    9, 6, 8),
            "hf spm: \"▁\" in the text is a space");
    t_check(ENCODES(tok, "cc a", 6, 0, 9), "hf spm: unknown characters fuse into one <unk>");
    t_check(ENCODES(tok, "a</s>b<s>", 9, 2, 6, 8, 1),
            "hf spm: added tokens are cut out first, each text normalised alone");
    fl_tokens empty = {0};
    fl_tokenizer_encode(tok, (const uint8_t *)"", 0, &empty);
    t_check(empty.n == 0, "hf spm: no tokens for an empty text (and no \"▁\")");
    fl_tokens_free(&empty);
    size_t len;
    uint8_t *text = fl_tokenizer_decode(tok, (const int32_t[]){1, 11, 6, 11, 3, 2}, 6, &len);
    t_check(len == 7 && !memcmp(text, "ab  ab\n", 7),
            "hf spm: decode drops special tokens and the leading space");
    fl_free(text);
    fl_tokenizer_free(tok);

    cJSON *root = spm_json();
    set_json(root, "model.byte_fallback", "false");
    set_json(root, "model.fuse_unk", "false");
    tok = load_json(root);
    t_check(ENCODES(tok, "cc\xc3\xa9", 6, 0, 0, 0), "hf spm: without byte fallback, <unk> each");
    fl_tokenizer_free(tok);

    root = spm_json();
    set_json(root, "normalizer",
             "{\"type\": \"Sequence\", \"normalizers\": [{\"type\": \"NFC\"},"
             "{\"type\": \"Prepend\", \"prepend\": \"\u2581\"},"
             "{\"type\": \"Replace\", \"pattern\": {\"String\": \" \"}, \"content\": "
             "\"\u2581\"}]}");
    tok = load_json(root);
    t_check(ENCODES(tok, "e\xcc\x81", 6, 4, 5), "hf spm: NFC composes e + U+0301 into U+00E9");
    fl_tokenizer_free(tok);

    const char *meta = "{\"type\": \"Metaspace\", \"replacement\": \"\u2581\", "
                       "\"prepend_scheme\": \"%s\", \"split\": false}";
    char json[200];
    static const char *const schemes[] = {"first", "always", "never"};
    for (int k = 0; k < 3; k++) {
        root = spm_json();
        set_json(root, "normalizer", "null");
        snprintf(json, sizeof json, meta, schemes[k]);
        set_json(root, "pre_tokenizer", json);
        tok = load_json(root);
        int ok = ENCODES(tok, " ab", 11);
        ok &= k == 0   ? ENCODES(tok, "ab</s>ab", 11, 2, 10)
              : k == 1 ? ENCODES(tok, "ab</s>ab", 11, 2, 11)
                       : ENCODES(tok, "ab</s>ab", 10, 2, 10);
        t_check(ok, "hf spm: Metaspace prepend_scheme %s", schemes[k]);
        fl_tokenizer_free(tok);
    }

    tok = load_json(byte_level_json());
    t_check(fl_tokenizer_vocab_size(tok) == 259 && fl_tokenizer_bos(tok) == -1 &&
                fl_tokenizer_eot(tok) == 258,
            "hf byte-level: vocabulary 259, no post-processor token, <|endoftext|> = 258");
    t_check(ENCODES(tok, "ab a<|endoftext|>a", 256, 257, 258, 'a'),
            "hf byte-level: GPT-2's pattern, merges, an added token");
    fl_tokenizer_free(tok);
    root = byte_level_json();
    set_json(root, "model.ignore_merges", "true");
    set_json(root, "model.vocab.aab", "259");
    set_json(root, "added_tokens",
             "[{\"id\": 258, \"content\": \"<|endoftext|>\"},"
             "{\"id\": 260, \"content\": \"<|endoftext|>x\"}]");
    tok = load_json(root);
    t_check(ENCODES(tok, "aab <|endoftext|>x<|endoftext|>", 259, ' ', 260, 258),
            "hf byte-level: ignore_merges takes a whole piece; the longest added token wins");
    fl_tokenizer_free(tok);
}

// ----------------------------------------------------------------------------
// hf: the real files

// The fixture's cases: [bos] + our ids = the reference's, and decoding gives
// back the text (invalid UTF-8 replaced).
static void test_hf_fixture(const fl_tokenizer *tok, const char *fixture) {
    size_t n;
    uint8_t *json = t_read_file(t_source_path(fixture), &n);
    cJSON *root = json ? cJSON_ParseWithLength((char *)json, n) : NULL;
    const cJSON *cases = cJSON_GetObjectItem(root, "cases");
    if (!t_check(cJSON_GetArraySize(cases) > 20, "%s parses", fixture)) return;
    int bad_ids = 0, bad_text = 0, count = 0;
    const cJSON *e;
    cJSON_ArrayForEach(e, cases) {
        const cJSON *want = cJSON_GetObjectItem(e, "ids");
        size_t len;
        uint8_t *text = case_text(e, &len);
        fl_tokens t = {0};
        fl_tokenizer_encode(tok, text, len, &t);
        int bos = fl_tokenizer_bos(tok) >= 0; // the reference's encode puts it first
        int same = (int)t.n + bos == cJSON_GetArraySize(want) &&
                   (!bos || cJSON_GetArrayItem(want, 0)->valueint == fl_tokenizer_bos(tok));
        for (size_t i = 0; same && i < t.n; i++)
            same = t.ids[i] == cJSON_GetArrayItem(want, (int)i + bos)->valueint;
        if (!same && bad_ids++ < 5) {
            printf("  %s: mismatch for \"%s\": got", fixture,
                   cJSON_GetObjectItem(e, "name")->valuestring);
            for (size_t i = 0; i < t.n && i < 40; i++) printf(" %d", t.ids[i]);
            printf("\n");
        }
        bad_text += !decodes_to(tok, &t, text, len);
        count++;
        fl_tokens_free(&t);
        free(text);
    }
    t_check(bad_ids == 0, "%s: %d strings encode to the reference's ids (%d differ)", fixture,
            count, bad_ids);
    t_check(bad_text == 0, "%s: %d strings decode to their text (%d differ)", fixture, count,
            bad_text);
    cJSON_Delete(root);
    free(json);
}

// GPT-2's encoder.json and vocab.bpe as a byte-level tokenizer.json: the
// same tokenizer through the same code, so the same ids on the corpus.
static void test_hf_gpt2(const fl_tokenizer *gpt2) {
    char path[4200];
    size_t n;
    snprintf(path, sizeof path, "%s/encoder.json", gpt2_dir);
    uint8_t *enc = t_read_file(path, &n);
    cJSON *root = byte_level_json();
    cJSON *model = cJSON_GetObjectItem(root, "model");
    cJSON_ReplaceItemInObject(model, "vocab", cJSON_ParseWithLength((char *)enc, n));
    set_json(root, "added_tokens", "[{\"id\": 50256, \"content\": \"<|endoftext|>\"}]");
    snprintf(path, sizeof path, "%s/vocab.bpe", gpt2_dir);
    uint8_t *bpe = t_read_file(path, &n);
    cJSON *merges = cJSON_CreateArray();
    for (char *line = strchr((char *)bpe, '\n') + 1, *eol; *line; line = eol + 1) {
        eol = strchr(line, '\n');
        *eol = 0;
        cJSON_AddItemToArray(merges, cJSON_CreateString(line));
    }
    cJSON_ReplaceItemInObject(model, "merges", merges);
    fl_tokenizer *tok = load_json(root);
    free(enc);
    free(bpe);
    uint8_t *text = t_read_file(t_source_path("data/brown.txt"), &n);
    fl_tokens a = {0}, b = {0};
    fl_tokenizer_encode(gpt2, text, n, &a);
    fl_tokenizer_encode(tok, text, n, &b);
    t_check(a.n == b.n && !memcmp(a.ids, b.ids, a.n * sizeof *a.ids),
            "GPT-2 as a tokenizer.json: the gpt2 tokenizer's ids on brown.txt");
    fl_tokens_free(&a);
    fl_tokens_free(&b);
    free(text);
    fl_tokenizer_free(tok);
}

// ----------------------------------------------------------------------------
// learning a BPE (fl_bpe_learn)

// The file's text (malloc'd), or NULL.
static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *s = malloc((size_t)n + 1);
    s[fread(s, 1, (size_t)n, f)] = 0;
    fclose(f);
    return s;
}

// Learns from one text into dir/sub; the merges file's lines after the header.
static char *learn_one(const char *text, int vocab, const char *sub, int *learnt) {
    char out[4200], path[4300];
    snprintf(out, sizeof out, "%s/%s", dir, sub);
    mkdir(out, 0755);
    const uint8_t *texts[1] = {(const uint8_t *)text};
    size_t lens[1] = {strlen(text)};
    *learnt = fl_bpe_learn(texts, lens, 1, vocab, out);
    snprintf(path, sizeof path, "%s/vocab.bpe", out);
    char *merges = slurp(path);
    char *body = merges ? strchr(merges, '\n') : NULL;
    char *copy = strdup(body ? body + 1 : "");
    free(merges);
    return copy;
}

// A plain learner to check the incremental one against: every pair counted
// again before each merge. Words over ' ', a, b, c as the pre-tokenizer cuts
// them (a leading space, then letters). Writes the merges as vocab.bpe has
// them (the space as "Ġ").
static void reference_learn(const char *text, int vocab, char *out, size_t cap) {
    enum { MAXW = 4096, MAXL = 16 };
    static int sym[MAXW][MAXL], len[MAXW];
    static char tok[1024][64];
    int n_words = 0, n_tok = 256;
    for (const char *p = text; *p;) {
        int l = 0;
        if (*p == ' ') sym[n_words][l++] = *p++;
        while (*p && *p != ' ') sym[n_words][l++] = (unsigned char)*p++;
        len[n_words++] = l;
    }
    for (int b = 0; b < 256; b++) tok[b][0] = (char)b, tok[b][1] = 0;
    size_t o = 0;
    out[0] = 0;
    while (n_tok < vocab - 1) {
        static int count[1024][1024];
        memset(count, 0, sizeof count);
        int best_a = -1, best_b = -1, best = 1;
        for (int w = 0; w < n_words; w++)
            for (int j = 0; j + 1 < len[w]; j++) count[sym[w][j]][sym[w][j + 1]]++;
        for (int a = 0; a < n_tok; a++)
            for (int b = 0; b < n_tok; b++)
                if (count[a][b] > best) best = count[a][b], best_a = a, best_b = b;
        if (best_a < 0) break;
        char made[64];
        snprintf(made, sizeof made, "%s%s", tok[best_a], tok[best_b]);
        int t = -1;
        for (int k = 0; k < n_tok; k++)
            if (!strcmp(tok[k], made)) t = k;
        if (t < 0) snprintf(tok[t = n_tok++], sizeof tok[0], "%s", made);
        for (int w = 0; w < n_words; w++) {
            int r = 0, k = 0;
            while (r < len[w])
                if (r + 1 < len[w] && sym[w][r] == best_a && sym[w][r + 1] == best_b)
                    sym[w][k++] = t, r += 2;
                else
                    sym[w][k++] = sym[w][r++];
            len[w] = k;
        }
        for (int side = 0; side < 2; side++) {
            const char *s = tok[side ? best_b : best_a];
            for (; *s; s++)
                o += (size_t)snprintf(out + o, cap - o, "%s",
                                      *s == ' ' ? "\xc4\xa0" : (char[2]){*s, 0});
            o += (size_t)snprintf(out + o, cap - o, side ? "\n" : " ");
        }
    }
}

static void test_learn(void) {
    printf("learning a BPE\n");
    int learnt;
    char *m = learn_one("ab ab ab abc", 300, "l1", &learnt);
    t_check(learnt == 259 && !strcmp(m, "a b\n\xc4\xa0 ab\n"),
            "ab ab ab abc: merges a+b then space+ab, then no pair occurs twice (vocab %d): %s",
            learnt, m);
    free(m);
    char path[4300];
    snprintf(path, sizeof path, "%s/l1", dir);
    fl_tokenizer *tok = fl_tokenizer_load("gpt2", path);
    fl_tokens t = {0};
    fl_tokenizer_encode(tok, (const uint8_t *)"ab ab abc", 9, &t);
    t_check(fl_tokenizer_vocab_size(tok) == 259 && fl_tokenizer_eot(tok) == 258 && t.n == 4 &&
                t.ids[0] == 256 && t.ids[1] == 257 && t.ids[2] == 257 && t.ids[3] == 'c',
            "the learnt files load as a gpt2 tokenizer: ab ab abc -> 256 257 257 99 (%zu ids)",
            t.n);
    fl_tokens_free(&t);
    fl_tokenizer_free(tok);
    m = learn_one("xy xy zw zw", 300, "l2", &learnt);
    t_check(learnt == 260 && !strcmp(m, "\xc4\xa0 z\nx y\n\xc4\xa0z w\n"),
            "equal counts merge the pair of lower ids first: %s", m);
    free(m);
    m = learn_one("ab ab ab abc", 258, "l3", &learnt);
    t_check(learnt == 258 && !strcmp(m, "a b\n"), "vocab 258: one merge (%d): %s", learnt, m);
    free(m);

    // random words over a, b, c, until no pair occurs twice
    static char text[8192], want[1 << 16];
    uint64_t state = 7;
    size_t n = 0;
    for (int w = 0; w < 600; w++) {
        if (w) text[n++] = ' ';
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        int l = 1 + (int)(state >> 60) % 8;
        for (int k = 0; k < l; k++) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            text[n++] = "abc"[(state >> 33) % 3];
        }
    }
    text[n] = 0;
    m = learn_one(text, 600, "l4", &learnt);
    reference_learn(text, 600, want, sizeof want);
    int merges = 0;
    for (const char *p = m; *p; p++) merges += *p == '\n';
    t_check(!strcmp(m, want),
            "random words: the same merges as a learner that recounts every pair "
            "(%d merges)",
            merges);
    free(m);
    snprintf(path, sizeof path, "%s/l4", dir);
    tok = fl_tokenizer_load("gpt2", path);
    memset(&t, 0, sizeof t);
    fl_tokenizer_encode(tok, (const uint8_t *)text, n, &t);
    t_check(decodes_to(tok, &t, (const uint8_t *)text, n) && t.n < n / 3,
            "the learnt tokenizer round-trips its text in fewer tokens (%zu for %zu bytes)", t.n,
            n);
    fl_tokens_free(&t);
    fl_tokenizer_free(tok);
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    snprintf(gpt2_dir, sizeof gpt2_dir, "%s", t_source_path("data/gpt2"));
    snprintf(hf_file, sizeof hf_file, "%s/tokenizer.json", dir);
    test_errors();
    test_hf_errors();
    test_byte();
    test_hf_small();
    test_learn();
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
    test_hf_gpt2(tok);
    fl_tokenizer_free(tok);
    static const char *const families[][2] = {
        {"data/llama", "tests/fixtures/hf_tokenizer_llama.json"},
        {"data/llama3/tokenizer.json", "tests/fixtures/hf_tokenizer_llama3.json"}};
    for (int k = 0; k < 2; k++) {
        tok = fl_tokenizer_load("hf", t_source_path(families[k][0]));
        printf("%s: vocabulary %d, bos %d, eot %d\n", families[k][0], fl_tokenizer_vocab_size(tok),
               fl_tokenizer_bos(tok), fl_tokenizer_eot(tok));
        test_hf_fixture(tok, families[k][1]);
        test_random(tok);
        if (k == 1) test_cache_limit(tok); // (SentencePiece: each call adds its own "▁")
        test_corpus(tok);
        fl_tokenizer_free(tok);
    }
    if (t_remove_dir(dir) != 0) return 1;
    return t_report();
}
