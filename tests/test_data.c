// test_data.c: token shards and the loader: shards round-trip in both token
// widths, damaged shards are refused naming the file and byte offset, every
// epoch visits each window once, ranks get disjoint windows, and a saved
// loader position continues exactly where it stopped. Instruction data: the
// chat templates render exactly the expected text with only the answers as
// targets, bad records are refused with a reason, packing keeps examples
// whole (truncating or splitting long ones), masked shards round-trip and
// are checked, and the loader turns masked targets into -1.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fitlm/data.h"
#include "fitlm/io.h"
#include "fitlm/tokenizer.h"
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

// ----------------------------------------------------------------------------
// instruction examples (byte tokenizer: a token is a byte, <eot> = 256)

static fl_tokenizer *byte_tok;

// The example's text with <eot> spelled "|", and its targets' text alone.
static void render_of(const char *json, fl_chat_template tpl, char *all, char *targets) {
    fl_example_format f = {"prompt", "response", "messages", tpl};
    fl_example ex = {0};
    char err[256] = "";
    int rc = fl_example_parse(byte_tok, &f, json, strlen(json), &ex, err, sizeof err);
    size_t a = 0, t = 0;
    for (size_t i = 0; rc == 0 && i < ex.tokens.n; i++) {
        char c = ex.tokens.ids[i] == 256 ? '|' : (char)ex.tokens.ids[i];
        all[a++] = c;
        if (ex.mask[i]) targets[t++] = c;
    }
    all[a] = targets[t] = 0;
    if (rc) snprintf(all, 256, "error: %.200s", err);
    fl_example_free(&ex);
}

