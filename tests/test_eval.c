// test_eval.c: `fitlm eval`, through the built binary (FITLM_BINARY, set by
// CTest) on the fixture checkpoint (GPT-2, byte tokenizer, T 8) and tiny
// shards: the loss equals the model API's on the same windows computed
// independently (no padding: each tail run at its own length), for any
// batch size and thread count; every target counted once; the JSON fields
// and formulas; --text equals tokenize + --data; masked examples; clear
// errors; an adapter's loss is its merged export's.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <cjson/cJSON.h>

#include "fitlm/data.h"
#include "fitlm/io.h"
#include "fitlm/safetensors.h"
#include "testlib.h"

static char dir[] = "/tmp/fitlm_test_eval_XXXXXX";
static char output[65536];
static const char *ckpt = "ck.fitlm"; // the fixture checkpoint, copied into dir
static char ckpt_path[1024];          // ... and its full path

// Runs `fitlm ARGS` in dir; stdout (and stderr unless quiet) captured.
static int run(const char *args, int quiet) {
    return t_fitlm(dir, args, !quiet, output, sizeof output);
}

static void fails_with(const char *args, const char *what) {
    t_fitlm_fails(dir, args, what, output, sizeof output);
}

// `fitlm eval ARGS --json`, parsed (NULL, checked, when it fails).
static cJSON *eval_json(const char *args) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "eval %s --json", args);
    int rc = run(cmd, 1);
    cJSON *j = rc == 0 ? cJSON_Parse(output) : NULL;
    t_check(j != NULL, "'fitlm %s' prints one JSON object (status %d): %.300s", cmd, rc, output);
    return j;
}

static double num(const cJSON *j, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    return cJSON_IsNumber(v) ? v->valuedouble : NAN;
}

static int rel_close(double a, double b, double rtol) {
    return fabs(a - b) <= rtol * fabs(b);
}

// ----------------------------------------------------------------------------
// the data: streams of byte tokens whose lengths hit every case of the tail
// rule with T = 8: a partial last window, one token (no target), two tokens,
// exactly one window (T+1), exactly two (2T+1), one token past it

static const uint64_t lengths[] = {37, 1, 2, 20, 9, 17, 18};
#define N_SHARDS (sizeof lengths / sizeof lengths[0])

static int32_t token_of(int shard, uint64_t i) {
    return (int32_t)((shard * 7919u + i * 104729u + (i * i) % 13u) % 257u);
}

static void write_shards(void) {
    char path[1024];
    for (size_t s = 0; s < N_SHARDS; s++) {
        int32_t tokens[64];
        for (uint64_t i = 0; i < lengths[s]; i++) tokens[i] = token_of((int)s, i);
        snprintf(path, sizeof path, "%s/mix/val_%06zu.bin", dir, s);
        fl_shard_write(path, "byte", 257, tokens, lengths[s], 3 * lengths[s] + s);
    }
}

// The loss summed over the shards' targets through the model API, with no
// padding: a stream's windows start every T tokens, the last one run at
// its own length; in data order, in double.
static void reference(fl_model *m, int T, double *nats, uint64_t *tokens) {
    *nats = 0;
    *tokens = 0;
    int in[64], tg[64];
    for (size_t s = 0; s < N_SHARDS; s++) {
        for (uint64_t start = 0; start + 1 < lengths[s]; start += (uint64_t)T) {
            int len = lengths[s] - 1 - start < (uint64_t)T ? (int)(lengths[s] - 1 - start) : T;
            for (int t = 0; t < len; t++) {
                in[t] = token_of((int)s, start + t);
                tg[t] = token_of((int)s, start + t + 1);
            }
            fl_model_forward(m, in, tg, 1, len);
            for (int t = 0; t < len; t++) *nats += m->losses[t];
            *tokens += (uint64_t)len;
        }
    }
}

static void test_loss_is_the_model_apis(void) {
    fl_model m;
    char tok[32];
    fl_ckpt_load_model(ckpt_path, &m, FL_F32, tok, sizeof tok);
    fl_model_alloc_acts(&m, 1, 8, FL_RECOMPUTE_NONE, 1);
    double nats;
    uint64_t tokens;
    reference(&m, 8, &nats, &tokens);
    fl_model_free(&m);
    uint64_t want_tokens = 0, bytes = 0;
    for (size_t s = 0; s < N_SHARDS; s++) {
        want_tokens += lengths[s] - 1;
        bytes += 3 * lengths[s] + s;
    }
    t_check(tokens == want_tokens, "every token but a stream's first is a target once");

    char args[2048];
    snprintf(args, sizeof args, "--checkpoint %s --data mix", ckpt);
    cJSON *j = eval_json(args);
    double loss = num(j, "loss");
    t_check(num(j, "tokens") == (double)want_tokens && num(j, "bytes") == (double)bytes,
            "counts: %g tokens (want %llu), %g bytes (want %llu)", num(j, "tokens"),
            (unsigned long long)want_tokens, num(j, "bytes"), (unsigned long long)bytes);
    t_check(rel_close(num(j, "nats"), nats, 1e-6) && rel_close(loss, nats / (double)tokens, 1e-6),
            "the loss is the model API's on the same windows: %.9g vs %.9g", loss,
            nats / (double)tokens);
    t_check(rel_close(num(j, "perplexity"), exp(loss), 1e-12), "perplexity = exp(loss)");
    t_check(rel_close(num(j, "bits_per_byte"), num(j, "nats") / log(2.0) / (double)bytes, 1e-12),
            "bits per byte = nats / ln 2 / bytes: %g", num(j, "bits_per_byte"));
    t_check(num(j, "windows") == 15 && num(j, "seq_len") == 8 && num(j, "seconds") >= 0,
            "15 windows of 8+1 (tails included), T the model's context");
    const char *strings[] = {"model", "data", "tokenizer", "precision"};
    for (int i = 0; i < 4; i++)
        t_check(cJSON_IsString(cJSON_GetObjectItemCaseSensitive(j, strings[i])),
                "the JSON has \"%s\"", strings[i]);
    t_check(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(j, "adapter")), "no adapter: null");

    // the same bits for any batch size and thread count, and with the LM
    // head over 5 positions at a time (--logits-chunk)
    const int batches[] = {1, 3, 7, 16};
    for (int t = 1; t <= 2; t++)
        for (int b = 0; b < 4; b++) {
            int chunk = t == 2 ? 5 : 0;
            snprintf(args, sizeof args,
                     "--checkpoint %s --data mix --batch %d --threads %d --logits-chunk %d", ckpt,
                     batches[b], t, chunk);
            cJSON *k = eval_json(args);
            t_check(num(k, "nats") == num(j, "nats") && num(k, "tokens") == num(j, "tokens"),
                    "batch %d, %d thread(s), logits in chunks of %d: the same sum, %.17g vs %.17g",
                    batches[b], t, chunk, num(k, "nats"), num(j, "nats"));
            cJSON_Delete(k);
        }
    // a shorter window: more context resets, so another loss, same count
    snprintf(args, sizeof args, "--checkpoint %s --data mix --seq-len 3", ckpt);
    cJSON *k = eval_json(args);
    t_check(num(k, "tokens") == (double)want_tokens && num(k, "nats") != num(j, "nats"),
            "--seq-len 3 counts the same targets with less context");
    cJSON_Delete(k);
    // bf16: the same model rounded; close to fp32
    snprintf(args, sizeof args, "--checkpoint %s --data mix --precision bf16", ckpt);
    k = eval_json(args);
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(k, "precision");
    t_check(cJSON_IsString(p) && !strcmp(p->valuestring, "bf16") &&
                rel_close(num(k, "loss"), loss, 2e-2),
            "--precision bf16: loss %g near fp32's %g", num(k, "loss"), loss);
    cJSON_Delete(k);
    cJSON_Delete(j);

    // the human-readable form and the line on a non-terminal stderr
    snprintf(args, sizeof args, "eval --checkpoint %s --data mix", ckpt);
    int rc = run(args, 0);
    t_check(rc == 0 && strstr(output, "loss ") && strstr(output, "perplexity ") &&
                strstr(output, "bits/byte ") && strstr(output, "tokens     97") &&
                strstr(output, "eval: 15 windows, 97 tokens"),
            "human-readable output: %.600s", output);
}

// ----------------------------------------------------------------------------
// --text FILE: the file as one document, after <|endoftext|> (the byte
// tokenizer has no <s>): what `fitlm tokenize` makes of it