static void test_templates(void) {
    char all[1024], tg[1024];
    const struct {
        fl_chat_template tpl;
        const char *json, *all, *targets;
    } cases[] = {
        {FL_TEMPLATE_DEFAULT, "{\"prompt\": \"Hi\", \"response\": \"Yo\"}",
         "### User:\nHi\n\n### Assistant:\nYo|", "Yo|"},
        {FL_TEMPLATE_DEFAULT, "{\"instruction\": \"Add\", \"input\": \"1 2\", \"output\": \"3\"}",
         "### User:\nAdd\n\n1 2\n\n### Assistant:\n3|", "3|"},
        {FL_TEMPLATE_DEFAULT,
         "{\"system\": \"S\", \"instruction\": \"Add\", \"input\": \"\", \"output\": \"3\"}",
         "### System:\nS\n\n### User:\nAdd\n\n### Assistant:\n3|", "3|"},
        {FL_TEMPLATE_CHATML,
         "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", "
         "\"content\": \"U\"}, {\"role\": \"assistant\", \"content\": \"A\"}]}",
         "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
         "<|im_start|>assistant\nA<|im_end|>|",
         "A<|im_end|>|"},
        {FL_TEMPLATE_LLAMA3,
         "{\"messages\": [{\"role\": \"user\", \"content\": \"U\"}, {\"role\": \"assistant\", "
         "\"content\": \"A\"}, {\"role\": \"user\", \"content\": \"V\"}, {\"role\": "
         "\"assistant\", \"content\": \"B\"}]}",
         "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\nA<|eot_id|>"
         "<|start_header_id|>user<|end_header_id|>\n\nV<|eot_id|>"
         "<|start_header_id|>assistant<|end_header_id|>\n\nB<|eot_id|>|",
         "A<|eot_id|>B<|eot_id|>|"},
        {FL_TEMPLATE_LLAMA2,
         "{\"messages\": [{\"role\": \"system\", \"content\": \"S\"}, {\"role\": \"user\", "
         "\"content\": \"U\"}, {\"role\": \"assistant\", \"content\": \"A\"}, {\"role\": "
         "\"user\", \"content\": \"V\"}, {\"role\": \"assistant\", \"content\": \"B\"}]}",
         "[INST] <<SYS>>\nS\n<</SYS>>\n\nU [/INST]A|[INST] V [/INST]B|", "A|B|"},
        {FL_TEMPLATE_DEFAULT, "{\"prompt\": \"\\u00e9\", \"response\": \"x\"}  ",
         "### User:\n\xc3\xa9\n\n### Assistant:\nx|", "x|"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        render_of(cases[i].json, cases[i].tpl, all, tg);
        t_check(!strcmp(all, cases[i].all) && !strcmp(tg, cases[i].targets),
                "template %d case %zu renders\n  %s\nwith targets '%s'; got\n  %s\nwith '%s'",
                cases[i].tpl, i, cases[i].all, cases[i].targets, all, tg);
    }
    t_check(fl_chat_template_parse("chatml") == FL_TEMPLATE_CHATML &&
                fl_chat_template_parse("llama3") == FL_TEMPLATE_LLAMA3 &&
                fl_chat_template_parse("vicuna") == -1,
            "templates are found by name");

    // configurable field names
    fl_example_format f = {"q", "a", "turns", FL_TEMPLATE_DEFAULT};
    fl_example ex = {0};
    char err[256];
    const char *json = "{\"q\": \"1\", \"a\": \"2\"}";
    t_check(fl_example_parse(byte_tok, &f, json, strlen(json), &ex, err, sizeof err) == 0 &&
                ex.tokens.n == strlen("### User:\n1\n\n### Assistant:\n2") + 1,
            "--prompt-field and --response-field name the fields");
    fl_example_free(&ex);

    const struct {
        const char *json, *why;
    } bad[] = {
        {"{\"prompt\": \"a\", \"response\": ", "invalid JSON at column"},
        {"{\"prompt\": \"a\", \"response\": \"b\"} x", "text after the JSON value at column 34"},
        {"[1, 2]", "not a JSON object"},
        {"{\"prompt\": \"a\"}", "missing field \"response\""},
        {"{\"prompt\": 1, \"response\": \"b\"}", "field \"prompt\" is not a string"},
        {"{\"prompt\": \"a\", \"response\": \"\"}", "empty response"},
        {"{\"text\": \"a\"}", "no \"messages\" list, \"prompt\"/\"response\" or"},
        {"{\"messages\": {}}", "field \"messages\" is not a list"},
        {"{\"messages\": [{\"role\": \"bot\", \"content\": \"a\"}]}",
         "messages[0].role \"bot\" is not"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": [1]}]}",
         "messages[0].content is missing or not a string"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}",
         "does not end with an assistant message"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"system\", "
         "\"content\": \"s\"}, {\"role\": \"assistant\", \"content\": \"b\"}]}",
         "messages[1]: a system message must come first"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", "
         "\"content\": \"\"}]}",
         "messages[1]: empty assistant message"},
        {"{\"instruction\": \"a\", \"input\": 3, \"output\": \"b\"}", "field \"input\" is not"},
    };
    fl_example_format d = {"prompt", "response", "messages", FL_TEMPLATE_DEFAULT};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        int rc =
            fl_example_parse(byte_tok, &d, bad[i].json, strlen(bad[i].json), &ex, err, sizeof err);
        t_check(rc == -1 && strstr(err, bad[i].why), "%s is refused: \"%s\" (got %d: \"%s\")",
                bad[i].json, bad[i].why, rc, err);
    }
    fl_example_free(&ex);
}

// An example of n tokens 1000*id + i whose targets are the tokens from `from` on.
static fl_example make_example(int id, size_t n, size_t from) {
    fl_example ex = {0};
    ex.tokens.ids = malloc(n * sizeof(int32_t));
    ex.mask = malloc(n);
    ex.text_bytes = malloc(n * sizeof *ex.text_bytes);
    ex.tokens.n = n;
    for (size_t i = 0; i < n; i++) {
        ex.tokens.ids[i] = (int32_t)(1000 * id + (int)i);
        ex.mask[i] = i >= from;
        ex.text_bytes[i] = i >= from;
    }
    return ex;
}

static void add_example(fl_packer *p, int id, size_t n, size_t from) {
    fl_example ex = make_example(id, n, from);
    fl_packer_add(p, &ex);
    free(ex.tokens.ids);
    free(ex.mask);
    free(ex.text_bytes);
}

static void test_packing(void) {
    enum { T = 8, W = T + 1 };
    fl_packer p;
    fl_packer_init(&p, T, FL_SEQ_TRUNCATE, 1, 7);
    add_example(&p, 1, 6, 2);   // window 0: 6 of 9
    add_example(&p, 2, 5, 1);   // too big for window 0's 3: window 1
    add_example(&p, 3, 3, 1);   // window 0 fits it exactly (best fit before window 1's 4)
    add_example(&p, 4, 4, 3);   // window 1's 4
    add_example(&p, 5, 12, 4);  // truncated to 9: window 2
    add_example(&p, 6, 12, 10); // its targets are past the cut: dropped
    t_check(p.n_windows == 3 && p.n_examples == 6 && p.n_truncated == 2 && p.n_dropped == 1,
            "best fit: 3 windows, 2 truncated, 1 dropped (got %zu, %llu, %llu)", p.n_windows,
            (unsigned long long)p.n_truncated, (unsigned long long)p.n_dropped);
    t_check(p.tokens[0] == 1000 && p.tokens[6] == 3000 && p.tokens[W] == 2000 &&
                p.tokens[W + 5] == 4000 && p.tokens[2 * W + 8] == 5008,
            "examples stay whole and in their windows");
    t_check(p.mask[6] == 0 && p.mask[7] == 1 && p.mask[W + 5] == 0 && p.mask[W + 8] == 1 &&
                p.mask[W + 4] == 1,
            "a piece's first token is never a target");
    int first_never = 1;
    for (size_t w = 0; w < p.n_windows; w++) first_never &= p.mask[w * W] == 0;
    t_check(first_never && p.examples[0] == 2 && p.examples[1] == 2 && p.examples[2] == 1,
            "windows count the examples that start in them");
    fl_packer_free(&p);

    // split: windows overlapping by one token keep every target
    fl_packer_init(&p, T, FL_SEQ_SPLIT, 1, 7);
    add_example(&p, 1, 20, 1); // 19 targets: windows [0,9) [8,17) [16,20)
    size_t targets = 0;
    for (size_t i = 0; i < p.n_windows * W; i++) targets += p.mask[i];
    t_check(p.n_windows == 3 && p.n_split == 1 && targets == 19 && p.n_targets == 19 &&
                p.tokens[W] == 1008 && p.tokens[2 * W] == 1016 && p.tokens[2 * W + 3] == 1019 &&
                p.tokens[2 * W + 4] == 7,
            "split: 3 windows overlapping by one token, all 19 targets, padded");
    fl_packer_free(&p);

    // unpacked: one example per window
    fl_packer_init(&p, T, FL_SEQ_TRUNCATE, 0, 7);
    add_example(&p, 1, 3, 1);
    add_example(&p, 2, 3, 1);
    t_check(p.n_windows == 2 && p.tokens[3] == 7 && p.tokens[W] == 2000,
            "--no-packing: one example per window");
    fl_packer_free(&p);
}