static void test_text_equals_tokenized_data(void) {
    const char *text = "It was the best of times, it was the worst of times, it was the age of "
                       "wisdom, it was the age of foolishness. \xc3\xa9t\xc3\xa9\n";
    char path[1024], args[2048];
    snprintf(path, sizeof path, "%s/tale.txt", dir);
    t_write_text(path, text);
    t_check(run("tokenize tale.txt -o tale --tokenizer byte --val-fraction 0", 0) == 0,
            "tokenize the text: %.300s", output);
    snprintf(args, sizeof args, "--checkpoint %s --data tale --split train --batch 5", ckpt);
    cJSON *a = eval_json(args);
    snprintf(args, sizeof args, "--checkpoint %s --text tale.txt", ckpt);
    cJSON *b = eval_json(args);
    t_check(num(a, "nats") == num(b, "nats") && num(a, "tokens") == num(b, "tokens") &&
                num(b, "tokens") == (double)strlen(text) &&
                num(b, "bytes") == (double)strlen(text) && num(a, "bytes") == num(b, "bytes"),
            "--text = tokenize + --data: %.17g/%g/%g vs %.17g/%g/%g", num(b, "nats"),
            num(b, "tokens"), num(b, "bytes"), num(a, "nats"), num(a, "tokens"), num(a, "bytes"));
    cJSON_Delete(a);
    cJSON_Delete(b);
}

// ----------------------------------------------------------------------------
// examples with a loss mask (version 2 shards): only marked targets count,
// windows laid out back to back, T the layout's

static void test_masked_examples(void) {
    enum { T = 8, W = 3, N = W * (T + 1) };
    int32_t tokens[N];
    uint8_t mask[N];
    for (int i = 0; i < N; i++) {
        tokens[i] = token_of(9, (uint64_t)i);
        mask[i] = (uint8_t)(i % (T + 1) >= 3); // a prompt of 3 tokens, then the answer
    }
    fl_shard_layout layout = {T, FL_SEQ_TRUNCATE, 0, W};
    char path[1024], args[2048];
    snprintf(path, sizeof path, "%s/ex/val_000000.bin", dir);
    fl_shard_write_masked(path, "byte", 257, tokens, mask, N, 100, &layout);

    fl_model m;
    char tok[32];
    fl_ckpt_load_model(ckpt_path, &m, FL_F32, tok, sizeof tok);
    fl_model_alloc_acts(&m, 1, T, FL_RECOMPUTE_NONE, 1);
    double nats = 0;
    uint64_t count = 0;
    for (int w = 0; w < W; w++) {
        int in[T], tg[T];
        for (int t = 0; t < T; t++) {
            int i = w * (T + 1) + t;
            in[t] = tokens[i];
            tg[t] = mask[i + 1] ? tokens[i + 1] : -1;
        }
        fl_model_forward(&m, in, tg, 1, T);
        for (int t = 0; t < T; t++)
            if (tg[t] != -1) nats += m.losses[t], count++;
    }
    fl_model_free(&m);
    snprintf(args, sizeof args, "--checkpoint %s --data ex --batch 2", ckpt);
    cJSON *j = eval_json(args);
    t_check(num(j, "tokens") == (double)count && count == W * 6 && num(j, "windows") == W &&
                rel_close(num(j, "nats"), nats, 1e-6),
            "masked examples: %g targets (want %llu), nats %.9g vs %.9g", num(j, "tokens"),
            (unsigned long long)count, num(j, "nats"), nats);
    cJSON_Delete(j);
    snprintf(args, sizeof args, "eval --checkpoint %s --data ex --seq-len 4", ckpt);
    fails_with(args, "laid out in windows of 8+1 tokens");
}

// Bits per byte counts the bytes of the targets the shards hold: answers
// cut by --overflow truncate count the part kept, so the figure is the
// untruncated one's (the model spends about the same nats on each byte),
// not inflated bytes under a few kept targets.
static void test_truncated_bits_per_byte(void) {
    char text[8192], path[1024];
    size_t n = 0, kept = 0, whole = 0;
    for (int i = 0; i < 24; i++) { // answers of 20..43 bytes; the window keeps 8 targets
        char answer[64];
        int len = 20 + i;
        for (int k = 0; k < len; k++) answer[k] = (char)('a' + (i * 7 + k * 3) % 26);
        answer[len] = 0;
        n += (size_t)snprintf(text + n, sizeof text - n,
                              "{\"messages\": [{\"role\": \"assistant\", \"content\": \"%s\"}]}\n",
                              answer);
        kept += 8;
        whole += (size_t)len - 1; // a window's first token is no target
    }
    snprintf(path, sizeof path, "%s/answers.jsonl", dir);
    t_write_text(path, text);
    double bpb[2];
    const char *policy[] = {"truncate", "split"};
    for (int p = 0; p < 2; p++) {
        char args[1024];
        snprintf(args, sizeof args,
                 "tokenize answers.jsonl -o bpb_%s --format jsonl --tokenizer byte --seq-len 8 "
                 "--val-fraction 0 --overflow %s",
                 policy[p], policy[p]);
        t_check(run(args, 0) == 0, "tokenize --overflow %s: %.300s", policy[p], output);
        snprintf(args, sizeof args, "--checkpoint %s --data bpb_%s --split train", ckpt, policy[p]);
        cJSON *j = eval_json(args);
        bpb[p] = num(j, "bits_per_byte");
        t_check(num(j, "bytes") == (double)(p ? whole : kept),
                "--overflow %s: the bytes are the kept targets' %zu (got %g)", policy[p],
                p ? whole : kept, num(j, "bytes"));
        cJSON_Delete(j);
    }
    t_check(bpb[0] > 0.75 * bpb[1] && bpb[0] < 1.33 * bpb[1],
            "bits per byte, truncated %.4f and whole %.4f, agree", bpb[0], bpb[1]);
}