// The bytes of text a packer records for its windows are those of exactly
// the targets it keeps, whatever cut the layout makes: for each tokenizer,
// template, overflow policy, packing and window length, recounted from the
// kept target tokens (their bytes in the vocabulary; a SentencePiece
// tokenizer's run of targets decoded, its leading space dropped), and, with
// nothing cut, the answers' own bytes.
static const char *const byte_records[] = {
    "{\"prompt\": \"What is 7 plus 5?\", \"response\": \"7 + 5 = 12, and that is all.\"}",
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, {\"role\": \"user\", "
    "\"content\": \"Say h\u00e9llo\"}, {\"role\": \"assistant\", \"content\": \"H\u00e9llo, "
    "w\u00f6rld! \u65e5\u672c\u8a9e \u00e9t\u00e9\"}, {\"role\": \"user\", \"content\": "
    "\"Again\"}, {\"role\": \"assistant\", \"content\": \"  Once more, with   spaces.\"}]}",
    "{\"instruction\": \"Count\", \"input\": \"to ten\", \"output\": \"one two three four five six "
    "seven eight nine ten\"}",
};

// The answers' bytes plus the template's target markers' (none for those
// it inserts as tokens).
static size_t answer_bytes(fl_chat_template tpl) {
    static const size_t answers[] = {28, 31 + 27, 48}, turns[] = {1, 2, 1};
    size_t marker = tpl == FL_TEMPLATE_CHATML   ? strlen("<|im_end|>")
                    : tpl == FL_TEMPLATE_LLAMA3 ? strlen("<|eot_id|>")
                                                : 0,
           sum = 0;
    for (int i = 0; i < 3; i++) sum += answers[i] + turns[i] * marker;
    return sum;
}

static uint64_t recount(const fl_tokenizer *tok, const fl_packer *p, int strip) {
    size_t W = (size_t)p->T + 1, len;
    int32_t eot = fl_tokenizer_eot(tok), bos = fl_tokenizer_bos(tok);
    uint64_t sum = 0;
    for (size_t w = 0; w < p->n_windows; w++) {
        uint64_t window = 0;
        for (size_t i = w * W; i < (w + 1) * W; i++) {
            if (!p->mask[i]) continue;
            size_t end = i; // the run of targets i..end
            while (end < (w + 1) * W && p->mask[end]) end++;
            if (strip) {
                uint8_t *text = fl_tokenizer_decode(tok, p->tokens + i, end - i, &len);
                window += len;
                fl_free(text);
            } else {
                for (size_t k = i; k < end; k++)
                    if (p->tokens[k] != eot && p->tokens[k] != bos) {
                        fl_tokenizer_token_bytes(tok, p->tokens[k], &len);
                        window += len;
                    }
            }
            i = end;
        }
        t_check(window == p->bytes[w], "window %zu records %llu bytes, its targets hold %llu", w,
                (unsigned long long)p->bytes[w], (unsigned long long)window);
        sum += window;
    }
    return sum;
}

static void check_text_bytes(const char *name, const fl_tokenizer *tok, int strip) {
    static const fl_chat_template templates[] = {FL_TEMPLATE_DEFAULT, FL_TEMPLATE_CHATML,
                                                 FL_TEMPLATE_LLAMA3, FL_TEMPLATE_LLAMA2};
    for (int t = 0; t < 4; t++) {
        fl_chat_template tpl = templates[t];
        // a SentencePiece recount decodes runs of targets, whose markers must be
        // the template's own tokens: the default template's
        if (strip && tpl != FL_TEMPLATE_DEFAULT) continue;
        fl_example ex[3];
        memset(ex, 0, sizeof ex);
        fl_example_format f = {"prompt", "response", "messages", tpl};
        char err[256] = "";
        for (int r = 0; r < 3; r++)
            t_check(fl_example_parse(tok, &f, byte_records[r], strlen(byte_records[r]), &ex[r], err,
                                     sizeof err) == 0,
                    "%s: record %d parses: %s", name, r, err);
        for (int T = 12; T <= 4096; T *= 4)
            for (int policy = FL_SEQ_TRUNCATE; policy <= FL_SEQ_SPLIT; policy++)
                for (int packed = 0; packed < 2; packed++) {
                    // split cuts runs of targets anywhere: only recounted token by token
                    if (strip && policy == FL_SEQ_SPLIT) continue;
                    fl_packer p;
                    fl_packer_init(&p, T, (fl_seq_policy)policy, packed, fl_tokenizer_eot(tok));
                    for (int r = 0; r < 3; r++) fl_packer_add(&p, &ex[r]);
                    uint64_t sum = recount(tok, &p, strip), recorded = 0;
                    for (size_t w = 0; w < p.n_windows; w++) recorded += p.bytes[w];
                    // split keeps every target, once
                    t_check(sum == recorded && (p.n_truncated || recorded == answer_bytes(tpl)),
                            "%s, template %d, T %d, %s, %s: %llu bytes recorded, %llu in the "
                            "kept targets (answers: %zu)",
                            name, tpl, T, policy == FL_SEQ_SPLIT ? "split" : "truncate",
                            packed ? "packed" : "unpacked", (unsigned long long)recorded,
                            (unsigned long long)sum, answer_bytes(tpl));
                    fl_packer_free(&p);
                }
        for (int r = 0; r < 3; r++) fl_example_free(&ex[r]);
    }
}

static void test_text_bytes(void) {
    check_text_bytes("byte", byte_tok, 0);
    fl_tokenizer *gpt2 = fl_tokenizer_load("gpt2", t_source_path("data/gpt2"));
    check_text_bytes("gpt2", gpt2, 0);
    fl_tokenizer_free(gpt2);
    fl_tokenizer *llama3 = fl_tokenizer_load("hf", t_source_path("data/llama3/tokenizer.json"));
    check_text_bytes("hf llama3", llama3, 0);
    fl_tokenizer_free(llama3);
    fl_tokenizer *llama = fl_tokenizer_load("hf", t_source_path("data/llama"));
    check_text_bytes("hf llama (SentencePiece)", llama, 1);
    fl_tokenizer_free(llama);
}

// A NUL in a record's string would cut it short (cJSON's strings end at
// one): refused wherever it is, naming the column and the field.
static void test_nul_in_records(void) {
    const struct {
        const char *json, *why;
    } cases[] = {
        {"{\"prompt\": \"hi\", \"response\": \"ok\\u0000SECRET\"}",
         "\\u0000 (a NUL character) at column 33, in field \"response\","},
        {"{\"prompt\": \"h\\u0000i\", \"response\": \"ok\"}", "column 14, in field \"prompt\","},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", "
         "\"content\": \"\\u0000\"}]}",
         "in field \"content\","},
        {"{\"messages\": [{\"role\": \"user\\u0000x\", \"content\": \"a\"}]}",
         "in field \"role\","},
        {"{\"instruction\": \"a\", \"input\": \"\\\\\\u0000\", \"output\": \"b\"}",
         "column 34, in field \"input\","},
        {"{\"prompt\": \"hi\", \"response\": \"ok\0SECRET\"}", "a NUL byte at column 33"},
    };
    fl_example_format f = {"prompt", "response", "messages", FL_TEMPLATE_DEFAULT};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fl_example ex = {0};
        char err[256] = "";
        size_t n = strlen(cases[i].json);
        if (i == 5) n += 1 + strlen("SECRET\"}");
        int rc = fl_example_parse(byte_tok, &f, cases[i].json, n, &ex, err, sizeof err);
        t_check(rc == -1 && strstr(err, cases[i].why), "%s is refused: '%s' (got %d: '%s')",
                cases[i].json, cases[i].why, rc, err);
        fl_example_free(&ex);
    }
    // an escaped backslash before "u0000" is no NUL
    const char *ok = "{\"prompt\": \"a\\\\u0000\", \"response\": \"b\"}";
    fl_example ex = {0};
    char err[256] = "";
    t_check(fl_example_parse(byte_tok, &f, ok, strlen(ok), &ex, err, sizeof err) == 0,
            "\"a\\\\u0000\" is a backslash and text: %s", err);
    fl_example_free(&ex);
}

static void open_loader_t(void *pattern) {
    fl_loader l;
    fl_loader_open(&l, pattern, "train", 8, 1, 1, 0, 1);
}

// A masked data set: windows of T+1 = 9 from a packer.
static void make_masked(const char *path, uint32_t T, const fl_packer *p) {
    fl_shard_layout layout = {T, FL_SEQ_TRUNCATE, 1, p->n_examples};
    fl_shard_write_masked(path, "byte", 50000, p->tokens, p->mask, p->n_windows * (T + 1), 99,
                          &layout);
}

static void test_masked_shards(void) {
    enum { T = 8, W = T + 1 };
    fl_packer p;
    fl_packer_init(&p, T, FL_SEQ_TRUNCATE, 1, 7);
    for (int i = 0; i < 10; i++) add_example(&p, i + 1, 4 + (size_t)i % 5, 2);
    char d[512], path[600];
    path_of(d, sizeof d, "masked");
    char cmd[700];
    snprintf(cmd, sizeof cmd, "mkdir -p %s", d);
    t_check(system(cmd) == 0, "mkdir");
    snprintf(path, sizeof path, "%s/train_000000.bin", d);
    make_masked(path, T, &p);

    fl_shard s;
    fl_shard_open(&s, path);
    int same = s.version == 2 && s.n_tokens == p.n_windows * W && s.layout.seq_len == T &&
               s.layout.policy == FL_SEQ_TRUNCATE && s.layout.packed == 1 &&
               s.layout.n_examples == 10 && s.n_targets == p.n_targets && s.source_bytes == 99;
    for (size_t i = 0; i < s.n_tokens; i++)
        same &= fl_shard_token(&s, i) == (uint32_t)p.tokens[i] &&
                fl_shard_is_target(&s, i) == (p.mask[i] != 0);
    t_check(same, "a masked shard round-trips tokens, mask and layout");
    fl_shard_close(&s);

    fl_loader l;
    fl_loader_open(&l, d, "train", T, 1, 0, 0, 1);
    t_check(l.stride == W && l.n_windows == p.n_windows && l.n_targets == p.n_targets,
            "the loader takes windows of T+1 back to back (%llu windows)",
            (unsigned long long)l.n_windows);
    int in[W * 8], tg[W * 8], ok = 1;
    size_t n = p.n_windows < 8 ? p.n_windows : 8, targets = 0;
    fl_loader_next(&l, in, tg, (int)n);
    for (size_t w = 0; w < n; w++)
        for (int t = 0; t < T; t++) {
            size_t i = w * W + (size_t)t;
            ok &= in[w * T + (size_t)t] == p.tokens[i];
            ok &= tg[w * T + (size_t)t] == (p.mask[i + 1] ? p.tokens[i + 1] : -1);
            targets += tg[w * T + (size_t)t] != -1;
        }
    t_check(ok && targets > 0, "targets outside the mask are -1, the rest the next token");
    double h = fl_loader_unigram_xent(&l, &l);
    t_check(h > 0 && isfinite(h), "the unigram baseline counts targets only (%g)", h);
    fl_loader_close(&l);

    char q[600];
    snprintf(q, sizeof q, "%s/train_000001.bin", d);
    int32_t other[20] = {0};
    fl_shard_write(q, "byte", 50000, other, 20, 20);
    t_dies("mixed versions", open_loader_t, d, "cannot be mixed in one data set");
    if (remove(q) != 0) t_check(0, "remove %s", q);

    // a run with another T: the windows would cut examples anywhere
    fl_packer_free(&p);
    fl_packer_init(&p, 16, FL_SEQ_SPLIT, 0, 7);
    add_example(&p, 1, 10, 2);
    path_of(q, sizeof q, "t16.bin");
    make_masked(q, 16, &p);
    t_dies("shard T is not the run's", open_loader_t, q,
           "was laid out for sequence length 16 (fitlm tokenize --seq-len), but this run's is 8");
    fl_packer_free(&p);

    // damage: named by offset; every checksum valid where a field is wrong
    size_t len;
    unsigned char *good = t_read_file(path, &len), *bad = malloc(len);
    path_of(q, sizeof q, "badmask.bin");
    const struct {
        const char *name;
        size_t offset;
        unsigned char xor ;
        size_t len;
        const char *expect;
    } cases[] = {
        {"layout flip", 70, 0x01, 0, "the header (bytes 64-123) is corrupt"},
        {"mask flip", len - 1, 0x01, 0, "the token data (byte offset 128 on) is corrupt"},
        {"mask truncated", 0, 0, len - 1, "is truncated or too long"},
        {"v2 shorter than its header", 0, 0, 100, "shorter than its 128-byte header"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        memcpy(bad, good, len);
        bad[cases[i].offset] ^= cases[i].xor ;
        t_write_file(q, bad, cases[i].len ? cases[i].len : len);
        t_dies(cases[i].name, open_shard, q, cases[i].expect);
    }
    // fields with valid checksums: a target count that is not the mask's, a
    // set bit at a window start, a policy that does not exist
    const struct {
        const char *name;
        size_t offset;
        uint32_t value;
        const char *expect;
    } fields[] = {
        {"target count", 84, 1, "the mask holds"},
        {"policy", 68, 9, "unknown sequence policy 9 (byte offset 68)"},
        {"seq_len", 64, 15, "are not whole windows of 16"},
        {"window start", 0, 0, "starts a window but its mask bit is set"},
    };
    size_t mask0 = 128 + (len - 128) / 17 * 16; // 2-byte tokens: mask after 16/17 of the body
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        memcpy(bad, good, len);
        if (fields[i].offset) {
            fl_put_u32(bad + fields[i].offset, fields[i].value);
        } else {
            bad[mask0] |= 1; // token 0's bit
            fl_put_u64(bad + 84, fl_get_u64(bad + 84) + 1);
            fl_put_u32(bad + 20, fl_crc32(0, bad + 128, len - 128));
            fl_put_u32(bad + 60, fl_crc32(0, bad, 60));
        }
        fl_put_u32(bad + 124, fl_crc32(0, bad + 64, 60));
        t_write_file(q, bad, len);
        t_dies(fields[i].name, open_shard, q, fields[i].expect);
    }
    free(good);
    free(bad);
}

int main(void) {
    if (!mkdtemp(dir)) return 1;
    test_crc();
    test_shards();
    test_shard_vocab_range();
    test_loader();
    byte_tok = fl_tokenizer_load("byte", NULL);
    test_templates();
    test_packing();
    test_text_bytes();
    test_nul_in_records();
    test_masked_shards();
    fl_tokenizer_free(byte_tok);
    if (t_remove_dir(dir) != 0) return 1;
    return t_report();
}