// A document cut between two shards: each shard records the bytes of the
// tokens it holds (byte tokens: one byte each, <eot> none), so the bits
// per byte of any one shard are right too.
static void test_shard_bytes_of_cut_documents(void) {
    static char text[8192];
    size_t n = 0;
    for (int d = 0; d < 4; d++) { // documents of 2500, 700, 1900 and 40 bytes
        int len = d == 0 ? 2500 : d == 1 ? 700 : d == 2 ? 1900 : 40;
        for (int k = 0; k < len; k++) text[n++] = (char)('a' + (d + k) % 26);
        if (d < 3) n += (size_t)snprintf(text + n, sizeof text - n, "\r\n\r\n");
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/cut.txt", dir);
    t_write_text(path, text);
    t_check(run("tokenize cut.txt -o cut --tokenizer byte --val-fraction 0 --shard-tokens 1024",
                0) == 0,
            "tokenize into shards of 1024 tokens: %.300s", output);
    uint64_t total = 0;
    int shards = 0, exact = 1;
    for (;; shards++) {
        snprintf(path, sizeof path, "%s/cut/train_%06d.bin", dir, shards);
        struct stat st;
        if (stat(path, &st) != 0) break;
        fl_shard s;
        fl_shard_open(&s, path);
        uint64_t bytes = 0;
        for (uint64_t i = 0; i < s.n_tokens; i++) bytes += fl_shard_token(&s, i) != 256;
        exact &= bytes == s.source_bytes;
        if (bytes != s.source_bytes)
            printf("  %s: %llu bytes recorded, its tokens hold %llu\n", path,
                   (unsigned long long)s.source_bytes, (unsigned long long)bytes);
        total += s.source_bytes;
        fl_shard_close(&s);
    }
    t_check(shards == 6 && exact && total == 2500 + 700 + 1900 + 40,
            "%d shards, each recording the bytes of its own tokens (%llu in all)", shards,
            (unsigned long long)total);
}

// ----------------------------------------------------------------------------
// errors: each a message and status 1

static void test_errors(void) {
    char path[1024], args[2048];
    int32_t t[4] = {1, 2, 3, 50000};
    snprintf(path, sizeof path, "%s/g2/val_000000.bin", dir);
    fl_shard_write(path, "gpt2", 50257, t, 4, 4);
    snprintf(path, sizeof path, "%s/mixed/val_000000.bin", dir);
    fl_shard_write(path, "byte", 257, t, 3, 3);
    snprintf(path, sizeof path, "%s/mixed/val_000001.bin", dir);
    fl_shard_write(path, "gpt2", 50257, t, 4, 4);
    snprintf(path, sizeof path, "%s/empty.txt", dir);
    t_write_text(path, "");
    const struct {
        const char *args, *what;
    } cases[] = {
        {"--data mix", "give one model: --checkpoint PATH"},
        {"--checkpoint ck.fitlm --init-from hf --data mix", "give one model"},
        {"--checkpoint ck.fitlm", "give the data to evaluate on"},
        {"--checkpoint ck.fitlm --data mix --text tale.txt", "give the data to evaluate on"},
        {"--checkpoint ck.fitlm --data nowhere", "token shards at nowhere"},
        {"--checkpoint ck.fitlm --data mix --split test", "--split must be val or train"},
        {"--checkpoint ck.fitlm --data g2",
         "was tokenized with 'gpt2', but the model's tokenizer is"},
        {"--init-from hf --data g2", "has a vocabulary of 50257 (tokenizer gpt2), larger than"},
        {"--checkpoint ck.fitlm --data mixed", "does not match"},
        {"--checkpoint ck.fitlm --text empty.txt", "empty.txt is empty"},
        {"--checkpoint ck.fitlm --text missing.txt", "missing.txt"},
        {"--checkpoint ck.fitlm --data mix --batch 0", "option --batch expects a number"},
        {"--checkpoint ck.fitlm --data mix --batch 1.5", "expects a whole number"},
        {"--checkpoint ck.fitlm --data mix --seq-len 9",
         "longer than the model's context, 8 tokens"},
        {"--checkpoint ck.fitlm --data mix --precision fp8",
         "--precision must be fp32, bf16 or fp16"},
        {"--checkpoint ck.fitlm --data mix --bogus 1", "unknown option '--bogus'"},
        {"--checkpoint ck.fitlm --data mix stray", "unexpected argument 'stray'"},
        {"--checkpoint ck.fitlm --data mix --batch", "option --batch needs a value"},
        {"--checkpoint hf --data mix", "hf is not a fitlm checkpoint"},
        {"--checkpoint ck.fitlm --quantize nf4 --data mix",
         "--quantize nf4 applies to --init-from"},
        {"--checkpoint ck.fitlm --data mix --double-quant", "apply with --quantize nf4"},
        {"--init-from hf --data mix --adapter nowhere", "nowhere"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        snprintf(args, sizeof args, "eval %s", cases[i].args);
        fails_with(args, cases[i].what);
    }
    t_check(run("eval --help", 0) == 0 && strstr(output, "stride T") && strstr(output, "--json"),
            "eval --help states the window rule and the options");
    t_check(run("--help", 0) == 0 && strstr(output, "eval "), "fitlm --help lists eval");
}

// ----------------------------------------------------------------------------
// an adapter: another loss than the base's, the merged export's loss

static void test_adapter_is_its_merge(void) {
    char path[1024];
    fl_model_config cfg = {
        .max_seq_len = 8, .vocab_size = 257, .n_layer = 2, .n_head = 2, .n_embd = 16};
    fl_model m;
    fl_model_init(&m, &cfg, FL_F32, 31);
    snprintf(path, sizeof path, "%s/hf", dir);
    fl_hf_export(path, &m, m.params, FL_F32, 0);
    fl_lora_config lc;
    fl_lora_config_defaults(&lc);
    lc.r = 4;
    lc.alpha = 8;
    snprintf(lc.target_modules, sizeof lc.target_modules, "c_attn,c_proj");
    fl_model_add_lora(&m, &lc, 32);
    size_t n = m.lora.table.numel;
    float *x = malloc(n * sizeof(float));
    t_fill(x, n, 33, 0.5f); // B non-zero: the adapter changes the model
    fl_store_f32(m.dtype, m.lora.params, x, n);
    free(x);
    snprintf(path, sizeof path, "%s/ad", dir);
    fl_peft_save(path, &m, "hf");
    fl_model_free(&m);
    t_check(run("export hf --adapter ad --merge -o merged", 0) == 0, "export --merge: %.300s",
            output);

    cJSON *base = eval_json("--init-from hf --data mix");
    cJSON *with = eval_json("--init-from hf --adapter ad --data mix --batch 3");
    cJSON *merged = eval_json("--init-from merged --data mix");
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(with, "adapter");
    t_check(cJSON_IsString(a) && !strcmp(a->valuestring, "ad"), "the JSON names the adapter");
    t_check(fabs(num(with, "loss") - num(base, "loss")) > 1e-3,
            "the adapter changes the loss: %.9g vs the base's %.9g", num(with, "loss"),
            num(base, "loss"));
    t_check(rel_close(num(with, "loss"), num(merged, "loss"), 1e-5),
            "with the adapter = the merged export: %.9g vs %.9g", num(with, "loss"),
            num(merged, "loss"));
    cJSON_Delete(base);
    cJSON_Delete(with);
    cJSON_Delete(merged);
}

int main(void) {
    if (!mkdtemp(dir)) {
        perror("mkdtemp");
        return 1;
    }
    size_t n;
    unsigned char *fixture = t_read_file(t_source_path("tests/fixtures/ckpt_tiny.fitlm"), &n);
    snprintf(ckpt_path, sizeof ckpt_path, "%s/%s", dir, ckpt);
    t_write_file(ckpt_path, fixture, n);
    free(fixture);
    const char *subdirs[] = {"mix", "ex", "g2", "mixed"};
    for (int i = 0; i < 4; i++) {
        char sub[1024];
        snprintf(sub, sizeof sub, "%s/%s", dir, subdirs[i]);
        mkdir(sub, 0755);
    }
    write_shards();
    test_loss_is_the_model_apis();
    test_text_equals_tokenized_data();
    test_masked_examples();
    test_truncated_bits_per_byte();
    test_shard_bytes_of_cut_documents();
    test_adapter_is_its_merge();
    test_errors();
    if (t_remove_dir(dir) != 0) fprintf(stderr, "could not remove %s\n", dir);
    return t_report();
}
